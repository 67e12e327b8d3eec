"""Pretrained checkpoints: HF safetensors directories and GGUF files in, HF directories out.

`load_pretrained(path, dtype=...)` and `save_pretrained(model, directory)`; the architectures the
zoo knows are listed in `architectures.ARCHITECTURES`.
"""

from zoo.pretrained.export import save_pretrained
from zoo.pretrained.load import load_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
