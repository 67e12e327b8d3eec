"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, arXiv 2412.19437) in HF layout, as transformers 5
computes it: multi-head latent attention (layers/mla.py) with interleaved rotary dims, YaRN rope,
`first_k_dense_replace` dense SwiGLU layers, then MoE layers of `n_routed_experts` experts
(`num_experts_per_tok` per token) routed by sigmoid scores with the `e_score_correction_bias`
(selection only) and group-limited top-k (`n_group`, `topk_group`), plus one shared SwiGLU of
width `n_shared_experts * moe_intermediate_size`.

Multi-token prediction (`num_nextn_predict_layers` > 0) is not part of the causal LM: real
checkpoints store its modules as layers past `num_hidden_layers`, which the causal LM's layout
ignores (as transformers does); zoo/pretrained/deepseek_mtp.py reads the first as `model.mtp`,
and `save_pretrained` writes it back (`num_nextn_predict_layers: 1`) or, without one, 0.

Experts are read per expert (`mlp.experts.E.{gate,up,down}_proj.weight`, what checkpoints and
transformers' `save_pretrained` hold) or fused (`mlp.experts.gate_up_proj` `[experts, 2 * mlp,
embed]` and `mlp.experts.down_proj`, transformers' in-memory layout); written per expert.
"""

import numpy as np

from zoo.config import Config
from zoo.pretrained.field_map import sizes_from_hf, sizes_to_hf
from zoo.pretrained.rope import rope_from_hf, rope_to_hf
from zoo.pretrained.tensor_map import TensorGroup, embedding, linear, same

READS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "rope_interleave",
    "tie_word_embeddings",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "qk_head_dim",
    "head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
    # Multi-token prediction modules: not part of the causal LM (ignored, see above).
    "num_nextn_predict_layers",
    "num_mtp_layers",
    # DeepSeek's own config.json: expert-parallel size and the training-time sequence aux loss
    # leave the forward alone.
    "ep_size",
    "aux_loss_alpha",
    "seq_aux",
)
# DeepSeek's own config.json names V3's routing; other values are other models.
ONLY = {
    "hidden_act": "silu",
    "attention_bias": False,
    "pretraining_tp": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}


HOLDS = frozenset(
    {"rope_theta", "rope_scaling", "mla_kv_rank", "mla_q_rank", "mla_rope_dim", "mla_v_head_dim",
     "mla_rope_interleave", "n_experts", "n_experts_per_token", "n_shared_experts", "moe_d_ff",
     "first_dense_layers", "router_scoring", "router_normalize", "router_scale", "router_bias",
     "router_groups", "router_topk_groups", "router_group_score"}
)  # fmt: skip


def mla_config(hf: dict, arch: str) -> Config:
    """The Config of a DeepSeek-V2/V3 config.json up to its routing: MLA, rope, sizes, and the
    dense layers (`n_experts=0`; `moe_fields` adds the MoE layers)."""
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise ValueError(
            f"{arch} num_key_value_heads={hf['num_key_value_heads']} differs from "
            f"num_attention_heads={heads}; MLA expands every head from the latent (transformers "
            "would repeat the keys into the wrong shape)"
        )
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    for name, expected in (("qk_head_dim", nope + rope), ("head_dim", rope)):
        if hf.get(name, expected) != expected:
            raise ValueError(
                f"{arch} {name}={hf[name]} contradicts qk_nope_head_dim={nope} and "
                f"qk_rope_head_dim={rope} (transformers derives {name}={expected})"
            )
    if hf.get("n_shared_experts", 1) < 1:
        raise ValueError(f"{arch} n_shared_experts must be >= 1 (every MoE layer has one)")
    theta, scaling = rope_from_hf(hf, arch, ("yarn",))
    # MLA: every head has its own keys and values (no GQA), q/k heads nope + rope wide.
    sizes = sizes_from_hf(hf) | {"n_kv_heads": heads, "head_dim": nope + rope}
    return Config(
        **sizes,
        norm="rmsnorm",
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        mlp="swiglu",
        mla_kv_rank=hf["kv_lora_rank"],
        mla_q_rank=hf.get("q_lora_rank"),
        mla_rope_dim=rope,
        mla_v_head_dim=v,
        mla_rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def moe_fields(hf: dict, default_first_dense: int) -> dict | None:
    """The experts' Config fields (routing aside), None when every layer is dense."""
    first_dense = hf.get("first_k_dense_replace", default_first_dense)
    if first_dense >= hf["num_hidden_layers"]:
        return None
    return {
        "n_experts": hf.get("n_routed_experts", hf.get("num_local_experts")),
        "n_experts_per_token": hf["num_experts_per_tok"],
        "n_shared_experts": hf.get("n_shared_experts", 1),
        "moe_d_ff": hf["moe_intermediate_size"],
        "first_dense_layers": first_dense,
        "router_scale": float(hf.get("routed_scaling_factor", 1.0)),
    }


def config_from_hf(hf: dict) -> Config:
    config, moe = mla_config(hf, "DeepseekV3"), moe_fields(hf, 3)
    if moe is None:
        return config
    return config.replace(
        **moe,
        router_scoring="sigmoid",
        router_normalize=bool(hf.get("norm_topk_prob", True)),
        router_bias=True,
        router_groups=hf.get("n_group") or 1,
        router_topk_groups=hf.get("topk_group") or 1,
    )


def config_to_hf(config: Config) -> dict:
    c = config
    rope = rope_to_hf(c.rope_theta, c.rope_scaling)
    moe = c.n_experts > 0
    sizes = {k: v for k, v in sizes_to_hf(c).items() if k != "head_dim"}  # MLA: qk_*_head_dim
    return {
        "model_type": "deepseek_v3",
        **sizes,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_parameters": rope,
        "rope_interleave": c.mla_rope_interleave,
        "kv_lora_rank": c.mla_kv_rank,
        "q_lora_rank": c.mla_q_rank,
        "qk_rope_head_dim": c.mla_rope_dim,
        "qk_nope_head_dim": c.head_dim - c.mla_rope_dim,
        "v_head_dim": c.mla_v_head_dim,
        "first_k_dense_replace": c.first_dense_layers if moe else c.n_layers,
        "n_routed_experts": c.n_experts if moe else 1,
        "num_experts_per_tok": c.n_experts_per_token if moe else 1,
        "n_shared_experts": c.n_shared_experts if moe else 1,
        "moe_intermediate_size": c.expert_d_ff,
        "n_group": c.router_groups if moe else 1,
        "topk_group": c.router_topk_groups if moe else 1,
        "norm_topk_prob": c.router_normalize,
        "routed_scaling_factor": c.router_scale,
        "num_nextn_predict_layers": 0,
        "output_router_logits": False,
    }


def exports(config: Config) -> bool:
    """Whether DeepSeek-V3's layout takes the values of the fields it holds: MLA with YaRN (or
    no) rope scaling, and MoE layers (if any) after the dense ones, each with shared experts,
    biased sigmoid routing."""
    c = config
    yarn = c.rope_scaling is None or c.rope_scaling.kind == "yarn"
    return (
        c.mla
        and yarn
        and (
            c.n_experts == 0
            or (
                c.n_shared_experts >= 1
                and c.router_scoring == "sigmoid"
                and c.router_bias
                and (c.router_groups == 1 or c.router_group_score == "top2")
            )
        )
    )


def _per_expert(c: Config, layers: tuple[int, ...]) -> TensorGroup:
    n, d, f = c.n_experts, c.d_model, c.expert_d_ff
    m = "model.layers.{i}.mlp.experts."
    names = [tuple(f"{m}{e}.{w}_proj.weight" for e in range(n)) for w in ("gate", "up", "down")]

    def to_zoo(*ws):
        gate, up, down = (np.stack(ws[k * n : (k + 1) * n]) for k in range(3))
        return gate.transpose(0, 2, 1), up.transpose(0, 2, 1), down.transpose(0, 2, 1)

    def to_hf(gate, up, down):
        return tuple(w[e].T for w in (gate, up, down) for e in range(n))

    return TensorGroup(
        ("blocks.mlp.experts.gate", "blocks.mlp.experts.up", "blocks.mlp.experts.down"),
        sum(names, ()),
        ((f, d),) * (2 * n) + ((d, f),) * n,
        to_zoo,
        to_hf,
        layers,
    )


def _fused(c: Config, layers: tuple[int, ...]) -> TensorGroup:
    n, d, f = c.n_experts, c.d_model, c.expert_d_ff

    def to_zoo(gate_up, down):
        up = gate_up[:, f:].transpose(0, 2, 1)
        return gate_up[:, :f].transpose(0, 2, 1), up, down.transpose(0, 2, 1)

    def to_hf(gate, up, down):
        return np.concatenate([gate, up], axis=-1).transpose(0, 2, 1), down.transpose(0, 2, 1)

    m = "model.layers.{i}.mlp.experts."
    return TensorGroup(
        ("blocks.mlp.experts.gate", "blocks.mlp.experts.up", "blocks.mlp.experts.down"),
        (f"{m}gate_up_proj", f"{m}down_proj"),
        ((n, 2 * f, d), (n, d, f)),
        to_zoo,
        to_hf,
        layers,
    )


def _groups(c: Config, fused: bool) -> list[TensorGroup]:
    d, h = c.d_model, c.n_heads
    rank, rope, v = c.mla_kv_rank, c.mla_rope_dim, c.mla_v_head_dim
    a, p = "model.layers.{i}.self_attn.", "blocks.attn."
    projections = [
        (p + "kv_a_proj", a + "kv_a_proj_with_mqa", (d,), (rank + rope,)),
        (p + "kv_b_proj", a + "kv_b_proj", (rank,), (h, c.head_dim - rope + v)),
        (p + "o_proj", a + "o_proj", (h, v), (d,)),
    ]
    if c.mla_q_rank is None:
        projections.append((p + "q_proj", a + "q_proj", (d,), (h, c.head_dim)))
    else:
        projections += [
            (p + "q_a_proj", a + "q_a_proj", (d,), (c.mla_q_rank,)),
            (p + "q_b_proj", a + "q_b_proj", (c.mla_q_rank,), (h, c.head_dim)),
        ]
    groups = [
        embedding("embed.weight", "model.embed_tokens.weight", (c.vocab_size, d)),
        same("blocks.attn_norm.scale", "model.layers.{i}.input_layernorm.weight", (d,)),
        same("blocks.mlp_norm.scale", "model.layers.{i}.post_attention_layernorm.weight", (d,)),
        same(p + "kv_a_norm.scale", a + "kv_a_layernorm.weight", (rank,)),
        same("final_norm.scale", "model.norm.weight", (d,)),
        *(linear(f"{ours}.weight", f"{theirs}.weight", i, o) for ours, theirs, i, o in projections),
    ]
    if c.mla_q_rank is not None:
        groups.append(same(p + "q_a_norm.scale", a + "q_a_layernorm.weight", (c.mla_q_rank,)))
    if not c.tie_embeddings:
        groups.append(linear("lm_head.weight", "lm_head.weight", (d,), (c.vocab_size,)))
    dense, moe = tuple(range(c.n_layers - len(c.moe_layers))), c.moe_layers
    mlp, m = "model.layers.{i}.mlp.", "blocks.mlp."
    shared_width = c.n_shared_experts * c.expert_d_ff
    for ours, theirs, f, layers in [
        (m, mlp, c.d_ff, dense),
        (m + "shared.", mlp + "shared_experts.", shared_width, moe),
    ]:
        for name, in_dim, out_dim in (("gate", d, f), ("up", d, f), ("down", f, d)):
            hf_name = f"{theirs}{name}_proj.weight"
            group = linear(f"{ours}{name}.weight", hf_name, (in_dim,), (out_dim,))
            groups += [_only(group, layers)] if layers else []
    if moe:
        router = linear(m + "router.weight", mlp + "gate.weight", (d,), (c.n_experts,))
        groups.append(_only(router, moe))
        if c.router_bias:
            bias = same(m + "router.bias", mlp + "gate.e_score_correction_bias", (c.n_experts,))
            groups.append(_only(bias, moe))
        groups.append(_fused(c, moe) if fused else _per_expert(c, moe))
    return groups


def _only(group: TensorGroup, layers: tuple[int, ...]) -> TensorGroup:
    return TensorGroup(group.zoo, group.hf, group.hf_shapes, group.to_zoo, group.to_hf, layers)


def tensors(c: Config) -> list[TensorGroup]:
    """The per-expert layout (what `save_pretrained` writes)."""
    return _groups(c, fused=False)


def read_tensors(c: Config, names: set[str]) -> list[TensorGroup]:
    """Fused experts when any layer has `mlp.experts.gate_up_proj`, else per expert."""
    return _groups(c, fused=any(n.endswith(".mlp.experts.gate_up_proj") for n in names))


def _at_least(n: int) -> str:
    """A regular expression for the decimal integers >= n."""
    digits = len(str(n))
    exact = "|".join(str(k) for k in range(n, 10**digits))
    return f"(?:{exact}|[1-9]\\d{{{digits},}})"


def ignored(c: Config) -> tuple[str, ...]:
    """Multi-token-prediction modules (layers past the causal LM's) and old rotary buffers."""
    return (
        rf"model\.layers\.{_at_least(c.n_layers)}\..*",
        r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",
    )
