"""LoRA adapters in HF PEFT's format: `save_adapter(model, directory)` writes
adapter_config.json + adapter_model.safetensors that `peft.PeftModel.from_pretrained` loads onto
the HF base model; `load_adapter(model, directory)` reads one onto ours.

PEFT names each adapter after the HF module it wraps, `base_model.model.<module>.lora_A.weight`
`[rank, in_features]` and `...lora_B.weight` `[out_features, rank]` (nn.Linear layouts, also for
GPT-2's Conv1D). The module names come from the architecture's own tensor map (a projection whose
weight is one HF tensor per layer), and the flat in/out features are split into ours by the same
`tensor_map.linear` conversion as the weight (heads x head_dim, ...). HF safetensors checkpoints of
Llama store q/k unpermuted (only GGUF permutes them, undone on import), so adapters need no
rotary permutation. A projection stored fused in HF (GPT-2's c_attn) has no PEFT adapter of its
own, so adapters on it cannot be saved.
"""

import json
import math
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from shard import Placement
from zoo.adapter import (
    PROJECTIONS,
    adapted_projections,
    add_lora,
    has_lora,
    is_lora,
    lora_settings,
    place_adapters,
)
from zoo.json_file import field, read_json_object
from zoo.pretrained.architectures import Architecture, architecture_for
from zoo.pretrained.hf_fields import check_fields
from zoo.pretrained.safetensors import checkpoint_file, open_file
from zoo.pretrained.tensor_map import TensorGroup, layer_path, leaf, linear
from zoo.transformer import Transformer

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


def peft_modules(arch: Architecture, model: Transformer) -> dict[str, str]:
    """Our projection (a `zoo.adapter.PROJECTIONS` path) -> its HF module name with `{i}` for
    the layer, for every projection stored as one HF tensor per layer."""
    modules = {}
    for group in arch.tensors(model.config):
        ours, theirs = group.zoo[0], group.hf[0]
        if group.per_layer and len(group.zoo) == 1 and theirs.endswith(".weight"):
            path = ours.removeprefix("blocks.").removesuffix(".weight")
            if path in PROJECTIONS:
                modules[path] = theirs.removesuffix(".weight")
    return modules


def _groups(model: Transformer, path: str, module: str, rank: int) -> tuple[TensorGroup, ...]:
    """The A and B conversions of projection `path` (its in/out dims read off the model)."""
    projection = leaf(model, layer_path(model, 0, f"blocks.{path}")[0])
    a = linear(f"{path}.lora_a", f"{module}.lora_A", projection.in_shape, (rank,))
    b = linear(f"{path}.lora_b", f"{module}.lora_B", (rank,), projection.out_shape)
    return a, b


def _peft_key(module: str, layer: int, matrix: str) -> str:
    return f"base_model.model.{module.format(i=layer)}.lora_{matrix}.weight"


def _layers_with(model: Transformer, path: str, wrapped: bool) -> list[int]:
    """The layers whose block holds projection `path` (as a LoRA when `wrapped`)."""
    layers = []
    for i in range(model.config.n_layers):
        where, _ = layer_path(model, i, f"blocks.{path}")
        try:
            node = leaf(model, where)
        except AttributeError:  # e.g. mlp.gate in a mixture-of-experts layer
            continue
        if is_lora(node) or (not wrapped and node is not None):
            layers.append(i)
    return layers


def _target_names(modules: dict[str, str], paths: list[str]) -> list[str]:
    """PEFT's target_modules: each module's last name (q_proj), or its last two where that
    would also match a projection without an adapter (GPT-2's c_proj is attn's and mlp's)."""
    names = []
    for path in paths:
        parts = modules[path].split(".")
        clash = any(m.split(".")[-1] == parts[-1] for p, m in modules.items() if p not in paths)
        names.append(".".join(parts[-2:] if clash else parts[-1:]))
    return sorted(set(names))


