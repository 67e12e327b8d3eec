"""The sharding plan, on paper: bytes per device and the collectives of one training step, each
beside the compute it could hide under (the "will the communication hide under the matmul"
table). Needs no devices: the mesh is just its axis sizes. It reads the model (zoo), so it sits
above zoo, beside the training step, while shard/ stays model-free.

    eqx-zoo plan --model llama3-8b --mesh fsdp=8 --batch-size 8 --seq-len 4096 --dtype bfloat16
    eqx-zoo plan --model llama3-70b --mesh fsdp=8,tensor=8 --batch-size 16 --seq-len 4096
    eqx-zoo plan --model llama3-8b --mesh fsdp=8 --offload-opt-state --device a100-40gb
    python -m training.plan ...      # the same

The flags are train's (`--model` a preset or any model artifact, `--batch-size`, `--seq-len`,
`--grad-accum`, `--dtype`, ...: the run it plans), plus `--device`. The plan ends with a verdict:
whether the run fits one device of that kind, and with which remat policy and micro-batch count
(`verdict`).

Collective costs are the ring algorithm's bytes sent per device (Patarasuk & Yuan 2009):
all-gather and reduce-scatter of a full array of S bytes over n devices send S (n-1)/n,
all-reduce sends twice that; an all-to-all of the S bytes a device holds sends S (n-1)/n too.
Time = bytes / the hardware's interconnect bandwidth.

Mixture of experts: the expert weights' bytes per device are listed apart; with the experts
split over a mesh axis and capacity dispatch, each MoE layer moves its `[experts, batch,
capacity, embed]` buffer by all-to-all to the experts and back (GShard), forward and backward,
each beside the routed experts' matmul time it would have to hide under.

Pipeline parallelism (`--mesh pipeline=S,...`, `--microbatches M`, `--pipeline-schedule`):
each device is one stage holding n_layers / S layers (its parameters and Adam state already
count only those); the activations are those one stage holds at its peak on the schedule
(`zoo.math.pipeline_activation_bytes`: GPipe and interleaved keep every micro-batch in flight,
1F1B at most 2 S - 1 stage inputs); each stage hands one micro-batch's activations (forward) or
their gradient (backward) to its neighbour per tick by collective-permute; the step idles the
bubble, (S - 1) / (M V + S - 1) (`zoo.math.pipeline_bubble`, V = the interleaved schedule's
virtual stages, 1 otherwise); the interleaved schedule regroups each stage's layer weights into
its chunks once per step (an all-to-all, and its transpose for the gradients).
"""

import argparse
import dataclasses
import math

import equinox as eqx
import jax

from layers.kernels.paged.int8 import SCALE_DTYPE as INT8_SCALE_DTYPE
from layers.moe import Capacity, expert_capacity
from layers.paged_cache import POOL_AXES, check_kv_dtype
from shard.axes import LogicalAxes, is_array_like, logical_axes
from shard.mesh import parse_mesh
from shard.pipeline import check_pipeline, virtual_stages
from shard.rules import (
    MESH_AXES,
    ShardingRules,
    check_divisible,
    default_rules,
    mesh_axes_of,
    rules_for,
    shard_count,
)
from shard.sequence import check_sequence_length
from training.args import ArgError, Args, add_arguments, check_batch_shards
from zoo import math as zmath
from zoo.config import Config
from zoo.policy import Policy
from zoo.stack import segments
from zoo.transformer import Transformer

PAGE_SIZE = 16  # tokens per page of `Transformer.init_cache`'s pools (its default)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective in a training step: how many times it runs, the bytes each device
    sends each time, the time that takes, and the compute it can overlap with each time."""

    name: str
    axis: str
    why: str
    count: int
    bytes_per_device: float
    comm_s: float
    compute_s: float

    @property
    def hides(self) -> bool:
        return self.comm_s <= self.compute_s


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per device (parameters, gradients, Adam state, activations by remat policy, KV
    cache) and the step's collectives, for one config, rules and mesh shape."""

    params: int
    expert_params: int
    grads: int
    adam_state: int
    activations: dict[str, float]
    kv_cache: int
    collectives: tuple[Collective, ...]
    step_compute_s: float
    stages: int = 1
    microbatches: int = 1
    bubble: float = 0.0
    schedule: str = "gpipe"
    virtual: int = 1
    context_attention: tuple[zmath.ContextAttentionCost, ...] = ()
    context_kernel: str | None = None
    kv_cache_per_head: int | None = None  # MLA: what per-head keys and values would take
    # --offload-opt-state: the Adam state's bytes per device held in pinned host memory between
    # steps instead (0 without it).
    adam_state_on_host: int = 0


