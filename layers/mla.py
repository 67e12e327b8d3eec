"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434, section 2.1; DeepSeek-V3, arXiv
2412.19437, section 2.1.1), laid out as HF's DeepseekV3Attention.

Per token: a query (a plain projection, or a rank-`q_rank` latent -> RMSNorm -> up-projection)
split per head into a non-rotary part `q_nope` and a rotary part `q_pe`; one latent
`kv_a_proj(x) = [c (kv_rank), k_pe (rope_dim)]`, c RMS-normed, k_pe one rotary key shared by all
heads; `kv_b_proj(c)` gives each head's `k_nope` and value. Keys are `[k_nope, k_pe]`.

Two equal ways to compute it:
- expanded (training and prefill without a cache): per-head keys and values, any kernel;
- absorbed (with a cache, paper eq. 10-11's remark): only `[c, k_pe]` is cached, `kv_rank +
  rope_dim` numbers per token and layer. `q_nope . k_nope = (q_nope W_uk) . c`, so the query moves
  into latent space and attention runs as MQA over the cache (keys `[c, k_pe]`, one K/V head);
  the values are those same cached rows, whose first `kv_rank` output columns are
  `sum_j p_j c_j` (the trailing `rope_dim` columns are dropped), and `W_uv` lifts that to each
  head's value before `o_proj`. Values equal to the keys let every kernel (naive, xla, flash,
  the paged decode kernels) run unchanged, and nothing is stored twice.

Kernels divide scores by sqrt(their q width); MLA's scale is `scale` (head_dim^-0.5, times YaRN's
mscale^2), so q is multiplied by `scale * sqrt(width)` first.
"""

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

Rope = tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]


class MLA(eqx.Module):
    """x -> (latent q) -> per-head q; x -> latent [c, k_pe] -> per-head k, v -> kernel -> o_proj.

    `head_dim` is the query/key width per head (non-rotary + `rope_dim` rotary dims), `v_dim` the
    value width. `rope_interleave`: q_pe and k_pe come out of their projections as interleaved
    pairs (x0, x1), (x2, x3)... (DeepSeek's checkpoints) and are de-interleaved before rotating.
    """

    q_proj: Linear | None
    q_a_proj: Linear | None
    q_a_norm: RMSNorm | None
    q_b_proj: Linear | None
    kv_a_proj: Linear
    kv_a_norm: RMSNorm
    kv_b_proj: Linear
    o_proj: Linear
    n_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    rope_dim: int = eqx.field(static=True)
    v_dim: int = eqx.field(static=True)
    kv_rank: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    rope_interleave: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        *,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        v_dim: int,
        kv_rank: int,
        q_rank: int | None,
        scale: float,
        rope_interleave: bool = True,
        norm_eps: float = 1e-6,
        out_init_std: float | None = None,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        if not 0 < rope_dim < head_dim or rope_dim % 2:
            raise ValueError(
                f"MLA rope_dim={rope_dim} must be even and in (0, head_dim={head_dim})"
            )
        qa_key, qb_key, kva_key, kvb_key, o_key = jax.random.split(key, 5)
        heads = (n_heads, head_dim)
        if q_rank is None:
            self.q_proj = Linear(
                d_model, heads, axes=("embed", "heads", "head_dim"), dtype=dtype, key=qb_key
            )
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(
                d_model, q_rank, axes=("embed", "latent"), dtype=dtype, key=qa_key
            )
            self.q_a_norm = RMSNorm(q_rank, eps=norm_eps, axis_name="latent", dtype=dtype)
            self.q_b_proj = Linear(
                q_rank, heads, axes=("latent", "heads", "head_dim"), dtype=dtype, key=qb_key
            )
        self.kv_a_proj = Linear(
            d_model, kv_rank + rope_dim, axes=("embed", "latent"), dtype=dtype, key=kva_key
        )
        self.kv_a_norm = RMSNorm(kv_rank, eps=norm_eps, axis_name="latent", dtype=dtype)
        self.kv_b_proj = Linear(
            kv_rank,
            (n_heads, head_dim - rope_dim + v_dim),
            axes=("latent", "heads", "head_dim"),
            dtype=dtype,
            key=kvb_key,
        )
        self.o_proj = Linear(
            (n_heads, v_dim),
            d_model,
            axes=("heads", "head_dim", "embed"),
            init_std=out_init_std,
            dtype=dtype,
            key=o_key,
        )
        self.n_heads, self.head_dim, self.rope_dim, self.v_dim = n_heads, head_dim, rope_dim, v_dim
        self.kv_rank, self.scale, self.rope_interleave = kv_rank, scale, rope_interleave

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    def _rotate(self, x: Float[Array, "batch seq h rope"], rope: Rope) -> Float[Array, "..."]:
        if self.rope_interleave:  # (x0, x1), (x2, x3)... -> (x0, x2, ...), (x1, x3, ...)
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rotary(x, *rope)

    def project(
        self, x: Float[Array, "batch seq embed"], rope: Rope
    ) -> tuple[
        Float[Array, "batch seq heads nope"],
        Float[Array, "batch seq heads rope"],
        Float[Array, "batch seq latent"],
    ]:
        """(q_nope, rotated q_pe, latent = [normed c, rotated k_pe]): what this token adds."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_pe = q[..., : self.nope_dim], self._rotate(q[..., self.nope_dim :], rope)
        kv = self.kv_a_proj(x)
        c = self.kv_a_norm(kv[..., : self.kv_rank])
        k_pe = self._rotate(kv[..., None, self.kv_rank :], rope)[:, :, 0]
        return q_nope, q_pe, jnp.concatenate([c, k_pe.astype(c.dtype)], axis=-1)

    def _scaled(self, q: Float[Array, "batch seq heads width"]) -> Float[Array, "..."]:
        """q such that a kernel's 1/sqrt(width) gives MLA's `scale`."""
        return q * jnp.asarray(self.scale * math.sqrt(q.shape[-1]), q.dtype)

    def _expanded(self, q_nope, q_pe, latent, mask, kernel) -> Float[Array, "batch seq heads v"]:
        """Per-head keys and values from the latent; q, k, v zero-padded to one width (zeros
        add nothing to q.k, and padded value columns are dropped)."""
        kv = self.kv_b_proj(latent[..., : self.kv_rank])
        k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
        k_pe = jnp.broadcast_to(latent[..., None, self.kv_rank :], q_pe.shape).astype(k_nope.dtype)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        k = jnp.concatenate([k_nope, k_pe], axis=-1)
        width = max(self.head_dim, self.v_dim)
        pad = lambda t: jnp.pad(t, ((0, 0),) * 3 + ((0, width - t.shape[-1]),))  # noqa: E731
        out = kernel(self._scaled(pad(q)), pad(k), pad(v), mask)
        return out[..., : self.v_dim]

    def _up_weight(self) -> Float[Array, "latent heads nope_v"]:
        """kv_b_proj's weight `[kv_rank, heads, nope + v]`, which the absorbed form splits."""
        if type(self.kv_b_proj) is not Linear:
            raise ValueError(
                "MLA decode over the latent cache multiplies by kv_b_proj's weight, but it is a "
                f"{type(self.kv_b_proj).__name__} (LoRA or quantized): merge the adapter "
                "(zoo.merge_adapter) or dequantize (zoo.dequantize_base) before decoding"
            )
        return self.kv_b_proj.layer_weight()

    def _absorbed_query(self, q_nope, q_pe) -> Float[Array, "batch seq heads width"]:
        """[q_nope W_uk, q_pe]: the query in the cache's latent space."""
        w_uk = self._up_weight()[..., : self.nope_dim].astype(q_nope.dtype)
        q_latent = jnp.einsum("bshn,rhn->bshr", q_nope, w_uk)
        return self._scaled(jnp.concatenate([q_latent, q_pe.astype(q_latent.dtype)], axis=-1))

    def _absorbed_output(self, out: Float[Array, "batch seq heads width"]) -> Float[Array, "..."]:
        """Attention over the latents -> per-head values: drop the k_pe columns, apply W_uv."""
        w_uv = self._up_weight()[..., self.nope_dim :].astype(out.dtype)
        return jnp.einsum("bshr,rhv->bshv", out[..., : self.kv_rank], w_uv)

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: AttentionMask,
        rope: Rope | None = None,
        *,
        kernel: AttentionKernel,
        cache: LayerView | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], LayerView | None]:
        """(output, updated cache view or None): expanded without a cache, absorbed with one
        (the view's `attend_latent` stores this step's latents and attends over all)."""
        if rope is None:
            raise ValueError("MLA needs rotary positions (Config.position='rope')")
        q_nope, q_pe, latent = self.project(x, rope)
        if cache is None:
            return self.o_proj(self._expanded(q_nope, q_pe, latent, mask, kernel)), None
        query = self._absorbed_query(q_nope, q_pe)
        out, cache = cache.attend_latent(query, latent, window=mask.sliding_window)
        return self.o_proj(self._absorbed_output(out)), cache
