"""DeepSeek-V3's multi-token-prediction modules in HF layout (zoo/mtp.py): module `i` of
`num_nextn_predict_layers` is stored as layer `num_hidden_layers + i`, whose `enorm`, `hnorm`,
`eh_proj`, `embed_tokens`, `shared_head.norm` and `shared_head.head` sit beside a decoder
layer's own tensors (`self_attn.*`, `mlp.*`, the two layer norms), named as the main model's
layers are.

The first module is loaded (the one V3 ships; drafting with it alone is what vLLM does with
one); `save_pretrained` writes it back as that layer. Its token table and head are the main
model's own arrays where the checkpoint's copies equal them (V3's do: no second copy)."""

import warnings

import equinox as eqx
import jax
import numpy as np

from shard import Placement
from zoo.config import Config
from zoo.mtp import MTP, body_config
from zoo.policy import Policy
from zoo.pretrained.architectures import Architecture
from zoo.pretrained.fill import TensorSource, load_weights, place
from zoo.pretrained.tensor_map import leaf
from zoo.transformer import Transformer

ARCHITECTURE = "DeepseekV3ForCausalLM"  # the layout that holds MTP modules
# The module's own tensors (the rest of its layer is a decoder layer), as its `MTP` leaves.
OWN = {"enorm.weight": "embed_norm.scale", "hnorm.weight": "hidden_norm.scale"}
PROJ = "eh_proj.weight"
# Its one-layer body's tensors under the names a one-layer main model has.
RENAMED = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.norm.weight": "model.norm.weight",
    "shared_head.head.weight": "lm_head.weight",
}


def layer_prefix(config: Config) -> str:
    """Where the first MTP module's tensors start."""
    return f"model.layers.{config.n_layers}."


class _BodyView:
    """The module's block, token table, norm and head seen as a one-layer main model's."""

    def __init__(self, source: TensorSource, prefix: str):
        self._source, self._names = source, {}
        for name in source.names():
            rest = name.removeprefix(prefix)
            if rest in (name, PROJ) or rest in OWN:
                continue
            self._names[RENAMED.get(rest, "model.layers.0." + rest)] = name

    def names(self) -> set[str]:
        return set(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source.shape(self._names[name])

    def read(self, name: str) -> np.ndarray:
        return self._source.read(self._names[name])


def _read(source: TensorSource, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if source.shape(name) != shape:
        raise ValueError(
            f"tensor {name} has shape {source.shape(name)}, but this config.json needs {shape}"
        )
    array = source.read(name)
    if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
        raise ValueError(f"tensor {name} has dtype {array.dtype}; MTP weights are floating point")
    return array


def _shared(model: Transformer, mtp: MTP) -> MTP:
    """The module's token table and head replaced by the model's own arrays where equal."""
    body = mtp.body
    pairs = [(lambda b: b.embed.weight, model.embed.weight)]
    if body.lm_head is not None and model.lm_head is not None:
        pairs.append((lambda b: b.lm_head.weight, model.lm_head.weight))
    for where, ours in pairs:
        theirs = where(body)
        if theirs.shape == ours.shape and bool(jax.numpy.array_equal(theirs, ours)):
            body = eqx.tree_at(where, body, ours)
    return eqx.tree_at(lambda m: m.body, mtp, body)


def load_checkpoint_mtp(
    source: TensorSource,
    arch: Architecture,
    model: Transformer,
    hf: dict,
    *,
    policy: Policy,
    placement: Placement,
    strict: bool = False,
    share_tables: bool = True,
) -> Transformer:
    """`model` with its checkpoint's first MTP module (`model.mtp`), or as it is when the
    config.json declares none (`num_nextn_predict_layers` 0 or absent) or the checkpoint holds
    none (converted checkpoints often drop them); a module whose layer lacks tensors or holds
    unknown ones is left out with a warning naming them (the causal LM does not need it), or
    with `strict` (a file of the module alone: zoo/pretrained/mtp_file.py) refused.
    `share_tables`: the module's token table and head become the model's own arrays where
    equal (False: the caller puts the model's there)."""
    config, prefix = model.config, layer_prefix(model.config)
    if not hf.get("num_nextn_predict_layers") or prefix + PROJ not in source.names():
        if strict:
            raise ValueError(f"the file holds no MTP module (no tensor {prefix + PROJ})")
        return model
    try:
        body = load_weights(
            _BodyView(source, prefix), arch, body_config(config), policy=policy,
            placement=placement,
        )  # fmt: skip
    except ValueError as error:  # the causal LM is whole: it loads, said without its MTP module
        if strict:
            raise ValueError(f"the MTP module's tensors do not load: {error}") from error
        warnings.warn(
            f"the checkpoint's multi-token-prediction module (its tensors {prefix}*) does not "
            f"load ({error}); the model is loaded without it (model.mtp is None)",
            stacklevel=3,
        )
        return model
    skeleton = eqx.filter_eval_shape(MTP, config, policy=body.policy, key=jax.random.key(0))
    shardings = placement.param_shardings(skeleton)
    d = config.d_model
    arrays = {path: _read(source, prefix + name, (d,)) for name, path in OWN.items()}
    arrays["proj.weight"] = _read(source, prefix + PROJ, (d, 2 * d)).T  # torch's [out, in]
    paths = list(arrays)
    placed = [
        place(arrays[p], leaf(skeleton, p), None if shardings is None else leaf(shardings, p))
        for p in paths
    ]
    mtp = eqx.tree_at(lambda m: [leaf(m, p) for p in paths], skeleton, placed)
    mtp = eqx.tree_at(lambda m: m.body, mtp, body)
    return model.with_mtp(_shared(model, mtp) if share_tables else mtp)


def mtp_tensors(mtp: MTP, config: Config, body: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The module's tensors under their HF names as `save_pretrained` writes them: its own, and
    its body's (`body`: the one-layer body's tensors in the main layout) renamed into its
    layer."""
    prefix = layer_prefix(config)
    back = {ours: theirs for theirs, ours in RENAMED.items()}
    tensors = {prefix + name: np.asarray(leaf(mtp, path)) for name, path in OWN.items()}
    tensors[prefix + PROJ] = np.ascontiguousarray(np.asarray(mtp.proj.weight).T)
    for name, array in body.items():
        tensors[prefix + back.get(name, name.removeprefix("model.layers.0."))] = array
    return tensors
