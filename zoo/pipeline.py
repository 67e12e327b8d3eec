"""A Transformer's layer stacks run as a pipeline (shard/pipeline.py) when the active mesh has a
`pipeline` axis larger than 1.

A stage chunk is a `Stack` of its own consecutive repeats (the weights' local slice), still run
by `lax.scan`, each layer under `Policy.remat` as in an unpipelined stack; MoE layers return
their router statistics per micro-batch and a per-layer attention pattern (Gemma 2/3's windows
and rotary tables, zoo/pattern.py) travels with the weights it belongs to. Two entry points:

- `run_stack`, what `Transformer.forward` calls for each stack: the GPipe schedule over the
  stack alone (the embedding and the head stay outside, on every device): pipelined evaluation
  and plain forwards.
- `pipelined_loss` (zoo/pipeline_loss.py), what the training loss calls: the whole model on
  the policy's schedule (`Policy.pipeline_schedule`), the embedding on the first stage and the
  head and loss on the last only.

A checkpoint around a whole stage instead of per-layer remat (GPipe's own choice: keep only each
stage's input per micro-batch) is what 1F1B does (shard/pipeline.py); GPipe and the interleaved
schedule keep what `Policy.remat` saves for every micro-batch in flight
(`zoo.math.pipeline_activation_bytes`).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from layers.kernels import AttentionMask, causal_mask
from layers.moe import MoEStats
from shard.pipeline import check_pipeline, circular, merge_micro, pipeline_stages
from zoo.block import Rope
from zoo.pattern import LayerPattern
from zoo.policy import Policy
from zoo.stack import Stack


def check_stack(stack: Stack, policy: Policy, *, stages: int, batch: int) -> None:
    """The checks of one stack under the policy's schedule (errors naming the numbers)."""
    if not stack.stacked or not policy.scan_layers:
        raise ValueError(
            "a pipelined stack runs its stages with lax.scan over stacked layers: keep "
            "Policy.scan_layers=True and Policy.storage='stacked'"
        )
    check_pipeline(
        repeats=stack.repeats,
        period=stack.period,
        stages=stages,
        microbatches=policy.microbatches,
        batch=batch,
        schedule=policy.pipeline_schedule,
        virtual=policy.virtual_stages,
    )


def stage_function(stack: Stack, policy: Policy, *, chunks: int, window: int | None):
    """`stage((blocks, pattern), x, inputs) -> (x, stats)` for one chunk of `stack` (its
    `repeats / chunks` consecutive repeats): `blocks` the chunk's arrays (stacked), `pattern`
    its `LayerPattern` rows or None, `inputs` a micro-batch's `positions`, `segment_ids`,
    `rope` and `local_rope`; `stats` the MoE layers' statistics in layer order (None for dense
    layers). `window`: the model's uniform sliding window (None under a per-layer pattern)."""
    static = eqx.partition(stack.blocks, eqx.is_array)[1]

    def stage(chunk, x, inputs):
        blocks, pattern = chunk
        layers = Stack(eqx.combine(blocks, static), stack.repeats // chunks, stack.period, True)
        mask = causal_mask(inputs["positions"], inputs["segment_ids"], sliding_window=window)
        y, stats, _ = layers(
            x, mask, inputs["rope"], policy=policy, pattern=pattern,
            local_rope=inputs["local_rope"],
        )  # fmt: skip
        return y, stats

    return stage


def layer_order(stats: PyTree) -> PyTree:
    """Stats from the executors, `[S, V, M, n, ...]` (chunk v S + s at [s, v]), as
    `[M, V S n, ...]`: each micro-batch's MoE layers in layer order."""

    def order(a):
        a = jnp.moveaxis(a, 2, 0).swapaxes(1, 2)  # [M, V, S, n, ...]
        return a.reshape(a.shape[0], -1, *a.shape[4:])

    return jax.tree.map(order, stats)


def run_stack(
    stack: Stack,
    x: Float[Array, "batch seq embed"],
    mask: AttentionMask,
    rope: Rope | None,
    *,
    policy: Policy,
    cache: tuple[PyTree, ...] | None = None,
    view=None,
    pattern: LayerPattern | None = None,
    local_rope: Rope | None = None,
) -> tuple[Float[Array, "batch seq embed"], MoEStats | None, tuple[PyTree, ...] | None]:
    """`stack(x, mask, rope, ...)` (same contract as `Stack.__call__`), run on the GPipe
    schedule over the active mesh's `pipeline` axis when it is larger than 1 (a plain forward
    or evaluation; training's loss pipelines the whole model, `pipelined_loss`). Takes no KV
    cache (refused). MoE statistics are each micro-batch's, averaged."""
    stages = pipeline_stages()
    if stages == 1:
        return stack(
            x, mask, rope, policy=policy, cache=cache, view=view, pattern=pattern,
            local_rope=local_rope,
        )  # fmt: skip
    if cache is not None:
        raise ValueError(
            f"a KV cache with a pipeline of {stages} stages: pipelined inference is not "
            "supported; generate on a mesh without a pipeline axis"
        )
    gpipe = policy.replace(pipeline_schedule="gpipe")
    check_stack(stack, gpipe, stages=stages, batch=x.shape[0])
    stage = stage_function(stack, gpipe, chunks=stages, window=mask.sliding_window)
    inputs = {
        "x": x,
        "positions": mask.q_positions,
        "segment_ids": mask.q_segment_ids,
        "rope": rope,
        "local_rope": local_rope,
    }
    layers = (eqx.filter(stack.blocks, eqx.is_array), pattern)
    ys, stats = circular(
        lambda _, rows: rows["x"],
        stage,
        lambda _, ys, __: ys,
        (),
        layers,
        inputs,
        microbatches=policy.microbatches,
    )
    stats = None if stats is None else jax.tree.map(lambda s: s.mean(0), layer_order(stats))
    return merge_micro(ys), stats, None
