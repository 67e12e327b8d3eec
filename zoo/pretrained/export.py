"""`save_pretrained`: a Transformer -> an HF model directory (model.safetensors + config.json)
that transformers' `from_pretrained` loads, so a fine-tuned model goes back to the ecosystem."""

import json
import os

import numpy as np
from safetensors.numpy import save_file

from zoo.pretrained.architectures import architecture_for
from zoo.pretrained.hf_config import config_to_hf
from zoo.pretrained.tensor_map import hf_names, layer_path, leaf
from zoo.transformer import Transformer


def _layer_array(model: Transformer, layer: int | None, path: str) -> np.ndarray:
    """Our array at `path` for one layer (or outside the layers), on the host."""
    if layer is None:
        return np.asarray(leaf(model, path))
    target, index = layer_path(model, layer, path)
    array = leaf(model, target)
    return np.asarray(array if index is None else array[index])


def save_pretrained(model: Transformer, directory: str | os.PathLike) -> None:
    """Write `model` in the HF layout of the architecture that holds its config (GPT-2, Llama or
    Mixtral), weights in their own dtype. Gathers the weights on the host (one copy of the
    model)."""
    config = model.config
    arch = architecture_for(config)
    tensors: dict[str, np.ndarray] = {}
    for group in arch.tensors(config):
        for i in range(config.n_layers) if group.per_layer else [None]:
            arrays = [_layer_array(model, i, path) for path in group.zoo]
            for name, array in zip(hf_names(group, i), group.to_hf(*arrays), strict=True):
                tensors[name] = np.ascontiguousarray(array)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    # transformers refuses safetensors files without the "format" metadata.
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config_to_hf(arch, config, model.policy.param_dtype), f, indent=2)
