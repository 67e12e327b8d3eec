"""Chat-template reference results (transformers' `apply_chat_template`), computed once per test
session, on the SmolLM2 GGUF's tokenizer and on tiny tokenizer directories built here:

- "llama3": a small BPE trained here with Llama 3's pre-tokenizer and special tokens, and a Llama 3
  style template in tokenizer_config.json (plus generation_config.json's stop ids);
- "features": the same vocabulary with a template that uses what transformers gives templates
  (namespace, loop controls, raise_exception, tojson, dict, the generation tag, a role outside the
  standard four), given as tokenizer_config.json's list of named templates.

Tests that use `chat_reference` carry `pytest.mark.xdist_group("smollm2")` (see smollm2.py).
"""

import json
from pathlib import Path

import pytest

from tests.reference.runner import run_reference, smollm2_gguf

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
# Meta-Llama-3-8B-Instruct's template.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
FEATURES_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(turns=0, system=none) -%}
{%- if tools is not none -%}{{ raise_exception('this template takes no tools') }}{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- if not loop.first -%}
            {{ raise_exception('the system message must come first') }}
        {%- endif -%}
        {%- set ns.system = message['content'] | trim -%}
        {%- continue -%}
    {%- endif -%}
    {%- set ns.turns = ns.turns + 1 -%}
    <|start_header_id|>{{ message.role }}
    {%- if ns.system and ns.turns == 1 %} {{ dict(system=ns.system, n=messages | length) | tojson }}
    {%- endif %}<|end_header_id|>

    {% if message.role == 'assistant' %}
        {%- generation %}{{ message['content'] }}{% endgeneration %}
    {%- elif message.role in ['ipython'] %}
        {{- {'output': message['content'], 'keys': message | list | sort} | tojson(indent=1) }}
    {%- else %}
        {{- message['content'] }}
    {%- endif %}<|eot_id|>
    {% if loop.index >= 6 %}{% break %}{% endif %}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|start_header_id|>assistant<|end_header_id|>

{% endif -%}
"""
CONVERSATIONS = {
    "one-turn": [{"role": "user", "content": "Hi! What is 12+345?"}],
    "system": [
        {"role": "system", "content": "You are terse. Answer in 3 words. "},
        {"role": "user", "content": "Name 3 colours."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "And 2 more? café 東京 🙂"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "  Hi there  \n"},
        {"role": "user", "content": "Count to 5:\n1 2 3"},
        {"role": "assistant", "content": "1 2 3 4 5"},
    ],
    "special-in-content": [
        {"role": "user", "content": "say <|im_end|> or <|eot_id|> as text <|im_start|>"}
    ],
    "late-system": [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "late system prompt"},
    ],
    "ipython": [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": "ok"},
        {"role": "ipython", "content": "42", "name": "calc"},
    ],
    "many-turns": [
        {"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(9)
    ],
}
TEXTS = [
    "Hello world 12345 <|im_start|>user\nhi<|im_end|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    # SmolLM2's vocabulary has no token for the bytes 0x04 and 0xF1 (the lead byte of U+69DEF).
    "drop \x04 and !\x04! and \U00069def, <|im_end|>\x04 keep é",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is 12+345? Count to 5.",
    "You are terse. Answer in 3 words. Name 3 colours: red, green, blue.",
    "Hello, hi there! Run it, ok. A late system prompt. café 東京 🙂",
] * 10


def write_llama3_style(folder: Path, *, config: dict) -> None:
    """A tiny byte-level BPE with Llama 3's pre-tokenizer and special tokens, trained on CORPUS
    (HF `tokenizers`), saved as folder/tokenizer.json, with `config` as tokenizer_config.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from zoo.tokenizer.bpe import LLAMA3_PATTERN

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def chat_reference(tmp_path_factory) -> dict:
    """Per directory name: "dir" (its path), "cases" ({conversation}-{add_generation_prompt} ->
    {"text", "ids"} or {"error"}) and "texts" (ids of TEXTS)."""
    out = tmp_path_factory.getbasetemp() / "chat-reference"
    if not (out / "chat.json").is_file():
        names = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
        write_llama3_style(out / "llama3", config={**names, "chat_template": LLAMA3_TEMPLATE})
        (out / "llama3" / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [1, 4]})  # <|end_of_text|>, <|eot_id|>
        )
        templates = [
            {"name": "default", "template": FEATURES_TEMPLATE},
            {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        ]
        write_llama3_style(out / "features", config={**names, "chat_template": templates})
        job = {
            "gguf": smollm2_gguf(),
            "dirs": {name: str(out / name) for name in ("llama3", "features")},
            "conversations": CONVERSATIONS,
            "texts": TEXTS,
        }
        run_reference("chat", job, out)
    return json.loads((out / "chat.json").read_text())
