"""Phi-3 (`Phi3ForCausalLM`, Abdin et al. 2024, "Phi-3 Technical Report") in HF layout: a
Llama-like model (RMSNorm, SwiGLU, rotary, no biases) whose checkpoint fuses the projections:
`self_attn.qkv_proj.weight` `[q_dim + 2 * kv_dim, embed]` holds the q, k and v rows in that
order, `mlp.gate_up_proj.weight` `[2 * mlp, embed]` the gate rows then the up rows. They are split
onto our separate projections on import and fused again on export. Optional sliding window on
every layer (Phi-3-mini-4k: 2047; HF's rule q_pos - k_pos < window, as Config.sliding_window).

Not implemented, and refused: LongRoPE (`rope_type` "longrope", formerly "su"/"yarn": the 128k
variants) and a partial rotary embedding (`partial_rotary_factor` != 1).
"""

import math

import numpy as np

from zoo.config import Config
from zoo.pretrained import llama
from zoo.pretrained.rope import hf_rope_parameters
from zoo.pretrained.tensor_map import TensorGroup

READS = (
    *(f for f in llama.READS if f not in ("attention_bias", "mlp_bias")),
    "sliding_window",
    # Only LongRoPE reads it (refused below): the default rope ignores it.
    "original_max_position_embeddings",
)
# Later Phi-3 config.json files say attention_bias=false; the model has no biases.
ONLY = llama.ONLY | {"partial_rotary_factor": 1.0, "attention_bias": False}
HOLDS = llama.HOLDS - {"bias"} | {"sliding_window"}
_LONGROPE = ("longrope", "su", "yarn")


def config_from_hf(hf: dict) -> Config:
    rope = hf_rope_parameters(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        # transformers' Phi-3 once spelled LongRoPE "su", then "yarn", now "longrope".
        what = " (LongRoPE, the 128k-context variants)" if kind in _LONGROPE else ""
        raise ValueError(
            f"Phi3ForCausalLM rope_type={kind!r}{what} is not supported; the zoo has 'default' "
            "only for Phi-3 (e.g. Phi-3-mini-4k)"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"Phi3ForCausalLM partial_rotary_factor={rope['partial_rotary_factor']} is not "
            "implemented; the zoo rotates every dim of each head (factor 1.0)"
        )
    window = hf.get("sliding_window")
    return llama.config_from_hf(hf, "Phi3ForCausalLM").replace(sliding_window=window)


def config_to_hf(config: Config) -> dict:
    hf = llama.config_to_hf(config)
    for field in ("attention_bias", "mlp_bias"):
        del hf[field]
    hf["rope_parameters"] |= {"partial_rotary_factor": 1.0}
    return hf | {
        "model_type": "phi3",
        "sliding_window": config.sliding_window,
        "original_max_position_embeddings": config.max_seq_len,
        # Phi3Config's defaults (32000) would lie outside a smaller vocabulary.
        "pad_token_id": None,
        "eos_token_id": None,
        "bos_token_id": None,
    }


def exports(config: Config) -> bool:
    """Whether Phi-3's layout takes the values of the fields it holds: Llama's, window or not
    (written as a Llama or Mistral unless Phi-3 is asked for by name)."""
    return llama.exports(config)


def _fused(zoo: tuple[str, ...], hf: str, out_shapes: tuple[tuple[int, ...], ...], d: int):
    """One `[sum of outputs, d]` nn.Linear weight <-> our `[d, *out_shape]` weights, their rows
    in order (heads x head_dim flattened for q, k and v)."""
    sizes = [math.prod(shape) for shape in out_shapes]
    splits = np.cumsum(sizes)[:-1]

    def to_zoo(w):
        parts = np.split(w, splits, axis=0)
        return tuple(p.T.reshape(d, *s) for p, s in zip(parts, out_shapes, strict=True))

    def to_hf(*ws):
        return (np.concatenate([w.reshape(d, -1).T for w in ws], axis=0),)

    rows = tuple(zip(zoo, sizes, strict=True))
    return TensorGroup(zoo, (hf,), ((sum(sizes), d),), to_zoo, to_hf, rows=rows)


def tensors(c: Config) -> list[TensorGroup]:
    d, f = c.d_model, c.d_ff
    qkv = _fused(
        ("blocks.attn.q_proj.weight", "blocks.attn.k_proj.weight", "blocks.attn.v_proj.weight"),
        "model.layers.{i}.self_attn.qkv_proj.weight",
        ((c.n_heads, c.head_dim), (c.n_kv_heads, c.head_dim), (c.n_kv_heads, c.head_dim)),
        d,
    )
    gate_up = _fused(
        ("blocks.mlp.gate.weight", "blocks.mlp.up.weight"),
        "model.layers.{i}.mlp.gate_up_proj.weight",
        ((f,), (f,)),
        d,
    )
    down = [("mlp.down", "model.layers.{i}.mlp.down_proj", (f,), (d,))]
    return [*llama.tensors_around_mlp(c, down, qkv=[qkv]), gate_up]


def ignored(c: Config) -> tuple[str, ...]:
    return llama.ignored(c)
