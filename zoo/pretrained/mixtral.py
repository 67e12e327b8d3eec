"""Mixtral (`MixtralForCausalLM`, Jiang et al. 2024, "Mixtral of Experts") in HF layout: a Llama
whose every MLP is a mixture of `num_local_experts` SwiGLU experts, `num_experts_per_tok` per
token, routed by softmax over all experts, then top-k, then renormalised (our Router with
`scoring="softmax", normalize=True`). Optional sliding-window attention.

Checkpoints come in two layouts, both read:
- per expert (what downloaded checkpoints and transformers' `save_pretrained` hold):
  `model.layers.N.block_sparse_moe.experts.E.w1/w2/w3.weight` (`[mlp, embed]`, `[embed, mlp]`,
  `[mlp, embed]`) and the router `model.layers.N.block_sparse_moe.gate.weight` `[experts, embed]`;
- fused (transformers >= 5's in-memory layout, written by saving its state dict directly):
  `model.layers.N.mlp.experts.gate_up_proj` `[experts, 2 * mlp, embed]` (gate rows first),
  `model.layers.N.mlp.experts.down_proj` `[experts, embed, mlp]` and the router
  `model.layers.N.mlp.gate.weight`.
Ours: gate = w1ᵀ, up = w3ᵀ (`[experts, embed, mlp]`), down = w2ᵀ (`[experts, mlp, embed]`),
router `[embed, experts]` = gate.weightᵀ. `save_pretrained` writes the per-expert layout.
"""

import numpy as np

from zoo.config import Config
from zoo.pretrained import llama
from zoo.pretrained.tensor_map import TensorGroup

_PER_EXPERT = "model.layers.{i}.block_sparse_moe."
_FUSED = "model.layers.{i}.mlp."
_GATE, _UP, _DOWN = "blocks.mlp.experts.gate", "blocks.mlp.experts.up", "blocks.mlp.experts.down"

READS = (
    *(f for f in llama.READS if f not in ("attention_bias", "mlp_bias")),
    "num_local_experts",
    "num_experts_per_tok",
    "sliding_window",
)
# Router noise during training (Mixtral's jitter) is not implemented.
ONLY = {"router_jitter_noise": 0.0}
HOLDS = llama.HOLDS - {"bias"} | {
    "sliding_window", "n_experts", "n_experts_per_token", "moe_d_ff", "router_scoring",
    "router_normalize",
}  # fmt: skip


def config_from_hf(hf: dict) -> Config:
    return llama.config_from_hf(hf, "MixtralForCausalLM").replace(
        n_experts=hf["num_local_experts"],
        n_experts_per_token=hf["num_experts_per_tok"],
        router_scoring="softmax",
        router_normalize=True,
        # null in most Mixtral configs: full causal attention.
        sliding_window=hf.get("sliding_window"),
    )


def config_to_hf(config: Config) -> dict:
    hf = llama.config_to_hf(config)
    for field in ("attention_bias", "mlp_bias"):
        del hf[field]
    return hf | {
        "model_type": "mixtral",
        "intermediate_size": config.expert_d_ff,
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.n_experts_per_token,
        "sliding_window": config.sliding_window,
        "output_router_logits": False,
    }


def exports(config: Config) -> bool:
    """Whether Mixtral's layout takes the values of the fields it holds: every layer an MoE of
    routed experts, softmax routing with renormalised top-k."""
    return (
        llama.exports(config)
        and config.n_experts > 0
        and config.router_scoring == "softmax"
        and config.router_normalize
    )


def _router(c: Config, hf: str) -> list:
    return [("mlp.router", hf, (c.d_model,), (c.n_experts,))]


def per_expert(
    c: Config, prefix: str = _PER_EXPERT, names: tuple[str, str, str] = ("w1", "w3", "w2")
) -> TensorGroup:
    """Three HF tensors per expert (gate, up, down: `prefix + experts.E.<name>.weight`) <-> our
    three stacked expert weights. Qwen3-MoE stores them the same way under other names."""
    n, d, f = c.n_experts, c.d_model, c.expert_d_ff
    hf = [tuple(f"{prefix}experts.{e}.{w}.weight" for e in range(n)) for w in names]

    def to_zoo(*ws):
        w1, w3, w2 = (np.stack(ws[k * n : (k + 1) * n]) for k in range(3))
        return w1.transpose(0, 2, 1), w3.transpose(0, 2, 1), w2.transpose(0, 2, 1)

    def to_hf(gate, up, down):
        return tuple(w[e].T for w in (gate, up, down) for e in range(n))

    return TensorGroup(
        (_GATE, _UP, _DOWN),
        sum(hf, ()),
        ((f, d),) * (2 * n) + ((d, f),) * n,
        to_zoo,
        to_hf,
    )


def fused(c: Config) -> TensorGroup:
    """transformers' stacked `gate_up_proj` and `down_proj` <-> our three expert weights (the
    same names and layout in Qwen3-MoE)."""
    n, d, f = c.n_experts, c.d_model, c.expert_d_ff

    def to_zoo(gate_up, down):
        return (
            gate_up[:, :f].transpose(0, 2, 1),
            gate_up[:, f:].transpose(0, 2, 1),
            down.transpose(0, 2, 1),
        )

    def to_hf(gate, up, down):
        gate_up = np.concatenate([gate, up], axis=-1).transpose(0, 2, 1)
        return gate_up, down.transpose(0, 2, 1)

    return TensorGroup(
        (_GATE, _UP, _DOWN),
        (f"{_FUSED}experts.gate_up_proj", f"{_FUSED}experts.down_proj"),
        ((n, 2 * f, d), (n, d, f)),
        to_zoo,
        to_hf,
    )


def tensors(c: Config) -> list[TensorGroup]:
    """The per-expert layout (the one `save_pretrained` writes)."""
    return [*llama.tensors_around_mlp(c, _router(c, _PER_EXPERT + "gate")), per_expert(c)]


def read_tensors(c: Config, names: set[str]) -> list[TensorGroup]:
    """The layout that a checkpoint holding tensors `names` uses: fused when any layer has
    `mlp.experts.gate_up_proj`, else per expert (so a partly missing checkpoint of either
    layout is reported against its own layout's names)."""
    if any(name.endswith(".mlp.experts.gate_up_proj") for name in names):
        return [*llama.tensors_around_mlp(c, _router(c, _FUSED + "gate")), fused(c)]
    return tensors(c)


def ignored(c: Config) -> tuple[str, ...]:
    return llama.ignored(c)
