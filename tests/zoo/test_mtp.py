"""DeepSeek-V3's multi-token-prediction module (zoo/mtp.py): loaded from its HF layer (the layer
after the last), it computes the paper's equations on the tensors written there; save_pretrained
writes it back; a checkpoint without one loads with `mtp` None."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import zoo
from zoo.mtp import MTP

CONFIG = zoo.preset("tiny-deepseek-v3")  # 3 layers: the MTP module is layer 3
POLICY = zoo.Policy(attention="naive")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny DeepSeek-V3 with an MTP module, written with save_pretrained."""
    model = zoo.Transformer(CONFIG, policy=POLICY, key=jax.random.key(0))
    model = model.with_mtp(MTP(CONFIG, policy=POLICY, key=jax.random.key(1)))
    directory = tmp_path_factory.mktemp("deepseek-mtp")
    zoo.save_pretrained(model, directory)
    return model, directory


def rms(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + CONFIG.norm_eps) * scale


def test_the_loaded_module_computes_the_equations_on_the_written_tensors(saved):
    """h' = Block(eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)])), logits = head(norm(h')), with
    emb, enorm, hnorm, eh_proj, shared_head.norm and shared_head.head read from the file in
    numpy; Block is the loaded module's own decoder layer run on the numpy input (its
    tensors are the main layout's, renamed: the round trip below checks them)."""
    _, directory = saved
    loaded = zoo.load_pretrained(directory, policy=POLICY)
    tensors = load_file(f"{directory}/model.safetensors")
    layer = lambda name: tensors[f"model.layers.{CONFIG.n_layers}.{name}"]  # noqa: E731
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 7))  # t_{i+1} at each position i
    hidden = rng.normal(size=(2, 7, CONFIG.d_model)).astype(np.float32)  # h_i
    embedded = rms(layer("embed_tokens.weight")[tokens], layer("enorm.weight"))
    joined = np.concatenate([embedded, rms(hidden, layer("hnorm.weight"))], axis=-1)
    block_input = joined @ layer("eh_proj.weight").T.astype(np.float64)
    body = loaded.mtp.body
    out = body.forward(jnp.asarray(tokens), embeddings=jnp.asarray(block_input, jnp.float32))
    expected = rms(np.asarray(out.hidden), layer("shared_head.norm.weight"))
    expected = expected @ layer("shared_head.head.weight").T.astype(np.float64)
    ours = loaded.mtp.forward(jnp.asarray(tokens), jnp.asarray(hidden))
    # float32 against float64: each logit sums 2 * d_model products after two RMS norms.
    tolerance = 2 * CONFIG.d_model * np.finfo(np.float32).eps * np.abs(expected).max()
    np.testing.assert_allclose(np.asarray(ours.logits), expected, atol=tolerance, rtol=0)
    # The module's h' is the block's output on that input (before the head's norm).
    scale = np.abs(np.asarray(out.hidden)).max()
    np.testing.assert_allclose(
        np.asarray(ours.hidden), np.asarray(out.hidden),
        atol=2 * CONFIG.d_model * np.finfo(np.float32).eps * scale, rtol=0,
    )  # fmt: skip


def test_save_pretrained_writes_the_module_as_the_layer_after_the_last(saved):
    model, directory = saved
    with open(f"{directory}/config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    names = set(load_file(f"{directory}/model.safetensors"))
    prefix = f"model.layers.{CONFIG.n_layers}."
    own = {
        "enorm.weight", "hnorm.weight", "eh_proj.weight", "embed_tokens.weight",
        "shared_head.norm.weight", "shared_head.head.weight", "input_layernorm.weight",
        "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight",
    }  # fmt: skip
    assert {prefix + name for name in own} <= names
    assert not any(n.startswith(f"model.layers.{CONFIG.n_layers + 1}.") for n in names)
    loaded = zoo.load_pretrained(directory, policy=POLICY)
    ours, theirs = jax.tree.leaves(model.mtp), jax.tree.leaves(loaded.mtp)
    assert len(ours) == len(theirs)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_checkpoint_without_the_module_loads_without_it(tmp_path, without_runtime_typechecks):
    model = zoo.Transformer(CONFIG, policy=POLICY, key=jax.random.key(0))
    zoo.save_pretrained(model, tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["num_nextn_predict_layers"] == 0
    assert zoo.load_pretrained(tmp_path, policy=POLICY).mtp is None
    other = zoo.preset("tiny-deepseek-v3", d_model=32, head_dim=24)
    with pytest.raises(ValueError, match=r"MTP module of d_model 32 .* does not fit"):
        model.with_mtp(MTP(other, key=jax.random.key(1)))


def test_the_modules_table_and_head_are_the_models_when_equal(saved, tmp_path):
    """DeepSeek-V3's checkpoints repeat the main token table and head in the MTP layer: loaded
    once, not twice."""
    model, _ = saved
    shared = eqx.tree_at(
        lambda m: (m.body.embed.weight, m.body.lm_head.weight),
        model.mtp,
        (model.embed.weight, model.lm_head.weight),
    )
    zoo.save_pretrained(model.with_mtp(shared), tmp_path)
    loaded = zoo.load_pretrained(tmp_path, policy=POLICY)
    assert loaded.mtp.body.embed.weight is loaded.embed.weight
    assert loaded.mtp.body.lm_head.weight is loaded.lm_head.weight
