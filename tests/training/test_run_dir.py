"""A run directory belongs to one run: nothing a second command does loses or mixes its files.
Every data-loss case checks the run's files byte for byte afterwards."""

import errno
import json
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import train
from tests.training.conftest import stopped_copy
from training import run_dir as runs
from training import state


def snapshot(directory):
    """Every file under `directory` (but the lock) and its bytes."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != runs.LOCK
    }


@pytest.fixture
def run(full_run, tmp_path):
    """A copy of a finished 6-step run (checkpoints at steps 3 and 6)."""
    return stopped_copy(full_run[0], tmp_path / "run", step=6)


def test_a_new_run_into_a_run_directory_is_refused(run, tiny_argv):
    before = snapshot(run)
    with pytest.raises(ValueError, match="already holds a run; continue it with --resume"):
        train.main(tiny_argv(run, "--model", "tiny-gpt2", "--override", "vocab_size=320"))
    assert snapshot(run) == before


def test_overwrite_replaces_the_old_run(run, tiny_argv):
    result = train.main(tiny_argv(run, "--steps", "2", "--overwrite"))
    assert [p.name for p in runs.checkpoints(run)] == ["step_00000002"]
    steps = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all('"step": 1' in s or '"step": 2' in s for s in steps)
    assert result.step == 2


@pytest.mark.parametrize(
    ("flag", "value", "recorded"),
    [("--lr", "0.5", "0.01"), ("--seq-len", "8", "16"), ("--seed", "3", "0")],
)
def test_resume_refuses_a_flag_that_contradicts_the_run(run, tiny_argv, flag, value, recorded):
    before = snapshot(run)
    argv = [*tiny_argv(run, "--steps", "8"), "--resume", str(run), flag, value]
    with pytest.raises(ValueError, match=f"argument {flag}: .* recorded with {recorded}"):
        train.main(argv)
    assert snapshot(run) == before


def test_resume_refuses_other_data_and_keeps_the_tokenizer(run, tiny_argv, tmp_path):
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "another corpus entirely"}\n' * 50)
    before = snapshot(run)
    argv = [*tiny_argv(run, "--steps", "8", data=other), "--resume", str(run)]
    with pytest.raises(ValueError, match=r"argument --data: .* not '.*other\.jsonl'"):
        train.main(argv)
    assert snapshot(run) == before  # tokenizer.tiktoken included


def test_resume_takes_the_recorded_settings(run, tiny_argv, corpus):
    # Only --resume and --steps given: data, model, schedule and seed come from run.json.
    result = train.main(["--resume", str(run), "--steps", "7", "--no-progress",
                         "--cache-dir", str(run / "cache")])  # fmt: skip
    assert result.step == 7 and result.model.config.vocab_size == 320


def test_steps_not_beyond_the_run_is_an_error(run, tiny_argv):
    before = snapshot(run)
    for steps in ("6", "3"):
        with pytest.raises(ValueError, match=f"argument --steps: {steps} is not beyond .* step 6"):
            train.main([*tiny_argv(run, "--steps", steps), "--resume", str(run)])
    assert snapshot(run) == before  # loss.png too


def test_resume_and_init_from_are_refused_together(run, tiny_argv, tmp_path):
    with pytest.raises(SystemExit):  # argparse's error: exit status 2, the flags named
        train.main([*tiny_argv(run), "--resume", str(run), "--init-from", str(run)])


def test_a_held_lock_stops_a_second_process_and_is_released_after(run, tiny_argv):
    before = snapshot(run)
    with runs.Lock(run):
        with pytest.raises(ValueError, match=f"in use by process {os.getpid()}"):
            train.main([*tiny_argv(run, "--steps", "8"), "--resume", str(run)])
        with pytest.raises(ValueError, match="in use by process"):
            train.main(tiny_argv(run, "--overwrite"))
    assert snapshot(run) == before
    # Released: the resume goes ahead now (and its own lock is released when it ends).
    assert train.main([*tiny_argv(run, "--steps", "7"), "--resume", str(run)]).step == 7
    runs.Lock(run).close()


def test_a_run_claimed_from_another_host_is_refused_until_its_lock_goes_stale(run, tiny_argv):
    """The record a lock writes (host, pid, refreshed) stops a run on another host, where
    flock may not reach on a shared filesystem; a record not refreshed for LOCK_STALE_S is
    what a dead run leaves, and is taken over."""
    before = snapshot(run)
    record = {"host": "other-host", "pid": 4242, "run_id": "theirs", "refreshed": time.time()}
    (run / runs.LOCK).write_text(json.dumps(record))
    with pytest.raises(
        ValueError,
        match=r"in use by process 4242 on host 'other-host' \(its "
        r"lock .* was refreshed 0 s ago; a lock not refreshed for 120 s",
    ):
        train.main([*tiny_argv(run, "--steps", "7"), "--resume", str(run)])
    assert snapshot(run) == before and runs.lock_holder(run)["host"] == "other-host"
    (run / runs.LOCK).write_text(json.dumps({**record, "refreshed": time.time() - 600}))
    with runs.Lock(run) as lock:
        holder = runs.lock_holder(run)
        assert holder["run_id"] == lock.run_id and holder["pid"] == os.getpid()
    assert runs.lock_holder(run) is None  # released


def test_a_full_disk_is_reported_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    async def no_space(self, directory, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", no_space)
    with (
        pytest.raises(OSError, match=r"no space left on the disk .* resume from the last"),
        state.Writer(tmp_path / "checkpoints", keep=2) as writer,
    ):
        writer.save(1, {"params": {"w": jnp.ones(3)}}, {"step": 1})
    assert runs.checkpoints(tmp_path) == []  # at most orbax's temporary directory is left


class _Block(eqx.Module):
    w: jax.Array


class _BlockWithHead(eqx.Module):
    """`_Block` after a release added an optional submodule (as `Transformer.mtp` was)."""

    w: jax.Array
    head: eqx.Module | None = None


def test_a_checkpoint_from_before_a_new_optional_field_restores(tmp_path):
    with state.Writer(tmp_path, keep=1, asynchronous=False) as writer:
        writer.save(1, {"params": [_Block(jnp.arange(3.0))]}, {"step": 1})
        step = writer.path(1)
    template = [_BlockWithHead(jax.ShapeDtypeStruct((3,), jnp.float32))]
    (restored,) = state.restore_state(step, {"params": template})["params"]
    assert isinstance(restored, _BlockWithHead) and restored.head is None
    assert restored.w.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(state.MismatchedState, match=r"has no array 0\.v"):
        state.restore_state(step, {"params": [_Renamed(template[0].w)]})


class _Renamed(eqx.Module):
    v: jax.Array


def test_a_relative_out_directory_checkpoints_and_resumes(tmp_path, monkeypatch, tiny_argv):
    # `make run` writes to the relative runs/default; orbax itself takes absolute paths only.
    monkeypatch.chdir(tmp_path)
    train.main(tiny_argv("run", "--steps", "2", "--checkpoint-every", "2"))
    assert [p.name for p in runs.checkpoints("run")] == ["step_00000002"]
    train.main(["--resume", "run", "--steps", "3", "--no-progress"])
    assert [p.name for p in runs.checkpoints("run")][-1] == "step_00000003"
