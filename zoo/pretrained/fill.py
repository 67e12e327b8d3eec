"""Build the model's skeleton without allocating it (`eqx.filter_eval_shape`) and fill each leaf
from a checkpoint, tensor by tensor: per-layer tensors are stacked into the stacks' `[repeats,
...]` arrays, and every array goes to its device through `place` (straight into its shard of a
mesh under a sharded `Placement`, so no device ever holds a whole weight it should only hold a
shard of)."""

import re
from typing import Protocol, runtime_checkable

import equinox as eqx
import jax
import numpy as np

from shard import Placement
from zoo.config import Config
from zoo.policy import Policy
from zoo.pretrained.architectures import Architecture
from zoo.pretrained.tensor_map import TensorGroup, hf_names, layer_path, leaf
from zoo.transformer import Transformer


@runtime_checkable
class TensorSource(Protocol):
    """A checkpoint seen as named tensors in HF layout (safetensors, or GGUF renamed)."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str) -> np.ndarray: ...


class _Prefixed:
    """A checkpoint of the base model alone (e.g. the original GPT-2 files: "h.0.attn...", no
    "transformer."), seen with the prefix that the LM-head model's names carry."""

    def __init__(self, source: TensorSource, prefix: str):
        self._source = source
        self._original = {prefix + name: name for name in source.names()}

    def names(self) -> set[str]:
        return set(self._original)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source.shape(self._original[name])

    def read(self, name: str) -> np.ndarray:
        return self._source.read(self._original[name])


def place(array: np.ndarray, like: jax.ShapeDtypeStruct, sharding=None) -> jax.Array:
    """One host array -> the device array that leaf `like` should be (its dtype). The single
    place where weights land on devices: a mesh's sharding for this leaf goes in `sharding`."""
    return jax.device_put(np.asarray(array, like.dtype), sharding)


def _check_tensor_names(
    source: TensorSource, arch: Architecture, groups: list[TensorGroup], c: Config
) -> None:
    expected = set()
    for group in groups:
        expected.update(name for i in group.layers(c.n_layers) for name in hf_names(group, i))
    available = source.names()
    missing = sorted(expected - available)
    if missing:
        raise ValueError(
            f"checkpoint lacks {len(missing)} tensor(s) that a {arch.name} with this config.json "
            f"has: {', '.join(missing[:8])}"
        )
    ignored = re.compile("|".join(f"(?:{p})" for p in arch.ignored(c)))
    extra = sorted(n for n in available - expected if not ignored.fullmatch(n))
    if extra:
        raise ValueError(
            f"checkpoint has {len(extra)} tensor(s) that a {arch.name} with this config.json "
            f"does not: {', '.join(extra[:8])}"
        )


def _read_layer(source: TensorSource, group: TensorGroup, layer: int | None) -> tuple:
    """One layer's HF tensors (shape-checked) converted to our arrays."""
    arrays = []
    for name, expected in zip(hf_names(group, layer), group.hf_shapes, strict=True):
        actual = source.shape(name)
        if actual != expected:
            raise ValueError(
                f"tensor {name} has shape {actual}, but this config.json needs {expected}"
            )
        arrays.append(source.read(name))
    return group.to_zoo(*arrays)


def load_weights(
    source: TensorSource,
    arch: Architecture,
    config: Config,
    *,
    policy: Policy,
    placement: Placement,
) -> Transformer:
    """A Transformer of `config` under `policy` whose every weight comes from `source`, each
    placed in its sharding under `placement` as it is read (in the policy's layer storage; a
    fused policy fuses the projections once they are loaded)."""
    unfused = policy.replace(fused=False)
    skeleton = eqx.filter_eval_shape(Transformer, config, policy=unfused, key=jax.random.key(0))
    # Checked before any tensor is read: a dim that does not divide by its mesh axes fails here.
    shardings = placement.param_shardings(skeleton)
    if not any(name.startswith(arch.prefix) for name in source.names()):
        source = _Prefixed(source, arch.prefix)
    groups = arch.tensors_in(config, source.names())
    _check_tensor_names(source, arch, groups, config)
    paths, arrays = [], []
    for group in groups:
        # One group at a time (all layers of it), placed before the next is read: the host
        # holds one group's tensors, never the whole checkpoint.
        buffers: dict[str, np.ndarray] = {}
        for i in group.layers(config.n_layers):
            for path, array in zip(group.zoo, _read_layer(source, group, i), strict=True):
                target, index = (path, None) if i is None else layer_path(skeleton, i, path)
                if index is None:
                    buffers[target] = np.asarray(array)
                else:
                    like = leaf(skeleton, target)
                    buffers.setdefault(target, np.empty(like.shape, like.dtype))[index] = array
        for path, buffer in buffers.items():
            like = leaf(skeleton, path)
            if buffer.shape != like.shape:
                raise AssertionError(f"{arch.name} mapping gave {path} shape {buffer.shape}")
            paths.append(path)
            sharding = None if shardings is None else leaf(shardings, path)
            arrays.append(place(buffer, like, sharding))
        del buffers
    n_leaves = len(jax.tree.leaves(skeleton))
    if len(paths) != n_leaves:
        raise AssertionError(f"{arch.name} mapping fills {len(paths)} of {n_leaves} weights")
    model = eqx.tree_at(lambda m: [leaf(m, p) for p in paths], skeleton, arrays)
    return model.with_policy(policy)
