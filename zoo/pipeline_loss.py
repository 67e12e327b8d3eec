"""The training loss of a model whose layers are pipelined (zoo/pipeline.py), on the policy's
schedule: GPipe, interleaved or 1F1B (shard/pipeline.py).

The embedding runs on the first stage, the final norm, head and loss on the last (the head under
`jax.checkpoint`, so the logits are recomputed in the backward rather than kept per
micro-batch), the layers' chunks in between: under `Policy.remat` on GPipe; on 1F1B and
interleaved, which run each stage or chunk again in its backward from its input alone, without
per-layer remat (it would run the layers a third time). The loss is returned as the same sums an
unpipelined step adds up (training/loss.py): the masked cross-entropy summed over tokens, the
token count, and the MoE auxiliary loss as the mean over micro-batches of each micro-batch's
(as gradient accumulation averages them), with every MoE layer's statistics.

`objective = nll_scale * nll_sum + aux_scale * aux_loss` is what the training step
differentiates. GPipe and the interleaved schedule are differentiated by autodiff; 1F1B computes
its gradient while it runs (its backward interleaves with the forward), so it is a
`jax.custom_vjp` whose forward returns the gradient of `objective` as its residual: the other
outputs are metrics (their cotangents are not used).
"""

from collections.abc import Callable
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from layers.kernels.context import Ring
from layers.moe import MoEStats, aux_loss
from shard.pipeline import circular, gathered, one_f_one_b, pipeline_stages, virtual_stages
from shard.sequence import sequence_axis, to_zigzag
from zoo.adapter import split_trainable
from zoo.pattern import LayerPattern
from zoo.pipeline import check_stack, layer_order, stage_function
from zoo.transformer import Transformer, positions_from_segments

TokenLoss = Callable[[Float[Array, "batch seq vocab"], Int[Array, "batch seq"]], Array]


class PipelinedLoss(NamedTuple):
    """`objective` (what to differentiate), the masked cross-entropy sum, the counted tokens,
    the weighted MoE auxiliary loss and the MoE statistics per layer (micro-batch mean)."""

    objective: Float[Array, ""]
    nll_sum: Float[Array, ""]
    tokens: Float[Array, ""]
    aux_loss: Float[Array, ""]
    moe: MoEStats


def _outer(tree):
    """`tree` (model-shaped) with every layer-stack leaf None: what the first and last stage
    read (embedding, positions, final norm, head)."""
    return eqx.tree_at(
        lambda m: m.stacks, tree, replace_fn=lambda s: jax.tree.map(lambda _: None, s)
    )


