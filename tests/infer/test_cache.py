"""The cached path: prefill + decode steps (the model's own forward with a KV cache) give the
full forward pass's logits, for every kernel, every layer storage (stacked weights decoded by
`lax.scan` or a Python loop, per-layer weights after `unstacked()`), dense and MoE models; the
cache is donated; `generate`'s compiled programs hold no second copy of the weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import infer.engine
import zoo
from infer.sampling import Greedy
from shard import Placement
from shard.axes import is_array_like

# How a model stores and runs its layers: stacked weights through `lax.scan` (the default),
# stacked weights through a Python loop, one block per layer.
STORAGE = ["scan", "loop", "unstacked"]


def stored(model: zoo.Transformer, storage: str) -> zoo.Transformer:
    if storage == "unstacked":
        return model.unstacked()
    return model.with_policy(scan_layers=storage == "scan")


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage", STORAGE)
def test_prefill_then_decode_equals_full_forward(model, storage):
    tokens = jax.random.randint(jax.random.key(1), (2, 11), 0, model.config.vocab_size)
    full = model(tokens)
    cached_model = stored(model, storage)
    cache = cached_model.init_cache(2, 16)
    logits, cache = infer.prefill(cached_model, tokens[:, :6], cache)
    close(logits, full[:, :6])
    for t in range(6, 11):
        logits, cache = infer.decode_step(cached_model, tokens[:, t], cache)
        close(logits, full[:, t])
    np.testing.assert_array_equal(cache.lengths, [11, 11])


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("kernel", ["naive", "xla", "flash"])
def test_every_kernel_cached_equals_the_naive_full_forward(kernel, storage):
    """Prefill (through the kernel, 16 tokens: a flash tile) and decode steps against the full
    forward pass of the specification kernel."""
    config = zoo.preset("tiny-llama", max_seq_len=64)
    model = zoo.Transformer(config, policy=zoo.Policy(attention="naive"), key=jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(6), (2, 20), 0, config.vocab_size)
    full = model(tokens)
    cached_model = stored(model.with_policy(attention=kernel), storage)
    assert cached_model.policy.kernel_name == kernel
    cache = cached_model.init_cache(2, 32)
    logits, cache = infer.prefill(cached_model, tokens[:, :16], cache)
    close(logits, full[:, :16])
    for t in range(16, 20):
        logits, cache = infer.decode_step(cached_model, tokens[:, t], cache)
        close(logits, full[:, t])


@pytest.mark.parametrize("storage", STORAGE)
def test_left_padded_prefill_matches_each_row_alone(model, storage):
    cached_model = stored(model, storage)
    short = jnp.array([[5, 6, 7]])
    long = jnp.array([[9, 8, 7, 6, 5]])
    padded = jnp.concatenate([jnp.pad(short, ((0, 0), (2, 0))), long])
    cache = cached_model.init_cache(2, 8)
    logits, cache = infer.prefill(cached_model, padded, cache, lengths=jnp.array([3, 5]))
    close(logits[0, 2:], model(short)[0])
    close(logits[1], model(long)[0])
    # The next token continues each row at its own position.
    step, _ = infer.decode_step(cached_model, jnp.array([4, 4]), cache)
    close(step[0], model(jnp.array([[5, 6, 7, 4]]))[0, -1])
    close(step[1], model(jnp.array([[9, 8, 7, 6, 5, 4]]))[0, -1])


@pytest.mark.parametrize("storage", STORAGE)
def test_prefill_and_decode_step_donate_the_cache(model, storage):
    cached_model = stored(model, storage)
    cache = cached_model.init_cache(1, 4)
    _, filled = infer.prefill(cached_model, jnp.array([[1, 2]]), cache)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    _, new_cache = infer.decode_step(cached_model, jnp.array([1]), filled)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(filled))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_cache))


def test_unstacked_model_forward_equals_stacked(model):
    tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, model.config.vocab_size)
    close(model.unstacked()(tokens), model(tokens))


def test_cache_mirrors_the_layer_storage(model):
    """Stacked weights get stacked cache arrays (`[layers, ...]`), unrolled ones one per layer;
    either way the cache holds every layer once."""
    c = model.config
    stacked = model.init_cache(3, 8).layers
    (k_shape,) = {kv.k.shape for stack in stacked for kv in stack}
    assert k_shape == (c.n_layers, 3, c.n_kv_heads, 8, c.head_dim)
    unrolled = model.unstacked().init_cache(3, 8).layers
    assert [len(stack) for stack in unrolled] == [c.n_layers]
    assert {kv.v.shape for kv in unrolled[0]} == {(3, c.n_kv_heads, c.head_dim, 8)}


@pytest.mark.parametrize("kernel", ["naive", "xla", "flash"])
@pytest.mark.parametrize(("n_heads", "n_kv_heads", "window"), [(4, 1, None), (4, 2, 3), (4, 4, 5)])
def test_ragged_decode_equals_each_row_alone(kernel, n_heads, n_kv_heads, window):
    """MQA/GQA/MHA, with and without a sliding window, over left-padded rows of different
    lengths: prefill then decode steps give each row's own full forward pass (the cache's
    `[.., head_dim, kv_seq]` values and `[.., kv_seq, head_dim]` keys read in the kernels' view;
    with a window, each layer's ring).
    Flash prefills a whole tile (16 tokens, mostly padding)."""
    config = zoo.preset("tiny-llama", n_heads=n_heads, n_kv_heads=n_kv_heads, sliding_window=window)
    model = zoo.Transformer(config, policy=zoo.Policy(attention=kernel), key=jax.random.key(3))
    model = model.unstacked()
    rows = [[7, 3, 9], [1, 2, 3, 4, 5, 6], [11]]
    new = jax.random.randint(jax.random.key(4), (3, 4), 0, config.vocab_size)
    width = 16 if kernel == "flash" else max(map(len, rows))
    max_len = 32 if kernel == "flash" else width + 4
    padded = jnp.array([[0] * (width - len(r)) + r for r in rows])
    cache = model.init_cache(3, max_len)
    if window is None:
        assert cache.layers[0][0].v.shape == (3, n_kv_heads, config.head_dim, max_len)
    else:  # a ring of the window (layers/window_cache.py), in the kernels' layout
        assert cache.layers[0][0].v.shape == (3, window, n_kv_heads, config.head_dim)
    logits, cache = infer.prefill(model, padded, cache, lengths=jnp.array(list(map(len, rows))))
    steps = [logits[:, -1]]
    for t in range(3):
        step, cache = infer.decode_step(model, new[:, t], cache)
        steps.append(step)
    reference = model.with_policy(attention="naive")
    for i, row in enumerate(rows):
        full = reference(jnp.array([row + new[i, :3].tolist()]))[0, len(row) - 1 :]
        close(jnp.stack([s[i] for s in steps]), full)


# --- MoE: interleaved dense and MoE layers --------------------------------------------------

# One leading dense layer, then (dense, MoE) twice: three stacks' worth of storage (a leading
# dense stack, a period-2 stack of a dense and an MoE block).
MOE = zoo.preset("tiny-moe", n_layers=5, moe_every=2, first_dense_layers=1)


@pytest.fixture(scope="module")
def moe_model() -> zoo.Transformer:
    model = zoo.Transformer(MOE, key=jax.random.key(7))
    assert [(s.period, s.repeats) for s in model.stacks] == [(1, 1), (2, 2)]
    assert MOE.moe_layers == (2, 4)
    return model


# Scanned and unrolled storage (the stacked Python loop runs the scan's body: test above).
@pytest.mark.parametrize("storage", ["scan", "unstacked"])
def test_moe_ragged_prefill_then_decode_equals_each_row_alone(moe_model, storage):
    """Left-padded rows through dense and MoE layers (dropless routing: a token's output does not
    depend on its batch), prefill then decode, against each row's own full forward pass; the
    cached forward returns every MoE layer's router statistics, in layer order."""
    cached_model = stored(moe_model, storage)
    rows = [[7, 3, 9, 4], [1, 2], [5, 6, 7, 8, 9, 10]]
    new = jax.random.randint(jax.random.key(8), (3, 3), 0, MOE.vocab_size)
    width = max(map(len, rows))
    padded = jnp.array([[0] * (width - len(r)) + r for r in rows])
    cache = cached_model.init_cache(3, width + 3)
    logits, cache = infer.prefill(cached_model, padded, cache, lengths=jnp.array([4, 2, 6]))
    steps = [logits[:, -1]]
    for t in range(2):
        step, cache = infer.decode_step(cached_model, new[:, t], cache)
        steps.append(step)
    for i, row in enumerate(rows):
        full = moe_model(jnp.array([row + new[i, :2].tolist()]))[0, len(row) - 1 :]
        close(jnp.stack([s[i] for s in steps]), full)
    out = cached_model.forward(new[:, 2:], cache=cache)
    assert out.aux.expert_load.shape[0] == len(MOE.moe_layers)
    close(out.logits[:, 0], jnp.stack([
        moe_model(jnp.array([row + new[i].tolist()]))[0, -1] for i, row in enumerate(rows)
    ]))  # fmt: skip


