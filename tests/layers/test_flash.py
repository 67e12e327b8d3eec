"""The Pallas flash kernel (interpret mode on CPU) equals the naive specification in values and
gradients; its tile skipping never hides a visible key; it lowers for CUDA through Triton; bad
inputs are refused with a message; a model trained with it tracks the naive one.

Interpret mode costs compile time per distinct configuration, so each case below is one
configuration with its own shape, and the blocks are small enough to give several tiles."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jex_core

import zoo
from layers.kernels import AttentionMask, BlockSizes, causal_mask, flash_attention, naive_attention
from layers.kernels.flash.attention import padded_length
from layers.kernels.flash.tiles import tile_ranges, tile_visibility
from zoo.transformer import positions_from_segments

SMALL = BlockSizes(block_q=16, block_k=16, backward_block_q=16, backward_block_k=16)


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    t: int
    h: int
    kv: int
    d: int
    mask: str
    dtype: str = "float32"
    s: int | None = None  # kv length when it differs from t
    blocks: BlockSizes = SMALL


CASES = {
    "bidirectional-gqa-f32-cross": Case(2, 32, 4, 2, 32, "bidirectional", s=64),
    "window-mqa-f32": Case(1, 64, 4, 1, 16, "window"),
    "packed-gqa-f32": Case(2, 64, 4, 2, 16, "packed"),
    "cache-offset-mha-f32": Case(1, 32, 2, 2, 16, "offset", s=64),
    "packed-window-gqa-bf16": Case(2, 64, 4, 2, 16, "packed-window", "bfloat16"),
    "causal-mqa-bf16": Case(1, 64, 4, 1, 32, "causal", "bfloat16", blocks=BlockSizes(block_q=32)),
    # The bit-reproducible backward (a dQ kernel of its own instead of atomic adds).
    "packed-window-gqa-f32-separate-dq": Case(
        2, 64, 4, 2, 16, "packed-window", blocks=dataclasses.replace(SMALL, backward_dq="separate")
    ),
    "offset-mha-bf16-separate-dq": Case(
        1, 32, 2, 2, 16, "offset", "bfloat16", s=64, blocks=BlockSizes(backward_dq="separate")
    ),
    # Lengths that are no multiple of the tiles: padded inside the kernel (a plain 23-token
    # forward with the default tiles; packed documents, a cache offset, no causality).
    "causal-23-default-blocks": Case(1, 23, 2, 2, 16, "causal", blocks=BlockSizes()),
    "packed-window-40": Case(2, 40, 4, 2, 16, "packed-window"),
    "offset-23-against-45": Case(1, 23, 2, 2, 16, "offset", s=45),
    "bidirectional-20-against-37": Case(1, 20, 2, 1, 16, "bidirectional", s=37),
}


def random_segments(key, b: int, t: int) -> jax.Array:
    """Packed documents with random boundaries: sorted ids starting at 1."""
    starts = jax.random.bernoulli(key, 0.08, (b, t)).at[:, 0].set(True)
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def make_mask(case: Case, key) -> AttentionMask:
    s = case.s or case.t
    pos = jnp.broadcast_to(jnp.arange(case.t), (case.b, case.t))
    if case.mask == "causal":
        return causal_mask(pos)
    if case.mask == "bidirectional":
        kv_pos = jnp.broadcast_to(jnp.arange(s), (case.b, s))
        return AttentionMask(q_positions=pos, kv_positions=kv_pos, causal=False)
    if case.mask == "window":
        return causal_mask(pos, sliding_window=20)
    if case.mask == "offset":  # a chunk of queries at positions s-t .. s-1 against a cache
        kv_pos = jnp.broadcast_to(jnp.arange(s), (case.b, s))
        return AttentionMask(q_positions=pos + (s - case.t), kv_positions=kv_pos)
    seg = random_segments(key, case.b, case.t)
    window = 12 if case.mask == "packed-window" else None
    return causal_mask(positions_from_segments(seg), seg, sliding_window=window)


def inputs(case: Case, seed: int = 0):
    kq, kk, kv_, km = jax.random.split(jax.random.key(seed), 4)
    s = case.s or case.t
    dtype = jnp.dtype(case.dtype)
    q = jax.random.normal(kq, (case.b, case.t, case.h, case.d), dtype)
    k = jax.random.normal(kk, (case.b, s, case.kv, case.d), dtype)
    v = jax.random.normal(kv_, (case.b, s, case.kv, case.d), dtype)
    return q, k, v, make_mask(case, km)


def assert_close(got, want, dtype: str, factor: float | int):
    """Error relative to the reference's scale, within `factor` units of the dtype's epsilon
    (float32 needs a floor: its epsilon is below the reordering noise of a softmax)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    eps = max(float(jnp.finfo(jnp.dtype(dtype)).eps), 1e-6)
    scale = max(float(np.abs(want).max()), 1.0)
    err = float(np.abs(got - want).max())
    assert err <= factor * eps * scale, f"max error {err:.3g} > {factor} eps x {scale:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_flash_matches_naive_values_and_grads(name):
    case = CASES[name]
    q, k, v, mask = inputs(case)
    # The reference is naive on the same (possibly bf16) inputs, computed in float32.
    up = [x.astype(jnp.float32) for x in (q, k, v)]

    def value_and_grads(kernel, *qkv):
        # One jit per kernel: the output and the gradients of sum(sin(out)) w.r.t. q, k, v.
        out, vjp = jax.vjp(lambda *a: kernel(*a, mask), *qkv)
        return out, vjp(jnp.cos(out.astype(jnp.float32)).astype(out.dtype))

    flash = lambda q, k, v, m: flash_attention(q, k, v, m, block_sizes=case.blocks)  # noqa: E731
    out, grads = jax.jit(lambda *a: value_and_grads(flash, *a))(q, k, v)
    want_out, want_grads = jax.jit(lambda *a: value_and_grads(naive_attention, *a))(*up)
    assert out.dtype == q.dtype
    assert_close(out, want_out, case.dtype, 4)
    for got, want in zip(grads, want_grads, strict=True):
        assert got.dtype == q.dtype
        assert_close(got, want, case.dtype, 16)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("packed", [False, True])
