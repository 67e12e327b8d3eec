"""Rules that map logical axis names to mesh axis names, their presets, and the active
(rules, mesh) context that `constrain` reads.

Parameters and activations get separate mappings because FSDP shards both a weight's `embed` dim
and the activations' `batch` dim over the same mesh axis, and one array may not use a mesh axis
twice. `params=None` means "same as the activation mapping".

Two names exist only for the capacity-dispatch buffer of a mixture of experts,
`[experts, expert_batch, capacity, embed]`: `capacity` (an expert's slots per sequence) and
`expert_batch` (its sequences). Under expert parallelism `batch` and `experts` share the `expert`
mesh axis, so the buffer cannot call its sequence dim `batch`; unless the rules map it,
`expert_batch` takes `batch`'s mesh axes minus those of `experts`. Moving tokens from the
`batch`-sharded layout to that one is the all-to-all of GShard.
"""

import contextlib
import contextvars
import dataclasses
import math

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array

LOGICAL_AXES = (
    "batch",
    "seq",
    "kv_seq",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "vocab",
    "experts",
    "layers",
    "expert_batch",
    "capacity",
    "pages",
    "page_size",
    "lora_rank",
    "latent",
    "latent_heads",
    "qkv",
    "gate_up",
)
MESH_AXES = ("data", "fsdp", "tensor", "expert", "context", "pipeline")

Target = str | tuple[str, ...] | None
Mapping = tuple[tuple[str, Target], ...]

_BATCH = ("data", "fsdp", "expert")
_TENSOR: Mapping = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"))
# A LoRA adapter's rank dim (layers/lora.py) is a handful of columns: every preset replicates it,
# so an adapter's A and B split only along the dims they share with their base weight.
_LORA: Mapping = (("lora_rank", None),)
# Pipeline parallelism (GPipe, Huang et al. 2019): every preset splits the stacked layer axis of
# the weights over `pipeline` (a no-op on a mesh whose pipeline axis has size 1); each device
# holds one stage's consecutive layers (shard/pipeline.py runs them).
_PIPELINE: Mapping = (("layers", "pipeline"),)

# Activations and KV cache (`mapping`) and parameters (`params`) of each strategy.
_PRESETS: dict[str, tuple[Mapping, Mapping | None]] = {
    # Replicate the weights, split the batch; gradients are all-reduced.
    "dp": ((("batch", _BATCH),), (*_LORA, *_PIPELINE)),
    # ZeRO-3 / FSDP (Rajbhandari et al. 2020): each weight split along `embed`; all-gathered
    # before its layer, gradients reduce-scattered after.
    "fsdp": ((("batch", _BATCH),), (("embed", "fsdp"), *_LORA, *_PIPELINE)),
    # Megatron tensor parallelism (Shoeybi et al. 2019): heads and MLP columns split, an
    # all-reduce after each row-parallel matmul (attention output, MLP down).
    "tp": (
        (("batch", _BATCH), *_TENSOR, ("vocab", "tensor"), *_LORA),
        (*_TENSOR, ("vocab", "tensor"), *_LORA, *_PIPELINE),
    ),
    "fsdp_tp": (
        (("batch", _BATCH), *_TENSOR, ("vocab", "tensor")),
        (("embed", "fsdp"), *_TENSOR, ("vocab", "tensor"), *_LORA, *_PIPELINE),
    ),
    # Expert parallelism (GShard, Lepikhin et al. 2020): experts live on the `expert` axis,
    # which also splits the batch, so tokens travel to their expert by all-to-all.
    "ep": (
        (("batch", _BATCH), ("experts", "expert")),
        (("embed", "fsdp"), ("experts", "expert"), *_LORA, *_PIPELINE),
    ),
}


