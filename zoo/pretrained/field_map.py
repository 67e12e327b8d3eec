"""The config.json fields the zoo's families share, as one table, and which Config fields each
family's layout holds.

`SIZES` maps the sizes every Llama-like family (Llama, Mistral, Mixtral, Qwen, Phi-3, Gemma,
DeepSeek) writes under the same names; `sizes_from_hf` / `sizes_to_hf` read and write them once,
and a family adds its own fields (its delta) beside them.

`HELD` (zoo sizes) plus a family's own `HOLDS` are the Config fields its layout can express;
`held_exactly` refuses a config with any other field away from its default. So a Config field
added to the zoo is exported by no family until one says it holds it: a model that uses it can
never be written silently as another family's (e.g. as a Llama, which would drop it).
"""

import dataclasses
from typing import Any

from zoo.config import Config


@dataclasses.dataclass(frozen=True)
class Field:
    """A Config field and the config.json key the Llama-like families write it under."""

    zoo: str
    hf: str


SIZES = (
    Field("vocab_size", "vocab_size"),
    Field("d_model", "hidden_size"),
    Field("n_layers", "num_hidden_layers"),
    Field("n_heads", "num_attention_heads"),
    Field("n_kv_heads", "num_key_value_heads"),
    Field("head_dim", "head_dim"),
    Field("d_ff", "intermediate_size"),
    Field("max_seq_len", "max_position_embeddings"),
    Field("norm_eps", "rms_norm_eps"),
    Field("tie_embeddings", "tie_word_embeddings"),
)
# Config fields every family holds: the sizes and a tied head (GPT-2 writes them under names of
# its own).
HELD = frozenset(
    {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
     "max_seq_len", "norm_eps", "tie_embeddings"}
)  # fmt: skip


def sizes_from_hf(hf: dict, *, tie_embeddings: bool = False) -> dict[str, Any]:
    """The `SIZES` Config fields of a Llama-like config.json, with HF's defaults (GQA heads =
    attention heads, head_dim = hidden / heads, rms_norm_eps 1e-6, `tie_embeddings`)."""
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "d_model": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "d_ff": hf["intermediate_size"],
        "max_seq_len": hf["max_position_embeddings"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": hf.get("tie_word_embeddings", tie_embeddings),
    }


def sizes_to_hf(config: Config) -> dict[str, Any]:
    """The `SIZES` config.json fields of `config`."""
    return {field.hf: getattr(config, field.zoo) for field in SIZES}


def off_default(config: Config, holds: frozenset[str]) -> list[str]:
    """The fields of `config` outside `HELD | holds` whose value is not their default (every
    field its dataclass has, so a field added later is seen too)."""
    return [
        f.name
        for f in dataclasses.fields(config)
        if f.name not in HELD | holds
        and f.default is not dataclasses.MISSING
        and getattr(config, f.name) != f.default
    ]


def held_exactly(config: Config, holds: frozenset[str]) -> bool:
    """Whether a layout holding the Config fields `HELD | holds` holds `config`: every other
    field is at its default (a feature the layout has no place for is not used)."""
    return not off_default(config, holds)
