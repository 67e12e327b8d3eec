"""`load_pretrained`: an HF model directory or a .gguf file -> a Transformer with its weights."""

import os

import jax.numpy as jnp
from jax.sharding import Mesh
from jax.typing import DTypeLike

from shard import ShardingRules
from zoo.pretrained import gguf
from zoo.pretrained.fill import load_weights
from zoo.pretrained.hf_config import DTYPES, config_from_hf, declared_dtype, read_hf_config
from zoo.pretrained.safetensors import SafetensorsSource
from zoo.transformer import Transformer


def _dtype_name(dtype: DTypeLike | None, default: str) -> str:
    if dtype is None:
        return default
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"load_pretrained dtype={name!r} is not supported; choose one of {DTYPES}")
    return name


def _sharding(mesh: Mesh | None, rules: ShardingRules | None) -> tuple[Mesh, ShardingRules] | None:
    if (mesh is None) != (rules is None):
        raise ValueError(
            "load_pretrained needs both mesh and rules to shard the weights (e.g. "
            "mesh=shard.mesh(fsdp=8), rules=ShardingRules.preset('fsdp')), or neither"
        )
    return None if mesh is None else (mesh, rules)


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: DTypeLike | None = None,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
) -> Transformer:
    """The model stored at `path`: an HF directory (config.json + model.safetensors or a sharded
    model.safetensors.index.json) or a llama-architecture `.gguf` file.

    The architecture and sizes always come from the checkpoint. `dtype` is the dtype of the
    loaded weights and of the compute (`Config.param_dtype` and `Config.dtype`); by default the
    dtype config.json declares (float32 if none), and float32 for GGUF (quantized tensors are
    dequantized to float32).
    Weights are read one tensor at a time; no second copy of the checkpoint is held. With a
    `mesh` and sharding `rules` (`shard.mesh`, `shard.ShardingRules.preset`), each weight goes
    straight into its sharding (`shard.param_shardings`) as it is read.
    """
    sharding = _sharding(mesh, rules)
    path = os.fspath(path)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {path!r} does not exist")
        reader = gguf.open_gguf(path)
        hf = gguf.hf_config(reader)
        arch, config = config_from_hf(hf, dtype=_dtype_name(dtype, "float32"))
        return load_weights(gguf.GGUFSource(reader, hf), arch, config, sharding=sharding)
    if not os.path.isdir(path):
        raise ValueError(
            f"{path!r} is neither an HF model directory nor a .gguf file; pass a directory with "
            "config.json and model.safetensors, or a path ending in .gguf"
        )
    hf = read_hf_config(path)
    arch, config = config_from_hf(hf, dtype=_dtype_name(dtype, declared_dtype(hf)))
    return load_weights(SafetensorsSource(path), arch, config, sharding=sharding)
