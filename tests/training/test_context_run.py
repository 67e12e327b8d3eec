"""train.py --mesh with a context axis (8 fake CPU devices): the sequence split over 2 devices
trains to the one-device run's losses with the context-parallel kernel zoo.math picks, and a
sequence length that does not cut into 2 x context chunks is refused before anything is
written."""

import json

import numpy as np
import pytest

import train
from zoo import math as zmath


def _losses(run_dir) -> dict[int, float]:
    lines = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def test_context_parallel_run_matches_one_device(tmp_path, tiny_argv, full_run):
    plain_dir, plain = full_run
    argv = tiny_argv(tmp_path / "context", "--steps", "6", "--checkpoint-every", "3")
    sharded = train.main([*argv, "--mesh", "context=2,fsdp=4"])
    # No --attention: the kernel zoo.math predicts faster for tiny-llama at seq 16 on the
    # hardware the tiny runs declare (1e11 FLOP/s, 1e10 B/s).
    hardware = zmath.Hardware(name="given", flops={"float32": 1e11}, bandwidth=1e10)
    expected = zmath.cheaper_context_kernel(
        sharded.model.config, sharded.model.policy, batch=1, seq=16, context=2, hardware=hardware
    )
    assert sharded.model.policy.kernel_name == expected
    a, b = _losses(plain_dir), _losses(tmp_path / "context")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    # The same bound as the other --mesh runs (test_mesh.py): six AdamW steps at lr 1e-2 can
    # turn float32 reassociation (~1e-6 relative per step) into ~1e-5 in the loss.
    np.testing.assert_allclose([b[s] for s in a], list(a.values()), rtol=1e-4)
    np.testing.assert_allclose(sharded.val_loss, plain.val_loss, rtol=1e-4)


def test_sequence_must_cut_into_zigzag_chunks(tmp_path, tiny_argv):
    argv = tiny_argv(tmp_path / "run", "--mesh", "context=4,data=2", "--seq-len", "12")
    with pytest.raises(ValueError, match=r"2 x 4 = 8 equal chunks.*12 tokens"):
        train.main(argv)
    assert not (tmp_path / "run").exists()
