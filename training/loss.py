"""The training objective. `loss_terms` is the ONE place where the model is called for the loss:
cross-entropy plus the MoE auxiliary losses (`zoo.moe_aux_loss`, weighted by the Config).

Cross-entropy is computed in float32 whatever the compute dtype (the logits are upcast before the
log-softmax), and masked: targets that belong to the next packed document do not count. It is
returned as a sum so micro-batches add up exactly. The MoE terms (Switch load balancing, ST-MoE
z-loss) are statistics of one batch's routing, not sums over tokens: under gradient
accumulation each micro-batch's router is balanced on its own and the step averages them (as
Megatron and Switch do per device batch). A dense model's aux loss is exactly 0.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from data.packing import Batch
from layers.moe import MoEStats
from zoo import Transformer, moe_aux_loss


class LossTerms(NamedTuple):
    """`nll_sum / tokens` is the mean cross-entropy; `aux_loss` is added to it once per batch."""

    nll_sum: Float[Array, ""]
    tokens: Float[Array, ""]
    aux_loss: Float[Array, ""]
    moe: MoEStats


def loss_terms(model: Transformer, batch: Batch) -> LossTerms:
    out = model.forward(batch.inputs, segment_ids=batch.segment_ids)
    log_probs = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, batch.targets[..., None], axis=-1)[..., 0]
    mask = batch.loss_mask.astype(jnp.float32)
    return LossTerms(
        nll_sum=jnp.sum(nll * mask),
        tokens=jnp.sum(mask),
        aux_loss=moe_aux_loss(out.aux, model.config),
        moe=out.aux,
    )
