"""Whole models quantized to packed weights (layers/quantized): `quantize` for inference,
`quantize_base` for QLoRA's frozen base (Dettmers et al. 2023), `dequantize` (and its name for
a base, `dequantize_base`) back to float.

`quantize(model, kind)` packs, for any family:
- every projection inside the layer stacks (attention q, k, v, o or MLA's latent projections,
  the dense MLP, DeepSeek's shared experts) as `kind` ("int8", "int4", "nf4"; `group` weights
  per scale, default per kind: layers/quantized/quantize.py);
- the MoE experts (`QuantizedExperts`: on CPU a decode step reads only the experts it routes to);
- the token embedding and the LM head (tied or not) as `embeddings` (default "int8", one scale
  per token row; None keeps them float): the head is a sixth of a small model's weights.
Left float: norms, biases, the MoE router (tiny, and its top-k choices are sensitive), GPT-2's
learned positions (a lookup table, read one row per token), and MLA's `kv_b_proj` (decode
multiplies by its weight directly: layers/mla.py's absorbed form).

Packed weights take x as it is (the CPU kernel's default float activations:
layers/quantized/formats.py); `with_activations(model, "int8")` rounds it per 32 inputs at decode
and multiplies codes in integers.

On stacked storage every layer gets its own scales (the packing runs over the layer axis), so
stacked and unrolled models quantize to the same weights. The engine and `infer.generate` run a
quantized model unchanged: they call its own forward, whose projections dispatch to the
quantized kernels (layers/kernels/quantized).
"""

import equinox as eqx
import jax
from jaxtyping import PyTree

from layers import Linear, LoRA, QuantizedEmbedding, QuantizedLinear
from layers.mla import MLA
from layers.moe import Experts, QuantizedExperts
from layers.quantized import Kind, PackedWeight
from zoo.transformer import Transformer

QUANTIZED = (QuantizedLinear, QuantizedEmbedding, QuantizedExperts)
# MLA projections that quantize (kv_b_proj stays float: see the module docstring).
MLA_PROJECTIONS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "o_proj")


def _is_quantized(node) -> bool:
    return isinstance(node, QUANTIZED)


def quantized_formats(model: PyTree) -> list[str]:
    """The packed formats `model` holds (e.g. ["q4_1", "q8_0"]), empty for a float model."""
    leaves = jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, PackedWeight))
    return sorted({leaf.name for leaf in leaves if isinstance(leaf, PackedWeight)})


def check_quantizable(model: Transformer, what: str) -> None:
    """Refuse a model that is not a plain float model: fused, adapted or already quantized."""
    model.check_unfused(what)
    is_lora = lambda n: isinstance(n, LoRA)  # noqa: E731
    if any(is_lora(n) for n in jax.tree.leaves(model, is_leaf=is_lora)):
        raise ValueError(
            f"{what} takes a model without LoRA adapters: merge them first (zoo.merge_adapter) "
            "and quantize the merged model, or quantize the base before add_lora (QLoRA)"
        )
    formats = quantized_formats(model)
    if formats:
        raise ValueError(
            f"{what}: this model is already quantized ({', '.join(formats)}); quantize the float "
            "model it came from, or zoo.dequantize(model) first"
        )


def _pack_projections(stacks, kind: Kind, group: int | None, *, experts: bool):
    """The stacks with every projection (and, with `experts`, every Experts) packed."""

    def pack(node):
        if isinstance(node, MLA):
            fields = [f for f in MLA_PROJECTIONS if isinstance(getattr(node, f), Linear)]
            return eqx.tree_at(
                lambda m: [getattr(m, f) for f in fields],
                node,
                [QuantizedLinear.from_linear(getattr(node, f), kind, group=group) for f in fields],
            )
        if isinstance(node, Linear):
            return QuantizedLinear.from_linear(node, kind, group=group)
        if isinstance(node, Experts) and experts:
            return QuantizedExperts.from_experts(node, kind, group=group)
        return node

    packable = lambda n: isinstance(n, Linear | MLA | Experts)  # noqa: E731
    return jax.tree.map(pack, stacks, is_leaf=packable)


def _quantized(
    model: Transformer, kind: Kind, group: int | None, embeddings: Kind | None, experts: bool
) -> Transformer:
    stacks = _pack_projections(model.stacks, kind, group, experts=experts)
    model = eqx.tree_at(lambda m: m.stacks, model, stacks)
    if embeddings is None:
        return model
    embed = QuantizedEmbedding.from_embedding(model.embed, embeddings)
    model = eqx.tree_at(lambda m: m.embed, model, embed)
    if model.lm_head is not None:
        head = QuantizedLinear.from_linear(model.lm_head, embeddings)
        model = eqx.tree_at(lambda m: m.lm_head, model, head)
    return model


def quantize(
    model: Transformer,
    kind: Kind,
    *,
    group: int | None = None,
    embeddings: Kind | None = "int8",
) -> Transformer:
    """`model` for inference with its projections and experts packed as `kind` and its
    embedding and head as `embeddings` (see the module docstring). Checks every weight before
    packing any: a group size that does not divide a row, a width that is not a multiple of 32,
    a fused, adapted or already quantized model are errors that name the weight."""
    check_quantizable(model, "zoo.quantize")
    # The same packing on shapes alone: every error raises here, before any weight is touched.
    eqx.filter_eval_shape(_quantized, model, kind, group, embeddings, True)
    return _quantized(model, kind, group, embeddings, True)


def quantize_base(model: Transformer, kind: Kind, *, block: int = 64) -> Transformer:
    """QLoRA's frozen base: the projections in the stacks packed as `kind` (int8 per output
    channel; 4-bit kinds in groups of `block`), embeddings, head and experts left float as
    QLoRA leaves them (the LoRA adapters go on the projections). Its kernels take x as it is
    (float activations): the adapters train through the base's exact forward, as QLoRA's
    dequantize-then-multiply computes it."""
    check_quantizable(model, "zoo.quantize_base")
    group = None if kind == "int8" else block
    eqx.filter_eval_shape(_quantized, model, kind, group, None, False)
    return _quantized(model, kind, group, None, False)  # float activations: the default


def dequantize_base(model: Transformer) -> Transformer:
    """`quantize_base`'s inverse: the float model of a quantized base (`dequantize`)."""
    return dequantize(model)


# One program per packed weight's structure and dtype (a stack's weights share it), not its
# dozen ops one by one.
_dequantized = eqx.filter_jit(lambda node, dtype: node.dequantize(dtype))


def dequantize(model: Transformer) -> Transformer:
    """`model` with every packed weight replaced by the float one it stands for (in the policy's
    parameter dtype): the same function as the quantized model (up to the order of float
    additions), e.g. to merge a LoRA adapter or to export."""
    dtype = model.policy.params

    def to_float(node):
        return _dequantized(node, dtype) if _is_quantized(node) else node

    return jax.tree.map(to_float, model, is_leaf=_is_quantized)
