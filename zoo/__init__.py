"""The model zoo: configs, presets, the Transformer assembly and transformer math."""

from zoo import math
from zoo.config import Config
from zoo.presets import preset, presets
from zoo.pretrained import load_pretrained, save_pretrained
from zoo.transformer import Block, Transformer

__all__ = [
    "Block",
    "Config",
    "Transformer",
    "load_pretrained",
    "math",
    "preset",
    "presets",
    "save_pretrained",
]
