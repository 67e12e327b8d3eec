"""Build the model's skeleton without allocating it (`eqx.filter_eval_shape`) and fill each leaf
from a checkpoint, tensor by tensor: per-layer tensors are stacked into the stacks' `[repeats,
...]` arrays, and every array goes to its device through `place` (straight into its shard of a
mesh under a sharded `Placement`, so no device ever holds a whole weight it should only hold a
shard of)."""

import re
from typing import Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from layers import Embedding, Linear, QuantizedEmbedding, QuantizedLinear
from layers.quantized import PackedWeight
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
        array = source.read(name)
        if not jnp.issubdtype(array.dtype, jnp.floating):
            # Cast silently, an int32 tensor would load as whole numbers where weights belong.
            raise ValueError(
                f"tensor {name} has dtype {array.dtype}; model weights are floating point "
                "(float32, bfloat16, float16): the checkpoint is damaged or not this model's"
            )
        arrays.append(array)
    return group.to_zoo(*arrays)


def _packable(skeleton: Transformer, group: TensorGroup, layer: int | None) -> list[str] | None:
    """The owners (dotted paths of the Linear / Embedding modules) of a `rows` group's leaves in
    `skeleton`, or None where one of them is not a projection or token table (a router)."""
    owners = []
    for path, _ in group.rows or ():
        target = path if layer is None else layer_path(skeleton, layer, path)[0]
        owner = target.removesuffix(".weight")
        if not isinstance(leaf(skeleton, owner), Linear | Embedding):
            return None
        owners.append(owner)
    return owners or None


def _packed_modules(
    source, skeleton: Transformer, group: TensorGroup, layer: int | None, placement: Placement
) -> dict[str, PackedWeight] | None:
    """This group's packed weights by owner path, read from the checkpoint's blocks (never in
    float) and placed; None where the tensor is float or its leaves are not projections."""
    owners = _packable(skeleton, group, layer)
    if owners is None:
        return None
    (name,) = hf_names(group, layer)
    packed = source.read_packed(name)
    if packed is None:
        return None
    weights, start = {}, 0
    for owner, (_, rows) in zip(owners, group.rows, strict=True):
        module = leaf(skeleton, owner)
        axes = (
            ("vocab", "embed")
            if isinstance(module, Embedding)
            else (module.axes[len(module.in_shape)], module.axes[0])
        )
        weight = packed.take(slice(start, start + rows)).weight(axes)
        if placement.sharded:
            weight = jax.device_put(weight, placement.param_shardings(weight))
        weights[owner] = weight
        start += rows
    return weights


def _as_quantized(model: Transformer, packed: dict[str, PackedWeight]) -> Transformer:
    """`model` with the modules at `packed`'s owner paths replaced by quantized ones holding
    those weights (a Linear's bias, already read, carried over)."""

    def quantized(owner: str, weight: PackedWeight):
        module = leaf(model, owner)
        if isinstance(module, Embedding):
            return QuantizedEmbedding(weight)
        return QuantizedLinear.of(
            weight, module.bias, module.in_shape, module.out_shape, module.axes
        )

    owners = list(packed)
    modules = [quantized(owner, packed[owner]) for owner in owners]
    return eqx.tree_at(lambda m: [leaf(m, o) for o in owners], model, modules)


def load_weights(
    source: TensorSource,
    arch: Architecture,
    config: Config,
    *,
    policy: Policy,
    placement: Placement,
    quantized: bool = False,
) -> Transformer:
    """A Transformer of `config` under `policy` whose every weight comes from `source`, each
    placed in its sharding under `placement` as it is read, in the policy's layer storage (a
    fused policy fuses the projections once they are loaded). With `quantized` (a source with
    `read_packed`: GGUF), a projection or token table stored in quantized blocks is kept in them
    (`layers.QuantizedLinear` / `QuantizedEmbedding`), read one layer at a time and stacked
    after, where the policy asks for stacked layers and every layer has the same block types (a
    GGUF may hold each layer in its own block type, which a stacked array cannot: those stay
    unrolled)."""
    if not any(name.startswith(arch.prefix) for name in source.names()):
        source = _Prefixed(source, arch.prefix)
    groups = arch.tensors_in(config, source.names())
    _check_tensor_names(source, arch, groups, config)
    quantized = quantized and any(
        source.is_quantized(name)
        for group in groups
        if group.rows is not None
        for i in group.layers(config.n_layers)
        for name in hf_names(group, i)
    )
    layout = policy.replace(fused=False, storage="unrolled" if quantized else policy.storage)
    skeleton = eqx.filter_eval_shape(Transformer, config, policy=layout, key=jax.random.key(0))
    # Checked before any tensor is read: a dim that does not divide by its mesh axes fails here.
    shardings = placement.param_shardings(skeleton)
    paths, arrays, packed = [], [], {}
    for group in groups:
        if quantized and group.rows is not None:
            weights = [
                _packed_modules(source, skeleton, group, i, placement)
                for i in group.layers(config.n_layers)
            ]
            if all(w is not None for w in weights):
                for w in weights:
                    packed.update(w)
                continue
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
    if len(paths) + len(packed) != n_leaves:
        raise AssertionError(f"{arch.name} mapping fills {len(paths)} of {n_leaves} weights")
    model = eqx.tree_at(lambda m: [leaf(m, p) for p in paths], skeleton, arrays)
    model = _as_quantized(model, packed) if packed else model
    if policy.storage == "stacked" and all(s.stackable for s in model.stacks):
        # Read one layer at a time, stacked here: each layer's arrays freed once stacked, so
        # the file's weights are never held twice.
        stacks = tuple(stack.restacked(consume=True) for stack in model.stacks)
        model = eqx.tree_at(lambda m: m.stacks, model, stacks)
    stacked = model.stacks[0].stacked
    return model.with_policy(policy.replace(storage="stacked" if stacked else "unrolled"))
