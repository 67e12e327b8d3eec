"""`load_tokenizer`: the tokenizer and chat template of an HF directory, a tokenizer.json, a
GGUF file or a tiktoken rank file, read without the network; HF `tokenizers` does the encoding.

Where each part comes from (as transformers reads it):

- HF directory: tokenizer.json (vocabulary, merges, pre-tokenizer, added tokens);
  tokenizer_config.json over the legacy special_tokens_map.json (named special tokens such as
  `eos_token`, `additional_special_tokens`, `chat_template`: a string, or a list of named
  templates of which "default" is used); chat_template.jinja, which newer transformers write and
  which wins over tokenizer_config.json's; generation_config.json's `eos_token_id` (stop ids).
- tokenizer.json alone: no named tokens, no template.
- GGUF: `tokenizer.ggml.*` (tokens, merges, scores, token types: control tokens are the special
  added tokens, user-defined ones plain added tokens; bos/eos/unknown/padding ids name the special
  tokens; eot/eom ids are stop ids) and `tokenizer.chat_template`. Both of llama.cpp's BPE kinds:
  "gpt2" (byte-level: zoo/tokenizer/bpe.py) and "llama" (SentencePiece-style with byte fallback:
  zoo/tokenizer/sentencepiece.py), built as transformers builds them from the same metadata.
- tiktoken: a `.tiktoken` rank file (a BPE train.py trained) or a `tiktoken.Encoding`
  (`from_tiktoken`): vocabulary and merges recovered from the ranks, no named tokens.

A tokenizer.json gets the pipeline transformers gives the tokenizer class tokenizer_config.json
names (as written for a generic class; rebuilt from the class for Llama, Gemma, GPT-2 and Qwen2's
own: zoo/tokenizer/classes.py), so that the ids are transformers'.

Named special tokens are matched whole in text even when the vocabulary also holds them as
ordinary pieces, as transformers adds them to its added tokens.
"""

import dataclasses
import json
from pathlib import Path
from typing import Any

from zoo.tokenizer.bpe import GGUF_PATTERNS, byte_encoder, byte_level, from_ranks, spell
from zoo.tokenizer.classes import pipeline_for
from zoo.tokenizer.sentencepiece import sentencepiece_bpe
from zoo.tokenizer.tokenizer import ENDOFTEXT, Tokenizer

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
# llama.cpp architectures whose SentencePiece vocabulary needs its own pipeline.
_SENTENCEPIECE_FAMILIES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}
_HOW_TO_PASS = "zoo.load_tokenizer(path, chat_template='file.jinja')"


