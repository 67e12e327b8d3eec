"""config.json of an HF model directory -> (architecture, zoo Config). The config is always read
from the checkpoint, never guessed."""

import os

from zoo.config import Config
from zoo.json_file import read_json_object
from zoo.pretrained.architectures import Architecture, architecture
from zoo.pretrained.hf_fields import check_fields

DTYPES = ("float32", "bfloat16", "float16")


def read_hf_config(directory: str) -> dict:
    """The parsed config.json of `directory`, with an error that says what is missing."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"{directory!r} has no config.json: an HF model directory needs config.json next to "
            "model.safetensors (or model.safetensors.index.json)"
        )
    return read_json_object(
        path, "the model's class and sizes, like {'architectures': ['LlamaForCausalLM'], ...}"
    )


def declared_dtype(hf: dict) -> str:
    """The weights' dtype that config.json declares (`dtype`, or `torch_dtype` before
    transformers 5); float32 when it declares none."""
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"config.json dtype={name!r} is not supported; choose one of {DTYPES}")
    return name


def config_from_hf(hf: dict) -> tuple[Architecture, Config]:
    """The architecture named in `hf["architectures"]` and its Config."""
    names = hf.get("architectures") or []
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise ValueError(
            f"config.json must name exactly one class in 'architectures', got {names}; "
            "e.g. ['LlamaForCausalLM']"
        )
    arch = architecture(names[0])
    check_fields(hf, arch.name, reads=arch.reads, only=arch.only)
    try:
        config = arch.config_from_hf(hf)
    except KeyError as e:
        raise ValueError(f"config.json of a {arch.name} lacks the field {e}") from e
    return arch, config


def config_to_hf(arch: Architecture, config: Config, dtype: str) -> dict:
    """config.json for `config` with weights in `dtype`, in `arch`'s layout (loadable by
    transformers)."""
    return {"architectures": [arch.name], "dtype": dtype} | arch.config_to_hf(config)
