"""Gemma 2 and Gemma 3 (text): tiny random HF checkpoints made by transformers load with its
logits; zoo.save_pretrained writes directories transformers loads back; cached decode (the
contiguous cache and infer.Engine's paged one) equals the full forward; config.json fields the zoo
does not implement are refused.

The configs differ in what a loader could get wrong: GQA ratios (4:2, MQA, MHA), windows shorter
and longer than the 12 tokens, query_pre_attn_scalar != head_dim, head_dim != hidden / heads,
tied and untied heads, a global/local pattern whose period does not divide the depth, soft-caps
small enough to matter, Gemma 3's per-layer-type rope with linear scaling on the global layers.
One reference job (one subprocess) serves the module; forwards are jitted once per config.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infer
import zoo
from infer.engine import Engine
from layers.kernels import Naive
from layers.rotary import RopeScaling
from tests.reference.runner import run_reference
from tests.zoo.random_model import VOCAB, random_model
from zoo.math import param_count
from zoo.pretrained.architectures import architecture_for
from zoo.pretrained.hf_config import config_from_hf, config_to_hf

TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, 12)).tolist()
_BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
MODELS = [
    {
        # GQA 4:2, head_dim 16 != 32 / 4, window 5 < 12 tokens, alternating layers, soft-caps
        # small enough to bend the scores and logits of a random model.
        "name": "gemma2-gqa",
        "model_type": "gemma2",
        "config": _BASE
        | {
            "num_hidden_layers": 3,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 5,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.5,
            "final_logit_softcapping": 2.0,
        },
    },
    {
        # MQA, head_dim = hidden / heads, window 32 > 12 tokens, explicit layer_types, untied.
        "name": "gemma2-mqa-untied",
        "model_type": "gemma2",
        "config": _BASE
        | {
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "sliding_window": 32,
            "query_pre_attn_scalar": 8,
            "layer_types": ["full_attention", "sliding_attention"] * 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
            "tie_word_embeddings": False,
        },
    },
    {
        # 5 layers with a global layer every 3rd (period does not divide), window 4, linear rope
        # scaling on the global layers and a local theta of their own.
        "name": "gemma3-gqa-linear-rope",
        "model_type": "gemma3_text",
        "config": _BASE
        | {
            "num_hidden_layers": 5,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 4,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 12,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        },
    },
    {
        # MHA, window 20 > 12 tokens, untied, final soft-capping. (Gemma 3 also keeps the
        # attention soft-cap option, but transformers' default SDPA attention ignores it.)
        "name": "gemma3-mha-untied-softcap",
        "model_type": "gemma3_text",
        "config": _BASE
        | {
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "head_dim": 8,
            "sliding_window": 20,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": False,
        },
    },
]
NAMES = [m["name"] for m in MODELS]
_GEMMA = dict(
    vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=48, max_seq_len=64, norm_eps=1e-6,
    norm_plus_one=True, mlp="geglu", sandwich_norm=True, embed_scale=True,
)  # fmt: skip
ZOO_CONFIGS = {
    "zoo-gemma2": zoo.Config(
        **_GEMMA, n_layers=3, n_kv_heads=2, head_dim=16, query_scale=10.0, attn_softcap=2.0,
        final_softcap=4.0, sliding_window=3, layer_types=("sliding", "full", "sliding"),
    ),
    "zoo-gemma3": zoo.Config(
        **_GEMMA, n_layers=3, n_kv_heads=1, qk_norm=True, tie_embeddings=False,
        sliding_window=6, layer_types=("sliding", "sliding", "full"), local_rope_theta=50.0,
        rope_scaling=RopeScaling(kind="linear", factor=4.0),
    ),
}  # fmt: skip
PRESETS = ["gemma2-2b", "gemma2-9b", "gemma3-1b", "gemma3-4b"]
NAIVE = zoo.Policy(attention=Naive())
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def relative_error(ours, reference) -> float:
    return float(np.max(np.abs(np.asarray(ours) - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="module")
def zoo_models():
    return {
        name: random_model(c, i).with_policy(NAIVE)
        for i, (name, c) in enumerate(ZOO_CONFIGS.items())
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory, zoo_models):
    out = tmp_path_factory.mktemp("gemma")
    for name, model in zoo_models.items():
        zoo.save_pretrained(model, out / name)
    # The presets' config.json as save_pretrained would write it, for HF's meta-device count.
    meta = []
    for name in PRESETS:
        config = zoo.preset(name)
        hf = config_to_hf(architecture_for(config), config, "float32")
        fields = {k: v for k, v in hf.items() if k not in ("architectures", "dtype", "model_type")}
        meta.append({"name": name, "model_type": hf["model_type"], "config": fields})
    job = {"models": MODELS, "dirs": list(ZOO_CONFIGS), "tokens": TOKENS, "count": meta}
    run_reference("tiny", job, out)
    return out


@pytest.fixture(scope="module")
def loaded(reference):
    # Naive: Gemma 2 soft-caps scores, which the default kernel (xla) refuses.
    return {name: zoo.load_pretrained(reference / name, policy=NAIVE) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(reference, loaded, name):
    reference = np.load(reference / f"{name}.npz")["logits"]
    ours = forward(loaded[name], jnp.asarray(TOKENS))
    assert ours.shape == reference.shape
    # float32 on both sides; 1e-4 of the largest logit leaves room for summation order only.
    assert relative_error(ours, reference) < 1e-4


def test_config_is_read_from_the_checkpoint(loaded):
    g2, g3 = loaded["gemma2-gqa"].config, loaded["gemma3-gqa-linear-rope"].config
    assert g2.layer_types == ("sliding", "full", "sliding") and g2.sliding_window == 5
    assert (g2.query_scale, g2.attn_softcap, g2.final_softcap, g2.qk_norm) == (24, 1.5, 2.0, False)
    assert g3.layer_types == ("sliding", "sliding", "full", "sliding", "sliding")
    assert (g3.rope_theta, g3.local_rope_theta, g3.qk_norm) == (10_000.0, 100.0, True)
    assert g3.rope_scaling == RopeScaling(kind="linear", factor=2.0)
    assert loaded["gemma2-mqa-untied"].config.query_scale is None  # = head_dim


@pytest.mark.parametrize("name", list(ZOO_CONFIGS))
def test_save_pretrained_reloads_in_transformers(zoo_models, reference, name):
    reloaded = np.load(reference / f"{name}.npz")["logits"]
    assert relative_error(reloaded, forward(zoo_models[name], jnp.asarray(TOKENS))) < 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_load_save_load_is_exact(loaded, tmp_path, name):
    zoo.save_pretrained(loaded[name], tmp_path)
    again = zoo.load_pretrained(tmp_path, policy=NAIVE)
    assert again.config == loaded[name].config
    for a, b in zip(jax.tree.leaves(loaded[name]), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cached_decode_equals_full_forward(loaded):
    """Gemma 3 with the contiguous KV cache (Gemma 2 decodes in the engine test): prefill 7
    tokens, then decode one at a time, the window of 4 sliding past the prefill, each layer
    with its own rope table."""
    model, tokens = loaded["gemma3-gqa-linear-rope"], jnp.asarray(TOKENS)
    full = forward(model, tokens)
    step = eqx.filter_jit(lambda m, t, cache: m.forward(t, cache=cache))
    out = step(model, tokens[:, :7], model.init_cache(2, 16))
    logits, cache = [out.logits], out.cache
    for i in range(7, tokens.shape[1]):
        out = step(model, tokens[:, i : i + 1], cache)
        logits.append(out.logits)
        cache = out.cache
    np.testing.assert_allclose(jnp.concatenate(logits, axis=1), full, rtol=1e-5, atol=1e-5)


def test_engine_equals_full_forward(loaded):
    """infer.Engine (paged cache, chunked prefill, continuous batching) on Gemma 2's soft-capped,
    alternating-window layers: each generated token is the full forward's greedy choice at its
    position (checked teacher-forced, all rows in one forward: right padding changes nothing
    before it under a causal mask)."""
    model = loaded["gemma2-gqa"]
    engine = Engine(model, max_batch=2, max_len=48, page_size=8, chunk=16)
    prompts = [TOKENS[0][:9], TOKENS[1], TOKENS[0][:3]]
    requests = [engine.submit(p, max_new_tokens=5) for p in prompts]
    engine.run()
    rows = [p + r.tokens for p, r in zip(prompts, requests, strict=True)]
    padded = jnp.asarray([row + [0] * (24 - len(row)) for row in rows])
    greedy = np.asarray(jnp.argmax(forward(model, padded), axis=-1))
    for prompt, request, row in zip(prompts, requests, greedy, strict=True):
        assert request.done and request.tokens == row[len(prompt) - 1 : len(prompt) + 4].tolist()


@pytest.mark.parametrize("name", PRESETS)
def test_preset_parameter_counts_match_transformers(reference, name):
    """zoo.math's exact count equals the HF model's, built on the meta device from the preset's
    own config.json; and our model has that many parameters (shapes only, no memory)."""
    counts = json.loads((reference / "counts.json").read_text())
    config = zoo.preset(name)
    skeleton = eqx.filter_eval_shape(zoo.Transformer, config, key=jax.random.key(0))
    ours = sum(x.size for x in jax.tree.leaves(skeleton) if isinstance(x, jax.ShapeDtypeStruct))
    assert param_count(config) == counts[name] == ours


# --- configs in older spellings, and what is refused -------------------------------------------

_GEMMA3_HF = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    **_BASE,
    "num_hidden_layers": 7,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 4,
}


def test_gemma3_older_rope_spelling_reads_the_same():
    """Top-level rope_theta / rope_local_base_freq / rope_scaling and sliding_window_pattern, as
    configs written before transformers 5 have them."""
    old = _GEMMA3_HF | {
        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }  # fmt: skip
    new = _GEMMA3_HF | {
        "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    assert config_from_hf(old)[1] == config_from_hf(new)[1]
    assert config_from_hf(old)[1].layer_types[5] == "full"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not"),
        ({"attention_bias": True}, "attention_bias=True, which the zoo does not implement"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type='yarn'"),
        ({"altup_num_inputs": 4}, "fields the zoo does not implement: ['altup_num_inputs']"),
        ({"layer_types": ["full_attention"]}, "layer_types must list 7"),
    ],
)
def test_unimplemented_config_fields_are_refused(changes, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        config_from_hf(_GEMMA3_HF | changes)


def test_xla_kernel_is_refused_when_the_policy_is_set(loaded):
    """Soft-capping is checked when the policy changes (or the model is built), not on the
    first call; the message names the kernel, the feature and the kernels that can."""
    with pytest.raises(
        ValueError,
        match=r"kernel 'xla' cannot compute soft-capping of attention scores \(softcap=1\.5\); "
        "kernels that can: naive, flash",
    ):
        loaded["gemma2-gqa"].with_policy(attention="xla")


@pytest.mark.parametrize("name", ["gemma2-gqa", "gemma3-gqa-linear-rope"])
def test_every_default_loads_and_generates(reference, name):
    """No policy given: the default kernel serves the checkpoint (naive on a CPU for Gemma 2,
    whose scores xla cannot cap) and generation runs with the engine's defaults."""
    model = zoo.load_pretrained(reference / name)
    assert model.policy.kernel_name == ("naive" if name.startswith("gemma2") else "xla")
    expected = np.load(reference / f"{name}.npz")["logits"]
    assert relative_error(forward(model, jnp.asarray(TOKENS)), expected) < 1e-4  # as above
    out = infer.generate(model, [TOKENS[0]], max_new_tokens=4, sampler=infer.Greedy(),
                         key=jax.random.key(0))  # fmt: skip
    assert len(out[0]) == 4


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"layer_types": ("full",)}, "layer_types has 1 entries but n_layers=2"),
        ({"layer_types": ("full", "sliding")}, "'sliding' layers but sliding_window is None"),
        ({"local_rope_theta": 10.0}, "local_rope_theta is the theta of the sliding layers"),
        ({"attn_softcap": 0.0}, "attn_softcap must be > 0"),
        ({"layer_types": ("full", "global")}, "layer_types='global' is unknown"),
    ],
)
def test_bad_pattern_configs_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        zoo.preset("tiny-llama", **changes)


