"""A run stopped and resumed from a checkpoint matches the uninterrupted run bit for bit."""

import json

import equinox as eqx
import jax
import numpy as np

import train
from tests.training.conftest import stopped_copy


def _losses(run_dir) -> dict[int, float]:
    lines = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def test_resume_is_bit_for_bit(tmp_path, tiny_argv, full_run):
    full_dir, full = full_run
    resumed_dir = stopped_copy(full_dir, tmp_path / "resumed", step=3)
    resumed = train.main(tiny_argv(tmp_path / "x", "--steps", "6", "--resume", str(resumed_dir)))

    full_losses, resumed_losses = _losses(full_dir), _losses(resumed_dir)
    assert sorted(resumed_losses) == [1, 2, 3, 4, 5, 6]
    for step, loss in resumed_losses.items():
        assert loss == full_losses[step]
    a = jax.tree.leaves(eqx.filter(full.model, eqx.is_array))
    b = jax.tree.leaves(eqx.filter(resumed.model, eqx.is_array))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
