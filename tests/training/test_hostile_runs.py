"""Run directories and data files a user damaged or named loosely (issue 26): a resume says when
it cannot check a step's files, metrics.jsonl stays one timeline across a resume from an earlier
step, a legacy run that cannot be converted says why and keeps nothing half-written, and a data
file's format is never guessed from a missing suffix."""

import hashlib
import json
import shutil

import jax
import pytest

import train
import zoo
from cli.sample import main as sample
from data.datasets import load_text
from tests.training.conftest import stopped_copy
from tests.training.test_resume import _bare_resume, _write_equinox_format
from training import convert_run, run_dir
from training.optimizer import adamw
from training.state import SHA256, UncheckedState
from training.step import split_model

CONFIG = zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64)


def snapshot(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*")
            if p.is_file()}  # fmt: skip


def _loss_steps(path):
    """The steps of the training-loss records (one per step in one timeline)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


def test_a_step_without_its_sha256_record_is_read_with_a_warning(tmp_path):
    params, _ = split_model(zoo.Transformer(CONFIG, key=jax.random.key(0)))
    optimizer = adamw(lambda _: 1e-3)
    run_dir.save(tmp_path, params=params, opt_state=optimizer.init(params), step=1,
                 data_position=4, rng=jax.random.key(0), config=CONFIG,
                 policy=zoo.Policy())  # fmt: skip
    step = run_dir.latest(tmp_path)
    (step / SHA256).unlink()
    with pytest.warns(UncheckedState, match=r"has no sha256\.json: its files cannot be checked"):
        restored = run_dir.restore(
            tmp_path, model=run_dir.abstract_model(CONFIG, zoo.Policy()), optimizer=optimizer
        )
    assert restored.step == 1


def test_resuming_from_an_earlier_step_sets_the_abandoned_timeline_aside(
    tmp_path, tiny_argv, full_run, capsys
):
    full_dir, _ = full_run
    run = tmp_path / "run"
    shutil.copytree(full_dir, run, ignore=shutil.ignore_patterns(".lock"))
    # Checkpoint 6 lost (a crash after its metrics, or a user going back): resume from step 3.
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    train.main(tiny_argv(tmp_path / "x", "--steps", "6", "--resume", str(run)))
    assert _loss_steps(run / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]  # once each, in order
    header, *abandoned = (run / "metrics.abandoned.jsonl").read_text().splitlines()
    assert json.loads(header)["resumed_at_step"] == 3
    assert {json.loads(line)["step"] for line in abandoned} == {4, 5, 6}
    assert "moved to metrics.abandoned.jsonl" in capsys.readouterr().out


@pytest.fixture
def legacy_run(tmp_path, full_run):
    run = stopped_copy(full_run[0], tmp_path / "old", step=3)
    _write_equinox_format(run)
    return run


def _rewrite_meta(run, change):
    (step,) = run_dir.checkpoints(run)
    meta = json.loads((step / "meta.json").read_text())
    (step / "meta.json").write_text(json.dumps(change(meta)))


def test_convert_run_of_a_meta_without_config(legacy_run):
    _rewrite_meta(legacy_run, lambda m: {k: v for k, v in m.items() if k != "config"})
    before = snapshot(legacy_run)
    with pytest.raises(ValueError, match=r"meta\.json lacks the field 'config'"):
        convert_run.convert(legacy_run)
    assert snapshot(legacy_run) == before
    (run_dir.checkpoints(legacy_run)[0] / "meta.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"meta\.json holds a JSON list, not an object"):
        convert_run.convert(legacy_run)


def test_convert_run_of_a_garbage_state_leaves_no_staging_directory(legacy_run):
    (step,) = run_dir.checkpoints(legacy_run)
    (step / "state.eqx").write_bytes(b"not an equinox file" * 10)
    digest = hashlib.sha256((step / "state.eqx").read_bytes()).hexdigest()
    _rewrite_meta(legacy_run, lambda m: m | {"sha256": digest})
    before = snapshot(legacy_run)
    with pytest.raises(ValueError, match=r"state\.eqx matches its SHA-256 but does not hold"):
        convert_run.convert(legacy_run)
    assert not (legacy_run / "checkpoints.orbax").exists()
    assert snapshot(legacy_run) == before


@pytest.mark.parametrize(("name", "message"), [("corpus", "has no suffix"), ("c.data", "'.data'")])
def test_a_data_file_whose_format_is_unknown(tmp_path, name, message):
    (tmp_path / name).write_text("some text\n")
    with pytest.raises(ValueError, match=rf"{message}, so its format is unknown; name it .*\.txt"):
        load_text(str(tmp_path / name))


def test_a_run_that_lost_its_tokenizer_says_which_file_to_put_back(tmp_path, full_run, cache_dir):
    """--resume used to stop with pathlib's TypeError, `sample --model RUN` to blame --prompt;
    both name the run and the missing file now, and change nothing in it."""
    run = stopped_copy(full_run[0], tmp_path / "run", step=3)
    (run / "tokenizer.tiktoken").unlink()
    before = snapshot(run)
    missing = rf"run {str(run)!r} records no tokenizer: neither tokenizer.tiktoken nor "
    with pytest.raises(ValueError, match=missing + r".*Put the run's tokenizer back"):
        train.main(_bare_resume(run, cache_dir))
    with pytest.raises(ValueError, match=missing):
        sample(["--model", str(run), "--prompt", "def main("])
    after = snapshot(run)
    assert after.pop(".lock") == b""  # the lock, released; every file of the run kept
    assert after == before
