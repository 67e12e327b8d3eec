"""The embedded default corpus: the Python standard library's own `.py` source files, tens of MB
of real text on every machine that has Python, so `python train.py` needs no download.

The files are written once as a JSON-lines file (one `{"text": ...}` document per source file)
and then loaded through `datasets` like any other local corpus.
"""

import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path


def stdlib_files(max_bytes: int) -> list[Path]:
    """Up to `max_bytes` of stdlib source files, in an order that mixes packages (sorted by a hash
    of the relative path, so it is the same on every run and not all `asyncio/` first)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for directory, _, names in os.walk(root):
        if "site-packages" in directory or "dist-packages" in directory:
            continue
        files += [Path(directory) / n for n in names if n.endswith(".py")]

    def order(path: Path) -> str:
        return hashlib.sha256(str(path.relative_to(root)).encode()).hexdigest()

    chosen, total = [], 0
    for path in sorted(files, key=order):
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    return chosen


def write_stdlib_corpus(cache_dir: str | Path, max_bytes: int = 6_000_000) -> Path:
    """Write (once) the stdlib corpus as JSON lines under `cache_dir`; returns the file's path.
    Files that are not valid UTF-8 (a few stdlib tests keep such files on purpose) are skipped."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = Path(cache_dir) / f"stdlib-py{version}-{max_bytes}.jsonl"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as out:
        for source in stdlib_files(max_bytes):
            try:
                text = source.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.write(json.dumps({"text": text}) + "\n")
    tmp.rename(path)
    return path
