"""Pipeline parallelism: consecutive layers split into stages over the mesh axis `pipeline`,
micro-batches streamed through them on one of three schedules.

- **GPipe** (Huang et al. 2019): stage s holds layers [s L / S, (s + 1) L / S). At clock tick
  t = 0 .. M + S - 2 every stage runs its layers once: stage 0 on micro-batch t, stage s on what
  stage s - 1 sent it at tick t - 1 (micro-batch t - s); `jax.lax.ppermute` hands the outputs on.
  The backward pass is the transpose of this loop (autodiff): the same ticks run backwards, so
  every micro-batch's activations are kept until the backward starts (memory grows with M).
- **Interleaved / circular** (Narayanan et al. 2021; MaxText's circular pipeline): each device
  holds V chunks of L / (S V) layers, chunk c = v S + s on device s, and a micro-batch goes
  round the ring of devices V times (stage S - 1 hands round v's output back to stage 0 for
  round v + 1). M V + S - 1 ticks of a chunk: the bubble shrinks by V. Autodiff, as GPipe.
  The weights are stored with consecutive layers together, so the step regroups each stack into
  the circular layout ([V, S, L / (S V)] -> [S, V, ...]: an all-to-all of (V - 1) / V of a
  stage's weights, and the transpose of their gradients; `training.plan` lists it). A chunk is
  picked per tick, so it keeps only its input and runs again in the backward (autodiff would
  keep a copy of its weights per tick): one more forward per chunk and micro-batch.
- **1F1B** (PipeDream-flush, Narayanan et al. 2019; Megatron's default): forwards and backwards
  interleave, so a stage holds at most min(M, 2 S - 1) micro-batches in flight instead of M.
  Lockstep ticks t = 0 .. M + 2 S - 3: stage s runs the forward of micro-batch t - s and the
  backward of micro-batch t - (2 S - 2 - s) (the last stage's backward follows its forward in
  the same tick); a slot with no micro-batch is skipped (`lax.cond`), so a tick lasts as long
  as its busiest stage and the step takes M + S - 1 micro-batches' worth of one stage's work:
  GPipe's bubble, with memory bounded by the stage count. Each stage keeps only its in-flight
  inputs and recomputes its forward in the backward (`jax.vjp`), as GPipe's paper did: one more
  forward per micro-batch.
  The gradient is computed here, not by autodiff (`one_f_one_b`).

The embedding runs on the first stage only and the head and loss on the last only (`first` and
`last`, under `lax.cond` on the stage index); a stage's layers (`stage`) may return statistics
(MoE routing) per micro-batch. Idle GPipe / interleaved ticks compute on placeholders whose
results are never used (their share of the step is the bubble, `zoo.math.pipeline_bubble`).

Only `pipeline` is a manual axis of the `shard_map` (`axis_names={"pipeline"}`); data, FSDP and
tensor sharding inside a stage stay automatic (GSPMD), so a pipeline combines with every preset.
Nothing here knows a model: zoo/pipeline.py gives the stage functions.
"""

import functools
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, PyTree

from shard.rules import active, use_rules

AXIS = "pipeline"
Schedule = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


def pipeline_stages() -> int:
    """The size of the active mesh's `pipeline` axis (1 without active rules)."""
    current = active()
    return 1 if current is None else dict(current[1].shape).get(AXIS, 1)


def virtual_stages(schedule: str, virtual: int) -> int:
    """Layer chunks per device: `virtual` for the interleaved schedule, 1 otherwise."""
    return virtual if schedule == "interleaved" else 1


def in_flight(schedule: str, stages: int, microbatches: int) -> int:
    """Micro-batches whose stage inputs a 1F1B stage keeps at once (the first stage holds the
    most: min(M, 2 S - 1) in these lockstep ticks); GPipe and interleaved keep all M."""
    return min(microbatches, 2 * stages - 1) if schedule == "1f1b" else microbatches


