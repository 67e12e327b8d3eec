"""Pretrained checkpoints: HF safetensors directories and GGUF files in, HF directories out.

`load_pretrained(path, policy=..., placement=...)` (weights placed straight into their
shardings under a sharded placement) and `save_pretrained(model, directory)`; LoRA adapters in
PEFT's format with `save_adapter(model, directory)` and `load_adapter(model, directory)`; a
multi-token-prediction module trained for a model with `save_mtp(model, path)` and
`load_mtp(model, path)`. The
architectures the zoo knows (GPT-2, Llama, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3) are
listed in `architectures.ARCHITECTURES`, the GGUF ones in `gguf.ARCHITECTURES`.
"""

from zoo.pretrained.adapter import load_adapter, save_adapter
from zoo.pretrained.export import save_pretrained
from zoo.pretrained.load import load_pretrained
from zoo.pretrained.mtp_file import load_mtp, save_mtp

__all__ = [
    "load_adapter",
    "load_mtp",
    "load_pretrained",
    "save_adapter",
    "save_mtp",
    "save_pretrained",
]
