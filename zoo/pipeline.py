"""A layer stack run as a pipeline (shard/pipeline.py's GPipe schedule) when the active mesh has
a `pipeline` axis larger than 1; the plain scan otherwise. The embedding, the final norm and the
LM head stay outside, in the transformer, under the automatic sharding.

A stage is a `Stack` of its own `repeats / stages` repeats (the weights' local slice), still run
by `lax.scan`, each layer under `Policy.remat` as in an unpipelined stack. A checkpoint around
the whole stage instead (GPipe's own choice: keep only each stage's input per micro-batch) would
save little more and cost more at the peak: its backward recomputes a micro-batch's whole stage
at once, every layer's full activations live together (`zoo.math.pipeline_activation_bytes`
counts what this layout keeps).
"""

import equinox as eqx
from jaxtyping import Array, Float, PyTree

from layers.kernels import AttentionMask
from layers.moe import MoE, MoEStats
from shard.pipeline import check_pipeline, gpipe, pipeline_stages
from zoo.block import Rope
from zoo.pattern import LayerPattern
from zoo.policy import Policy
from zoo.stack import Stack


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
    """`stack(x, mask, rope, ...)` (same contract as `Stack.__call__`), pipelined over the
    active mesh's `pipeline` axis when it is larger than 1. A pipelined stack trains and
    evaluates; it takes no KV cache, no MoE layers and no per-layer attention pattern (each
    refused with an error)."""
    stages = pipeline_stages()
    if stages == 1:
        return stack(
            x, mask, rope, policy=policy, cache=cache, view=view, pattern=pattern,
            local_rope=local_rope,
        )  # fmt: skip
    if pattern is not None:
        raise ValueError(
            f"a pipeline of {stages} stages over layers with their own windows or rotary theta "
            "(Config.layer_types, local_rope_theta: Gemma 2/3) is not supported; train such "
            "models without a pipeline axis (e.g. --mesh fsdp=N)"
        )
    if cache is not None:
        raise ValueError(
            f"a KV cache with a pipeline of {stages} stages: pipelined inference is not "
            "supported; generate on a mesh without a pipeline axis"
        )
    if any(isinstance(block.mlp, MoE) for block in stack.blocks):
        raise ValueError(
            f"a pipeline of {stages} stages over MoE layers: the router statistics and the "
            "auxiliary loss are not carried through the pipeline; train MoE models without a "
            "pipeline axis (e.g. --mesh expert=N)"
        )
    if not stack.stacked or not policy.scan_layers:
        raise ValueError(
            "a pipelined stack runs its stages with lax.scan over stacked layers: keep "
            "Policy.scan_layers=True and Policy.storage='stacked'"
        )
    check_pipeline(
        layers=stack.repeats,
        stages=stages,
        microbatches=policy.microbatches,
        batch=x.shape[0],
    )
    weights, static = eqx.partition(stack.blocks, eqx.is_array)

    def stage(local, x, rows):
        mask, rope = rows
        layers = Stack(eqx.combine(local, static), stack.repeats // stages, stack.period, True)
        return layers(x, mask, rope, policy=policy)[0]

    y = gpipe(stage, weights, x, (mask, rope), microbatches=policy.microbatches)
    return y, None, None