def test_layer_types_survive_json():
    config = ZOO_CONFIGS["zoo-gemma3"]
    assert zoo.Config.from_dict(config.to_dict()) == config


# --- GGUF (llama.cpp's gemma2 / gemma3) --------------------------------------------------------

# HF name -> GGUF name, as llama.cpp's convert_hf_to_gguf.py writes Gemma (gguf.constants'
# MODEL_TENSORS for GEMMA2 / GEMMA3).
_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# GGUF can say only what llama.cpp reads: score scale 1/sqrt(head_dim), global layers every 2nd
# (Gemma 2) or 6th (Gemma 3), local rope theta 10000.
GGUF_CONFIGS = {
    "gemma2": ZOO_CONFIGS["zoo-gemma2"].replace(query_scale=None),
    "gemma3": ZOO_CONFIGS["zoo-gemma3"].replace(
        n_layers=7, sliding_window=4, layer_types=("sliding",) * 5 + ("full", "sliding"),
        local_rope_theta=10_000.0, rope_theta=1e6,
    ),
}  # fmt: skip


def write_gemma_gguf(model: zoo.Transformer, arch: str, directory) -> str:
    """The model as convert_hf_to_gguf.py would write its HF checkpoint: GGUF names, 1 added to
    every norm weight, the metadata llama.cpp reads."""
    import gguf
    from safetensors.numpy import load_file

    c = model.config
    zoo.save_pretrained(model, directory / "hf")
    path = str(directory / f"{arch}.gguf")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(c.n_layers)
    writer.add_context_length(c.max_seq_len)
    writer.add_embedding_length(c.d_model)
    writer.add_feed_forward_length(c.d_ff)
    writer.add_head_count(c.n_heads)
    writer.add_head_count_kv(c.n_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_softcap)
        writer.add_final_logit_softcapping(c.final_softcap)
    else:
        writer.add_rope_freq_base(c.rope_theta)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_scaling.factor)
    for name, w in load_file(directory / "hf" / "model.safetensors").items():
        if name.endswith("norm.weight"):
            w = w + 1.0
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            name = f"blk.{layer}.{_TO_GGUF[rest.removesuffix('.weight')]}.weight"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[name]  # fmt: skip
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", list(GGUF_CONFIGS))
def test_gguf_loads_like_the_model_it_was_written_from(tmp_path, arch):
    model = random_model(GGUF_CONFIGS[arch], 7).with_policy(NAIVE)
    loaded = zoo.load_pretrained(write_gemma_gguf(model, arch, tmp_path), policy=NAIVE)
    # GGUF stores the norm epsilon as a float32.
    assert loaded.config.norm_eps == pytest.approx(model.config.norm_eps, rel=1e-7)
    assert loaded.config == model.config.replace(norm_eps=loaded.config.norm_eps)
    want = forward(model, jnp.asarray(TOKENS))
    # The norms' +1 and -1 round in float32 (offsets ~0.1 + 1 lose ~2^-24 relative).
    assert relative_error(forward(loaded, jnp.asarray(TOKENS)), np.asarray(want)) < 1e-5


def test_scan_loop_and_unrolled_layers_agree(loaded):
    """Per-layer windows and rope tables reach each layer alike whether the stack is scanned,
    looped over stacked weights, or stored one block per layer."""
    model, tokens = loaded["gemma3-gqa-linear-rope"], jnp.asarray(TOKENS)
    want = forward(model, tokens)
    for variant in (model.with_policy(scan_layers=False), model.with_policy(storage="unrolled")):
        np.testing.assert_allclose(forward(variant, tokens), want, rtol=1e-6, atol=1e-6)
