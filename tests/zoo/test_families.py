"""Qwen2, Qwen3, Qwen3-MoE, Mistral and Phi-3: tiny random checkpoints made by HF transformers load
with its logits, zoo.save_pretrained writes directories transformers loads back, cached decode
equals the full forward, GGUF files of llama.cpp's qwen2/qwen3/phi3 load, the presets' parameter
counts equal those of the HF models built from the same config, and bad configs are refused.

One reference job (one subprocess) serves the module; forwards are jitted once per config.
"""

import json

import equinox as eqx
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zoo
from tests.reference.runner import run_reference
from tests.zoo.random_model import HF_LLAMA, VOCAB, random_model
from zoo.math import param_count
from zoo.pretrained.architectures import architecture
from zoo.pretrained.hf_config import config_from_hf, config_to_hf

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12)).tolist()
TIED, UNTIED = {"tie_word_embeddings": True}, {"tie_word_embeddings": False}
# Phi3Config's default special ids (32000) lie outside the tiny vocabulary.
_PHI3 = HF_LLAMA | {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
# Two configs per family: sizes, GQA 2:1 / MQA / MHA, head_dim apart from hidden/heads, tied and
# untied heads, windows shorter (5) and longer (64) than the 12 tokens.
MODELS = {
    "qwen2-gqa-tied": ("qwen2", HF_LLAMA | TIED),
    "qwen2-mqa-window": (
        "qwen2",
        HF_LLAMA
        | UNTIED
        | {"num_key_value_heads": 1, "head_dim": 16, "rope_theta": 1e6}
        | {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0},
    ),
    "qwen3-gqa-head16": ("qwen3", HF_LLAMA | UNTIED | {"head_dim": 16}),
    "qwen3-mqa-tied": (
        "qwen3",
        HF_LLAMA | TIED | {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 1},
    ),
    "qwen3moe-norm-topk": (
        "qwen3_moe",
        HF_LLAMA | TIED | _MOE | {"head_dim": 16, "norm_topk_prob": True},
    ),
    "qwen3moe-fused": (
        "qwen3_moe",
        HF_LLAMA
        | UNTIED
        | _MOE
        | {"num_experts": 6, "num_experts_per_tok": 3, "num_hidden_layers": 4}
        # Layers 0-1 dense, then MoE every second layer: layer 3 alone.
        | {"mlp_only_layers": [0, 1], "decoder_sparse_step": 2},
    ),
    "mistral-window5": ("mistral", HF_LLAMA | UNTIED | {"sliding_window": 5, "head_dim": 16}),
    "mistral-mqa-window64": (
        "mistral",
        HF_LLAMA | TIED | {"sliding_window": 64, "num_key_value_heads": 1},
    ),
    "phi3-window5": ("phi3", _PHI3 | UNTIED | {"sliding_window": 5}),
    "phi3-mha-head16": (
        "phi3",
        _PHI3 | TIED | {"num_key_value_heads": 4, "head_dim": 16, "num_hidden_layers": 3},
    ),
}
FUSED = {"qwen3moe-fused"}  # experts stacked as transformers 5 holds them in memory
HF_CLASS = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# Models made by the zoo (random, every weight perturbed), written in each family's layout.
_SMALL = zoo.preset("tiny-llama", vocab_size=VOCAB, d_model=32, d_ff=48, max_seq_len=64)
ZOO_MODELS = {
    "zoo-qwen2": ("Qwen2ForCausalLM", _SMALL.replace(qkv_bias=True, tie_embeddings=True)),
    "zoo-qwen3": ("Qwen3ForCausalLM", _SMALL.replace(qk_norm=True, head_dim=16, n_kv_heads=1)),
    "zoo-qwen3-moe": (
        "Qwen3MoeForCausalLM",
        _SMALL.replace(qk_norm=True, n_layers=3, first_dense_layers=1).replace(
            n_experts=4, n_experts_per_token=2, moe_d_ff=16
        ),
    ),
    "zoo-mistral": ("MistralForCausalLM", _SMALL.replace(sliding_window=4, head_dim=16)),
    "zoo-phi3": ("Phi3ForCausalLM", _SMALL.replace(sliding_window=4, n_kv_heads=1)),
}
# Each preset -> the HF architecture whose model (built from the same values) it is counted against.
PRESETS = {
    "qwen2.5-0.5b": "Qwen2ForCausalLM",
    "qwen2.5-1.5b": "Qwen2ForCausalLM",
    "qwen2.5-7b": "Qwen2ForCausalLM",
    "qwen3-0.6b": "Qwen3ForCausalLM",
    "qwen3-8b": "Qwen3ForCausalLM",
    "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
    "mistral-7b": "MistralForCausalLM",
    "phi3-mini-4k": "Phi3ForCausalLM",
}
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def relative_error(ours, reference) -> float:
    return float(np.max(np.abs(np.asarray(ours) - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="module")
def zoo_models():
    return {name: random_model(c, i) for i, (name, (_, c)) in enumerate(ZOO_MODELS.items())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, zoo_models):
    """HF builds each MODELS checkpoint (logits in name.npz), loads each zoo model we saved
    (logits in zoo-....npz), counts the presets' parameters (counts.json) and reads the GGUF
    files we wrote (gguf-NAME/NAME.npz)."""
    out = tmp_path_factory.mktemp("families")
    for name, model in zoo_models.items():
        zoo.save_pretrained(model, out / name, architecture=ZOO_MODELS[name][0])
    models = [
        {"name": name, "model_type": kind, "config": config, "fused": name in FUSED}
        for name, (kind, config) in MODELS.items()
    ]
    counts = []
    for name, hf_class in PRESETS.items():
        hf = config_to_hf(architecture(hf_class), zoo.preset(name), "float32")
        counts.append({"name": name, "model_type": hf.pop("model_type"), "config": hf})
    ggufs = []
    for i, (name, (hf_class, arch, config)) in enumerate(GGUF_MODELS.items()):
        ggufs.append(out / f"gguf-{name}" / f"{name}.gguf")
        write_gguf(random_model(config, i), hf_class, arch, ggufs[-1])
    job = {
        "models": models,
        "dirs": list(ZOO_MODELS),
        "tokens": TOKENS,
        "count": counts,
        "gguf": [str(ggufs[list(GGUF_MODELS).index(name)]) for name in GGUF_REFERENCE],
    }
    run_reference("families", job, out)
    return out


@pytest.fixture(scope="module")
def loaded(reference):
    return {name: zoo.load_pretrained(reference / name) for name in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers(reference, loaded, name):
    expected = np.load(reference / f"{name}.npz")["logits"]
    ours = forward(loaded[name], jnp.asarray(TOKENS))
    assert ours.shape == expected.shape
    assert relative_error(ours, expected) < 1e-4


def test_configs_are_read_from_the_checkpoints(loaded):
    qwen2, qwen3 = loaded["qwen2-mqa-window"].config, loaded["qwen3-gqa-head16"].config
    assert (qwen2.qkv_bias, qwen2.bias, qwen2.n_kv_heads, qwen2.sliding_window) == (
        True,
        False,
        1,
        5,
    )
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.sliding_window) == (True, 16, None)
    normed, fused = loaded["qwen3moe-norm-topk"].config, loaded["qwen3moe-fused"].config
    assert (normed.n_experts, normed.n_experts_per_token, normed.moe_d_ff) == (4, 2, 16)
    assert (normed.router_normalize, fused.router_normalize, fused.n_experts) == (True, False, 6)
    assert (fused.first_dense_layers, fused.moe_every, fused.moe_layers) == (2, 2, (3,))
    assert loaded["mistral-mqa-window64"].config.sliding_window == 64
    assert loaded["phi3-window5"].config.sliding_window == 5
    assert loaded["phi3-mha-head16"].config.tie_embeddings


@pytest.mark.parametrize("name", list(ZOO_MODELS))
def test_save_pretrained_reloads_in_transformers(zoo_models, reference, name):
    written = json.loads((reference / name / "config.json").read_text())
    assert written["architectures"] == [ZOO_MODELS[name][0]]
    reloaded = np.load(reference / f"{name}.npz")["logits"]
    assert relative_error(reloaded, forward(zoo_models[name], jnp.asarray(TOKENS))) < 1e-4


@pytest.mark.parametrize("name", list(MODELS))
def test_load_save_load_is_exact(loaded, tmp_path, name):
    """Written back in its own layout (Phi-3's fused projections fused again), read again."""
    zoo.save_pretrained(loaded[name], tmp_path, architecture=HF_CLASS[MODELS[name][0]])
    again = zoo.load_pretrained(tmp_path)
    assert again.config == loaded[name].config
    for a, b in zip(jax.tree.leaves(loaded[name]), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["qwen3moe-norm-topk", "phi3-window5"])
def test_cached_decode_equals_full_forward(loaded, name):
    """Prefill 6 tokens, then decode one at a time past the window of 5."""
    model, tokens = loaded[name], jnp.asarray(TOKENS)
    full = forward(model, tokens)
    step = eqx.filter_jit(lambda m, t, cache: m.forward(t, cache=cache))
    out = step(model, tokens[:, :6], model.init_cache(2, 12))
    np.testing.assert_allclose(out.logits, full[:, :6], rtol=1e-5, atol=1e-5)
    cache = out.cache
    for t in range(6, 12):
        out = step(model, tokens[:, t : t + 1], cache)
        np.testing.assert_allclose(out.logits[:, 0], full[:, t], rtol=1e-5, atol=1e-5)
        cache = out.cache


@pytest.mark.parametrize("name", ["qwen2-mqa-window", "mistral-window5"])
def test_flash_equals_naive(loaded, name):
    """The families' windows (5 < 16 tokens) under the Pallas kernel (head_dim 16 and a power-of-two
    length, as flash needs)."""
    model = loaded[name]
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 16)))
    naive = forward(model.with_policy(attention="naive"), tokens)
    flash = forward(model.with_policy(attention="flash"), tokens)
    # Both in float32; flash only reorders the softmax sums (online softmax).
    assert relative_error(flash, np.asarray(naive)) < 1e-5


