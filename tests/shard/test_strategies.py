"""Every preset on 8 fake CPU devices: the training step (training/step.py, given a sharded
Placement) computes the unsharded model's loss and gradients, each parameter's shard has the
expected shape, and the compiled step runs the collectives its strategy promises (and no others
that would defeat it). Expert parallelism runs a mixture-of-experts model with capacity dispatch
(all-to-all) and with dropless dispatch.

One layer everywhere: depth changes none of these properties (the layers are scanned). Compiled
without LLVM's optimisations (FAST_COMPILE): they cost most of the CPU compile time of these tiny
programs, and the partitioning (collectives) is done before them; floats may differ in the last
bit."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shard
import zoo
from data.packing import to_batch
from layers.moe import aux_loss, expert_capacity
from training.step import compile_steps, split_model

# Naive attention: the cheapest kernel to compile (the kernels are tested elsewhere).
NAIVE = zoo.Policy(attention="naive")
DENSE = (
    zoo.preset("tiny-llama", n_layers=1, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256),
    NAIVE,
)
MOE = (zoo.preset("tiny-moe", n_layers=1), NAIVE.replace(moe_dispatch="capacity"))
MOE_DROPLESS = (MOE[0], NAIVE)
TOKENS = np.random.default_rng(0).integers(0, DENSE[0].vocab_size, (8, 17)).astype(np.int32)
# One document per row: every target counts.
BATCH = to_batch(TOKENS, np.ones_like(TOKENS))
# Slots per expert and sequence of MOE (16 tokens per sequence).
CAPACITY = expert_capacity(
    16, MOE[0].n_experts_per_token, MOE[0].n_experts, MOE[1].moe_dispatch.capacity_factor
)

FAST_COMPILE = {"xla_backend_optimization_level": 0}

# (Config, policy), preset, mesh, and by how much it should split each named parameter dim
# (written out by hand, independently of the rules' code).
CASES = {
    "dp": (DENSE, "dp", {"data": 8}, {}),
    "fsdp": (DENSE, "fsdp", {"fsdp": 8}, {"embed": 8}),
    "tp": (
        DENSE,
        "tp",
        {"data": 2, "tensor": 4},
        {"heads": 4, "kv_heads": 4, "mlp": 4, "vocab": 4},
    ),
    "fsdp_tp": (
        DENSE,
        "fsdp_tp",
        {"fsdp": 2, "tensor": 4},
        {"embed": 2, "heads": 4, "kv_heads": 4, "mlp": 4, "vocab": 4},
    ),
    "ep": (MOE, "ep", {"fsdp": 2, "expert": 4}, {"embed": 2, "experts": 4}),
    "ep-dropless": (
        MOE_DROPLESS,
        "ep",
        {"fsdp": 2, "expert": 4},
        {"embed": 2, "experts": 4},
    ),
}


def loss_fn(model, tokens):
    """(cross-entropy + MoE aux loss, (cross-entropy, aux loss)), written apart from
    training/loss.py: the reference the step is checked against."""
    out = model.forward(tokens[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, tokens[:, 1:]).mean()
    aux = aux_loss(out.aux, load_balancing_weight=0.01, z_loss_weight=0.001)  # AuxWeights()
    return ce + aux, (ce, aux)


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result type) of every collective in compiled HLO text."""
    pattern = r"= (.+?) (all-gather|reduce-scatter|all-reduce|all-to-all)(?:-start)?\("
    return [(op, shape) for shape, op in re.findall(pattern, hlo)]


def reference(spec):
    """Unsharded model (on one device), (cross-entropy, aux loss) and gradients. Jitted: one
    fast compile costs less than running the initialiser and the gradient op by op."""
    config, policy = spec
    key = jax.random.key(0)
    make = lambda key: zoo.Transformer(config, policy=policy, key=key)  # noqa: E731
    static = eqx.partition(eqx.filter_eval_shape(make, key), eqx.is_array)[1]

    def init(key):
        return eqx.filter(make(key), eqx.is_array)

    def value_and_grad(params, tokens):
        objective = jax.value_and_grad(
            lambda p: loss_fn(eqx.combine(p, static), tokens), has_aux=True
        )
        (_, terms), grads = objective(params)
        return terms, grads

    params = jax.jit(init).lower(key).compile(FAST_COMPILE)(key)
    tokens = jnp.asarray(TOKENS)
    terms, grads = (
        jax.jit(value_and_grad).lower(params, tokens).compile(FAST_COMPILE)(params, tokens)
    )
    return eqx.combine(params, static), terms, grads


@pytest.fixture(scope="module")
def references():
    """The reference of each config, computed once."""
    return {config: reference(config) for config in {case[0] for case in CASES.values()}}


