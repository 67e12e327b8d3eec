"""`bank_adapters`: several LoRA adapters of one base model served together, each batch row
choosing its own (layers/lora_bank.py), instead of a merged model per adapter."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from layers import Linear, LoRA, QuantizedLinear
from layers.lora_bank import LoRABank
from zoo.adapter import has_lora, is_lora
from zoo.transformer import Transformer


def _is_projection(node) -> bool:
    return isinstance(node, Linear | QuantizedLinear)


def _bank(base, *nodes):
    loras = [n for n in nodes if is_lora(n)]
    if not loras:
        return base
    n_in = len(base.in_shape)
    lead = loras[0].lora_a.ndim - n_in - 1  # a stacked layer axis, if any
    rank = max(lora.rank for lora in loras)

    def padded(node: LoRA | None, which: str):
        if node is None:
            a = loras[0].lora_a
            shape = (*a.shape[:lead], *base.in_shape, rank) if which == "a" else (
                *a.shape[:lead], rank, *base.out_shape)  # fmt: skip
            return jnp.zeros(shape, jnp.float32)
        if which == "a":
            a = node.lora_a.astype(jnp.float32)
            return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, rank - node.rank)])
        b = node.lora_b.astype(jnp.float32) * node.scale  # the scale folded into B
        pads = [(0, 0)] * b.ndim
        pads[lead] = (0, rank - node.rank)
        return jnp.pad(b, pads)

    nodes = [n if is_lora(n) else None for n in nodes]
    a = jnp.stack([padded(n, "a") for n in nodes], axis=lead)
    b = jnp.stack([padded(n, "b") for n in nodes], axis=lead)
    rows = jnp.full((*a.shape[:lead], 0), -1, jnp.int32)
    return LoRABank(base, a, b, rows)


def bank_adapters(model: Transformer, adapted: Sequence[Transformer]) -> Transformer:
    """`model` (no adapters) with the adapters of `adapted` (each `model` plus one LoRA adapter,
    e.g. `zoo.load_adapter(model, path)`) banked: adapter `i` of every bank is `adapted[i]`'s
    (zeros where it wraps no such projection), chosen per batch row by
    `layers.lora_bank.with_adapter_rows` (the engine does it per request). The base weights are
    shared, not copied."""
    if has_lora(model):
        raise ValueError("bank_adapters needs the base model without adapters")
    if not adapted:
        raise ValueError("bank_adapters needs at least one adapted model")
    for i, other in enumerate(adapted):
        if not has_lora(other):
            raise ValueError(f"adapted model {i} holds no LoRA adapter")
        if other.config != model.config:
            raise ValueError(
                f"adapted model {i} is not an adapter of this base (its config differs)"
            )
    return jax.tree.map(_bank, model, *adapted, is_leaf=_is_projection)
