"""The model zoo: architecture configs and presets, the run-time policy, the Transformer assembly,
LoRA adapters, quantized models (packed weights for inference, the frozen base of QLoRA),
transformer math, and tokenizers with chat templates."""

from zoo import math
from zoo.adapter import add_lora, merge_adapter
from zoo.adapter_bank import bank_adapters
from zoo.block import Block
from zoo.config import Config
from zoo.mtp import MTP
from zoo.output import ModelOutput
from zoo.policy import Policy
from zoo.presets import preset, presets
from zoo.quantize import dequantize, dequantize_base, quantize, quantize_base
from zoo.router_balance import update_router_bias
from zoo.stack import Stack
from zoo.tokenizer import Tokenizer, from_tiktoken, load_tokenizer, save_tokenizer
from zoo.transformer import Transformer

__all__ = [
    "MTP",
    "Block",
    "Config",
    "ModelOutput",
    "Policy",
    "Stack",
    "Tokenizer",
    "Transformer",
    "add_lora",
    "bank_adapters",
    "dequantize",
    "dequantize_base",
    "from_tiktoken",
    "load_adapter",
    "load_mtp",
    "load_pretrained",
    "load_tokenizer",
    "math",
    "merge_adapter",
    "preset",
    "presets",
    "quantize",
    "quantize_base",
    "save_adapter",
    "save_mtp",
    "save_pretrained",
    "save_tokenizer",
    "update_router_bias",
]


def __getattr__(name: str):
    # Checkpoint and adapter files need the `checkpoints` extra (safetensors, gguf): import
    # them on first use so that `import zoo` works without it.
    if name in (
        "load_pretrained", "save_pretrained", "load_adapter", "save_adapter", "load_mtp", "save_mtp"
    ):  # fmt: skip
        from zoo import pretrained

        return getattr(pretrained, name)
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")
