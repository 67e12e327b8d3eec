"""Gemma 2 (`Gemma2ForCausalLM`, Gemma Team 2024) and Gemma 3 text (`Gemma3ForCausalLM`, model
type "gemma3_text", Gemma Team 2025) in HF layout.

Both: GQA with a head_dim of its own, scores scaled by query_pre_attn_scalar^-1/2, sandwich norms
(`input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
`post_feedforward_layernorm`), RMSNorms that scale by (1 + weight), GeGLU (gelu-tanh gate),
embeddings times sqrt(hidden_size), sliding-window layers between global ones (`layer_types`,
or the older `sliding_window_pattern`: every n-th layer global). Gemma 2 soft-caps attention
scores and logits and has one rotary theta; Gemma 3 adds per-head q/k RMSNorms and gives the
sliding layers their own theta (`rope_local_base_freq`, or `rope_parameters["sliding_attention"]`
in transformers >= 5), the global ones optionally a linear rope scaling.

Weights map one to one (norm weights stay offsets from 1: our RMSNorm has `plus_one`).
"""

import types

from zoo.config import Config
from zoo.pretrained.field_map import sizes_from_hf, sizes_to_hf
from zoo.pretrained.rope import rope_from_hf, rope_to_hf, scaling_from_hf
from zoo.pretrained.tensor_map import TensorGroup, embedding, linear, same

_COMMON_READS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "hidden_activation",
    "hidden_act",
    "tie_word_embeddings",
    "query_pre_attn_scalar",
    "sliding_window",
    "sliding_window_size",
    "layer_types",
    "sliding_window_pattern",
    "_sliding_window_pattern",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "use_bidirectional_attention",
    # The generation cache class HF picks ("hybrid"): no effect on the weights' math.
    "cache_implementation",
)
# Biases on the projections are not implemented.
ONLY = {"attention_bias": False}
HOLDS_GEMMA2 = frozenset(
    {"rope_theta", "rope_scaling", "norm_plus_one", "mlp", "sandwich_norm", "embed_scale",
     "query_scale", "attn_softcap", "final_softcap", "sliding_window", "layer_types"}
)  # fmt: skip
HOLDS_GEMMA3 = HOLDS_GEMMA2 | {"qk_norm", "local_rope_theta"}
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
_HF_LAYER_TYPES = {v: k for k, v in _LAYER_TYPES.items()}


def _layer_types(hf: dict, arch: str, default_period: int) -> tuple[str, ...]:
    """Per-layer "full"/"sliding": `layer_types`, else every `sliding_window_pattern`-th layer
    global (HF's rule: layer i is global iff (i + 1) % pattern == 0)."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types") is not None:
        names = hf["layer_types"]
        unknown = sorted(set(names) - set(_LAYER_TYPES))
        if unknown or len(names) != n:
            raise ValueError(
                f"{arch} layer_types must list {n} of {sorted(_LAYER_TYPES)}, got {names}"
            )
        return tuple(_LAYER_TYPES[t] for t in names)
    period = int(
        hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default_period
    )
    return tuple("full" if (i + 1) % period == 0 else "sliding" for i in range(n))


def _check_common(hf: dict, arch: str) -> None:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(
            f"{arch} hidden_activation={act!r} is not supported; only 'gelu_pytorch_tanh' (GeGLU)"
        )
    size = hf.get("sliding_window_size")
    if size is not None and size != hf.get("sliding_window"):
        raise ValueError(
            f"{arch} sliding_window_size={size} differs from sliding_window="
            f"{hf.get('sliding_window')}; the older field must repeat the window"
        )
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            f"{arch} use_bidirectional_attention=True is not implemented (the zoo's Gemma is a "
            "causal decoder); use a checkpoint with use_bidirectional_attention=false"
        )


def _config(hf: dict, arch: str, layer_types: tuple[str, ...], **fields) -> Config:
    sizes = sizes_from_hf(hf, tie_embeddings=True)
    query = float(hf.get("query_pre_attn_scalar", sizes["head_dim"]))
    windowed = "sliding" in layer_types
    return Config(
        **sizes,
        norm="rmsnorm",
        norm_plus_one=True,
        position="rope",
        mlp="geglu",
        sandwich_norm=True,
        embed_scale=True,
        query_scale=None if query == sizes["head_dim"] else query,
        attn_softcap=hf.get("attn_logit_softcapping"),
        final_softcap=hf.get("final_logit_softcapping"),
        sliding_window=hf.get("sliding_window") if windowed else None,
        layer_types=layer_types,
        **fields,
    )


def gemma2_config_from_hf(hf: dict) -> Config:
    arch = "Gemma2ForCausalLM"
    _check_common(hf, arch)
    theta, scaling = rope_from_hf(hf, arch, ("linear",))
    return _config(
        hf, arch, _layer_types(hf, arch, 2), rope_theta=theta, rope_scaling=scaling
    )  # fmt: skip


def gemma3_config_from_hf(hf: dict) -> Config:
    """Rotary settings from either layout: transformers >= 5 nests them per layer type
    (`rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}`); older configs
    have `rope_theta`, `rope_local_base_freq` and `rope_scaling` (the global layers') on top."""
    arch = "Gemma3ForCausalLM"
    _check_common(hf, arch)
    params = hf.get("rope_parameters") or {}
    if params and not set(params) <= set(_LAYER_TYPES):
        raise ValueError(
            f"{arch} rope_parameters must be keyed by layer type {sorted(_LAYER_TYPES)}, got "
            f"{sorted(params)}"
        )
    # A legacy rope_scaling wins over rope_parameters, as in transformers.
    full = dict(hf.get("rope_scaling") or params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if scaling_from_hf(local, arch, ("linear",)) is not None:
        raise ValueError(f"{arch}: rope scaling on the sliding layers is not implemented")
    return _config(
        hf, arch, _layer_types(hf, arch, 6),
        qk_norm=True,
        rope_theta=float(full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))),
        rope_scaling=scaling_from_hf(full, arch, ("linear",)),
        local_rope_theta=float(local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0))),
    )  # fmt: skip