def _check_mapping(mapping: Mapping, field: str) -> None:
    seen = set()
    for logical, target in mapping:
        if logical not in LOGICAL_AXES:
            raise ValueError(
                f"ShardingRules.{field}: unknown logical axis {logical!r}; known: {LOGICAL_AXES}"
            )
        if logical in seen:
            raise ValueError(f"ShardingRules.{field}: logical axis {logical!r} is mapped twice")
        seen.add(logical)
        for mesh_axis in mesh_axes_of(target):
            if mesh_axis not in MESH_AXES:
                raise ValueError(
                    f"ShardingRules.{field}: {logical!r} maps to unknown mesh axis "
                    f"{mesh_axis!r}; mesh axes are {MESH_AXES}"
                )


def mesh_axes_of(target: Target) -> tuple[str, ...]:
    """The mesh axes of one rule target or PartitionSpec entry (a name, a tuple of names, None)."""
    return (target,) if isinstance(target, str) else (target or ())


def _spec(mapping: Mapping, names: tuple[str, ...]) -> PartitionSpec:
    table = dict(mapping)
    used: dict[str, str] = {}
    spec = []
    for name in names:
        if name not in LOGICAL_AXES:
            raise ValueError(f"unknown logical axis {name!r} in {names}; known: {LOGICAL_AXES}")
        target = table.get(name)
        for mesh_axis in mesh_axes_of(target):
            if mesh_axis in used:
                raise ValueError(
                    f"logical axes {used[mesh_axis]!r} and {name!r} both map to mesh axis "
                    f"{mesh_axis!r} in one array {names}; change the rules"
                )
            used[mesh_axis] = name
        spec.append(target)
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """`mapping` pairs each logical axis with a mesh axis (or a tuple of them) for activations
    and the KV cache; `params` does the same for weights (None: use `mapping`). Unnamed axes are
    replicated. Two logical axes may not share a mesh axis inside one array's spec."""

    mapping: Mapping = ()
    params: Mapping | None = None

    def __post_init__(self):
        _check_mapping(self.mapping, "mapping")
        if self.params is not None:
            _check_mapping(self.params, "params")

    @staticmethod
    def preset(name: str) -> "ShardingRules":
        """One of the named strategies: dp, fsdp, tp, fsdp_tp, ep."""
        if name not in _PRESETS:
            raise ValueError(f"unknown sharding preset {name!r}; choose one of {list(_PRESETS)}")
        mapping, params = _PRESETS[name]
        return ShardingRules(mapping, params)

    @property
    def param_mapping(self) -> Mapping:
        return self.mapping if self.params is None else self.params

    @property
    def activation_mapping(self) -> Mapping:
        """`mapping` plus the derived `expert_batch` entry (see the module docstring)."""
        table = dict(self.mapping)
        if "expert_batch" in table:
            return self.mapping
        experts = set(mesh_axes_of(table.get("experts")))
        rest = tuple(a for a in mesh_axes_of(table.get("batch")) if a not in experts)
        return (*self.mapping, ("expert_batch", rest or None))

    def mesh_axes(self, logical: str) -> Target:
        """Mesh axes of an activation dim called `logical`."""
        return dict(self.activation_mapping).get(logical)

    def partition_spec(self, names: tuple[str, ...]) -> PartitionSpec:
        """The PartitionSpec for an activation (or cache) whose dims are called `names`."""
        return _spec(self.activation_mapping, names)

    def param_spec(self, names: tuple[str, ...]) -> PartitionSpec:
        """The PartitionSpec for a parameter whose dims are called `names`."""
        return _spec(self.param_mapping, names)


def split_sequence(rules: ShardingRules) -> ShardingRules:
    """`rules` with the activations' `seq` dim split over the `context` mesh axis (context, or
    sequence, parallelism: every token-wise layer runs on its slice of the sequence; attention
    needs a kernel that sees the whole sequence, layers/kernels/context.py). `kv_seq` (the KV
    cache) stays whole."""
    if "seq" in dict(rules.mapping):
        raise ValueError(
            f"the rules already map 'seq' to {dict(rules.mapping)['seq']!r}; context "
            "parallelism splits it over 'context'"
        )
    return dataclasses.replace(rules, mapping=(*rules.mapping, ("seq", "context")))


