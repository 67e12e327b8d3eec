"""Tiny random GPT-2 and Llama checkpoints made by HF transformers: zoo.load_pretrained matches
transformers' logits, and zoo.save_pretrained writes directories transformers loads back."""

import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zoo
from tests.reference.runner import run_reference

VOCAB = 97
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12)).tolist()
_GPT2 = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}
_LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
}
TIED, UNTIED = {"tie_word_embeddings": True}, {"tie_word_embeddings": False}
MODELS = [
    {"name": "gpt2", "model_type": "gpt2", "config": _GPT2},
    {"name": "gpt2-untied", "model_type": "gpt2", "config": _GPT2 | UNTIED},
    {"name": "llama-gqa-tied", "model_type": "llama", "config": _LLAMA | TIED},
    {
        # MQA, a head_dim that is not hidden/heads, Llama-3 rope scaling, sharded files.
        "name": "llama-mqa-llama3-rope",
        "model_type": "llama",
        "max_shard_size": "20KB",
        "config": _LLAMA
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
        "config": _LLAMA | {"attention_bias": True, "mlp_bias": True, "rope_theta": 1000.0},
    },
]
NAMES = [m["name"] for m in MODELS]


def relative_error(ours, reference) -> float:
    return float(np.max(np.abs(np.asarray(ours) - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Directory with one HF checkpoint per model (and its logits as name.npz), built once."""
    out = tmp_path_factory.mktemp("hf_models")
    run_reference("build", {"models": MODELS, "tokens": TOKENS}, out)
    return out


@pytest.fixture(scope="session")
def loaded(hf_models):
    return {name: zoo.load_pretrained(hf_models / name) for name in NAMES}


@pytest.fixture(scope="session")
def exported(loaded, tmp_path_factory):
    """Our loaded models written back with save_pretrained, and transformers' logits for them."""
    out = tmp_path_factory.mktemp("exported")
    for name, model in loaded.items():
        zoo.save_pretrained(model, out / name)
    run_reference("reload", {"dirs": NAMES, "tokens": TOKENS}, out)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(hf_models, loaded, name):
    reference = np.load(hf_models / f"{name}.npz")["logits"]
    ours = loaded[name](jnp.asarray(TOKENS))
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


def test_sharded_checkpoint_was_sharded(hf_models):
    assert (hf_models / "llama-mqa-llama3-rope" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("name", NAMES)
def test_save_pretrained_reloads_in_transformers(hf_models, exported, name):
    reference = np.load(hf_models / f"{name}.npz")["logits"]
    reloaded = np.load(exported / f"{name}.npz")["logits"]
    assert relative_error(reloaded, reference) < 1e-4


@pytest.mark.parametrize("name", ["gpt2", "llama-mqa-llama3-rope"])
def test_save_then_load_is_exact(loaded, exported, name):
    again = zoo.load_pretrained(exported / name)
    assert again.config == loaded[name].config
    for a, b in zip(jax.tree.leaves(loaded[name]), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)


def test_base_model_files_without_prefix_load(hf_models, tmp_path):
    """The original GPT-2 files name tensors "h.0.attn..." (no "transformer.")."""
    shutil.copy(hf_models / "gpt2" / "config.json", tmp_path / "config.json")
    tensors = load_file(hf_models / "gpt2" / "model.safetensors")
    renamed = {name.removeprefix("transformer."): w for name, w in tensors.items()}
    save_file(renamed, tmp_path / "model.safetensors")
    reference = np.load(hf_models / "gpt2.npz")["logits"]
    assert relative_error(zoo.load_pretrained(tmp_path)(jnp.asarray(TOKENS)), reference) < 1e-4


def test_dtype_sets_params_and_compute(hf_models):
    model = zoo.load_pretrained(hf_models / "llama-gqa-tied", dtype=jnp.bfloat16)
    params = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert {p.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
    assert model(jnp.asarray(TOKENS)).dtype == jnp.bfloat16
