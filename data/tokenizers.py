"""Tokenizers as `tiktoken.Encoding` objects: OpenAI encodings by name, or a byte-level BPE
(Sennrich et al. 2016; GPT-2's byte-level variant, Radford et al. 2019) trained on a local corpus
and stored in tiktoken's rank-file format (one `base64(token) rank` line per token).

Training uses HF `tokenizers` (a well-kept Rust BPE trainer, minutes faster than pure Python);
encoding and decoding use tiktoken, so every tokenizer in the project has one interface.
The special token `<|endoftext|>` gets the id after the last rank and separates documents.
"""

import base64
import hashlib
from collections.abc import Iterable
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from zoo.tokenizer.bpe import GPT2_PATTERN, byte_decoder

EOT = "<|endoftext|>"
OPENAI_ENCODINGS = ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base")


def openai_encoding(name: str) -> tiktoken.Encoding:
    """An OpenAI encoding by name; needs the network once, or its file in `TIKTOKEN_CACHE_DIR`."""
    try:
        return tiktoken.get_encoding(name)
    except Exception as error:
        raise ValueError(
            f"could not load tiktoken encoding {name!r} ({error}); it is downloaded on first use, "
            "so go online once or point TIKTOKEN_CACHE_DIR at a directory holding its file"
        ) from error


def train_bpe(texts: Iterable[str], vocab_size: int, *, name: str = "bpe") -> tiktoken.Encoding:
    """Train a byte-level BPE with `vocab_size` tokens in all (256 bytes + merges + EOT)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size} must be >= 257 (256 bytes + {EOT})")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    to_byte = byte_decoder()
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    # HF ids put the 256 bytes first and then merges in the order learned: the same priority
    # tiktoken uses (lowest rank merges first), so the ids can be the ranks.
    ranks = {bytes(to_byte[c] for c in token): rank for rank, (token, _) in enumerate(vocab)}
    return from_ranks(ranks, name=name)


def from_ranks(ranks: dict[bytes, int], *, name: str) -> tiktoken.Encoding:
    """A tiktoken encoding from BPE ranks, with `<|endoftext|>` right after the last rank."""
    return tiktoken.Encoding(
        name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: len(ranks)}
    )


def save_ranks(encoding: tiktoken.Encoding, path: str | Path) -> None:
    """Write the encoding's ranks in tiktoken's rank-file format (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = encoding._mergeable_ranks
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items())
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(lines))
    tmp.rename(path)


def load_ranks(path: str | Path) -> tiktoken.Encoding:
    """Load a rank file written by `save_ranks` (or any tiktoken `.tiktoken` file)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"tokenizer file {str(path)!r} does not exist")
    return from_ranks(load_tiktoken_bpe(str(path)), name=path.stem)


def eot_id(encoding: tiktoken.Encoding) -> int:
    """Id of the document separator: `<|endoftext|>`, which every encoding here has."""
    return encoding.eot_token


def cached_bpe(
    texts: list[str], vocab_size: int, cache_dir: str | Path, *, log=print
) -> tiktoken.Encoding:
    """A BPE trained on `texts`, cached under `cache_dir` by a hash of the texts and vocab size,
    so a second run on the same corpus loads it instead of training again."""
    digest = hashlib.sha256(str(vocab_size).encode())
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    path = Path(cache_dir) / f"bpe-{vocab_size}-{digest.hexdigest()[:16]}.tiktoken"
    if path.is_file():
        log(f"tokenizer: loaded cached BPE {path}")
        return load_ranks(path)
    encoding = train_bpe(texts, vocab_size, name=path.stem)
    save_ranks(encoding, path)
    log(f"tokenizer: trained a {vocab_size}-token byte-level BPE, saved to {path}")
    return encoding


def get_tokenizer(
    spec: str, *, texts: list[str], vocab_size: int, cache_dir: str | Path, log=print
) -> tiktoken.Encoding:
    """`spec` is "bpe" (train on `texts`, cached), an OpenAI encoding name, or a rank-file path."""
    if spec == "bpe":
        return cached_bpe(texts, vocab_size, cache_dir, log=log)
    if spec in OPENAI_ENCODINGS:
        return openai_encoding(spec)
    if Path(spec).suffix == ".tiktoken" or Path(spec).is_file():
        return load_ranks(spec)
    raise ValueError(
        f"--tokenizer {spec!r} is not 'bpe', an OpenAI encoding {OPENAI_ENCODINGS}, "
        "or an existing .tiktoken rank file"
    )