def check_pipeline(
    *,
    repeats: int,
    period: int = 1,
    stages: int,
    microbatches: int,
    batch: int,
    schedule: str = "gpipe",
    virtual: int = 1,
) -> None:
    """Clear errors, naming the numbers, for a pipeline that cannot run: a layer stack of
    `repeats` x `period` layers split into `stages` (x `virtual` chunks per device for the
    interleaved schedule), `microbatches` micro-batches of a `batch`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    if schedule == "interleaved" and virtual < 2:
        raise ValueError(
            f"the interleaved schedule needs at least 2 virtual stages per device, got {virtual} "
            "(1 is GPipe: give --pipeline-schedule gpipe)"
        )
    chunks = stages * virtual_stages(schedule, virtual)
    if repeats % chunks:
        what = (
            f"{stages} stages x {virtual} virtual stages = {chunks} chunks"
            if schedule == "interleaved"
            else f"pipeline size {stages}"
        )
        stack = (
            f"{repeats} layers of a layer stack"
            if period == 1
            else f"{repeats} repeats of a layer stack's {period}-layer period "
            f"({repeats * period} layers)"
        )
        raise ValueError(
            f"{what} does not divide the {stack}: every stage holds the same number of "
            f"layers; give a pipeline size (x virtual stages) that divides {repeats}"
        )
    if microbatches < stages:
        raise ValueError(
            f"{microbatches} micro-batches are fewer than the {stages} pipeline stages, so "
            f"some stage would never work; give at least {stages} (more shrink the bubble, "
            f"(stages - 1) / (micro-batches + stages - 1))"
        )
    if batch % microbatches:
        raise ValueError(
            f"a batch of {batch} sequences does not split into {microbatches} micro-batches of "
            "equal size; give a number of micro-batches that divides the batch"
        )


def split_micro(tree: PyTree, microbatches: int) -> PyTree:
    """[batch, ...] leaves -> [microbatches, batch / microbatches, ...], micro-batch i holding
    rows i, i + M, ... (as training/step.py's gradient accumulation does), so that each
    micro-batch stays spread over the devices that split the batch."""
    return jax.tree.map(lambda x: x.reshape(-1, microbatches, *x.shape[1:]).swapaxes(0, 1), tree)


def merge_micro(x: Array) -> Array:
    """The inverse of `split_micro` for one array."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def _flat(tree: PyTree) -> PyTree:
    """[M, mb, ...] leaves -> [M * mb, ...] (a row-wise function's view of every micro-batch)."""
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def _circular(layers: PyTree, stages: int, virtual: int) -> PyTree:
    """Stacked [R, ...] leaves -> [S, V, R / (S V), ...]: device s's chunks s, S + s, ... in
    round order (for V = 1 a reshape of the layers each device already holds)."""

    def regroup(w):
        chunk = w.shape[0] // (stages * virtual)
        return w.reshape(virtual, stages, chunk, *w.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(regroup, layers)


def _uncircular(grads: PyTree) -> PyTree:
    """The inverse of `_circular` ([S, V, c, ...] -> [V S c, ...])."""
    return jax.tree.map(lambda g: g.swapaxes(0, 1).reshape(-1, *g.shape[3:]), grads)


def _pick(tree: PyTree, i) -> PyTree:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _put(buffer: PyTree, value: PyTree, i, keep) -> PyTree:
    """`buffer[i] = value` where `keep`, unchanged otherwise (a select, so nothing computed on
    a placeholder reaches the buffer or its gradient)."""

    def put(b, v):
        old = jax.lax.dynamic_index_in_dim(b, i, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(b, jnp.where(keep, v, old), i, axis=0)

    return jax.tree.map(put, buffer, value)


def gathered(tree: PyTree) -> PyTree:
    """`tree`'s arrays whole on every device of the active mesh: inside a stage, a table split
    over the stage's automatic axes, gathered before a lookup (XLA's SPMD partitioner fails a
    check on a gather from such a table inside the pipeline's shard_map, JAX 0.12; FSDP
    all-gathers every weight before its use anyway)."""
    mesh = active()[1]
    whole = jax.sharding.NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, whole), tree)


def _zeros_of(fn: Callable, *args) -> PyTree:
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *args))


def _on_stage(pred, fn: Callable, *args) -> PyTree:
    """`fn(*args)` where `pred` (this device's stage) holds, zeros elsewhere: the work runs on
    that stage only."""
    return jax.lax.cond(pred, fn, lambda *a: _zeros_of(fn, *a), *args)


