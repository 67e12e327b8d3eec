"""Preference losses: DPO and its variants IPO, SimPO and ORPO, each written from its paper, and
the frozen reference's log-probabilities computed once per pair.

Notation (every paper's): x a prompt, y_w the chosen and y_l the rejected response, pi the policy
being trained, pi_ref the frozen reference (the starting model), log pi(y|x) the SUM of the
response tokens' log-probabilities and |y| its token count, sigma the logistic function.

    DPO   (Rafailov et al. 2023, eq. 7)
          L = -log sigma(beta [(log pi(y_w|x) - log pi_ref(y_w|x))
                               - (log pi(y_l|x) - log pi_ref(y_l|x))])
    IPO   (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
          Preferences", eq. 17; `beta` is the paper's tau)
          L = (h - 1 / (2 tau))^2,  h = the bracket of DPO without beta
    SimPO (Meng et al. 2024, eq. 6): no reference, length-normalised, a target margin gamma
          L = -log sigma(beta / |y_w| log pi(y_w|x) - beta / |y_l| log pi(y_l|x) - gamma)
    ORPO  (Hong et al. 2024, eqs. 6-7; `beta` is the paper's lambda): no reference
          L = L_SFT + lambda L_OR,   L_SFT = -log pi(y_w|x) / |y_w|,
          L_OR = -log sigma(log odds(y_w|x) - log odds(y_l|x)),
          odds(y|x) = P / (1 - P) with P = exp(log pi(y|x) / |y|)

Each is averaged over the pairs of a batch. Where TRL differs it is said here: TRL's IPO divides
the log-probabilities by the response lengths (the paper sums them), TRL's SimPO takes
gamma / beta as its setting, and TRL's ORPO averages the SFT term over all chosen tokens of the
batch instead of per pair.

The reference's log-probabilities depend only on the pair, so they are computed once, before
training (`reference_logps`), with the starting model, and travel with the batches: no second
model is held while training. A LoRA run's reference is its own model with the adapters off
(`without_adapters`: the same arrays, no copy).
"""

import dataclasses
import time
from pathlib import Path
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, PyTree

from data.preference import PreferenceBatch, PreferenceBatches
from layers.moe import MoEStats, aux_loss
from training.loss import DEFAULT_AUX_WEIGHTS, AuxWeights, LossTerms
from zoo import Transformer
from zoo.adapter import is_lora

LossKind = Literal["dpo", "ipo", "simpo", "orpo"]
LOSSES: tuple[str, ...] = ("dpo", "ipo", "simpo", "orpo")
# Each paper's setting: DPO's beta 0.1 (its experiments use 0.1-0.5), IPO's tau 0.1 (the value
# TRL's docs use), SimPO's beta 2.0 with gamma 1.0 (its Mistral/Llama settings: gamma / beta
# 0.5), ORPO's lambda 0.1.
DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1}
DEFAULT_SIMPO_GAMMA = 1.0


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """Which loss and its settings: `beta` (DPO's beta, IPO's tau, SimPO's beta, ORPO's
    lambda; default each paper's) and `gamma` (SimPO's target margin)."""

    kind: LossKind = "dpo"
    beta: float | None = None
    gamma: float = DEFAULT_SIMPO_GAMMA

    def __post_init__(self):
        if self.kind not in LOSSES:
            raise ValueError(f"--preference-loss {self.kind!r} is not one of {list(LOSSES)}")
        if self.beta is None:
            object.__setattr__(self, "beta", DEFAULT_BETA[self.kind])
        if not (np.isfinite(self.beta) and self.beta > 0):
            raise ValueError(
                f"--beta must be a positive finite number (the {self.kind.upper()} strength), "
                f"got {self.beta}"
            )
        if not np.isfinite(self.gamma) or self.gamma < 0:
            raise ValueError(f"--simpo-gamma must be finite and >= 0, got {self.gamma}")

    @property
    def needs_reference(self) -> bool:
        return self.kind in ("dpo", "ipo")


class PairStats(eqx.Module):
    """Per pair `[pairs]`: the loss, the margin (chosen reward minus rejected reward, each in the
    loss's own terms: beta times the log-ratio to the reference for DPO/IPO, beta times the mean
    log-probability for SimPO, the log-odds for ORPO) and the chosen side's summed log-prob."""

    loss: Float[Array, " pairs"]
    margin: Float[Array, " pairs"]
    chosen_logp: Float[Array, " pairs"]


def pair_loss(
    loss: PreferenceLoss,
    logps: Float[Array, "pairs 2"],
    lengths: Float[Array, "pairs 2"],
    reference: Float[Array, "pairs 2"],
) -> PairStats:
    """The loss of each pair from the summed response log-probabilities `logps` (chosen, rejected),
    their token counts `lengths` and the reference's summed log-probabilities (module docstring)."""
    beta = loss.beta
    chosen, rejected = logps[:, 0], logps[:, 1]
    if loss.kind in ("dpo", "ipo"):
        h = (chosen - reference[:, 0]) - (rejected - reference[:, 1])
        if loss.kind == "dpo":
            values, margin = -jax.nn.log_sigmoid(beta * h), beta * h
        else:
            values, margin = (h - 1.0 / (2.0 * beta)) ** 2, h
        return PairStats(values, margin, chosen)
    mean = logps / lengths
    if loss.kind == "simpo":
        margin = beta * (mean[:, 0] - mean[:, 1])
        return PairStats(-jax.nn.log_sigmoid(margin - loss.gamma), margin, chosen)
    # ORPO: log odds = log P - log(1 - P), P = exp(mean log-prob) < 1.
    log_odds = mean - jnp.log(-jnp.expm1(mean))
    margin = log_odds[:, 0] - log_odds[:, 1]
    values = -mean[:, 0] - beta * jax.nn.log_sigmoid(margin)
    return PairStats(values, margin, chosen)


