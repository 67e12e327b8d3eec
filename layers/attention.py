"""Multi-head attention (Vaswani et al. 2017) with grouped K/V heads (GQA, Ainslie et al. 2023;
MQA when n_kv_heads == 1), optional QK-norm, rotary positions, a pluggable kernel and an optional
KV cache; Gemma's score scale (query_pre_attn_scalar) and score soft-capping (Gemma 2)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from layers.kernels import AttentionKernel, AttentionMask
from layers.kv_cache import LayerView
from layers.linear import Linear
from layers.norm import RMSNorm
from layers.rotary import apply_rotary


class Attention(eqx.Module):
    """x -> q, k, v projections -> (rotary) -> [KV cache] -> kernel -> output projection.

    The kernel is an argument of each call (`layers.kernels.Xla()`, `Flash(...)`, ...), not a
    weight: the same module runs under any kernel.

    `query_scale`: scores are scaled by query_scale^-1/2 instead of head_dim^-1/2 (Gemma's
    query_pre_attn_scalar), done by scaling q by sqrt(head_dim / query_scale) so that kernels
    keep their one scale. `softcap`: the kernel caps the scaled scores at softcap * tanh(s /
    softcap) (Gemma 2); a kernel that cannot raises.
    """

    q_proj: Linear | None
    k_proj: Linear | None
    v_proj: Linear | None
    o_proj: Linear
    qkv_proj: Linear | None
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    query_scale: float | None = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        norm_plus_one: bool = False,
        use_bias: bool = False,
        qkv_bias: bool = False,
        query_scale: float | None = None,
        softcap: float | None = None,
        out_init_std: float | None = None,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        q_key, k_key, v_key, o_key = jax.random.split(key, 4)
        # `qkv_bias`: biases on q, k and v alone (Qwen2); `use_bias`: on every projection.
        in_bias = use_bias or qkv_bias
        self.q_proj = Linear(
            d_model,
            (n_heads, head_dim),
            axes=("embed", "heads", "head_dim"),
            use_bias=in_bias,
            dtype=dtype,
            key=q_key,
        )
        self.k_proj = Linear(
            d_model,
            (n_kv_heads, head_dim),
            axes=("embed", "kv_heads", "head_dim"),
            use_bias=in_bias,
            dtype=dtype,
            key=k_key,
        )
        self.v_proj = Linear(
            d_model,
            (n_kv_heads, head_dim),
            axes=("embed", "kv_heads", "head_dim"),
            use_bias=in_bias,
            dtype=dtype,
            key=v_key,
        )
        self.o_proj = Linear(
            (n_heads, head_dim),
            d_model,
            axes=("heads", "head_dim", "embed"),
            use_bias=use_bias,
            init_std=out_init_std,
            dtype=dtype,
            key=o_key,
        )
        norm = lambda: RMSNorm(  # noqa: E731
            head_dim, eps=norm_eps, axis_name="head_dim", plus_one=norm_plus_one, dtype=dtype
        )
        self.q_norm = norm() if qk_norm else None
        self.k_norm = norm() if qk_norm else None
        self.qkv_proj = None
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.query_scale, self.softcap = query_scale, softcap

    def fused(self) -> "Attention":
        """The same attention with q, k and v as one projection (one matmul per step instead of
        three: fewer kernels per decode step), weights `[embed, kv_heads, group + 2, head_dim]`
        holding each K/V head's `group` query heads, then its key and value: splitting
        `kv_heads` over devices keeps whole GQA groups. A copy of the three weights (keep the
        result, drop this one); adapters and quantized projections are refused (merge first)."""
        if self.qkv_proj is not None:
            return self
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if any(type(p) is not Linear for p in projections):
            raise ValueError(
                "fusing q/k/v needs plain Linear projections, got "
                f"{[type(p).__name__ for p in projections]}; merge LoRA adapters "
                "(zoo.merge_adapter) and fuse the float model, not a quantized one"
            )
        kv, group = self.n_kv_heads, self.n_heads // self.n_kv_heads

        def parts(q, k, v):  # [..., heads, head_dim] and [..., kv_heads, head_dim] each
            q = q.reshape(*q.shape[:-2], kv, group, self.head_dim)
            return jnp.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)

        bias = None if self.q_proj.bias is None else parts(*(p.bias for p in projections))
        weight = parts(*(p.weight for p in projections))
        axes = ("embed", "kv_heads", "qkv", "head_dim")
        qkv = Linear.of(weight, bias, n_in=1, axes=axes)
        return eqx.tree_at(
            lambda a: (a.q_proj, a.k_proj, a.v_proj, a.qkv_proj),
            self,
            (None, None, None, qkv),
            is_leaf=lambda x: x is None,
        )

    def unfused(self) -> "Attention":
        """The inverse of `fused`: q, k and v as separate projections again (a copy)."""
        if self.qkv_proj is None:
            return self
        group = self.n_heads // self.n_kv_heads

        def split(x):  # [..., kv_heads, group + 2, head_dim] -> q, k, v
            q = x[..., :group, :].reshape(*x.shape[:-3], self.n_heads, self.head_dim)
            return q, x[..., group, :], x[..., group + 1, :]

        weights = split(self.qkv_proj.weight)
        biases = (None,) * 3 if self.qkv_proj.bias is None else split(self.qkv_proj.bias)
        axes = [("embed", "heads", "head_dim")] + [("embed", "kv_heads", "head_dim")] * 2
        q, k, v = (Linear.of(w, b, n_in=1, axes=a)
                   for w, b, a in zip(weights, biases, axes, strict=True))  # fmt: skip
        return eqx.tree_at(
            lambda a: (a.q_proj, a.k_proj, a.v_proj, a.qkv_proj),
            self,
            (q, k, v, None),
            is_leaf=lambda x: x is None,
        )

    def project(
        self,
        x: Float[Array, "batch seq embed"],
        rope: tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]] | None,
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """q, k, v for these tokens: projected, QK-normed (if on) and rotated (if rope); q scaled
        for `query_scale`."""
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:  # [batch, seq, kv_heads, group + 2, head_dim]: each K/V head's queries, k, v
            qkv = self.qkv_proj(x)
            group = self.n_heads // self.n_kv_heads
            q = qkv[..., :group, :].reshape(*qkv.shape[:-3], self.n_heads, self.head_dim)
            k, v = qkv[..., group, :], qkv[..., group + 1, :]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.query_scale is not None:
            q = q * jnp.asarray(math.sqrt(self.head_dim / self.query_scale), q.dtype)
        return q, k, v

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: AttentionMask,
        rope: tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]] | None = None,
        *,
        kernel: AttentionKernel,
        cache: LayerView | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], LayerView | None]:
        """(output, updated cache view or None). Without a cache `kernel` attends under `mask`;
        with one (a layer's view of the KV cache, layers/kv_cache.py) this call's keys and values
        are written into it and attention runs over everything its rows hold, within the mask's
        window (the cache's own paged kernels: `kernel` is for uncached calls)."""
        q, k, v = self.project(x, rope)
        if cache is None:
            return self.o_proj(kernel(q, k, v, mask, softcap=self.softcap)), None
        out, cache = cache.attend(q, k, v, window=mask.sliding_window, softcap=self.softcap)
        return self.o_proj(out), cache
