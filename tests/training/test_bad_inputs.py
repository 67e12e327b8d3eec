"""Every bad input named in the training issue gets a clear error and loses no checkpoint."""

import json

import jax
import numpy as np
import pytest

import train
from training import run_dir, run_model
from training.state import checkpoint_files


def test_missing_data_path(tmp_path, tiny_argv):
    with pytest.raises(ValueError, match="does not exist"):
        train.main(tiny_argv(tmp_path / "run", data=tmp_path / "nope.jsonl"))


def test_hub_name_while_offline(tmp_path, tiny_argv):
    argv = tiny_argv(tmp_path / "run")
    argv[argv.index("--data") + 1] = "someone/some-dataset"
    with pytest.raises(ValueError, match="HF_DATASETS_OFFLINE"):
        train.main(argv)


def test_missing_text_column(tmp_path, tiny_argv):
    with pytest.raises(
        ValueError, match=r"matches no format: its columns are \['text'\].* text: 'body'"
    ):
        train.main([*tiny_argv(tmp_path / "run"), "--text-column", "body"])


def test_corpus_smaller_than_one_sequence(tmp_path, tiny_argv):
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b", "c d", "e f"]))
    with pytest.raises(ValueError, match="fewer than one sequence"):
        train.main(tiny_argv(tmp_path / "run", data=small))


def test_tokenizer_larger_than_model_vocab(tmp_path, tiny_argv):
    with pytest.raises(ValueError, match="vocab_size=256"):
        train.main([*tiny_argv(tmp_path / "run"), "--override", "vocab_size=256"])


def test_resume_from_directory_without_a_run(tmp_path, tiny_argv):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"is not a train\.py run directory"):
        train.main([*tiny_argv(tmp_path / "run"), "--resume", str(tmp_path / "empty")])


def test_nan_loss_stops_and_keeps_checkpoints_then_corrupt_resume(tmp_path, tiny_argv):
    run = tmp_path / "run"
    # The warm-up starts at lr 0, so step 1 is harmless (and checkpointed); then an absurd
    # peak learning rate without clipping overflows the weights and the run must stop.
    argv = [*tiny_argv(run), "--steps", "8", "--warmup", "4", "--lr", "1e30", "--clip", "0",
            "--checkpoint-every", "1"]  # fmt: skip
    with pytest.raises(FloatingPointError, match=r"not finite.*last good checkpoint is kept"):
        train.main(argv)
    kept = run_dir.checkpoints(run)
    assert kept and kept[0].name == "step_00000001"
    # No checkpoint holds a non-finite weight: an overflowing update is caught before saving.
    restored = run_model.run_model(run)
    assert all(np.isfinite(np.asarray(w)).all() for w in jax.tree.leaves(restored))
    largest = max(checkpoint_files(kept[-1]), key=lambda f: f.stat().st_size)
    state = largest.read_bytes()

    # Damage the newest checkpoint: resuming says it is corrupt, and names it.
    damaged = bytearray(state)
    damaged[len(damaged) // 2] ^= 0xFF
    largest.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=f"{kept[-1].name} is corrupt"):
        train.main([*argv, "--resume", str(run), "--steps", "9"])
    assert largest.read_bytes() == bytes(damaged)


def test_a_preset_takes_its_tokenizers_vocabulary(tmp_path, tiny_argv):
    """`--model tiny-llama` (vocab_size 256 in the preset) with the default 2048... here
    300-token BPE: the embedding is sized to the tokenizer, no flag to reconcile."""
    argv = tiny_argv(tmp_path / "run", "--steps", "1")
    argv.remove("--override")
    argv.remove("vocab_size=320")
    summary = train.main(argv)
    assert summary.model.config.vocab_size == summary.encoding.n_vocab == 300


def test_model_that_is_neither_a_preset_nor_a_path(tmp_path, tiny_argv, capsys):
    """A typo in --model is named at once, with the presets, not as a missing checkpoint later."""
    with pytest.raises(SystemExit) as exit_:
        train.main([*tiny_argv(tmp_path / "run"), "--model", "tiny-lama"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "argument --model: 'tiny-lama' is neither a zoo preset (" in error
    assert "tiny-llama" in error
    assert not (tmp_path / "run").exists()