def full_mesh(mesh_shape: dict[str, int]) -> dict[str, int]:
    """Sizes of all mesh axes (1 where not given)."""
    for name in mesh_shape:
        if name not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {name!r}; mesh axes are {MESH_AXES}")
    return {name: mesh_shape.get(name, 1) for name in MESH_AXES}


def _shard_bytes(what: str, shape, names, spec, sizes: dict[str, int], itemsize: int) -> int:
    check_divisible(what, tuple(shape), tuple(names), spec, sizes)
    pieces = math.prod(shard_count(spec, sizes, d) for d in range(len(shape)))
    return math.prod(shape) // pieces * itemsize


@dataclasses.dataclass(frozen=True)
class ParamBytes:
    """Bytes of parameter shards one device holds: all of them, those of the stacked layers
    (names starting with `layers`), and those of the routed experts (`experts ... mlp`)."""

    total: int
    layers: int
    experts: int


def param_bytes(
    config: Config, policy: Policy, rules: ShardingRules, sizes: dict[str, int]
) -> ParamBytes:
    """Bytes of the parameter shards one device holds (from the model's own logical axes)."""
    abstract = eqx.filter_eval_shape(Transformer, config, policy=policy, key=jax.random.key(0))
    arrays = jax.tree_util.tree_leaves_with_path(eqx.filter(abstract, is_array_like))
    axes = jax.tree.leaves(logical_axes(abstract), is_leaf=lambda x: isinstance(x, LogicalAxes))
    total = layers = experts = 0
    for (path, leaf), axes_of in zip(arrays, axes, strict=True):
        names = axes_of.names
        spec = rules.param_spec(names)
        n = _shard_bytes(
            jax.tree_util.keystr(path), leaf.shape, names, spec, sizes, leaf.dtype.itemsize
        )
        total += n
        layers += n if names[0] == "layers" else 0
        experts += n if {"experts", "mlp"} <= set(names) else 0
    return ParamBytes(total, layers, experts)


def param_bytes_per_device(
    config: Config, policy: Policy, rules: ShardingRules, sizes: dict[str, int]
) -> int:
    """Bytes of the parameter shards one device holds."""
    return param_bytes(config, policy, rules, sizes).total


def kv_cache_bytes_per_device(
    config: Config,
    policy: Policy,
    rules: ShardingRules,
    sizes: dict[str, int],
    batch: int,
    context: int,
    *,
    per_head: bool = False,
    kv_dtype: str | None = None,
) -> int:
    """Bytes one device holds of the KV cache of `batch` rows of `context` tokens: the leaves of
    the model's own cache (`jax.eval_shape` of `Transformer.init_cache` in `kv_dtype`: the page
    pools of layers/paged_cache.py with their page tables, int8 pools' numbers and scales, MLA's
    latent pages, a sliding layer's ring of its window), each sharded by the activation rules
    from its logical axes. `per_head=True` counts, for an MLA model, per-head key and value
    pages of the same heads instead (what caching the latent saves)."""
    if per_head:
        pages = batch * -(-context // PAGE_SIZE)
        dtype = check_kv_dtype(kv_dtype) or policy.compute_dtype
        total = 0
        for width in (config.head_dim, config.mla_v_head_dim):
            shape = (config.n_heads, pages, PAGE_SIZE, width)
            if dtype != "int8":
                itemsize = zmath.bytes_per_element(dtype)
                total += _shard_bytes(
                    "KV cache", shape, POOL_AXES, rules.partition_spec(POOL_AXES), sizes, itemsize
                )
                continue
            scale_axes = POOL_AXES[:-1]
            total += _shard_bytes(
                "KV cache", shape, POOL_AXES, rules.partition_spec(POOL_AXES), sizes, 1
            ) + _shard_bytes(
                "KV cache scales", shape[:-1], scale_axes, rules.partition_spec(scale_axes),
                sizes, zmath.bytes_per_element(INT8_SCALE_DTYPE),
            )  # fmt: skip
        return config.n_layers * total
    model = eqx.filter_eval_shape(Transformer, config, policy=policy, key=jax.random.key(0))
    cache = jax.eval_shape(lambda: model.init_cache(batch, context, kv_dtype=kv_dtype))
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(cache, is_array_like))
    axes = jax.tree.leaves(logical_axes(cache), is_leaf=lambda x: isinstance(x, LogicalAxes))
    return sum(
        _shard_bytes(
            f"KV cache {jax.tree_util.keystr(path)}",
            leaf.shape,
            names.names,
            rules.partition_spec(names.names),
            sizes,
            leaf.dtype.itemsize,
        )
        for (path, leaf), names in zip(leaves, axes, strict=True)
    )


