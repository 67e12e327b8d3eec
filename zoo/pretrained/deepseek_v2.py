"""DeepSeek-V2 (`DeepseekV2ForCausalLM`, arXiv 2405.04434) in HF layout, as transformers 5
computes it: DeepSeek-V3's layout (zoo/pretrained/deepseek.py: MLA, YaRN, dense first layers,
shared experts) with V2's routing: softmax over the experts, top-k by `topk_method` ("greedy", or
"group_limited_greedy": only the `topk_group` best of `n_group` groups, a group scored by its
best expert), gates never renormalised (transformers ignores `norm_topk_prob`, so only false is
read) times `routed_scaling_factor`, no balancing bias. The rotary dims are interleaved pairs."""

from zoo.config import Config
from zoo.pretrained import deepseek
from zoo.pretrained.tensor_map import TensorGroup

_V3_ONLY = {"rope_interleave", "num_nextn_predict_layers", "num_mtp_layers", "norm_topk_prob"}
READS = (*(f for f in deepseek.READS if f not in _V3_ONLY), "topk_method")
ONLY = {
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "moe_layer_freq": 1,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
}
_METHODS = ("greedy", "group_limited_greedy")
HOLDS = deepseek.HOLDS


def config_from_hf(hf: dict) -> Config:
    config, moe = deepseek.mla_config(hf, "DeepseekV2"), deepseek.moe_fields(hf, 0)
    if moe is None:
        return config
    method = hf.get("topk_method", "greedy")
    if method not in _METHODS:
        raise ValueError(f"DeepseekV2 topk_method={method!r} is not supported; known: {_METHODS}")
    limited = method == "group_limited_greedy"
    return config.replace(
        **moe,
        router_scoring="softmax",
        router_normalize=False,
        router_groups=hf["n_group"] if limited else 1,
        router_topk_groups=hf["topk_group"] if limited else 1,
        router_group_score="max",
    )


def config_to_hf(config: Config) -> dict:
    hf = {k: v for k, v in deepseek.config_to_hf(config).items() if k not in _V3_ONLY}
    limited = config.router_groups > 1
    return hf | {
        "model_type": "deepseek_v2",
        "mlp_bias": False,
        "norm_topk_prob": False,
        "topk_method": "group_limited_greedy" if limited else "greedy",
        "n_group": config.router_groups if limited else None,
        "topk_group": config.router_topk_groups if limited else None,
    }


def exports(config: Config) -> bool:
    """Whether DeepSeek-V2's layout takes the values of the fields it holds: MLA with
    interleaved rotary dims, MoE layers after the dense ones with shared experts and V2's
    routing."""
    c = config
    return (
        c.mla
        and c.mla_rope_interleave
        and (c.rope_scaling is None or c.rope_scaling.kind == "yarn")
        and c.n_experts > 0
        and c.n_shared_experts >= 1
        and c.router_scoring == "softmax"
        and not c.router_bias
        and not c.router_normalize
        and (c.router_groups == 1 or c.router_group_score == "max")
    )


def tensors(c: Config) -> list[TensorGroup]:
    return deepseek.tensors(c)


def read_tensors(c: Config, names: set[str]) -> list[TensorGroup]:
    return deepseek.read_tensors(c, names)


def ignored(c: Config) -> tuple[str, ...]:
    """Old rotary buffers (V2 has no multi-token-prediction layers: extra layers are errors)."""
    return (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
