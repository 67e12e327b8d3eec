"""The training objective. `loss_terms` is the ONE place where the model is called for the loss:
cross-entropy plus the MoE auxiliary losses (`layers.moe.aux_loss`, weighted by `AuxWeights`).

Cross-entropy is computed in float32 whatever the compute dtype (the logits are upcast before the
log-softmax), and masked: targets that belong to the next packed document do not count. It is
returned as a sum so micro-batches add up exactly. The MoE terms (Switch load balancing, ST-MoE
z-loss) are statistics of one batch's routing, not sums over tokens: under gradient
accumulation each micro-batch's router is balanced on its own and the step averages them (as
Megatron and Switch do per device batch). A dense model's aux loss is exactly 0.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int

from data.packing import Batch
from layers.moe import MoEStats, aux_loss
from shard.pipeline import pipeline_stages
from zoo import Transformer
from zoo.pipeline_loss import pipelined_loss


@dataclasses.dataclass(frozen=True)
class AuxWeights:
    """How the MoE routers are balanced: the weights of the auxiliary losses in the training loss,
    Switch load balancing (Fedus et al. 2021) and the ST-MoE z-loss (Zoph et al. 2022), and
    `bias_rate`, the step of DeepSeek-V3's aux-loss-free balancing bias after each optimizer step
    (`zoo.update_router_bias`; models with `Config.router_bias` whose bias trains, i.e. not a
    LoRA run's frozen base). Training settings, not architecture: a checkpoint's model is the
    same whatever they are."""

    load_balancing: float = 0.01
    z_loss: float = 0.001
    bias_rate: float = 0.001

    def __post_init__(self):
        for name in ("load_balancing", "z_loss", "bias_rate"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise ValueError(f"AuxWeights.{name} must be finite and >= 0, got {value}")


class LossTerms(NamedTuple):
    """`nll_sum / tokens` is the mean cross-entropy; `aux_loss` is added to it once per batch.
    `objective`, nll_scale * nll_sum + aux_scale * aux_loss, is what a training step
    differentiates. Another objective (training/preference.py) puts its loss summed over what it
    averages in `nll_sum` and their count in `tokens`; `stats` holds its extra metrics as sums
    over the same count."""

    nll_sum: Float[Array, ""]
    tokens: Float[Array, ""]
    aux_loss: Float[Array, ""]
    moe: MoEStats
    objective: Float[Array, ""]
    stats: dict[str, Float[Array, ""]] | None = None


DEFAULT_AUX_WEIGHTS = AuxWeights()


def token_nll(
    logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"]
) -> Float[Array, "batch seq"]:
    """Each token's cross-entropy, in float32: logsumexp(logits) - logits[target], so no
    [batch, seq, vocab] log-probability array is made (GPT-2 shapes, 2 layers, 8 x 256 tokens:
    the compiled step needs 2.2 GB instead of 2.9)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def loss_terms(
    model: Transformer,
    batch: Batch,
    weights: AuxWeights = DEFAULT_AUX_WEIGHTS,
    *,
    nll_scale: Float[Array, ""] | float = 1.0,
    aux_scale: Float[Array, ""] | float = 1.0,
) -> LossTerms:
    """The loss terms of `model` on `batch`; on a mesh with a pipeline axis the model runs
    pipelined on its policy's schedule (zoo/pipeline_loss.py: the embedding on the first
    stage, the head and this loss on the last)."""
    if pipeline_stages() > 1:
        out = pipelined_loss(
            model, batch.inputs, batch.segment_ids, batch.targets, batch.loss_mask,
            token_nll=token_nll, balance_weight=weights.load_balancing,
            z_weight=weights.z_loss, nll_scale=nll_scale, aux_scale=aux_scale,
        )  # fmt: skip
        return LossTerms(out.nll_sum, out.tokens, out.aux_loss, out.moe, out.objective)
    out = model.forward(batch.inputs, segment_ids=batch.segment_ids)
    mask = batch.loss_mask.astype(jnp.float32)
    nll_sum = jnp.sum(token_nll(out.logits, batch.targets) * mask)
    aux = aux_loss(
        out.aux, load_balancing_weight=weights.load_balancing, z_loss_weight=weights.z_loss
    )
    return LossTerms(
        nll_sum=nll_sum,
        tokens=jnp.sum(mask),
        aux_loss=aux,
        moe=out.aux,
        objective=nll_scale * nll_sum + aux_scale * aux,
    )


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """The training step's objective for token data (training/step.py): `loss_terms`, averaged
    over the whole batch's counted tokens (`total`). Batches are `[batch, seq]` (`batch_axes`)."""

    aux_weights: AuxWeights = DEFAULT_AUX_WEIGHTS
    batch_axes: str = "batch seq"

    def total(self, batch: Batch) -> Float[Array, ""]:
        return jnp.sum(batch.loss_mask.astype(jnp.float32))

    def terms(
        self,
        model: Transformer,
        batch: Batch,
        *,
        nll_scale: Float[Array, ""] | float = 1.0,
        aux_scale: Float[Array, ""] | float = 1.0,
    ) -> LossTerms:
        return loss_terms(model, batch, self.aux_weights, nll_scale=nll_scale, aux_scale=aux_scale)

    def abstract_batch(self, batch_size: int, seq_len: int, sharding=None) -> Batch:
        """Shapes, dtypes (and sharding) of a batch as packing makes it: what the step is
        compiled for before any data arrives."""
        ids = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
        mask = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.float32, sharding=sharding)
        return Batch(inputs=ids, targets=ids, segment_ids=ids, loss_mask=mask)
