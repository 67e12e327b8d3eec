"""DeepSeek-V3 (MLA, latent KV cache, V3 routing, YaRN) and V2 against HF transformers: tiny
random DeepseekV3ForCausalLM / DeepseekV2ForCausalLM checkpoints load with transformers' logits,
zoo.save_pretrained reloads in transformers, decode over the latent cache (absorbed) equals the
full forward (expanded), the serving engine equals greedy decoding alone, and the
DeepSeek-V2-Lite / V3 presets have exactly the parameters of the HF models built from the same
config values.

One reference job (one subprocess) serves the module; forwards are jitted once per config.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import zoo
from infer.engine import Engine
from layers.paged_cache import LatentPages
from layers.rotary import RopeScaling
from tests.reference.runner import run_reference
from tests.zoo.random_model import VOCAB, random_model
from zoo import math as zm
from zoo.pretrained.hf_config import config_from_hf

TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12)).tolist()
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    # mscale != mscale_all_dim: cos/sin are scaled (attention_factor != 1) and so is the softmax.
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
_BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
}
# A: low-rank q, 4 groups of 2 experts (2 kept), one dense layer, yarn, interleaved rope.
_A = _BASE | {
    "q_lora_rank": 12,
    "kv_lora_rank": 24,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 3,
    "first_k_dense_replace": 1,
    "rope_parameters": _YARN,
}
# B: plain q, values wider than q/k heads, no groups, every layer MoE, no rope scaling, rope
# dims in halves, gates not renormalised.
_B = _BASE | {
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "v_head_dim": 20,
    "n_routed_experts": 4,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 0,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.5,
    "rope_interleave": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
}
# DeepSeek-V2: softmax routing limited to the best group (scored by its best expert).
_V2 = _BASE | {
    "q_lora_rank": 12,
    "kv_lora_rank": 16,
    "v_head_dim": 8,
    "n_routed_experts": 6,
    "n_group": 3,
    "topk_group": 1,
    "topk_method": "group_limited_greedy",
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.5,
    "rope_parameters": _YARN,
}
MODELS = [
    {"name": "ds-a", "model_type": "deepseek_v3", "config": _A},
    {"name": "ds-v2", "model_type": "deepseek_v2", "config": _V2},
    {"name": "ds-b", "model_type": "deepseek_v3", "config": _B},
    # The same weights as ds-a with the experts stacked as transformers 5 holds them.
    {"name": "ds-a-fused", "model_type": "deepseek_v3", "config": _A, "fused": True},
]
NAMES = [m["name"] for m in MODELS]
ZOO_CONFIGS = {
    "zoo-ds-yarn": zoo.preset(
        "tiny-deepseek-v3",
        vocab_size=VOCAB,
        rope_scaling=RopeScaling(
            kind="yarn", factor=8.0, original_max_seq_len=16, mscale=0.9, mscale_all_dim=0.8
        ),
    ),
    "zoo-ds-v2": zoo.preset(
        "tiny-deepseek-v3",
        vocab_size=VOCAB,
        router_scoring="softmax",
        router_bias=False,
        router_normalize=False,
        router_group_score="max",
    ),
    "zoo-ds-dense": zoo.preset(
        "tiny-deepseek-v3", vocab_size=VOCAB, n_experts=0, mla_q_rank=None, n_layers=2
    ),
}
# The published config.json values (deepseek-ai/DeepSeek-V2-Lite, deepseek-ai/DeepSeek-V3).
HF_FULL_SIZE = [
    {
        "name": "deepseek-v2-lite",
        "model_type": "deepseek_v2",
        "config": {
            "vocab_size": 102400,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "n_shared_experts": 2,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": None,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
        },
    },
    {
        "name": "deepseek-v3",
        "model_type": "deepseek_v3",
        "config": {
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_shared_experts": 1,
            "n_routed_experts": 256,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "first_k_dense_replace": 3,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
        },
    },
]
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def relative_error(ours, reference) -> float:
    return float(np.max(np.abs(np.asarray(ours) - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="module")
def zoo_models():
    return {name: random_model(c, i) for i, (name, c) in enumerate(ZOO_CONFIGS.items())}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, zoo_models):
    out = tmp_path_factory.mktemp("deepseek")
    for name, model in zoo_models.items():
        zoo.save_pretrained(model, out / name)
    job = {"models": MODELS, "dirs": list(ZOO_CONFIGS), "tokens": TOKENS, "count": HF_FULL_SIZE}
    run_reference("tiny", job, out)
    return out


@pytest.fixture(scope="module")
def loaded(reference):
    return {name: zoo.load_pretrained(reference / name) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(reference, loaded, name):
    expected = np.load(reference / f"{name}.npz")["logits"]
    assert relative_error(forward(loaded[name], jnp.asarray(TOKENS)), expected) < 1e-4


def test_config_is_read_from_the_checkpoint(loaded):
    a, b = loaded["ds-a"].config, loaded["ds-b"].config
    assert (a.mla_kv_rank, a.mla_q_rank, a.mla_rope_dim, a.mla_v_head_dim) == (24, 12, 8, 12)
    assert (a.head_dim, a.first_dense_layers, a.router_groups, a.router_topk_groups) == (
        16,
        1,
        4,
        2,
    )
    assert a.rope_scaling.kind == "yarn" and a.mla_rope_interleave and a.router_bias
    assert (b.mla_q_rank, b.rope_scaling, b.mla_rope_interleave) == (None, None, False)
    assert (b.router_normalize, b.router_scale, b.first_dense_layers) == (False, 1.5, 0)
    v2 = loaded["ds-v2"].config
    assert (v2.router_scoring, v2.router_bias, v2.router_normalize) == ("softmax", False, False)
    assert (v2.router_groups, v2.router_topk_groups, v2.router_group_score) == (3, 1, "max")


@pytest.mark.parametrize("name", list(ZOO_CONFIGS))
def test_save_pretrained_reloads_in_transformers(zoo_models, reference, name):
    reloaded = np.load(reference / f"{name}.npz")["logits"]
    assert relative_error(reloaded, forward(zoo_models[name], jnp.asarray(TOKENS))) < 1e-4


@pytest.mark.parametrize("name", ["ds-a", "ds-v2"])
def test_load_save_load_is_exact(loaded, tmp_path, name):
    zoo.save_pretrained(loaded[name], tmp_path)
    again = zoo.load_pretrained(tmp_path)
    assert again.config == loaded[name].config
    assert jax.tree.structure(again) == jax.tree.structure(loaded[name])
    for x, y in zip(jax.tree.leaves(loaded[name]), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(x, y)


def test_mtp_layers_are_ignored_and_other_extra_tensors_refused(reference, tmp_path):
    """Real V3 checkpoints hold the multi-token-prediction module as layer num_hidden_layers."""
    (tmp_path / "config.json").write_text((reference / "ds-a" / "config.json").read_text())
    tensors = load_file(reference / "ds-a" / "model.safetensors")
    mtp = {"model.layers.3.eh_proj.weight": np.zeros((32, 64), np.float32)}
    save_file(tensors | mtp, tmp_path / "model.safetensors", metadata={"format": "pt"})
    expected = np.load(reference / "ds-a.npz")["logits"]
    # An MTP layer missing its block (zoo/pretrained/deepseek_mtp.py): left out, said so.
    with pytest.warns(UserWarning, match=r"multi-token-prediction module .* \(model.mtp is None\)"):
        model = zoo.load_pretrained(tmp_path)
    assert model.mtp is None
    assert relative_error(forward(model, jnp.asarray(TOKENS)), expected) < 1e-4
    stray = {"model.layers.1.self_attn.k_proj.weight": np.zeros((4, 4), np.float32)}
    save_file(tensors | stray, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not: model\.layers\.1\.self_attn\.k_proj"):
        zoo.load_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["ds-a", "ds-b"])
def test_latent_cache_decode_equals_full_forward(loaded, name):
    """Prefill 5 tokens, then decode one at a time over the latent cache (absorbed
    up-projections): the logits of the full forward (expanded keys and values)."""
    model, tokens = loaded[name], jnp.asarray(TOKENS)
    cache, c = model.init_cache(2, 16), model.config
    layers = jax.tree.leaves(cache.layers, is_leaf=lambda x: isinstance(x, LatentPages))
    assert all(isinstance(x, LatentPages) for x in layers)  # one pool per layer: the latent
    assert {x.c.shape[-1] for x in layers} == {c.mla_kv_rank + c.mla_rope_dim}
    step = eqx.filter_jit(lambda m, t, cache: m.forward(t, cache=cache))
    out = step(model, tokens[:, :5], cache)
    logits = [out.logits]
    for t in range(5, tokens.shape[1]):
        out = step(model, tokens[:, t : t + 1], out.cache)
        logits.append(out.logits)
    full = forward(model, tokens)
    # The same float32 products associated differently (q . (W_uk c) vs (q W_uk) . c): rounding
    # of ~sqrt(48) x 1.2e-7 relative per sum, so 1e-5 has two orders of margin.
    assert relative_error(jnp.concatenate(logits, axis=1), np.asarray(full)) < 1e-5


def test_engine_equals_greedy_decoding_alone(loaded):
    """The engine's paged latent pools give each request the greedy tokens of full forwards
    (padded to TOKENS' shape, whose forward is compiled already: a causal model's logits at a
    position ignore the padding after it)."""
    model, width, n_new = loaded["ds-a"], len(TOKENS[0]), 4
    engine = Engine(model, max_batch=2, max_len=32, page_size=8, chunk=16)
    prompts = [TOKENS[0][:7], TOKENS[1][:8], TOKENS[0][:3]]
    requests = [engine.submit(p, max_new_tokens=n_new) for p in prompts]
    engine.run()
    for prompt, request in zip(prompts, requests, strict=True):
        tokens = list(prompt)
        for _ in range(n_new):
            padded = jnp.asarray([tokens + [0] * (width - len(tokens))] * len(TOKENS))
            tokens.append(int(jnp.argmax(forward(model, padded)[0, len(tokens) - 1])))
        assert request.tokens == tokens[len(prompt) :]


@pytest.mark.parametrize("name", [m["name"] for m in HF_FULL_SIZE])
def test_preset_param_counts_equal_transformers(reference, name):
    """HF's DeepseekV2/V3 modules hold no multi-token-prediction layers (checkpoints store them
    past num_hidden_layers): both counts are of the causal LM alone."""
    counts = json.loads((reference / "counts.json").read_text())
    assert zm.param_count(zoo.preset(name)) == counts[name]


def test_latent_cache_is_what_mla_saves():
    c = zoo.preset("deepseek-v3")
    bf16 = zoo.Policy(compute_dtype="bfloat16")
    # 61 layers x (512 + 64) x 2 bytes, against 61 x 128 heads x (192 + 128) x 2 bytes.
    assert zm.kv_cache_bytes_per_token(c, bf16) == 61 * 576 * 2
    assert zm.per_head_kv_cache_bytes_per_token(c, bf16) == 61 * 128 * 320 * 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"topk_method": "greedy"}, "topk_method='greedy', which the zoo does not implement"),
        ({"attention_bias": True}, "attention_bias=True, which the zoo does not implement"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 differs from num_attention_heads=4"),
        ({"qk_head_dim": 12}, "qk_head_dim=12 contradicts"),
        ({"rope_parameters": _YARN | {"rope_type": "linear"}}, "rope_type='linear' is not"),
        ({"rope_parameters": _YARN | {"attention_factor": 2.0}}, r"not \['attention_factor'\]"),
        ({"some_new_knob": 1}, r"does not implement: \['some_new_knob'\]"),
    ],
)
def test_config_fields_the_zoo_does_not_implement_are_refused(change, message):
    hf = {"architectures": ["DeepseekV3ForCausalLM"], **_A, **change}
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc' is not supported"),
        ({"norm_topk_prob": True}, "norm_topk_prob=True, which the zoo does not implement"),
        ({"rope_interleave": False}, r"does not implement: \['rope_interleave'\]"),
    ],
)
def test_deepseek_v2_fields_the_zoo_does_not_implement_are_refused(change, message):
    hf = {"architectures": ["DeepseekV2ForCausalLM"], **_V2, **change}
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"n_kv_heads": 2}, "n_kv_heads=2 must equal n_heads=4"),
        ({"mla_rope_dim": 24}, r"mla_rope_dim=24 must be in \(0, head_dim=24\)"),
        ({"router_groups": 8, "router_topk_groups": 4}, "leaves 1 expert per group"),
        ({"n_experts_per_token": 5}, "exceeds the 4 experts of the router_topk_groups=2"),
        ({"router_scoring": "softmax"}, "router_bias .* needs router_scoring='sigmoid'"),
    ],
)
def test_bad_deepseek_configs_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        zoo.preset("tiny-deepseek-v3", **change)
