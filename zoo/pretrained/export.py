"""`save_pretrained`: a Transformer (and its tokenizer) -> a complete HF model directory
(model.safetensors, config.json, tokenizer.json, tokenizer_config.json with the chat template,
generation_config.json with the stop ids) that transformers' `AutoModelForCausalLM` and
`AutoTokenizer` load and `zoo.load_pretrained` / `zoo.load_tokenizer` read back, so a fine-tuned
model goes back to the ecosystem."""

import json
import os
import re

import numpy as np
from safetensors.numpy import save_file

from zoo.adapter import has_lora
from zoo.pretrained import deepseek_mtp
from zoo.pretrained.architectures import architecture_for
from zoo.pretrained.hf_config import config_to_hf
from zoo.pretrained.safetensors import INDEX, SINGLE, read_weight_map
from zoo.pretrained.tensor_map import hf_names, layer_path, leaf
from zoo.quantize import dequantize as zoo_dequantize
from zoo.quantize import quantized_formats
from zoo.tokenizer import Tokenizer, save_tokenizer
from zoo.transformer import Transformer


def _layer_array(model: Transformer, layer: int | None, path: str) -> np.ndarray:
    """Our array at `path` for one layer (or outside the layers), on the host."""
    if layer is None:
        return np.asarray(leaf(model, path))
    target, index = layer_path(model, layer, path)
    array = leaf(model, target)
    return np.asarray(array if index is None else array[index])


def _tensors(model: Transformer, arch) -> dict[str, np.ndarray]:
    """Every weight of `model` under its HF name in `arch`'s layout, on the host."""
    tensors = {}
    for group in arch.tensors(model.config):
        for i in group.layers(model.config.n_layers):
            arrays = [_layer_array(model, i, path) for path in group.zoo]
            for name, array in zip(hf_names(group, i), group.to_hf(*arrays), strict=True):
                tensors[name] = np.ascontiguousarray(array)
    return tensors


# The files of an HF model directory: what `overwrite` replaces, so that nothing of the old model
# (a stale shard index would win on load, a foreign tokenizer would decode garbage) survives.
HF_FILES = ("config.json", "generation_config.json", INDEX, "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
            "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")  # fmt: skip


# transformers' own shard names (`model-00001-of-00004.safetensors`).
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def _model_files(directory: str) -> set[str]:
    """The files of `directory` an HF model consists of: `HF_FILES`, model.safetensors, shards
    named the way transformers names them, and the shards its index names (plain names of that
    directory only). Nothing else there is the model's: an adapter_model.safetensors beside it
    belongs to someone else."""
    names = set(os.listdir(directory))
    ours = {n for n in names if n in HF_FILES or n == SINGLE or _SHARD.fullmatch(n)}
    try:
        indexed = set(read_weight_map(os.path.join(directory, INDEX)).values())
    except (OSError, ValueError):  # no index, or one that names nothing readable
        indexed = set()
    return ours | {n for n in indexed & names if n.endswith(".safetensors")}


def _clear(directory: str, overwrite: bool) -> None:
    """Refuse a non-empty directory unless `overwrite`; then remove its HF model files."""
    if not os.path.isdir(directory) or not os.listdir(directory):
        return
    if not overwrite:
        raise ValueError(
            f"save_pretrained: {directory!r} is not empty; choose an empty or new directory, or "
            "pass overwrite=True to replace the model files in it"
        )
    for name in _model_files(directory):
        os.remove(os.path.join(directory, name))


def save_pretrained(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    tokenizer: Tokenizer | None = None,
    overwrite: bool = False,
    architecture: str | None = None,
    dequantize: bool = False,
) -> None:
    """Write `model` in the HF layout of `architecture` (an HF class name, e.g.
    "Phi3ForCausalLM"), by default the first of `architectures.ARCHITECTURES` that holds its
    config (a Phi-3 model is written as a Llama or Mistral unless asked), weights in their own
    dtype, and with `tokenizer` its files (`zoo.save_tokenizer`) and generation_config.json
    (bos and the ids generation stops at, `tokenizer.stop_ids()`). Gathers the weights on the
    host (one copy of the model). A non-empty `directory` is refused unless `overwrite`, which
    first removes every HF model file there (weights, shard index, config, tokenizer). A
    quantized model (packed weights: `zoo.quantize`, a GGUF loaded as it is) is refused unless
    `dequantize`, which writes the float weights its blocks stand for (in the policy's parameter
    dtype)."""
    formats = quantized_formats(model)
    if formats and not dequantize:
        raise ValueError(
            f"save_pretrained: the model's weights are quantized ({', '.join(formats)}), which an "
            "HF safetensors directory does not hold; pass dequantize=True to write the float "
            "weights they stand for, or keep the original file"
        )
    if formats:
        model = zoo_dequantize(model)
    if has_lora(model):
        raise ValueError(
            "save_pretrained: the model holds LoRA adapters, which an HF model directory has no "
            "place for; export merge_adapter(model) for a plain model, or save the adapters "
            "alone with zoo.save_adapter"
        )
    model.check_unfused("save_pretrained")
    config = model.config
    arch = architecture_for(config, architecture)
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"save_pretrained: the tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {config.vocab_size}: it is not this model's tokenizer"
        )
    if model.mtp is not None and arch.name != deepseek_mtp.ARCHITECTURE:
        raise ValueError(
            f"save_pretrained: the model has a multi-token-prediction module, which the "
            f"{arch.name} layout has no place for ({deepseek_mtp.ARCHITECTURE}'s has); export "
            "model.with_mtp(None) to write the model without it"
        )
    directory = os.fspath(directory)
    _clear(directory, overwrite)
    tensors = _tensors(model, arch)
    hf = config_to_hf(arch, config, model.policy.param_dtype)
    if model.mtp is not None:  # DeepSeek-V3's MTP module as the layer after the last
        tensors |= deepseek_mtp.mtp_tensors(model.mtp, config, _tensors(model.mtp.body, arch))
        hf["num_nextn_predict_layers"] = 1
    os.makedirs(directory, exist_ok=True)
    # transformers refuses safetensors files without the "format" metadata.
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)
        generation = {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": list(tokenizer.stop_ids()),
        }
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump({k: v for k, v in generation.items() if v not in (None, [])}, f, indent=2)
