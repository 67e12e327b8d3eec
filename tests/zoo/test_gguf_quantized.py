"""GGUF files loaded with their quantized blocks kept (zoo.load_pretrained's default): a tiny llama
GGUF written with every packed type (Q8_0 table, Q4_0, Q4_1, Q4_K, Q6_K projections, a type per
layer as llama.cpp's mixes do) loads to packed weights that compute what the same file
dequantized to float32 computes; the blocks are never in float; a type the zoo does not pack is
an error naming it and the tensor.

Tolerance: the same weights with each product summed in another order (the quantized kernels):
tests/zoo/test_transformer.py's tolerance for another schedule, relative to the logits' scale
(random blocks give logits far from 1).
"""

import os

import equinox as eqx
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from layers import QuantizedEmbedding, QuantizedLinear
from layers.kernels.quantized import default_activations
from layers.quantized import PackedWeight, with_activations
from zoo.pretrained.gguf import open_gguf
from zoo.quantize import quantized_formats

CONFIG = zoo.preset(
    "tiny-llama", n_layers=2, d_model=256, d_ff=512, n_heads=4, n_kv_heads=2, head_dim=64
)
Q = gguf.GGMLQuantizationType
# Per layer: the projections' type (llama.cpp's Q4_K_M mixes Q4_K and Q6_K across layers).
LAYER_TYPES = [
    {"attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q6_K, "attn_output": Q.Q4_1,
     "ffn_gate": Q.Q4_K, "ffn_up": Q.Q8_0, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q6_K, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_K,
     "ffn_gate": Q.Q4_0, "ffn_up": Q.Q6_K, "ffn_down": Q.Q4_K},
]  # fmt: skip
TOKENS = jnp.asarray([[3, 14, 15, 92, 65, 35, 89, 79]])


def random_blocks(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Raw blocks of `qtype` for a [rows, cols] tensor: random codes, small finite f16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    blocks = data.reshape(rows, -1, size)
    halves = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
              Q.Q6_K: [208]}[qtype]  # fmt: skip
    for at in halves:
        scale = rng.uniform(-2e-3, 2e-3, blocks.shape[:2]).astype(np.float16)
        blocks[..., at : at + 2] = scale[..., None].view(np.uint8)
    return data


def write_gguf(path, *, unsupported: str | None = None, layer_types=LAYER_TYPES) -> str:
    """A llama GGUF of CONFIG: F32 norms, a Q8_0 token table (tied head), each layer's
    projections in `layer_types`' types (`unsupported`: that tensor in Q5_K instead)."""
    c, rng = CONFIG, np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c.n_layers)
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.d_model)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_rope_dimension_count(c.head_dim)

    def add(name, rows, cols, qtype):
        qtype = Q.Q5_K if name == unsupported else qtype
        writer.add_tensor(name, random_blocks(rng, rows, cols, qtype), raw_dtype=qtype)

    add("token_embd.weight", c.vocab_size, c.d_model, Q.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(c.d_model, np.float32))
    shapes = {"attn_q": (c.q_dim, c.d_model), "attn_k": (c.kv_dim, c.d_model),
              "attn_v": (c.kv_dim, c.d_model), "attn_output": (c.d_model, c.q_dim),
              "ffn_gate": (c.d_ff, c.d_model), "ffn_up": (c.d_ff, c.d_model),
              "ffn_down": (c.d_model, c.d_ff)}  # fmt: skip
    for i, types in enumerate(layer_types):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(c.d_model, np.float32))
        for name, qtype in types.items():
            add(f"blk.{i}.{name}.weight", *shapes[name], qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf")


def test_blocks_stay_packed_in_their_own_types(mixed):
    model = zoo.load_pretrained(mixed)
    assert isinstance(model.embed, QuantizedEmbedding) and model.embed.kind == "q8_0"
    for i, types in enumerate(LAYER_TYPES):
        attn, mlp = model.layer(i).attn, model.layer(i).mlp
        kinds = {"attn_q": attn.q_proj, "attn_k": attn.k_proj, "attn_v": attn.v_proj,
                 "attn_output": attn.o_proj, "ffn_gate": mlp.gate, "ffn_up": mlp.up,
                 "ffn_down": mlp.down}  # fmt: skip
        for name, qtype in types.items():
            assert (
                isinstance(kinds[name], QuantizedLinear) and kinds[name].kind == qtype.name.lower()
            )
    assert not model.stacks[0].stacked  # each layer its own types: unrolled storage
    floats = [
        x
        for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        if x.dtype == jnp.float32
    ]
    assert sum(x.size for x in floats) == 2 * CONFIG.n_layers * CONFIG.d_model + CONFIG.d_model


def test_packed_model_computes_what_the_dequantized_file_does(mixed):
    # Its kernels taking x as it is (not the int8 activations a VNNI CPU loads with by default:
    # their rounding is held to its own bound in tests/layers/test_quantized.py).
    packed = with_activations(zoo.load_pretrained(mixed), "float")
    # One array per layer as the packed model (its layers' block types differ: unrolled), which
    # the float one is not by default on a CPU (stacked: zoo.policy.decode_storage).
    floats = zoo.load_pretrained(mixed, quantized=False).with_policy(storage="unrolled")
    assert not quantized_formats(floats)
    # The packed weights are exactly the file's dequantized ones (llama's Q/K rows unpermuted
    # the same way on both paths)...
    for a, b in zip(jax.tree.leaves(zoo.dequantize(packed)), jax.tree.leaves(floats), strict=True):
        np.testing.assert_array_equal(a, b)
    # ...and the forward (kernels taking x as it is) differs from the float one by summation
    # order alone.
    packed_weights = jax.tree.leaves(packed, is_leaf=lambda n: isinstance(n, PackedWeight))
    assert {w.activations for w in packed_weights if isinstance(w, PackedWeight)} == {"float"}
    forward = eqx.filter_jit(lambda m, t: m(t))
    ours, want = forward(packed, TOKENS), forward(floats, TOKENS)
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(ours / scale, want / scale, rtol=1e-5, atol=1e-5)


def test_blocks_load_with_the_cpus_default_activations(mixed):
    # int8 where the CPU multiplies codes in integers (AVX-512 VNNI), else float.
    model = zoo.load_pretrained(mixed)
    packed = [w for w in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, PackedWeight))
              if isinstance(w, PackedWeight)]  # fmt: skip
    assert {w.activations for w in packed} == {default_activations()}


