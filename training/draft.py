"""Distilling a draft model for speculative decoding (infer/speculative/draft.py): a few layers
trained to predict the target's next-token distribution, so that the target keeps most of what
the draft proposes (Leviathan et al. 2023, section 3.5: a draft is kept with probability
1 - TV(p, q); DistillSpec, Zhou et al. 2023: distil on text the target itself generates).

- `draft_init(target, n_layers)`: the target's first `n_layers` layers, its final norm and its
  embedding and head, as a model to train (stacked layers). The truncated target already speaks
  the target's tokenizer; distillation teaches its few layers what the rest computed.
- `target_hidden(target, tokens, segment_ids)`: the target's last hidden state at every token,
  computed once: its distribution at a position is its head on that state (`target.logits`),
  so a training step pays the head (a fifth of SmolLM2's weights), not the whole target.
- `distill_step`: one optimizer step on the forward KL, KL(p || q) summed over the vocabulary
  and averaged over the counted positions (a reply's), with the embedding and the head frozen
  (the target's own: the draft's output space stays the target's; the layers and the final
  norm learn). It also reports the top-1 agreement: how often a greedy target keeps a greedy
  draft at a position whose prefix is the target's, which is what speculation sees.
- `draft_vocabulary(sequences, size, vocab_size)`: the tokens a draft may propose
  (`DraftModel(vocab=)`: its head cut to them), the most frequent in the training text.
"""

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from infer.speculative.draft import truncated_draft
from zoo.transformer import Transformer


class DistillBatch(eqx.Module):
    """`tokens` `[batch, seq]`, several sequences to a row (`segment_ids`: attention stays
    inside each); `counted` `[batch, seq]` the positions whose next-token distribution is
    learned (a reply's: the positions a draft proposes for); `hidden` `[batch, seq, embed]` the
    target's last hidden state at each token (before its final norm)."""

    tokens: Int[Array, "batch seq"]
    segment_ids: Int[Array, "batch seq"]
    counted: Bool[Array, "batch seq"]
    hidden: Float[Array, "batch seq embed"]


class DistillMetrics(eqx.Module):
    """Means over the counted positions: KL(p || q) in nats and the top-1 agreement."""

    kl: Float[Array, ""]
    agreement: Float[Array, ""]


def draft_vocabulary(sequences: list[list[int]], size: int, vocab_size: int) -> list[int]:
    """`size` token ids for a draft's vocabulary: the most frequent in `sequences` (ties: the
    lower id first), then the lowest ids not seen (a BPE vocabulary's first merges are its most
    frequent pieces)."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"a draft vocabulary holds 1 to {vocab_size} tokens, got {size}")
    counts = collections.Counter(t for tokens in sequences for t in tokens)
    seen = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    unseen = (t for t in range(vocab_size) if t not in counts)
    return seen + [next(unseen) for _ in range(size - len(seen))]


def draft_init(target: Transformer, n_layers: int) -> Transformer:
    """The target's first `n_layers` layers under its final norm and tied head
    (`truncated_draft`), with stacked layers (the training layout: `lax.scan` over the layers)
    and its own copy of the weights."""
    draft = truncated_draft(target, n_layers).with_policy(storage="stacked")
    return jax.tree.map(lambda leaf: jnp.array(leaf, copy=True), draft)


def trainable(draft: Transformer):
    """The filter of what distillation trains: the layers and the final norm, not the
    embedding and the head (the target's)."""
    spec = jax.tree.map(eqx.is_inexact_array, draft)
    spec = eqx.tree_at(lambda m: m.embed, spec, replace_fn=lambda e: jax.tree.map(_no, e))
    if draft.lm_head is None:
        return spec
    return eqx.tree_at(lambda m: m.lm_head, spec, replace_fn=lambda h: jax.tree.map(_no, h))


def _no(_) -> bool:
    return False


@eqx.filter_jit
def target_hidden(
    target: Transformer, tokens: Int[Array, "batch seq"], segment_ids: Int[Array, "batch seq"]
) -> Float[Array, "batch seq embed"]:
    """The target's last hidden state (before its final norm) at every token."""
    return target.forward(tokens, segment_ids=segment_ids).hidden


def distill_terms(
    draft: Transformer, target: Transformer, batch: DistillBatch
) -> tuple[Float[Array, ""], DistillMetrics]:
    """The mean KL(p || q) over the counted positions (`p` the target's head on its hidden
    state, `q` the draft's), in float32, and the metrics."""
    logits = draft(batch.tokens, segment_ids=batch.segment_ids)
    log_q = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    log_p = jax.nn.log_softmax(target.logits(batch.hidden).astype(jnp.float32), axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    agree = jnp.argmax(log_p, axis=-1) == jnp.argmax(log_q, axis=-1)
    weight = batch.counted.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(weight), 1.0)
    mean_kl = jnp.sum(kl * weight) / count
    return mean_kl, DistillMetrics(mean_kl, jnp.sum(agree * weight) / count)


@eqx.filter_jit
def distill_eval(draft: Transformer, target: Transformer, batch: DistillBatch) -> DistillMetrics:
    return distill_terms(draft, target, batch)[1]


@eqx.filter_jit
def distill_step(
    draft: Transformer, opt_state, target: Transformer, batch: DistillBatch, optimizer
) -> tuple[Transformer, optax.OptState, DistillMetrics]:
    """One optimizer step of the draft's trainable part (`trainable`) on `batch`."""
    learned, frozen = eqx.partition(draft, trainable(draft))

    def loss(learned):
        return distill_terms(eqx.combine(learned, frozen), target, batch)

    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(learned)
    updates, opt_state = optimizer.update(grads, opt_state, learned)
    return eqx.combine(optax.apply_updates(learned, updates), frozen), opt_state, metrics


def init_optimizer(draft: Transformer, optimizer: optax.GradientTransformation):
    """The optimizer state of the draft's trainable part."""
    return optimizer.init(eqx.filter(draft, trainable(draft)))


def pack(
    sequences: list[tuple[list[int], int]], seq_len: int
) -> tuple[Int[np.ndarray, "n seq"], Int[np.ndarray, "n seq"], Bool[np.ndarray, "n seq"]]:
    """Each `(tokens, prompt_len)`, cut to `seq_len` tokens, into rows of `seq_len` (each
    sequence whole in one row, in order, a new row when it does not fit; the rest padded with
    token 0 in segment 0), with its segment ids (1, 2, ... in a row) and which positions count:
    those whose next token is a reply token (the last prompt token's onward, up to the last
    token's predecessor)."""
    rows, width = [], 0
    for sequence, prompt_len in sequences:
        sequence = sequence[:seq_len]
        if not rows or width + len(sequence) > seq_len:
            rows.append([])
            width = 0
        rows[-1].append((sequence, prompt_len))
        width += len(sequence)
    tokens = np.zeros((len(rows), seq_len), np.int32)
    segments = np.zeros((len(rows), seq_len), np.int32)
    counted = np.zeros((len(rows), seq_len), bool)
    for i, row in enumerate(rows):
        start = 0
        for segment, (sequence, prompt_len) in enumerate(row, 1):
            end = start + len(sequence)
            tokens[i, start:end], segments[i, start:end] = sequence, segment
            counted[i, start + prompt_len - 1 : end - 1] = True
            start = end
    return tokens, segments, counted
