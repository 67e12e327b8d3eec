"""The model zoo: configs, presets, the Transformer assembly, transformer math, and tokenizers
with chat templates."""

from zoo import math
from zoo.config import Config
from zoo.output import ModelOutput, moe_aux_loss
from zoo.presets import preset, presets
from zoo.runtime import RUNTIME_FIELDS, with_runtime
from zoo.tokenizer import Tokenizer, load_tokenizer
from zoo.transformer import Block, Transformer

__all__ = [
    "RUNTIME_FIELDS",
    "Block",
    "Config",
    "ModelOutput",
    "Tokenizer",
    "Transformer",
    "load_pretrained",
    "load_tokenizer",
    "math",
    "moe_aux_loss",
    "preset",
    "presets",
    "save_pretrained",
    "with_runtime",
]


def __getattr__(name: str):
    # load_pretrained/save_pretrained need the `checkpoints` extra (safetensors, gguf): import
    # them on first use so that `import zoo` works without it.
    if name in ("load_pretrained", "save_pretrained"):
        from zoo import pretrained

        return getattr(pretrained, name)
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
