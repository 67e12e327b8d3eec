"""Pretrained checkpoints: HF safetensors directories and GGUF files in, HF directories out.

`load_pretrained(path, policy=..., placement=...)` (weights placed straight into their
shardings under a sharded placement) and `save_pretrained(model, directory)`; the architectures
the zoo knows (GPT-2, Llama, Mixtral) are listed in `architectures.ARCHITECTURES`.
"""

from zoo.pretrained.export import save_pretrained
from zoo.pretrained.load import load_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
