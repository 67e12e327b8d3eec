"""The training objective. `loss_terms` is the ONE place where the model is called for the loss,
so extra terms (e.g. an MoE load-balancing loss) are added here and nowhere else.

Cross-entropy is computed in float32 whatever the compute dtype (the logits are upcast before the
log-softmax), and masked: targets that belong to the next packed document do not count.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from data.packing import Batch
from zoo import Transformer


class LossTerms(NamedTuple):
    """Sums, not means, so micro-batches add up exactly: mean loss = nll_sum / tokens."""

    nll_sum: Float[Array, ""]
    tokens: Float[Array, ""]


def loss_terms(model: Transformer, batch: Batch) -> LossTerms:
    logits = model(batch.inputs, segment_ids=batch.segment_ids).astype(jnp.float32)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, batch.targets[..., None], axis=-1)[..., 0]
    mask = batch.loss_mask.astype(jnp.float32)
    return LossTerms(nll_sum=jnp.sum(nll * mask), tokens=jnp.sum(mask))
