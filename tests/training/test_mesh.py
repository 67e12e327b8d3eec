"""train.py --mesh: the sharded step agrees with the one-device run, resumes from its
checkpoints, and a bad mesh is refused before anything loads or compiles (8 fake CPU devices)."""

import json
import typing

import jax
import numpy as np
import pytest

import shard
import train
from tests.training.conftest import stopped_copy
from training.args import Args


def _losses(run_dir) -> dict[int, float]:
    lines = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def test_sharded_run_matches_one_device_and_resumes(tmp_path, tiny_argv, full_run):
    assert len(jax.devices()) == 8
    plain_dir, plain = full_run
    argv = tiny_argv(tmp_path / "mesh", "--steps", "6", "--checkpoint-every", "3")
    sharded = train.main([*argv, "--mesh", "fsdp=4,tensor=2"])
    params = jax.tree.leaves(sharded.model)
    assert any(len(p.sharding.device_set) == 8 and not p.is_fully_replicated for p in params)
    a, b = _losses(plain_dir), _losses(tmp_path / "mesh")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([b[s] for s in a], list(a.values()), rtol=1e-4)
    np.testing.assert_allclose(sharded.val_loss, plain.val_loss, rtol=1e-4)

    # Resume the sharded run from its step-3 checkpoint (each shard saved and restored in place).
    resumed = stopped_copy(tmp_path / "mesh", tmp_path / "resumed", step=3)
    train.main([*argv, "--mesh", "fsdp=4,tensor=2", "--resume", str(resumed)])
    again = _losses(resumed)
    assert sorted(again) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([again[s] for s in (4, 5, 6)], [b[4], b[5], b[6]], rtol=1e-6)


def test_mesh_of_the_wrong_size_fails_before_loading(tmp_path, tiny_argv):
    with pytest.raises(ValueError, match=r"--mesh 'fsdp=3'.*3 devices but there are 8"):
        train.main(tiny_argv(tmp_path / "run", "--mesh", "fsdp=3", "--data", "/does/not/exist"))
    with pytest.raises(SystemExit):  # a flag error (tests/training/test_args.py)
        train.main(tiny_argv(tmp_path / "run", "--mesh", "model=8"))
    with pytest.raises(ValueError, match="--rules 'tp' needs a --mesh"):
        train.main(tiny_argv(tmp_path / "run", "--rules", "tp"))
    assert not (tmp_path / "run").exists()


def test_indivisible_dimension_is_named(tmp_path, tiny_argv):
    # tiny-llama has 2 KV heads: tensor=8 cannot split them.
    with pytest.raises(ValueError, match="does not divide by mesh axis"):
        train.main(tiny_argv(tmp_path / "run", "--mesh", "tensor=8"))


def test_rules_choices_are_the_shard_presets():
    choices = typing.get_args(typing.get_args(Args.__annotations__["rules"])[0])
    assert list(choices) == shard.presets()
