"""Pipeline parallelism: consecutive layers split into stages over the mesh axis `pipeline`,
micro-batches streamed through them with the GPipe schedule (Huang et al. 2019).

Stage s holds layers [s * L / S, (s + 1) * L / S) (the weights' stacked `layers` axis is split
over `pipeline` by every preset's rules). At clock tick t = 0 .. M + S - 2 every stage runs its
layers once: stage 0 on micro-batch t, stage s on what stage s - 1 sent it at tick t - 1 (micro-
batch t - s), then hands its output to stage s + 1 with `jax.lax.ppermute`. The last stage's
outputs are the result. Each stage idles (computes on placeholder zeros whose results are never
used) for S - 1 of the M + S - 1 ticks: the bubble, (S - 1) / (M + S - 1) of the step
(`zoo.math.pipeline_bubble`). The backward pass is the transpose of this loop: the same schedule
run backwards, the ppermutes reversed.

Only `pipeline` is a manual axis of the `shard_map` (`axis_names={"pipeline"}`); data, FSDP and
tensor sharding inside a stage stay automatic (GSPMD), so a pipeline combines with every preset.
Nothing here knows a model: zoo/pipeline.py gives the stage function.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, PyTree

from shard.rules import active, use_rules

AXIS = "pipeline"


def pipeline_stages() -> int:
    """The size of the active mesh's `pipeline` axis (1 without active rules)."""
    current = active()
    return 1 if current is None else dict(current[1].shape).get(AXIS, 1)


def check_pipeline(*, layers: int, stages: int, microbatches: int, batch: int) -> None:
    """Clear errors, naming the numbers, for a pipeline that cannot run."""
    if layers % stages:
        raise ValueError(
            f"pipeline size {stages} does not divide the {layers} layers of a layer stack: "
            f"every stage holds the same number of layers; give a pipeline size that divides "
            f"{layers}"
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


def gpipe(
    stage: Callable[[PyTree, Array, PyTree], Array],
    weights: PyTree,
    x: Array,
    rows: PyTree,
    *,
    microbatches: int,
) -> Array:
    """`stage(local_weights, x_micro, rows_micro) -> x_micro` run as a pipeline over the active
    mesh's `pipeline` axis of S stages, on `microbatches` = M micro-batches.

    `weights`: leaves with a leading layer axis (split into S consecutive pieces, one per
    stage); `x`: `[batch, ...]` activations (same shape in and out of a stage); `rows`: a pytree
    of `[batch, ...]` arrays each stage reads for its micro-batch (masks, rotary tables).
    Returns the last stage's outputs, `[batch, ...]` like `x`. The caller checks the sizes with
    `check_pipeline`."""
    stages = pipeline_stages()
    rules, mesh = active()
    xs, rows = split_micro(x, microbatches), split_micro(rows, microbatches)
    ticks = microbatches + stages - 1
    forward = [(s, s + 1) for s in range(stages - 1)]

    def run(weights, xs, rows):
        s = jax.lax.axis_index(AXIS)

        def tick(carry, t):
            received, outputs = carry
            # The micro-batch this stage works on at tick t; outside [0, M) it idles.
            i = jnp.clip(t - s, 0, microbatches - 1)
            inputs = jnp.where(s == 0, xs[jnp.minimum(t, microbatches - 1)], received)
            # Inside, `pipeline` is a manual axis: `constrain` must name this mesh, not the
            # all-automatic one outside.
            with use_rules(rules, jax.sharding.get_abstract_mesh()):
                y = stage(weights, inputs, jax.tree.map(lambda r: r[i], rows))
            # Only the last stage's buffer is returned; there each index i >= 0 is written by
            # its own micro-batch after any idle write (t - s < 0 clips to 0, then is
            # overwritten at t = s), so placeholder results never reach the output or its
            # gradient.
            outputs = jax.lax.dynamic_update_index_in_dim(outputs, y, i, axis=0)
            return (jax.lax.ppermute(y, AXIS, forward), outputs), None

        init = (jnp.zeros_like(xs[0]), jnp.zeros_like(xs))
        (_, outputs), _ = jax.lax.scan(tick, init, jnp.arange(ticks))
        return outputs[None]

    # check_vma=False, as in shard/manual.py: a stage may hold per-shard code (a Pallas kernel)
    # that declares no varying axes. The transpose stays exact: the outputs are split over
    # `pipeline` (no division), and the cotangents of the inputs that are whole on it (`xs`,
    # `rows`) are summed over the stages, of which only stage 0's are not zero for `xs`.
    per_stage = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(PartitionSpec(AXIS), PartitionSpec(), PartitionSpec()),
        out_specs=PartitionSpec(AXIS),
        axis_names={AXIS},
        check_vma=False,
    )
    return merge_micro(per_stage(weights, xs, rows)[-1])
