"""Tiny checkpoints of the families a first day meets (Gemma 2, Gemma 3, Mistral, Phi-3), as a
user downloads them: a random model and a tokenizer built by the family's own transformers class
(from a SentencePiece-style vocabulary trained here with HF `tokenizers` on the standard library's
source) with the family's chat template, saved by transformers; and transformers' reference
numbers for them and for directories eqx-zoo writes (hf_reference.py `first_day`, `export`).
"""

import json
from pathlib import Path

import pytest

from tests.reference.runner import run_reference
from tests.reference.tokenizer_families import sentencepiece_vocab

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<eos>", "<bos>", "<mask>"]
LAYERS = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 512}  # fmt: skip
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ m['content'] }}{{ eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]{% endif %}"
    "{% endfor %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
GEMMA_TURNS = ["<start_of_turn>", "<end_of_turn>"]
MODELS = [
    {"name": "gemma2", "model_type": "gemma2", "tokenizer": "gemma", "template": GEMMA_TEMPLATE,
     "turn_tokens": GEMMA_TURNS, "eos_token": "<eos>",
     "config": {**LAYERS, "sliding_window": 8, "layer_types": ["sliding_attention",
                "full_attention"], "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}},
    {"name": "gemma3", "model_type": "gemma3_text", "tokenizer": "gemma",
     "template": GEMMA_TEMPLATE, "turn_tokens": GEMMA_TURNS, "eos_token": "<eos>",
     "config": {**LAYERS, "sliding_window": 8, "layer_types": ["sliding_attention",
                "full_attention"], "query_pre_attn_scalar": 16}},
    {"name": "mistral", "model_type": "mistral", "tokenizer": "llama",
     "template": MISTRAL_TEMPLATE, "turn_tokens": [], "config": {**LAYERS, "sliding_window": 8}},
    {"name": "phi3", "model_type": "phi3", "tokenizer": "phi3", "template": PHI3_TEMPLATE,
     "turn_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
     "config": {**{k: v for k, v in LAYERS.items() if k != "head_dim"},
                "original_max_position_embeddings": 512, "sliding_window": None}},
]  # fmt: skip
TEXTS = [
    "Hello world",
    " leading space and  two",
    "What is the capital of Quillmora? Tessaly Harbour, 12 km.",
    "café 東京 🙂",
    "<start_of_turn>user\nHi<end_of_turn> <|end|> </s>",
]
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of Quillmora?"},
]
NEW_TOKENS = 8


@pytest.fixture(scope="session")
def first_day_reference(tmp_path_factory) -> dict:
    """{"dir": out, NAME: {"path", "texts", "chat", "logits", "greedy", "eos"}} for MODELS."""
    out = tmp_path_factory.getbasetemp() / "first-day"
    if not (out / "export.json").is_file():
        pieces, _, merges = sentencepiece_vocab(SPECIALS)
        job = {
            "vocab": {"tokens": pieces, "merges": merges},
            "models": MODELS,
            "texts": TEXTS,
            "conversation": CONVERSATION,
            "new_tokens": NEW_TOKENS,
        }
        run_reference("first_day", job, out)
    results = json.loads((out / "export.json").read_text())
    return {"dir": out} | {Path(path).name: {"path": path, **r} for path, r in results.items()}


def export_reference(dirs: list[Path], out: Path) -> dict:
    """transformers' measurements (hf_reference.py `export`) of directories eqx-zoo wrote."""
    job = {"dirs": [str(d) for d in dirs], "texts": TEXTS, "conversation": CONVERSATION,
           "new_tokens": NEW_TOKENS}  # fmt: skip
    run_reference("export", job, out)
    return json.loads((out / "export.json").read_text())
