"""The cached path: prefill + decode steps (the model's own forward with the paged KV cache) give
the full forward pass's logits, for both paged decode kernels, every layer storage (stacked
weights decoded by `lax.scan` or a Python loop, per-layer weights), dense and MoE models; a
ragged step (decode rows and prompt chunks in one forward) equals the separate calls; the cache
is donated and updated in place; the engine's programs hold no second copy of the weights and
their memory does not grow with `max_len`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import infer.engine
import zoo
from layers.kernels.paged import CpuDecodeKernel, PallasDecodeKernel, XlaPagedKernel
from layers.paged_cache import PagedKVCache
from shard.axes import is_array_like

# How a model stores and runs its layers: stacked weights through `lax.scan` (the default),
# stacked weights through a Python loop, one block per layer.
STORAGE = ["scan", "loop", "unrolled"]


def stored(model: zoo.Transformer, storage: str) -> zoo.Transformer:
    if storage == "unrolled":
        return model.with_policy(storage="unrolled")
    return model.with_policy(scan_layers=storage == "scan")


# One compiled program per model and shape: an op-by-op forward compiles each op at each new shape.
_forward = eqx.filter_jit(lambda model, tokens, **kwargs: model.forward(tokens, **kwargs))


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


# The prefill + decode tests on `model` share one shape (two rows, a cache of 16 tokens, a prompt
# block of 6), so each storage's two programs compile once for all of them.
ROWS, CACHE_LEN, BLOCK = 2, 16, 6


@pytest.mark.parametrize("storage", STORAGE)
def test_prefill_then_decode_equals_full_forward(model, storage):
    tokens = jax.random.randint(jax.random.key(1), (ROWS, 11), 0, model.config.vocab_size)
    full = model(tokens)
    cached_model = stored(model, storage)
    cache = cached_model.init_cache(ROWS, CACHE_LEN)
    logits, cache = infer.prefill(cached_model, tokens[:, :BLOCK], cache)
    close(logits, full[:, :BLOCK])
    for t in range(BLOCK, 11):
        logits, cache = infer.decode_step(cached_model, tokens[:, t], cache)
        close(logits, full[:, t])
    np.testing.assert_array_equal(cache.lengths, [11, 11])


DECODE_KERNELS = {
    "xla": XlaPagedKernel(),
    "xla-small-blocks": XlaPagedKernel(keys_per_block=16),  # several blocks per row
    "pallas": PallasDecodeKernel(keys_per_block=16, interpret=True),
    "cpu": CpuDecodeKernel(),
}


@pytest.mark.parametrize("kernel", list(DECODE_KERNELS))
def test_every_decode_kernel_equals_the_naive_full_forward(kernel):
    """Prefill and decode steps through each paged decode kernel (the Pallas one reads one
    layer's pool: unrolled storage) against the full forward of the specification kernel."""
    config = zoo.preset("tiny-llama", max_seq_len=64)
    model = zoo.Transformer(config, policy=zoo.Policy(attention="naive"), key=jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(6), (2, 40), 0, config.vocab_size)
    full = model(tokens)
    cached = model.with_policy(storage="unrolled", decode_kernel=DECODE_KERNELS[kernel])
    cache = cached.init_cache(2, 48)
    logits, cache = infer.prefill(cached, tokens[:, :35], cache)
    close(logits, full[:, :35])
    for t in range(35, 40):
        logits, cache = infer.decode_step(cached, tokens[:, t], cache)
        close(logits, full[:, t])


@pytest.mark.parametrize("storage", STORAGE)
def test_left_padded_prefill_matches_each_row_alone(model, storage):
    cached_model = stored(model, storage)
    short = jnp.array([[5, 6, 7]])
    long = jnp.array([[9, 8, 7, 6, 5]])
    padded = jnp.concatenate([jnp.pad(short, ((0, 0), (3, 0))), jnp.pad(long, ((0, 0), (1, 0)))])
    cache = cached_model.init_cache(ROWS, CACHE_LEN)
    logits, cache = infer.prefill(cached_model, padded, cache, lengths=jnp.array([3, 5]))
    close(logits[0, 3:], model(short)[0])
    close(logits[1, 1:], model(long)[0])
    # The next token continues each row at its own position.
    step, _ = infer.decode_step(cached_model, jnp.array([4, 4]), cache)
    close(step[0], model(jnp.array([[5, 6, 7, 4]]))[0, -1])
    close(step[1], model(jnp.array([[9, 8, 7, 6, 5, 4]]))[0, -1])


def test_valid_is_the_only_mark_of_padding_with_a_cache(model):
    """With a cache, `valid` marks the real tokens anywhere in a row (right padding too);
    `segment_ids` (documents) and `positions` are refused instead of silently renumbering."""
    cache = model.init_cache(1, 8)
    tokens = jnp.array([[5, 6, 0, 7]])
    out = model.forward(tokens, cache=cache, valid=jnp.array([[True, True, False, True]]))
    close(out.logits[0, [0, 1, 3]], model(jnp.array([[5, 6, 7]]))[0])
    assert int(out.cache.lengths[0]) == 3
    with pytest.raises(ValueError, match="do not pass positions or segment_ids"):
        model.forward(tokens, cache=model.init_cache(1, 8), segment_ids=jnp.ones_like(tokens))
    with pytest.raises(ValueError, match="valid= marks the real tokens of a cached call"):
        model.forward(tokens, valid=jnp.ones(tokens.shape, bool))


@pytest.mark.parametrize("storage", STORAGE)
def test_prefill_and_decode_step_donate_the_cache(model, storage):
    cached_model = stored(model, storage)
    cache = cached_model.init_cache(ROWS, CACHE_LEN)
    _, filled = infer.prefill(cached_model, jnp.ones((ROWS, BLOCK), jnp.int32), cache)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    _, new_cache = infer.decode_step(cached_model, jnp.ones(ROWS, jnp.int32), filled)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(filled))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_cache))


