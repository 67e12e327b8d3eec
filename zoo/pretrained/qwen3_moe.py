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

Dense layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step` > 1) are not read yet:
the released checkpoints have none, and such a config is refused.
"""

from zoo.config import Config
from zoo.pretrained import llama, mixtral, qwen3
from zoo.pretrained.tensor_map import TensorGroup

_MLP = "model.layers.{i}.mlp."
READS = (
    *qwen3.READS,
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
)
ONLY = qwen3.ONLY | {"decoder_sparse_step": 1, "mlp_only_layers": []}


def config_from_hf(hf: dict) -> Config:
    # transformers 5 writes num_local_experts; the released config.json files say num_experts.
    n_experts = hf.get("num_local_experts", hf.get("num_experts"))
    if not n_experts:
        raise ValueError(
            f"Qwen3MoeForCausalLM num_experts={n_experts!r}: a Qwen3-MoE needs experts "
            "(a dense Qwen3 is a Qwen3ForCausalLM)"
        )
    return qwen3.config_from_hf(hf).replace(
        n_experts=n_experts,
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
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def exports(config: Config) -> bool:
    """Whether Qwen3-MoE's layout holds this config exactly: Qwen3 attention, every layer an MoE
    of routed experts with softmax routing."""
    return (
        qwen3.exports(config.replace(n_experts=0))
        and config.n_experts > 0
        and config.n_shared_experts == 0
        and config.first_dense_layers == 0
        and config.moe_every == 1
        and config.router_scoring == "softmax"
    )


def tensors(c: Config) -> list[TensorGroup]:
    """The per-expert layout (the one `save_pretrained` writes)."""
    experts = mixtral.per_expert(c, _MLP, ("gate_proj", "up_proj", "down_proj"))
    return [*llama.tensors_around_mlp(c, mixtral.router(c, _MLP + "gate")), experts]


def read_tensors(c: Config, names: set[str]) -> list[TensorGroup]:
    """Fused when any layer has `mlp.experts.gate_up_proj`, else per expert."""
    if any(name.endswith(".mlp.experts.gate_up_proj") for name in names):
        return [*llama.tensors_around_mlp(c, mixtral.router(c, _MLP + "gate")), mixtral.fused(c)]
    return tensors(c)


def ignored(c: Config) -> tuple[str, ...]:
    return llama.ignored(c)