@pytest.mark.parametrize("name", list(MODELS))
def test_param_count_counts_the_loaded_weights(loaded, name):
    weights = jax.tree.leaves(eqx.filter(loaded[name], eqx.is_array))
    assert sum(w.size for w in weights) == param_count(loaded[name].config)


def test_preset_parameter_counts_equal_transformers(reference):
    counts = json.loads((reference / "counts.json").read_text())
    ours = {name: param_count(zoo.preset(name)) for name in PRESETS}
    assert ours == counts


# --- GGUF (llama.cpp) ---------------------------------------------------------------------------

# transformers' GGUF reader, the reference, reads neither key_length (Qwen3's head_dim, default 128
# there) nor Phi-3's window: "phi3-window" is compared with the model it was written from only.
GGUF_MODELS = {
    "qwen2": ("Qwen2ForCausalLM", gguf.MODEL_ARCH.QWEN2, _SMALL.replace(qkv_bias=True)),
    "qwen3": (
        "Qwen3ForCausalLM",
        gguf.MODEL_ARCH.QWEN3,
        _SMALL.replace(qk_norm=True, head_dim=128, tie_embeddings=True),
    ),
    "phi3": ("Phi3ForCausalLM", gguf.MODEL_ARCH.PHI3, _SMALL.replace(n_kv_heads=1)),
    "phi3-window": ("Phi3ForCausalLM", gguf.MODEL_ARCH.PHI3, _SMALL.replace(sliding_window=5)),
}
GGUF_REFERENCE = ["qwen2", "qwen3", "phi3"]


