"""The pipeline transformers gives a tokenizer.json, by the tokenizer class it picks for it.

transformers 5 uses a tokenizer.json as written for its generic fast tokenizer, but for a class
with a pipeline of its own (`LlamaTokenizer`, `GemmaTokenizer`, `GPT2Tokenizer`,
`Qwen2Tokenizer`: the classes of the families the zoo loads) it keeps the file's vocabulary,
merges, added tokens and post-processor and rebuilds the normalizer, pre-tokenizer and decoder
from the class and tokenizer_config.json (`legacy`, `add_prefix_space`). Which class it picks
depends on the class tokenizer_config.json declares and on config.json's model type
(`picked_class`: AutoTokenizer's rules for these families). `pipeline_for` does the same, so
that the ids are transformers'.
"""

import json
from pathlib import Path

from zoo.tokenizer.bpe import QWEN2_PATTERN
from zoo.tokenizer.sentencepiece import SPACE

# transformers' TOKENIZER_MAPPING_NAMES for the model types of the zoo's families (None: its
# generic fast tokenizer); the types it lists no class for (llama, deepseek) are absent.
MODEL_TYPE_CLASSES = {
    "mistral": None,
    "mixtral": None,
    "phi3": None,
    "gemma": "GemmaTokenizer",
    "gemma2": "GemmaTokenizer",
    "gemma3": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
    "gpt2": "GPT2Tokenizer",
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "qwen3_moe": "Qwen2Tokenizer",
}
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS among them: their model type's class
# wins over the one the hub's tokenizer_config.json declares.
WRONG_HUB_CLASS = frozenset({"phi3", "qwen2"})
REBUILT = ("LlamaTokenizer", "GemmaTokenizer", "GPT2Tokenizer", "Qwen2Tokenizer")


def picked_class(declared: str | None, model_type: str | None, byte_level: bool) -> str | None:
    """The class AutoTokenizer loads for tokenizer_config.json's `declared` class, config.json's
    `model_type` and whether tokenizer.json is byte-level; None for the generic one."""
    declared = declared.removesuffix("Fast") if isinstance(declared, str) else None
    if declared is None:
        return None
    if declared == "LlamaTokenizer" and byte_level and model_type not in WRONG_HUB_CLASS:
        return None  # a Llama class over a byte-level file (Llama 3): the file as written
    if model_type in MODEL_TYPE_CLASSES and MODEL_TYPE_CLASSES[model_type] != declared:
        registered = MODEL_TYPE_CLASSES[model_type]
        if registered is None:
            return None
        return registered if model_type in WRONG_HUB_CLASS else declared
    return declared


def _prepend_scheme(add_prefix_space: bool, legacy: bool) -> str:
    """transformers' `_get_prepend_scheme`."""
    if not add_prefix_space:
        return "never"
    return "always" if legacy else "first"


def _rebuild(backend, model, *, normalizer, pre_tokenizer, decoder):
    """A tokenizer of `model` and the given pipeline, with `backend`'s added tokens and
    post-processor (as transformers carries them over)."""
    from tokenizers import Tokenizer

    rebuilt = Tokenizer(model)
    rebuilt.normalizer, rebuilt.pre_tokenizer, rebuilt.decoder = normalizer, pre_tokenizer, decoder
    rebuilt.post_processor = backend.post_processor
    added = backend.get_added_tokens_decoder()
    for i in sorted(added):  # one at a time, in id order, so that each keeps its id
        token = added[i]
        (rebuilt.add_special_tokens if token.special else rebuilt.add_tokens)([token])
    return rebuilt


def pipeline_for(backend, tokenizer_json: Path, config: dict, model_type: str | None):
    """`backend` (read from `tokenizer_json`) with the pipeline transformers gives the class it
    picks (`picked_class`) from tokenizer_config.json (`config`) and config.json's
    `model_type`; as it is for the generic class or any other."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

    text = tokenizer_json.read_text(encoding="utf-8")
    name = picked_class(config.get("tokenizer_class"), model_type, '"ByteLevel"' in text)
    if name not in REBUILT:
        return backend
    spec = json.loads(text)["model"]
    if spec.get("type") != "BPE":
        return backend
    vocab, merges = spec["vocab"], [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
                                    for m in spec.get("merges", [])]  # fmt: skip
    unk = config.get("unk_token")
    unk = unk.get("content") if isinstance(unk, dict) else unk
    if name == "LlamaTokenizer":
        prefix = config.get("add_prefix_space")
        prefix = True if prefix is None else prefix
        scheme = _prepend_scheme(prefix, config.get("legacy", False))
        steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        return _rebuild(
            backend,
            models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True),
            normalizer=None,
            pre_tokenizer=pre_tokenizers.Metaspace(SPACE, prepend_scheme=scheme, split=False),
            decoder=decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps),
        )
    if name == "GemmaTokenizer":
        return _rebuild(
            backend,
            models.BPE(
                vocab=vocab,
                merges=merges,
                fuse_unk=True,
                unk_token=unk or "<unk>",
                byte_fallback=True,
            ),
            normalizer=normalizers.Replace(" ", SPACE),
            pre_tokenizer=pre_tokenizers.Split(" ", behavior="merged_with_previous"),
            decoder=decoders.Sequence(
                [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            ),
        )
    prefix = bool(config.get("add_prefix_space") or False)
    model = models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="",
                       end_of_word_suffix="", fuse_unk=False)  # fmt: skip
    if name == "GPT2Tokenizer":
        return _rebuild(
            backend, model, normalizer=None,
            pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=prefix),
            decoder=decoders.ByteLevel(),
        )  # fmt: skip
    return _rebuild(
        backend, model, normalizer=normalizers.NFC(),
        pre_tokenizer=pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False),
        ]),
        decoder=decoders.ByteLevel(),
    )  # fmt: skip
