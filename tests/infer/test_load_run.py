"""training.run_model.load_run: a run directory written by train.py's run_dir.save gives back the
trained model (same logits) and the run's tokenizer."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from data.tokenizers import from_ranks, save_ranks
from training import run_dir, run_model
from training.optimizer import adamw, learning_rate
from training.state import checkpoint_files
from training.step import split_model


def test_load_run_returns_the_trained_model_and_tokenizer(tmp_path):
    config = zoo.preset("tiny-llama", vocab_size=257)
    model = zoo.Transformer(config, key=jax.random.key(3))
    params, _ = split_model(model)
    params = jax.tree.map(lambda p: p + 0.01, params)  # "trained": differs from a fresh init
    opt_state = adamw(learning_rate("cosine", peak=1e-3, steps=10, warmup=1)).init(params)
    run_dir.save(tmp_path, params=params, opt_state=opt_state, step=1, data_position=0,
                    rng=jax.random.key(0), config=config, policy=zoo.Policy())  # fmt: skip
    encoding = from_ranks({bytes([i]): i for i in range(256)}, name="bytes")
    save_ranks(encoding, tmp_path / "tokenizer.tiktoken")

    loaded, tokenizer = run_model.load_run(tmp_path)
    tokens = jnp.array([[1, 2, 3, 4]])
    expected = eqx.combine(params, split_model(model)[1])(tokens)
    np.testing.assert_array_equal(loaded(tokens), expected)
    assert loaded.config == config
    assert tokenizer.encode_ordinary("hi") == encoding.encode_ordinary("hi")


def test_load_run_without_checkpoint_says_so(tmp_path):
    with pytest.raises(ValueError, match="holds no checkpoint"):
        run_model.load_run(tmp_path)


def test_load_run_detects_a_damaged_checkpoint(tmp_path):
    config = zoo.preset("tiny-gpt2")
    params, _ = split_model(zoo.Transformer(config, key=jax.random.key(0)))
    path = run_dir.save(tmp_path, params=params, opt_state=(), step=1, data_position=0,
                           rng=jax.random.key(0), config=config, policy=zoo.Policy())  # fmt: skip
    largest = max(checkpoint_files(path / "params"), key=lambda f: f.stat().st_size)
    largest.write_bytes(b"broken")
    with pytest.raises(ValueError, match="corrupt"):
        run_model.load_run(tmp_path)