def pipelined_loss(
    model: Transformer,
    tokens: Int[Array, "batch seq"],
    segment_ids: Int[Array, "batch seq"],
    targets: Int[Array, "batch seq"],
    loss_mask: Float[Array, "batch seq"],
    *,
    token_nll: TokenLoss,
    balance_weight: float,
    z_weight: float,
    nll_scale: Float[Array, ""] | float = 1.0,
    aux_scale: Float[Array, ""] | float = 1.0,
) -> PipelinedLoss:
    """The loss terms of `model` on a batch, pipelined over the active mesh's `pipeline` axis
    on `model.policy`'s schedule and micro-batches; `token_nll(logits, targets)` the per-token
    cross-entropy (training/loss.py), `balance_weight` / `z_weight` the MoE loss weights."""
    c, policy = model.config, model.policy
    stages, batch = pipeline_stages(), tokens.shape[0]
    schedule = policy.pipeline_schedule
    for stack in model.stacks:
        check_stack(stack, policy, stages=stages, batch=batch)
    if schedule == "1f1b" and len(model.stacks) > 1:
        raise ValueError(
            f"the 1F1B schedule runs one layer stack and this model has {len(model.stacks)} "
            f"({', '.join(str(s.n_layers) for s in model.stacks)} layers: DeepSeek's leading "
            "dense layers, or a Gemma pattern's leftover layers): use --pipeline-schedule "
            "gpipe or interleaved"
        )
    _, split = sequence_axis()
    if schedule == "1f1b" and isinstance(policy.attention, Ring):
        raise ValueError(
            f"the 1F1B schedule with the ring attention kernel (context parallelism over {split} "
            "devices) is not supported: it computes NaN losses (found on JAX 0.12); use "
            "--attention allgather, or --pipeline-schedule gpipe or interleaved"
        )
    positions = positions_from_segments(segment_ids)
    rows = {
        "tokens": tokens,
        "positions": positions,
        "segment_ids": segment_ids,
        "targets": targets,
        "loss_mask": loss_mask.astype(jnp.float32),
    }
    if split > 1:  # context parallelism: every row in the zig-zag order (sums do not care)
        rows = {k: to_zigzag(v, split) for k, v in rows.items()}
    rows["rope"] = model.rope(rows["positions"])
    rows["local_rope"] = model.local_rope(rows["positions"])
    pattern = LayerPattern.of(c)
    window = None if pattern is not None else c.sliding_window
    # 1F1B and interleaved run each stage (chunk) again in its backward from its input alone:
    # per-layer remat inside would only run its layers a third time.
    layers_policy = policy if schedule == "gpipe" else policy.replace(remat="none")
    stage_patterns, start = [], 0
    for stack in model.stacks:
        rows_k = None if pattern is None else pattern.layers(start, stack.repeats, stack.period)
        stage_patterns.append(rows_k)
        start += stack.n_layers
    arrays, skeleton = eqx.partition(model, eqx.is_array)
    outer_skeleton = _outer(skeleton)

    def embed(outer, rows):
        m = eqx.combine(outer, outer_skeleton)
        m = eqx.tree_at(lambda m: m.embed, m, gathered(m.embed))
        x = m.embed_tokens(rows["tokens"])
        if m.positions is not None:
            x = x + gathered(m.positions)(rows["positions"], dtype=policy.compute)
        return x

    @jax.checkpoint
    def head(outer, y, rows):
        logits = eqx.combine(outer, outer_skeleton).logits(y)
        nll = token_nll(logits.astype(jnp.float32), rows["targets"])
        return jnp.sum(nll * rows["loss_mask"]), jnp.sum(rows["loss_mask"])

    def moe_terms(stats: list) -> tuple[Array, MoEStats]:
        """(mean over micro-batches of the aux loss, statistics averaged) from the stacks'
        `layer_order` stats (None for dense stacks)."""
        stats = [s for s in stats if s is not None]
        if not stats:
            return jnp.zeros((), jnp.float32), MoEStats.empty(c.n_experts)
        stats = jax.tree.map(lambda *s: jnp.concatenate(s, axis=1), *stats)
        per_micro = jax.vmap(
            lambda s: aux_loss(s, load_balancing_weight=balance_weight, z_loss_weight=z_weight)
        )(stats)
        return jnp.mean(per_micro), jax.tree.map(lambda s: s.mean(0), stats)

    def gpipe_or_interleaved(arrays, nll_scale, aux_scale, rows):
        """The loss by the autodiff schedules (also 1F1B's forward without a gradient)."""
        v = virtual_stages(schedule, policy.virtual_stages)
        outer, x, stats = _outer(arrays), None, []
        for k, stack in enumerate(model.stacks):
            first_stack, last_stack = k == 0, k == len(model.stacks) - 1
            inputs = dict(rows) if first_stack else {**rows, "x": x}

            def last(outer, ys, micro, last_stack=last_stack):
                if not last_stack:  # hand the stack's outputs on to the next
                    return ys
                flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), (ys, micro))
                return head(outer, *flat)

            out, stack_stats = circular(
                embed if first_stack else (lambda _, rows: rows["x"]),
                stage_function(stack, layers_policy, chunks=stages * v, window=window),
                last,
                outer,
                (arrays.stacks[k].blocks, stage_patterns[k]),
                inputs,
                microbatches=policy.microbatches,
                virtual=v,
            )
            stats.append(None if stack_stats is None else layer_order(stack_stats))
            x = None if last_stack else jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out)
        nll_sum, n_tokens = out
        aux, moe = moe_terms(stats)
        objective = nll_scale * nll_sum + aux_scale * aux
        return PipelinedLoss(objective, nll_sum, n_tokens, aux, moe)

    if schedule != "1f1b":
        return gpipe_or_interleaved(arrays, nll_scale, aux_scale, rows)
    return _one_f_one_b_loss(
        model, arrays, rows, stage_patterns[0], nll_scale, aux_scale,
        forward=gpipe_or_interleaved, embed=embed, head=head, moe_terms=moe_terms,
        stage=stage_function(model.stacks[0], layers_policy, chunks=stages, window=window),
        balance_weight=balance_weight, z_weight=z_weight,
    )  # fmt: skip