def test_tile_ranges_cover_every_visible_key(window, packed):
    """Loop ranges never skip a visible (query, key) pair and skip the element mask only where
    every pair is visible; with standard positions and no segments the tile tests are exact:
    causal stops at the diagonal tile."""
    b, t, bq, bk = 3, 128, 16, 32
    seg = random_segments(jax.random.key(1), b, t) if packed else None
    pos = positions_from_segments(seg) if packed else jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = causal_mask(pos, seg, sliding_window=window)
    visible, full = tile_visibility(
        pos, pos, seg, seg, causal=True, window=window, block_q=bq, block_k=bk
    )
    ranges = tile_ranges(visible, full)
    dense = np.asarray(mask.dense())
    per_tile = dense.reshape(b, t // bq, bq, t // bk, bk)
    q_tile, k_tile = np.arange(t) // bq, np.arange(t) // bk
    for bi in range(b):
        qi, kj = np.nonzero(dense[bi])
        for own, other, (lo, full_lo, full_hi, hi) in [
            (q_tile[qi], k_tile[kj], ranges["kv"]),
            (k_tile[kj], q_tile[qi], ranges["q"]),
        ]:
            lo, full_lo, full_hi, hi = (np.asarray(x[bi])[own] for x in (lo, full_lo, full_hi, hi))
            assert np.all((lo <= other) & (other < hi))
            assert np.all((lo <= full_lo) & (full_lo <= full_hi) & (full_hi <= hi))
        lo, full_lo, full_hi, _ = (np.asarray(x[bi]) for x in ranges["kv"])
        for i in range(t // bq):
            for j in range(full_lo[i], full_hi[i]):
                assert per_tile[bi, i, :, j, :].all(), (bi, i, j)
    if not packed:
        np.testing.assert_array_equal(visible, per_tile.any(axis=(2, 4)))
        np.testing.assert_array_equal(full, per_tile.all(axis=(2, 4)))
        # Causal: query tile i (rows 16i..16i+15) needs key tiles up to the one holding row 16i+15.
        hi = (np.arange(t // bq) * bq + bq - 1) // bk + 1
        np.testing.assert_array_equal(ranges["kv"][3][0], hi)


def test_decode_step_equals_naive():
    """seq == 1 (decode) takes the documented xla path, on any cache length."""
    q, k, v, _ = inputs(Case(2, 1, 4, 2, 16, "causal", s=37))
    kv_pos = jnp.broadcast_to(jnp.arange(37), (2, 37))
    mask = AttentionMask(q_positions=jnp.array([[30], [36]]), kv_positions=kv_pos)
    got = jax.jit(flash_attention)(q, k, v, mask)
    want = jax.jit(naive_attention)(q, k, v, mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("shape_q", "shape_kv", "dtype", "blocks", "message"),
    [
        ((1, 32, 2, 24), (1, 32, 2, 24), "float32", BlockSizes(), "head_dim=24"),
        ((1, 32, 2, 8), (1, 32, 2, 8), "float32", BlockSizes(), "head_dim=8"),
        ((1, 32, 3, 16), (1, 32, 2, 16), "float32", BlockSizes(), "multiple of kv_heads"),
        ((1, 32, 2, 16), (1, 32, 2, 16), "float8_e4m3fn", BlockSizes(), "dtype float8_e4m3fn"),
    ],
)
def test_bad_inputs_are_refused(shape_q, shape_kv, dtype, blocks, message):
    q = jnp.zeros(shape_q, dtype)
    k = jnp.zeros(shape_kv, dtype)
    mask = AttentionMask(
        q_positions=jnp.zeros(shape_q[:2], jnp.int32),
        kv_positions=jnp.zeros(shape_kv[:2], jnp.int32),
    )
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k, mask, block_sizes=blocks)


@pytest.mark.parametrize(
    ("length", "blocks", "padded"),
    [(23, (128, 64), 32), (64, (128, 64), 64), (96, (128, 64), 128), (40, (16, 16), 48),
     (130, (128, 64), 256), (1000, (32, 64), 1024), (16, (128, 128), 16), (3, (16, 16), 16)],
)  # fmt: skip
def test_padded_length_is_a_multiple_of_every_used_tile(length, blocks, padded):
    assert padded_length(length, *blocks) == padded
    for block in blocks:
        used = min(block, padded)
        assert padded % used == 0 and used >= 16


def test_mixed_dtypes_are_refused():
    q = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
    k = jnp.zeros((1, 32, 2, 16), jnp.float32)
    mask = causal_mask(jnp.zeros((1, 32), jnp.int32))
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attention(q, k, k, mask)


@pytest.mark.parametrize("field", ["block_q", "block_k", "backward_block_q", "backward_block_k"])
@pytest.mark.parametrize("value", [8, 48])
def test_block_sizes_must_be_powers_of_two(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}={value}"):
        BlockSizes(**{field: value})


def test_backward_dq_scheme_must_be_known():
    # A Literal-typed field: the runtime type check (tests) or BlockSizes' own check names it.
    with pytest.raises((TypeError, ValueError), match="backward_dq"):
        BlockSizes(backward_dq="fast")


def cuda_mesh():
    """An abstract mesh naming a CUDA device, so that Pallas picks the GPU's Triton target while
    lowering on a CPU-only machine."""
    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"
    )
    return jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device
    )


@pytest.mark.parametrize(
    ("h", "kv", "d", "dtype", "mask_name", "dq"),
    [
        (6, 2, 64, "bfloat16", "packed-window", "atomic"),
        (2, 2, 128, "float32", "causal", "atomic"),
        (6, 2, 64, "bfloat16", "packed-window", "separate"),
    ],
)
def test_forward_and_backward_lower_for_cuda_through_triton(h, kv, d, dtype, mask_name, dq):
    """The real (non-interpret) kernels at the default block sizes pass Triton's lowering checks
    (power-of-two tiles, supported ops, atomic adds), without a GPU. 384 tokens and groups of 3
    query heads are not powers of two: only the loaded tiles must be."""
    case = Case(2, 384, h, kv, d, mask_name, dtype)
    q, k, v, mask = inputs(case)
    blocks = BlockSizes(backward_dq=dq)

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(
            lambda *a: flash_attention(*a, mask, block_sizes=blocks, interpret=False), q, k, v
        )
        return out, vjp(out)

    with jax.sharding.use_abstract_mesh(cuda_mesh()):
        lowered = jax.jit(fwd_bwd).trace(q, k, v).lower(lowering_platforms=("cuda",))
    # forward, then dK/dV/dQ ("atomic") or dK/dV and dQ ("separate")
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == {"atomic": 2, "separate": 3}[dq]


def matmuls_per_tile(blocks: BlockSizes, mask: AttentionMask, q, k) -> dict[str, list[list]]:
    """For each Pallas kernel of forward+backward (by name): for each loop body that does
    matmuls (one tile step; walk_tiles traces its step three times), the dimension numbers of
    its dot_generals."""

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(lambda *a: flash_attention(*a, mask, block_sizes=blocks), q, k, v)
        return vjp(out)

    kernels: dict[str, list[list]] = {}

    def visit(jaxpr, bodies):
        dots = [
            e.params["dimension_numbers"] for e in jaxpr.eqns if e.primitive.name == "dot_general"
        ]
        if dots and bodies is not None:
            bodies.append(dots)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                visit(eqn.params["jaxpr"], kernels.setdefault(str(eqn.params["name"]), []))
        for sub in jex_core.subjaxprs(jaxpr):
            visit(sub, bodies)

    visit(jax.make_jaxpr(fwd_bwd)(q, k, k).jaxpr, None)
    return kernels


def left_transposed(dimension_numbers) -> bool:
    """a.T @ b: the left operand contracts its first (row) dimension."""
    ((lhs_contracting,), _), _ = dimension_numbers
    return lhs_contracting == 0


@pytest.mark.parametrize("dq", ["atomic", "separate"])
def test_each_tile_step_does_flash_attention_2s_matmuls(dq):
    """FlashAttention-2's cost, read off the kernels' jaxprs: the forward does 2 matmuls per tile
    (QK^T, PV); the "atomic" backward 5 per tile pair in one kernel (S^T, dV, dP^T, dK, dQ), of
    which only dQ's transposes a computed tile (dS^T); "separate" 4 in the dK/dV kernel with no
    transposed tile, and 3 in its dQ kernel (S and dP recomputed). GQA (2 query heads per K/V
    head) and packed segments with a window take the same steps."""
    case = Case(1, 64, 4, 2, 16, "packed-window")
    q, k, _, mask = inputs(case)
    kernels = matmuls_per_tile(dataclasses.replace(SMALL, backward_dq=dq), mask, q, k)
    want = {"atomic": {"flash_forward": 2, "flash_backward": 5}}.get(
        dq, {"flash_forward": 2, "flash_backward_dkv": 4, "flash_backward_dq": 3}
    )
    assert {name: {len(body) for body in bodies} for name, bodies in kernels.items()} == {
        name: {n} for name, n in want.items()
    }
    assert all(len(bodies) == 3 for bodies in kernels.values())  # masked, full, masked runs
    transposed = {
        name: {sum(map(left_transposed, body)) for body in bodies}
        for name, bodies in kernels.items()
    }
    assert transposed == {name: {1 if name == "flash_backward" else 0} for name in want}


def test_model_trained_with_flash_tracks_naive():
    config = zoo.preset("tiny-llama", n_layers=2, max_seq_len=32)
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, config.vocab_size)
    optimizer = optax.adam(1e-2)

    def train(attention):
        policy = zoo.Policy(attention=attention)
        model = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
        state = optimizer.init(eqx.filter(model, eqx.is_array))

        @eqx.filter_jit
        def step(model, state):
            def loss_fn(model):
                logits = model(tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

            loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
            updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))
            return eqx.apply_updates(model, updates), state, loss

        losses = []
        for _ in range(4):
            model, state, loss = step(model, state)
            losses.append(float(loss))
        return model, losses

    flash_model, flash_losses = train("flash")
    naive_model, naive_losses = train("naive")
    np.testing.assert_allclose(flash_losses, naive_losses, rtol=1e-4)
    assert naive_losses[-1] < naive_losses[0]  # it trains, so the comparison is not vacuous
    leaves = zip(
        jax.tree.leaves(eqx.filter(flash_model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(naive_model, eqx.is_array)),
        strict=True,
    )
    for a, b in leaves:
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
