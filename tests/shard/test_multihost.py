"""Multi-host through JAX's own runtime: two processes on localhost with 4 CPU devices each run
the same sharded training steps as one process with 8 devices, and agree with it."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.shard.multihost_worker import STEPS

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start(
    worker_args: list[str], devices: int, worker: str = "tests/shard/multihost_worker.py"
) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        # No LLVM optimisation: most of the compile time of these tiny programs, in every run
        # alike, so the comparison stays like for like.
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} "
        "--xla_backend_optimization_level=0",
    }
    return subprocess.Popen(
        [sys.executable, str(ROOT / worker), *worker_args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_processes_agree_with_one(tmp_path):
    two, one, port = tmp_path / "two.npz", tmp_path / "one.npz", str(free_port())
    # The reference (one process, 8 devices) runs at the same time as the pair.
    procs = [start([str(i), "2", port, str(two)], devices=4) for i in range(2)]
    procs.append(start(["0", "1", port, str(one)], devices=8))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]

    two, one = np.load(two), np.load(one)
    losses = one["losses"]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    np.testing.assert_allclose(two["losses"], losses, rtol=1e-5)
    n_params = len(one.files) - 1
    assert n_params > 0 and len(two.files) == n_params + 1
    for i in range(n_params):
        np.testing.assert_allclose(two[f"arr_{i}"], one[f"arr_{i}"], rtol=1e-4, atol=1e-6)
