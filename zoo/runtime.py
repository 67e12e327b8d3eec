"""Run-time settings: the Config fields that say how a model computes (compute and weight dtypes,
remat policy, attention kernel, scanned layers, MoE dispatch and its loss weights), not what its
weights are. Changing one never changes a weight's shape, so a loaded model (a pretrained
checkpoint to fine-tune, a train.py run to sample from) can take any of them: `with_runtime`.
Every other field is architecture and comes from the checkpoint.
"""

from typing import Any

import equinox as eqx
import jax

from shard.axes import is_array_like
from zoo.transformer import Transformer

RUNTIME_FIELDS = (
    "dtype",
    "param_dtype",
    "remat",
    "attention",
    "scan_layers",
    "moe_dispatch",
    "capacity_factor",
    "moe_load_balancing_weight",
    "moe_z_loss_weight",
)


def with_runtime(model: Transformer, **changes: Any) -> Transformer:
    """The same weights under `model.config.replace(**changes)`, every change a run-time field.
    The layers hold some settings themselves (an Attention its kernel, an MoE layer its
    dispatch), so the model is rebuilt from the new config's skeleton (no memory) and filled
    with the weights, cast to the new `param_dtype`. Sharded weights keep their shardings."""
    architecture = sorted(set(changes) - set(RUNTIME_FIELDS))
    if architecture:
        raise ValueError(
            f"with_runtime cannot change {architecture}: they are architecture (they fix the "
            f"weights); only the run-time fields {RUNTIME_FIELDS} can change on a built model"
        )
    config = model.config.replace(**changes)
    skeleton = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    likes, static = eqx.partition(skeleton, is_array_like)
    weights = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    shapes = [like.shape for like in jax.tree.leaves(likes)]
    if [w.shape for w in weights] != shapes:
        raise ValueError(
            "the model's weights are not laid out as Transformer(model.config) builds them "
            "(e.g. after unstack_layers()): call with_runtime on the stacked model"
        )
    cast = [w.astype(like.dtype) for w, like in zip(weights, jax.tree.leaves(likes), strict=True)]
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(likes), cast), static)
