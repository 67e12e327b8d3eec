"""A train.py run directory: its checkpoints, the tokenizer it recorded, and the model it trained.

Layout: `<run>/checkpoints/step_00000100/` (an orbax step directory, training/state.py: the items
`params/`, `opt_state/` and `rng/`, `meta/` with the step, the data position, the model config and
the policy's parameter dtype, and `sha256.json`); the last `keep` are kept. Steps are written in
the background (`Checkpointer`) by every process of a run, and restored into any placement.
`<run>/tokenizer.tiktoken` or `<run>/tokenizer.source` names the tokenizer. Run directories from
before orbax (`state.eqx` checkpoints) are converted by `python -m training.convert_run RUN`.
The model a run trained is rebuilt by training/run_model.py.
"""

import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
import optax

from shard import Placement
from training.state import (
    LEGACY_STATE,
    CorruptState,
    MismatchedState,
    Writer,
    read_meta,
    restore_state,
)
from zoo import Config, Policy, Transformer
from zoo.adapter import split_trainable

_NAME = re.compile(r"^step_(\d{8})$")


class Restored(NamedTuple):
    params: Any
    opt_state: Any
    step: int
    data_position: int
    rng: jax.Array
    path: Path


def checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `run_dir`, oldest first (temporary directories are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir())


def is_run(path: str | Path) -> bool:
    """Whether `path` is a run directory holding at least one complete checkpoint."""
    return bool(checkpoints(path))


def latest(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of `run_dir`; an error that says so when there is none."""
    found = checkpoints(run_dir)
    if not found:
        raise ValueError(
            f"{str(run_dir)!r} holds no checkpoint (no checkpoints/step_XXXXXXXX directory); "
            "train into it first with --out"
        )
    return found[-1]


class Checkpointer:
    """Writes a run's checkpoints (`checkpoints/step_XXXXXXXX`) in the background and keeps the
    last `keep`; every process of a multi-process run makes one and saves every step alike.
    `save` returns the seconds the caller was blocked; `close` waits for the last write."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        config: Config,
        policy: Policy,
        keep: int = 3,
        asynchronous: bool = True,
    ):
        self._writer = Writer(Path(run_dir) / "checkpoints", keep=keep, asynchronous=asynchronous)
        self._config, self._param_dtype = config.to_dict(), policy.param_dtype

    def path(self, step: int) -> Path:
        return self._writer.path(step)

    def save(
        self, *, params: Any, opt_state: Any, step: int, data_position: int, rng: jax.Array
    ) -> float:
        meta = {
            "step": step,
            "data_position": data_position,
            "config": self._config,
            "param_dtype": self._param_dtype,
        }
        trees = {"params": params, "opt_state": opt_state, "rng": _rng_item(rng)}
        return self._writer.save(step, trees, meta)

    def close(self) -> float:
        return self._writer.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _rng_item(rng: jax.Array) -> dict[str, np.ndarray]:
    # orbax saves pytrees, not a lone array, and raw key data, not a typed key; on the host,
    # since the key lives on one device of one process, which orbax cannot save multi-process.
    return {"key_data": np.asarray(jax.random.key_data(rng))}


def save(
    run_dir: str | Path,
    *,
    params: Any,
    opt_state: Any,
    step: int,
    data_position: int,
    rng: jax.Array,
    config: Config,
    policy: Policy,
    keep: int = 3,
) -> Path:
    """Write checkpoint `step` and drop all but the last `keep`; returns when it is on disk."""
    with Checkpointer(run_dir, config=config, policy=policy, keep=keep) as checkpointer:
        checkpointer.save(
            params=params, opt_state=opt_state, step=step, data_position=data_position, rng=rng
        )
    return checkpointer.path(step)


def _meta(path: Path, run_dir: str | Path) -> dict[str, Any]:
    if (path / LEGACY_STATE).exists():
        raise ValueError(
            f"{str(run_dir)!r} holds checkpoints in the Equinox format written before orbax "
            f"({path / LEGACY_STATE}); convert the run directory in place with "
            f"`python -m training.convert_run {run_dir}`, then use it again"
        )
    try:
        return read_meta(path)
    except CorruptState as error:
        raise ValueError(
            f"{str(run_dir)!r}: checkpoint {path} is corrupt ({error}); delete it to use the "
            "one before, or start a new run"
        ) from error


def checkpoint_config(run_dir: str | Path) -> tuple[Config, str]:
    """(model config, parameter dtype) of the run's latest checkpoint."""
    path = latest(run_dir)
    meta = _meta(path, run_dir)
    return Config.from_dict(meta["config"], source=f"{path}/meta.json"), meta["param_dtype"]


def abstract_model(config: Config, policy: Policy) -> Transformer:
    """The model's shapes and dtypes, nothing allocated: the template to restore into."""
    return eqx.filter_eval_shape(Transformer, config, policy=policy, key=jax.random.key(0))