def _shard_map(run: Callable, n_outputs: int, *args) -> tuple:
    """`run(outer, layers, micro)` over the pipeline axis: `layers` split over it, everything
    else whole; each output stacked over the stages (`[S, ...]`).

    check_vma=False, as in shard/manual.py: a stage may hold per-shard code (a Pallas kernel)
    that declares no varying axes. The transpose stays exact: the outputs are split over
    `pipeline` (no division), and the cotangents of the inputs that are whole on it are summed
    over the stages, of which only the stage that used them gives a non-zero one."""
    _, mesh = active()
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(AXIS), PartitionSpec()),
        out_specs=(PartitionSpec(AXIS),) * n_outputs,
        axis_names={AXIS},
        check_vma=False,
    )(*args)


StageFn = Callable[[PyTree, Array, PyTree], tuple[Array, PyTree]]


def circular(
    first: Callable[[PyTree, PyTree], Array],
    stage: StageFn,
    last: Callable[[PyTree, Array, PyTree], PyTree],
    outer: PyTree,
    layers: PyTree,
    inputs: PyTree,
    *,
    microbatches: int,
    virtual: int = 1,
) -> tuple[PyTree, PyTree]:
    """The GPipe (`virtual` = 1) or interleaved schedule over the active mesh's `pipeline` axis
    of S stages, on M = `microbatches` micro-batches; differentiable (autodiff).

    `outer`: weights every stage may read (embedding, head), whole on `pipeline`; `layers`:
    stacked `[R, ...]` leaves split into S V chunks of consecutive layers; `inputs`: `[batch,
    ...]` arrays, split into micro-batches (`split_micro`).
    `first(outer, inputs_rows) -> x` (row-wise: the embedding), run by stage 0 on every
    micro-batch; `stage(chunk, x, inputs_micro) -> (x, stats)` runs a chunk's layers;
    `last(outer, ys, inputs_micro) -> out` on the last stage, with `ys` `[M, mb, ...]` the
    final outputs and `inputs_micro` `[M, mb, ...]`. Returns (`out`, the stats of every chunk
    and micro-batch `[S, V, M, ...]`, chunk v S + s at [s, v])."""
    stages, rules = pipeline_stages(), active()[0]
    m, v_total = microbatches, virtual
    ticks = m * v_total + stages - 1
    ring = [(s, (s + 1) % stages) for s in range(stages)]
    if v_total == 1:
        ring = ring[:-1]

    def run(outer, layers, micro):
        s = jax.lax.axis_index(AXIS)
        local = jax.tree.map(lambda w: w[0], layers)  # [V, chunk, ...]
        scoped = lambda: use_rules(rules, jax.sharding.get_abstract_mesh())  # noqa: E731

        def embed(outer, micro):
            x = first(outer, _flat(micro))
            return x.reshape(m, -1, *x.shape[1:])

        with scoped():
            circ = _on_stage(s == 0, embed, outer, micro)  # stage 0's inputs, by micro-batch
            x_like = jax.tree.map(lambda a: a[0], circ)
            stats_like = jax.eval_shape(
                lambda w, x, r: stage(w, x, r)[1], _pick(local, 0), x_like, _pick(micro, 0)
            )

        def run_chunk(local, v, x, inputs):
            if v_total == 1:  # the stage's weights, the same every tick
                return stage(jax.tree.map(lambda a: a[0], local), x, inputs)
            return recomputed_chunk(local, v, x, inputs)

        @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
        def recomputed_chunk(local, v, x, inputs):
            # A chunk picked by the tick (its round): autodiff would keep a copy of the picked
            # weights per tick, so the chunk keeps only its input and is run again in the
            # backward (one more forward per chunk and micro-batch).
            return stage(_pick(local, v), x, inputs)

        def tick(carry, t):
            received, circ, outputs, stats = carry
            # Stage 0 keeps what the last stage handed back for a micro-batch's next round.
            back = t - stages
            circ = _put(
                circ, received, back % m, (s == 0) & (back >= 0) & (back < m * (v_total - 1))
            )
            k = t - s  # this stage's k-th work item: micro-batch k % M in round k // M
            valid = (k >= 0) & (k < m * v_total)
            k = jnp.clip(k, 0, m * v_total - 1)
            i, v = k % m, k // m
            x = jnp.where(s == 0, _pick(circ, i), received)
            with scoped():
                y, chunk_stats = run_chunk(local, v, x, _pick(micro, i))
            outputs = _put(outputs, y, i, valid & (s == stages - 1) & (v == v_total - 1))
            stats = _put(stats, chunk_stats, v * m + i, valid)
            return (jax.lax.ppermute(y, AXIS, ring), circ, outputs, stats), None

        stats = jax.tree.map(lambda a: jnp.zeros((v_total * m, *a.shape), a.dtype), stats_like)
        init = (jnp.zeros_like(x_like), circ, jnp.zeros_like(circ), stats)
        (_, _, outputs, stats), _ = jax.lax.scan(tick, init, jnp.arange(ticks))
        with scoped():
            out = _on_stage(s == stages - 1, last, outer, outputs, micro)
        stats = jax.tree.map(lambda a: a.reshape(v_total, m, *a.shape[1:]), stats)
        return jax.tree.map(lambda a: a[None], out), jax.tree.map(lambda a: a[None], stats)

    out, stats = _shard_map(
        run, 2, outer, _circular(layers, stages, v_total), split_micro(inputs, m)
    )
    return jax.tree.map(lambda a: a[-1], out), stats


