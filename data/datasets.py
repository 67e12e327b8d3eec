"""Loading text through HF `datasets`: local files (text/json/jsonl/parquet/csv), a hub name for
users who are online, optional streaming, a named text column, and batched tokenization.

A hub name while offline fails at once with a message that says so, instead of `datasets`'
retry loop (about 20 s without HF_DATASETS_OFFLINE=1).
"""

import os
from pathlib import Path

import datasets
import tiktoken

_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


def is_offline() -> bool:
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def _looks_like_path(spec: str) -> bool:
    """Hub names are `name` or `owner/name`; more slashes or a file suffix mean a path."""
    starts = spec.startswith((".", "/", "~"))
    return starts or Path(spec).suffix in _BUILDERS or spec.count("/") > 1


def load_text(
    spec: str, *, column: str = "text", streaming: bool = False, split: str = "train"
) -> datasets.Dataset | datasets.IterableDataset:
    """A dataset with a `column` of strings, from a local file/directory or a hub name."""
    path = Path(spec).expanduser()
    if path.exists():
        files = (
            sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
        )
        if not files:
            raise ValueError(f"--data {spec!r} holds no {sorted(_BUILDERS)} files")
        suffixes = {p.suffix for p in files}
        builders = {_BUILDERS.get(s) for s in suffixes}
        if None in builders or len(builders) != 1:
            raise ValueError(
                f"--data {spec!r}: cannot load {sorted(suffixes)} together; use one of "
                f"{sorted(_BUILDERS)} (text, json/jsonl, parquet or csv)"
            )
        dataset = datasets.load_dataset(
            builders.pop(), data_files=[str(f) for f in files], split=split, streaming=streaming
        )
    elif _looks_like_path(spec):
        raise ValueError(f"--data {spec!r} does not exist (no such file or directory)")
    elif is_offline():
        raise ValueError(
            f"--data {spec!r} is not a local path, so it would be a Hugging Face hub dataset, but "
            "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set: go online (unset them) or pass a local "
            "text/json/jsonl/parquet/csv file"
        )
    else:
        dataset = datasets.load_dataset(spec, split=split, streaming=streaming)
    names = dataset.column_names
    if names is not None and column not in names:
        raise ValueError(
            f"--data {spec!r} has no text column {column!r}; its columns are {names}: "
            "pass --text-column with one of them"
        )
    return dataset


def tokenize(
    dataset: datasets.Dataset | datasets.IterableDataset,
    encoding: tiktoken.Encoding,
    *,
    column: str = "text",
) -> datasets.Dataset | datasets.IterableDataset:
    """Replace the columns by `ids`: each document's tokens (no EOT; packing adds separators)."""

    def encode(batch: dict) -> dict:
        return {"ids": encoding.encode_ordinary_batch(batch[column])}

    names = dataset.column_names
    return dataset.map(encode, batched=True, remove_columns=names)
