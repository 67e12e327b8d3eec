"""GGUF files (llama.cpp) seen as HF checkpoints: the config comes from the GGUF metadata, tensor
names are mapped to the HF architecture's, quantized tensors are kept in their blocks
(`read_packed`: zoo/pretrained/gguf_blocks.py) or dequantized (`gguf.quants.dequantize`, to
float32) one at a time, and llama.cpp's permutation of the Q/K rows is undone where its
converter applies one, and so is the 1 Gemma's converter adds to every norm
weight (HF stores the offset from 1). SmolLM2's GGUF is a llama one.

One row of `ARCHITECTURES` per llama.cpp architecture: its HF class, the GGUF tensor names that
differ from llama's, whether Q/K rows are permuted, and the config.json fields it adds. llama.cpp's
converter (convert_hf_to_gguf.py) permutes Q/K for llama only; qwen2, qwen3 and phi3 keep HF's
row order. Phi-3's fused `attn_qkv` and `ffn_up` (gate rows, then up rows) are HF's `qkv_proj` and
`gate_up_proj` as they are.
"""

import dataclasses
import functools
import os
import re
from collections.abc import Callable

import gguf
import numpy as np

from zoo.pretrained.gguf_blocks import FLOAT_TYPES, PackedRows, packed_rows

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """A llama.cpp architecture as an HF one: `hf_class`, per-layer tensor names beyond (or
    instead of) llama's (`tensors`: GGUF name -> HF module), whether the converter permuted the
    Q/K rows, what it added to every norm weight (`norm_offset`), and `fields(reader,
    tensor_names)`: config.json fields beyond the shared ones, or `config(reader, arch)`: the
    whole config.json where the shared reading does not apply."""

    hf_class: str
    tensors: dict[str, str] = dataclasses.field(default_factory=dict)
    permuted_qk: bool = False
    norm_offset: float = 0.0
    fields: Callable[[gguf.GGUFReader, set[str]], dict] = lambda reader, names: {}
    config: Callable[[gguf.GGUFReader, str], dict] | None = None


def _llama_fields(reader: gguf.GGUFReader, names: set[str]) -> dict:
    return {
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }


def _phi3_fields(reader: gguf.GGUFReader, names: set[str]) -> dict:
    # The converter writes 0 for "no window" (Phi-4); the 4k Phi-3-mini has 2047.
    window = int(metadata(reader, "phi3.attention.sliding_window", 0))
    return {"sliding_window": window or None}


# llama.cpp's Gemma models: the layer count names the size, and the 27B ones scale scores by
# (hidden / heads)^-1/2 instead of head_dim^-1/2 (GGUF has no query_pre_attn_scalar; llama.cpp's
# llama-model.cpp applies this rule after Google's gemma_pytorch configs).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Global layers: every 2nd (Gemma 2) or 6th (Gemma 3), as llama.cpp hard-codes them; Gemma 3's
# sliding layers use rope theta 10000 (likewise fixed there).
_GEMMA_PERIOD = {"gemma2": 2, "gemma3": 6}


def _gemma_config(reader: gguf.GGUFReader, arch: str) -> dict:
    """Gemma2ForCausalLM / Gemma3ForCausalLM config.json fields from a gemma2 / gemma3 GGUF."""
    names = {t.name for t in reader.tensors}
    heads = int(metadata(reader, f"{arch}.attention.head_count"))
    d_model = int(metadata(reader, f"{arch}.embedding_length"))
    n_layers = int(metadata(reader, f"{arch}.block_count"))
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", d_model // heads))
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    period = _GEMMA_PERIOD[arch]
    theta = float(metadata(reader, f"{arch}.rope.freq_base", 10_000.0))
    rope = {"rope_type": "default", "rope_theta": theta}
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope = rope | {
            "rope_type": "linear",
            "factor": float(metadata(reader, f"{arch}.rope.scaling.factor")),
        }
    elif scaling != "none":
        raise ValueError(f"GGUF {arch} rope scaling {scaling!r} is not supported (only linear)")
    hf = {
        "architectures": ["Gemma2ForCausalLM" if arch == "gemma2" else "Gemma3ForCausalLM"],
        "vocab_size": int(metadata(reader, f"{arch}.vocab_size", int(embed.shape[1]))),
        "hidden_size": d_model,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(metadata(reader, f"{arch}.feed_forward_length")),
        "max_position_embeddings": int(metadata(reader, f"{arch}.context_length")),
        "rms_norm_eps": float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "query_pre_attn_scalar": (
            d_model // heads if n_layers == _GEMMA_27B_LAYERS[arch] else head_dim
        ),
        "sliding_window": int(metadata(reader, f"{arch}.attention.sliding_window", 4096)),
        "layer_types": [
            "full_attention" if (i + 1) % period == 0 else "sliding_attention"
            for i in range(n_layers)
        ],
    }
    if arch == "gemma2":
        softcaps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
        for field, default in softcaps.items():
            hf[field] = float(metadata(reader, f"{arch}.{field}", default))
        return hf | {"rope_parameters": rope}
    local = {"rope_type": "default", "rope_theta": 10_000.0}
    return hf | {"rope_parameters": {"full_attention": rope, "sliding_attention": local}}


