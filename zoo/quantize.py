"""A model's projection weights quantized into a frozen base for QLoRA (Dettmers et al. 2023).

`quantize_base(model, kind)` replaces every `Linear` inside the layer stacks (attention q, k, v,
o and the dense MLP's gate/up/down) with a `QuantizedLinear`; on stacked storage each layer gets
its own scales (the quantization is vmapped over the layer axis), so stacked and unrolled models
quantize to the same weights.

Left in float, as QLoRA leaves them:
- the token embedding and the LM head (tied or not): a lookup table gains nothing from weight-only
  quantization on the matmul path, and the head's logits are what the loss reads;
- norms, biases and the MoE router (tiny, and the router's top-k decisions are sensitive);
- MoE experts: they are stacked raw arrays run by `ragged_dot`, not `Linear`s; quantizing them
  needs a quantized grouped matmul (not done).
"""

import equinox as eqx
import jax

from layers.linear import Linear
from layers.quantized import Kind, QuantizedLinear, check_kind
from zoo.transformer import Transformer


def _is_linear(node) -> bool:
    return isinstance(node, Linear)


def _is_quantized(node) -> bool:
    return isinstance(node, QuantizedLinear)


def quantize_base(model: Transformer, kind: Kind, *, block: int = 64) -> Transformer:
    """`model` with every projection in its stacks held as `kind` ("int8" or "nf4", NF4 blocks
    of `block` along each projection's last input dim, which `block` must divide). Raises before
    quantizing anything if one projection cannot be."""
    model.check_unfused("quantize_base")
    for linear in jax.tree.leaves(model.stacks, is_leaf=_is_linear):
        if _is_linear(linear):
            check_kind(kind, block, linear.in_shape)

    def quantize(node):
        return QuantizedLinear.from_linear(node, kind, block=block) if _is_linear(node) else node

    stacks = jax.tree.map(quantize, model.stacks, is_leaf=_is_linear)
    return eqx.tree_at(lambda m: m.stacks, model, stacks)


def dequantize_base(model: Transformer) -> Transformer:
    """`model` with every `QuantizedLinear` replaced by the float `Linear` it stands for (in the
    policy's parameter dtype): the same function as the quantized model, e.g. to merge a LoRA
    adapter into plain weights."""

    def dequantize(node):
        return node.dequantize(model.policy.params) if _is_quantized(node) else node

    stacks = jax.tree.map(dequantize, model.stacks, is_leaf=_is_quantized)
    return eqx.tree_at(lambda m: m.stacks, model, stacks)
