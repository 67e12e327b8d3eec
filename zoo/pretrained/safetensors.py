"""Tensors of an HF model directory (model.safetensors, or shards listed in
model.safetensors.index.json), read one at a time through memory-mapped `safe_open`, so loading
never holds a second full copy of the checkpoint in host memory. Pickle files are never read."""

import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so bf16 tensors read as NumPy)
import numpy as np
from safetensors import SafetensorError, safe_open

from zoo.json_file import field, read_json_object

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def open_file(path: str):
    """One safetensors file, memory-mapped, read as NumPy; a clear error if it is damaged."""
    try:
        return safe_open(path, framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"{path}: cannot read safetensors (truncated or corrupt?): {e}") from e


def checkpoint_file(directory: str, name: str, what: str) -> str:
    """The path of the file `name` that a checkpoint in `directory` names (a shard in its index,
    its adapter weights). The name must be a file of that directory, not a path elsewhere; a
    symlink may lead elsewhere only as the HF hub cache links them, from `<repo>/snapshots/<rev>/`
    to `<repo>/blobs/`. Anything else could read a file the checkpoint's author chose anywhere on
    this machine, and is refused. `what` names the file's role for messages ("the shard")."""
    path = os.path.join(directory, name)
    root, real = os.path.realpath(directory), os.path.realpath(path)
    plain = name == os.path.basename(name) and name not in ("", ".", "..")
    hub_blob = os.path.dirname(real) == os.path.join(
        os.path.dirname(os.path.dirname(root)), "blobs"
    )
    if not plain or (os.path.dirname(real) != root and not hub_blob):
        raise ValueError(
            f"{directory!r} names {what} {name!r}, which is not a file of that directory (it "
            f"leads to {real!r}); a checkpoint's files must sit in its directory"
        )
    if not os.path.isfile(path):
        raise ValueError(f"{what} {name}, which is not in {directory!r}")
    return path


def read_weight_map(index: str) -> dict[str, str]:
    """The index's tensor name -> shard file map, checked for its shape (a non-empty object of
    strings): an index is what the loader trusts over model.safetensors."""
    expected = '{"weight_map": {"tensor name": "shard file name", ...}}'
    weight_map = field(read_json_object(index, expected), "weight_map", dict, index)
    if not weight_map:
        raise ValueError(f"{index} has an empty weight_map; it should be {expected}")
    bad = {k: v for k, v in weight_map.items() if not isinstance(v, str)}
    if bad:
        raise ValueError(
            f"{index}: weight_map values must be shard file names, not {list(bad.items())[:3]}"
        )
    return weight_map


class SafetensorsSource:
    """Name -> tensor for every safetensors file of `directory`."""

    def __init__(self, directory: str):
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            weight_map = read_weight_map(index)
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            weight_map = None
        else:
            raise ValueError(
                f"{directory!r} has neither {SINGLE} nor {INDEX}; the zoo reads safetensors only "
                "(never pickled .bin/.pt files): convert them with transformers' save_pretrained"
            )
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        paths = {
            name: checkpoint_file(directory, name, f"{INDEX} lists the shard") for name in files
        }
        self._files = {name: open_file(path) for name, path in paths.items()}
        self._where = {t: name for name, f in self._files.items() for t in f.keys()}  # noqa: SIM118
        for tensor, file in (weight_map or {}).items():
            if self._where.get(tensor) != file:
                raise ValueError(f"{INDEX} puts tensor {tensor} in {file}, which lacks it")

    def names(self) -> set[str]:
        return set(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self._where[name]].get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        return self._files[self._where[name]].get_tensor(name)
