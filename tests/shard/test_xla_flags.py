"""The default XLA flags for GPUs: merged under the user's own, accepted by this jaxlib."""

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from shard.xla_flags import GPU_DEFAULTS, merged_xla_flags, set_default_xla_flags

ROOT = Path(__file__).parents[2]


def test_user_flags_win_and_defaults_fill_in():
    user = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_backend_optimization_level=1"
    flags = merged_xla_flags(user).split()
    assert flags[:2] == user.split()
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert "--xla_gpu_enable_highest_priority_async_stream=true" in flags


def test_every_default_is_a_flag_this_jaxlib_knows():
    # XLA aborts the process on an unknown flag when the backend starts: a misspelt default fails.
    code = (
        "from shard.xla_flags import set_default_xla_flags; import jax.numpy as jnp; "
        "print(set_default_xla_flags()); print(float(jnp.ones(3).sum()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    flags, total = out.stdout.split("\n")[:2]
    assert all(f"--{name}={value}" in flags.split() for name, value in GPU_DEFAULTS.items())
    assert total == "3.0"


def test_setting_flags_after_the_backend_started_is_an_error():
    jnp.zeros(1).block_until_ready()
    with pytest.raises(RuntimeError, match="before the first JAX computation"):
        set_default_xla_flags()