# Gemma's sandwich norms and Gemma 3's q/k norms; its ffn_norm is the pre-MLP norm.
_GEMMA_TENSORS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", permuted_qk=True, fields=_llama_fields),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM"),
    "qwen3": GGUFArchitecture(
        "Qwen3ForCausalLM",
        tensors={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    ),
    "phi3": GGUFArchitecture(
        "Phi3ForCausalLM",
        tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        fields=_phi3_fields,
    ),
    # Gemma runs llama.cpp's NeoX (rotate-half) rotary kernel: its Q/K rows are HF's as they are.
    "gemma2": GGUFArchitecture(
        "Gemma2ForCausalLM", tensors=_GEMMA_TENSORS, norm_offset=1.0, config=_gemma_config
    ),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM", tensors=_GEMMA_TENSORS, norm_offset=1.0, config=_gemma_config
    ),
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: str) -> gguf.GGUFReader:
    """The reader for `path`, with a clear error for a file that is cut short or not GGUF.

    Readers are cached per file version: parsing the metadata (tens of thousands of vocabulary
    strings) takes about half a second (`_Reader`), and the model and its tokenizer both need
    it. A reader memory-maps the file, so the cache holds no tensor data.
    """
    stat = os.stat(path)
    return _reader(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


class _Reader(gguf.GGUFReader):
    """gguf-py's reader over a plain ndarray view of the file's memory map (the same bytes, no
    copy): numpy's `memmap` subclass runs Python code for every view taken of it, and the parser
    takes about a million (a view per vocabulary string), which made parsing SmolLM2's metadata
    3.5x slower (2.0 s against 0.55 s: bench/RESULTS.md)."""

    @property
    def data(self) -> np.ndarray:
        return self._mapped

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._mapped = mapped.view(np.ndarray)


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    try:
        return _Reader(path)
    except (ValueError, IndexError, OSError, KeyError) as e:
        raise ValueError(f"{path}: cannot read GGUF file (truncated or corrupt?): {e}") from e


def metadata(reader: gguf.GGUFReader, key: str, default=None):
    """The value of metadata `key` (`default` when absent and a default is given)."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF name of a GGUF tensor of llama.cpp architecture `arch` (unknown names are kept,
    and reported as extra)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    per_layer = _PER_LAYER | ARCHITECTURES[arch].tensors
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match[2] in per_layer:
        return f"model.layers.{match[1]}.{per_layer[match[2]]}.{match[3]}"
    return gguf_name


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute`, which reorders each head's rows from HF's rotate-half layout
    (first half, second half) to interleaved pairs for its rotary kernel."""
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# The `{arch}.*` metadata the shared reading below maps (Phi-3 adds its window), and keys read at
# one value only. Any other `{arch}.` key may change the model's math (a rope scaling, experts),
# so the file is refused rather than loaded as something else.
READS = frozenset(
    {
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "attention.layer_norm_rms_epsilon",
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "rope.dimension_count",
        "rope.freq_base",
        "vocab_size",
        "attention.sliding_window",  # Phi-3's (read by _phi3_fields; refused for the others)
    }
)
ONLY = {"rope.scaling.type": "none", "expert_count": 0, "expert_used_count": 0}


def _check_keys(reader: gguf.GGUFReader, arch: str) -> None:
    """Refuse `{arch}.*` metadata the shared reading would ignore (see READS and ONLY)."""
    prefix = f"{arch}."
    keys = {name.removeprefix(prefix) for name in reader.fields if name.startswith(prefix)}
    for key in sorted(keys & set(ONLY)):
        if metadata(reader, prefix + key) != ONLY[key]:
            raise ValueError(
                f"GGUF {prefix}{key}={metadata(reader, prefix + key)!r} is not supported for "
                f"{arch} (only {ONLY[key]!r}); load the HF safetensors checkpoint instead"
            )
    reads = READS if arch == "phi3" else READS - {"attention.sliding_window"}
    # value_length: the value heads' size, read only where it equals the key heads'.
    if "attention.value_length" in keys:
        heads = metadata(reader, prefix + "embedding_length") // metadata(
            reader, prefix + "attention.head_count"
        )
        key_length = metadata(reader, prefix + "attention.key_length", heads)
        value_length = metadata(reader, prefix + "attention.value_length")
        if value_length != key_length:
            raise ValueError(
                f"GGUF {prefix}attention.value_length={value_length} differs from the key heads' "
                f"{key_length}, which the zoo does not implement"
            )
        keys.discard("attention.value_length")
    unknown = sorted(keys - reads - set(ONLY))
    if unknown:
        raise ValueError(
            f"GGUF metadata {', '.join(prefix + k for k in unknown)} is not read by the zoo for "
            f"{arch}; it may change the model's math, so the file is refused rather than loaded "
            "wrong"
        )


