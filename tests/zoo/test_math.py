"""Transformer math: FLOPs, bytes and rooflines."""

import types

import pytest

import zoo
from zoo import math as zm


def test_training_flops_are_six_n_plus_attention():
    config = zoo.preset("gpt2-124m")
    seq = 1024
    n = zm.matmul_params(config)
    attention = 12 * config.n_layers * seq * config.d_model
    assert zm.training_flops_per_token(config, seq, causal=False) == pytest.approx(
        6 * n + attention
    )
    assert zm.training_flops_per_token(config, seq, causal=True) == pytest.approx(
        6 * n + attention / 2
    )


def test_matmul_params_include_the_head_once():
    config = zoo.preset("gpt2-124m")
    embeddings = config.vocab_size * config.d_model + config.max_seq_len * config.d_model
    non_embedding = zm.param_count(config) - embeddings
    norms_and_biases = non_embedding - (
        zm.matmul_params(config) - config.vocab_size * config.d_model
    )
    assert 0 < norms_and_biases < 0.01 * non_embedding


def test_kv_cache_bytes():
    config = zoo.preset("llama3-8b")
    # 32 layers x 2 (k, v) x 8 heads x 128 dims x 2 bytes = 128 KiB per token.
    assert zm.kv_cache_bytes_per_token(config, zoo.Policy(compute_dtype="bfloat16")) == 131072


def test_roofline_picks_the_binding_limit():
    hw = zm.HARDWARE["h100"]
    bf16 = zoo.Policy.of_dtype("bfloat16")
    decode = zm.decode_step_roofline(zoo.preset("llama3-8b"), 1, 1024, hw, bf16)
    assert decode.bound == "memory"
    assert decode.time_s == pytest.approx(decode.bytes / hw.bandwidth)
    train = zm.training_step_roofline(
        zoo.preset("llama3-8b"), 8, 4096, hw, zoo.Policy(compute_dtype="bfloat16")
    )
    assert train.bound == "compute"


def test_unknown_dtype_peak_is_an_error():
    with pytest.raises(ValueError, match="no peak"):
        zm.HARDWARE["tpu-v4"].peak_flops("float16")


def test_memory_estimate_shrinks_with_remat():
    config, bf16 = zoo.preset("llama3-1b"), zoo.Policy(compute_dtype="bfloat16")
    full = zm.training_memory_bytes(config, 4, 2048, bf16.replace(remat="full"))
    none = zm.training_memory_bytes(config, 4, 2048, bf16)
    assert full < none


def test_measure_this_machine_reports_positive_ceilings():
    hw = zm.measure_this_machine(("float32",))
    assert hw.peak_flops("float32") > 1e8 and hw.bandwidth > 1e8


def test_a_ceiling_is_the_fastest_timed_run_after_the_compiling_one(monkeypatch):
    """zoo.math's clock is scripted (its own `time`, not the process's): the untimed first
    call, then runs of 4, 1, 3, 9 and 5 s."""
    calls = []
    ticks = iter([0.0, 4.0, 10.0, 11.0, 20.0, 23.0, 30.0, 39.0, 40.0, 45.0])
    monkeypatch.setattr(zm, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert zm.fastest_seconds(lambda x: calls.append(x) or x, 7) == 1.0
    assert calls == [7] * 6


@pytest.mark.parametrize(
    "k, verify_cost, draft_cost", [(1, 1.0, 0.0), (4, 1.34, 0.064), (6, 1.7, 0.1)]
)
def test_the_acceptance_needed_for_a_speedup_reaches_it(k, verify_cost, draft_cost):
    """Leviathan et al.'s expected speedup at the rate found is the goal; a rate 0.01 lower
    falls short (the speedup grows with the rate)."""
    costs = dict(verify_cost=verify_cost, draft_cost=draft_cost)
    rate = zm.speculative_acceptance_needed(1.3, k, **costs)
    assert zm.speculative_speedup(rate, k, **costs) == pytest.approx(1.3, abs=1e-5)
    assert zm.speculative_speedup(rate - 0.01, k, **costs) < 1.3
    # One draft per step cannot give 1.3x when verifying costs 1.7 steps: 2 tokens at most.
    assert zm.speculative_acceptance_needed(1.3, 1, verify_cost=1.7) is None
