"""One transformer layer: the pre-norm residual block of GPT-2 (Radford et al. 2019) and Llama
(Touvron et al. 2023), with a dense MLP or a mixture of experts (Mixtral, Jiang et al. 2024;
DeepSeek-MoE, Dai et al. 2024), and optionally Gemma 2/3's sandwich norms (a norm on each
sublayer's output too, Gemma Team 2024)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from layers import MLP, Attention, LayerNorm, RMSNorm, SwiGLU
from layers.kernels import AttentionMask
from layers.kv_cache import LayerView
from layers.mla import MLA
from layers.moe import MoE, MoEStats
from shard import constrain
from zoo.config import Config
from zoo.policy import Policy

Rope = tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]


def make_norm(config: Config, dtype: DTypeLike) -> LayerNorm | RMSNorm:
    if config.norm == "layernorm":
        return LayerNorm(config.d_model, eps=config.norm_eps, use_bias=config.bias, dtype=dtype)
    return RMSNorm(config.d_model, eps=config.norm_eps, plus_one=config.norm_plus_one, dtype=dtype)


def make_mla(config: Config, out_std: float, dtype: DTypeLike, key: PRNGKeyArray) -> MLA:
    """DeepSeek's multi-head latent attention for `config.mla`; the softmax scale is
    head_dim^-0.5 times YaRN's mscale^2, and the latent norms use HF's fixed eps 1e-6."""
    c = config
    mscale = c.rope_scaling.softmax_mscale() if c.rope_scaling is not None else 1.0
    return MLA(
        c.d_model,
        n_heads=c.n_heads,
        head_dim=c.head_dim,
        rope_dim=c.mla_rope_dim,
        v_dim=c.mla_v_head_dim,
        kv_rank=c.mla_kv_rank,
        q_rank=c.mla_q_rank,
        scale=c.head_dim**-0.5 * mscale**2,
        rope_interleave=c.mla_rope_interleave,
        out_init_std=out_std,
        dtype=dtype,
        key=key,
    )


class Block(eqx.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)); with `moe=True` the MLP is a mixture of
    experts, whose router statistics the block returns (None otherwise). Attention is
    multi-head latent attention (layers/mla.py) when `config.mla`. With `config.sandwich_norm`:
    x + post_attn_norm(attn(norm(x))), x + post_mlp_norm(mlp(norm(x)))."""

    attn_norm: LayerNorm | RMSNorm
    attn: Attention | MLA
    mlp_norm: LayerNorm | RMSNorm
    mlp: MLP | SwiGLU | MoE
    post_attn_norm: LayerNorm | RMSNorm | None
    post_mlp_norm: LayerNorm | RMSNorm | None

    def __init__(
        self,
        config: Config,
        *,
        moe: bool = False,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        attn_key, mlp_key = jax.random.split(key)
        # GPT-2's scaled init of residual projections: std / sqrt(2 * n_layers).
        out_std = 1.0 / math.sqrt(config.d_model * 2 * config.n_layers)
        self.attn_norm = make_norm(config, dtype)
        self.attn = (
            make_mla(config, out_std, dtype, attn_key)
            if config.mla
            else Attention(
                config.d_model,
                n_heads=config.n_heads,
                n_kv_heads=config.n_kv_heads,
                head_dim=config.head_dim,
                qk_norm=config.qk_norm,
                norm_eps=config.norm_eps,
                norm_plus_one=config.norm_plus_one,
                use_bias=config.bias,
                qkv_bias=config.qkv_bias,
                query_scale=config.query_scale,
                softcap=config.attn_softcap,
                out_init_std=out_std,
                dtype=dtype,
                key=attn_key,
            )
        )
        self.mlp_norm = make_norm(config, dtype)
        sandwich = config.sandwich_norm
        self.post_attn_norm = make_norm(config, dtype) if sandwich else None
        self.post_mlp_norm = make_norm(config, dtype) if sandwich else None
        if moe:
            self.mlp = MoE(
                config.d_model,
                config.expert_d_ff,
                n_experts=config.n_experts,
                n_experts_per_token=config.n_experts_per_token,
                n_shared=config.n_shared_experts,
                scoring=config.router_scoring,
                normalize=config.router_normalize,
                scale=config.router_scale,
                bias=config.router_bias,
                groups=config.router_groups,
                topk_groups=config.router_topk_groups,
                group_score=config.router_group_score,
                out_init_std=out_std,
                dtype=dtype,
                key=mlp_key,
            )
            return
        if config.mlp == "gelu":
            self.mlp = MLP(
                config.d_model,
                config.d_ff,
                use_bias=config.bias,
                out_init_std=out_std,
                dtype=dtype,
                key=mlp_key,
            )
            return
        self.mlp = SwiGLU(
            config.d_model,
            config.d_ff,
            use_bias=config.bias,
            out_init_std=out_std,
            activation="silu" if config.mlp == "swiglu" else "gelu_tanh",
            dtype=dtype,
            key=mlp_key,
        )

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: AttentionMask,
        rope: Rope | None,
        *,
        policy: Policy,
        cache: LayerView | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats | None, LayerView | None]:
        """(output, router statistics or None, updated cache or None)."""
        with jax.named_scope("attention"):
            y, cache = self.attn(
                self.attn_norm(x), mask, rope, kernel=policy.attention, cache=cache
            )
            if self.post_attn_norm is not None:
                y = self.post_attn_norm(y)
            x = x + y
        stats = None
        with jax.named_scope("mlp"):
            if isinstance(self.mlp, MoE):
                y, stats = self.mlp(self.mlp_norm(x), dispatch=policy.moe_dispatch)
            else:
                y = self.mlp(self.mlp_norm(x))
            if self.post_mlp_norm is not None:
                y = self.post_mlp_norm(y)
            x = x + y
        return constrain(x, "batch seq embed"), stats, cache
