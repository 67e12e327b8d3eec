"""Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`, Yang et al. 2024, "Qwen2 Technical Report") in HF
layout: a Llama whose query, key and value projections carry biases (Config.qkv_bias; the output
projection and the MLP have none).

Sliding-window attention: HF's Qwen2 puts a window of `sliding_window` on the layers that
`layer_types` marks "sliding_attention", by default the layers from `max_window_layers` on when
`use_sliding_window` is true. The zoo runs one window for every layer, so a config whose window
covers every layer or none loads; one that mixes windowed and full layers is refused.
`layer_pattern` is shared with Qwen3 and Qwen3-MoE, which configure windows the same way.
"""

from zoo.config import Config
from zoo.pretrained import llama
from zoo.pretrained.tensor_map import TensorGroup

_WINDOW_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
READS = (*(f for f in llama.READS if f not in ("attention_bias", "mlp_bias")), *_WINDOW_FIELDS)
# Qwen2.5's config.json says use_mrope=false: multimodal rotary sections (Qwen2-VL) are not here.
ONLY = llama.ONLY | {"use_mrope": False}
HOLDS = llama.HOLDS - {"bias"} | {"qkv_bias", "sliding_window"}


def window(hf: dict, arch: str) -> int | None:
    """The one sliding window of every layer (None: full attention), from Qwen's fields as
    transformers reads them; a mix of windowed and full layers is an error."""
    n_layers = hf["num_hidden_layers"]
    size = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", n_layers)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n_layers:
        raise ValueError(
            f"{arch} layer_types={types} must list 'full_attention' or 'sliding_attention' for "
            f"each of the {n_layers} layers"
        )
    sliding = [t == "sliding_attention" for t in types]
    if size is None or not any(sliding):
        return None
    if not all(sliding):
        raise ValueError(
            f"{arch} config.json puts a sliding window of {size} on layers "
            f"{[i for i, s in enumerate(sliding) if s]} only (use_sliding_window with "
            "max_window_layers or layer_types); the zoo runs one window for all layers or none"
        )
    return size


def window_to_hf(config: Config) -> dict:
    """Qwen's window fields for one window on every layer (or none)."""
    windowed = config.sliding_window is not None
    kind = "sliding_attention" if windowed else "full_attention"
    return {
        "use_sliding_window": windowed,
        "sliding_window": config.sliding_window,
        "max_window_layers": 0 if windowed else config.n_layers,
        "layer_types": [kind] * config.n_layers,
    }


def config_from_hf(hf: dict) -> Config:
    arch = "Qwen2ForCausalLM"
    return llama.config_from_hf(hf, arch).replace(qkv_bias=True, sliding_window=window(hf, arch))


def config_to_hf(config: Config) -> dict:
    hf = llama.config_to_hf(config)
    for field in ("attention_bias", "mlp_bias"):
        del hf[field]
    return hf | {"model_type": "qwen2"} | window_to_hf(config)


def exports(config: Config) -> bool:
    """Whether Qwen2's layout takes the values of the fields it holds: a Llama with q/k/v
    biases (and optionally one window on every layer)."""
    return llama.exports(config) and config.qkv_bias


def tensors(c: Config) -> list[TensorGroup]:
    return llama.tensors(c)


def ignored(c: Config) -> tuple[str, ...]:
    return llama.ignored(c)
