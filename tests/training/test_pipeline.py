"""train.py --mesh with a pipeline axis: each schedule trains like the one-device run (8 fake CPU
devices), the micro-batch count is chosen from the mesh and batch unless given (and printed),
and a pipeline that cannot run is refused before anything loads or compiles."""

import json

import numpy as np
import pytest

import train


def _losses(run_dir) -> list[float]:
    lines = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in sorted(lines, key=lambda r: r["step"]) if "loss" in r]


def _argv(tiny_argv, out, *extra):
    # 8 layers (interleaved on 4 stages: 2 chunks of one layer each); a batch of 8.
    return tiny_argv(
        out, "--override", "n_layers=8", "--batch-size", "8", "--steps", "3",
        "--eval-every", "3", "--checkpoint-every", "3", *extra,
    )  # fmt: skip


def test_pipelined_runs_match_one_device(tmp_path, tiny_argv, capsys):
    train.main(_argv(tiny_argv, tmp_path / "plain"))
    expected = _losses(tmp_path / "plain")
    assert len(expected) == 3
    runs = [
        # No --microbatches: the most from 4 up to 16 that split the 8 rows over the 2 data
        # shards is 4.
        ("pipeline=4,data=2", "1f1b", []),
        ("pipeline=4,data=2", "interleaved", ["--microbatches", "4"]),
        # Gradient accumulation composes: 2 parts of 4 rows, each 2 micro-batches of 2.
        (
            "pipeline=2,fsdp=2,tensor=2",
            "gpipe",
            ["--grad-accum", "2", "--microbatches", "2", "--remat", "full"],
        ),
    ]
    for mesh, schedule, extra in runs:
        out = tmp_path / f"{mesh}-{schedule}".replace(",", "_")
        flags = ["--mesh", mesh, "--pipeline-schedule", schedule, *extra]
        train.main(_argv(tiny_argv, out, *flags))
        # float32 sums in another order (micro-batches in flight, sharded matmuls): rounding
        # of ~1e-6 relative per step, far inside the 1e-3.
        np.testing.assert_allclose(_losses(out), expected, atol=1e-3, err_msg=schedule)
    printed = capsys.readouterr().out
    assert "pipeline: 4 stages, 1f1b schedule, 4 micro-batches of 2 sequences (the most" in printed
    assert "interleaved schedule (2 virtual stages per device), 4 micro-batches" in printed


def test_grad_accum_composes_with_the_default_microbatches():
    from training.args import Args, accumulation

    args = Args(mesh="pipeline=4,data=2", batch_size=64, grad_accum=2)
    # Each part of 32 rows: the most micro-batches from 4 up to 16 with whole rows per data
    # shard (2) is 16.
    assert accumulation(args) == (2, 16)
    assert accumulation(Args(mesh="pipeline=4,data=2")) == (1, 8)  # train.py's defaults


def test_bad_pipeline_is_refused_before_the_run_starts(tmp_path, tiny_argv, capsys):
    cases = [
        (["--microbatches", "2"], "argument --microbatches: 2 micro-batches are fewer than the "
         "4 pipeline stages"),
        (["--batch-size", "4"], "argument --batch-size: 4 (in --grad-accum 1 parts of 4) splits "
         "into no count of micro-batches from the 4 pipeline stages"),
        (["--microbatches", "8", "--batch-size", "8"], "argument --microbatches: 8 micro-batches"
         " of each --grad-accum part of 8 sequences"),
    ]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(SystemExit) as exit_:  # a flag error: argparse's exit status 2
            train.main(tiny_argv(tmp_path / "run", "--mesh", "pipeline=4,data=2", *extra))
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(tiny_argv(tmp_path / "run", "--pipeline-schedule", "1f1b"))
    assert "argument --pipeline-schedule: 1f1b applies to a pipeline" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(tiny_argv(tmp_path / "run", "--mesh", "pipe=4,data=2"))
    assert "argument --mesh: unknown mesh axis 'pipe'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