def restore(
    run_dir: str | Path,
    *,
    model: Transformer,
    optimizer: optax.GradientTransformation,
    placement: Placement | None = None,
    opt_state_shardings: Any = None,
) -> Restored:
    """The latest checkpoint of `run_dir` for `model` (real or abstract: only its structure,
    config and policy are read), its parameters and `optimizer`'s state placed in their
    shardings: the placement's, or `opt_state_shardings` for the state (e.g. in host memory,
    training/offload.py: read straight there, never whole on a device)."""
    placement = placement or Placement()
    path = latest(run_dir)
    meta = _meta(path, run_dir)
    if meta.get("config") != model.config.to_dict():
        raise ValueError(
            f"--resume {str(run_dir)!r}: checkpoint {path} was written for a different model "
            f"config ({meta.get('config')}); resume with the same --model and overrides"
        )
    params = shapes_of(split_trainable(model)[0])
    templates = {
        "params": placed(params, placement.param_shardings(params), placement),
        "opt_state": placed(
            jax.eval_shape(optimizer.init, params),
            opt_state_shardings or placement.opt_state_shardings(optimizer, params),
            placement,
            given=opt_state_shardings is not None,
        ),
        "rng": placed(
            {"key_data": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))},
            None,
            placement,
            replicate=True,
        ),
    }
    try:
        state = restore_state(path, templates)
    except MismatchedState as error:
        raise ValueError(
            f"--resume {str(run_dir)!r}: checkpoint {path} holds another state than this run "
            f"makes ({error}); resume with the settings it was written with (--model, "
            "--override, --clip, --lora-*)"
        ) from error
    except CorruptState as error:
        raise ValueError(
            f"--resume {str(run_dir)!r}: checkpoint {path} is corrupt or not this run's state "
            f"({error}); delete it to resume from the one before, or start a new run"
        ) from error
    params, opt_state = state["params"], state["opt_state"]
    key_data = state["rng"]["key_data"]
    rng = jax.random.wrap_key_data(key_data)
    return Restored(params, opt_state, meta["step"], meta["data_position"], rng, path)


def shapes_of(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def placed(
    shapes: Any,
    shardings: Any,
    placement: Placement,
    *,
    replicate: bool = False,
    given: bool = False,
) -> Any:
    """`shapes` (ShapeDtypeStruct leaves) carrying the shardings they are restored into:
    `shardings` (always when `given`), the mesh's replicated sharding (`replicate`), or the
    default device without a mesh."""
    if not given and not placement.sharded:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, shapes)
    elif not given and replicate:
        shardings = jax.tree.map(lambda _: placement.replicated(), shapes)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def run_tokenizer_spec(run_dir: str | Path) -> str | None:
    """The tokenizer a run recorded, as `tokenizer_from_spec` reads it: `<run>/tokenizer.tiktoken`
    (its absolute path), else the name or checkpoint path in `<run>/tokenizer.source` (both
    written by train.py); None when the run records none."""
    ranks, source = Path(run_dir) / "tokenizer.tiktoken", Path(run_dir) / "tokenizer.source"
    if ranks.is_file():
        return str(ranks.resolve())
    if source.is_file():
        return source.read_text().strip()
    return None


def recorded_tokenizer_spec(run_dir: str | Path) -> str:
    """`run_tokenizer_spec` of a run that needs its tokenizer (to resume it, to start from it):
    a ValueError naming the run and the missing files when it records none."""
    spec = run_tokenizer_spec(run_dir)
    if spec is None:
        raise ValueError(
            f"run {str(run_dir)!r} records no tokenizer: neither tokenizer.tiktoken nor "
            "tokenizer.source is in it (train.py writes one of them; was it deleted?). Put the "
            "run's tokenizer back: its rank file as tokenizer.tiktoken (a BPE train.py trained "
            "is cached as <--cache-dir>/bpe-<vocab>-<digest>.tiktoken), or the OpenAI encoding "
            "name or checkpoint path it used in tokenizer.source"
        )
    return spec


def tokenizer_from_spec(spec: str) -> Any:
    """The tiktoken encoding of a pretrained checkpoint's tokenizer (an HF directory, .gguf or
    tokenizer.json), a `.tiktoken` rank file, or an OpenAI encoding name."""
    tokenizer = chat_tokenizer_from_spec(spec)
    return getattr(tokenizer, "encoding", tokenizer)


def chat_tokenizer_from_spec(spec: str) -> Any:
    """As `tokenizer_from_spec`, but a checkpoint's tokenizer whole: a `zoo.Tokenizer` with its
    chat template (instruction data is rendered with it); a tiktoken encoding otherwise."""
    from data.tokenizers import load_ranks, openai_encoding

    source = Path(spec)
    if not source.exists() and (source.is_absolute() or source.suffix or len(source.parts) > 1):
        raise ValueError(
            f"tokenizer {spec!r} does not exist (a run's tokenizer.source names the checkpoint "
            "or rank file it was trained with: put it back there, or write its new path)"
        )
    if source.is_dir() or source.suffix in (".gguf", ".json"):
        from zoo.tokenizer import load_tokenizer

        return load_tokenizer(spec)
    return load_ranks(spec) if source.is_file() else openai_encoding(spec)


