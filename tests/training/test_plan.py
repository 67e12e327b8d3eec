"""The plan printer's bytes per device equal those of the real shardings of a tiny model."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import shard
import zoo
from shard.axes import is_array_like
from training.plan import REMATS, USABLE, format_plan, main, plan, verdict
from zoo.math import HARDWARE

# Naive attention: the cheapest kernel to compile (the kernels are tested elsewhere).
CONFIG = zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256)
MOE = zoo.preset("tiny-moe")
# Multi-head latent attention: its own projections and a latent KV cache.
MLA = zoo.preset("tiny-deepseek-v3", n_layers=1, n_experts=0)
NAIVE = zoo.Policy(attention="naive")
CAPACITY = NAIVE.replace(moe_dispatch="capacity")
MESHES = {"fsdp": {"fsdp": 8}, "tp": {"data": 2, "tensor": 4}, "fsdp_tp": {"fsdp": 2, "tensor": 4}}
EP_MESH = {"fsdp": 2, "expert": 4}


def bytes_per_device(tree) -> int:
    """The most bytes any one device holds of the arrays in `tree`."""
    held: dict = {}
    for array in jax.tree.leaves(tree):
        for piece in array.addressable_shards:
            held[piece.device] = held.get(piece.device, 0) + piece.data.nbytes
    return max(held.values())


def zeros_in_shardings(config, policy, rules, mesh):
    """A model of zeros, each parameter a real array in its sharding: bytes are what count
    here, and zeros compile and run faster than the initialiser (tests/shard/test_init.py
    covers init_sharded)."""
    abstract = eqx.filter_eval_shape(zoo.Transformer, config, policy=policy, key=jax.random.key(0))
    params, static = eqx.partition(abstract, is_array_like)
    zeros = jax.jit(
        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), params),
        out_shardings=shard.param_shardings(abstract, rules, mesh),
    )()
    return eqx.combine(zeros, static)


@pytest.mark.parametrize("name", [*MESHES, "ep", "mla-tp"])
def test_plan_bytes_match_real_shardings(name):
    config, mesh_shape = (MOE, EP_MESH) if name == "ep" else (CONFIG, MESHES.get(name))
    config, mesh_shape = (MLA, MESHES["tp"]) if name == "mla-tp" else (config, mesh_shape)
    policy = CAPACITY if name == "ep" else NAIVE
    rules = shard.ShardingRules.preset(name.removeprefix("mla-"))
    mesh = shard.mesh(**mesh_shape)
    p = plan(config, policy, rules, mesh_shape, batch=8, seq=16, hardware=HARDWARE["h100"])

    model = zeros_in_shardings(config, policy, rules, mesh)
    assert p.params == bytes_per_device(model)
    if name == "ep":
        assert p.expert_params == bytes_per_device(model.stacks[0].blocks[0].mlp.experts)
        assert p.expert_params * 8 == 4 * 3 * MOE.n_layers * MOE.n_experts * 64 * 64
    else:
        assert p.expert_params == 0
    state = shard.init_opt_state(optax.adam(1e-3), model, rules, mesh)
    assert p.adam_state == bytes_per_device(state)
    # The real cache (its layout and logical axes from the model's init_cache), placed by them:
    # every leaf, keys, values and the rows' positions alike.
    cache = shard.Placement(mesh, rules).place_arrays(model.init_cache(8, 16))
    assert p.kv_cache == bytes_per_device(cache)


def test_plan_lists_each_strategys_collectives():
    h100 = HARDWARE["h100"]
    kinds = {}
    for name, mesh_shape in MESHES.items():
        rules = shard.ShardingRules.preset(name)
        p = plan(CONFIG, NAIVE, rules, mesh_shape, batch=8, seq=16, hardware=h100)
        kinds[name] = {(c.name, c.axis) for c in p.collectives}
    assert kinds["fsdp"] == {("all-gather", "fsdp"), ("reduce-scatter", "fsdp")}
    assert kinds["tp"] == {("all-reduce", "data"), ("all-reduce", "tensor")}
    assert kinds["fsdp_tp"] == {
        ("all-gather", "fsdp"),
        ("reduce-scatter", "fsdp"),
        ("all-reduce", "tensor"),
    }


def test_plan_moves_the_capacity_buffer_by_all_to_all():
    rules, h100 = shard.ShardingRules.preset("ep"), HARDWARE["h100"]
    p = plan(MOE, CAPACITY, rules, EP_MESH, batch=8, seq=16, hardware=h100)
    a2a = [c for c in p.collectives if c.name == "all-to-all"]
    assert {c.axis for c in a2a} == {"expert"}
    # Dispatch and combine, forward and backward, in each of the 2 MoE layers.
    assert sum(c.count for c in a2a) == 4 * 2
    # Each device holds 1 of the 8 sequences: 4 experts x 10 slots x 64 floats of it, and
    # keeps its own quarter (4 devices on the expert axis).
    assert all(c.bytes_per_device == 4 * 10 * 64 * 4 * 3 / 4 for c in a2a)
    # The compute beside it: at least the routed experts' matmuls of this device's 16 tokens
    # (2 experts of 3 [64, 64] matmuls each; capacity adds padding slots), twice that backward.
    forward, backward = sorted(a2a, key=lambda c: c.compute_s)
    assert forward.compute_s >= 16 * 2 * 2 * 3 * 64 * 64 / h100.peak_flops("float32")
    assert backward.compute_s == 2 * forward.compute_s
    dropless = plan(MOE, NAIVE, rules, EP_MESH, batch=8, seq=16, hardware=h100)
    assert not [c for c in dropless.collectives if c.name == "all-to-all"]


def test_cli_prints_the_table_and_a_verdict(capsys):
    argv = ["--model", "tiny-llama", "--mesh", "fsdp=4,tensor=2", "--batch-size", "8",
            "--seq-len", "64"]  # fmt: skip
    assert main(argv).fits
    out = capsys.readouterr().out
    assert "rules fsdp_tp" in out and "reduce-scatter" in out and "hides?" in out
    assert "verdict: fits one NVIDIA H100 SXM 80GB (80.0 GiB, 90% usable) with --remat none" in out
    main(["--model", "tiny-moe", "--mesh", "fsdp=2,expert=4", "--moe-dispatch", "capacity"])
    out = capsys.readouterr().out
    assert "rules ep" in out and "active" in out and "routed experts" in out and "all-to-all" in out


def test_the_kv_cache_is_the_models_own_windows_counted():
    """Gemma 2's sliding layers keep a ring of their window: the plan counts the real cache
    (eval_shape of init_cache), not every layer at full length."""
    sizes = dict(n_layers=2, sliding_window=4, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16,
                 d_ff=128, vocab_size=256, max_seq_len=64)  # fmt: skip
    gemma = zoo.preset("gemma2-2b", layer_types=("sliding", "full"), **sizes)
    rules, mesh_shape = shard.ShardingRules.preset("fsdp"), {"fsdp": 8}
    p = plan(gemma, NAIVE, rules, mesh_shape, batch=8, seq=32, hardware=HARDWARE["h100"])
    mesh = shard.mesh(**mesh_shape)
    model = zeros_in_shardings(gemma, NAIVE, rules, mesh)
    cache = shard.Placement(mesh, rules).place_arrays(model.init_cache(8, 32))
    assert p.kv_cache == bytes_per_device(cache)
    full = zoo.preset("gemma2-2b", layer_types=("full", "full"), **sizes)
    full_length = plan(full, NAIVE, rules, mesh_shape, batch=8, seq=32, hardware=HARDWARE["h100"])
    # The sliding layer holds 4 of 32 positions: about half of two full-length layers.
    assert p.kv_cache < 0.7 * full_length.kv_cache


@pytest.mark.parametrize(
    ("batch", "seq", "expected"),
    [(8, 4096, ("dots", 1)), (128, 4096, ("dots", 4)), (512, 4096, ("dots", 16)),
     (8, 32768, ("full", 1))],
)  # fmt: skip
def test_the_verdict_is_the_first_fitting_choice(batch, seq, expected):
    """llama3-8b in bfloat16 on 8 H100s: at 4096 tokens its activations do not fit without
    remat, with "dots" they do, larger batches in micro-batches; one 32k-token sequence per
    device needs "full". Every candidate before the chosen one (less recomputation first, then
    fewer micro-batches) does not fit."""
    config, policy = zoo.preset("llama3-8b"), zoo.Policy.of_dtype("bfloat16")
    rules, device = shard.ShardingRules.preset("fsdp"), zoo.math.DEVICES["h100-80gb"]
    run = dict(batch=batch, seq=seq, device=device)
    result = verdict(config, policy, rules, {"fsdp": 8}, **run)
    assert result.fits and (result.remat, result.grad_accum) == expected
    assert result.bytes_needed <= USABLE * device.memory
    counts = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % 8 == 0]
    earlier = [(r, m) for r in REMATS[: REMATS.index(result.remat) + 1] for m in counts]
    for remat, m in earlier[: earlier.index((result.remat, result.grad_accum))]:
        p = plan(config, policy.replace(remat=remat), rules, {"fsdp": 8}, batch=batch // m,
                 seq=seq, hardware=device)  # fmt: skip
        needed = p.params + p.grads + p.adam_state + p.activations[remat]
        assert needed > USABLE * device.memory, (remat, m)


def test_a_run_too_big_for_the_device_says_what_to_do():
    config, policy = zoo.preset("llama3-70b"), zoo.Policy.of_dtype("bfloat16")
    rules = shard.ShardingRules.preset("fsdp")
    result = verdict(config, policy, rules, {"fsdp": 8}, batch=8, seq=4096,
                     device=zoo.math.DEVICES["a100-40gb"])  # fmt: skip
    assert not result.fits and result.remat == "full"
    assert "does NOT fit one NVIDIA A100 40GB" in result.line()
    assert "a larger --mesh fsdp=N" in result.line()


def test_pipeline_plan_splits_the_layers_and_predicts_the_bubble():
    config, h100 = CONFIG.replace(n_layers=4), HARDWARE["h100"]
    rules = shard.ShardingRules.preset("dp")
    one = plan(config, NAIVE, rules, {"data": 2}, batch=8, seq=16, hardware=h100)
    piped = plan(
        config, NAIVE, rules, {"data": 2, "pipeline": 4}, batch=8, seq=16, hardware=h100,
        microbatches=4,
    )  # fmt: skip
    # Each of the 4 stages holds one of the 4 layers (float32 weights).
    assert one.params - piped.params == 3 * zoo.math.layer_params(config) * 4
    assert piped.bubble == pytest.approx(3 / 7)  # (S - 1) / (M + S - 1)
    # A quarter of the layers, kept over 7 ticks for 4 micro-batches.
    for remat in ("none", "dots", "full"):
        assert piped.activations[remat] == pytest.approx(one.activations[remat] / 4 * 7 / 4)
    assert {c.name for c in piped.collectives if c.axis == "pipeline"} == {"coll.-permute"}

    # Interleaved, 2 chunks per device: 4 x 2 + 3 ticks of half a stage each.
    inter = plan(
        config.replace(n_layers=8), NAIVE, rules, {"data": 2, "pipeline": 4}, batch=8, seq=16,
        hardware=h100, microbatches=4, schedule="interleaved", virtual=2,
    )  # fmt: skip
    one8 = plan(config.replace(n_layers=8), NAIVE, rules, {"data": 2}, batch=8, seq=16,
                hardware=h100)  # fmt: skip
    assert inter.bubble == pytest.approx(3 / 11) and inter.virtual == 2
    tokens, inputs = 8 * 16 // 2, config.d_model * 4  # a device's tokens; float32 inputs
    for remat in ("none", "dots", "full"):
        # 11 ticks' chunk inputs, and one chunk's activations (an eighth of the layers), all
        # of them whatever the remat policy (the chunk is run again in its backward).
        chunk = one8.activations["none"] / tokens / 8
        assert inter.activations[remat] == pytest.approx(tokens / 4 * (11 * inputs + chunk))
    regroups = [c for c in inter.collectives if c.name == "all-to-all"]
    assert len(regroups) == 2  # the layer weights into chunks, and their gradients back
    # Half of a stage's 2 float32 layers moves (the other half is already in place).
    layer_bytes = zoo.math.layer_params(config) * 4
    assert regroups[0].bytes_per_device == pytest.approx(2 * layer_bytes / 2)
    # 1F1B: at most 2 S - 1 = 7 stage inputs (4 here: M) plus one micro-batch's stage
    # activations; the bubble is GPipe's.
    f1b = plan(
        config, NAIVE, rules, {"data": 2, "pipeline": 4}, batch=8, seq=16, hardware=h100,
        microbatches=4, schedule="1f1b",
    )  # fmt: skip
    assert f1b.bubble == pytest.approx(3 / 7)
    for remat in ("none", "dots", "full"):
        stage = one.activations["none"] / tokens / 4
        assert f1b.activations[remat] == pytest.approx(tokens / 4 * (4 * inputs + stage))
    assert "at most 4 stage inputs in flight" in format_plan(f1b)

    bad = {"data": 2, "pipeline": 4}
    with pytest.raises(ValueError, match="2 micro-batches are fewer than the 4 pipeline stages"):
        plan(config, NAIVE, rules, bad, batch=8, seq=16, hardware=h100, microbatches=2)
    with pytest.raises(ValueError, match="pipeline size 4 does not divide the 3 layers"):
        plan(CONFIG.replace(n_layers=3), NAIVE, rules, bad, batch=8, seq=16, hardware=h100,
             microbatches=4)  # fmt: skip


def test_offloaded_adam_state_moves_to_the_host_line():
    rules, h100 = shard.ShardingRules.preset("fsdp"), HARDWARE["h100"]
    kept = plan(CONFIG, NAIVE, rules, MESHES["fsdp"], batch=8, seq=16, hardware=h100)
    moved = plan(
        CONFIG, NAIVE, rules, MESHES["fsdp"], batch=8, seq=16, hardware=h100,
        offload_opt_state=True,
    )  # fmt: skip
    assert (moved.adam_state, moved.adam_state_on_host) == (0, kept.adam_state)
    assert moved.params == kept.params and moved.grads == kept.grads
    assert "in host memory" in format_plan(moved) and "in host memory" not in format_plan(kept)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
        (["--seq-len", "-5"], "argument --seq-len: must be a positive integer, got -5"),
        (["--microbatches", "0"], "argument --microbatches: must be a positive integer, got 0"),
        # What train.py refuses, the plan refuses with train.py's words (it planned them before).
        (["--grad-accum", "3"], "argument --grad-accum: --batch-size 16 is not divisible by "
         "--grad-accum 3"),
        (["--microbatches", "2"], "argument --microbatches: 2 applies to a pipeline, and one "
         "device has no pipeline axis"),
        (["--mesh", "data=8", "--batch-size", "4"], "argument --batch-size: 4 does not split "
         "evenly over the 8 devices"),
        (["--model", "tiny-llama", "--seq-len", "100000"], "model 'tiny-llama': --seq-len 100000 "
         "(100000 tokens) exceeds Config.max_seq_len=128"),
        (["--model", "tiny-llama", "--mesh", "context=2,fsdp=4", "--seq-len", "126"], "argument "
         "--seq-len: context parallelism over 2 devices cuts the sequence into 2 x 2 = 4 equal "
         "chunks"),
    ],
)  # fmt: skip
def test_a_run_train_py_refuses_gets_an_error_not_a_plan(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert f"python -m training.plan: error: {message}" in captured.err
    assert "verdict" not in captured.out
