"""zoo.add_lora / merge_adapter / split_trainable on whole models (stacked and unrolled, under
jit, sharded), and the PEFT file format against `peft` itself in the reference venv."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shard
import zoo
from data.packing import to_batch
from layers import Linear, LoRA
from tests.reference.runner import run_reference
from tests.zoo.random_model import HF_LLAMA, VOCAB, random_model
from training.step import split_model, train_step
from zoo.adapter import TARGETS, split_trainable

EPS = float(jnp.finfo(jnp.float32).eps)
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12)).astype(np.int32)
CONFIG = zoo.preset(
    "tiny-llama", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
forward = eqx.filter_jit(lambda model, tokens: model(tokens))


def randomize_adapters(model, seed: int = 1, std: float = 0.2):
    """Every LoRA A and B drawn at random (a new adapter's B = 0 would hide any mistake)."""
    rng = np.random.default_rng(seed)

    def draw(path, w):
        name = jax.tree_util.keystr(path)
        if "lora_a" in name or "lora_b" in name:
            return jnp.asarray(std * rng.standard_normal(w.shape), w.dtype)
        return w

    return jax.tree_util.tree_map_with_path(draw, model)


@pytest.fixture(scope="module")
def base():
    return random_model(CONFIG, 0)


@pytest.mark.parametrize("storage", ["stacked", "unstacked"])
def test_new_adapters_leave_the_logits_unchanged(base, storage):
    model = base if storage == "stacked" else base.with_policy(storage="unrolled")
    adapted = zoo.add_lora(model, ALL, rank=4, alpha=8, key=jax.random.key(0))
    np.testing.assert_array_equal(forward(adapted, TOKENS), forward(model, TOKENS))
    q = adapted.stacks[0].blocks[0].attn.q_proj
    assert isinstance(q, LoRA) and q.base is not None
    layers = (2,) if storage == "stacked" else ()
    assert q.lora_a.shape == (*layers, 32, 4) and q.lora_b.shape == (*layers, 4, 4, 8)


def test_stacked_and_unrolled_get_the_same_adapters(base):
    stacked = zoo.add_lora(base, ALL, rank=4, alpha=8, key=jax.random.key(0)).with_policy(
        storage="unrolled"
    )
    unrolled = zoo.add_lora(
        base.with_policy(storage="unrolled"), ALL, rank=4, alpha=8, key=jax.random.key(0)
    )
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(unrolled), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("storage", ["stacked", "unstacked"])
def test_merged_equals_unmerged(base, storage):
    """Merging changes only the rounding of each adapted projection: x·W + s·(x·A)·B against
    x·(W + s·A·B), both within (n + rank + 2)·eps relative to |x|·|W| of the exact value for a
    reduction of length n <= d_ff (tests/layers/test_lora.py checks that bound per projection).
    The logits see 7 such projections per layer, each error carried through the layers above
    at about unit gain (random weights of std 0.1), so their difference stays below
    2 · n_layers · 7 · (d_ff + rank + 2) · eps of the logits' scale."""
    model = base if storage == "stacked" else base.with_policy(storage="unrolled")
    adapted = randomize_adapters(zoo.add_lora(model, ALL, rank=4, alpha=8, key=jax.random.key(0)))
    merged = zoo.merge_adapter(adapted)
    assert not any(
        isinstance(n, LoRA) for n in jax.tree.leaves(merged, is_leaf=lambda n: isinstance(n, LoRA))
    )
    assert isinstance(merged.stacks[0].blocks[0].mlp.down, Linear)
    unmerged_logits = forward(adapted, TOKENS)
    merged_logits = forward(merged, TOKENS)
    changed = np.max(np.abs(unmerged_logits - forward(model, TOKENS)))
    scale = float(np.max(np.abs(unmerged_logits)))
    tolerance = 2 * CONFIG.n_layers * 7 * (CONFIG.d_ff + 4 + 2) * EPS * scale
    assert changed > 1000 * tolerance  # the adapters matter
    assert np.max(np.abs(merged_logits - unmerged_logits)) <= tolerance


def test_split_trains_the_adapters_alone(base):
    adapted = zoo.add_lora(base, ["q_proj", "v_proj"], rank=4, alpha=8, key=jax.random.key(0))
    trainable, frozen = split_trainable(adapted)
    assert jax.tree.structure(split_model(adapted)[0]) == jax.tree.structure(trainable)
    # Per layer: q A [32, 4] + B [4, 4, 8], v A [32, 4] + B [4, 2, 8].
    per_layer = 32 * 4 + 4 * 32 + 32 * 4 + 4 * 16
    assert sum(x.size for x in jax.tree.leaves(trainable)) == CONFIG.n_layers * per_layer
    assert len(jax.tree.leaves(trainable)) == 4  # stacked: one A and one B per projection
    n_base = sum(x.size for x in jax.tree.leaves(base))
    assert sum(x.size for x in jax.tree.leaves(frozen)) == n_base
    state = optax.adamw(1e-3).init(trainable)
    moments = [x for x in jax.tree.leaves(state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * CONFIG.n_layers * per_layer
    # A model without adapters trains every float array, as before.
    assert sum(x.size for x in jax.tree.leaves(split_model(base)[0])) == n_base


@pytest.mark.parametrize(
    ("preset", "targets"),
    [("tiny-llama", ALL), ("tiny-gpt2", ["c_attn", "c_fc"]), ("tiny-moe", ["q_proj", "up_proj"])],
)
def test_lora_param_count_predicts_the_trainable_parameters(preset, targets):
    config = zoo.preset(preset, n_layers=2)
    model = eqx.filter_eval_shape(zoo.Transformer, config, key=jax.random.key(0))
    adapted = eqx.filter_eval_shape(
        lambda m: zoo.add_lora(m, targets, 4, 8, key=jax.random.key(0)), model
    )
    trainable = sum(x.size for x in jax.tree.leaves(split_trainable(adapted)[0]))
    assert zoo.math.lora_param_count(config, targets, 4) == trainable


def test_a_training_step_moves_only_the_adapters(base):
    adapted = zoo.add_lora(base, ALL, rank=4, alpha=8, key=jax.random.key(0))
    params, static = split_model(adapted)
    optimizer = optax.adamw(1e-2)
    batch = to_batch(TOKENS, np.ones_like(TOKENS))
    step = jax.jit(lambda p, s, b: train_step(p, s, b, static=static, optimizer=optimizer, accum=1))
    new_params, _, metrics = step(params, optimizer.init(params), batch)
    assert np.isfinite(metrics.loss)
    b = new_params.stacks[0].blocks[0].attn.q_proj.lora_b
    assert np.any(b != 0)  # B leaves zero: the adapters learn
    after = eqx.combine(new_params, static)
    for path in ("attn.q_proj", "mlp.down"):
        old, new = base.stacks[0].blocks[0], after.stacks[0].blocks[0]
        for name in path.split("."):
            old, new = getattr(old, name), getattr(new, name)
        np.testing.assert_array_equal(new.base.weight, old.weight)


def test_targets_that_match_nothing_list_what_exists():
    gpt2 = zoo.Transformer(
        zoo.preset("tiny-gpt2", vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4),
        key=jax.random.key(0),
    )
    with pytest.raises(ValueError, match=r"match no projection.*'c_attn'.*'q_proj'"):
        zoo.add_lora(gpt2, ["gate_proj"], rank=2, alpha=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"unknown LoRA target\(s\) \['qproj'\]; known names"):
        zoo.add_lora(gpt2, ["qproj"], rank=2, alpha=2, key=jax.random.key(0))
    # GPT-2's own names: c_attn wraps q, k and v; c_proj both output projections.
    adapted = zoo.add_lora(gpt2, ["c_attn", "c_proj"], rank=2, alpha=2, key=jax.random.key(0))
    block = adapted.stacks[0].blocks[0]
    wrapped = [
        isinstance(p, LoRA)
        for p in (
            block.attn.q_proj,
            block.attn.v_proj,
            block.attn.o_proj,
            block.mlp.down,
            block.mlp.up,
        )
    ]
    assert wrapped == [True, True, True, True, False]


def test_peft_names_agree_with_the_llama_tensor_map(base):
    """The short names accepted by add_lora wrap the projections whose HF module has that name."""
    from zoo.pretrained.adapter import peft_modules
    from zoo.pretrained.architectures import architecture

    modules = peft_modules(architecture("LlamaForCausalLM"), base)
    assert {m.split(".")[-1]: (p,) for p, m in modules.items()} == {n: TARGETS[n] for n in ALL}


def test_adapters_twice_and_saving_unmerged_are_refused(base, tmp_path):
    adapted = zoo.add_lora(base, ["q_proj"], rank=2, alpha=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="already holds LoRA adapters; merge_adapter"):
        zoo.add_lora(adapted, ["v_proj"], rank=2, alpha=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"holds LoRA adapters.*merge_adapter"):
        zoo.save_pretrained(adapted, tmp_path / "model")
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        zoo.save_adapter(base, tmp_path / "adapter")
    zoo.save_pretrained(zoo.merge_adapter(adapted), tmp_path / "model")
    gpt2 = zoo.Transformer(
        zoo.preset("tiny-gpt2", vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=4),
        key=jax.random.key(0),
    )
    fused = zoo.add_lora(gpt2, ["c_attn"], rank=2, alpha=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="no PEFT module of their own in GPT2LMHeadModel"):
        zoo.save_adapter(fused, tmp_path / "gpt2")


def test_save_load_round_trip_and_bad_files(base, tmp_path):
    adapted = randomize_adapters(
        zoo.add_lora(base, ["q_proj", "o_proj", "up_proj"], rank=4, alpha=8, key=jax.random.key(0))
    )
    zoo.save_adapter(adapted, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["o_proj", "q_proj", "up_proj"]
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    loaded = zoo.load_adapter(base.with_policy(storage="unrolled"), tmp_path / "a")
    np.testing.assert_array_equal(forward(loaded, TOKENS), forward(adapted, TOKENS))
    with pytest.raises(ValueError, match="already holds"):
        zoo.save_adapter(adapted, tmp_path / "a")
    other = random_model(CONFIG.replace(d_model=48), 0)
    with pytest.raises(
        ValueError, match=r"tensor base_model\.model\.model\.layers\.0\.\S+ has shape \(4, 32\)"
    ):
        zoo.load_adapter(other, tmp_path / "a")
    from safetensors.numpy import load_file, save_file

    file = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(file)
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    save_file(
        {k: v for k, v in tensors.items() if k != name},
        tmp_path / "a" / "adapter_model.safetensors",
    )
    with pytest.raises(ValueError, match=f"lacks 1 tensor.*{name}"):
        zoo.load_adapter(base, tmp_path / "a")
    extra = "base_model.model.lm_head.lora_A.weight"
    save_file(
        {**tensors, extra: np.zeros((4, 32), np.float32)},
        tmp_path / "a" / "adapter_model.safetensors",
    )
    with pytest.raises(ValueError, match=f"fit no projection.*{extra}"):
        zoo.load_adapter(base, tmp_path / "a")
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        zoo.load_adapter(base, tmp_path)
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        zoo.load_adapter(base, tmp_path / "a")


# --- against peft ------------------------------------------------------------------------------

LLAMA = HF_LLAMA | {"tie_word_embeddings": False}


def relative_error(ours, reference) -> float:
    return float(np.max(np.abs(np.asarray(ours) - reference)) / np.max(np.abs(reference)))


@pytest.fixture(scope="module")
def peft_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("peft")
    job = {"config": LLAMA, "targets": ALL, "tokens": TOKENS.tolist()}
    run_reference("peft", job, out)
    return out


def test_peft_adapter_loads_with_peft_logits(peft_reference):
    base = zoo.load_pretrained(peft_reference / "base")
    model = zoo.load_adapter(base, peft_reference / "adapter")
    reference = np.load(peft_reference / "adapter.npz")["logits"]
    assert relative_error(forward(model, TOKENS), reference) < 1e-4
    # The adapter matters: without it the logits are far off.
    assert relative_error(forward(base, TOKENS), reference) > 1e-2


def test_our_adapter_loads_in_peft(peft_reference):
    base = zoo.load_pretrained(peft_reference / "base")
    ours = randomize_adapters(
        zoo.add_lora(
            base, ["q_proj", "k_proj", "down_proj"], rank=3, alpha=6, key=jax.random.key(0)
        ),
        seed=7,
    )
    zoo.save_adapter(ours, peft_reference / "zoo-adapter")
    run_reference("peft", {"dirs": ["zoo-adapter"], "tokens": TOKENS.tolist()}, peft_reference)
    reference = np.load(peft_reference / "zoo-adapter.npz")["logits"]
    assert relative_error(forward(ours, TOKENS), reference) < 1e-4


# --- sharded ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "mesh"), [("fsdp", {"fsdp": 8}), ("tp", {"data": 2, "tensor": 4})]
)
def test_sharded_adapters_equal_unsharded(base, preset, mesh):
    placement = shard.Placement(shard.mesh(**mesh), shard.ShardingRules.preset(preset))
    # Every split dim divides by 4 (heads, kv_heads, mlp, vocab) and 8 (embed).
    config = CONFIG.replace(n_heads=4, n_kv_heads=4, d_ff=64, vocab_size=96)
    model = random_model(config, 3)
    adapted = randomize_adapters(zoo.add_lora(model, ALL, rank=4, alpha=8, key=jax.random.key(0)))
    expected = forward(adapted, TOKENS)
    placed = placement.place(adapted)
    q = placed.stacks[0].blocks[0].attn.q_proj
    # lora_a [layers, embed, rank], lora_b [layers, rank, heads, head_dim].
    if preset == "fsdp":
        assert q.lora_a.sharding.shard_shape(q.lora_a.shape) == (2, 4, 4)
    else:
        assert q.lora_b.sharding.shard_shape(q.lora_b.shape) == (2, 4, 1, 8)
    with placement.context():
        logits = forward(placed, jnp.asarray(TOKENS))
    # As tests/shard/test_strategies.py: tp reorders the o_proj and down sums (partial sums per
    # device, then an all-reduce), which moves float32 results by a few ulps of the logits.
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    # add_lora under a placement puts the new adapters in their shardings.
    on_mesh = zoo.add_lora(
        placement.place(model),
        ["q_proj"],
        rank=4,
        alpha=8,
        placement=placement,
        key=jax.random.key(0),
    )
    a = on_mesh.stacks[0].blocks[0].attn.q_proj.lora_a
    assert a.sharding == placement.param_shardings(on_mesh).stacks[0].blocks[0].attn.q_proj.lora_a
