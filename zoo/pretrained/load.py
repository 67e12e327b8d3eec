"""`load_pretrained`: an HF model directory or a .gguf file -> a Transformer with its weights."""

import os

from shard import Placement
from zoo.policy import Policy
from zoo.pretrained import gguf
from zoo.pretrained.fill import load_weights
from zoo.pretrained.hf_config import config_from_hf, declared_dtype, read_hf_config
from zoo.pretrained.safetensors import SafetensorsSource
from zoo.transformer import Transformer


def load_pretrained(
    path: str | os.PathLike,
    *,
    policy: Policy | None = None,
    placement: Placement | None = None,
) -> Transformer:
    """The model stored at `path`: an HF directory (config.json + model.safetensors or a sharded
    model.safetensors.index.json) or a `.gguf` file of a llama.cpp architecture in
    `gguf.ARCHITECTURES` (llama, qwen2, qwen3, phi3).

    The architecture and sizes always come from the checkpoint; how the model runs is `policy`,
    by default `Policy.inference`: the fastest decode (one array per layer), computing and
    storing in the dtype config.json declares (float32 if none), and float32 for GGUF
    (quantized tensors are dequantized to float32). Training takes stacked layers: pass a
    policy with `storage="stacked"` (train.py does). Weights are read one tensor
    group at a time (no second copy of the checkpoint is held) and each goes straight into its
    sharding under `placement` (`shard.Placement(mesh, rules)`) as it is read.
    """
    placement = placement or Placement()
    path = os.fspath(path)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist")
        reader = gguf.open_gguf(path)
        hf = gguf.hf_config(reader)
        arch, config = config_from_hf(hf)
        policy = policy or Policy.inference("float32")
        source = gguf.GGUFSource(reader, hf)
        return load_weights(source, arch, config, policy=policy, placement=placement)
    if not os.path.isdir(path):
        raise ValueError(
            f"{path!r} is neither an HF model directory nor a .gguf file; pass a directory with "
            "config.json and model.safetensors, or a path ending in .gguf"
        )
    hf = read_hf_config(path)
    arch, config = config_from_hf(hf)
    policy = policy or Policy.inference(declared_dtype(hf))
    return load_weights(SafetensorsSource(path), arch, config, policy=policy, placement=placement)