def test_unrolled_model_forward_equals_stacked_and_converts_back(model):
    tokens = jax.random.randint(jax.random.key(2), (1, 9), 0, model.config.vocab_size)
    unrolled = model.with_policy(storage="unrolled")
    close(unrolled(tokens), model(tokens))
    back = unrolled.with_policy(storage="stacked")
    assert all(stack.stacked for stack in back.stacks)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cache_mirrors_the_layer_storage(model):
    """Stacked weights get stacked pools (`[layers, ...]`), unrolled ones one per layer; either
    way the cache holds every layer once, in whole pages of each row."""
    c = model.config
    stacked = model.init_cache(3, 20).layers  # 20 tokens: 2 pages of 16 per row
    (k_shape,) = {kv.k.shape for stack in stacked for kv in stack}
    assert k_shape == (c.n_layers, c.n_kv_heads, 3 * 2, 16, c.head_dim)
    unrolled = model.with_policy(storage="unrolled").init_cache(3, 20).layers
    assert [len(stack) for stack in unrolled] == [c.n_layers]
    assert {kv.v.shape for kv in unrolled[0]} == {(c.n_kv_heads, 3 * 2, 16, c.head_dim)}


@pytest.mark.parametrize(("n_heads", "n_kv_heads", "window"), [(4, 1, None), (4, 2, 3), (4, 4, 5)])
def test_ragged_decode_equals_each_row_alone(n_heads, n_kv_heads, window):
    """MQA/GQA/MHA, with and without a sliding window, over left-padded rows of different
    lengths: prefill then decode steps give each row's own full forward pass (with a window,
    each layer's ring)."""
    config = zoo.preset("tiny-llama", n_heads=n_heads, n_kv_heads=n_kv_heads, sliding_window=window)
    model = zoo.Transformer(config, policy=zoo.Policy.inference(), key=jax.random.key(3))
    rows = [[7, 3, 9], [1, 2, 3, 4, 5, 6], [11]]
    new = jax.random.randint(jax.random.key(4), (3, 4), 0, config.vocab_size)
    width = max(map(len, rows))
    padded = jnp.array([[0] * (width - len(r)) + r for r in rows])
    cache = model.init_cache(3, width + 4)
    if window is None:
        assert cache.layers[0][0].v.shape[-4:] == (n_kv_heads, 3, 16, config.head_dim)
    else:  # a ring of the window (layers/window_cache.py), in the kernels' layout
        assert cache.layers[0][0].v.shape[-4:] == (3, window, n_kv_heads, config.head_dim)
    logits, cache = infer.prefill(model, padded, cache, lengths=jnp.array(list(map(len, rows))))
    steps = [logits[:, -1]]
    for t in range(3):
        step, cache = infer.decode_step(model, new[:, t], cache)
        steps.append(step)
    # Each row's own full forward, right-padded to one width (under the causal mask padding
    # changes no earlier position), so one compiled forward serves every row.
    reference = model.with_policy(attention="naive")
    for i, row in enumerate(rows):
        tokens = row + new[i, :3].tolist()
        full = _forward(reference, jnp.array([tokens + [0] * (width + 3 - len(tokens))])).logits
        close(jnp.stack([s[i] for s in steps]), full[0, len(row) - 1 : len(tokens)])


