"""GGUF files (llama.cpp) of the llama, gemma2 and gemma3 architectures, seen as the HF checkpoint
they were converted from: the config comes from the GGUF metadata, tensor names are mapped to
HF's, quantized tensors are dequantized (`gguf.quants.dequantize`, to float32) one at a time, and
what llama.cpp's converter changed is undone: Llama's permutation of the Q/K rows, the 1 that
Gemma's converter adds to every norm weight (HF stores the offset from 1). SmolLM2's GGUF is a
llama one."""

import functools
import os
import re

import gguf
import numpy as np

ARCHITECTURES = ("llama", "gemma2", "gemma3")

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
# Gemma's sandwich norms and Gemma 3's q/k norms; its ffn_norm is the pre-MLP norm.
_GEMMA_PER_LAYER = _PER_LAYER | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: str) -> gguf.GGUFReader:
    """The reader for `path`, with a clear error for a file that is cut short or not GGUF.

    Readers are cached per file version: parsing the metadata (tens of thousands of vocabulary
    strings) takes seconds, and the model and its tokenizer both need it. A reader memory-maps
    the file, so the cache holds no tensor data.
    """
    stat = os.stat(path)
    return _reader(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
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
    """HF's name for a GGUF tensor of `arch` (unknown names are kept, and reported as extra)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    per_layer = _PER_LAYER if arch == "llama" else _GEMMA_PER_LAYER
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


def hf_config(reader: gguf.GGUFReader) -> dict:
    """An HF config.json equivalent of the GGUF metadata (LlamaForCausalLM, Gemma2ForCausalLM
    or Gemma3ForCausalLM)."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; the zoo reads GGUF of: "
            f"{', '.join(ARCHITECTURES)}"
        )
    if arch != "llama":
        return _gemma_config(reader, arch)
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(
            "this GGUF stores Llama-3 rope scaling as a rope_freqs tensor, which the zoo does "
            "not read yet; load the HF safetensors checkpoint instead"
        )
    heads = int(metadata(reader, "llama.attention.head_count"))
    d_model = int(metadata(reader, "llama.embedding_length"))
    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(metadata(reader, "llama.vocab_size", int(embed.shape[1]))),
        "hidden_size": d_model,
        "num_hidden_layers": int(metadata(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(metadata(reader, "llama.rope.dimension_count", d_model // heads)),
        "intermediate_size": int(metadata(reader, "llama.feed_forward_length")),
        "max_position_embeddings": int(metadata(reader, "llama.context_length")),
        "rms_norm_eps": float(metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata(reader, "llama.rope.freq_base", 10_000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }


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


class GGUFSource:
    """Name -> float32 tensor, in HF names and layout, dequantized on read."""

    def __init__(self, reader: gguf.GGUFReader, hf: dict):
        self._gemma = hf["architectures"][0] != "LlamaForCausalLM"
        arch = metadata(reader, "general.architecture")
        self._tensors = {hf_name(t.name, arch): t for t in reader.tensors}
        # llama.cpp permutes Llama's Q/K rows for its interleaved rotary kernel; Gemma runs
        # llama.cpp's NeoX (rotate-half) kernel, which needs HF's order as it is.
        self._heads = (
            {}
            if self._gemma
            else {"q_proj": hf["num_attention_heads"], "k_proj": hf["num_key_value_heads"]}
        )

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dims fastest-first; NumPy (and HF) slowest-first.
        return tuple(int(n) for n in reversed(self._tensors[name].shape))

    def read(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        # A plain ndarray view: slicing a memmap costs far more per call inside dequantize.
        w = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)
        w = w.reshape(self.shape(name))
        projection = name.split(".")[-2]
        if projection in self._heads:
            w = unpermute(w, self._heads[projection])
        if self._gemma and projection.endswith("norm"):
            w = w - 1.0  # llama.cpp stores 1 + w; HF (and our plus_one RMSNorm) the offset w
        return w
