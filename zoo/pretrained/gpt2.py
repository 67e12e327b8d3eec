"""GPT-2 (`GPT2LMHeadModel`, Radford et al. 2019) in HF layout: Conv1D weights stored `[in, out]`,
q/k/v fused in one `c_attn` tensor, learned positions, LayerNorm with bias, tied head."""

import numpy as np

from zoo.config import Config
from zoo.pretrained.tensor_map import TensorGroup, embedding, linear, same

_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both are the tanh-approximate GELU we use

READS = (
    "vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "n_ctx",  # old configs repeat n_positions
    "layer_norm_epsilon",
    "activation_function",
    "tie_word_embeddings",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",  # float32 attention scores: what our kernels do anyway
    "task_specific_params",  # generation settings
    # The sequence-summary head of GPT2DoubleHeadsModel, absent from the LM.
    "summary_activation",
    "summary_first_dropout",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",
)
ONLY = {"add_cross_attention": False}
HOLDS = frozenset({"norm", "position", "mlp", "bias"})


def config_from_hf(hf: dict) -> Config:
    if hf.get("activation_function", "gelu_new") not in _ACTIVATIONS:
        raise ValueError(
            f"GPT-2 activation_function={hf['activation_function']!r} is not supported; "
            f"the zoo's GPT-2 MLP uses the tanh GELU ({' or '.join(_ACTIVATIONS)})"
        )
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError(
            "GPT-2 attention scaling other than 1/sqrt(head_dim) (scale_attn_weights=False or "
            "scale_attn_by_inverse_layer_idx=True) is not supported"
        )
    d_model = hf["n_embd"]
    return Config(
        vocab_size=hf["vocab_size"],
        d_model=d_model,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * d_model,
        max_seq_len=hf["n_positions"],
        norm="layernorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        position="learned",
        mlp="gelu",
        tie_embeddings=hf.get("tie_word_embeddings", True),
        bias=True,
    )


def config_to_hf(config: Config) -> dict:
    return {
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        "n_positions": config.max_seq_len,
        "layer_norm_epsilon": config.norm_eps,
        "activation_function": "gelu_new",
        "tie_word_embeddings": config.tie_embeddings,
    }


def exports(config: Config) -> bool:
    """Whether GPT-2's layout takes the values of the fields it holds."""
    return (
        config.position == "learned"
        and config.norm == "layernorm"
        and config.mlp == "gelu"
        and config.bias
    )


def _fused_qkv(c: Config) -> list[TensorGroup]:
    """c_attn holds [q | k | v] along its output dim, each heads x head_dim."""
    d, h, hd = c.d_model, c.n_heads, c.head_dim
    names = tuple(f"blocks.attn.{p}_proj" for p in "qkv")
    weight = TensorGroup(
        tuple(f"{n}.weight" for n in names),
        ("transformer.h.{i}.attn.c_attn.weight",),
        ((d, 3 * d),),
        lambda w: tuple(np.moveaxis(w.reshape(d, 3, h, hd), 1, 0)),
        lambda q, k, v: (np.stack([q, k, v], axis=1).reshape(d, 3 * d),),
    )
    fused_bias = TensorGroup(
        tuple(f"{n}.bias" for n in names),
        ("transformer.h.{i}.attn.c_attn.bias",),
        ((3 * d,),),
        lambda b: tuple(b.reshape(3, h, hd)),
        lambda q, k, v: (np.stack([q, k, v]).reshape(3 * d),),
    )
    return [weight, fused_bias]


def tensors(c: Config) -> list[TensorGroup]:
    d, f, heads = c.d_model, c.d_ff, (c.n_heads, c.head_dim)
    h = "transformer.h.{i}."
    groups = [
        embedding("embed.weight", "transformer.wte.weight", (c.vocab_size, d)),
        same("positions.weight", "transformer.wpe.weight", (c.max_seq_len, d)),
        same("blocks.attn_norm.scale", h + "ln_1.weight", (d,)),
        same("blocks.attn_norm.bias", h + "ln_1.bias", (d,)),
        *_fused_qkv(c),
        linear("blocks.attn.o_proj.weight", h + "attn.c_proj.weight", heads, (d,), hf_in_out=True),
        same("blocks.attn.o_proj.bias", h + "attn.c_proj.bias", (d,)),
        same("blocks.mlp_norm.scale", h + "ln_2.weight", (d,)),
        same("blocks.mlp_norm.bias", h + "ln_2.bias", (d,)),
        linear("blocks.mlp.up.weight", h + "mlp.c_fc.weight", (d,), (f,), hf_in_out=True),
        same("blocks.mlp.up.bias", h + "mlp.c_fc.bias", (f,)),
        linear("blocks.mlp.down.weight", h + "mlp.c_proj.weight", (f,), (d,), hf_in_out=True),
        same("blocks.mlp.down.bias", h + "mlp.c_proj.bias", (d,)),
        same("final_norm.scale", "transformer.ln_f.weight", (d,)),
        same("final_norm.bias", "transformer.ln_f.bias", (d,)),
    ]
    if not c.tie_embeddings:
        groups.append(linear("lm_head.weight", "lm_head.weight", (d,), (c.vocab_size,)))
    return groups


def ignored(c: Config) -> tuple[str, ...]:
    """Checkpoint tensors that are not weights: old files keep the causal-mask buffers, and some
    tied checkpoints repeat the embedding as lm_head."""
    extra = ("lm_head.weight",) if c.tie_embeddings else ()
    return (r"transformer\.h\.\d+\.attn\.(masked_)?bias", *extra)
