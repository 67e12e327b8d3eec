"""What `Transformer.forward` returns, and the auxiliary loss a training step adds from it."""

import equinox as eqx
from jaxtyping import Array, Float

from layers.moe import MoEStats, aux_loss
from zoo.config import Config


class ModelOutput(eqx.Module):
    """Logits, and the router statistics of each MoE layer stacked on a leading axis in layer
    order (`Config.moe_layers`); a dense model has zero MoE layers, so empty arrays."""

    logits: Float[Array, "batch seq vocab"]
    aux: MoEStats


def moe_aux_loss(aux: MoEStats, config: Config) -> Float[Array, ""]:
    """Load-balancing and z-losses weighted by the config, averaged over MoE layers (0 if none):
    `loss = cross_entropy + moe_aux_loss(output.aux, config)`."""
    return aux_loss(
        aux,
        load_balancing_weight=config.moe_load_balancing_weight,
        z_loss_weight=config.moe_z_loss_weight,
    )
