"""Random models for checkpoint tests, drawn with NumPy on the model's abstract shapes: no JAX
compilation per shape (jax.random per leaf, or the real initialiser, costs seconds per config)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import zoo

VOCAB = 97
# A tiny HF Llama (GQA 4:2), the reference model of the checkpoint and adapter tests.
HF_LLAMA = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
}


def random_model(config: zoo.Config, seed: int) -> zoo.Transformer:
    """Random weights (std 0.1), norm scales around 1, biases nonzero so that each matters."""
    skeleton = eqx.filter_eval_shape(zoo.Transformer, config, key=jax.random.key(0))
    rng = np.random.default_rng(seed)

    def draw(path, like):
        offset = 1.0 if jax.tree_util.keystr(path).endswith(".scale") else 0.0
        return jnp.asarray(offset + 0.1 * rng.standard_normal(like.shape, np.float32))

    return jax.tree_util.tree_map_with_path(draw, skeleton)
