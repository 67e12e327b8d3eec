"""JSON files of a checkpoint (config.json, model.safetensors.index.json, adapter_config.json,
a run's meta.json) read with one contract: the file is a JSON object, or an error names the
file, what it holds instead, and what it should hold. Files come from strangers: nothing here
trusts their shape."""

import json
import os
from typing import Any


def read_json_object(path: str | os.PathLike, expected: str) -> dict[str, Any]:
    """The JSON object in `path`; a ValueError naming `path` if it is not valid JSON or not an
    object (a list, a number). `expected` says what the object should hold, for the message
    (e.g. "the model's sizes, like {'architectures': ['LlamaForCausalLM'], ...}")."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not a text file ({e}); it should be a JSON object: {expected}"
        ) from e
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); it should be an object: {expected}"
        ) from e
    if not isinstance(value, dict):
        raise ValueError(
            f"{path} holds a JSON {type(value).__name__}, not an object; it should be an "
            f"object: {expected}"
        )
    return value


def field(value: dict[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """`value[name]`, required, of the JSON type `kind` (a bool is not an int); an error naming
    `where`, the field and both types otherwise."""
    if name not in value:
        raise ValueError(f"{where} lacks the field {name!r}")
    item = value[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(item, bool) and bool not in kinds) or not isinstance(item, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise ValueError(
            f"{where}: {name!r} is {item!r} (a {type(item).__name__}); it must be a {names}"
        )
    return item
