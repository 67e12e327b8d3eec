"""`load_tokenizer`: the tokenizer and chat template of an HF directory, a tokenizer.json or a
GGUF file, read without the network.

Where each part comes from (as transformers reads it):

- HF directory: tokenizer.json (vocabulary, merges, pre-tokenizer, added tokens);
  tokenizer_config.json over the legacy special_tokens_map.json (named special tokens such as
  `eos_token`, `additional_special_tokens`, `chat_template`: a string, or a list of named
  templates of which "default" is used); chat_template.jinja, which newer transformers write and
  which wins over tokenizer_config.json's; generation_config.json's `eos_token_id` (stop ids).
- tokenizer.json alone: no named tokens, no template.
- GGUF: `tokenizer.ggml.*` (tokens, merges, token types: control and user-defined tokens are the
  added tokens; bos/eos/unknown/padding ids name the special tokens; eot/eom ids are stop ids)
  and `tokenizer.chat_template`.

Named special tokens are matched whole in text even when the vocabulary also holds them as
ordinary pieces, as transformers adds them to its added tokens.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

from zoo.tokenizer.bpe import GGUF_PATTERNS, build_encoding, pattern_from_hf
from zoo.tokenizer.tokenizer import Tokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the special tokens a chat template sees by name.
NAMED_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_GGUF_NAMED = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_GGUF_STOPS = ("eot_token_id", "eom_token_id")  # llama.cpp's end of turn / end of message
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4  # llama.cpp token types that are not BPE pieces
_HOW_TO_PASS = "zoo.load_tokenizer(path, chat_template='file.jinja')"


def load_tokenizer(path: str | Path, *, chat_template: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint: an HF directory, a tokenizer.json file or a .gguf file.

    `chat_template` replaces the checkpoint's template (or gives one to a checkpoint without):
    a `Path` or a string naming a file (read as UTF-8), or a string holding Jinja (`{{` or `{%`)
    used as the template itself. Only byte-level BPE vocabularies load (GPT-2, Llama 3, SmolLM2);
    anything tiktoken would encode differently from HF is refused with the reason.
    """
    source = None
    if chat_template is not None:  # checked first: a bad template fails before the slow part
        from zoo.tokenizer.chat import compile_template

        source = read_chat_template(chat_template)
        compile_template(source)
    path = Path(path)
    if path.suffix == ".gguf":
        tokenizer = _from_gguf(path)
    elif path.is_dir():
        tokenizer = _from_hf_directory(path)
    elif path.suffix == ".json" and path.is_file():
        tokenizer = _from_tokenizer_json(
            path, config={}, chat_template=None, stop_ids=(), source=str(path)
        )
    else:
        raise ValueError(
            f"{str(path)!r} is not a tokenizer: pass an HF directory (with tokenizer.json), a "
            "tokenizer.json file or a .gguf file"
        )
    if source is not None:
        tokenizer = dataclasses.replace(tokenizer, chat_template=source)
    return tokenizer


def read_chat_template(template: str | Path) -> str:
    """The Jinja source `template` gives: its text if it holds Jinja, else the file it names."""
    if isinstance(template, str) and ("{{" in template or "{%" in template):
        return template
    try:
        source = Path(template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"cannot read the chat template file {str(template)!r} ({e}); pass a readable "
            "UTF-8 .jinja file, or the template text itself"
        ) from e
    if not source.strip():
        raise ValueError(f"the chat template file {str(template)!r} is empty")
    return source


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}): is it valid JSON?") from e


def _content(token: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _extra_tokens(config: dict) -> list[str]:
    """additional_special_tokens / extra_special_tokens: lists, or (v5) dicts of name -> token."""
    tokens = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key) or []
        tokens += [_content(t) for t in (value.values() if isinstance(value, dict) else value)]
    return [t for t in tokens if isinstance(t, str)]


