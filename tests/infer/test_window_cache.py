"""Sliding layers keep a ring of their window (layers/window_cache.py) in the paged cache, for
`init_cache` and the engine: the cache holds what zoo.math says, and decoding through the rings
(left-padded rows, prefill chunks longer than the window, rows reused by later requests) gives
what the full forward gives."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from infer.engine import Engine
from layers.paged_cache import LayerPages
from layers.window_cache import LayerWindow
from tests.zoo.random_model import random_model

_BASE = dict(
    vocab_size=61, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64,
    position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
)  # fmt: skip
CONFIGS = {
    # Every layer windowed (Mistral's rolling buffer): every layer a ring.
    "uniform": zoo.Config(**_BASE, n_layers=2, sliding_window=4),
    # Gemma 3's shape: a period of (sliding, sliding, global) that does not divide 5 layers, a
    # local rope theta of its own.
    "pattern": zoo.Config(
        **_BASE,
        n_layers=5,
        sliding_window=3,
        local_rope_theta=100.0,
        layer_types=("sliding", "sliding", "full", "sliding", "sliding"),
    ),
}


@pytest.fixture(scope="module")
def models():
    return {name: random_model(c, i) for i, (name, c) in enumerate(CONFIGS.items())}


def _is_layer(x) -> bool:
    return isinstance(x, (LayerPages, LayerWindow))


def test_sliding_layers_hold_their_window_and_the_cache_is_what_zoo_math_counts(models):
    model, config = models["pattern"], CONFIGS["pattern"]
    batch, max_len = 2, 32
    cache = model.init_cache(batch, max_len)
    layers = jax.tree.leaves(cache.layers, is_leaf=_is_layer)
    # Stacks: 1 repeat of (sliding, sliding, full), then (sliding, sliding) left over.
    assert [type(x) for x in layers] == [
        LayerWindow,
        LayerWindow,
        LayerPages,
        LayerWindow,
        LayerWindow,
    ]
    assert {x.ring for x in layers if isinstance(x, LayerWindow)} == {config.sliding_window}
    held = sum(x.nbytes for x in jax.tree.leaves(cache.layers))
    assert held == batch * zoo.math.kv_cache_bytes(config, max_len, model.policy)
    # A cache no longer than the window gains nothing from a ring.
    short = model.init_cache(batch, config.sliding_window)
    assert all(isinstance(x, LayerPages) for x in jax.tree.leaves(short.layers, is_leaf=_is_layer))


# Storage is orthogonal to the window: each config once, on one storage each.
@pytest.mark.parametrize(("name", "storage"), [("uniform", "unrolled"), ("pattern", "scan")])
def test_ragged_prefill_chunks_and_decode_equal_the_full_forward(models, name, storage):
    """Row 1 is left-padded by 3; a second prefill chunk of 6 tokens is longer than the window
    (its queries need keys from the ring and from the chunk); then 3 single-token steps."""
    model = models[name]
    model = model.with_policy(storage="unrolled") if storage == "unrolled" else model
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 61, 16), rng.integers(0, 61, 13)]
    first = np.stack([rows[0][:7], np.concatenate([np.zeros(3, int), rows[1][:4]])])
    cache = model.init_cache(2, 32)
    logits, cache = infer.prefill(model, jnp.asarray(first), cache, lengths=jnp.array([7, 4]))
    ours = [[logits[0]], [logits[1, 3:]]]
    chunk = np.stack([rows[0][7:13], rows[1][4:10]])
    logits, cache = infer.prefill(model, jnp.asarray(chunk), cache)
    for r in range(2):
        ours[r].append(logits[r])
    for i in range(3):
        step = np.array([rows[0][13 + i], rows[1][10 + i]])
        logits, cache = infer.decode_step(model, jnp.asarray(step), cache)
        for r in range(2):
            ours[r].append(logits[r][None])
    forward = eqx.filter_jit(lambda m, t: m(t))
    for r, row in enumerate(rows):
        want = forward(model, jnp.asarray(row[None]))[0]
        got = jnp.concatenate(ours[r])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_engine_rings_give_the_tokens_of_full_length_pages(models):
    """Prompts longer than a prefill chunk (3 chunks through the rings), 3 requests on 2 rows
    (a reused row starts from an empty ring): the same greedy tokens with and without rings,
    in less memory per row; asking for prefix sharing with rings is refused."""
    model = models["pattern"]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 61, n).tolist() for n in (40, 9, 33)]
    out, engines = {}, {}
    for window_cache in (True, False):
        engine = Engine(  # warm_up=False: only the step shapes these requests use compile
            model, max_batch=2, max_len=56, chunk=16, window_cache=window_cache, warm_up=False
        )
        requests = [engine.submit(p, max_new_tokens=6) for p in prompts]
        engine.run()
        out[window_cache] = [r.tokens for r in requests]
        engines[window_cache] = engine
    assert out[True] == out[False]
    assert engines[True].ring_bytes > 0 == engines[False].ring_bytes
    assert engines[True].page_bytes < engines[False].page_bytes
    assert not engines[True].prefix_sharing and engines[False].prefix_sharing
    with pytest.raises(ValueError, match="window_cache=False"):
        Engine(model, max_batch=2, max_len=56, chunk=16, prefix_sharing=True, warm_up=False)
