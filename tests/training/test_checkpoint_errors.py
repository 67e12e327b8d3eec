"""A checkpoint that cannot be restored as asked gets an error naming what differs, and every
file of it stays as it was: another model's checkpoint, another optimizer's state, an
incomplete or damaged orbax directory, a mesh that cannot hold the state."""

import hashlib
import json
import logging
import shutil

import jax
import jax.numpy as jnp
import pytest
from absl import logging as absl_logging

import shard
import zoo
from training import run_dir
from training.optimizer import adamw
from training.state import Writer, checkpoint_files, read_meta, restore_state
from training.step import split_model

CONFIG = zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=2, d_model=32, d_ff=64)


def snapshot(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*")
            if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory holding one checkpoint (step 1) of CONFIG with AdamW (clipping on)."""
    root = tmp_path_factory.mktemp("saved")
    params, _ = split_model(zoo.Transformer(CONFIG, key=jax.random.key(0)))
    opt_state = adamw(lambda _: 1e-3).init(params)
    run_dir.save(root, params=params, opt_state=opt_state, step=1, data_position=4,
                 rng=jax.random.key(0), config=CONFIG, policy=zoo.Policy())  # fmt: skip
    return root


def restore(run, config=CONFIG, clip=1.0, placement=None):
    model = run_dir.abstract_model(config, zoo.Policy())
    optimizer = adamw(lambda _: 1e-3, clip=clip)
    return run_dir.restore(run, model=model, optimizer=optimizer, placement=placement)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("another model", r"written for a different model config .*'n_layers': 1"),
        ("another optimizer", r"another state .*opt_state/ has no array 0\.0\.count.*--clip"),
        ("tensor=8 mesh", r"does not divide by mesh axis"),
        ("a file missing", r"1 of its \d+ files are missing"),
        ("unfinalized", r"not a finalized orbax checkpoint \(no _CHECKPOINT_METADATA"),
    ],
)
def test_a_checkpoint_that_cannot_be_restored_says_why_and_stays(saved, tmp_path, case, message):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    step = run_dir.latest(run)
    if case == "a file missing":
        max(checkpoint_files(step / "params"), key=lambda f: f.stat().st_size).unlink()
    if case == "unfinalized":
        (step / "_CHECKPOINT_METADATA").unlink()
    before = snapshot(run)
    kwargs = {
        "another model": {"config": CONFIG.replace(n_layers=2)},
        "another optimizer": {"clip": 0.0},
        "tensor=8 mesh": {
            "placement": shard.Placement(shard.mesh(tensor=8), shard.ShardingRules.preset("tp"))
        },
    }.get(case, {})
    with pytest.raises(ValueError, match=message):
        restore(run, **kwargs)
    assert snapshot(run) == before


def test_an_unfinished_write_is_not_a_checkpoint(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    partial = run / "checkpoints" / "step_00000002.orbax-checkpoint-tmp"
    shutil.copytree(run_dir.latest(run), partial)
    assert run_dir.latest(run).name == "step_00000001"
    assert restore(run).step == 1


def test_reading_a_step_prints_no_orbax_metadata_warning(tmp_path, caplog):
    """Resuming reads each item of a finalized step; orbax would warn on every resume that the
    item directory has no step metadata (it is one level up). A missing file elsewhere still
    warns."""
    with Writer(tmp_path, keep=1, asynchronous=False) as writer:
        writer.save(1, {"params": {"w": jnp.ones(3)}}, {"step": 1})
    (step,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    with caplog.at_level(logging.WARNING):
        assert read_meta(step) == {"step": 1}
        template = {"params": {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}}
        restore_state(step, template)
        absl_logging.warning("Metadata file does not exist: %s", tmp_path / "x" / "y")
    warned = [r.getMessage() for r in caplog.records if "Metadata file" in r.getMessage()]
    assert warned == [f"Metadata file does not exist: {tmp_path / 'x' / 'y'}"]


def _rewrite(step, name, text):
    """Replace file `name` of `step` and record its new SHA-256: what a file author can do."""
    (step / name).write_text(text)
    record = json.loads((step / "sha256.json").read_text())
    record[name] = hashlib.sha256((step / name).read_bytes()).hexdigest()
    (step / "sha256.json").write_text(json.dumps(record))


def _meta(change):
    return lambda step: _rewrite(step, "meta/metadata", json.dumps(change(read_meta(step))))


def _record(change):
    def edit(step):
        record = json.loads((step / "sha256.json").read_text())
        (step / "sha256.json").write_text(json.dumps(change(record)))

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_meta(lambda m: [m]), r"meta/metadata holds a JSON list, not an object"),
        (_meta(lambda m: m | {"step": "3"}), r"meta/metadata: 'step' is '3' \(a str\)"),
        (_meta(lambda m: m | {"step": True}), r"meta/metadata: 'step' is True \(a bool\)"),
        (_meta(lambda m: m | {"data_position": -1}), r"'data_position' is -1, a count"),
        (_meta(lambda m: {k: v for k, v in m.items() if k != "data_position"}),
         r"meta/metadata lacks the field 'data_position'"),
        (_meta(lambda m: m | {"param_dtype": "int8"}), r"'param_dtype' is 'int8'; the Policy"),
        (_meta(lambda m: m | {"config": [1]}), r"'config' is \[1\] \(a list\)"),
        (_meta(lambda m: m | {"resume_from": "x"}),
         r"meta/metadata holds fields the zoo does not write: \['resume_from'\]"),
        (_record(lambda r: []), r"sha256.json holds \[\], not an object"),
        (_record(lambda r: {}), r"sha256.json holds \{\}, not an object"),
        (_record(lambda r: r | {"../../x": "0" * 64}), r"names '\.\./\.\./x', which is not a path"),
        (_record(lambda r: r | {"meta/metadata": 5}), r"SHA-256 of 'meta/metadata' is 5, not 64"),
        (_record(lambda r: {k: v for k, v in r.items() if k != "meta/metadata"}),
         r"1 files are not in .*sha256.json \(e.g. meta/metadata\): added after"),
        (lambda step: _rewrite(step, "_CHECKPOINT_METADATA", "{"),
         r"_CHECKPOINT_METADATA is not readable JSON"),
        (lambda step: _rewrite(step, "_CHECKPOINT_METADATA", '{"item_handlers": 5}'),
         r"_CHECKPOINT_METADATA is not orbax step metadata"),
    ],
)  # fmt: skip
def test_checkpoint_metadata_reads_only_what_it_declares(saved, tmp_path, edit, message):
    """Each metadata file of a step (training/checkpoint_metadata.py): malformed or unexpected
    content is an error naming the file, and the step stays as it is."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    edit(run_dir.latest(run))
    before = snapshot(run)
    for read in (run_dir.checkpoint_config, restore):
        with pytest.raises(ValueError, match=message):
            read(run)
    assert snapshot(run) == before


def test_a_writer_refuses_a_root_with_malformed_step_metadata(saved, tmp_path):
    """orbax's manager reads every step's metadata at the first save after a resume: named when
    the writer opens, nothing written or deleted."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    _rewrite(run_dir.latest(run), "_CHECKPOINT_METADATA", "[]")
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"step_00000001/_CHECKPOINT_METADATA is not orbax step"):
        Writer(run / "checkpoints", keep=1, asynchronous=False)
    assert snapshot(run) == before