@pytest.fixture(scope="module", params=list(CASES))
def run(request, references):
    """One SGD step (lr 1, so new = old - grad) of each case by train.py's step, compiled once."""
    name = request.param
    config, preset, mesh_shape, _ = CASES[name]
    placement = shard.Placement(shard.mesh(**mesh_shape), shard.ShardingRules.preset(preset))
    # Placed rather than created sharded, to save a compile (tests/shard/test_init.py
    # covers init_sharded).
    model = placement.place(references[config][0])
    optimizer = optax.sgd(1.0)
    params, static = split_model(model)
    state = placement.init_opt_state(optimizer, params)
    batch = placement.batch(BATCH)
    step, _ = compile_steps(static, optimizer, placement=placement, model=model)
    compiled = step.lower(params, state, batch).compile(FAST_COMPILE)
    params, _, metrics = compiled(params, state, batch)
    return name, eqx.combine(params, static), metrics, compiled.as_text()


def test_loss_and_gradients_match_unsharded(run, references):
    name, new_model, metrics, _ = run
    ref_model, (ref_ce, ref_aux), ref_grads = references[CASES[name][0]]
    np.testing.assert_allclose(metrics.loss, ref_ce, rtol=1e-5)
    np.testing.assert_allclose(metrics.aux_loss, ref_aux, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(metrics.loss + metrics.aux_loss, ref_ce + ref_aux, rtol=1e-5)
    np.testing.assert_allclose(metrics.grad_norm, optax.tree.norm(ref_grads), rtol=1e-4)
    expected = jax.tree.map(lambda p, g: p - g, eqx.filter(ref_model, eqx.is_array), ref_grads)
    got = eqx.filter(new_model, eqx.is_array)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


def test_each_device_holds_the_expected_shard(run):
    name, new_model, _, _ = run
    divisors = CASES[name][3]
    params = jax.tree.leaves(eqx.filter(new_model, eqx.is_array))
    axes = jax.tree.leaves(
        shard.logical_axes(new_model), is_leaf=lambda x: isinstance(x, shard.LogicalAxes)
    )
    for array, names in zip(params, axes, strict=True):
        expected = tuple(
            s // divisors.get(n, 1) for s, n in zip(array.shape, names.names, strict=True)
        )
        assert len(array.addressable_shards) == 8
        for piece in array.addressable_shards:
            assert piece.data.shape == expected, (names, array.shape)


def test_compiled_step_runs_the_strategys_collectives(run):
    name, new_model, _, hlo = run
    ops = collectives(hlo)
    kinds = {op for op, _ in ops}
    gathered = {shape.split("{")[0] for op, shape in ops if op == "all-gather"}
    if name == "dp":
        assert "all-reduce" in kinds and "all-gather" not in kinds
    if name in ("fsdp", "fsdp_tp", "ep"):
        # Weights gathered before use. Gradients are reduce-scattered: XLA:CPU has no
        # reduce-scatter creator pass, so there it is an all-reduce then a dynamic-slice.
        assert "all-gather" in kinds
        assert "reduce-scatter" in kinds or ("all-reduce" in kinds and "dynamic-slice" in hlo)
    if name in ("ep", "ep-dropless"):
        return
    block = new_model.stacks[0].blocks[0]
    # Full (one layer's) shapes of the weights TP splits and FSDP gathers.
    weights = [
        block.attn.q_proj.weight,
        block.attn.o_proj.weight,
        block.mlp.gate.weight,
        block.mlp.down.weight,
    ]
    full = {f"f32[{','.join(map(str, w.shape[1:]))}]" for w in weights}
    if name == "fsdp":
        assert full <= gathered, f"expected every weight gathered whole, got {gathered}"
    if name in ("tp", "fsdp_tp"):
        assert "all-reduce" in kinds
        whole = full & gathered
        assert not whole, f"TP weights gathered whole: {whole}"


def buffer_all_to_alls(hlo: str) -> list[str]:
    """All-to-alls that move pieces of the capacity buffer: their operands have a `capacity`
    dim and an `embed` dim (other all-to-alls, e.g. of attention activations, have neither)."""
    found = []
    for op, shape in collectives(hlo):
        dims = [set(map(int, d.split(","))) for d in re.findall(r"\[([\d,]+)\]", shape)]
        if op == "all-to-all" and dims and all({CAPACITY, MOE[0].d_model} <= d for d in dims):
            found.append(shape)
    return found


def test_expert_parallel_capacity_dispatch_is_an_all_to_all(run):
    name, _, _, hlo = run
    moved = buffer_all_to_alls(hlo)
    if name == "ep":
        # Dispatch and combine, forward and backward: tokens travel to their experts' devices.
        assert len(moved) >= 4, collectives(hlo)
    else:
        # Dropless dispatch (and dense models) have no capacity buffer to move.
        assert not moved
