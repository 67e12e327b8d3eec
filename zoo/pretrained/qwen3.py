"""Qwen3 (`Qwen3ForCausalLM`, Yang et al. 2025, "Qwen3 Technical Report") in HF layout: a Llama
with RMSNorm on each query and key head over head_dim before the rotary embedding (Config.qk_norm,
`self_attn.q_norm/k_norm.weight` of shape `[head_dim]`), a head_dim set apart from
hidden_size / num_attention_heads, and no biases. Windows are configured as in Qwen2."""

from zoo.config import Config
from zoo.pretrained import llama, qwen2
from zoo.pretrained.tensor_map import TensorGroup

READS = qwen2.READS
# attention_bias puts biases on q, k, v and o alone, which no Config holds (Config.bias also
# covers the MLP, qkv_bias leaves o out).
ONLY = qwen2.ONLY | {"attention_bias": False}
HOLDS = llama.HOLDS - {"bias"} | {"qk_norm", "sliding_window"}


def config_from_hf(hf: dict, arch: str = "Qwen3ForCausalLM") -> Config:
    """`arch`: the class name in messages (Qwen3-MoE reads its config through this one)."""
    window = qwen2.window(hf, arch)
    return llama.config_from_hf(hf, arch).replace(qk_norm=True, sliding_window=window)


def config_to_hf(config: Config) -> dict:
    hf = llama.config_to_hf(config)
    del hf["mlp_bias"]
    return hf | {"model_type": "qwen3"} | qwen2.window_to_hf(config)


def exports(config: Config) -> bool:
    """Whether Qwen3's layout takes the values of the fields it holds: a Llama with q/k norms
    (and optionally one window on every layer)."""
    return llama.exports(config) and config.qk_norm


def tensors(c: Config) -> list[TensorGroup]:
    return llama.tensors(c)


def ignored(c: Config) -> tuple[str, ...]:
    return llama.ignored(c)