@pytest.mark.parametrize("window", [None, 4])
def test_a_ragged_step_equals_its_parts(window):
    """One forward over `[tokens, 1]` laid out as two decode groups and two prompt chunks
    (layers/token_groups.py) gives each group the logits and the cache writes of its own call:
    the engine's mixed step == separate decode and prefill calls."""
    config = zoo.preset("tiny-llama", n_layers=2, sliding_window=window)
    model = zoo.Transformer(config, policy=zoo.Policy.inference(), key=jax.random.key(9))
    rng = np.random.default_rng(0)
    first, second = rng.integers(0, 256, (2, 9)), rng.integers(0, 256, (2, 5))
    # Rows 0, 1 hold 9 tokens each and decode one; rows 2, 3 prefill 5 tokens (one padded).
    ragged = model.init_cache(4, 32)
    _, ragged = infer.prefill(model, jnp.asarray(np.concatenate([first, first])), ragged)
    ragged = eqx.tree_at(lambda c: c.lengths, ragged, jnp.array([9, 9, 0, 0], jnp.int32))
    ragged = PagedKVCache(
        ragged.layers, ragged.page_table, ragged.lengths, segments=((2, 1), (2, 5)),
        kernel=ragged.kernel, page_size=16,
    )  # fmt: skip
    decode_tokens = rng.integers(0, 256, 2)
    tokens = np.concatenate([decode_tokens, second.reshape(-1)])[:, None]
    valid = np.ones((12, 1), bool)
    valid[-1] = False  # the second chunk has 4 real tokens
    out = _forward(model, jnp.asarray(tokens), cache=ragged, valid=jnp.asarray(valid))
    np.testing.assert_array_equal(out.cache.lengths, [10, 10, 5, 4])
    alone = _forward(model, jnp.asarray(np.concatenate([first, decode_tokens[:, None]], 1)))
    close(out.logits[:2, 0], alone.logits[:, -1])
    for g, n in ((0, 5), (1, 4)):
        logits = out.logits[2 + 5 * g : 2 + 5 * g + n, 0]
        close(logits, _forward(model, jnp.asarray(second[g : g + 1, :n])).logits[0])


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
@pytest.mark.parametrize("storage", ["scan", "unrolled"])
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
    # Each row's own full forward, right-padded to one width (under the causal mask padding
    # changes no earlier position; dropless routing: nor do the padded tokens' experts), so one
    # compiled forward serves every row (given as an array: a list would be static to
    # `filter_jit`, a program per row).
    padded_rows = [row + new[i].tolist() + [0] * (width - len(row)) for i, row in enumerate(rows)]
    fulls = [_forward(moe_model, jnp.array([tokens])).logits[0] for tokens in padded_rows]
    for i, (row, full) in enumerate(zip(rows, fulls, strict=True)):
        close(jnp.stack([s[i] for s in steps]), full[len(row) - 1 : len(row) + 2])
    out = cached_model.forward(new[:, 2:], cache=cache)
    assert out.aux.expert_load.shape[0] == len(MOE.moe_layers)
    close(
        out.logits[:, 0],
        jnp.stack([full[len(row) + 2] for row, full in zip(rows, fulls, strict=True)]),
    )


@pytest.mark.parametrize("storage", STORAGE)
def test_moe_decode_step_donates_the_cache(moe_model, storage):
    cached_model = stored(moe_model, storage)
    cache = cached_model.init_cache(2, 4)
    _, new_cache = infer.decode_step(cached_model, jnp.array([1, 2]), cache)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_cache))


