"""Training a multi-token-prediction module for a model that has none (zoo/mtp.py), so that the
model drafts for itself in speculative decoding (`infer.speculative.MTPDraft`): EAGLE's recipe
(Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty") on
DeepSeek-V3's module. A draft model sees only tokens; the module also reads the target's last
hidden state, which already holds most of what the next token depends on, so one layer
predicts the token after next about as well as a draft of several layers predicts the next.

At position `i` the module takes the target's hidden state `h_i` (after its final norm) and the
next token `t_{i+1}`, and learns
- the target's distribution at `i + 1` (of `t_{i+2}`): KL(p || q), p the target's head on its
  hidden state `h_{i+1}` (cached: `training.draft.target_hidden`), q the module's;
- the target's hidden state `h_{i+1}` itself (the module's output feature, smooth L1: EAGLE's
  regression), since drafting further feeds the module its own output in place of the
  target's state, which the target has not computed yet;
- the second draft as drafting makes it (the training-time test of HASS and EAGLE-3, one step):
  the module again, at every position from its own output feature instead of the target's, KL
  against the target's distribution one position later (every position's attention then reads
  the module's own features where drafting reads the target's for earlier positions: an
  approximation that costs one more forward, not one per position).

The module starts from the target's last layer and final norm, a random projection, and the
target's token table and head, which stay frozen (the module's output space is the target's).
`head` cuts both distributions to a draft vocabulary (`MTPDraft(vocab=)` proposes only those
tokens): a training step then pays `n / vocab_size` of the two heads.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, PRNGKeyArray

from training.draft import DistillBatch
from zoo.mtp import MTP
from zoo.transformer import HeadRows, Transformer


class MTPMetrics(eqx.Module):
    """Means over the counted positions: the first draft's KL(p || q) in nats, the feature
    regression, and the top-1 agreement of the first and the second draft (what a greedy
    target keeps)."""

    kl: Float[Array, ""]
    feature: Float[Array, ""]
    agreement: Float[Array, ""]
    second_agreement: Float[Array, ""]


def mtp_init(target: Transformer, key: PRNGKeyArray) -> MTP:
    """A module for `target` (module docstring) under its policy, one unrolled layer."""
    unrolled = target.with_policy(storage="unrolled")
    mtp = MTP(target.config, policy=unrolled.policy, key=key)
    copy = jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), unrolled.stacks[-1].blocks[-1])
    return eqx.tree_at(
        lambda m: (m.body.stacks[0].blocks[0], m.body.final_norm, m.body.embed, m.body.lm_head),
        mtp,
        (copy, jax.tree.map(jnp.copy, unrolled.final_norm), target.embed, target.lm_head),
        is_leaf=lambda x: x is None,
    )


def trainable(mtp: MTP):
    """The filter of what training learns: everything but the token table and the head."""
    spec = jax.tree.map(eqx.is_inexact_array, mtp)
    return eqx.tree_at(
        lambda m: (m.body.embed, m.body.lm_head), spec,
        replace_fn=lambda tables: jax.tree.map(lambda _: False, tables),
        is_leaf=lambda x: x is None,
    )  # fmt: skip


def _kl(log_p, log_q):
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def _mean(x, weight):
    return jnp.sum(x * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def mtp_terms(
    mtp: MTP, target: Transformer, batch: DistillBatch, head: HeadRows | None = None
) -> tuple[Float[Array, ""], MTPMetrics]:
    """The loss (module docstring: first draft's KL + feature regression + half the second
    draft's KL) in float32, and the metrics. `batch.hidden` is before the target's final norm
    (`target_hidden`)."""
    tokens, segments, hidden = batch.tokens, batch.segment_ids, batch.hidden
    normed = target.final_norm(hidden)
    # Position i reads h_i and t_{i+1} and predicts t_{i+2}: the target's distribution at i+1.
    same = (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] > 0)
    weight = (batch.counted[:, 1:] & same).astype(jnp.float32)
    log_p = jax.nn.log_softmax(target.logits(hidden[:, 1:], head=head).astype(jnp.float32), -1)
    nexts = tokens[:, 1:]
    first = mtp.body.forward(
        nexts, segment_ids=segments[:, :-1], embeddings=mtp.inputs(nexts, normed[:, :-1]),
        head=head,
    )  # fmt: skip
    log_q = jax.nn.log_softmax(first.logits.astype(jnp.float32), -1)
    feature = optax.huber_loss(
        first.hidden.astype(jnp.float32), normed[:, 1:].astype(jnp.float32)
    ).mean(-1)
    # The second draft: position i reads the module's own feature at i - 1 and t_{i+1}.
    after = tokens[:, 2:]
    second = mtp.body.forward(
        after, segment_ids=segments[:, :-2], embeddings=mtp.inputs(after, first.hidden[:, :-1]),
        head=head,
    )  # fmt: skip
    log_q2 = jax.nn.log_softmax(second.logits.astype(jnp.float32), -1)
    weight2 = weight[:, 1:] * same[:, :-1]
    metrics = MTPMetrics(
        kl=_mean(_kl(log_p, log_q), weight),
        feature=_mean(feature, weight),
        agreement=_mean(jnp.argmax(log_p, -1) == jnp.argmax(log_q, -1), weight),
        second_agreement=_mean(jnp.argmax(log_p[:, 1:], -1) == jnp.argmax(log_q2, -1), weight2),
    )
    loss = metrics.kl + metrics.feature + 0.5 * _mean(_kl(log_p[:, 1:], log_q2), weight2)
    return loss, metrics


@eqx.filter_jit
def mtp_eval(mtp: MTP, target: Transformer, batch: DistillBatch, head=None) -> MTPMetrics:
    return mtp_terms(mtp, target, batch, head)[1]


@eqx.filter_jit
def mtp_step(
    mtp: MTP, opt_state, target: Transformer, batch: DistillBatch, optimizer, head=None
) -> tuple[MTP, optax.OptState, MTPMetrics]:
    """One optimizer step of the module's trainable part (`trainable`) on `batch`."""
    learned, frozen = eqx.partition(mtp, trainable(mtp))

    def loss(learned):
        return mtp_terms(eqx.combine(learned, frozen), target, batch, head)

    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(learned)
    updates, opt_state = optimizer.update(grads, opt_state, learned)
    return eqx.combine(optax.apply_updates(learned, updates), frozen), opt_state, metrics


def init_optimizer(mtp: MTP, optimizer: optax.GradientTransformation):
    """The optimizer state of the module's trainable part."""
    return optimizer.init(eqx.filter(mtp, trainable(mtp)))