def load_tokenizer(path: str | Path, *, chat_template: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint: an HF directory, a tokenizer.json file, a .gguf file or a
    .tiktoken rank file.

    `chat_template` replaces the checkpoint's template (or gives one to a checkpoint without):
    a `Path` or a string naming a file (read as UTF-8), or a string holding Jinja (`{{` or `{%`)
    used as the template itself.
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
            path, config={}, chat_template=None, eos_ids=(), source=str(path)
        )
    elif path.suffix == ".tiktoken" and path.is_file():
        from tiktoken.load import load_tiktoken_bpe

        from zoo.tokenizer.bpe import GPT2_PATTERN

        ranks = load_tiktoken_bpe(str(path))
        tokenizer = from_tiktoken_ranks(ranks, GPT2_PATTERN, {ENDOFTEXT: len(ranks)}, str(path))
    else:
        raise ValueError(
            f"{str(path)!r} is not a tokenizer: pass an HF directory (with tokenizer.json), a "
            "tokenizer.json file, a .gguf file or a .tiktoken rank file"
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


def _eos_ids(value: Any) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(int(i) for i in ids)


def _from_hf_directory(folder: Path) -> Tokenizer:
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        also = (
            " (a SentencePiece tokenizer.model is there alone)"
            if (folder / "tokenizer.model").is_file()
            else ""
        )
        raise ValueError(
            f"{str(folder)!r} has no tokenizer.json{also}; write one with transformers: "
            "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
        )
    config = _read_json(folder / "special_tokens_map.json") | _read_json(
        folder / "tokenizer_config.json"
    )
    template = _config_template(config.get("chat_template"), folder / "tokenizer_config.json")
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        template = read_chat_template(jinja_file)
    generation = _read_json(folder / "generation_config.json")
    model_type = _read_json(folder / "config.json").get("model_type")
    return _from_tokenizer_json(
        tokenizer_json,
        config=config,
        chat_template=template,
        eos_ids=_eos_ids(generation.get("eos_token_id")),
        source=str(folder),
        model_type=model_type,
    )


def _with_special(backend, special: dict[str, int], source: str) -> dict[str, int]:
    """`special` (string -> id) made special added tokens of `backend` (matched whole in any
    text, as transformers matches the named special tokens); each must keep its id."""
    from tokenizers import AddedToken

    added = [AddedToken(t, special=True, normalized=False) for t in special]
    backend.add_special_tokens(added)
    vocab = backend.get_vocab(with_added_tokens=True)
    moved = {t: (i, vocab.get(t)) for t, i in special.items() if vocab.get(t) != i}
    if moved:
        raise ValueError(f"{source}: special tokens {moved} (id, id in the vocabulary) disagree")
    return special


def _from_tokenizer_json(
    path: Path,
    *,
    config: dict,
    chat_template: str | None,
    eos_ids: tuple[int, ...],
    source: str,
    model_type: str | None = None,
) -> Tokenizer:
    """A tokenizer.json with tokenizer_config.json's `config`, the pipeline transformers gives
    the class it names (zoo/tokenizer/classes.py)."""
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(
            f"{path} is not a tokenizer.json the tokenizers library reads ({e})"
        ) from e
    backend = pipeline_for(backend, path, config, model_type)
    vocab = backend.get_vocab(with_added_tokens=True)
    added = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
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
    return Tokenizer(
        backend=backend,
        special_tokens=_with_special(backend, special, source),
        named_tokens=named,
        chat_template=chat_template,
        eos_ids=eos_ids,
        source=source,
    )


def from_tiktoken_ranks(
    ranks: dict[bytes, int], pattern: str, special: dict[str, int], source: str
) -> Tokenizer:
    """A `Tokenizer` equal to the tiktoken encoding of `ranks`, `pattern` and `special` (string
    -> id): a BPE train.py trained, or an OpenAI encoding. No named tokens, no template."""
    vocab, merges = from_ranks(ranks, pattern)
    backend = byte_level(vocab, merges, pattern)
    return Tokenizer(
        backend=backend,
        special_tokens=_with_special(backend, dict(special), source),
        named_tokens={},
        source=source,
    )


def from_tiktoken(encoding) -> Tokenizer:
    """`from_tiktoken_ranks` of a `tiktoken.Encoding` (its ranks, regex and special tokens)."""
    # tiktoken keeps these private; they are what the encoding is made of.
    return from_tiktoken_ranks(
        encoding._mergeable_ranks, encoding._pat_str, encoding._special_tokens, encoding.name
    )


def _gguf_backend(reader, tokens: list[str], types: list[int], source: str):
    """(backend, added tokens: string -> (id, special)) of a GGUF vocabulary of either kind."""
    from zoo.pretrained.gguf import metadata

    kind = metadata(reader, "tokenizer.ggml.model")
    merges = metadata(reader, "tokenizer.ggml.merges", []) or None
    if kind == "gpt2":
        pre = metadata(reader, "tokenizer.ggml.pre", "gpt2")
        if pre not in GGUF_PATTERNS:
            raise ValueError(
                f"{source}: GGUF pre-tokenizer {pre!r} is not supported; known: "
                f"{', '.join(GGUF_PATTERNS)}"
            )
        alphabet = set(byte_encoder().values())
        # transformers' spelling: a piece outside the byte alphabet is spelled byte by byte.
        spelled = [t if set(t) <= alphabet else spell(t.encode()) for t in tokens]
        backend = byte_level(
            {t: i for i, t in enumerate(spelled)}, merges or [], GGUF_PATTERNS[pre]
        )
        # A "control" token outside the byte alphabet is a mislabelled piece (as transformers).
        control = lambda i: set(tokens[i]) <= alphabet  # noqa: E731
    elif kind == "llama":
        arch = metadata(reader, "general.architecture", "llama")
        unk = metadata(reader, "tokenizer.ggml.unknown_token_id", -1)
        backend = sentencepiece_bpe(
            tokens,
            metadata(reader, "tokenizer.ggml.scores", []) or None,
            merges,
            unk=tokens[unk] if 0 <= unk < len(tokens) else None,
            family=_SENTENCEPIECE_FAMILIES.get(arch, "llama"),
        )
        control = lambda i: True  # noqa: E731
    else:
        raise ValueError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported; known: 'gpt2' "
            "(byte-level BPE) and 'llama' (SentencePiece-style BPE)"
        )
    from tokenizers import AddedToken

    vocab = backend.get_vocab()
    specials = [i for i, k in enumerate(types) if k == _GGUF_CONTROL and control(i)]
    plain = [i for i, k in enumerate(types) if k == _GGUF_USER_DEFINED and tokens[i] in vocab]
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in specials]
    )
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in plain])
    return backend, {tokens[i]: i for i in specials}


def _from_gguf(path: Path) -> Tokenizer:
    if not path.is_file():
        raise ValueError(f"GGUF file {str(path)!r} does not exist")
    from zoo.pretrained.gguf import metadata, open_gguf

    reader = open_gguf(str(path))
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type", []) or [1] * len(tokens)
    backend, added = _gguf_backend(reader, tokens, types, str(path))

    def token_id(key: str) -> int | None:
        value = metadata(reader, f"tokenizer.ggml.{key}", -1)
        return value if 0 <= value < len(tokens) else None

    named_ids = {name: i for name, key in _GGUF_NAMED.items() if (i := token_id(key)) is not None}
    named = {name: tokens[i] for name, i in named_ids.items()}
    special = added | {tokens[i]: i for i in named_ids.values()}
    template = metadata(reader, "tokenizer.chat_template", "") or None
    return Tokenizer(
        backend=backend,
        special_tokens=_with_special(backend, special, str(path)),
        named_tokens=named,
        chat_template=template,
        eos_ids=tuple(i for key in _GGUF_STOPS if (i := token_id(key)) is not None),
        source=str(path),
    )
