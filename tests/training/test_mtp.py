"""Training a multi-token-prediction module (training/mtp.py): it starts from the target's last
layer with the target's own token table and head, learns the target's distribution one position
ahead (the held-out KL drops, by a paired test on sequences), leaves the tables untouched, and a
head cut to every token in order computes what the whole head does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import zoo
from infer.speculative.draft import head_rows
from tests.training.test_draft import T_995_DF31, held_out_kl_drop
from training import draft as distill
from training import mtp as mtp_training

TARGET = dataclasses.replace(zoo.preset("tiny-llama", max_seq_len=64), n_layers=2)


def data(target, rows: int):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, TARGET.vocab_size, (rows, 32)).astype(np.int32)
    segments, counted = np.ones_like(tokens), np.ones_like(tokens, bool)
    segments[:, 20:] = 2  # two sequences a row: nothing is learned across their boundary
    hidden = distill.target_hidden(target, tokens, segments)
    return distill.DistillBatch(tokens, segments, counted, hidden)


def test_a_module_starts_from_the_last_layer_and_shares_the_tables():
    target = zoo.Transformer(TARGET, key=jax.random.key(0))
    mtp = mtp_training.mtp_init(target, jax.random.key(1))
    last = target.with_policy(storage="unrolled").stacks[-1].blocks[-1]
    for ours, theirs in zip(
        jax.tree.leaves(mtp.body.stacks[0].blocks[0]), jax.tree.leaves(last), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)
    assert mtp.body.embed.weight is target.embed.weight  # the target's own arrays
    assert mtp.body.lm_head.weight is target.lm_head.weight
    spec = mtp_training.trainable(mtp)
    assert not any(jax.tree.leaves(spec.body.embed)) and all(jax.tree.leaves(spec.proj))


def test_a_module_learns_the_targets_next_distribution():
    target = zoo.Transformer(TARGET, key=jax.random.key(0))
    mtp = mtp_training.mtp_init(target, jax.random.key(1))
    embedding = np.asarray(target.embed.weight)
    t, mtp = held_out_kl_drop(
        mtp, target, data(target, 288), mtp_training.init_optimizer, mtp_training.mtp_step,
        mtp_training.mtp_eval,
    )  # fmt: skip
    assert t > T_995_DF31
    np.testing.assert_array_equal(np.asarray(mtp.body.embed.weight), embedding)  # frozen


def test_a_head_of_every_token_in_order_is_the_whole_head():
    target = zoo.Transformer(TARGET, key=jax.random.key(0))
    batch = jax.tree.map(lambda x: x[:4], data(target, 4))
    mtp = mtp_training.mtp_init(target, jax.random.key(1))
    every = head_rows(target, jnp.arange(TARGET.vocab_size))
    whole = mtp_training.mtp_eval(mtp, target, batch)
    cut = mtp_training.mtp_eval(mtp, target, batch, every)
    for name, value in vars(whole).items():
        # The same products in another layout: float32 roundings of a d_model-long sum.
        tolerance = TARGET.d_model * np.finfo(np.float32).eps * max(abs(float(value)), 1.0)
        np.testing.assert_allclose(float(getattr(cut, name)), float(value), atol=tolerance)
