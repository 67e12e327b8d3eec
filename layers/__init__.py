"""Typed Equinox layers acting on batched arrays (`batch seq embed`).

Every module that owns arrays names their logical axes in `logical_axes()`; shard/ reads those
names to place each parameter on a device mesh.
"""

from layers.attention import Attention
from layers.embedding import Embedding, LearnedPositions
from layers.linear import Linear
from layers.lora import LoRA
from layers.mlp import MLP, SwiGLU
from layers.moe import MoE
from layers.norm import LayerNorm, RMSNorm
from layers.quantized import QuantizedEmbedding, QuantizedLinear
from layers.rotary import RopeScaling, apply_rotary, rotary_frequencies

__all__ = [
    "MLP",
    "Attention",
    "Embedding",
    "LayerNorm",
    "LearnedPositions",
    "Linear",
    "LoRA",
    "MoE",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "RMSNorm",
    "RopeScaling",
    "SwiGLU",
    "apply_rotary",
    "rotary_frequencies",
]