def _ring(kind: str, n_bytes: float | int, n: int) -> float:
    """Bytes each device sends for a ring collective over an array of `n_bytes` in total."""
    factor = 2 if kind == "all-reduce" else 1
    return factor * n_bytes * (n - 1) / n


def _axes_size(sizes: dict[str, int], axes: set[str]) -> int:
    return math.prod(sizes[a] for a in axes)


def _label(axes: set[str], sizes: dict[str, int]) -> str:
    return "+".join(a for a in MESH_AXES if a in axes and sizes[a] > 1)


def _targets(rules_mapping, logical: str) -> set[str]:
    return set(mesh_axes_of(dict(rules_mapping).get(logical)))


def plan(
    config: Config,
    policy: Policy,
    rules: ShardingRules,
    mesh_shape: dict[str, int],
    *,
    batch: int,
    seq: int,
    hardware: zmath.Hardware,
    context: int | None = None,
    microbatches: int = 1,
    schedule: str = "gpipe",
    virtual: int = 2,
    offload_opt_state: bool = False,
    kv_dtype: str | None = None,
) -> Plan:
    """The plan for training on `batch x seq` tokens per step (and a KV cache of `context`
    tokens per row, default `seq`, in `kv_dtype`) on a mesh of `mesh_shape`, with `policy`'s
    dtypes, kernel and MoE dispatch (activations are listed for every remat policy).

    Parameters, Adam state and KV cache are exact (the model's own logical axes under the
    rules). Activations are zoo.math's per-token estimate times the tokens a device holds,
    divided by the tensor axis: an optimistic share, since without sequence parallelism the
    norms' and residuals' part (10 d of Korthikanti et al.'s 34 d) is not split. With a
    pipeline axis, `microbatches` micro-batches stream through its stages on `schedule`
    ("gpipe", "1f1b", "interleaved" with `virtual` chunks per device; module docstring).
    """
    sizes = full_mesh(mesh_shape)
    if hardware.interconnect is None:
        raise ValueError(f"{hardware.name} lists no interconnect bandwidth; pick another")
    devices = math.prod(sizes.values())
    batch_axes = _targets(rules.mapping, "batch")
    batch_shards = _axes_size(sizes, batch_axes)
    if batch % batch_shards:
        raise ValueError(f"batch {batch} does not divide by its mesh axes {batch_axes}")
    tensor = _axes_size(sizes, _targets(rules.param_mapping, "mlp"))
    seq_shards = _axes_size(sizes, _targets(rules.mapping, "seq"))
    tokens = batch * seq // batch_shards // seq_shards
    stages = sizes["pipeline"]
    virtual = virtual_stages(schedule, virtual)
    if stages > 1:
        for _, period, repeats in segments(config):
            check_pipeline(
                repeats=repeats, period=len(period), stages=stages, microbatches=microbatches,
                batch=batch, schedule=schedule, virtual=virtual,
            )  # fmt: skip
        if (batch // microbatches) % batch_shards:
            raise ValueError(
                f"micro-batches of {batch // microbatches} sequences do not divide by the "
                f"batch's mesh axes {sorted(batch_axes)} ({batch_shards} devices)"
            )
        bubble = zmath.pipeline_bubble(stages, microbatches, virtual=virtual)
    else:
        bubble, microbatches, schedule, virtual = 0.0, 1, "gpipe", 1
    held = param_bytes(config, policy, rules, sizes)
    activations = {
        remat: zmath.pipeline_activation_bytes(
            config,
            seq,
            policy.replace(remat=remat),
            tokens=tokens,
            stages=stages,
            microbatches=microbatches,
            schedule=schedule,
            virtual=virtual,
        )
        / tensor
        for remat in ("none", "dots", "full")
    }
    # The layers one device runs (its stage's, all of them without a pipeline).
    layers = config.n_layers // stages

    peak = hardware.peak_flops(policy.compute_dtype)
    link = hardware.interconnect
    layer_matmul_flops = (
        zmath.forward_flops_per_token(config, seq) - 2 * config.d_model * config.vocab_size
    ) / config.n_layers
    layer_fwd_s = tokens * layer_matmul_flops / tensor / peak
    # One layer's parameter shards on a device, on average (MoE layers hold their experts'
    # shards); the routed experts apart, since their replicas differ under expert parallelism.
    layer_held = held.layers / layers
    layer_experts = held.experts / layers
    collectives = []

    def add(name, axes, why, count, sent, compute):
        label = _label(axes, sizes) if isinstance(axes, set) else axes
        collectives.append(Collective(name, label, why, count, sent, sent / link, compute))

    gather_axes = _targets(rules.param_mapping, "embed")
    if (fsdp := _axes_size(sizes, gather_axes)) > 1:
        gathered = layer_held * fsdp
        sent = _ring("all-gather", gathered, fsdp)
        add("all-gather", gather_axes, "weights, forward", layers, sent, layer_fwd_s)
        add("all-gather", gather_axes, "weights, backward", layers, sent, 2 * layer_fwd_s)
        sent = _ring("reduce-scatter", gathered, fsdp)
        add("reduce-scatter", gather_axes, "gradients", layers, sent, 2 * layer_fwd_s)
    replica_axes = batch_axes - gather_axes
    expert_replica_axes = replica_axes - _targets(rules.param_mapping, "experts")
    sent = _ring("all-reduce", layer_held - layer_experts, _axes_size(sizes, replica_axes))
    sent += _ring("all-reduce", layer_experts, _axes_size(sizes, expert_replica_axes))
    if sent:
        add("all-reduce", replica_axes, "gradients", layers, sent, 2 * layer_fwd_s)
    if tensor > 1:
        activation = tokens * config.d_model * zmath.bytes_per_element(policy.compute_dtype)
        sent = _ring("all-reduce", activation, tensor)
        # Megatron: one all-reduce after attention and one after the MLP, forward and backward.
        add(
            "all-reduce",
            "tensor",
            "activations (attn + mlp), fwd + bwd",
            4 * layers,
            sent,
            layer_fwd_s / 2,
        )
    if stages > 1:
        # Per tick a stage sends one micro-batch's [batch, seq, embed] slice to the next stage
        # (forward) or its gradient back (backward), beside that micro-batch's stage compute.
        activation = tokens * config.d_model * zmath.bytes_per_element(policy.compute_dtype)
        sent = activation / microbatches / tensor
        chunk_fwd_s = layers * layer_fwd_s / microbatches / virtual
        ticks = microbatches * virtual + stages - 1
        if schedule == "1f1b":  # lockstep ticks, each sending both ways
            ticks = microbatches + 2 * stages - 2
        add("coll.-permute", "pipeline", "stage outputs, forward", ticks, sent, chunk_fwd_s)
        add("coll.-permute", "pipeline", "their gradients, backward", ticks, sent, 2 * chunk_fwd_s)
        if virtual > 1:
            # Each device keeps 1 / V of its consecutive layers and trades the rest for its
            # chunks (and the gradients back), beside the whole step's compute on the stage.
            regroup = held.layers * (virtual - 1) / virtual
            step_s = layers * layer_fwd_s * 3
            add("all-to-all", "pipeline", "layer weights into chunks, fwd", 1, regroup, step_s)
            add("all-to-all", "pipeline", "their gradients back, bwd", 1, regroup, step_s)
    collectives += _expert_all_to_alls(
        config, policy, rules, sizes, batch=batch, seq=seq, peak=peak, link=link
    )
    costs, chosen = (), None
    if seq_shards > 1:
        costs = zmath.context_attention_costs(
            config, policy, batch=batch // batch_shards, seq=seq, context=seq_shards
        )
        chosen = min(costs, key=lambda cost: cost.seconds(peak, link))
        kind = "collective-permute" if chosen.kernel == "ring" else "all-gather"
        add(
            kind,
            _targets(rules.mapping, "seq"),
            f"K/V for {chosen.kernel} attention, fwd + bwd",
            config.n_layers,
            chosen.bytes_moved,
            chosen.flops / peak,
        )
    # The pipeline's devices split the layers, not the tokens: a stage's share of the step is
    # its layers' FLOPs on the device's tokens (the bubble is printed apart).
    step_flops = zmath.training_flops_per_token(config, seq) * batch * seq / devices
    return Plan(
        params=held.total,
        expert_params=held.experts,
        grads=held.total,
        # Adam's two moments in the parameters' dtype and shardings, plus its int32 step count.
        adam_state=0 if offload_opt_state else 2 * held.total + 4,
        adam_state_on_host=2 * held.total + 4 if offload_opt_state else 0,
        activations=activations,
        kv_cache=kv_cache_bytes_per_device(
            config, policy, rules, sizes, batch, context or seq, kv_dtype=kv_dtype
        ),
        collectives=tuple(collectives),
        step_compute_s=step_flops / peak,
        stages=stages,
        microbatches=microbatches,
        bubble=bubble,
        schedule=schedule,
        virtual=virtual,
        context_attention=costs,
        context_kernel=chosen and chosen.kernel,
        kv_cache_per_head=kv_cache_bytes_per_device(
            config, policy, rules, sizes, batch, context or seq, per_head=True, kv_dtype=kv_dtype
        )
        if config.mla
        else None,
    )


def _expert_all_to_alls(
    config: Config,
    policy: Policy,
    rules: ShardingRules,
    sizes: dict[str, int],
    *,
    batch: int,
    seq: int,
    peak: float | int,
    link: float | int,
) -> list[Collective]:
    """Capacity dispatch with the experts split over mesh axes: per MoE layer the buffer goes
    to the experts and back by all-to-all, forward and backward. Each device holds the
    buffer's slice of its own sequences, `experts x capacity x embed` per sequence, and keeps
    1/n of it. The compute beside it is the routed experts' matmuls on that device: zoo.math's
    active expert FLOPs per token (k experts) plus capacity dispatch's padding slots and
    one-hot einsums."""
    c = config
    expert_axes = _targets(rules.mapping, "experts")
    n = _axes_size(sizes, expert_axes)
    n_moe = len(c.moe_layers)
    dispatch = policy.moe_dispatch
    if not n_moe or not isinstance(dispatch, Capacity) or n == 1:
        return []
    sequences = batch // _axes_size(sizes, _targets(rules.mapping, "batch"))
    factor = dispatch.capacity_factor
    capacity = expert_capacity(seq, c.n_experts_per_token, c.n_experts, factor)
    itemsize = zmath.bytes_per_element(policy.compute_dtype)
    buffer = sequences * c.n_experts * capacity * c.d_model * itemsize
    sent = buffer * (n - 1) / n
    tensor = _axes_size(sizes, _targets(rules.param_mapping, "mlp"))
    # Active routed-expert FLOPs of one token in one MoE layer: k SwiGLU experts (3 matmuls).
    active = 2 * c.n_experts_per_token * 3 * c.d_model * c.expert_d_ff
    padding = zmath.capacity_dispatch_flops_per_token(c, seq, factor) / n_moe
    expert_fwd_s = sequences * seq * (active + padding) / tensor / peak
    axis = _label(expert_axes, sizes)
    return [
        Collective("all-to-all", axis, why, 2 * n_moe, sent, sent / link, compute)
        for why, compute in [
            ("tokens to experts and back, forward", expert_fwd_s),
            ("tokens to experts and back, backward", 2 * expert_fwd_s),
        ]
    ]


def _gib(n: float | int) -> str:
    return f"{n / 2**30:9.3f} GiB"


def format_plan(p: Plan) -> str:
    lines = ["bytes per device"]
    lines += [
        f"  parameters          {_gib(p.params)}",
        f"    routed experts    {_gib(p.expert_params)}",
        f"  gradients           {_gib(p.grads)}",
        f"  Adam state          {_gib(p.adam_state)}",
    ]
    if p.adam_state_on_host:
        lines += [
            f"    in host memory    {_gib(p.adam_state_on_host)}  (--offload-opt-state: off the "
            "device between steps, back on it during the update;",
            f"                      {_gib(2 * p.adam_state_on_host)} host<->device per step)",
        ]
    lines += [f"  activations ({k:4s})  {_gib(v)}" for k, v in p.activations.items()]
    lines += [f"  KV cache            {_gib(p.kv_cache)}"]
    if p.kv_cache_per_head is not None:
        lines += [f"    per-head K/V      {_gib(p.kv_cache_per_head)} (MLA caches the latent)"]
    if p.stages > 1:
        chunks = f", {p.virtual} virtual stages per device" if p.virtual > 1 else ""
        kept = {
            "1f1b": f"at most {min(p.microbatches, 2 * p.stages - 1)} stage inputs in flight "
            "plus one micro-batch's stage activations (each stage's forward is recomputed in "
            "its backward: one more forward per micro-batch, remat or not)",
            "interleaved": "each tick's chunk input plus one chunk's activations (each chunk is "
            "recomputed in its backward: one more forward per micro-batch, remat or not)",
        }.get(p.schedule, f"{p.microbatches} micro-batches in flight")
        lines += [
            "",
            f"pipeline: {p.stages} stages (one per device along `pipeline`, the bytes above are "
            f"one stage's), {p.schedule} schedule{chunks}, {p.microbatches} micro-batches; "
            f"activations above: {kept}; bubble (S - 1) / (M V + S - 1) = {p.bubble:.1%} of "
            f"the step: step time about compute / {1 - p.bubble:.3f}",
        ]
    lines += [
        "",
        f"compute per step per device: {p.step_compute_s * 1e3:.2f} ms",
        f"{'collective':15s} {'axis':12s} {'what':36s} {'x/step':>6s} {'MiB/dev':>9s} "
        f"{'comm ms':>8s} {'compute ms':>10s}  hides?",
    ]
    for c in p.collectives:
        lines.append(
            f"{c.name:15s} {c.axis:12s} {c.why:36s} {c.count:6d} "
            f"{c.bytes_per_device / 2**20:9.2f} {c.comm_s * 1e3:8.3f} {c.compute_s * 1e3:10.3f}"
            f"  {'yes' if c.hides else 'NO'}"
        )
    if not p.collectives:
        lines.append("(none: a single device, or nothing sharded)")
    if p.context_attention:
        lines += [
            "",
            "context-parallel attention, one layer, fwd + bwd, per device",
            f"{'kernel':10s} {'GFLOP':>9s} {'MiB moved':>10s} {'MiB held':>9s}",
        ]
        lines += [
            f"{c.kernel:10s} {c.flops / 1e9:9.3f} {c.bytes_moved / 2**20:10.2f} "
            f"{c.held_bytes / 2**20:9.2f}"
            for c in p.context_attention
        ]
        lines.append(f"cheaper here: {p.context_kernel}")
    return "\n".join(lines)


# Of a device's memory, what the plan may fill: the rest goes to XLA's temporaries and
# fragmentation (bench/train.py checks its pick against XLA's compiled memory with the same 90%).
USABLE = 0.9
REMATS = ("none", "dots", "full")  # least recomputation first


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether a training run fits a device, and with which remat policy and gradient
    accumulation (or pipeline micro-batches): the first candidate, least recomputation (which
    costs FLOPs) then fewest micro-batches (which cost almost none), whose bytes per device fit
    `USABLE` of its memory; else the smallest."""

    fits: bool
    remat: str
    grad_accum: int
    bytes_needed: float
    parts: dict[str, float]
    device: zmath.Hardware

    def line(self) -> str:
        gib = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
        usable = USABLE * self.device.memory
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.parts.items())
        choice = f"--remat {self.remat}" + (
            f" --grad-accum {self.grad_accum}" if self.grad_accum > 1 else ""
        )
        where = f"{self.device.name} ({gib(self.device.memory)} GiB, {USABLE:.0%} usable)"
        if self.fits:
            return (
                f"verdict: fits one {where} with {choice}: {gib(self.bytes_needed)} GiB per "
                f"device ({parts})"
            )
        return (
            f"verdict: does NOT fit one {where}: the least it needs is {gib(self.bytes_needed)} "
            f"GiB per device, with {choice} ({parts}) > {gib(usable)} GiB; shard over more "
            "devices (a larger --mesh fsdp=N), --offload-opt-state, or a smaller --batch-size or "
            "--seq-len"
        )


def _accumulations(batch: int, batch_shards: int, stages: int) -> list[int]:
    """Micro-batch counts train.py accepts: each micro-batch splits over the batch's devices
    (and, with a pipeline, at least one per stage)."""
    return [
        m for m in range(1, batch + 1)
        if batch % m == 0 and (batch // m) % batch_shards == 0 and m >= stages
    ]  # fmt: skip


def verdict(
    config: Config,
    policy: Policy,
    rules: ShardingRules,
    mesh_shape: dict[str, int],
    *,
    batch: int,
    seq: int,
    device: zmath.Hardware,
    grad_accum: int | None = None,
    microbatches: int | None = None,
    schedule: str = "gpipe",
    virtual: int = 2,
    offload_opt_state: bool = False,
) -> Verdict:
    """Whether training `batch x seq` tokens per step fits one `device` of the mesh, trying
    each remat policy (least recomputation first) with `grad_accum` micro-batches (default:
    each count train.py accepts, fewest first). Without a pipeline, micro-batches run one after
    another, so a device holds one micro-batch's activations; with one, the pipeline's
    `microbatches` (default: each count train.py accepts) stream through the stages on
    `schedule` and `plan` counts what is in flight. Parameters, gradients and Adam state do not
    depend on either."""
    if device.memory is None:
        raise ValueError(f"{device.name} lists no memory size; pick one of {list(zmath.DEVICES)}")
    sizes = full_mesh(mesh_shape)
    stages = sizes["pipeline"]
    batch_shards = _axes_size(sizes, _targets(rules.mapping, "batch"))
    pipelined = stages > 1
    if pipelined and microbatches:
        counts = [microbatches]
    else:
        counts = [grad_accum] if grad_accum else _accumulations(batch, batch_shards, stages)
    if not counts:
        raise ValueError(
            f"--batch-size {batch} does not split into micro-batches over {batch_shards} batch "
            f"devices and {stages} pipeline stages; give a multiple of {batch_shards * stages}"
        )
    plans = {
        m: plan(
            config,
            policy,
            rules,
            mesh_shape,
            batch=batch if pipelined else batch // m,
            seq=seq,
            hardware=device,
            microbatches=m if pipelined else 1,
            schedule=schedule,
            virtual=virtual,
            offload_opt_state=offload_opt_state,
        )
        for m in counts
    }
    best = None
    for remat in REMATS:
        for m, p in plans.items():
            parts = {"parameters": p.params, "gradients": p.grads, "Adam": p.adam_state,
                     "activations": p.activations[remat]}  # fmt: skip
            needed = sum(parts.values())
            candidate = Verdict(needed <= USABLE * device.memory, remat, m, needed, parts, device)
            if candidate.fits:
                return candidate
            if best is None or needed < best.bytes_needed:
                best = candidate
    return best


# The settings of the run planned: train.py's flags (training/args.py), checked as train.py
# checks them.
TRAIN_FLAGS = ("model", "override", "mesh", "rules", "batch_size", "seq_len", "grad_accum",
               "microbatches", "pipeline_schedule", "virtual_stages", "dtype", "param_dtype",
               "attention", "moe_dispatch", "capacity_factor", "offload_opt_state")  # fmt: skip


def parser(
    prog: str = "python -m training.plan", *, defaults: bool = True
) -> argparse.ArgumentParser:
    """The plan's flags: train's own (same names, defaults and checks: training/args.py) for the
    run it plans, and `--device` for the verdict. `defaults=False` leaves unset flags out."""
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        epilog="With a pipeline axis and no --grad-accum, the micro-batches are the most, up to "
        "4 x the pipeline size, that split --batch-size evenly over the batch axes; the "
        "verdict tries each count train.py accepts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(p, TRAIN_FLAGS, defaults=defaults)
    p.add_argument(
        "--device",
        default="h100-80gb",
        choices=list(zmath.DEVICES),
        help="the device to plan for: its peak FLOP/s and links for the collectives' times, its "
        "memory for the verdict",
    )
    return p


def main(argv: list[str] | None = None, prog: str = "python -m training.plan") -> Verdict:
    p = parser(prog)
    args = p.parse_args(argv)
    given = vars(parser(prog, defaults=False).parse_known_args(argv)[0])
    try:
        check_batch_shards(Args(**{name: getattr(args, name) for name in TRAIN_FLAGS}))
        return _print_plan(args, given_accum="grad_accum" in given)
    except ValueError as error:
        p.error(str(error))


def check_trainable_length(config: Config, seq: int, name: str, sizes: dict[str, int]) -> None:
    """The sequence lengths train.py refuses for this model and mesh: past the model's
    `max_seq_len`, or not cut into the context axis's 2n zig-zag chunks."""
    try:
        config.check_length(seq, f"--seq-len {seq}")
    except ValueError as error:
        raise ValueError(f"model {name!r}: {error}") from None
    try:
        check_sequence_length(seq, sizes.get("context", 1))
    except ValueError as error:
        raise ArgError("--seq-len", str(error)) from None


def _print_plan(args: argparse.Namespace, *, given_accum: bool) -> Verdict:
    from training.artifacts import artifact_config
    from training.model_config import overrides

    sizes = parse_mesh(args.mesh) if args.mesh else {}
    name = args.model or "gpt-mini"
    config = artifact_config(name)
    if args.override:
        config = config.replace(**overrides(args))
    check_trainable_length(config, args.seq_len, name, sizes)
    policy = Policy(
        compute_dtype=args.dtype, param_dtype=args.param_dtype, attention=args.attention,
        moe_dispatch=Capacity(args.capacity_factor) if args.moe_dispatch == "capacity"
        else "dropless",
    ).for_model(config)  # fmt: skip
    rules_name = args.rules or default_rules(sizes)
    device = zmath.DEVICES[args.device]
    stages = sizes.get("pipeline", 1)
    rows = math.prod(sizes.get(axis, 1) for axis in ("data", "fsdp", "expert"))
    batch = args.batch_size
    # train.py's default count (training/args.py): the most, from the stage count up to 4 x it,
    # that split the batch evenly over the batch's devices.
    microbatches = args.microbatches or max(
        [m for m in range(stages, 4 * stages + 1) if batch % (m * rows) == 0], default=1
    )
    print(
        f"{name} ({zmath.param_count(config) / 1e9:.2f}B params, "
        f"{zmath.active_param_count(config) / 1e9:.2f}B active, compute {args.dtype}, weights "
        f"{args.param_dtype}), rules {rules_name}, mesh {full_mesh(sizes)}, batch {batch} x "
        f"seq {args.seq_len}, {device.name} ({device.interconnect / 1e9:.0f} GB/s link)"
    )
    rules = rules_for(sizes, rules_name)
    p = plan(
        config, policy, rules, sizes, batch=batch, seq=args.seq_len, hardware=device,
        microbatches=microbatches if stages > 1 else 1, schedule=args.pipeline_schedule,
        virtual=args.virtual_stages,
        offload_opt_state=args.offload_opt_state,
    )  # fmt: skip
    print(format_plan(p))
    if args.moe_dispatch == "dropless" and config.n_experts and sizes.get("expert", 1) > 1:
        print(
            "(dropless dispatch sorts all tokens together: under jit XLA replicates the routed "
            "rows instead of an all-to-all; plan with --moe-dispatch capacity for expert "
            "parallelism)"
        )
    result = verdict(
        config, policy, rules, sizes, batch=batch, seq=args.seq_len, device=device,
        grad_accum=args.grad_accum if given_accum else None,
        microbatches=microbatches, schedule=args.pipeline_schedule, virtual=args.virtual_stages,
        offload_opt_state=args.offload_opt_state,
    )  # fmt: skip
    print("\n" + result.line())
    return result


if __name__ == "__main__":
    main()