def _stats_seed(balance_weight: float, z_weight: float, n_moe: int, micro: int):
    """`seed(stats, scale)`: d objective / d stats of one chunk and micro-batch, the aux loss
    being `scale` times a weighted mean over MoE layers and micro-batches of the load-balancing
    and z-losses (their loads and drop fractions do not enter it)."""

    def seed(stats, scale):
        if stats is None:
            return None
        per = scale / (n_moe * micro)
        full = lambda like, w: jnp.full(like.shape, w, like.dtype) * per  # noqa: E731
        return MoEStats(
            load_balancing_loss=full(stats.load_balancing_loss, balance_weight),
            z_loss=full(stats.z_loss, z_weight),
            expert_load=jnp.zeros(stats.expert_load.shape, stats.expert_load.dtype),
            dropped_fraction=jnp.zeros(stats.dropped_fraction.shape, stats.dropped_fraction.dtype),
        )

    return seed


def _one_f_one_b_loss(
    model, arrays, rows, pattern, nll_scale, aux_scale, *, forward, embed, head, moe_terms,
    stage, balance_weight, z_weight,
) -> PipelinedLoss:  # fmt: skip
    """The 1F1B schedule's loss (module docstring): the gradient of the trainable arrays is
    computed in the forward; frozen arrays (a LoRA base) stay constant."""
    trainable, frozen = split_trainable(arrays)
    m = model.policy.microbatches
    seed = _stats_seed(balance_weight, z_weight, len(model.config.moe_layers), m)

    @jax.custom_vjp
    def loss(trainable, frozen, nll_scale, aux_scale, rows):
        return forward(eqx.combine(trainable, frozen), nll_scale, aux_scale, rows)

    def loss_and_gradient(trainable, frozen, nll_scale, aux_scale, rows):
        def last(outer, y, inputs):
            nll_sum, n_tokens = head(outer, y, inputs)
            return nll_sum, (nll_sum, n_tokens)

        # The loss enters with seed 1 and the gradient is scaled by nll_scale afterwards, so
        # the aux loss enters with aux_scale / nll_scale.
        (nll_sum, n_tokens), stats, (g_outer, g_layers) = one_f_one_b(
            embed, stage, last,
            (_outer(trainable), _outer(frozen)),
            ((trainable.stacks[0].blocks, None), (frozen.stacks[0].blocks, pattern)),
            rows,
            microbatches=m,
            stats_seed=seed,
            seed_scale=jnp.asarray(aux_scale / nll_scale, jnp.float32),
        )  # fmt: skip
        aux, moe = moe_terms([None if stats is None else layer_order(stats)])
        grads = eqx.tree_at(lambda t: t.stacks[0].blocks, g_outer, g_layers[0])
        grads = jax.tree.map(lambda g: (g * nll_scale).astype(g.dtype), grads)
        out = PipelinedLoss(nll_scale * nll_sum + aux_scale * aux, nll_sum, n_tokens, aux, moe)
        return out, grads

    def backward(grads, cotangents):
        scaled = jax.tree.map(lambda g: (cotangents.objective * g).astype(g.dtype), grads)
        return scaled, None, None, None, None

    loss.defvjp(loss_and_gradient, backward)
    return loss(trainable, frozen, nll_scale, aux_scale, rows)
