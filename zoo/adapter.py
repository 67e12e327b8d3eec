"""LoRA adapters on a Transformer: wrap chosen projections of every layer (`add_lora`), train
only the adapters (`split_trainable`), fold them back into plain weights (`merge_adapter`).

Tree surgery on the `Linear` leaves of each layer's Block (`eqx.tree_at`). Stacked storage (the
stacks' `[repeats, ...]` leaves run by `lax.scan`) keeps working: the adapters are built with
`eqx.filter_vmap` over the stacked base, so A and B carry the same leading layer axis. The PEFT
file format lives in zoo/pretrained/adapter.py.

Targets are named as PEFT and HF name the modules, or as we do (the projection's path inside a
Block, or its attribute name):

    PEFT / HF Llama   ours              GPT-2 (HF)
    q_proj            attn.q_proj       c_attn   -> attn.q_proj, attn.k_proj, attn.v_proj
    k_proj            attn.k_proj       c_proj   -> attn.o_proj and mlp.down
    v_proj            attn.v_proj       c_fc     -> mlp.up
    o_proj            attn.o_proj
    gate_proj         mlp.gate (gate)
    up_proj           mlp.up   (up)
    down_proj         mlp.down (down)

GPT-2's fused `c_attn` becomes three adapters, one each for q, k and v (PEFT's single adapter on
the fused weight shares one A between them). Mixture-of-experts MLPs hold no Linear projections:
their layers take only the attention targets.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import PRNGKeyArray, PyTree

from layers import Linear, LoRA, QuantizedLinear
from shard import Placement
from shard.axes import is_float_array_like
from zoo.block import Block
from zoo.stack import Stack
from zoo.transformer import Transformer

# Every projection of a Block an adapter can wrap, in a fixed order (each one's init key is
# folded in by its index here, so the same target gets the same adapter whatever else is wrapped).
PROJECTIONS = (
    "attn.q_proj",
    "attn.k_proj",
    "attn.v_proj",
    "attn.o_proj",
    "mlp.gate",
    "mlp.up",
    "mlp.down",
)
TARGETS: dict[str, tuple[str, ...]] = {
    "q_proj": ("attn.q_proj",),
    "k_proj": ("attn.k_proj",),
    "v_proj": ("attn.v_proj",),
    "o_proj": ("attn.o_proj",),
    "gate_proj": ("mlp.gate",),
    "up_proj": ("mlp.up",),
    "down_proj": ("mlp.down",),
    "gate": ("mlp.gate",),
    "up": ("mlp.up",),
    "down": ("mlp.down",),
    "c_attn": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "c_proj": ("attn.o_proj", "mlp.down"),
    "c_fc": ("mlp.up",),
    **{path: (path,) for path in PROJECTIONS},
}


def is_lora(node) -> bool:
    return isinstance(node, LoRA)


def has_lora(model: PyTree) -> bool:
    """Whether any projection of `model` is wrapped by an adapter."""
    return any(is_lora(node) for node in jax.tree.leaves(model, is_leaf=is_lora))


def _get(block: Block, path: str):
    node = block
    for part in path.split("."):
        node = getattr(node, part, None)
    return node


def _present(model: Transformer) -> set[str]:
    """The projections (PROJECTIONS entries) that some layer of `model` holds."""
    return {
        path
        for stack in model.stacks
        for block in stack.blocks
        for path in PROJECTIONS
        if isinstance(_get(block, path), Linear | QuantizedLinear | LoRA)
    }


def resolve_targets(model: Transformer, targets: str | list[str] | tuple[str, ...]) -> list[str]:
    """Target names (see the module docstring) -> the projections they wrap, in PROJECTIONS
    order. Unknown names, and names that match no projection of this model, are errors that list
    what there is."""
    names = [targets] if isinstance(targets, str) else list(targets)
    if not names:
        raise ValueError(f"add_lora needs at least one target; choose from {sorted(TARGETS)}")
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target(s) {unknown}; known names: {sorted(TARGETS)}")
    present = _present(model)
    paths = {p for n in names for p in TARGETS[n]}
    if not paths & present:
        there = sorted(n for n, ps in TARGETS.items() if set(ps) <= present)
        raise ValueError(
            f"LoRA target(s) {names} match no projection of this model; its layers have: {there}"
        )
    return [p for p in PROJECTIONS if p in paths and p in present]


def add_lora(
    model: Transformer,
    targets: str | list[str] | tuple[str, ...],
    rank: int,
    alpha: float | int,
    *,
    dropout: float = 0.0,
    dtype: DTypeLike = jnp.float32,
    placement: Placement | None = None,
    key: PRNGKeyArray,
) -> Transformer:
    """`model` with the projections named by `targets` wrapped in `LoRA(rank, alpha, dropout)`
    in every layer that has them (B = 0: the new model computes what `model` does).

    The base weights are shared, not copied. Layer i's adapter for projection p starts from
    `fold_in(split(key, n_layers)[i], PROJECTIONS.index(p))`, so stacked and unrolled storage get
    the same adapters. The adapters' arrays are stored in `dtype`; under a sharded `placement`
    they are put in their shardings (the base keeps its own)."""
    if has_lora(model):
        raise ValueError(
            "this model already holds LoRA adapters; merge_adapter(model) first to stack another"
        )
    model.check_unfused("add_lora")
    paths = resolve_targets(model, targets)
    layer_keys = jax.random.split(key, model.config.n_layers)

    def make(base, k):
        return LoRA(base, rank=rank, alpha=alpha, dropout=dropout, dtype=dtype, key=k)

    stacks, first = [], 0
    for stack in model.stacks:
        blocks = []
        for j, block in enumerate(stack.blocks):
            # Stacked: block j holds layers first + r * period + j; unrolled: layer first + j.
            repeats = range(stack.repeats) if stack.stacked else [0]
            layers = jnp.array([first + r * stack.period + j for r in repeats])
            for index, path in enumerate(PROJECTIONS):
                base = _get(block, path)
                if path not in paths or not isinstance(base, Linear | QuantizedLinear):
                    continue
                keys = jax.vmap(jax.random.fold_in, (0, None))(layer_keys[layers], index)
                new = eqx.filter_vmap(make)(base, keys) if stack.stacked else make(base, keys[0])
                block = eqx.tree_at(lambda b, path=path: _get(b, path), block, new)
            blocks.append(block)
        stacks.append(Stack(tuple(blocks), stack.repeats, stack.period, stack.stacked))
        first += stack.n_layers
    model = eqx.tree_at(lambda m: m.stacks, model, tuple(stacks))
    return place_adapters(model, placement or Placement())


def place_adapters(model: Transformer, placement: Placement) -> Transformer:
    """`model` with its adapters' arrays in their shardings under `placement` (unchanged on one
    device); the base weights are not touched."""
    if not placement.sharded:
        return model
    mask = trainable_filter(model)
    adapters, rest = eqx.partition(model, mask)
    shardings = eqx.filter(placement.param_shardings(model), mask)
    return eqx.combine(jax.device_put(adapters, shardings), rest)


def _adapter_mask(lora: LoRA) -> LoRA:
    mask = jax.tree.map(lambda _: False, lora)
    return eqx.tree_at(lambda m: (m.lora_a, m.lora_b), mask, (True, True))


def _is_frozen_base(node) -> bool:
    return isinstance(node, QuantizedLinear)


def trainable_filter(model: PyTree) -> PyTree:
    """A filter spec for `eqx.partition`: with adapters, True on their A and B alone (the base
    is frozen); without, True on every floating-point array outside a `QuantizedLinear` (a
    quantized base is frozen whole: its float scales too, since AdamW's weight decay would move
    them even with a zero gradient). Works on abstract models."""
    if not has_lora(model):
        return jax.tree.map(
            lambda node: not _is_frozen_base(node) and is_float_array_like(node),
            model,
            is_leaf=_is_frozen_base,
        )
    return jax.tree.map(
        lambda node: _adapter_mask(node) if is_lora(node) else False, model, is_leaf=is_lora
    )


def split_trainable(model: PyTree) -> tuple[PyTree, PyTree]:
    """(trainable, frozen) = `eqx.partition(model, trainable_filter(model))`: an optimizer built
    on the first holds state for the adapters alone when the model has any."""
    return eqx.partition(model, trainable_filter(model))


def _merge(lora: LoRA) -> Linear:
    merge = LoRA.merged
    # Stacked storage: one vmap per leading layer axis of the adapter's arrays.
    for _ in range(lora.lora_a.ndim - len(lora.in_shape) - 1):
        merge = eqx.filter_vmap(merge)
    return merge(lora)


def merge_adapter(model: PyTree) -> PyTree:
    """`model` with every LoRA folded into its base, W + (alpha / rank) · A · B (in W's dtype):
    a plain model computing the same function up to float rounding, which `save_pretrained`
    exports."""
    return jax.tree.map(lambda n: _merge(n) if is_lora(n) else n, model, is_leaf=is_lora)


def adapted_projections(model: Transformer) -> list[str]:
    """The projections (PROJECTIONS entries) that hold an adapter in some layer."""
    return [
        path
        for path in PROJECTIONS
        if any(is_lora(_get(b, path)) for stack in model.stacks for b in stack.blocks)
    ]


def lora_settings(model: Transformer) -> tuple[int, float, float]:
    """(rank, alpha, dropout) shared by every adapter of `model` (an error if it has none or
    they differ: the PEFT format stores one of each)."""
    settings = {
        (node.rank, node.alpha, node.dropout)
        for node in jax.tree.leaves(model, is_leaf=is_lora)
        if is_lora(node)
    }
    if len(settings) != 1:
        raise ValueError(
            "the model holds no LoRA adapter; add_lora(model, ...) first"
            if not settings
            else f"the model's adapters differ in (rank, alpha, dropout): {sorted(settings)}"
        )
    return settings.pop()
