"""Multi-host through JAX's own runtime: two processes on localhost with 4 CPU devices each run
the same sharded training steps as one process with 8 devices, and agree with it."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.shard.multihost_worker import STEPS, train

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_agree_with_one(tmp_path):
    out, port = tmp_path / "two.npz", free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    }
    worker = ROOT / "tests" / "shard" / "multihost_worker.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(i), "2", str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]

    two = np.load(out)
    losses, params = train()
    assert len(losses) == STEPS and losses[-1] < losses[0]
    np.testing.assert_allclose(two["losses"], losses, rtol=1e-5)
    for i, p in enumerate(params):
        np.testing.assert_allclose(two[f"arr_{i}"], p, rtol=1e-4, atol=1e-6)
