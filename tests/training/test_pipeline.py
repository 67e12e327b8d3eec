"""train.py --mesh with a pipeline axis: the GPipe step trains like the one-device run (8 fake
CPU devices), and a pipeline that cannot run is refused before anything loads or compiles."""

import json

import numpy as np
import pytest

import train


def _losses(run_dir) -> list[float]:
    lines = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in sorted(lines, key=lambda r: r["step"]) if "loss" in r]


def _argv(tiny_argv, out, *extra):
    # 4 layers (pipeline=4 needs a multiple of 4); a batch of 8 in 4 micro-batches of 2 rows,
    # which the data / fsdp axes (size 2) split.
    return tiny_argv(
        out, "--override", "n_layers=4", "--batch-size", "8", "--grad-accum", "4",
        "--steps", "3", "--eval-every", "3", "--checkpoint-every", "3", *extra,
    )  # fmt: skip


def test_pipelined_runs_match_one_device(tmp_path, tiny_argv):
    train.main(_argv(tiny_argv, tmp_path / "plain"))
    expected = _losses(tmp_path / "plain")
    assert len(expected) == 3
    for mesh in ("pipeline=4,data=2", "pipeline=2,fsdp=2,tensor=2"):
        out = tmp_path / mesh.replace(",", "_")
        train.main(_argv(tiny_argv, out, "--mesh", mesh, "--remat", "full"))
        # float32 sums in another order (micro-batches in flight, sharded matmuls): rounding
        # of ~1e-6 relative per step, far inside the 1e-3.
        np.testing.assert_allclose(_losses(out), expected, atol=1e-3)


def test_bad_pipeline_is_refused_before_the_run_starts(tmp_path, tiny_argv, capsys):
    # Too few micro-batches: a flag error (argparse's exit status 2) naming the numbers.
    with pytest.raises(SystemExit) as exit_:
        train.main(tiny_argv(tmp_path / "run", "--mesh", "pipeline=4,data=2", "--grad-accum", "2"))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --grad-accum: 2 micro-batches are fewer than the 4 pipeline stages" in err
    with pytest.raises(ValueError, match="unknown mesh axis 'pipe'"):
        train.main(tiny_argv(tmp_path / "run", "--mesh", "pipe=4,data=2"))
    assert not (tmp_path / "run").exists()