def _common_to_hf(c: Config) -> dict:
    types_ = c.layer_types or tuple("full" if w is None else "sliding" for w in c.layer_windows)
    return {
        **sizes_to_hf(c),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        # An int in HF's config class.
        "query_pre_attn_scalar": c.head_dim if c.query_scale is None else int(c.query_scale),
        "sliding_window": c.sliding_window,
        "layer_types": [_HF_LAYER_TYPES[t] for t in types_],
        "attn_logit_softcapping": c.attn_softcap,
        "final_logit_softcapping": c.final_softcap,
    }


def gemma2_config_to_hf(c: Config) -> dict:
    rope = rope_to_hf(c.rope_theta, c.rope_scaling)
    return _common_to_hf(c) | {"model_type": "gemma2", "rope_parameters": rope}


def gemma3_config_to_hf(c: Config) -> dict:
    rope = {
        "full_attention": rope_to_hf(c.rope_theta, c.rope_scaling),
        "sliding_attention": rope_to_hf(c.local_rope_theta, None),
    }
    return _common_to_hf(c) | {
        "model_type": "gemma3_text",
        "rope_parameters": rope,
        "use_bidirectional_attention": False,
    }


def _gemma_layout(c: Config) -> bool:
    """The values of the fields both Gemmas hold (`HOLDS_GEMMA2`)."""
    return (
        c.norm_plus_one
        and c.mlp == "geglu"
        and c.sandwich_norm
        and c.embed_scale
        and (c.rope_scaling is None or c.rope_scaling.kind == "linear")
        and (c.query_scale is None or float(c.query_scale).is_integer())
    )


def gemma2_exports(c: Config) -> bool:
    return _gemma_layout(c)


def gemma3_exports(c: Config) -> bool:
    return _gemma_layout(c) and c.qk_norm and c.local_rope_theta is not None


def tensors(c: Config) -> list[TensorGroup]:
    d, f = c.d_model, c.d_ff
    q, kv = (c.n_heads, c.head_dim), (c.n_kv_heads, c.head_dim)
    a, m, layer = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp.", "model.layers.{i}."
    projections = [
        ("attn.q_proj", a + "q_proj", (d,), q),
        ("attn.k_proj", a + "k_proj", (d,), kv),
        ("attn.v_proj", a + "v_proj", (d,), kv),
        ("attn.o_proj", a + "o_proj", q, (d,)),
        ("mlp.gate", m + "gate_proj", (d,), (f,)),
        ("mlp.up", m + "up_proj", (d,), (f,)),
        ("mlp.down", m + "down_proj", (f,), (d,)),
    ]
    norms = {
        "attn_norm": "input_layernorm",
        "post_attn_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
    }
    groups = [
        embedding("embed.weight", "model.embed_tokens.weight", (c.vocab_size, d)),
        same("final_norm.scale", "model.norm.weight", (d,)),
    ]
    for ours, theirs in norms.items():
        groups.append(same(f"blocks.{ours}.scale", f"{layer}{theirs}.weight", (d,)))
    if c.qk_norm:
        for name in ("q_norm", "k_norm"):
            groups.append(same(f"blocks.attn.{name}.scale", f"{a}{name}.weight", (c.head_dim,)))
    for ours, theirs, in_shape, out_shape in projections:
        groups.append(linear(f"blocks.{ours}.weight", f"{theirs}.weight", in_shape, out_shape))
    if not c.tie_embeddings:
        groups.append(linear("lm_head.weight", "lm_head.weight", (d,), (c.vocab_size,)))
    return groups


def ignored(c: Config) -> tuple[str, ...]:
    """Tied checkpoints that repeat the embedding as lm_head."""
    return ("lm_head.weight",) if c.tie_embeddings else ()


GEMMA2 = types.SimpleNamespace(
    READS=_COMMON_READS,
    ONLY=ONLY,
    HOLDS=HOLDS_GEMMA2,
    config_from_hf=gemma2_config_from_hf,
    config_to_hf=gemma2_config_to_hf,
    exports=gemma2_exports,
    tensors=tensors,
    ignored=ignored,
)
GEMMA3 = types.SimpleNamespace(
    READS=(*_COMMON_READS, "rope_local_base_freq"),
    ONLY=ONLY,
    HOLDS=HOLDS_GEMMA3,
    config_from_hf=gemma3_config_from_hf,
    config_to_hf=gemma3_config_to_hf,
    exports=gemma3_exports,
    tensors=tensors,
    ignored=ignored,
)
