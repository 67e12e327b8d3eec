"""cuDNN's fused flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`:
the fastest attention on NVIDIA GPUs that JAX reaches (forward and backward in cuDNN's kernels).

What it serves: self-attention (queries and keys the same tokens, `q_positions` ==
`kv_positions`, so the causal test by index equals ours by position within each document),
packed documents (segment ids, as a boolean mask cuDNN takes as a bias), a fixed sliding window,
float16/bfloat16 inputs, head_dim a multiple of 8 up to 256. What it refuses, naming the kernel
that can: soft-capping, a traced per-layer window, a non-causal mask, float32, a backend other
than an NVIDIA GPU.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from layers.kernels.mask import AttentionMask

HEAD_DIMS = tuple(range(8, 257, 8))  # what cuDNN's fused attention takes
DTYPES = ("bfloat16", "float16")


def cudnn_attention(
    q: Float[Array, "batch seq heads head_dim"],
    k: Float[Array, "batch seq kv_heads head_dim"],
    v: Float[Array, "batch seq kv_heads head_dim"],
    mask: AttentionMask,
    *,
    softcap: float | None = None,
) -> Float[Array, "batch seq heads head_dim"]:
    """Same contract as `naive_attention` for causal self-attention (see the module docstring
    for what is served); GQA is native."""
    _check_served(q, k, mask, softcap)
    window = mask.sliding_window
    segments = None
    if mask.q_segment_ids is not None:
        segments = (mask.q_segment_ids[:, :, None] == mask.kv_segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q, k, v, mask=segments, is_causal=True, implementation="cudnn",
        local_window_size=None if window is None else (window - 1, 0),
    )  # fmt: skip


def _check_served(q, k, mask: AttentionMask, softcap: float | None) -> None:
    def refuse(what: str) -> None:
        raise ValueError(f"attention='cudnn' {what}; use attention='flash' (or 'naive')")

    if jax.default_backend() != "gpu":
        refuse(f"runs only on NVIDIA GPUs (this backend is {jax.default_backend()!r})")
    if softcap is not None:
        refuse(f"cannot soft-cap attention scores (softcap={softcap})")
    if not mask.causal:
        refuse("serves causal masks only")
    if mask.sliding_window is not None and not isinstance(mask.sliding_window, int):
        refuse("needs a fixed sliding window (a Python int), not a per-layer traced one")
    if jnp.dtype(q.dtype).name not in DTYPES:
        refuse(f"computes in bfloat16 or float16, not {q.dtype}")
    if q.shape[1] != k.shape[1]:
        refuse(f"serves self-attention only (seq {q.shape[1]} != kv_seq {k.shape[1]})")
    if q.shape[-1] not in HEAD_DIMS:
        refuse(f"needs head_dim a multiple of 8 up to 256, not {q.shape[-1]}")