def response_logps(
    model: Transformer, batch: PreferenceBatch
) -> tuple[Float[Array, "pairs 2"], Float[Array, "pairs 2"], MoEStats]:
    """(summed log-probabilities of the masked response targets, their counts, the MoE router
    statistics) of each side: one forward over the `[2 pairs, seq]` rows, in float32."""
    pairs, sides, seq = batch.inputs.shape
    flat = lambda x: x.reshape(pairs * sides, seq)  # noqa: E731
    out = model.forward(flat(batch.inputs), segment_ids=flat(batch.segment_ids))
    nll = optax.softmax_cross_entropy_with_integer_labels(
        out.logits.astype(jnp.float32), flat(batch.targets)
    )
    mask = batch.loss_mask.astype(jnp.float32)
    logps = -jnp.sum(nll.reshape(pairs, sides, seq) * mask, axis=-1)
    return logps, jnp.sum(mask, axis=-1), out.aux


@dataclasses.dataclass(frozen=True)
class PreferenceObjective:
    """The training step's objective for preference data (training/step.py): the loss summed over
    a micro-batch's pairs (`LossTerms.nll_sum`, divided by the whole batch's pairs), the MoE
    auxiliary terms, and per-pair statistics summed (`stats`: accuracy, the share of pairs whose
    margin is positive, and the mean margin)."""

    loss: PreferenceLoss
    aux_weights: AuxWeights = DEFAULT_AUX_WEIGHTS
    batch_axes: str = "batch"

    def total(self, batch: PreferenceBatch) -> Array:
        return jnp.asarray(batch.inputs.shape[0], jnp.float32)

    def terms(
        self,
        model: Transformer,
        batch: PreferenceBatch,
        *,
        nll_scale: Float[Array, ""] | float = 1.0,
        aux_scale: Float[Array, ""] | float = 1.0,
    ) -> LossTerms:
        """The loss terms of `model` on `batch`; `objective`, nll_scale * the pairs' summed loss
        + aux_scale * the MoE terms, is what the step differentiates."""
        logps, lengths, moe = response_logps(model, batch)
        stats = pair_loss(self.loss, logps, jnp.maximum(lengths, 1.0), batch.reference)
        pairs = jnp.asarray(batch.inputs.shape[0], jnp.float32)
        nll_sum = jnp.sum(stats.loss)
        aux = aux_loss(
            moe,
            load_balancing_weight=self.aux_weights.load_balancing,
            z_loss_weight=self.aux_weights.z_loss,
        )
        return LossTerms(
            nll_sum=nll_sum,
            tokens=pairs,
            aux_loss=aux,
            moe=moe,
            objective=nll_scale * nll_sum + aux_scale * aux,
            stats={
                "accuracy": jnp.sum((stats.margin > 0).astype(jnp.float32)),
                "margin": jnp.sum(stats.margin),
            },
        )

    def abstract_batch(self, batch_size: int, seq_len: int, sharding=None) -> PreferenceBatch:
        shape = (batch_size, 2, seq_len)
        ids = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
        mask = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
        reference = jax.ShapeDtypeStruct(shape[:2], jnp.float32, sharding=sharding)
        return PreferenceBatch(ids, ids, ids, mask, reference)


def without_adapters(model: PyTree) -> PyTree:
    """`model` with every LoRA adapter off: each LoRA node replaced by the projection it wraps
    (the same arrays: nothing is copied). A LoRA run's reference model."""
    return jax.tree.map(lambda n: n.base if is_lora(n) else n, model, is_leaf=is_lora)


@eqx.filter_jit
def _reference_batch(model: Transformer, batch: PreferenceBatch) -> Array:
    return response_logps(model, batch)[0]


def reference_logps(
    model: Transformer, data: PreferenceBatches, batch_size: int, place=jax.device_put
) -> np.ndarray:
    """`[pairs, 2]` summed response log-probabilities of every side under `model` (the reference:
    call it with the starting model, adapters off), in batches of `batch_size` pairs of one shape
    (one compilation). `place` puts a host batch on the devices."""
    model = without_adapters(model)
    out = np.zeros((len(data), 2), np.float32)
    for rows, batch in data.all_in_order(batch_size):
        logps = np.asarray(_reference_batch(model, place(batch)))
        out[rows] = logps[: rows.stop - rows.start]
    return out


def cached_reference(
    path: Path, model: Transformer, data: PreferenceBatches, batch_size: int, place, log
) -> PreferenceBatches:
    """`data` with its reference log-probabilities: read from `path` (a run's own cache, written
    when it started: a resumed full fine-tune's model is no longer the reference) or computed
    with `model` and written there."""
    if path.is_file():
        cached = np.load(path)
        if cached.shape != data.reference.shape:
            raise ValueError(
                f"{path} holds reference log-probabilities of {cached.shape[0]} pairs, but the "
                f"data has {len(data)}: the run's data changed; start a new run"
            )
        log(f"reference log-probabilities of {len(data):,} pairs read from {path}")
        return data.with_reference(cached)
    t0 = time.perf_counter()
    reference = reference_logps(model, data, batch_size, place)
    np.save(path.with_suffix(".tmp.npy"), reference)
    path.with_suffix(".tmp.npy").rename(path)
    log(
        f"reference log-probabilities of {len(data):,} pairs computed once in "
        f"{time.perf_counter() - t0:.1f} s (cached in {path})"
    )
    return data.with_reference(reference)
