"""Tensors of an HF model directory (model.safetensors, or shards listed in
model.safetensors.index.json), read one at a time through memory-mapped `safe_open`, so loading
never holds a second full copy of the checkpoint in host memory. Pickle files are never read."""

import json
import os

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so bf16 tensors read as NumPy)
import numpy as np
from safetensors import SafetensorError, safe_open

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def open_file(path: str):
    """One safetensors file, memory-mapped, read as NumPy; a clear error if it is damaged."""
    try:
        return safe_open(path, framework="numpy")
    except SafetensorError as e:
        raise ValueError(f"{path}: cannot read safetensors (truncated or corrupt?): {e}") from e


class SafetensorsSource:
    """Name -> tensor for every safetensors file of `directory`."""

    def __init__(self, directory: str):
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            weight_map = None
        else:
            raise ValueError(
                f"{directory!r} has neither {SINGLE} nor {INDEX}; the zoo reads safetensors only "
                "(never pickled .bin/.pt files): convert them with transformers' save_pretrained"
            )
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        root = os.path.realpath(directory)
        for name in files:
            if os.path.dirname(os.path.realpath(os.path.join(root, name))) != root:
                raise ValueError(
                    f"{INDEX} in {directory!r} lists the shard {name!r}, which is not a file of "
                    "that directory; a checkpoint's shards must sit beside its index"
                )
            if not os.path.isfile(os.path.join(directory, name)):
                raise ValueError(f"{INDEX} lists the shard {name}, which is not in {directory!r}")
        self._files = {name: open_file(os.path.join(directory, name)) for name in files}
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
