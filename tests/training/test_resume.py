"""A run stopped and resumed from a checkpoint matches the uninterrupted run: bit for bit on one
device; within float tolerance after a SIGKILL, resumed on another mesh."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

import train
import zoo
from tests.training.conftest import stopped_copy
from training import convert_run, run_dir
from training.optimizer import adamw
from training.state import read_meta


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


def test_a_killed_fsdp_run_resumes_on_another_mesh(tmp_path, tiny_argv):
    """`--mesh fsdp=8`, SIGKILLed as soon as its last checkpoint (step 6) is handed to the
    background writer, leaves steps 2 and 4 finalized (each save waits for the one before) and
    step 6 finalized or absent, never partial under its name. Resumed from step 4 on `--mesh
    fsdp=4,tensor=2`, steps 5 and 6 repeat the killed run's losses within 1e-4 (another mesh
    reduces in another order, as in test_mesh.py)."""
    run = tmp_path / "run"
    argv = tiny_argv(run, "--steps", "6", "--batch-size", "8")
    script = Path(__file__).with_name("killed_run.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    killed = subprocess.run(
        [sys.executable, str(script), "6", *argv, "--mesh", "fsdp=8"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    kept = [int(p.name.removeprefix("step_")) for p in run_dir.checkpoints(run)]
    assert kept in ([2, 4], [2, 4, 6])
    reference = _losses(run)
    assert sorted(reference) == [1, 2, 3, 4, 5, 6]

    resumed = stopped_copy(run, tmp_path / "resumed", step=4)
    train.main([*argv, "--mesh", "fsdp=4,tensor=2", "--resume", str(resumed)])
    again = _losses(resumed)
    np.testing.assert_allclose([again[5], again[6]], [reference[5], reference[6]], rtol=1e-4)


def _write_equinox_format(run) -> None:
    """Rewrite `run`'s only checkpoint as the pre-orbax code did: `state.eqx` holding (params,
    optimizer state, key data) in Equinox serialisation and `meta.json` with its SHA-256."""
    (path,) = run_dir.checkpoints(run)
    config, _ = run_dir.checkpoint_config(run)
    model = run_dir.abstract_model(config, zoo.Policy())
    restored = run_dir.restore(run, model=model, optimizer=adamw(lambda _: 0.0))
    meta = read_meta(path)
    shutil.rmtree(path)
    path.mkdir()
    state = (restored.params, restored.opt_state, jax.random.key_data(restored.rng))
    eqx.tree_serialise_leaves(path / "state.eqx", state)
    digest = hashlib.sha256((path / "state.eqx").read_bytes()).hexdigest()
    (path / "meta.json").write_text(json.dumps({**meta, "sha256": digest}))


def test_an_equinox_format_run_is_refused_then_converted_and_resumes(tmp_path, tiny_argv, full_run):
    full_dir, _ = full_run
    run = stopped_copy(full_dir, tmp_path / "old", step=3)
    _write_equinox_format(run)
    argv = tiny_argv(tmp_path / "x", "--steps", "6", "--resume", str(run))
    with pytest.raises(ValueError, match=r"(?s)Equinox format .*python -m training\.convert_run"):
        train.main(argv)

    convert_run.main([str(run)])
    assert not list(run.glob("checkpoints.*"))  # the staging and the old directories are gone
    train.main(argv)
    full_losses, resumed_losses = _losses(full_dir), _losses(run)
    assert all(resumed_losses[s] == full_losses[s] for s in (4, 5, 6))


def _bare_resume(run: Path, cache_dir) -> list[str]:
    """`--resume RUN` and nothing the run records (no --steps): what a user types."""
    return ["--resume", str(run), "--cache-dir", str(cache_dir), "--no-progress",
            "--peak-flops", "1e11", "--peak-bandwidth", "1e10"]  # fmt: skip


def test_resume_without_steps_trains_to_the_runs_own_target(tmp_path, full_run, cache_dir):
    full_dir, _ = full_run
    resumed_dir = stopped_copy(full_dir, tmp_path / "resumed", step=3)
    resumed = train.main(_bare_resume(resumed_dir, cache_dir))
    assert resumed.step == 6  # the run's --steps 6, not train.py's default 300
    assert _losses(resumed_dir)[6] == _losses(full_dir)[6]  # and exactly where it would be


def test_a_finished_run_resumed_without_steps_says_how_to_go_on(full_run, cache_dir):
    full_dir, _ = full_run
    with pytest.raises(ValueError, match="the run reached its target, step 6 of 6; give --steps"):
        train.main(_bare_resume(full_dir, cache_dir))


def test_a_new_target_is_recorded_once_the_resume_is_accepted(tmp_path, full_run, tiny_argv):
    full_dir, _ = full_run
    run = stopped_copy(full_dir, tmp_path / "run", step=6)
    with pytest.raises(ValueError, match="--lr"):  # a contradicting flag: nothing is changed
        train.main(tiny_argv(tmp_path / "x", "--steps", "9", "--lr", "1", "--resume", str(run)))
    assert json.loads((run / "run.json").read_text())["settings"]["steps"] == 6
    train.main(tiny_argv(tmp_path / "x", "--steps", "7", "--resume", str(run)))
    assert json.loads((run / "run.json").read_text())["settings"]["steps"] == 7
