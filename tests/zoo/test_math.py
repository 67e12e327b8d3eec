"""Transformer math: FLOPs, bytes and rooflines."""

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