def test_layers_of_the_same_types_load_stacked_and_decode_as_unrolled(tmp_path):
    # Every layer in the first layer's types: one stack of packed weights (the CPU decode
    # storage), each projection's kernel reading its layer in place; the same greedy tokens as
    # the same weights one array per layer.
    path = write_gguf(tmp_path / "same.gguf", layer_types=[LAYER_TYPES[0]] * CONFIG.n_layers)
    stacked = zoo.load_pretrained(path)
    assert stacked.stacks[0].stacked and quantized_formats(stacked) == [
        "q4_0",
        "q4_1",
        "q4_k",
        "q6_k",
        "q8_0",
    ]
    unrolled = stacked.with_policy(storage="unrolled")
    prompts = [[3, 14, 15, 92], [65, 35, 89, 79, 32, 38]]
    greedy = dict(max_new_tokens=5, sampler=infer.Greedy(), key=jax.random.key(0))
    assert infer.generate(stacked, prompts, **greedy) == infer.generate(unrolled, prompts, **greedy)


def test_a_type_the_zoo_does_not_pack_is_named(tmp_path):
    path = write_gguf(tmp_path / "q5k.gguf", unsupported="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_up\.weight' is Q5_K.*quantized=False"):
        zoo.load_pretrained(path)
    assert zoo.load_pretrained(path, quantized=False).config.n_layers == 2  # dequantized instead


def test_quantized_load_of_a_safetensors_directory_is_refused(tmp_path):
    zoo.save_pretrained(zoo.Transformer(CONFIG, key=jax.random.key(0)), tmp_path)
    with pytest.raises(ValueError, match=r"quantized=True keeps a GGUF file's quantized blocks"):
        zoo.load_pretrained(tmp_path, quantized=True)


def test_a_quantized_gguf_model_is_not_quantized_again(mixed):
    with pytest.raises(ValueError, match=r"already quantized \(q4_0, q4_1, q4_k, q6_k, q8_0\)"):
        zoo.quantize(zoo.load_pretrained(mixed), "int8")


def test_the_reader_parses_a_plain_view_of_the_memory_map(mixed):
    # numpy's memmap subclass runs Python code for every view taken of it, and the parser takes
    # one per vocabulary string: the reader's bytes are a plain ndarray over the file's mapping
    # (not a copy of the file).
    reader = open_gguf(mixed)
    assert type(reader.data) is np.ndarray and isinstance(reader.data.base, np.memmap)
    assert reader.data.nbytes == os.path.getsize(mixed)
