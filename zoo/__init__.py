"""The model zoo: configs, presets, the Transformer assembly and transformer math."""

from zoo import math
from zoo.config import Config
from zoo.output import ModelOutput, moe_aux_loss
from zoo.presets import preset, presets
from zoo.transformer import Block, Transformer

__all__ = [
    "Block",
    "Config",
    "ModelOutput",
    "Transformer",
    "math",
    "moe_aux_loss",
    "preset",
    "presets",
]
