"""GGUF files (llama.cpp) of the llama architecture, seen as an HF Llama checkpoint: the config
comes from the GGUF metadata, tensor names are mapped to HF's, quantized tensors are dequantized
(`gguf.quants.dequantize`, to float32) one at a time, and llama.cpp's permutation of the Q/K rows
is undone. SmolLM2's GGUF is one of these."""

import functools
import os
import re

import gguf
import numpy as np

ARCHITECTURES = ("llama",)

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


def hf_name(gguf_name: str) -> str:
    """HF Llama's name for a GGUF tensor (unknown names are kept, and reported as extra)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match[2] in _PER_LAYER:
        return f"model.layers.{match[1]}.{_PER_LAYER[match[2]]}.{match[3]}"
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
    """An HF LlamaForCausalLM config.json equivalent of the GGUF metadata."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; the zoo reads GGUF of: "
            f"{', '.join(ARCHITECTURES)}"
        )
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


class GGUFSource:
    """Name -> float32 tensor, in HF Llama names and layout, dequantized on read."""

    def __init__(self, reader: gguf.GGUFReader, hf: dict):
        self._tensors = {hf_name(t.name): t for t in reader.tensors}
        self._heads = {
            "q_proj": hf["num_attention_heads"],
            "k_proj": hf["num_key_value_heads"],
        }

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
        return w