def rules_for(sizes: dict[str, int], preset: str | None = None) -> ShardingRules:
    """The rules of `preset` (default: the one the mesh's shape suggests, `default_rules`) for a
    mesh of `sizes`; a `context` axis larger than 1 also splits the sequence over it."""
    rules = ShardingRules.preset(preset or default_rules(sizes))
    return split_sequence(rules) if sizes.get("context", 1) > 1 else rules


def presets() -> list[str]:
    """Names of the sharding strategies."""
    return list(_PRESETS)


def default_rules(sizes: dict[str, int]) -> str:
    """The preset a mesh's shape suggests (axis name -> size)."""
    if sizes.get("expert", 1) > 1:
        return "ep"
    if sizes.get("tensor", 1) > 1:
        return "fsdp_tp" if sizes.get("fsdp", 1) > 1 else "tp"
    return "fsdp" if sizes.get("fsdp", 1) > 1 else "dp"


def shard_count(spec: PartitionSpec, mesh_shape: dict[str, int], dim: int) -> int:
    """Into how many pieces `spec` cuts dimension `dim` on a mesh of `mesh_shape`."""
    target = spec[dim] if dim < len(spec) else None
    return math.prod(mesh_shape[a] for a in mesh_axes_of(target))


def check_divisible(
    what: str,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    spec: PartitionSpec,
    sizes: dict[str, int],
) -> None:
    """A clear error, before compiling, when a dim does not divide by its mesh axes (`sizes`:
    each mesh axis's size)."""
    for dim, (size, name) in enumerate(zip(shape, names, strict=True)):
        pieces = shard_count(spec, sizes, dim)
        if size % pieces:
            raise ValueError(
                f"{what}: dimension {name!r} of size {size} does not divide by mesh axis "
                f"{spec[dim]!r} of size {pieces}; change the mesh or the rules"
            )


def check_mesh(rules: ShardingRules, mesh: Mesh | AbstractMesh) -> None:
    """Every mesh axis the rules name must exist in `mesh`."""
    for logical, target in rules.mapping + rules.param_mapping:
        for mesh_axis in mesh_axes_of(target):
            if mesh_axis not in mesh.shape:
                raise ValueError(
                    f"rules map {logical!r} to mesh axis {mesh_axis!r}, which this mesh "
                    f"{dict(mesh.shape)} lacks; build it with shard.mesh(...)"
                )


def named_sharding(axes: str, rules: ShardingRules, mesh: Mesh) -> NamedSharding:
    """The sharding of an activation or cache named like "layers batch kv_heads kv_seq
    head_dim" (one call for the KV cache, batches and logits)."""
    check_mesh(rules, mesh)
    return NamedSharding(mesh, rules.partition_spec(tuple(axes.split())))


Active = tuple[ShardingRules, Mesh | AbstractMesh]
_ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar(
    "active_sharding", default=None
)


@contextlib.contextmanager
def use_rules(rules: ShardingRules, mesh: Mesh | AbstractMesh):
    """Make `constrain` place activations on `mesh` according to `rules` inside this block (an
    abstract mesh serves to lower for devices this machine lacks)."""
    check_mesh(rules, mesh)
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> Active | None:
    """The (rules, mesh) of the innermost `use_rules` block, or None outside any."""
    return _ACTIVE.get()


def constrain(x: Array, axes: str) -> Array:
    """Pin activation `x` (dims named by `axes`, e.g. "batch seq embed") to its sharding under
    the active rules; with no active rules it returns x unchanged, so layers run anywhere."""
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    names = tuple(axes.split())
    if len(names) != x.ndim:
        raise ValueError(f"constrain: {axes!r} names {len(names)} dims but x has shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.partition_spec(names)))
