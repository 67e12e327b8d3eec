"""Pretrained checkpoints: HF safetensors directories and GGUF files in, HF directories out.

`load_pretrained(path, policy=..., placement=...)` (weights placed straight into their
shardings under a sharded placement) and `save_pretrained(model, directory)`; LoRA adapters in
PEFT's format with `save_adapter(model, directory)` and `load_adapter(model, directory)`. The
architectures the zoo knows (GPT-2, Llama, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Mistral, Phi-3) are
listed in `architectures.ARCHITECTURES`, the GGUF ones in `gguf.ARCHITECTURES`.
"""

from zoo.pretrained.adapter import load_adapter, save_adapter
from zoo.pretrained.export import save_pretrained
from zoo.pretrained.load import load_pretrained

__all__ = ["load_adapter", "load_pretrained", "save_adapter", "save_pretrained"]
