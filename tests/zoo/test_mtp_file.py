"""A trained multi-token-prediction module's own file (zoo/pretrained/mtp_file.py): it round-trips
exactly, holds neither the token table nor the head (the model's own, shared on load, quantized
ones included), and a file for another model, not such a file, or a module whose tables are not
the model's is a clear error."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import zoo
from zoo.mtp import MTP

TIED = zoo.preset("tiny-llama")
UNTIED = dataclasses.replace(TIED, tie_embeddings=False)


def with_module(config):
    """A model of `config` with a random module that reads the model's token table and head."""
    model = zoo.Transformer(config, key=jax.random.key(0))
    mtp = MTP(config, policy=model.policy, key=jax.random.key(1))
    mtp = eqx.tree_at(
        lambda m: (m.body.embed, m.body.lm_head), mtp, (model.embed, model.lm_head),
        is_leaf=lambda x: x is None,
    )  # fmt: skip
    return model.with_mtp(mtp)


def module_logits(model):
    tokens = jnp.arange(12)[None] % model.config.vocab_size
    hidden = model.final_norm(model.forward(tokens).hidden)
    return np.asarray(model.mtp.forward(tokens, hidden).logits)


@pytest.mark.parametrize("config", [TIED, UNTIED], ids=["tied", "untied"])
def test_a_module_round_trips_without_the_models_tables(config, tmp_path):
    model = with_module(config)
    path = tmp_path / "mtp.safetensors"
    zoo.save_mtp(model, path)
    with safe_open(str(path), "numpy") as f:
        names = set(f.keys())
    prefix = f"model.layers.{config.n_layers}."
    assert prefix + "eh_proj.weight" in names and prefix + "self_attn.q_proj.weight" in names
    assert not {prefix + "embed_tokens.weight", prefix + "shared_head.head.weight"} & names
    back = zoo.load_mtp(model.with_mtp(None), path)
    np.testing.assert_array_equal(module_logits(back), module_logits(model))
    assert back.mtp.body.embed.weight is model.embed.weight  # shared, not copied


def test_a_quantized_model_shares_its_packed_tables(tmp_path):
    model = with_module(TIED)
    zoo.save_mtp(model, tmp_path / "mtp.safetensors")
    packed = zoo.quantize(model.with_mtp(None), "int8")
    back = zoo.load_mtp(packed, tmp_path / "mtp.safetensors")
    shared = zip(jax.tree.leaves(back.mtp.body.embed), jax.tree.leaves(packed.embed), strict=True)
    assert all(ours is theirs for ours, theirs in shared)  # the packed table itself
    assert np.isfinite(module_logits(back)).all()


def test_bad_files_and_modules_are_refused(tmp_path):
    model = with_module(TIED)
    path = tmp_path / "mtp.safetensors"
    zoo.save_mtp(model, path)
    wider = zoo.Transformer(dataclasses.replace(TIED, d_model=128), key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"was not written by save_mtp for this model.*d_model"):
        zoo.load_mtp(wider, path)
    with pytest.raises(ValueError, match="is not a file"):
        zoo.load_mtp(model, tmp_path / "missing.safetensors")
    other = tmp_path / "other.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(other))
    with pytest.raises(ValueError, match="was not written by save_mtp"):
        zoo.load_mtp(model, other)
    with pytest.raises(ValueError, match="has no multi-token-prediction module"):
        zoo.save_mtp(model.with_mtp(None), path)
    foreign = eqx.tree_at(lambda m: m.mtp.body.embed.weight, model, model.embed.weight + 1)
    with pytest.raises(ValueError, match="module's token table is not the model's"):
        zoo.save_mtp(foreign, path)
