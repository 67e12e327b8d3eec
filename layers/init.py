"""Weight initialisation: normal draws scaled by a standard deviation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike
from jaxtyping import Array, PRNGKeyArray


def scaled_normal(key: PRNGKeyArray, std: float, shape: tuple[int, ...], dtype: DTypeLike) -> Array:
    """`std * N(0, 1)` of `shape`, drawn in float32 and cast to `dtype`: one compiled program per
    shape and dtype (op by op, the draw, the scaling and the cast were a program each, and each
    new weight shape compiled them all). The same floats as those ops run eagerly; under `vmap`
    (a stack's layers) one batched program."""
    return _scaled_normal(key, std, tuple(int(n) for n in shape), np.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _scaled_normal(key, std, shape, dtype):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
