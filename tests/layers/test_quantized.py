"""Packed weights and the kernels that multiply them: quantizers within their bounds, packing
round trips, every kernel (CPU AVX-512 and portable paths, Pallas interpreted) == dequantize +
matmul within a derived bound, QuantizedLinear / QuantizedEmbedding / QuantizedExperts against
the float modules they stand for, gradients, stacked layers, logical axes, errors.

Bounds (float32, eps the machine epsilon, u = eps / 2 the unit roundoff):
- int8: code = round(fl(w / s)) errs from w / s by <= 1/2 + |w / s| u, and fl(code · s) adds
  |code · s| u, so |dequantized - w| <= s / 2 + eps (|w| + s).
- int4: min16 <= w and the 16 levels span the group (the scale is rounded up), so the code errs
  by <= 1/2 + 16 u (two roundings of a quotient <= 16), and fl(code s + min16) adds
  u (|w| + s): |dequantized - w| <= s / 2 + eps (|w| + |min16| + 16 s).
- nf4: as QLoRA's: |dequantized - w| <= absmax (NF4_MAX_HALF_GAP + 2 eps).
- int8 activations (`with_activations(w, "int8")`): x̂ = quantize_activations(x) is the kernel's
  input, computed in JAX with the same float32 operations as the C++ (so x̂ is the same bits);
  the kernel is then held to the bound below against dequantize + matmul on x̂. x̂ errs from x
  by <= d / 2 + u |x̂| per input (d = the chunk's max |x| / 127: round to nearest, then one
  rounded product).
- a kernel against dequantize + matmul: both sum the same K products of x with the weights'
  parts (code · scale, and the group's minimum and offset · scale, which the kernel adds
  through per-group sums of x); each path's rounding is at most gamma_(K+4) sum_k |x_k| A_k
  (Higham's gamma_n ~ n u, A_k = |code_k scale| + |min + offset scale|, every partial sum
  bounded by it), so they differ by at most (K + 8) eps sum_k |x_k| A_k.
"""

import dataclasses

import equinox as eqx
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers import Embedding, Linear, QuantizedEmbedding, QuantizedLinear
from layers.kernels import cpu as library
from layers.kernels.quantized import (
    KERNEL_TOKENS,
    cpu_dequantize,
    cpu_matmul,
    pallas,
    quantize_activations,
    quantized_matmul,
    quantized_ragged_matmul,
    reference_matmul,
    reference_ragged_matmul,
)
from layers.moe import Experts, QuantizedExperts
from layers.quantized import (
    NF4_LEVELS,
    NF4_MAX_HALF_GAP,
    Int8Weight,
    Q4KWeight,
    Q6KWeight,
    pack,
    pack_high_bits,
    pack_nibbles,
    unpack_high_bits,
    unpack_nibbles,
    with_activations,
)
from shard import logical_axes
from tests.bench.test_cuda_lowering import TRITON_CALL
from tests.layers.test_flash import cuda_mesh
from zoo.pretrained.gguf_blocks import PACKED_TYPES, Q

EPS = float(jnp.finfo(jnp.float32).eps)
KINDS = [("int8", None), ("int8", 32), ("int4", 32), ("int4", 64), ("nf4", 64), ("nf4", 16)]
GGUF_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K]


def random_w(rows=48, cols=256, key=0) -> jax.Array:
    return jax.random.normal(jax.random.key(key), (rows, cols)) * 0.05