def hf_config(reader: gguf.GGUFReader) -> dict:
    """The HF config.json equivalent of the GGUF metadata (`{arch}.*` keys)."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; the zoo reads GGUF of: "
            f"{', '.join(ARCHITECTURES)}"
        )
    names = {t.name for t in reader.tensors}
    kinds = {"rope_freqs.weight": "frequency factors", "rope_factors_long.weight": "LongRoPE"}
    for scaling, kind in kinds.items():
        if scaling in names:
            raise ValueError(
                f"this {arch} GGUF stores rope scaling as a {scaling.removesuffix('.weight')} "
                f"tensor ({kind}), which the zoo does not read yet; load the HF safetensors "
                "checkpoint instead"
            )
    if ARCHITECTURES[arch].config is not None:
        return ARCHITECTURES[arch].config(reader, arch)
    _check_keys(reader, arch)

    def key(name: str, default=None):
        return metadata(reader, f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    d_model = int(key("embedding_length"))
    # head_dim: key_length where the converter wrote it (Qwen3), else the rotary dims.
    rotary = int(key("rope.dimension_count", d_model // heads))
    head_dim = int(key("attention.key_length", rotary))
    if rotary != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rotary} rotates part of head_dim={head_dim} "
            "(partial rotary embedding), which the zoo does not implement"
        )
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return {
        "architectures": [ARCHITECTURES[arch].hf_class],
        "vocab_size": int(key("vocab_size", int(embed.shape[1]))),
        "hidden_size": d_model,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": int(key("feed_forward_length")),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10_000.0)),
        "tie_word_embeddings": "output.weight" not in names,
    } | ARCHITECTURES[arch].fields(reader, names)


class GGUFSource:
    """Name -> float32 tensor, in the HF architecture's names and layout, dequantized on read;
    or (`read_packed`) a quantized tensor's blocks as the zoo's packed rows, never in float."""

    def __init__(self, reader: gguf.GGUFReader, hf: dict):
        arch = metadata(reader, "general.architecture")
        self._tensors = {hf_name(t.name, arch): t for t in reader.tensors}
        self._norm_offset = ARCHITECTURES[arch].norm_offset
        self._heads = (
            {"q_proj": hf["num_attention_heads"], "k_proj": hf["num_key_value_heads"]}
            if ARCHITECTURES[arch].permuted_qk
            else {}
        )

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dims fastest-first; NumPy (and HF) slowest-first.
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def is_quantized(self, name: str) -> bool:
        """Whether the tensor is stored in quantized blocks (not F32, F16 or BF16)."""
        return self._tensors[name].tensor_type not in FLOAT_TYPES

    def read_packed(self, name: str) -> PackedRows | None:
        """The tensor's blocks as packed rows (an `[out, in]` matrix: rows are outputs) in the HF
        row order, or None for a float tensor; a quantized type the zoo does not pack is an
        error naming it."""
        tensor = self._tensors[name]
        rows = self.shape(name)[0]
        packed = packed_rows(np.asarray(tensor.data), tensor.tensor_type, rows, tensor.name)
        projection = name.split(".")[-2]
        if packed is None or projection not in self._heads:
            return packed
        return packed.take(unpermute(np.arange(rows), self._heads[projection]))

    def read(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        # A plain ndarray view: slicing a memmap costs far more per call inside dequantize.
        w = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
        w = w.reshape(self.shape(name))
        projection = name.split(".")[-2]
        if projection in self._heads:
            w = unpermute(w, self._heads[projection])
        if self._norm_offset and projection.endswith("norm"):
            w = w - self._norm_offset  # llama.cpp stores offset + w; HF (and plus_one RMSNorm) w
        return w
