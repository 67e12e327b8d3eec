"""The mixture-of-experts feed-forward layer: router -> dispatch to k of N experts -> weighted
sum, plus optional always-on shared experts (DeepSeek-MoE, Dai et al. 2024)."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, PRNGKeyArray

from layers.mlp import SwiGLU
from layers.moe.dispatch import Capacity, Dropless
from layers.moe.experts import Experts
from layers.moe.quantized import QuantizedExperts
from layers.moe.router import GroupScore, Router, Scoring
from layers.moe.stats import MoEStats, routing_stats

Dispatch = Dropless | Capacity
DROPLESS = Dropless()


class MoE(eqx.Module):
    """y = sum over the k chosen experts of gate_e(x) * expert_e(x)  [+ shared(x)].

    Every token of the batch is routed together (no vmap over the batch). Fine-grained experts
    (DeepSeek-MoE) are many experts with a small `d_ff`; the `n_shared` shared experts are one
    SwiGLU of width `n_shared x d_ff`, as in DeepSeek-MoE's reference code. How tokens reach
    their experts (`Dropless()` or `Capacity(factor)`) is an argument of each call.
    """

    router: Router
    experts: Experts | QuantizedExperts
    shared: SwiGLU | None

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        n_experts: int,
        n_experts_per_token: int,
        n_shared: int = 0,
        scoring: Scoring = "softmax",
        normalize: bool = True,
        scale: float = 1.0,
        bias: bool = False,
        groups: int = 1,
        topk_groups: int = 1,
        group_score: GroupScore = "top2",
        out_init_std: float | None = None,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        router_key, experts_key, shared_key = jax.random.split(key, 3)
        if n_shared < 0:
            raise ValueError(f"n_shared={n_shared} must be >= 0")
        self.router = Router(
            d_model,
            n_experts,
            n_experts_per_token=n_experts_per_token,
            scoring=scoring,
            normalize=normalize,
            scale=scale,
            bias=bias,
            groups=groups,
            topk_groups=topk_groups,
            group_score=group_score,
            dtype=dtype,
            key=router_key,
        )
        self.experts = Experts(
            n_experts, d_model, d_ff, out_init_std=out_init_std, dtype=dtype, key=experts_key
        )
        self.shared = (
            SwiGLU(d_model, n_shared * d_ff, out_init_std=out_init_std, dtype=dtype, key=shared_key)
            if n_shared
            else None
        )

    def __call__(
        self, x: Float[Array, "batch seq embed"], *, dispatch: Dispatch = DROPLESS
    ) -> tuple[Float[Array, "batch seq embed"], MoEStats]:
        with jax.named_scope("router"):
            routing = self.router(x)
        with jax.named_scope("experts"):
            out = dispatch(self.experts, x, routing.experts, routing.weights)
        y = out.y
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                y = y + self.shared(x)
        return y, routing_stats(routing, out.kept)
