"""Qwen3-MoE (`Qwen3MoeForCausalLM`, Yang et al. 2025) in HF layout: Qwen3's attention (q/k
norms, head_dim apart from hidden/heads) with every MLP a mixture of `num_experts` SwiGLU experts
of width `moe_intermediate_size`, `num_experts_per_tok` per token, routed by a softmax over all
experts then top-k, renormalised iff `norm_topk_prob` (our Router `scoring="softmax"`,
`normalize`); no shared experts.

Experts come in two layouts, both read (as for Mixtral):
- per expert (downloaded checkpoints, transformers' `save_pretrained`):
  `model.layers.N.mlp.experts.E.gate_proj/up_proj/down_proj.weight` and the router
  `model.layers.N.mlp.gate.weight` `[experts, embed]`;
- fused (transformers >= 5's in-memory layout): `model.layers.N.mlp.experts.gate_up_proj`
  `[experts, 2 * mlp, embed]` and `...experts.down_proj` `[experts, embed, mlp]`.

Dense layers (`mlp.gate_proj/up_proj/down_proj` of width `intermediate_size`): HF makes layer i an
MoE layer iff i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0. That is
Config's `first_dense_layers` = k, `moe_every` = s exactly when `mlp_only_layers` is the first k
layers, s divides k and s divides the layers after them (no dense layers after the last MoE one);
other patterns are refused. The released checkpoints have k = 0, s = 1.
"""

import dataclasses

from zoo.config import Config
from zoo.pretrained import llama, mixtral, qwen3
from zoo.pretrained.tensor_map import TensorGroup, linear

_MLP = "model.layers.{i}.mlp."
READS = (
    *qwen3.READS,
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)
ONLY = qwen3.ONLY
HOLDS = qwen3.HOLDS | {
    "n_experts", "n_experts_per_token", "moe_d_ff", "moe_every", "first_dense_layers",
    "router_scoring", "router_normalize",
}  # fmt: skip


def _dense_layers(hf: dict) -> tuple[int, int]:
    """(first_dense_layers, moe_every) for HF's mlp_only_layers and decoder_sparse_step."""
    n_layers, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    only = sorted(hf.get("mlp_only_layers") or [])
    first = len(only)
    if step < 1 or only != list(range(first)) or first % step or (n_layers - first) % step:
        raise ValueError(
            f"Qwen3MoeForCausalLM mlp_only_layers={only}, decoder_sparse_step={step} with "
            f"{n_layers} layers: the zoo holds dense layers first, then groups of "
            "decoder_sparse_step layers ending in an MoE one; mlp_only_layers must be the first "
            "k layers, with decoder_sparse_step dividing k and the layers after them"
        )
    return first, step


def config_from_hf(hf: dict) -> Config:
    # transformers 5 writes num_local_experts; the released config.json files say num_experts.
    n_experts = hf.get("num_local_experts", hf.get("num_experts"))
    if not n_experts:
        raise ValueError(
            f"Qwen3MoeForCausalLM num_experts={n_experts!r}: a Qwen3-MoE needs experts "
            "(a dense Qwen3 is a Qwen3ForCausalLM)"
        )
    first_dense, moe_every = _dense_layers(hf)
    return qwen3.config_from_hf(hf, "Qwen3MoeForCausalLM").replace(
        n_experts=n_experts,
        first_dense_layers=first_dense,
        moe_every=moe_every,
        n_experts_per_token=hf["num_experts_per_tok"],
        moe_d_ff=hf["moe_intermediate_size"],
        router_scoring="softmax",
        router_normalize=bool(hf.get("norm_topk_prob", False)),
    )


def config_to_hf(config: Config) -> dict:
    return qwen3.config_to_hf(config) | {
        "model_type": "qwen3_moe",
        "num_experts": config.n_experts,
        "num_experts_per_tok": config.n_experts_per_token,
        "moe_intermediate_size": config.expert_d_ff,
        "norm_topk_prob": config.router_normalize,
        "decoder_sparse_step": config.moe_every,
        "mlp_only_layers": list(range(config.first_dense_layers)),
    }


def exports(config: Config) -> bool:
    """Whether Qwen3-MoE's layout takes the values of the fields it holds: Qwen3 attention, MoE
    layers of routed experts with softmax routing, dense ones where HF's rule puts them."""
    return (
        qwen3.exports(config)
        and config.n_experts > 0
        and config.first_dense_layers % config.moe_every == 0
        and config.router_scoring == "softmax"
    )


def _layers(c: Config, experts: TensorGroup) -> list[TensorGroup]:
    """Attention and norms in every layer; the router and `experts` in the MoE layers, a dense
    SwiGLU in the others."""
    d, f, moe = c.d_model, c.d_ff, c.moe_layers
    dense = tuple(i for i in range(c.n_layers) if i not in moe)
    mlp = [
        ("mlp.gate", "gate_proj", (d,), (f,)),
        ("mlp.up", "up_proj", (d,), (f,)),
        ("mlp.down", "down_proj", (f,), (d,)),
    ]
    dense_groups = [
        linear(f"blocks.{ours}.weight", f"{_MLP}{theirs}.weight", in_shape, out_shape)
        for ours, theirs, in_shape, out_shape in mlp
    ]
    router = linear("blocks.mlp.router.weight", _MLP + "gate.weight", (d,), (c.n_experts,))
    return [
        *llama.tensors_around_mlp(c, []),
        *(dataclasses.replace(g, only_layers=dense) for g in dense_groups if dense),
        *(dataclasses.replace(g, only_layers=moe) for g in (router, experts)),
    ]


def tensors(c: Config) -> list[TensorGroup]:
    """The per-expert layout (the one `save_pretrained` writes)."""
    return _layers(c, mixtral.per_expert(c, _MLP, ("gate_proj", "up_proj", "down_proj")))


def read_tensors(c: Config, names: set[str]) -> list[TensorGroup]:
    """Fused when any layer has `mlp.experts.gate_up_proj`, else per expert."""
    if any(name.endswith(".mlp.experts.gate_up_proj") for name in names):
        return _layers(c, mixtral.fused(c))
    return tensors(c)


def ignored(c: Config) -> tuple[str, ...]:
    return llama.ignored(c)
