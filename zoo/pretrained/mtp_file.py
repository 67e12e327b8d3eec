"""A multi-token-prediction module trained for a model (zoo/mtp.py; `python -m
examples.train_draft --mtp`: EAGLE's recipe, Li et al. 2024, on DeepSeek-V3's module) as a
file of its own: `save_mtp(model, path)` writes `model.mtp` and `load_mtp(model, path)` gives
it back to a model of the same config.

One safetensors file holding the module's tensors under the names DeepSeek-V3's checkpoints
give their MTP layer (zoo/pretrained/deepseek_mtp.py: layer `num_hidden_layers` of the model's
HF layout), without its token table and head: a trained module reads the model's own (they
were frozen while it learned), so the file is the module's few megabytes and the model's tables
(quantized ones included) are shared, never copied. The metadata names the layout and the
model's sizes, checked on load."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from shard import Placement
from zoo.pretrained import deepseek_mtp
from zoo.pretrained.architectures import Architecture, architecture_for
from zoo.pretrained.export import _tensors
from zoo.pretrained.safetensors import open_file
from zoo.transformer import Transformer

# The module's tensors it shares with its model (not written): its token table and head.
SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def _sizes(model: Transformer, arch: Architecture) -> dict[str, str]:
    c = model.config
    return {
        "format": "pt", "architecture": arch.name, "n_layers": str(c.n_layers),
        "d_model": str(c.d_model), "vocab_size": str(c.vocab_size),
    }  # fmt: skip


def save_mtp(model: Transformer, path: str | os.PathLike) -> None:
    """Write `model.mtp` to the safetensors file `path` (module docstring), float weights only."""
    if model.mtp is None:
        raise ValueError("save_mtp: the model has no multi-token-prediction module (model.mtp)")
    model.check_unfused("save_mtp")
    body = model.mtp.body
    tables = [("token table", body.embed, model.embed), ("head", body.lm_head, model.lm_head)]
    for what, theirs, ours in tables:
        if not _same(theirs, ours):
            raise ValueError(
                f"save_mtp: the module's {what} is not the model's, and the file holds the "
                "module without them (it reads the model's); give the module the model's "
                f"{what} (eqx.tree_at) or save the model with save_pretrained"
            )
    arch = architecture_for(model.config)
    body = _tensors(body, arch)
    tensors = deepseek_mtp.mtp_tensors(model.mtp, model.config, body)
    prefix = deepseek_mtp.layer_prefix(model.config)
    for name in SHARED:
        tensors.pop(prefix + name, None)
    save_file(tensors, os.fspath(path), metadata=_sizes(model, arch))


def _same(a, b) -> bool:
    """Whether two token tables or heads (or both None) hold the same weights."""
    if a is None or b is None:
        return a is b
    left, right = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(left) == len(right) and all(
        x is y or (x.shape == y.shape and bool(jnp.array_equal(x, y)))
        for x, y in zip(left, right, strict=True)
    )


class _WithModelTables:
    """The file's tensors, and the token table and head it leaves to the model (zeros of their
    shapes, replaced by the model's own arrays once loaded)."""

    def __init__(self, file, shapes: dict[str, tuple[int, ...]]):
        self._file, self._shapes = file, shapes

    def names(self) -> set[str]:
        return set(self._file.keys()) | set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._shapes:
            return self._shapes[name]
        return tuple(self._file.get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        if name in self._shapes:
            return np.zeros(self._shapes[name], np.float32)
        return self._file.get_tensor(name)


def load_mtp(
    model: Transformer, path: str | os.PathLike, *, placement: Placement | None = None
) -> Transformer:
    """`model` with the module `save_mtp` wrote to `path` as `model.mtp` (its token table and
    head the model's own), under the model's policy. A file written for another model's
    sizes or layout, or not such a file, is a clear error."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"load_mtp: {path!r} is not a file (save_mtp writes one)")
    file = open_file(path)
    arch = architecture_for(model.config)
    written = file.metadata() or {}
    expected = _sizes(model, arch)
    differ = {k: (written.get(k), v) for k, v in expected.items() if written.get(k) != v}
    if differ:
        raise ValueError(
            f"load_mtp: {path} was not written by save_mtp for this model: (file, model) "
            f"{json.dumps(differ)}; train a module for this model (python -m "
            "examples.train_draft --mtp)"
        )
    prefix = deepseek_mtp.layer_prefix(model.config)
    c = model.config
    shared = SHARED if not c.tie_embeddings else SHARED[:1]
    shapes = {prefix + name: (c.vocab_size, c.d_model) for name in shared}
    source = _WithModelTables(file, shapes)
    hf = {"num_nextn_predict_layers": 1}
    loaded = deepseek_mtp.load_checkpoint_mtp(
        source, arch, model.with_mtp(None), hf, policy=model.policy.replace(fused=False),
        placement=placement or Placement(), strict=True, share_tables=False,
    )  # fmt: skip
    mtp = loaded.mtp.with_policy(model.policy)
    mtp = eqx.tree_at(lambda m: m.body.embed, mtp, model.embed)
    if not c.tie_embeddings:
        mtp = eqx.tree_at(lambda m: m.body.lm_head, mtp, model.lm_head)
    return model.with_mtp(mtp)
