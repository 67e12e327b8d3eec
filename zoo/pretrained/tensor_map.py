"""How the zoo's parameters sit in an HF checkpoint: groups of our leaves and the HF tensors
they come from, with the conversions both ways.

A group is usually one leaf <-> one tensor (a transposed, reshaped nn.Linear weight), but may fuse
several (GPT-2 keeps q, k and v in one `c_attn` tensor; Mixtral keeps each expert apart while we
stack them). Per-layer groups name their tensors with `{i}` and their leaves `blocks.<field>`, a
field of the layer's Block (`layer_path` finds it in the model's stacks); conversions see one
layer.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import numpy as np

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TensorGroup:
    """`zoo` leaves (dotted paths in a Transformer) <-> `hf` tensors of shapes `hf_shapes`.

    `to_zoo(*hf_arrays) -> tuple of our arrays` and `to_hf(*our_arrays) -> tuple of HF arrays`,
    one layer at a time for per-layer groups. `only_layers` restricts a per-layer group to some
    layers (DeepSeek's dense first layers and MoE ones hold different tensors); None: all.
    `rows`, for a group of one `[out, in]` tensor (nn.Linear's layout, an embedding table): its
    consecutive rows as (our leaf, number of rows), which is how a quantized checkpoint's blocks
    become packed weights without going through float (zoo/pretrained/fill.py).
    """

    zoo: tuple[str, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[Shape, ...]
    to_zoo: Callable[..., tuple[np.ndarray, ...]]
    to_hf: Callable[..., tuple[np.ndarray, ...]]
    only_layers: tuple[int, ...] | None = None
    rows: tuple[tuple[str, int], ...] | None = None

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf[0]

    def layers(self, n_layers: int) -> list[int | None]:
        """The layer indices to read or write this group for ([None] outside the stack)."""
        if not self.per_layer:
            return [None]
        return list(range(n_layers)) if self.only_layers is None else list(self.only_layers)


def same(zoo: str, hf: str, shape: Shape) -> TensorGroup:
    """A tensor stored exactly as we store it (norm scales, biases of flat outputs)."""
    return TensorGroup((zoo,), (hf,), (shape,), lambda w: (w,), lambda w: (w,))


def embedding(zoo: str, hf: str, shape: Shape) -> TensorGroup:
    """A token table `[vocab, embed]`, stored as we store it: one row per token."""
    return TensorGroup(
        (zoo,), (hf,), (shape,), lambda w: (w,), lambda w: (w,), rows=((zoo, shape[0]),)
    )


def linear(zoo: str, hf: str, in_shape: Shape, out_shape: Shape, *, hf_in_out: bool = False):
    """An HF projection weight as our Linear weight `[*in_shape, *out_shape]`.

    torch's nn.Linear stores `[out, in]` (transposed here); GPT-2's Conv1D stores `[in, out]`
    (`hf_in_out=True`). Either way the flat dims are split into ours (heads x head_dim, ...).
    """
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    if hf_in_out:
        return TensorGroup(
            (zoo,),
            (hf,),
            ((n_in, n_out),),
            lambda w: (w.reshape(in_shape + out_shape),),
            lambda w: (w.reshape(n_in, n_out),),
        )
    return TensorGroup(
        (zoo,),
        (hf,),
        ((n_out, n_in),),
        lambda w: (w.T.reshape(in_shape + out_shape),),
        lambda w: (w.reshape(n_in, n_out).T,),
        rows=((zoo, n_out),),
    )


def bias(zoo: str, hf: str, out_shape: Shape) -> TensorGroup:
    """A flat HF bias `[prod(out_shape)]` as our `[*out_shape]` bias."""
    n_out = math.prod(out_shape)
    return TensorGroup(
        (zoo,), (hf,), ((n_out,),), lambda b: (b.reshape(out_shape),), lambda b: (b.reshape(n_out),)
    )


def hf_names(group: TensorGroup, layer: int | None) -> list[str]:
    """The group's HF tensor names for one layer (None for groups outside the layer stack)."""
    return [name.format(i=layer) for name in group.hf]


def leaf(model, path: str):
    """The leaf of `model` at dotted `path`, e.g. "stacks.0.blocks.0.attn.q_proj.weight" (a
    number indexes a tuple)."""
    return functools.reduce(
        lambda node, part: node[int(part)] if part.isdigit() else getattr(node, part),
        path.split("."),
        model,
    )


def layer_path(model, layer: int, path: str) -> tuple[str, int | None]:
    """Where a per-layer group's leaf `path` ("blocks.<field>...") of `layer` lives: the dotted
    path of the array in the model's stacks and the index of the layer along its leading axis
    (None for unrolled storage, whose arrays hold one layer each)."""
    field = path.removeprefix("blocks.")
    s, i = model.layer_location(layer)
    stack = model.stacks[s]
    if not stack.stacked:
        return f"stacks.{s}.blocks.{i}.{field}", None
    repeat, j = divmod(i, stack.period)
    return f"stacks.{s}.blocks.{j}.{field}", repeat