# --- ownership: one run per directory, one process at a time ----------------------------------

RECORD = "run.json"
LOCK = ".lock"
# What a run's files belong to: replaced by --overwrite, never by a new run without it.
RUN_FILES = ("checkpoints", "metrics.jsonl", "metrics.abandoned.jsonl", "loss.png", RECORD,
             "tokenizer.tiktoken", "tokenizer.source", "reference.npy",
             "reference_val.npy")  # fmt: skip


# A lock's record is refreshed this often while its run trains, and a record from another host
# older than LOCK_STALE_S counts as left by a dead run.
LOCK_REFRESH_S, LOCK_STALE_S = 30.0, 120.0


def lock_holder(run_dir: str | Path) -> dict[str, Any] | None:
    """The record of the lock on `run_dir` (`host`, `pid`, `run_id`, `refreshed`: Unix time),
    or None when there is none (never locked, released, or written before records existed)."""
    try:
        record = json.loads((Path(run_dir) / LOCK).read_text() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class Lock:
    """The lock on a run directory, held by one process (process 0 of a multi-process run).

    Two layers: `flock` on `<run>/.lock`, released when the process ends however it ends, so
    never stale on one host; and in that file a record of its holder (host, pid, a fresh
    `run_id`), refreshed every LOCK_REFRESH_S seconds, which a process on another host
    respects while it is younger than LOCK_STALE_S (flock does not reach across hosts on
    every shared filesystem). Closing releases both."""

    def __init__(self, run_dir: Path):
        import fcntl

        self.path = run_dir / LOCK
        self.run_id = uuid.uuid4().hex
        self._file = self.path.open("a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(run_dir) or {}
            self._file.close()
            raise ValueError(
                f"run directory {str(run_dir)!r} is in use by process "
                f"{holder.get('pid', 'another process')} (lock {self.path}); wait for it to "
                "finish or use another --out"
            ) from None
        holder, host = lock_holder(run_dir), socket.gethostname()
        age = time.time() - holder.get("refreshed", 0) if holder else None
        if holder and holder.get("host") != host and age < LOCK_STALE_S:
            self._file.close()
            raise ValueError(
                f"run directory {str(run_dir)!r} is in use by process {holder.get('pid')} on "
                f"host {holder.get('host')!r} (its lock {self.path} was refreshed {age:.0f} s "
                f"ago; a lock not refreshed for {LOCK_STALE_S:.0f} s is taken over); wait for "
                "that run to finish or use another --out"
            )
        self._record = {"host": host, "pid": os.getpid(), "run_id": self.run_id}
        self._write()
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh, name="run-lock", daemon=True)
        self._refresher.start()

    def _write(self) -> None:
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps({**self._record, "refreshed": time.time()}))
        self._file.flush()

    def _refresh(self) -> None:
        while not self._stop.wait(LOCK_REFRESH_S):
            self._write()

    def close(self) -> None:
        self._stop.set()
        self._refresher.join()
        self._file.seek(0)
        self._file.truncate()  # no record: the directory is free
        self._file.close()  # closing the file releases the flock

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in RUN_FILES)


def claim(run_dir: str | Path, *, resume: bool, overwrite: bool) -> Lock:
    """Lock `run_dir` for this process. A new run into a directory that holds one is refused
    unless `overwrite` (then the old run's files go); a resume needs the run's record."""
    run_dir = Path(run_dir)
    if resume:
        if not (run_dir / RECORD).is_file():
            raise ValueError(
                f"--resume {str(run_dir)!r} is not a train.py run directory (no {RECORD}); "
                "give the --out of an earlier run"
            )
        latest(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = Lock(run_dir)
    if not resume and holds_run(run_dir):
        if not overwrite:
            lock.close()
            raise ValueError(
                f"--out {str(run_dir)!r} already holds a run; continue it with --resume "
                f"{str(run_dir)!r}, choose another --out, or pass --overwrite to delete it"
            )
        for name in RUN_FILES:
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    return lock


def write_record(run_dir: str | Path, record: dict[str, Any]) -> None:
    """What defines the run (settings, model config, tokenizer), written once when it starts."""
    path = Path(run_dir) / RECORD
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.rename(path)


def read_record(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / RECORD
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is unreadable ({error}); the run cannot be resumed") from error


def latest_step(run_dir: str | Path) -> int:
    """The step of the run's latest checkpoint."""
    path = latest(run_dir)
    return int(_meta(path, run_dir)["step"])