def one_f_one_b(
    first: Callable[[PyTree, PyTree], Array],
    stage: StageFn,
    last: Callable[[PyTree, Array, PyTree], tuple[Array, PyTree]],
    outer: tuple[PyTree, PyTree],
    layers: tuple[PyTree, PyTree],
    inputs: PyTree,
    *,
    microbatches: int,
    stats_seed: Callable[[PyTree, Array], PyTree],
    seed_scale: Array,
) -> tuple[PyTree, PyTree, tuple[PyTree, PyTree]]:
    """The 1F1B schedule (module docstring), forward and backward in one pass: the value and
    gradient of the sum over micro-batches of `last`'s objective plus seed . stats.

    `outer` and `layers` are (differentiated, constant) halves of the weights (`eqx.partition`;
    the gradient covers the first halves), laid out as for `circular`. `first(outer, rows) ->
    x`, `stage(chunk, x, inputs_micro) -> (x, stats)`, `last(outer, y, inputs_micro) ->
    (objective, metrics)` for one micro-batch; `stats_seed(stats, seed_scale)`: the objective's
    derivative with respect to a chunk's stats for one micro-batch (constant: the MoE aux loss
    is a weighted sum of them). Returns (the summed metrics of `last`, the stats `[S, 1, M, ...]`,
    the gradient of (outer, layers)'s differentiated halves)."""
    stages, rules = pipeline_stages(), active()[0]
    m = microbatches
    slots = in_flight("1f1b", stages, m)
    ticks = m + 2 * stages - 2
    forward = [(s, s + 1) for s in range(stages - 1)]
    backward = [(s + 1, s) for s in range(stages - 1)]
    (outer_d, outer_c), (layers_d, layers_c) = outer, layers

    def run(outer, layers, micro):
        # The first and last stage's weights (embedding, head) whole on each device of the
        # stage, gathered once per step rather than per tick (and XLA's SPMD partitioner fails
        # a check on the head's backward inside these conditionals with a vocabulary split over
        # `tensor`, JAX 0.12).
        with use_rules(rules, jax.sharding.get_abstract_mesh()):
            outer_d, outer_c = gathered(outer[:2])
        seed_scale = outer[2]
        layers_d, layers_c = jax.tree.map(lambda w: w[0, 0], layers)  # [chunk, ...]
        s = jax.lax.axis_index(AXIS)
        scoped = lambda: use_rules(rules, jax.sharding.get_abstract_mesh())  # noqa: E731

        def embed(o_d, inputs):
            return first(eqx.combine(o_d, outer_c), inputs)

        def run_stage(w_d, x, inputs):
            return stage(eqx.combine(w_d, layers_c), x, inputs)

        def head(o_d, y, inputs):
            return last(eqx.combine(o_d, outer_c), y, inputs)

        mb0 = _pick(micro, 0)
        with scoped():
            x_like = jax.eval_shape(embed, outer_d, mb0)
            y_like, stats_like = jax.eval_shape(run_stage, layers_d, x_like, mb0)
            metrics_like = jax.eval_shape(head, outer_d, y_like, mb0)[1]
        seed = stats_seed(stats_like, seed_scale)
        zeros = lambda like: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), like)  # noqa: E731

        def tick(carry, t):
            from_prev, from_next, stash, g_outer, g_layers, metrics, stats = carry
            i_f, i_b = t - s, t - (2 * stages - 2 - s)
            f_on, b_on = (i_f >= 0) & (i_f < m), (i_b >= 0) & (i_b < m)
            i_f, i_b = jnp.clip(i_f, 0, m - 1), jnp.clip(i_b, 0, m - 1)

            def forward_slot(from_prev):
                inputs = _pick(micro, i_f)
                with scoped():
                    x = jax.lax.cond(s == 0, lambda: embed(outer_d, inputs), lambda: from_prev)
                    y, chunk_stats = run_stage(layers_d, x, inputs)
                return x, y, chunk_stats

            x, y, chunk_stats = jax.lax.cond(
                f_on, forward_slot, lambda r: zeros((x_like, y_like, stats_like)), from_prev
            )
            stash = _put(stash, x, i_f % slots, f_on)
            stats = _put(stats, chunk_stats, i_f, f_on)

            def backward_slot(from_next, y):
                inputs = _pick(micro, i_b)

                def loss_cotangent():
                    # The last stage: its forward of micro-batch i_b ran in this same tick.
                    (_, micro_metrics), vjp = jax.vjp(lambda o, y: head(o, y, inputs), outer_d, y)
                    g_o, dy = vjp((jnp.ones(()), zeros(metrics_like)))
                    return dy, g_o, micro_metrics

                with scoped():
                    dy, g_o, micro_metrics = jax.lax.cond(
                        s == stages - 1,
                        loss_cotangent,
                        lambda: (from_next, zeros(outer_d), zeros(metrics_like)),
                    )
                    # Recompute the stage from its stashed input, then run its backward.
                    _, vjp = jax.vjp(
                        lambda w, x: run_stage(w, x, inputs), layers_d, _pick(stash, i_b % slots)
                    )
                    g_w, dx = vjp((dy, seed))
                    g_embed = jax.lax.cond(
                        s == 0,
                        lambda: jax.vjp(lambda o: embed(o, inputs), outer_d)[1](dx)[0],
                        lambda: zeros(outer_d),
                    )
                g_o = jax.tree.map(jnp.add, g_o, g_embed)
                return dx, g_w, g_o, micro_metrics

            dx, g_w, g_o, micro_metrics = jax.lax.cond(
                b_on,
                backward_slot,
                lambda *_: zeros((x_like, layers_d, outer_d, metrics_like)),
                from_next,
                y,
            )
            add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
            carry = (
                jax.lax.ppermute(y, AXIS, forward),
                jax.lax.ppermute(dx, AXIS, backward),
                stash,
                add(g_outer, g_o),
                add(g_layers, g_w),
                add(metrics, micro_metrics),
                stats,
            )
            return carry, None

        init = (
            zeros(x_like),
            zeros(x_like),
            jax.tree.map(lambda a: jnp.zeros((slots, *a.shape), a.dtype), x_like),
            zeros(outer_d),
            zeros(layers_d),
            zeros(metrics_like),
            jax.tree.map(lambda a: jnp.zeros((m, *a.shape), a.dtype), stats_like),
        )
        carry, _ = jax.lax.scan(tick, init, jnp.arange(ticks))
        _, _, _, g_outer, g_layers, metrics, stats = carry
        g_layers = jax.tree.map(lambda g: g[None, None], g_layers)
        stats = jax.tree.map(lambda a: a[None], stats)
        return jax.tree.map(lambda a: a[None], (metrics, g_outer)), g_layers, stats

    (metrics, g_outer), g_layers, stats = _shard_map(
        run,
        3,
        (outer_d, outer_c, seed_scale),
        _circular((layers_d, layers_c), stages, 1),
        split_micro(inputs, m),
    )
    metrics = jax.tree.map(lambda a: a[-1], metrics)  # the last stage's
    g_outer = jax.tree.map(lambda g: g.sum(0), g_outer)  # each stage's share
    stats = jax.tree.map(lambda a: a[:, None], stats)
    return metrics, stats, (g_outer, _uncircular(g_layers))
