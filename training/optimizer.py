"""AdamW (Loshchilov & Hutter 2019) with global-norm clipping and a learning-rate schedule:
linear warmup then cosine decay, or WSD (warmup-stable-decay, Hu et al. 2024, MiniCPM).

Weight decay applies to matrices only (leaves named `weight`: projections, embeddings), not to
norm scales or biases. The optimizer state has the dtype of the parameters, float32 master
weights by default (`Policy.param_dtype`).
"""

from typing import Literal

import jax
import optax

Schedule = Literal["cosine", "wsd"]


def learning_rate(
    schedule: Schedule,
    *,
    peak: float,
    steps: int,
    warmup: int,
    min_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> optax.Schedule:
    """Learning rate per step; `min_ratio * peak` at the end. WSD decays linearly over the last
    `decay_fraction` of the steps and holds `peak` before that."""
    if schedule not in ("cosine", "wsd"):
        raise ValueError(f"--schedule {schedule!r} is unknown; choose 'cosine' or 'wsd'")
    warmup = min(warmup, max(steps - 1, 0))
    end = peak * min_ratio
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1), end)
    decay_steps = max(1, round(steps * decay_fraction))
    stable = max(0, steps - warmup - decay_steps)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, peak, max(warmup, 1)),
            optax.constant_schedule(peak),
            optax.linear_schedule(peak, end, decay_steps),
        ],
        boundaries=[warmup, warmup + stable],
    )


def decay_mask(params):
    """True for leaves called `weight` (matrices), False for norm scales and biases."""

    def is_weight(path, _) -> bool:
        last = path[-1]
        return getattr(last, "name", None) == "weight"

    return jax.tree_util.tree_map_with_path(is_weight, params)


def adamw(
    lr: optax.Schedule,
    *,
    weight_decay: float = 0.1,
    clip: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
) -> optax.GradientTransformation:
    """Clip by global norm (0 turns clipping off), then AdamW with decoupled weight decay."""
    parts = [optax.clip_by_global_norm(clip)] if clip > 0 else []
    parts.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))
    return optax.chain(*parts)
