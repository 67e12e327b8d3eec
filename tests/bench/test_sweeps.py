"""bench/attention.py and bench/flash_blocks.py keep going past what fails: the score-matrix
guard for the materialising kernels, one error per row, time budgets."""

import dataclasses
import math
import time

import jax.numpy as jnp
import pytest

from bench import attention, flash_blocks
from bench.harness import Table
from layers.kernels import BlockSizes, xla_attention
from layers.kernels.flash.config import DEFAULT_BLOCK_SIZES

TINY = attention.Shape(batch=1, seq=32, heads=2, kv_heads=1, head_dim=16, dtype="float32")


def test_xla_and_naive_are_guarded_by_their_score_matrices():
    """The issue's case: 4 x 16 heads at seq 8192 is a 17 GB float32 score matrix; its
    forward+backward does not fit an 80 GB GPU, its forward and seq 2048 do."""
    big = attention.Shape(batch=4, seq=8192, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16")
    assert round(big.score_bytes() / 1e9) == 17
    assert not attention.fits_in_memory(big, "fwd+bwd", 80e9)
    assert attention.fits_in_memory(big, "fwd", 80e9)
    small = attention.Shape(
        batch=4, seq=2048, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16"
    )
    assert attention.fits_in_memory(small, "fwd+bwd", 80e9)


def test_materialising_kernels_that_do_not_fit_are_skipped_not_run(monkeypatch):
    monkeypatch.setattr(attention, "device_memory_bytes", lambda: 1e3)
    table = Table("t", "t")
    rates = attention.measure(table, TINY, ("naive", "xla"), 1e12, repeats=1)
    assert rates == {}
    assert len(table.rows) == 4
    assert all(row["note"].startswith("skipped: needs") for row in table.rows)
    assert all(math.isnan(row["measured ms"]) for row in table.rows)


def test_a_failing_kernel_is_recorded_and_the_others_run(monkeypatch):
    def broken(q, k, v, mask):
        raise ValueError("this kernel refuses the shape")

    monkeypatch.setattr(
        attention, "kernels", lambda names: {"broken": broken, "xla": xla_attention}
    )
    table = Table("t", "t")
    rates = attention.measure(table, TINY, ("broken", "xla"), 1e12, repeats=1)
    assert set(rates) == {("xla", "fwd"), ("xla", "fwd+bwd")}
    notes = {(row["kernel"], row["pass"]): row["note"] for row in table.rows}
    assert notes["broken", "fwd"] == "error: ValueError: this kernel refuses the shape"
    assert notes["xla", "fwd+bwd"] == ""


def test_nothing_starts_after_the_deadline():
    table = Table("t", "t")
    rates = attention.measure(table, TINY, ("xla",), 1e12, repeats=1, deadline=time.monotonic())
    assert rates == {}
    assert [row["note"] for row in table.rows] == ["not run: stage budget spent"] * 2


def test_gpu_sweep_starts_with_the_defaults_then_the_atomic_backward():
    settings = flash_blocks.settings(gpu=True)
    assert settings[0] == DEFAULT_BLOCK_SIZES
    assert settings[0].backward_dq == "separate"
    assert settings[1] == dataclasses.replace(DEFAULT_BLOCK_SIZES, backward_dq="atomic")
    assert len(set(settings)) == len(settings)


@pytest.mark.parametrize(
    ("budget_s", "notes"), [(600.0, ["", "error", ""]), (0.0, ["", "not", "not"])]
)
def test_sweep_records_failures_and_stops_at_its_budget(monkeypatch, budget_s, notes):
    three = [DEFAULT_BLOCK_SIZES, BlockSizes(block_q=16), BlockSizes(block_k=16)]
    monkeypatch.setattr(flash_blocks, "settings", lambda gpu: three)

    def fake_grad(mask, blocks):  # no flash compile: the sweep's bookkeeping is under test
        if blocks == three[1]:
            raise RuntimeError("out of shared memory")
        return lambda q, k, v: jnp.sum(q)

    monkeypatch.setattr(flash_blocks, "_grad", fake_grad)

    class Fixed:
        def matmul_flops(self, dtype):
            return 1e12

    table = flash_blocks.run(Fixed(), budget_s=budget_s)
    assert [row["note"].split(":")[0].split(" ")[0] for row in table.rows] == notes
    measured = [not math.isnan(row["measured ms"]) for row in table.rows]
    assert measured == [note == "" for note in notes]
