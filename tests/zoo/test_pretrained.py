"""Tiny random GPT-2, Llama and Mixtral checkpoints made by HF transformers: zoo.load_pretrained
matches transformers' logits, and zoo.save_pretrained writes directories transformers loads back.

One reference job (one subprocess) serves the whole session; forwards are jitted once per config.
"""

import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zoo
from layers.rotary import RopeScaling
from tests.reference.runner import run_reference
from tests.zoo.random_model import HF_LLAMA, VOCAB, random_model

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12)).tolist()
_GPT2 = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
TIED, UNTIED = {"tie_word_embeddings": True}, {"tie_word_embeddings": False}
# Sliding window 5 < 12 tokens, so the window matters.
_MIXTRAL = HF_LLAMA | {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5}
MODELS = [
    {"name": "gpt2", "model_type": "gpt2", "config": _GPT2},
    {"name": "gpt2-untied", "model_type": "gpt2", "config": _GPT2 | UNTIED},
    {"name": "llama-gqa-tied", "model_type": "llama", "config": HF_LLAMA | TIED},
    {
        # MQA, a head_dim that is not hidden/heads, Llama-3 rope scaling, sharded files.
        "name": "llama-mqa-llama3-rope",
        "model_type": "llama",
        "max_shard_size": "20KB",
        "config": HF_LLAMA
        | {
            "num_key_value_heads": 1,
            "head_dim": 16,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    },
    {
        "name": "llama-bias",
        "model_type": "llama",
        "config": HF_LLAMA | {"attention_bias": True, "mlp_bias": True, "rope_theta": 1000.0},
    },
    {"name": "mixtral", "model_type": "mixtral", "config": _MIXTRAL},
    # The same weights (same seed) with the experts stacked as transformers 5 holds them.
    {"name": "mixtral-fused", "model_type": "mixtral", "config": _MIXTRAL, "fused": True},
]
NAMES = [m["name"] for m in MODELS]
# Models made by the zoo (random, every weight perturbed), written with save_pretrained.
_SMALL = {"vocab_size": VOCAB, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64}
ZOO_CONFIGS = {
    "zoo-gpt2": zoo.preset("tiny-gpt2", **_SMALL),
    "zoo-gpt2-untied": zoo.preset("tiny-gpt2", **_SMALL, tie_embeddings=False),
    "zoo-llama-gqa-tied": zoo.preset("tiny-llama", **_SMALL, d_ff=48, tie_embeddings=True),
    "zoo-llama-llama3-rope-bias": zoo.preset(
        "tiny-llama",
        **_SMALL,
        d_ff=48,
        n_kv_heads=1,
        head_dim=16,
        bias=True,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=4.0, original_max_seq_len=16),
    ),
    "zoo-mixtral-window": zoo.preset(
        "tiny-moe", **_SMALL, d_ff=48, moe_d_ff=None, n_experts_per_token=3, sliding_window=4
    ),
}
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def relative_error(ours, reference) -> float:
    return float(np.max(np.abs(np.asarray(ours) - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="session")
def zoo_models():
    return {name: random_model(c, i) for i, (name, c) in enumerate(ZOO_CONFIGS.items())}


@pytest.fixture(scope="session")
def reference(tmp_path_factory, zoo_models):
    """One reference job: HF builds a checkpoint per MODELS entry (logits in name.npz) and loads
    each zoo model we saved (logits in zoo-....npz)."""
    out = tmp_path_factory.mktemp("reference")
    for name, model in zoo_models.items():
        zoo.save_pretrained(model, out / name)
    run_reference("tiny", {"models": MODELS, "dirs": list(ZOO_CONFIGS), "tokens": TOKENS}, out)
    return out


@pytest.fixture(scope="session")
def loaded(reference):
    return {name: zoo.load_pretrained(reference / name) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(reference, loaded, name):
    reference = np.load(reference / f"{name}.npz")["logits"]
    ours = forward(loaded[name], jnp.asarray(TOKENS))
    assert ours.shape == reference.shape
    assert relative_error(ours, reference) < 1e-4


def test_config_is_read_from_the_checkpoint(loaded):
    gpt2, llama = loaded["gpt2"].config, loaded["llama-mqa-llama3-rope"].config
    assert (gpt2.position, gpt2.norm, gpt2.tie_embeddings, gpt2.max_seq_len) == (
        "learned",
        "layernorm",
        True,
        64,
    )
    assert (llama.n_kv_heads, llama.head_dim, llama.rope_theta) == (1, 16, 500_000.0)
    assert llama.rope_scaling.factor == 4.0 and llama.rope_scaling.original_max_seq_len == 16
    assert not llama.tie_embeddings and loaded["llama-bias"].config.bias
    mixtral = loaded["mixtral"].config
    assert (mixtral.n_experts, mixtral.n_experts_per_token, mixtral.sliding_window) == (4, 2, 5)
    assert (mixtral.router_scoring, mixtral.router_normalize) == ("softmax", True)


def test_sharded_checkpoint_was_sharded(reference):
    assert (reference / "llama-mqa-llama3-rope" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("name", list(ZOO_CONFIGS))
def test_save_pretrained_reloads_in_transformers(zoo_models, reference, name):
    reloaded = np.load(reference / f"{name}.npz")["logits"]
    assert relative_error(reloaded, forward(zoo_models[name], jnp.asarray(TOKENS))) < 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_load_save_load_is_exact(loaded, tmp_path, name):
    zoo.save_pretrained(loaded[name], tmp_path)
    again = zoo.load_pretrained(tmp_path)
    assert again.config == loaded[name].config
    for a, b in zip(jax.tree.leaves(loaded[name]), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)


def test_base_model_files_without_prefix_load(reference, tmp_path):
    """The original GPT-2 files name tensors "h.0.attn..." (no "transformer.")."""
    shutil.copy(reference / "gpt2" / "config.json", tmp_path / "config.json")
    tensors = load_file(reference / "gpt2" / "model.safetensors")
    renamed = {name.removeprefix("transformer."): w for name, w in tensors.items()}
    save_file(renamed, tmp_path / "model.safetensors")
    reference = np.load(reference / "gpt2.npz")["logits"]
    assert (
        relative_error(forward(zoo.load_pretrained(tmp_path), jnp.asarray(TOKENS)), reference)
        < 1e-4
    )


def test_policy_sets_params_and_compute(reference):
    policy = zoo.Policy.of_dtype("bfloat16")
    model = zoo.load_pretrained(reference / "llama-gqa-tied", policy=policy)
    params = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert {p.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
    assert model(jnp.asarray(TOKENS)).dtype == jnp.bfloat16