def random_gguf(rows: int, cols: int, qtype: Q, seed: int = 0):
    """(raw llama.cpp blocks [rows, bytes], the packed weight they become): random bytes, with
    every float16 scale set to a finite value."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = data.reshape(rows, -1, size)
    halves = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q6_K: [208]}[qtype]
    for at in halves:
        scale = rng.uniform(-0.02, 0.02, blocks.shape[:2]).astype(np.float16)
        blocks[..., at : at + 2] = scale[..., None].view(np.uint8)
    return data, PACKED_TYPES[qtype](data, rows).weight(("embed", "mlp"))


def magnitude(w) -> jax.Array:
    """A_k of the module docstring, `[.., rows, cols]`: |code · scale| + |min + offset · scale|."""
    if isinstance(w, Int8Weight):
        return jnp.abs(w.dequantize())
    if isinstance(w, Q6KWeight):
        return jnp.abs(w.dequantize()) + 32 * jnp.abs(
            jnp.repeat(w.sub_scales * jnp.repeat(w.d.astype(jnp.float32), 16, axis=-1), 16, -1)
        )
    if isinstance(w, Q4KWeight):
        codes = unpack_nibbles(w.codes).astype(jnp.float32)
        d, dmin = (jnp.repeat(a.astype(jnp.float32), 8, axis=-1) for a in (w.d, w.dmin))
        scale = jnp.repeat(w.sub_scales * d, 32, axis=-1)
        return jnp.abs(codes * scale) + jnp.repeat(jnp.abs(w.sub_mins * dmin), 32, axis=-1)
    codes = unpack_nibbles(w.codes)
    scale = jnp.repeat(w.scales.astype(jnp.float32), w.group, axis=-1)
    offset = w.linear_offset
    if offset is None:  # a table: the kernel looks the levels up, no minimum
        return jnp.abs(jnp.asarray(w.levels)[codes] * scale)
    low = 0.0 if w.mins is None else jnp.repeat(w.mins.astype(jnp.float32), w.group, axis=-1)
    return jnp.abs(codes * scale) + jnp.abs(low + offset * scale)


def kernel_bound(x: jax.Array, w) -> jax.Array:
    """(K + 8) eps sum_k |x_k| A_k: `[tokens, rows]`."""
    return (x.shape[-1] + 8) * EPS * (jnp.abs(x) @ magnitude(w).T)


def quantizer_bound(kind: str, packed, w: jax.Array) -> jax.Array:
    g = packed.group
    per = lambda a: jnp.repeat(a.astype(jnp.float32), g, axis=-1)  # noqa: E731
    if kind == "int8":
        s = per(packed.scales)
        return s / 2 + EPS * (jnp.abs(w) + s)
    if kind == "int4":
        s, low = per(packed.scales), per(packed.mins)
        return s / 2 + EPS * (jnp.abs(w) + jnp.abs(low) + 16 * s)
    return per(packed.scales) * (NF4_MAX_HALF_GAP + 2 * EPS)


# --- quantizers and packing ---------------------------------------------------------------


@pytest.mark.parametrize("kind, group", KINDS)
def test_dequantized_weight_within_the_quantizer_bound(kind, group):
    w = random_w()
    packed = pack(w, kind, group=group, axes=("mlp", "embed"))
    assert packed.name == kind and packed.shape == w.shape
    assert packed.group == (group or w.shape[1])
    error = jnp.abs(packed.dequantize() - w)
    assert bool(jnp.all(error <= quantizer_bound(kind, packed, w)))


def test_int4_levels_span_every_group_without_clipping():
    # A group of one huge and many tiny weights: the rounded-up scale keeps the top level >= max.
    w = jnp.concatenate([jnp.full((1, 31), 1e-3), jnp.array([[7.0]])], axis=1)
    packed = pack(w, "int4", axes=("mlp", "embed"))
    top = packed.mins.astype(jnp.float32) + 15 * packed.scales.astype(jnp.float32)
    assert bool(jnp.all(top >= 7.0))
    assert float(jnp.abs(packed.dequantize() - w).max()) <= float(packed.scales[0, 0]) / 2


def test_nibble_and_high_bit_packing_round_trip():
    codes = jax.random.randint(jax.random.key(0), (3, 64), 0, 16)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 32) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(unpack_nibbles(packed), codes)
    # Weight j of a 32-weight chunk in byte j's low nibble, j + 16 in its high one.
    np.testing.assert_array_equal(packed[:, :16] & 15, codes[:, :16])
    np.testing.assert_array_equal(packed[:, :16] >> 4, codes[:, 16:32])
    high = jax.random.randint(jax.random.key(1), (3, 64), 0, 4)
    planes = pack_high_bits(high)
    assert planes.shape == (3, 16)
    np.testing.assert_array_equal(unpack_high_bits(planes), high)


def test_nf4_levels_come_back_exactly():
    index = jax.random.randint(jax.random.key(0), (3, 64), 0, 16).at[:, 0].set(15)
    w = jnp.asarray(NF4_LEVELS)[index] * jnp.array([[0.5], [2.0], [3.0]])
    packed = pack(w, "nf4", axes=("mlp", "embed"))
    np.testing.assert_array_equal(unpack_nibbles(packed.codes), index)
    np.testing.assert_array_equal(packed.dequantize(), w)


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_all_zero_weights_stay_zero(kind):
    packed = pack(jnp.zeros((4, 64)), kind, axes=("mlp", "embed"))
    np.testing.assert_array_equal(packed.dequantize(), 0.0)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda q: q.name)
def test_gguf_blocks_round_trip_against_the_gguf_package(qtype):
    """Each llama.cpp block type, kept packed, dequantizes to exactly what gguf-py computes."""
    data, packed = random_gguf(8, 512, qtype)
    expected = gguf.quants.dequantize(data, qtype)
    assert packed.name == qtype.name.lower()
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), expected)


# --- kernels against the specification ----------------------------------------------------


def packed_cases():
    cases = [(f"{kind}-{group}", pack(random_w(), kind, group=group, axes=("mlp", "embed")))
             for kind, group in KINDS]  # fmt: skip
    cases.append(("int8-f16", Int8Weight(*_f16_int8(), group=32, axes=("mlp", "embed"))))
    cases += [(q.name, random_gguf(48, 512, q)[1]) for q in GGUF_TYPES]
    return cases


def _f16_int8():
    packed = pack(random_w(), "int8", group=32, axes=("mlp", "embed"))
    return packed.codes, packed.scales.astype(jnp.float16)


CASES = packed_cases()
# Rows of 5 chunks: the integer path's blocks of 4 chunks and a partial one.
TAIL_CASES = [
    (f"{kind}-{group}-160", pack(random_w(cols=160), kind, group=group, axes=("mlp", "embed")))
    for kind, group in [("int8", None), ("int8", 32), ("int4", 32), ("nf4", 32)]
] + [("int4-32-51rows", pack(random_w(rows=51), "int4", group=32, axes=("mlp", "embed")))]


def test_activations_are_rounded_within_half_a_step():
    x = jax.random.normal(jax.random.key(0), (3, 96)) * jnp.array([1e-3, 1.0, 1e3])[:, None]
    x = x.at[0, :32].set(0.0)  # an all-zero chunk stays zero
    x_hat = quantize_activations(x)
    step = jnp.repeat(jnp.max(jnp.abs(x.reshape(3, 3, 32)), axis=-1) / 127, 32, axis=-1)
    assert bool(jnp.all(jnp.abs(x_hat - x) <= step / 2 + EPS * jnp.abs(x_hat)))
    np.testing.assert_array_equal(x_hat[0, :32], 0.0)
    codes = x_hat / jnp.where(step > 0, step, 1)
    np.testing.assert_allclose(codes, jnp.round(codes), atol=1e-4)  # integers times the step


# GGUF's groups of 32 with minimums (Q4_1) and two-level constants (Q4_K) on rows that leave a
# partial vector of sixteen (int8 activations' path for them).
BLOCK_CASES = [
    *TAIL_CASES,
    ("q4_1-51rows", random_gguf(51, 160, Q.Q4_1)[1]),
    ("q4_k-40rows", random_gguf(40, 256, Q.Q4_K)[1]),
]


@pytest.mark.parametrize("name, weight", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_one_token_equals_its_row_of_a_token_block_bit_for_bit(name, weight, int8):
    """Float activations on AVX-512: groups of 32 run a lone token four rows at a time, blocks of
    8 tokens two rows at a time and of 4 and 2 four (51 rows: tails of one and three rows); other
    groups a lone token four rows at a time, blocks of 4 and 2 one row at a time. int8
    activations with AVX-512 VNNI: groups of 32 sixteen rows a vector in blocks of 8, 4, 2 and 1
    tokens. Every path sums each output in the same order, so a token's outputs are the same
    bits either way (on a CPU without AVX-512 all are the portable path)."""
    tokens = 15  # below the blocked path's 16 (32): a block of 8 where the group is 32, 4, 2, 1
    x = jax.random.normal(jax.random.key(5), (tokens, weight.cols))
    product = jax.jit(lambda x, w: cpu_matmul(x, w, int8_activations=int8))
    together = product(x, weight)
    for t in range(tokens):
        np.testing.assert_array_equal(product(x[t : t + 1], weight)[0], together[t], err_msg=name)


@pytest.mark.parametrize("name, weight", CASES + TAIL_CASES,
                         ids=[c[0] for c in CASES + TAIL_CASES])  # fmt: skip
@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
def test_cpu_kernel_equals_dequantize_then_matmul(name, weight, portable):
    # 1, 7 and 33 tokens: the kernel's blocks of 4 and 2 tokens and the single-token tail (8
    # tokens: the bit-for-bit test above); 33 with float activations: blocks of rows dequantized
    # once for every token, with int8 activations blocks of 8 tokens. int8 activations: the
    # kernel's input is x̂ (the module docstring), the same bound on it.
    for tokens in (1, 7, 33):
        x = jax.random.normal(jax.random.key(tokens), (tokens, weight.cols))
        for int8, x_in in ((True, quantize_activations(x)), (False, x)):
            y = jax.jit(
                lambda x, w, int8=int8: cpu_matmul(x, w, int8_activations=int8, portable=portable)
            )(x, weight)
            reference = reference_matmul(x_in, weight)
            assert y.shape == reference.shape == (tokens, weight.shape[0])
            assert bool(jnp.all(jnp.abs(y - reference) <= kernel_bound(x_in, weight))), name


@pytest.mark.parametrize("name, weight", CASES + TAIL_CASES,
                         ids=[c[0] for c in CASES + TAIL_CASES])  # fmt: skip
@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
def test_cpu_dequantize_is_the_specification_bit_for_bit(name, weight, portable):
    # Both compute each value as dequantize() does in float32 (one product, then the minimum),
    # so no tolerance: the bits, signed zeros included.
    w = jax.jit(lambda w: cpu_dequantize(w, portable=portable))(weight)
    reference = weight.dequantize(jnp.float32)
    assert w.shape == reference.shape and w.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(w).view(np.uint32), np.asarray(reference).view(np.uint32)
    )


def test_cpu_dequantize_takes_leading_dims_and_vmap():
    weight = pack(random_w(rows=3 * 40, cols=64).reshape(3, 40, 64), "int4", group=32,
                  axes=("experts", "mlp", "embed"))  # fmt: skip
    reference = np.asarray(weight.dequantize()).view(np.uint32)
    stacked = jax.jit(cpu_dequantize)(weight)
    mapped = jax.jit(jax.vmap(cpu_dequantize))(weight)
    np.testing.assert_array_equal(np.asarray(stacked).view(np.uint32), reference)
    np.testing.assert_array_equal(np.asarray(mapped).view(np.uint32), reference)


@pytest.mark.parametrize("sizes", [(2, 0, 3, 1), (0, 0, 6, 0), (1, 1, 1, 1), (1, 33, 0, 2)])
@pytest.mark.parametrize("kind, int8", [("int8", True), ("int4", True), ("int4", False)])
def test_cpu_kernel_per_expert_equals_ragged_dot(sizes, kind, int8):
    # (1, 33, 0, 2) with float activations: the expert of 33 rows takes the blocked path, the
    # others the per-token one.
    w = jax.random.normal(jax.random.key(0), (4, 40, 64)) * 0.05
    weight = pack(w, kind, axes=("experts", "mlp", "embed"))
    x = jax.random.normal(jax.random.key(1), (sum(sizes) + 1, 64))  # the last row: no expert's
    group_sizes = jnp.asarray(sizes, jnp.int32)
    y = jax.jit(lambda *a: cpu_matmul(*a, int8_activations=int8))(x, weight, group_sizes)
    x = quantize_activations(x) if int8 else x  # what the kernel multiplies
    reference = reference_ragged_matmul(x, weight, group_sizes)
    assigned = sum(sizes)
    np.testing.assert_array_equal(y[assigned:], 0.0)
    expert = np.repeat(np.arange(4), sizes)
    bound = jnp.concatenate(
        [
            kernel_bound(x[i : i + 1], jax.tree.map(lambda a, e=e: a[e], weight))
            for i, e in enumerate(expert)
        ]
    )
    assert bool(jnp.all(jnp.abs(y[:assigned] - reference[:assigned]) <= bound))


@pytest.mark.parametrize("name, weight", [c for c in CASES if pallas.supports(c[1])],
                         ids=[c[0] for c in CASES if pallas.supports(c[1])])  # fmt: skip
def test_pallas_kernel_interpreted_equals_dequantize_then_matmul(name, weight):
    x = jax.random.normal(jax.random.key(0), (3, weight.cols))
    y = pallas.pallas_matmul(x, weight, interpret=True)
    assert bool(jnp.all(jnp.abs(y - reference_matmul(x, weight)) <= kernel_bound(x, weight)))


def test_pallas_kernel_declares_what_it_takes():
    names = {name for name, w in CASES if pallas.supports(w)}
    assert names == {"int8-None", "int8-32", "int4-32", "int4-64", "int8-f16", "Q8_0", "Q4_0",
                     "Q4_1"}  # fmt: skip
    nf4 = dict(CASES)["nf4-64"]
    with pytest.raises(ValueError, match="does not take a nf4 weight"):
        pallas.pallas_matmul(jnp.ones((1, nf4.cols)), nf4, interpret=True)


def test_missing_or_stale_library_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setattr(library, "LIBRARY", tmp_path / "_matmul.so")
    library._registered.cache_clear()
    with pytest.raises(library.KernelNotBuilt, match=r"python -m layers.kernels.cpu.build"):
        library.ensure_built()
    monkeypatch.undo()
    library._registered.cache_clear()
    with pytest.raises(
        library.KernelNotBuilt, match=r"another version of matmul\.cc and dense\.cc"
    ):
        library._registered("0" * 64)
    library.ensure_built()


# --- layers -------------------------------------------------------------------------------

SHAPES = [  # a q/k/v-like projection (two output dims) and an o-like one (two input dims)
    ((64,), (4, 16), ("embed", "heads", "head_dim")),
    ((4, 32), (48,), ("heads", "head_dim", "embed")),
]


@pytest.mark.parametrize("in_shape, out_shape, axes", SHAPES)
@pytest.mark.parametrize("kind, group", KINDS[:5])
@pytest.mark.parametrize("tokens", [1, KERNEL_TOKENS + 1], ids=["kernel", "xla"])
def test_quantized_linear_is_the_linear_of_its_dequantized_weight(
    in_shape, out_shape, axes, kind, group, tokens
):
    linear = Linear(in_shape, out_shape, axes=axes, use_bias=True, key=jax.random.key(0))
    q = QuantizedLinear.from_linear(linear, kind, group=group)
    assert q.kind == kind and (q.in_shape, q.out_shape, q.axes) == (in_shape, out_shape, axes)
    float_linear = q.dequantize()
    assert isinstance(float_linear, Linear) and float_linear.weight.shape == linear.weight.shape
    np.testing.assert_array_equal(float_linear.bias, linear.bias)
    x = jax.random.normal(jax.random.key(1), (1, tokens, *in_shape))
    forward = eqx.filter_jit(lambda m, x: m(x))
    # The kernel (up to KERNEL_TOKENS tokens) takes x as it is (float activations, the default),
    # as dequantize + XLA do; with int8 activations the kernel multiplies x̂.
    kernel = tokens <= KERNEL_TOKENS
    rounded = quantize_activations(x.reshape(tokens, -1)).reshape(x.shape)
    for model, x_in in [(q, x)] + ([(with_activations(q, "int8"), rounded)] if kernel else []):
        y = forward(model, x)
        reference = float_linear(x_in)
        bound = kernel_bound(x_in.reshape(tokens, -1), q.packed).reshape(1, tokens, *out_shape)
        assert y.shape == reference.shape
        assert bool(jnp.all(jnp.abs(y - reference) <= bound))


def test_gradient_reaches_the_input_alone():
    q = QuantizedLinear.from_linear(
        Linear(64, 32, axes=("embed", "mlp"), key=jax.random.key(0)), "int4"
    )
    q = with_activations(q, "float")  # the forward's x as it is: sin' at the float model's y
    x = jax.random.normal(jax.random.key(1), (2, 64))
    dx = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(q(x)))))(x)  # one program, not op by op
    w = q.weight()
    want = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(x @ w))))(x)
    np.testing.assert_allclose(dx, want, rtol=1e-5, atol=1e-6)
    # The packed weight is frozen: its float arrays (scales, minimums) get zero cotangents.
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x))))(q, x)
    assert jax.tree.leaves(grads.packed)  # scales and minimums were differentiated...
    for leaf in jax.tree.leaves(grads.packed):
        np.testing.assert_array_equal(leaf, 0.0)  # ...to zero
    assert np.any(np.asarray(grads.bias) != 0.0) if grads.bias is not None else True


def test_compute_dtype():
    q = QuantizedLinear.from_linear(
        Linear(64, 32, axes=("embed", "mlp"), key=jax.random.key(0)), "nf4"
    )
    x = jnp.ones((1, 64), jnp.float32)
    assert q(x, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    assert q(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_stacked_linear_gets_each_layers_own_scales(kind):
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = eqx.filter_vmap(lambda k: Linear(64, 48, axes=("embed", "mlp"), key=k))(keys)
    # Layers of very different size: shared scales would blow the per-layer bound.
    stacked = eqx.tree_at(
        lambda s: s.weight, stacked, stacked.weight * jnp.array([1e-3, 1, 1e3])[:, None, None]
    )
    q = QuantizedLinear.from_linear(stacked, kind)
    for i in range(3):
        layer = jax.tree.map(lambda a, i=i: a[i], stacked)
        one = QuantizedLinear.from_linear(layer, kind)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(jax.tree.map(lambda a, i=i: a[i], q)),
                        strict=True):  # fmt: skip
            np.testing.assert_array_equal(a, b)
    assert q.dequantize().weight.shape == stacked.weight.shape


def test_quantized_embedding_looks_up_and_unembeds():
    embedding = Embedding(256, 64, key=jax.random.key(0))
    q = QuantizedEmbedding.from_embedding(embedding, "int8")
    table = q.packed.dequantize()
    tokens = jnp.array([[0, 5, 255]])
    np.testing.assert_array_equal(q(tokens), table[tokens])
    x = jax.random.normal(jax.random.key(1), (1, 2, 64))
    x_hat = quantize_activations(x[0])[None]  # the kernel's input with int8 activations
    for model, x_in in ((q, x), (with_activations(q, "int8"), x_hat)):
        bound = kernel_bound(x_in[0], q.packed)[None]
        assert bool(jnp.all(jnp.abs(model.unembed(x) - x_in @ table.T) <= bound))
    np.testing.assert_array_equal(q.dequantize().weight, table)


def test_quantized_experts_are_the_experts_of_their_dequantized_weights():
    experts = Experts(4, 64, 96, key=jax.random.key(0))
    q = QuantizedExperts.from_experts(experts, "int4", group=32)
    assert q.n_experts == 4 and q.kind == "int4"
    floats = q.dequantize()
    q = with_activations(q, "float")  # x as it is: the float experts' inputs
    x = jax.random.normal(jax.random.key(1), (6, 64))
    sizes = jnp.array([2, 0, 3, 1], jnp.int32)
    # Same weights, another summation order: the tolerance of tests/zoo/test_transformer.py.
    np.testing.assert_allclose(q.grouped(x, sizes), floats.grouped(x, sizes), rtol=1e-5, atol=1e-5)
    buffer = jax.random.normal(jax.random.key(2), (4, 1, 2, 64))
    np.testing.assert_allclose(q.batched(buffer), floats.batched(buffer), rtol=1e-5, atol=1e-5)


def test_ragged_gradient_reaches_the_input():
    w = jax.random.normal(jax.random.key(0), (2, 32, 64)) * 0.05
    weight = pack(w, "int8", axes=("experts", "mlp", "embed"))
    weight = with_activations(weight, "float")  # the forward's x as it is (y in the gradient)
    sizes = jnp.array([1, 2], jnp.int32)
    x = jax.random.normal(jax.random.key(1), (3, 64))
    # Each gradient as one program, not op by op.
    dx = jax.jit(jax.grad(lambda x: jnp.sum(quantized_ragged_matmul(x, weight, sizes) ** 2)))(x)
    deq = jnp.swapaxes(weight.dequantize(), -1, -2)
    want = jax.jit(jax.grad(lambda x: jnp.sum(jax.lax.ragged_dot(x, deq, sizes) ** 2)))(x)
    np.testing.assert_allclose(dx, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_logical_axes_name_every_array(kind):
    q = QuantizedLinear.from_linear(Linear(64, (4, 16), axes=("embed", "heads", "head_dim"),
                                           use_bias=True, key=jax.random.key(0)), kind)  # fmt: skip
    names = logical_axes(q)
    assert names.packed.codes.names == ("heads", "embed")
    assert names.packed.scales.names == ("heads", "embed")
    assert names.bias.names == ("heads", "head_dim")


def test_quantized_matmul_under_vmap():
    weight = with_activations(pack(random_w(), "int4", axes=("mlp", "embed")), "int8")
    x = jax.random.normal(jax.random.key(1), (3, 1, weight.cols))
    y = jax.vmap(lambda x: quantized_matmul(x, weight))(x)
    x_hat = quantize_activations(x[:, 0])  # each row rounded on its own, as unbatched
    assert bool(
        jnp.all(jnp.abs(y[:, 0] - reference_matmul(x_hat, weight)) <= kernel_bound(x_hat, weight))
    )


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
@pytest.mark.parametrize("tokens", [1, KERNEL_TOKENS + 1], ids=["kernel", "many"])
def test_one_path_is_traced_for_the_backend(monkeypatch, backend, tokens):
    # ops.py picks the path when tracing: on a CPU the kernel (few tokens) or the library's
    # dequantize + one dot (many); on a backend without a kernel the specification alone (it
    # runs here too, on the CPU). One path only: no other path's call in the program.
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    weight = pack(random_w(), "int4", axes=("mlp", "embed"))
    x = jax.random.normal(jax.random.key(3), (tokens, weight.cols))
    f = jax.jit(lambda x, w: quantized_matmul(x, w))  # a new function: traced afresh
    text = f.trace(x, weight).lower().as_text()
    called = {t for t in (library.QUANTIZED_TARGET, library.DEQUANTIZE_TARGET) if t in text}
    kernel = tokens <= KERNEL_TOKENS
    expected = {library.QUANTIZED_TARGET if kernel else library.DEQUANTIZE_TARGET}
    assert called == (expected if backend == "cpu" else set())
    if backend == "tpu" or not kernel:  # the specification's float weight (bit for bit, above)
        # and a dot of it; only the dots' summation orders may differ: each errs by at most
        # K eps sum_k |x_k w_k|, so they differ by at most twice that.
        w = weight.dequantize()
        bound = 2 * weight.cols * EPS * (jnp.abs(x) @ jnp.abs(w).T)
        assert bool(jnp.all(jnp.abs(f(x, weight) - x @ w.T) <= bound))


# --- bad inputs -----------------------------------------------------------------------------


def test_bad_activations_are_refused(without_runtime_typechecks):
    weight = pack(random_w(), "int8", axes=("mlp", "embed"))
    with pytest.raises(ValueError, match="activations 'int4' is not one of"):
        dataclasses.replace(weight, activations="int4")
    with pytest.raises(ValueError, match="activations 'bf16' is not one of"):
        with_activations(weight, "bf16")
    assert with_activations(weight, "float").activations == "float"


def test_bad_kind_is_refused(without_runtime_typechecks):
    with pytest.raises(ValueError, match="kind 'int3' is not one of"):
        pack(random_w(), "int3", axes=("mlp", "embed"))


@pytest.mark.parametrize(
    "kind, group, message",
    [
        ("int4", 48, r"group size 48 must divide the 256 inputs of a row and be 16 or a multiple"),
        ("nf4", 3, r"nf4 group size 3 must be even"),
        ("int8", 512, r"group size 512 must divide the 256 inputs"),
    ],
)
def test_group_that_does_not_divide_the_row_is_refused(kind, group, message):
    with pytest.raises(ValueError, match=message):
        pack(random_w(), kind, group=group, axes=("mlp", "embed"))


def test_row_not_a_multiple_of_32_is_refused():
    linear = Linear(48, 16, axes=("embed", "mlp"), key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"Linear \(48,\) -> \(16,\) \(int8\): 48 inputs per row is not a multiple of 32",
    ):
        QuantizedLinear.from_linear(linear, "int8")


# --- GPU: lowering for CUDA on this CPU (the real Triton kernel, not the interpreter) -------


@pytest.mark.parametrize(
    "kind, group, rows, cols, tokens",
    [("int8", None, 576, 576, 1), ("int4", 32, 1536, 576, 8), ("int8", 32, 49152, 576, 1)],
)
def test_pallas_kernel_lowers_for_cuda(monkeypatch, kind, group, rows, cols, tokens):
    # The path is chosen by the backend the program is traced for (ops.py): a GPU's here.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    weight = pack(jnp.zeros((rows, cols)), kind, group=group, axes=("mlp", "embed"))
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), weight)
    x = jax.ShapeDtypeStruct((tokens, cols), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(cuda_mesh()):
        lowered = jax.jit(quantized_matmul).trace(x, abstract).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    # The Pallas kernel, and not the CPU kernel's custom call.
    assert text.count(TRITON_CALL) == 1 and library.QUANTIZED_TARGET not in text


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("kind", ["int8", "int4", "nf4"])
def test_a_layer_of_a_stacked_weight_is_read_where_it_lies(kind, tokens):
    # What a stacked model's layer loop runs (`QuantizedLinear.at_layer`): the kernel reads layer
    # i of the stack in place, the same work on the same bytes as on the layer's own copy, so
    # bit for bit its product; one token, the per-token walk and the blocked one (33 rows).
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = eqx.filter_vmap(lambda k: Linear(64, 48, axes=("embed", "mlp"), key=k))(keys)
    q = QuantizedLinear.from_linear(stacked, kind)
    x = jax.random.normal(jax.random.key(1), (tokens, 64))
    call = jax.jit(lambda x, q, i: q.at_layer(i)(x))
    for i in range(3):
        one = jax.tree.map(lambda a, i=i: a[i], q)
        np.testing.assert_array_equal(call(x, q, jnp.int32(i)), jax.jit(lambda x, q: q(x))(x, one))
    with pytest.raises(ValueError, match=r"stacked \[experts or layers, rows, cols\] with"):
        cpu_matmul(x, q.packed)  # a stack without a layer
    with pytest.raises(Exception, match="layer out of range"):
        call(x, q, jnp.int32(3)).block_until_ready()