def _config_template(value: Any, where: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or [{name, template}, ...] ("default")."""
    if value is None or isinstance(value, str):
        return value
    templates = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if isinstance(templates.get("default"), str):
        return templates["default"]
    raise ValueError(
        f"{where}: chat_template lists templates {sorted(map(str, templates))} but no 'default'; "
        f"pass the one to use: {_HOW_TO_PASS}"
    )


def _stop_ids(value: Any) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(int(i) for i in ids)


def _from_hf_directory(folder: Path) -> Tokenizer:
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(
            f"{str(folder)!r} has no tokenizer.json (only byte-level BPE tokenizers in "
            "tokenizer.json load; a SentencePiece tokenizer.model does not)"
        )
    config = _read_json(folder / "special_tokens_map.json") | _read_json(
        folder / "tokenizer_config.json"
    )
    template = _config_template(config.get("chat_template"), folder / "tokenizer_config.json")
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        template = read_chat_template(jinja_file)
    generation = _read_json(folder / "generation_config.json")
    return _from_tokenizer_json(
        tokenizer_json,
        config=config,
        chat_template=template,
        stop_ids=_stop_ids(generation.get("eos_token_id")),
        source=str(folder),
    )


def _from_tokenizer_json(
    path: Path,
    *,
    config: dict,
    chat_template: str | None,
    stop_ids: tuple[int, ...],
    source: str,
) -> Tokenizer:
    spec = _read_json(path)
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ValueError(
            f"{path}: model type {model.get('type')!r} (byte_fallback={model.get('byte_fallback')})"
            " is not byte-level BPE; only byte-level BPE converts to tiktoken"
        )
    if spec.get("normalizer") is not None:
        raise ValueError(f"{path}: a normalizer ({spec['normalizer']['type']}) is not supported")
    added = {}
    for token in spec.get("added_tokens", []):
        for flag in ("lstrip", "rstrip", "single_word"):
            if token.get(flag):
                raise ValueError(
                    f"{path}: added token {token['content']!r} has {flag}=true, which tiktoken "
                    "cannot reproduce (it matches added tokens exactly); not supported"
                )
        added[token["content"]] = token["id"]
    vocab = model["vocab"]
    named = {name: _content(config[name]) for name in NAMED_TOKENS if config.get(name)}
    special = dict(added)
    for token in [*named.values(), *_extra_tokens(config)]:
        if token not in special:
            if token not in vocab:
                raise ValueError(
                    f"{source}: tokenizer_config.json names the special token {token!r}, "
                    "which is neither an added token nor in the vocabulary"
                )
            special[token] = vocab[token]
    encoding = build_encoding(
        path.parent.name or path.stem,
        vocab=vocab,
        merges=model.get("merges", []),
        added=added,
        special=special,
        pat_str=pattern_from_hf(spec.get("pre_tokenizer")),
    )
    return Tokenizer(
        encoding=encoding,
        special_tokens=special,
        named_tokens=named,
        chat_template=chat_template,
        stop_ids=stop_ids,
        source=source,
    )


def _from_gguf(path: Path) -> Tokenizer:
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    from zoo.pretrained.gguf import metadata, open_gguf

    reader = open_gguf(str(path))
    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' (BPE)")
    pre = metadata(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in GGUF_PATTERNS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(GGUF_PATTERNS)}"
        )
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type")
    not_bpe = (_GGUF_CONTROL, _GGUF_USER_DEFINED)
    added = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k in not_bpe}

    def token_id(key: str) -> int | None:
        value = metadata(reader, f"tokenizer.ggml.{key}", -1)
        return value if 0 <= value < len(tokens) else None

    named_ids = {name: i for name, key in _GGUF_NAMED.items() if (i := token_id(key)) is not None}
    named = {name: tokens[i] for name, i in named_ids.items()}
    special = added | {tokens[i]: i for i in named_ids.values() if tokens[i] not in added}
    encoding = build_encoding(
        path.stem,
        vocab={t: i for i, t in enumerate(tokens)},
        merges=metadata(reader, "tokenizer.ggml.merges"),
        added=added,
        special=special,
        pat_str=GGUF_PATTERNS[pre],
    )
    template = metadata(reader, "tokenizer.chat_template", "") or None
    return Tokenizer(
        encoding=encoding,
        special_tokens=special,
        named_tokens=named,
        chat_template=template,
        stop_ids=tuple(i for key in _GGUF_STOPS if (i := token_id(key)) is not None),
        source=str(path),
    )