def save_adapter(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
    architecture: str | None = None,
) -> None:
    """Write `model`'s LoRA adapters (only them, not the base) as a PEFT LoRA adapter for the
    HF architecture of the base model: `architecture` (e.g. "Phi3ForCausalLM", whose fused
    projections hold no adapters), by default the first that holds its config (as
    `save_pretrained`). `base_model_name_or_path` goes into the config for PEFT to find the base
    model. Refuses a directory that already holds an adapter unless `overwrite`."""
    directory = os.fspath(directory)
    rank, alpha, dropout = lora_settings(model)
    arch = architecture_for(model.config, architecture)
    modules = peft_modules(arch, model)
    paths = adapted_projections(model)
    unstorable = [p for p in paths if p not in modules]
    if unstorable:
        raise ValueError(
            f"save_adapter: adapters on {unstorable} have no PEFT module of their own in "
            f"{arch.name} (its checkpoint fuses them); PEFT can hold adapters on {list(modules)}"
        )
    existing = [n for n in (CONFIG, WEIGHTS) if os.path.exists(os.path.join(directory, n))]
    if existing and not overwrite:
        raise ValueError(
            f"save_adapter: {directory!r} already holds {existing}; choose another directory "
            "or pass overwrite=True"
        )
    tensors = {}
    for path in paths:
        groups = _groups(model, path, modules[path], rank)
        for i in _layers_with(model, path, wrapped=True):
            where, index = layer_path(model, i, f"blocks.{path}")
            lora = leaf(model, where)
            for group, array, matrix in zip(groups, (lora.lora_a, lora.lora_b), "AB", strict=True):
                array = np.asarray(array if index is None else array[index])
                (tensors[_peft_key(modules[path], i, matrix)],) = group.to_hf(array)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": _target_names(modules, paths),
        "bias": "none",
        # PEFT turns this on itself for GPT-2's Conv1D (with a warning); A and B are stored as
        # nn.Linear weights either way.
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    os.makedirs(directory, exist_ok=True)
    tensors = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    save_file(tensors, os.path.join(directory, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(config, f, indent=2)


# adapter_config.json (PEFT 0.21's LoraConfig): what the loader reads, what it implements at one
# value only (falsy, or the value given), and what leaves the adapter's function alone
# (bookkeeping, and initialisers of an adapter not yet trained). Anything else is refused.
READS = ("peft_type", "r", "lora_alpha", "lora_dropout")
ONLY = {
    "bias": "none",
    "use_rslora": False,
    "use_dora": False,
    "rank_pattern": False,
    "alpha_pattern": False,
    "modules_to_save": False,
    # PEFT adapts only these layers; the zoo puts an adapter in every layer with the projection.
    "layers_to_transform": False,
    "layers_pattern": False,
    "layer_replication": False,
    "trainable_token_indices": False,
    "alora_invocation_tokens": False,
    "use_qalora": False,
    "lora_bias": False,
    "target_parameters": False,
    "use_bdlora": False,
    "arrow_config": False,
    "kasa_config": False,
    "velora_config": False,
    "monteclora_config": False,
}
HARMLESS = (
    "task_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    # Which modules hold adapters is read off the tensors, every one of which must fit.
    "target_modules",
    "exclude_modules",
    # A and B are stored as nn.Linear weights either way (PEFT flips GPT-2's Conv1D itself).
    "fan_in_fan_out",
    "init_lora_weights",
    "loftq_config",
    "eva_config",
    "corda_config",
    "lora_ga_config",
    "megatron_config",
    "megatron_core",
    "qalora_group_size",
    "runtime_config",
    "ensure_weight_tying",
)


def _number(config: dict, name: str, path: str, *, integer: bool = False) -> int | float:
    """A finite number field (an int where `integer`); an error naming it otherwise."""
    value = field(config, name, int if integer else (int, float), path)
    if not math.isfinite(value):
        raise ValueError(f"{path}: {name}={value!r}; it must be a finite number")
    return value


def read_adapter_config(directory: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter, checked for the settings we can run: every
    field is in READS, HARMLESS, or ONLY at its one value; r an integer >= 1, lora_alpha a
    finite number, lora_dropout in [0, 1)."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise ValueError(
            f"{directory!r} has no {CONFIG}: a PEFT adapter directory holds {CONFIG} and {WEIGHTS}"
        )
    config = read_json_object(
        path, "a PEFT LoRA config, like {'peft_type': 'LORA', 'r': 8, 'lora_alpha': 16, ...}"
    )
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type={config.get('peft_type')!r}; only 'LORA' is supported")
    for name, value in ONLY.items():
        if name in config and (config[name] != value if value else bool(config[name])):
            raise ValueError(
                f"{path}: {name}={config[name]!r} is not supported; the zoo loads plain LoRA "
                "(bias 'none', one rank and alpha for every module, in every layer that has it, "
                "no rsLoRA/DoRA, no modules_to_save); merge it with PEFT and load the merged model"
            )
    check_fields(config, "PEFT LoRA", reads=(*READS, *ONLY), harmless=HARMLESS, file=CONFIG)
    rank = _number(config, "r", path, integer=True)
    if rank < 1:
        raise ValueError(f"{path}: r={rank}; the rank must be an integer >= 1")
    _number(config, "lora_alpha", path)
    dropout = _number(config, "lora_dropout", path) if "lora_dropout" in config else 0.0
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{path}: lora_dropout={dropout!r}; it must be in [0, 1)")
    return config


def _finite(array: np.ndarray, name: str) -> np.ndarray:
    """An adapter tensor, refused unless it is floating point with finite values (an int32 or
    NaN adapter would load and turn the model's every output into garbage)."""
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(
            f"{WEIGHTS}: tensor {name} has dtype {array.dtype}; LoRA weights are floating point "
            "(float32, bfloat16, float16)"
        )
    if not np.isfinite(array).all():
        raise ValueError(
            f"{WEIGHTS}: tensor {name} holds NaN or infinite values; the adapter is damaged "
            "(or trained into a divergence): retrain it or take an earlier checkpoint"
        )
    return array


def load_adapter(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    placement: Placement | None = None,
) -> Transformer:
    """`model` (a plain model, e.g. from `zoo.load_pretrained`) with the PEFT LoRA adapter in
    `directory` added: rank, alpha and dropout from adapter_config.json, the wrapped projections
    from the tensors the file holds. Every tensor the file holds must find its module in `model`
    and every wrapped projection needs its A and B in every layer that has it: missing and extra
    tensors are named, as is a tensor whose shape does not fit the model. Under a sharded
    `placement` the adapters go into their shardings."""
    directory = os.fspath(directory)
    if has_lora(model):
        raise ValueError(
            "load_adapter needs a model without adapters; merge_adapter(model) first, or load "
            "the base model again"
        )
    config = read_adapter_config(directory)
    if not os.path.lexists(os.path.join(directory, WEIGHTS)):
        raise ValueError(
            f"{directory!r} has no {WEIGHTS} (adapters saved as .bin need converting to "
            "safetensors)"
        )
    source = open_file(checkpoint_file(directory, WEIGHTS, "the adapter's weights"))
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    arch = architecture_for(model.config)
    modules = peft_modules(arch, model)
    where: dict[str, tuple[str, int, str]] = {}
    for path, module in modules.items():
        for i in _layers_with(model, path, wrapped=False):
            for matrix in "AB":
                where[_peft_key(module, i, matrix)] = (path, i, matrix)
    names = set(source.keys())
    extra = sorted(n for n in names if n not in where)
    if extra:
        raise ValueError(
            f"{WEIGHTS} has {len(extra)} tensor(s) that fit no projection of this {arch.name} "
            f"(adapters go on {list(modules)}): {', '.join(extra[:8])}"
        )
    paths = [p for p in PROJECTIONS if any(where[n][0] == p for n in names)]
    if not paths:
        raise ValueError(f"{WEIGHTS} in {directory!r} holds no LoRA tensors")
    missing = sorted(n for n, (p, _, _) in where.items() if p in paths and n not in names)
    if missing:
        raise ValueError(
            f"{WEIGHTS} lacks {len(missing)} tensor(s) of the projections it adapts: "
            f"{', '.join(missing[:8])}"
        )
    model = add_lora(
        model,
        paths,
        rank,
        alpha,
        dropout=float(config.get("lora_dropout", 0.0)),
        key=jax.random.key(0),
    )
    leaves, arrays = [], []
    for path in paths:
        groups = dict(zip("AB", _groups(model, path, modules[path], rank), strict=True))
        buffers: dict[str, np.ndarray] = {}
        for name in sorted(n for n in names if where[n][0] == path):
            _, i, matrix = where[name]
            group = groups[matrix]
            (expected,) = group.hf_shapes
            shape = tuple(source.get_slice(name).get_shape())
            if shape != expected:
                raise ValueError(
                    f"tensor {name} has shape {shape}, but this model with r={rank} needs "
                    f"{expected}"
                )
            (array,) = group.to_zoo(_finite(source.get_tensor(name), name))
            target, index = layer_path(model, i, f"blocks.{path}.lora_{matrix.lower()}")
            like = leaf(model, target)
            if index is None:
                buffers[target] = np.asarray(array, like.dtype)
            else:
                buffers.setdefault(target, np.empty(like.shape, like.dtype))[index] = array
        for target, buffer in buffers.items():
            leaves.append(target)
            arrays.append(jnp.asarray(buffer))
    model = eqx.tree_at(lambda m: [leaf(m, p) for p in leaves], model, arrays)
    return place_adapters(model, placement or Placement())