def write_gguf(model: zoo.Transformer, hf_class: str, arch, path) -> None:
    """`model` as llama.cpp's converter writes it: HF tensors renamed by gguf-py's own name map,
    rows as HF has them (no Q/K permutation for these architectures), the `{arch}.*` metadata."""
    c = model.config
    zoo.save_pretrained(model, path.parent / "hf", architecture=hf_class)
    names = gguf.get_tensor_name_map(arch, c.n_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
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
    writer.add_key_length(c.head_dim)
    if arch == gguf.MODEL_ARCH.PHI3:
        writer.add_sliding_window(c.sliding_window or 0)
        # Else transformers takes Phi3Config's special ids (32000), outside a tiny vocabulary.
        writer.add_pad_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    for hf, w in sorted(load_file(path.parent / "hf" / "model.safetensors").items()):
        writer.add_tensor(names.get_name(hf, try_suffixes=(".weight", ".bias")), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", list(GGUF_MODELS))
def test_gguf_loads_the_model_it_was_written_from(reference, name):
    _, _, config = GGUF_MODELS[name]
    loaded = zoo.load_pretrained(reference / f"gguf-{name}" / f"{name}.gguf")
    # GGUF stores the norm epsilon as a float32.
    assert loaded.config == config.replace(norm_eps=float(np.float32(config.norm_eps)))
    written = random_model(config, list(GGUF_MODELS).index(name))
    # load_pretrained's default: the fast decode's storage (stacked on a CPU: decode_storage)
    assert loaded.policy.storage == zoo.Policy.inference().storage
    loaded = loaded.with_policy(written.policy)
    for a, b in zip(jax.tree.leaves(written), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", GGUF_REFERENCE)
def test_gguf_logits_match_transformers(reference, name):
    """transformers' GGUF reader un-permutes Q/K for llama alone, as we do."""
    expected = np.load(reference / f"gguf-{name}" / f"{name}.npz")["logits"]
    loaded = zoo.load_pretrained(reference / f"gguf-{name}" / f"{name}.gguf")
    assert relative_error(forward(loaded, jnp.asarray(TOKENS)), expected) < 1e-4


def test_gguf_longrope_is_refused(reference, tmp_path):
    _, _, config = GGUF_MODELS["phi3"]
    reader = gguf.GGUFReader(str(reference / "gguf-phi3" / "phi3.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "long.gguf"), "phi3")
    for field in reader.fields.values():
        if field.name.startswith("phi3."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data))
    writer.add_tensor("rope_factors_long.weight", np.ones(config.head_dim // 2, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"rope_factors_long tensor.*LongRoPE"):
        zoo.load_pretrained(tmp_path / "long.gguf")


# --- bad inputs ---------------------------------------------------------------------------------


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))


@pytest.mark.parametrize(
    ("name", "changes", "message"),
    [
        (
            "zoo-qwen2",
            {"use_sliding_window": True, "sliding_window": 4}
            | {"layer_types": ["full_attention", "sliding_attention"]},
            r"sliding window of 4 on layers \[1\] only",
        ),
        ("zoo-qwen2", {"layer_types": ["full_attention"]}, r"for each of the 2 layers"),
        ("zoo-qwen3", {"attention_bias": True}, r"attention_bias=True, which the zoo does not"),
        (
            "zoo-qwen3-moe",
            {"mlp_only_layers": [1]},
            r"mlp_only_layers=\[1\], decoder_sparse_step=1 with 3 layers: .* first k layers",
        ),
        (
            "zoo-qwen3-moe",
            {"decoder_sparse_step": 2},
            r"mlp_only_layers=\[0\], decoder_sparse_step=2 with 3 layers",
        ),
        ("zoo-qwen3-moe", {"num_experts": 0}, r"a Qwen3-MoE needs experts"),
        (
            "zoo-phi3",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            r"rope_type='longrope' \(LongRoPE",
        ),
        (
            "zoo-phi3",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            r"partial_rotary_factor=0\.5 is not implemented",
        ),
        ("zoo-mistral", {"use_sliding_window": True}, r"does not implement: \['use_sliding_w"),
    ],
)
def test_unimplemented_config_is_refused(reference, tmp_path, name, changes, message):
    path = tmp_path / name
    path.mkdir()
    for file in ("config.json", "model.safetensors"):
        (path / file).write_bytes((reference / name / file).read_bytes())
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        zoo.load_pretrained(path)


def test_fused_phi3_tensors_are_named_with_shapes(reference, tmp_path):
    path = tmp_path / "phi3"
    path.mkdir()
    (path / "config.json").write_bytes((reference / "zoo-phi3" / "config.json").read_bytes())
    tensors = load_file(reference / "zoo-phi3" / "model.safetensors")
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[qkv] = tensors[qkv][:-8]  # the v rows of one head cut off
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((48, 32), np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not: model\.layers\.0\.mlp\.up_proj\.weight"):
        zoo.load_pretrained(path)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{qkv} has shape \(40, 32\).*needs \(48, 32\)"):
        zoo.load_pretrained(path)


def test_saving_under_an_architecture_that_cannot_hold_the_config(zoo_models, tmp_path):
    with pytest.raises(ValueError, match=r"Phi3ForCausalLM's HF layout cannot hold.*Qwen2For"):
        zoo.save_pretrained(zoo_models["zoo-qwen2"], tmp_path, architecture="Phi3ForCausalLM")


# config.json of published checkpoints (as on the hub; bookkeeping fields kept, since every field
# must be either read or known harmless): each reads as the preset of the same model.
_COMMON = {"attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}
PUBLISHED = {
    "qwen2.5-0.5b": _COMMON
    | {
        "architectures": ["Qwen2ForCausalLM"],
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "qwen3-30b-a3b": _COMMON
    | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "mistral-7b": _COMMON
    | {
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.42.0.dev0",
        "vocab_size": 32768,
    },
    "phi3-mini-4k": _COMMON
    | {
        "_name_or_path": "Phi-3-mini-4k-instruct",
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "auto_map": {
            "AutoConfig": "configuration_phi3.Phi3Config",
            "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
        },
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 32000,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "max_position_embeddings": 4096,
        "model_type": "phi3",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096,
        "pad_token_id": 32000,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2",
        "vocab_size": 32064,
    },
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_read_as_the_presets(name):
    arch, config = config_from_hf(PUBLISHED[name])
    assert arch.name == PUBLISHED[name]["architectures"][0]
    assert config == zoo.preset(name)


def test_phi3_adapters_name_the_fused_projections(zoo_models, tmp_path):
    """PEFT wraps Phi-3's qkv_proj as one module: adapters on our q_proj have no place there."""
    model = zoo.add_lora(zoo_models["zoo-phi3"], ["q_proj", "o_proj"], 4, 8, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"\['attn\.q_proj'\] have no PEFT module.*Phi3For"):
        zoo.save_adapter(model, tmp_path, architecture="Phi3ForCausalLM")
    # Written for the Mistral layout the same config also fits, q_proj has its own module.
    zoo.save_adapter(model, tmp_path, architecture="MistralForCausalLM")
    assert "q_proj" in json.loads((tmp_path / "adapter_config.json").read_text())["target_modules"]
