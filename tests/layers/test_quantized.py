"""QuantizedLinear: dequantization error within the quantizer's own bound per weight, the forward
within that bound carried through the matmul, stacked == per layer, logical axes, errors.

Bounds (float32, u = eps / 2 the unit roundoff):
- int8: code = round(fl(w / s)) errs from w / s by <= 1/2 + |w / s| u, and fl(code · s) adds
  |code · s| u, so |dequantized - w| <= s / 2 + eps (|w| + s).
- nf4: v = fl(w / absmax) is within u of w / absmax; the level picked by the float32 midpoints
  between levels (each within u of the true one) is within NF4_MAX_HALF_GAP + u of v, and
  fl(level · absmax) adds absmax · u: |dequantized - w| <= absmax (NF4_MAX_HALF_GAP + 2 eps).
- forward: |x · W_q - x · W| <= sum_i |x_i| bound_i, plus float32 rounding of two length-n dot
  products, each <= n u sum_i |x_i| |w_i| (Higham's gamma_n): n eps sum_i |x_i| (|w_i| + bound_i).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers import Linear, QuantizedLinear
from layers.quantized import NF4_LEVELS, NF4_MAX_HALF_GAP
from shard import logical_axes

EPS = float(jnp.finfo(jnp.float32).eps)
# A q/k/v-like projection (one input dim, two output dims) and an o-like one (two input dims).
SHAPES = [
    ((64,), (4, 16), ("embed", "heads", "head_dim")),
    ((4, 32), (48,), ("heads", "head_dim", "embed")),
]
KINDS = [("int8", 64), ("nf4", 16), ("nf4", 32)]


def make_linear(in_shape, out_shape, axes, *, bias=True, key=0):
    return Linear(in_shape, out_shape, axes=axes, use_bias=bias, key=jax.random.key(key))


def error_bound(q: QuantizedLinear, w: jax.Array) -> jax.Array:
    """The per-weight bound above, shaped like `w`."""
    n_in = len(q.in_shape)
    if q.kind == "int8":
        return q.scales / 2 + EPS * (jnp.abs(w) + q.scales)
    absmax = jnp.repeat(q.scales, q.block, axis=n_in - 1)
    return absmax * (NF4_MAX_HALF_GAP + 2 * EPS)


@pytest.mark.parametrize("in_shape, out_shape, axes", SHAPES)
@pytest.mark.parametrize("kind, block", KINDS)
def test_dequantized_weight_within_the_bound(in_shape, out_shape, axes, kind, block):
    linear = make_linear(in_shape, out_shape, axes)
    q = QuantizedLinear.from_linear(linear, kind, block=block)
    assert q.codes.dtype == (jnp.int8 if kind == "int8" else jnp.uint8)
    error = jnp.abs(q.weight() - linear.weight)
    assert bool(jnp.all(error <= error_bound(q, linear.weight)))
    np.testing.assert_array_equal(q.bias, linear.bias)


def test_nf4_levels_and_packing():
    # Weights that are exactly block_absmax x a level come back exactly, in their positions: the
    # nibble order (element 2j low, 2j + 1 high) and the block layout round-trip.
    index = jax.random.randint(jax.random.key(0), (32, 3), 0, 16)
    index = index.at[0].set(15)  # each block's absmax is then 1 x the scale
    w = jnp.asarray(NF4_LEVELS)[index] * jnp.array([0.5, 2.0, 3.0])
    linear = eqx.tree_at(lambda lin: lin.weight, make_linear((32,), (3,), ("embed", "mlp")), w)
    q = QuantizedLinear.from_linear(linear, "nf4", block=32)
    assert q.codes.shape == (16, 3) and q.scales.shape == (1, 3)
    np.testing.assert_array_equal(q.codes & 0xF, index[0::2])
    np.testing.assert_array_equal(q.codes >> 4, index[1::2])
    np.testing.assert_array_equal(q.weight(), w)
    assert NF4_LEVELS.shape == (16,) and NF4_LEVELS[7] == 0.0


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_all_zero_weights_stay_zero(kind):
    linear = make_linear((32,), (4,), ("embed", "mlp"))
    linear = eqx.tree_at(lambda lin: lin.weight, linear, jnp.zeros((32, 4)))
    q = QuantizedLinear.from_linear(linear, kind, block=32)
    np.testing.assert_array_equal(q.weight(), 0.0)


@pytest.mark.parametrize("in_shape, out_shape, axes", SHAPES)
@pytest.mark.parametrize("kind, block", KINDS)
def test_forward_within_the_propagated_bound(in_shape, out_shape, axes, kind, block):
    linear = make_linear(in_shape, out_shape, axes)
    q = QuantizedLinear.from_linear(linear, kind, block=block)
    x = jax.random.normal(jax.random.key(1), (2, 5, *in_shape))
    n_in, n = len(in_shape), int(np.prod(in_shape))
    bound = error_bound(q, linear.weight)
    axes_ = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    dot = lambda a, b: jnp.tensordot(a, b, axes=axes_)  # noqa: E731
    allowed = dot(jnp.abs(x), bound) + n * EPS * dot(jnp.abs(x), jnp.abs(linear.weight) + bound)
    y, reference = eqx.filter_jit(lambda m, x: m(x))(q, x), linear(x)
    assert y.shape == reference.shape == (2, 5, *out_shape)
    assert bool(jnp.all(jnp.abs(y - reference) <= allowed))


def test_compute_dtype():
    q = QuantizedLinear.from_linear(make_linear(*SHAPES[0]), "nf4", block=16)
    x = jnp.ones((1, 64), jnp.float32)
    assert q(x, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    assert q(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("kind, block", KINDS)
def test_dequantize_gives_the_linear_it_stands_for(kind, block):
    q = QuantizedLinear.from_linear(make_linear(*SHAPES[1]), kind, block=block)
    linear = q.dequantize()
    assert isinstance(linear, Linear)
    assert (linear.in_shape, linear.out_shape, linear.axes) == (q.in_shape, q.out_shape, q.axes)
    np.testing.assert_array_equal(linear.weight, q.weight())
    np.testing.assert_array_equal(linear.bias, q.bias)


@pytest.mark.parametrize("kind, block", KINDS)
def test_stacked_linear_quantizes_each_layer_with_its_own_scales(kind, block):
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = eqx.filter_vmap(lambda k: Linear(64, 48, axes=("embed", "mlp"), key=k))(keys)
    # Layers of very different size: shared scales would blow the per-layer bound.
    stacked = eqx.tree_at(
        lambda s: s.weight, stacked, stacked.weight * jnp.array([1e-3, 1, 1e3])[:, None, None]
    )
    q = QuantizedLinear.from_linear(stacked, kind, block=block)
    for i in range(3):
        layer = jax.tree.map(lambda a, i=i: a[i], stacked)
        expected = QuantizedLinear.from_linear(layer, kind, block=block)
        np.testing.assert_array_equal(q.codes[i], expected.codes)
        np.testing.assert_array_equal(q.scales[i], expected.scales)
    dequantized = q.dequantize()
    assert dequantized.weight.shape == stacked.weight.shape
    for i in range(3):
        layer_q = jax.tree.map(lambda a, i=i: a[i], q)
        np.testing.assert_array_equal(dequantized.weight[i], layer_q.weight())


@pytest.mark.parametrize("in_shape, out_shape, axes", SHAPES)
@pytest.mark.parametrize("kind, block", KINDS)
def test_logical_axes_name_every_dim(in_shape, out_shape, axes, kind, block):
    q = QuantizedLinear.from_linear(make_linear(in_shape, out_shape, axes), kind, block=block)
    names = logical_axes(q)
    assert names.codes.names == axes
    assert names.bias.names == axes[len(in_shape) :]
    assert len(names.scales.names) == q.scales.ndim


def test_bad_kind_is_refused(without_runtime_typechecks):
    with pytest.raises(ValueError, match="kind 'int4' is not one of"):
        QuantizedLinear.from_linear(make_linear(*SHAPES[0]), "int4")


@pytest.mark.parametrize("block", [48, 3, 0, 128])
def test_nf4_block_must_divide_the_last_input_dim(block):
    with pytest.raises(ValueError, match=f"nf4 block {block} must be even and divide the last"):
        QuantizedLinear.from_linear(make_linear(*SHAPES[0]), "nf4", block=block)
