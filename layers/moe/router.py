"""Token-choice top-k routing (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et
al. 2024): score every expert for every token, keep the k best and their gate weights.

`tokens` in the shapes below is any leading shape (`batch seq` in the model); `topk` is
`n_experts_per_token`.
"""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int, PRNGKeyArray

Scoring = Literal["softmax", "sigmoid"]


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
    n_experts_per_token: int = eqx.field(static=True)
    scoring: Scoring = eqx.field(static=True)
    normalize: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        n_experts: int,
        *,
        n_experts_per_token: int,
        scoring: Scoring = "softmax",
        normalize: bool = True,
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
        std = init_std if init_std is not None else d_model**-0.5
        self.weight = (std * jax.random.normal(key, (d_model, n_experts))).astype(dtype)
        self.n_experts_per_token = n_experts_per_token
        self.scoring = scoring
        self.normalize = normalize

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
        weights, experts = jax.lax.top_k(scores, self.n_experts_per_token)
        if self.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return Routing(logits=logits, probs=probs, weights=weights, experts=experts)

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"weight": ("embed", "experts")}
