"""Checkpoint saving: how long the training loop is blocked by an asynchronous orbax save
(training/state.py's `Writer`) vs a synchronous one, on the same state, each beside its
prediction from bandwidths measured in this run.

    python -m bench checkpoint

The state is a Llama-shaped model's float32 parameters and its two AdamW moments. Predictions:
a synchronous save blocks for state bytes / disk bandwidth (a plain write of as many bytes,
fsynced); an asynchronous one blocks the loop only for the copy of the arrays off the devices,
state bytes / host copy bandwidth (`np.copy` of the state), while the write goes on in the
background. Either is finalized after the write plus state bytes / SHA-256 rate (the checksum
record training/state.py writes once orbax has finalized a step).
"""

import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import zoo
from bench.harness import Ceilings, Table, on_gpu
from training.optimizer import adamw, learning_rate
from training.state import Writer
from training.step import split_model
from zoo import math as zmath

REPEATS = 3


def state_of(config: zoo.Config) -> dict:
    model = zoo.Transformer(config, key=jax.random.key(0))
    params, _ = split_model(model)
    optimizer = adamw(learning_rate("cosine", peak=1e-3, steps=100, warmup=10))
    return {"params": params, "opt_state": optimizer.init(params)}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def disk_seconds(n_bytes: int, directory: Path) -> float:
    """Median time to write `n_bytes` to a new file in `directory` and fsync it."""
    data = np.random.default_rng(0).integers(0, 255, n_bytes, dtype=np.uint8).tobytes()
    times = []
    for i in range(REPEATS):
        path = directory / f"plain-{i}"
        start = time.perf_counter()
        with path.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - start)
        path.unlink()
    return statistics.median(times)


def sha_seconds(n_bytes: int) -> float:
    data = np.ones(n_bytes, np.uint8).tobytes()
    start = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return time.perf_counter() - start


def copy_seconds(state) -> float:
    """Median time to copy the state's arrays to new host buffers."""
    host = [np.asarray(x) for x in jax.tree.leaves(state)]
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        [np.copy(x) for x in host]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def saves(state, directory: Path, *, asynchronous: bool) -> tuple[float, float]:
    """(median seconds the caller was blocked per save, median seconds until each save was
    finalized), over REPEATS saves of `state`, each awaited before the next."""
    blocked, done = [], []
    for i in range(REPEATS):
        root = directory / f"{'async' if asynchronous else 'sync'}-{i}"
        writer = Writer(root, keep=1, asynchronous=asynchronous)
        start = time.perf_counter()
        blocked.append(writer.save(1, state, {"step": 1}))
        writer.close()
        done.append(time.perf_counter() - start)
        shutil.rmtree(root)
    return statistics.median(blocked), statistics.median(done)


def run(ceilings: Ceilings) -> Table:
    del ceilings  # disk and memory copies, not the device's roofline
    if on_gpu():
        config = zoo.preset("tiny-llama", d_model=1024, n_layers=8, d_ff=2816, vocab_size=32000)
    else:
        config = zoo.preset("tiny-llama", d_model=512, n_layers=4, d_ff=1408, vocab_size=8192)
    state = state_of(config)
    size = nbytes(state)
    table = Table(
        "checkpoint",
        "Checkpoint save: loop blocked, asynchronous vs synchronous (orbax)",
        [
            f"state: {zmath.param_count(config) / 1e6:.1f}M float32 parameters + 2 AdamW moments = "
            f"{size / 1e6:.0f} MB, {REPEATS} saves each (median), into a temporary directory. "
            "predicted blocked: sync = bytes / plain-write bandwidth, async = bytes / host copy "
            "bandwidth; predicted finalized (renamed into place, checksums written) = bytes / "
            "plain-write bandwidth + bytes / SHA-256 rate, both ways."
        ],
    )
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as tmp:
        directory = Path(tmp)
        disk, sha, copy = disk_seconds(size, directory), sha_seconds(size), copy_seconds(state)
        table.add(
            {
                "what": "plain write + fsync",
                "predicted blocked s": float("nan"),
                "blocked s": disk,
                "predicted finalized s": float("nan"),
                "finalized s": disk,
                "GB/s": size / disk / 1e9,
            }
        )
        sync_blocked, sync_done = saves(state, directory, asynchronous=False)
        table.add(
            {
                "what": "orbax save, synchronous",
                "predicted blocked s": disk,
                "blocked s": sync_blocked,
                "predicted finalized s": disk + sha,
                "finalized s": sync_done,
                "GB/s": size / sync_done / 1e9,
            }
        )
        async_blocked, async_done = saves(state, directory, asynchronous=True)
        table.add(
            {
                "what": "orbax save, asynchronous",
                "predicted blocked s": copy,
                "blocked s": async_blocked,
                "predicted finalized s": disk + sha,
                "finalized s": async_done,
                "GB/s": size / async_done / 1e9,
            }
        )
    return table
