"""Checkpoints: model parameters, optimizer state, step, data position and RNG key.

Format: Equinox serialisation (`eqx.tree_serialise_leaves`, one `.eqx` file of numpy arrays)
plus a `meta.json`. Chosen over orbax-checkpoint because a single-host run needs none of orbax's
async/multi-host machinery, the file is a plain, exact byte copy of every leaf (bit-for-bit
resume), loading needs only a template pytree we already build, and it adds no background
threads or tensorstore to a small training script. A sharded multi-host run should switch this
module to orbax (it writes each host's shards in parallel); nothing outside this file would change.

Layout: `<run>/checkpoints/step_00000100/{state.eqx, meta.json}`. A checkpoint is written into
a temporary directory and renamed into place, so a crash never leaves a half-written checkpoint
under a real name; `meta.json` holds a SHA-256 of `state.eqx` so a damaged file is detected.
Only the last `keep` checkpoints are kept.
"""

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from zoo import Config

_NAME = re.compile(r"^step_(\d{8})$")


class Restored(NamedTuple):
    params: Any
    opt_state: Any
    step: int
    data_position: int
    rng: jax.Array
    path: Path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _config_dict(config: Config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config)))


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first (temporary directories are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir())


def save(
    run_dir: str | Path,
    *,
    params: Any,
    opt_state: Any,
    step: int,
    data_position: int,
    rng: jax.Array,
    config: Config,
    keep: int = 3,
) -> Path:
    """Write a checkpoint atomically (temp dir, fsync, rename) and drop all but the last `keep`."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = tmp / "state.eqx"
    # Gathered to the host first: a sharded array is written whole (one host holds every
    # shard); `restore` returns host arrays that the caller puts back into its shardings.
    host = jax.device_get((params, opt_state, jax.random.key_data(rng)))
    eqx.tree_serialise_leaves(state, host)
    meta = {
        "step": step,
        "data_position": data_position,
        "sha256": _sha256(state),
        "config": _config_dict(config),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    for f in (state, tmp / "meta.json"):
        with f.open("rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def latest(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of `run_dir`; an error that says so when there is none."""
    found = checkpoints(run_dir)
    if not found:
        raise ValueError(
            f"--resume {str(run_dir)!r} holds no checkpoint (no checkpoints/step_XXXXXXXX "
            "directory); train into it first with --out, or drop --resume"
        )
    return found[-1]


def restore(run_dir: str | Path, *, params: Any, opt_state: Any, config: Config) -> Restored:
    """The latest checkpoint of `run_dir`, read into the shapes of `params` and `opt_state`."""
    path = latest(run_dir)

    def corrupt(why: str) -> ValueError:
        return ValueError(
            f"--resume {str(run_dir)!r}: checkpoint {path} is corrupt ({why}); delete it to "
            "resume from the one before, or start a new run"
        )

    try:
        meta = json.loads((path / "meta.json").read_text())
        step, position, expected = meta["step"], meta["data_position"], meta["sha256"]
    except (OSError, ValueError, KeyError) as error:
        raise corrupt(f"unreadable meta.json: {error}") from error
    state = path / "state.eqx"
    if not state.is_file() or _sha256(state) != expected:
        raise corrupt("state.eqx is missing or does not match the SHA-256 in meta.json")
    if meta.get("config") != _config_dict(config):
        raise ValueError(
            f"--resume {str(run_dir)!r}: checkpoint {path} was written for a different model "
            f"config ({meta.get('config')}); resume with the same --model and overrides"
        )
    key_template = jax.random.key_data(jax.random.key(0))
    try:
        params, opt_state, key_data = eqx.tree_deserialise_leaves(
            state, (params, opt_state, key_template)
        )
    except Exception as error:
        raise corrupt(f"cannot read state.eqx: {error}") from error
    rng = jax.random.wrap_key_data(np.asarray(key_data))
    return Restored(params, opt_state, step, position, rng, path)


def is_run(path: str | Path) -> bool:
    """Whether `path` is a run directory holding at least one complete checkpoint."""
    return bool(checkpoints(path))


def load_run(run_dir: str | Path, *, tokenizer: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of a run directory written by train.py, for inference: `run_model`
    and the tokenizer named by `tokenizer` (an OpenAI encoding name or a `.tiktoken` rank file),
    else the one the run recorded (`run_tokenizer_spec`); None when the run records none."""
    model = run_model(run_dir)
    spec = tokenizer or run_tokenizer_spec(run_dir)
    return model, None if spec is None else tokenizer_from_spec(spec)


def run_model(run_dir: str | Path) -> Any:
    """The Transformer of the latest checkpoint's config with its trained parameters (the
    optimizer state is not read)."""
    from layers.rotary import RopeScaling
    from training.step import split_model
    from zoo import Transformer

    path = latest(run_dir)
    meta = json.loads((path / "meta.json").read_text())
    state = path / "state.eqx"
    if not state.is_file() or _sha256(state) != meta.get("sha256"):
        raise ValueError(
            f"checkpoint {path} is corrupt (state.eqx is missing or does not match the SHA-256 in "
            "meta.json); delete it to load the one before"
        )
    fields = dict(meta["config"])
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    config = Config(**fields)
    params, static = split_model(Transformer(config, key=jax.random.key(0)))
    # The file holds (params, opt_state, rng) in order; reading the first subtree stops there.
    (params,) = eqx.tree_deserialise_leaves(state, (params,))
    return eqx.combine(params, static)


def run_tokenizer_spec(run_dir: str | Path) -> str | None:
    """The tokenizer a run recorded, as `tokenizer_from_spec` reads it: meta.json's "tokenizer"
    entry, else `<run>/tokenizer.tiktoken` (its absolute path), else the name or checkpoint path
    in `<run>/tokenizer.source` (both written by train.py); None when the run records none."""
    meta = json.loads((latest(run_dir) / "meta.json").read_text())
    ranks, source = Path(run_dir) / "tokenizer.tiktoken", Path(run_dir) / "tokenizer.source"
    if meta.get("tokenizer") is not None:
        return meta["tokenizer"]
    if ranks.is_file():
        return str(ranks.resolve())
    if source.is_file():
        return source.read_text().strip()
    return None


def tokenizer_from_spec(spec: str) -> Any:
    """A pretrained checkpoint's tokenizer (an HF directory, .gguf or tokenizer.json), a
    `.tiktoken` rank file, or an OpenAI encoding name."""
    from data.tokenizers import load_ranks, openai_encoding

    source = Path(spec)
    if source.is_dir() or source.suffix in (".gguf", ".json"):
        from zoo.tokenizer import load_tokenizer

        return load_tokenizer(spec).encoding
    return load_ranks(spec) if source.is_file() else openai_encoding(spec)
