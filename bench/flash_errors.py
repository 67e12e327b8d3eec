"""Flash attention's error against the naive specification at GPU-sized shapes, in units of the
dtype's epsilon, for values and all three gradients: what `python -m bench gpu-first` checks
before it times anything.

The reference is naive attention computed in float32 under matmul precision "highest" (on a GPU
XLA's default float32 matmul is TF32, which would make the reference the less exact side), on
the same (possibly bfloat16) inputs. Allowed errors are the tests' (tests/layers/test_flash.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from layers.kernels import AttentionMask, causal_mask, flash_attention, naive_attention


@dataclasses.dataclass(frozen=True)
class ErrorCase:
    name: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    packed_window: int | None = None  # packed documents with this sliding window


def error_cases(gpu: bool) -> list[ErrorCase]:
    b, t = (2, 1024) if gpu else (1, 64)
    return [
        ErrorCase("bf16 GQA d=64 causal", b, t, 8, 2, 64, "bfloat16"),
        ErrorCase("f32 d=64 causal", b, t, 4, 4, 64 if gpu else 32, "float32"),
        ErrorCase("bf16 d=128 causal", b, t, 4, 4, 128 if gpu else 32, "bfloat16"),
        ErrorCase("bf16 packed + window", b, t, 8, 2, 64 if gpu else 16, "bfloat16", t // 8),
    ]


def error_inputs(case: ErrorCase):
    kq, kk, kv, ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (case.batch, case.seq, case.heads, case.head_dim))
    k, v = (
        jax.random.normal(key, (case.batch, case.seq, case.kv_heads, case.head_dim))
        for key in (kk, kv)
    )
    index = jnp.broadcast_to(jnp.arange(case.seq), (case.batch, case.seq))
    if case.packed_window is None:
        mask = causal_mask(index)
    else:  # documents with random boundaries, positions restarting at each
        starts = jax.random.bernoulli(ks, 0.02, index.shape).at[:, 0].set(True)
        segments = jnp.cumsum(starts, axis=1).astype(jnp.int32)
        positions = index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
        mask = causal_mask(positions, segments, sliding_window=case.packed_window)
    return *(x.astype(case.dtype) for x in (q, k, v)), mask


def max_errors(case: ErrorCase) -> dict[str, float]:
    """Max |flash - naive| of out, dq, dk, dv over the reference's max |value| (at least 1), in
    units of the dtype's epsilon (float32's floored at 1e-6, below a softmax's reordering noise),
    for the cotangent cos(out)."""
    q, k, v, mask = error_inputs(case)

    def value_and_grads(kernel, q, k, v, mask: AttentionMask):
        out, vjp = jax.vjp(lambda *a: kernel(*a, mask), q, k, v)
        return out, *vjp(jnp.cos(out.astype(jnp.float32)).astype(out.dtype))

    got = jax.jit(functools.partial(value_and_grads, flash_attention))(q, k, v, mask)
    with jax.default_matmul_precision("highest"):
        up = (x.astype(jnp.float32) for x in (q, k, v))
        want = jax.jit(functools.partial(value_and_grads, naive_attention))(*up, mask)
    eps = max(float(jnp.finfo(case.dtype).eps), 1e-6)
    errors = {}
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        errors[name] = float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1.0) / eps
    return errors


# Allowed error in epsilons, as in tests/layers/test_flash.py.
ERROR_TOLERANCE = {"out": 4.0, "dq": 16.0, "dk": 16.0, "dv": 16.0}
