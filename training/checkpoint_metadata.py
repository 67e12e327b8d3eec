"""What the zoo reads from the metadata files of an orbax step directory, declared, with
everything else refused (as zoo's HF config `READS`/`ONLY` does for config.json): a checkpoint
is a file format that strangers' files can imitate, so a malformed or unexpected one is an error
naming the file, before anything is restored, written or deleted.

- `_CHECKPOINT_METADATA` (orbax's step metadata): read by orbax itself, by the CheckpointManager
  of every writer that opens the steps' root (a resumed run's first save). Checked with orbax's
  own deserializer, so a malformed one is named when the run starts, not deep inside a save
  after hours of training.
- `sha256.json` (training/state.py writes it once a step is finalized): a JSON object mapping
  each file of the step, by its path inside the step (relative, no `..`), to its SHA-256 (64
  lowercase hex digits); it names exactly the step's files: a missing one or one added since
  is refused, as is an empty record (which would check nothing).
- `meta/metadata` (the `meta` item, orbax's JSON handler): a run's `META_READS`, each of its
  JSON type, `step` and `data_position` counts, `param_dtype` a dtype the Policy takes; no
  other field.
"""

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any, get_args

from zoo.json_file import field
from zoo.policy import DType

# A run checkpoint's meta/ (training/run_dir.py writes it): field -> JSON type.
META_READS: dict[str, type] = {
    "step": int,
    "data_position": int,
    "config": dict,
    "param_dtype": str,
}
META_FILE = "meta/metadata"  # where orbax's JSON handler keeps the `meta` item
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not readable JSON ({error})") from error


def check_step_metadata(path: Path) -> None:
    """A ValueError naming `path` unless orbax's deserializer reads it as step metadata."""
    from orbax.checkpoint._src.metadata import step_metadata_serialization

    value = _json(path)
    try:
        step_metadata_serialization.deserialize(value)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path} is not orbax step metadata ({error})") from error


def read_checksums(path: Path, files: list[str]) -> dict[str, str]:
    """The record at `path` (file -> SHA-256) of a step holding `files` (paths inside it); a
    ValueError naming `path` unless it is an object of well-formed entries for exactly those
    files."""
    record = _json(path)
    if not isinstance(record, dict) or not record:
        raise ValueError(
            f"{path} holds {record!r:.60}, not an object mapping each file of the step to its "
            "SHA-256"
        )
    for name, digest in record.items():
        parts = PurePosixPath(name).parts
        if PurePosixPath(name).is_absolute() or ".." in parts or str(PurePosixPath(name)) != name:
            raise ValueError(f"{path} names {name!r}, which is not a path inside the step")
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise ValueError(f"{path}: the SHA-256 of {name!r} is {digest!r}, not 64 hex digits")
    missing = sorted(set(record) - set(files))
    if missing:
        raise ValueError(
            f"{path.parent}: {len(missing)} of its {len(record)} files are missing (e.g. "
            f"{missing[0]}, recorded in {path.name})"
        )
    added = sorted(set(files) - set(record))
    if added:
        raise ValueError(
            f"{len(added)} files are not in {path} (e.g. {added[0]}): added after the step was "
            f"written; remove them (or remove {path.name} to read the step unchecked, with a "
            "warning)"
        )
    return record


def check_run_meta(meta: Any, path: str) -> dict[str, Any]:
    """A run checkpoint's meta (read from `path`), checked against `META_READS`."""
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a JSON {type(meta).__name__}, not the run's object")
    unknown = sorted(set(meta) - set(META_READS))
    if unknown:
        raise ValueError(
            f"{path} holds fields the zoo does not write: {unknown} (a checkpoint's meta holds "
            f"{', '.join(META_READS)} only)"
        )
    for name, kind in META_READS.items():
        field(meta, name, kind, path)
    for name in ("step", "data_position"):
        if meta[name] < 0:
            raise ValueError(f"{path}: {name!r} is {meta[name]}, a count (>= 0)")
    if meta["param_dtype"] not in get_args(DType):
        raise ValueError(
            f"{path}: 'param_dtype' is {meta['param_dtype']!r}; the Policy takes "
            f"{', '.join(map(repr, get_args(DType)))}"
        )
    return meta