@pytest.mark.parametrize("storage", STORAGE)
def test_moe_decode_step_donates_the_cache(moe_model, storage):
    cached_model = stored(moe_model, storage)
    cache = cached_model.init_cache(2, 4)
    _, new_cache = infer.decode_step(cached_model, jnp.array([1, 2]), cache)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_cache))


# --- generate holds the weights once ---------------------------------------------------------

# Weights dominate: ~6.4M parameters (25.7 MB float32) against a page pool of about 2 MB.
BIG = zoo.preset(
    "tiny-llama", vocab_size=8192, d_model=256, n_heads=4, n_kv_heads=1, d_ff=512, n_layers=4
)


def nbytes(tree) -> int:
    """Bytes of the (real or abstract) arrays of `tree`."""
    arrays = jax.tree.leaves(eqx.filter(tree, is_array_like))
    return sum(x.size * x.dtype.itemsize for x in arrays)


# The two storages: stacked weights run by `lax.scan`, and unrolled ones. (A stacked model run by a
# Python loop, `scan_layers=False`, slices every layer's weights inside the program: a debugging
# mode, not for serving.)
@pytest.mark.parametrize("storage", ["scan", "unstacked"])
def test_generate_programs_hold_no_second_copy_of_the_weights(storage):
    """XLA's own memory analysis of each program `generate` compiles (the engine's prefill and
    decode steps, lowered with the model as it is stored): the memory a program allocates beyond
    its arguments (temporaries + outputs not aliased to a donated argument) stays below what the
    cache, one layer's weights (a stacked weight's slice) and the logits need, which is a small
    fraction of the weights. A second copy of the weights would add all of them."""
    model = stored(zoo.Transformer(BIG, key=jax.random.key(0)), storage)
    model = eqx.filter_eval_shape(lambda: model)  # shapes only: lowering allocates nothing
    weights = nbytes(model)
    one_layer = nbytes(model.stacks) // BIG.n_layers
    rows, chunk, max_len, page_size = 4, 64, 256, 16
    n_pages = rows * max_len // page_size + 1
    pages = jax.eval_shape(lambda: model.init_pages(n_pages, page_size, dtype=jnp.float32))
    cache = nbytes(pages)
    table = jax.ShapeDtypeStruct((rows, max_len // page_size), jnp.int32)
    lengths = jax.ShapeDtypeStruct((rows,), jnp.int32)
    params = Greedy().params().broadcast(rows)
    key = jax.random.key(0)
    settings = {"decode_kernel": None, "placement": Placement()}
    programs = {
        "prefill": infer.engine._prefill_program.lower(
            model,
            pages,
            jax.ShapeDtypeStruct((rows, chunk), jnp.int32),
            jax.ShapeDtypeStruct((rows,), jnp.int32),
            table,
            lengths,
            lengths,  # the rows' ring rows (none here: BIG has no window)
            params,
            key,
            **settings,
        ),
        "decode": infer.engine._decode_program.lower(
            model,
            pages,
            jax.ShapeDtypeStruct((rows,), jnp.int32),
            jax.ShapeDtypeStruct((rows,), jnp.bool_),
            table,
            lengths,
            params,
            key,
            **settings,
        ),
    }
    logits = rows * BIG.vocab_size * 4  # one position per row (`logits_at`)
    bound = cache + 2 * one_layer + 2 * logits
    assert bound < weights / 2, (bound, weights)  # the check can tell a copy apart
    for name, lowered in programs.items():
        memory = lowered.compile().memory_analysis()
        extra = memory.temp_size_in_bytes + memory.output_size_in_bytes
        extra -= memory.alias_size_in_bytes
        print(f"{storage} {name}: weights {weights / 1e6:.2f} MB, cache {cache / 1e6:.2f} MB, "
              f"allocated beyond the arguments {extra / 1e6:.2f} MB "
              f"(bound {bound / 1e6:.2f} MB)")  # fmt: skip
        assert extra < bound, (name, extra, bound, weights)
