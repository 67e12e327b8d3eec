"""Llama (`LlamaForCausalLM`, Touvron et al. 2023; Llama 3, Grattafiori et al. 2024) in HF
layout: nn.Linear weights stored `[out, in]`, GQA, RMSNorm, SwiGLU, rotary positions with an
optional Llama-3 frequency scaling, tied or untied head. SmolLM2 is a Llama."""

from zoo.config import Config
from zoo.pretrained.field_map import sizes_from_hf, sizes_to_hf
from zoo.pretrained.rope import rope_from_hf, rope_to_hf
from zoo.pretrained.tensor_map import TensorGroup, bias, embedding, linear, same

READS = (
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
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
)
ONLY = {"pretraining_tp": 1}
# The Config fields Llama's layout holds beyond the sizes (field_map.held_exactly).
HOLDS = frozenset({"rope_theta", "rope_scaling", "bias"})


def config_from_hf(hf: dict, arch: str = "LlamaForCausalLM") -> Config:
    """The Config of a Llama's config.json; the Llama-like families read theirs through this
    one, passing their own class name `arch` for the messages."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch} hidden_act={hf['hidden_act']!r} is not supported; only 'silu'")
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ValueError(
            f"{arch} attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported: "
            "the zoo's Config.bias puts biases on both or neither"
        )
    theta, scaling = rope_from_hf(hf, arch, ("llama3",))
    return Config(
        **sizes_from_hf(hf),
        norm="rmsnorm",
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        mlp="swiglu",
        bias=attention_bias,
    )


def config_to_hf(config: Config) -> dict:
    rope = rope_to_hf(config.rope_theta, config.rope_scaling)
    return {
        "model_type": "llama",
        **sizes_to_hf(config),
        "hidden_act": "silu",
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
        # Both spellings, so that transformers before and after v5 read the same rope.
        "rope_parameters": rope,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope if config.rope_scaling is not None else None,
    }


def exports(config: Config) -> bool:
    """Whether Llama's layout takes the values of the fields it holds (`HOLDS`): no rope
    scaling but Llama 3's."""
    return config.rope_scaling is None or config.rope_scaling.kind == "llama3"


def tensors(c: Config) -> list[TensorGroup]:
    d, f, m = c.d_model, c.d_ff, "model.layers.{i}.mlp."
    mlp = [
        ("mlp.gate", m + "gate_proj", (d,), (f,)),
        ("mlp.up", m + "up_proj", (d,), (f,)),
        ("mlp.down", m + "down_proj", (f,), (d,)),
    ]
    return tensors_around_mlp(c, mlp)


def tensors_around_mlp(
    c: Config,
    mlp: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]],
    *,
    qkv: list[TensorGroup] | None = None,
) -> list[TensorGroup]:
    """Every group but the feed-forward ones, plus the projections `mlp` (ours, theirs, in, out):
    shared with the Llama-like families, whose layers differ from Llama's only in the MLP, q/k/v
    biases (Qwen2), q/k norms (Qwen3) or a fused `qkv` (Phi-3: groups replacing the q, k and v
    projections)."""
    d = c.d_model
    q, kv = (c.n_heads, c.head_dim), (c.n_kv_heads, c.head_dim)
    a = "model.layers.{i}.self_attn."
    separate_qkv = [
        ("attn.q_proj", a + "q_proj", (d,), q),
        ("attn.k_proj", a + "k_proj", (d,), kv),
        ("attn.v_proj", a + "v_proj", (d,), kv),
    ]
    projections = [*(separate_qkv if qkv is None else []), ("attn.o_proj", a + "o_proj", q, (d,))]
    groups = [
        embedding("embed.weight", "model.embed_tokens.weight", (c.vocab_size, d)),
        same("blocks.attn_norm.scale", "model.layers.{i}.input_layernorm.weight", (d,)),
        same("blocks.mlp_norm.scale", "model.layers.{i}.post_attention_layernorm.weight", (d,)),
        same("final_norm.scale", "model.norm.weight", (d,)),
        *(qkv or []),
    ]
    if c.qk_norm:
        for name in ("q_norm", "k_norm"):
            groups.append(same(f"blocks.attn.{name}.scale", f"{a}{name}.weight", (c.head_dim,)))
    for ours, theirs, in_shape, out_shape in [*projections, *mlp]:
        groups.append(linear(f"blocks.{ours}.weight", f"{theirs}.weight", in_shape, out_shape))
        if c.bias or (c.qkv_bias and ours in ("attn.q_proj", "attn.k_proj", "attn.v_proj")):
            groups.append(bias(f"blocks.{ours}.bias", f"{theirs}.bias", out_shape))
    if not c.tie_embeddings:
        groups.append(linear("lm_head.weight", "lm_head.weight", (d,), (c.vocab_size,)))
    return groups


def ignored(c: Config) -> tuple[str, ...]:
    """Checkpoint tensors that are not weights: old files keep rotary inverse frequencies, and
    some tied checkpoints repeat the embedding as lm_head."""
    extra = ("lm_head.weight",) if c.tie_embeddings else ()
    return (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", *extra)