# --- the engine's programs: weights once, memory independent of max_len ----------------------

# Weights dominate: ~6.4M parameters (25.7 MB float32) against a page pool of about 2 MB.
BIG = zoo.preset(
    "tiny-llama", vocab_size=8192, d_model=256, n_heads=4, n_kv_heads=1, d_ff=512, n_layers=4,
    max_seq_len=4096,
)  # fmt: skip


def nbytes(tree) -> int:
    """Bytes of the (real or abstract) arrays of `tree`."""
    arrays = jax.tree.leaves(eqx.filter(tree, is_array_like))
    return sum(x.size * x.dtype.itemsize for x in arrays)


def compiled_step(model, rows: int, max_len: int, chunks: int):
    """The engine's step program for these shapes, compiled from abstract arguments (nothing
    allocated), and the bytes of its page pools."""
    engine = infer.Engine(model, max_batch=rows, max_len=max_len, warm_up=False)
    plan = engine._plan([], [], chunks)
    state = eqx.filter_eval_shape(lambda: engine.state)
    return engine._lower(plan, state).compile(), nbytes(state.pages)


# The two storages: stacked weights run by `lax.scan`, and unrolled ones. (A stacked model run by a
# Python loop, `scan_layers=False`, slices every layer's weights inside the program: a debugging
# mode, not for serving.)
@pytest.mark.parametrize("storage", ["scan", "unrolled"])
def test_engine_programs_hold_no_second_copy_of_the_weights_nor_of_the_pools(storage):
    """XLA's own memory analysis of the engine's two programs (decode rows alone; decode rows
    and a prompt chunk): the memory a program allocates beyond its arguments (temporaries +
    outputs not aliased to a donated argument) stays below what one layer's weights (a stacked
    weight's slice), the logits and a block of keys need, a small fraction of the weights or
    the pools: a copy of either would add all of it. The same bound holds at max_len 256 and
    4096: nothing scales with max_len (attention reads the blocks of pages rows hold)."""
    model = stored(zoo.Transformer(BIG, key=jax.random.key(0)), storage)
    model = eqx.filter_eval_shape(lambda: model)  # shapes only: lowering allocates nothing
    weights = nbytes(model)
    one_layer = nbytes(model.stacks) // BIG.n_layers
    rows = 4
    tokens = rows + 64  # the mixed step: every row's decode slot and a chunk of 64
    logits = 2 * tokens * BIG.vocab_size * 4  # logits and the sampler's float32 copy
    # A block of 256 keys: k and v for every group (4 decode rows, 1 chunk; d_model numbers a
    # key bounds kv_heads x head_dim), and the chunk's scores and softmax weights.
    block = 2 * (rows + 1) * 256 * BIG.d_model * 4 + 2 * 64 * BIG.n_heads * 256 * 4
    bound = 2 * one_layer + logits + block
    assert bound < weights / 2  # the check can tell a copy of the weights apart
    extras = {}
    for max_len in (256, 4096):
        for chunks in (0, 1):
            compiled, pools = compiled_step(model, rows, max_len, chunks)
            memory = compiled.memory_analysis()
            extra = memory.temp_size_in_bytes + memory.output_size_in_bytes
            extra -= memory.alias_size_in_bytes
            extras[max_len, chunks] = extra
            print(
                f"{storage} max_len {max_len} chunks {chunks}: {extra / 1e6:.2f} MB beyond "
                f"the arguments (bound {bound / 1e6:.2f} MB, pools {pools / 1e6:.1f} MB)"
            )
            assert extra < bound, (storage, max_len, chunks, extra, bound, weights, pools)
    assert bound < pools / 2  # at max_len 4096, and a copy of the pools too
    # max_len 256 and 4096: gathering the rows' whole span of keys for even one layer would
    # add this much; the programs differ by a small fraction of it (buffer assignment).
    one_span = rows * (4096 - 256) * BIG.n_kv_heads * BIG.head_dim * 4
    for chunks in (0, 1):
        assert abs(extras[4096, chunks] - extras[256, chunks]) < one_span / 10
