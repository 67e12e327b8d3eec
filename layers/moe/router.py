"""Token-choice top-k routing (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et
al. 2024): score every expert for every token, keep the k best and their gate weights.

DeepSeek-V3 (arXiv 2412.19437, section 2.1.2) adds to sigmoid scoring: a balancing `bias` per
expert added to the scores to choose the experts only (the gate weights use the unbiased scores;
"auxiliary-loss-free load balancing", a buffer that the optimizer never moves: it gets no
gradient), and group-limited selection (experts in `groups` groups, a group's score the sum of
its two best biased scores, only the best `topk_groups` groups eligible; DeepSeek-V2 scores a
group by its best expert, `group_score="max"`). The gates are
renormalised iff `normalize`, then multiplied by `scale` (routed_scaling_factor).

`tokens` in the shapes below is any leading shape (`batch seq` in the model); `topk` is
`n_experts_per_token`.
"""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

from layers.init import scaled_normal

Scoring = Literal["softmax", "sigmoid"]
GroupScore = Literal["top2", "max"]


class Routing(eqx.Module):
    """What the router decided, all in float32.

    `logits` feed the z-loss; `probs` (softmax, or sigmoid scores normalised to sum to one per
    token) feed the load-balancing loss; `weights` are the gates that scale each chosen expert's
    output; `experts` are the chosen expert ids, best first.
    """

    logits: Float[Array, "*tokens experts"]
    probs: Float[Array, "*tokens experts"]
    weights: Float[Array, "*tokens topk"]
    experts: Int[Array, "*tokens topk"]


class Router(eqx.Module):
    """logits = x · W (in float32), then softmax over experts (or an elementwise sigmoid, as in
    DeepSeek-V3), then top-k; with `normalize` the k chosen weights are rescaled to sum to one.

    softmax -> top-k -> renormalise equals Mixtral's softmax over the top-k logits.
    The weight is `[embed, experts]`: HF Mixtral's `gate.weight` transposed.
    """

    weight: Float[Array, "embed experts"]
    bias: Float[Array, " experts"] | None
    n_experts_per_token: int = eqx.field(static=True)
    scoring: Scoring = eqx.field(static=True)
    normalize: bool = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    groups: int = eqx.field(static=True)
    topk_groups: int = eqx.field(static=True)
    group_score: GroupScore = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        *,
        n_experts_per_token: int,
        scoring: Scoring = "softmax",
        normalize: bool = True,
        scale: float = 1.0,
        bias: bool = False,
        groups: int = 1,
        topk_groups: int = 1,
        group_score: GroupScore = "top2",
        init_std: float | None = None,
        dtype: DTypeLike = jnp.float32,
        key: PRNGKeyArray,
    ):
        if not 1 <= n_experts_per_token <= n_experts:
            raise ValueError(
                f"n_experts_per_token={n_experts_per_token} must be in [1, n_experts={n_experts}]"
            )
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring={scoring!r} is unknown; choose softmax or sigmoid")
        if bias and scoring != "sigmoid":
            raise ValueError("a router balancing bias needs scoring='sigmoid' (DeepSeek-V3)")
        if groups < 1 or n_experts % groups or not 1 <= topk_groups <= groups:
            raise ValueError(
                f"router groups={groups} must divide n_experts={n_experts} and topk_groups="
                f"{topk_groups} be in [1, groups]"
            )
        if groups > 1 and n_experts // groups < 2 and group_score == "top2":
            raise ValueError(f"router groups={groups}: each group needs >= 2 experts")
        if n_experts_per_token > topk_groups * (n_experts // groups):
            raise ValueError(
                f"n_experts_per_token={n_experts_per_token} exceeds the experts of the "
                f"topk_groups={topk_groups} groups kept"
            )
        std = init_std if init_std is not None else d_model**-0.5
        self.weight = scaled_normal(key, std, (d_model, n_experts), dtype)
        # Created in float32 as HF keeps it (it decides selection); a policy cast may change it.
        self.bias = jnp.zeros((n_experts,), jnp.float32) if bias else None
        self.n_experts_per_token = n_experts_per_token
        self.scoring = scoring
        self.normalize = normalize
        self.scale, self.groups, self.topk_groups = scale, groups, topk_groups
        self.group_score = group_score

    @property
    def n_experts(self) -> int:
        return self.weight.shape[-1]

    def __call__(self, x: Float[Array, "*tokens embed"]) -> Routing:
        # Routing decisions are discrete: compute them in float32 so bfloat16 ties do not flip.
        logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), self.weight.astype(jnp.float32))
        if self.scoring == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
            probs = scores
        else:
            scores = jax.nn.sigmoid(logits)
            probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        experts = self._select(scores)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if self.scale != 1.0:
            weights = weights * self.scale
        return Routing(logits=logits, probs=probs, weights=weights, experts=experts)

    def _select(self, scores: Float[Array, "*tokens experts"]) -> Int[Array, "*tokens topk"]:
        """The k chosen experts, best first: by biased scores, within the best groups."""
        if self.bias is not None:
            scores = scores + jax.lax.stop_gradient(self.bias.astype(jnp.float32))
        if self.groups > 1:
            per_group = scores.reshape(*scores.shape[:-1], self.groups, -1)
            if self.group_score == "max":
                group_scores = jnp.max(per_group, axis=-1)
            else:
                group_scores = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)
            _, best = jax.lax.top_k(group_scores, self.topk_groups)
            kept = jnp.sum(jax.nn.one_hot(best, self.groups, dtype=bool), axis=-2, dtype=bool)
            kept = jnp.broadcast_to(kept[..., None], per_group.shape).reshape(scores.shape)
            scores = jnp.where(kept, scores, -jnp.inf)
        return jax.lax.top_k(scores, self.n_experts_per_token)[1]

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        names = {"weight": ("embed", "experts")}
        if self.bias is not None:
            names["bias"] = ("experts",)
        return names
