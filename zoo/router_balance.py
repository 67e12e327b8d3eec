"""DeepSeek-V3's auxiliary-loss-free load balancing (arXiv 2412.19437, section 2.1.2; Wang et al.
2024, arXiv 2408.15664): after each training step, every MoE layer's balancing bias moves by a
fixed `rate` toward the experts that received fewer tokens than average,
`b_e += rate * sign(mean_load - load_e)`. The bias only decides which experts a token goes to
(layers/moe/router.py), so the balance costs no loss term pulling on the weights; the optimizer
never moves the bias (it gets no gradient), this update alone does."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from layers.moe import MoE
from zoo.transformer import Transformer


def update_router_bias(
    model: Transformer, expert_load: Float[Array, "layers experts"], rate: float
) -> Transformer:
    """`model` with each router bias moved by `rate` against its layer's load imbalance.

    `expert_load` is a step's `MoEStats.expert_load` (the forward's per-MoE-layer fraction of
    assignments per expert, MoE layers in layer order; a training step reports their mean over
    micro-batches). DeepSeek-V3 used rate 0.001 for most of its training."""
    c = model.config
    if not c.router_bias:
        raise ValueError("update_router_bias needs a model with Config.router_bias=True")
    if expert_load.shape != (len(c.moe_layers), c.n_experts):
        raise ValueError(
            f"expert_load has shape {expert_load.shape}; this model has {len(c.moe_layers)} MoE "
            f"layers of {c.n_experts} experts"
        )
    step = rate * jnp.sign(jnp.mean(expert_load, axis=-1, keepdims=True) - expert_load)
    paths, biases, row = [], [], 0
    for s, stack in enumerate(model.stacks):
        moe = [j for j, block in enumerate(stack.blocks) if isinstance(block.mlp, MoE)]
        if not moe:
            continue
        repeats = stack.repeats if stack.stacked else 1
        # The forward stacks a stack's statistics repeat-major: [repeats, MoE blocks per period].
        rows = step[row : row + repeats * len(moe)].reshape(repeats, len(moe), -1)
        for m, j in enumerate(moe):
            bias = stack.blocks[j].mlp.router.bias
            update = rows[:, m] if stack.stacked else rows[0, m]
            paths.append((s, j))
            biases.append(bias + update.astype(bias.dtype))
        row += repeats * len(moe)
    return eqx.tree_at(
        lambda mdl: [mdl.stacks[s].blocks[j].mlp.router.bias for s, j in paths], model, biases
    )
