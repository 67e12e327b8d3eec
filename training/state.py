"""Saving and restoring a pytree of arrays (a training state) in one directory, apart from any
run-directory layout (training/run_dir.py names and keeps them).

Format: Equinox serialisation (`eqx.tree_serialise_leaves`: one `state.eqx` file, every leaf's
exact bytes, so a resume is bit for bit) plus `meta.json` (the caller's metadata and the file's
SHA-256, so a damaged file is detected). Writing goes to a temporary sibling directory that is
fsynced and renamed into place: a crash never leaves a half-written state under its real name,
and a failed write (a full disk) removes its temporary directory and says what happened.

Restoring reads into a template of the state's shapes and dtypes (`eqx.filter_eval_shape` /
`jax.eval_shape` leaves: nothing is initialised to be overwritten) and places each array in the
`Placement`'s shardings. One process writes the whole state (it gathers sharded arrays): a
multi-host run needs per-process shards (orbax), not this module.
"""

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from shard import Placement

STATE, META = "state.eqx", "meta.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_state(directory: str | Path, tree: PyTree, meta: dict[str, Any]) -> Path:
    """Write `tree` (arrays, possibly sharded) and `meta` (JSON-ready) to `directory`
    atomically, replacing a state already there."""
    final = Path(directory)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        state = tmp / STATE
        eqx.tree_serialise_leaves(state, jax.device_get(tree))
        (tmp / META).write_text(json.dumps({**meta, "sha256": sha256(state)}, indent=1))
        for f in (state, tmp / META):
            with f.open("rb") as handle:
                os.fsync(handle.fileno())
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if error.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"no space left on the disk holding {final.parent} while writing a checkpoint; "
                "free some space (or lower --keep) and resume from the last complete checkpoint",
            ) from error
        raise
    return final


class CorruptState(ValueError):
    """A state directory that cannot be read back as it was written."""


def read_meta(directory: str | Path) -> dict[str, Any]:
    """`meta.json` of a state directory, after checking `state.eqx` against its SHA-256."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / META).read_text())
        expected = meta["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CorruptState(f"{directory}: unreadable {META}: {error}") from error
    state = directory / STATE
    if not state.is_file() or sha256(state) != expected:
        raise CorruptState(f"{directory}: {STATE} is missing or does not match its SHA-256")
    return meta


def restore_state(
    directory: str | Path,
    template: PyTree,
    *,
    placement: Placement | None = None,
    shardings: PyTree = None,
) -> PyTree:
    """The state saved in `directory`, read into `template`'s structure (abstract leaves are
    fine) and put on the device(s) (in `shardings` under a sharded `placement`). Reads a prefix
    when `template` covers only the first subtrees of what was saved."""
    directory = Path(directory)
    try:
        host = eqx.tree_deserialise_leaves(directory / STATE, template)
    except Exception as error:
        raise CorruptState(f"{directory}: cannot read {STATE}: {error}") from error
    host = jax.tree.map(np.asarray, host)
    return (placement or Placement()).put(host, shardings)
