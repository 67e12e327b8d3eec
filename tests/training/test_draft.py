"""Distilling a draft model (training/draft.py): it starts as the target's first layers, learns
(the held-out KL to the target drops, by a paired test on sequences), trains neither the
embedding nor anything else it should not, and counts a reply's positions."""

import dataclasses
import math

import jax
import numpy as np
import optax
import pytest

import zoo
from training import draft as distill

# Three layers: the draft keeps one, and distillation must teach it what the other two add.
TARGET = dataclasses.replace(zoo.preset("tiny-llama", max_seq_len=64), n_layers=3)
# One-sided 99.5% quantile of Student's t with 31 degrees of freedom (32 held-out sequences):
# a paired drop above it is not chance at p < 0.005.
T_995_DF31 = 2.744


def paired_t(before: list[float], after: list[float]) -> float:
    """Student's t of the paired drops from `before` to `after`."""
    drops = np.subtract(before, after)
    return drops.mean() / (drops.std(ddof=1) / math.sqrt(drops.size))


def held_out_kl_drop(params, target, data, init, step, evaluate) -> float:
    """`paired_t` of the held-out KL (the last 32 rows of `data`, one at a time) before and
    after 40 Adam steps of `step` on the first 256 rows, 32 at a time."""
    train = jax.tree.map(lambda x: x[:256], data)
    held_out = [jax.tree.map(lambda x, i=i: x[i : i + 1], data) for i in range(256, 288)]
    before = [float(evaluate(params, target, b).kl) for b in held_out]
    optimizer = optax.adam(3e-3)
    state = init(params, optimizer)
    for i in range(40):
        batch = jax.tree.map(lambda x, s=i: x[(s % 8) * 32 : (s % 8) * 32 + 32], train)
        params, state, _ = step(params, state, target, batch, optimizer)
    after = [float(evaluate(params, target, b).kl) for b in held_out]
    return paired_t(before, after), params


def test_a_draft_learns_the_targets_distribution():
    target = zoo.Transformer(TARGET, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TARGET.vocab_size, (288, 32)).astype(np.int32)
    segments, counted = np.ones_like(tokens), np.ones_like(tokens, bool)
    hidden = distill.target_hidden(target, tokens, segments)
    data = distill.DistillBatch(tokens, segments, counted, hidden)
    draft = distill.draft_init(target, 1)
    assert draft.config.n_layers == 1
    embedding = np.asarray(draft.embed.weight)
    t, draft = held_out_kl_drop(
        draft, target, data, distill.init_optimizer, distill.distill_step, distill.distill_eval
    )
    assert t > T_995_DF31
    np.testing.assert_array_equal(np.asarray(draft.embed.weight), embedding)  # frozen


def test_pack_keeps_sequences_whole_and_counts_the_positions_that_predict_the_reply():
    sequences = [([1, 2, 3, 4, 5], 2), ([7, 8, 9], 1), ([5, 6], 1)]
    tokens, segments, counted = distill.pack(sequences, 5)
    assert tokens.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 5, 6]]
    assert segments.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 2, 2]]
    # Position i predicts token i + 1: a reply starts at index prompt_len of its sequence.
    assert counted.tolist() == [[False, True, True, True, False], [True, True, False, True, False]]
    tokens, segments, counted = distill.pack([([1, 2, 3, 4, 5, 6], 2)], 4)  # cut to a row
    assert tokens.tolist() == [[1, 2, 3, 4]] and counted.tolist() == [[False, True, True, False]]


def test_a_draft_vocabulary_takes_the_most_frequent_tokens_then_the_lowest_unseen():
    sequences = [[5, 9, 9, 3], [9, 5, 7]]
    assert distill.draft_vocabulary(sequences, 2, 12) == [9, 5]  # 9 thrice, 5 twice
    assert distill.draft_vocabulary(sequences, 4, 12) == [9, 5, 3, 7]  # ties: lower id first
    assert distill.draft_vocabulary(sequences, 6, 12) == [9, 5, 3, 7, 0, 1]
    for bad in (0, 13):
        with pytest.raises(ValueError, match="a draft vocabulary holds 1 to 12 tokens"):
            distill.draft_vocabulary(sequences, bad, 12)
