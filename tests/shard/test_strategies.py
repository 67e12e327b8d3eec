"""Every preset on 8 fake CPU devices: the sharded training step computes the unsharded model's
loss and gradients, each parameter's shard has the expected shape, and the compiled step runs
the collectives its strategy promises (and no others that would defeat it)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shard
import zoo

# Naive attention: the cheapest kernel to compile (the kernels are tested elsewhere).
CONFIG = zoo.preset(
    "tiny-llama", n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256, attention="naive"
)
TOKENS = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (8, 17)).astype(np.int32)

# Mesh of each preset, and by how much it should split each named parameter dim (written out
# by hand, independently of the rules' code).
CASES = {
    "dp": ({"data": 8}, {}),
    "fsdp": ({"fsdp": 8}, {"embed": 8}),
    "tp": ({"data": 2, "tensor": 4}, {"heads": 4, "kv_heads": 4, "mlp": 4, "vocab": 4}),
    "fsdp_tp": (
        {"fsdp": 2, "tensor": 4},
        {"embed": 2, "heads": 4, "kv_heads": 4, "mlp": 4, "vocab": 4},
    ),
    "ep": ({"fsdp": 2, "expert": 4}, {"embed": 2}),
}


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result type) of every collective in compiled HLO text."""
    pattern = r"= (.+?) (all-gather|reduce-scatter|all-reduce|all-to-all)(?:-start)?\("
    return [(op, shape) for shape, op in re.findall(pattern, hlo)]


@pytest.fixture(scope="module")
def reference():
    model = zoo.Transformer(CONFIG, key=jax.random.key(0))
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, jnp.asarray(TOKENS))
    return model, loss, grads


@pytest.fixture(scope="module", params=list(CASES))
def run(request, reference):
    """One SGD step (lr 1, so new = old - grad) of each preset, compiled once."""
    name = request.param
    mesh_shape, _ = CASES[name]
    rules, mesh = shard.ShardingRules.preset(name), shard.mesh(**mesh_shape)
    # Placed rather than created sharded, to save a compile (tests/shard/test_init.py
    # covers init_sharded).
    model = shard.shard_model(reference[0], rules, mesh)
    optimizer = optax.sgd(1.0)
    state = shard.init_opt_state(optimizer, model, rules, mesh)
    batch = shard.shard_batch(TOKENS, rules, mesh)
    step = shard.ShardedStep(loss_fn, optimizer, model, rules, mesh)
    compiled = step.compile(model, state, batch)
    params, _, loss = compiled(eqx.filter(model, eqx.is_array), state, batch)
    return name, eqx.combine(params, step.static), loss, compiled.as_text()


def test_loss_and_gradients_match_unsharded(run, reference):
    _, new_model, loss, _ = run
    ref_model, ref_loss, ref_grads = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    expected = jax.tree.map(lambda p, g: p - g, eqx.filter(ref_model, eqx.is_array), ref_grads)
    got = eqx.filter(new_model, eqx.is_array)
    for e, g in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5)


def test_each_device_holds_the_expected_shard(run):
    name, new_model, _, _ = run
    divisors = CASES[name][1]
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
    block = new_model.blocks
    # Full (one layer's) shapes of the weights TP splits and FSDP gathers.
    weights = [
        block.attn.q_proj.weight,
        block.attn.o_proj.weight,
        block.mlp.gate.weight,
        block.mlp.down.weight,
    ]
    full = {f"f32[{','.join(map(str, w.shape[1:]))}]" for w in weights}
    if name == "dp":
        assert "all-reduce" in kinds and "all-gather" not in kinds
    if name in ("fsdp", "fsdp_tp", "ep"):
        # Weights gathered before use. Gradients are reduce-scattered: XLA:CPU has no
        # reduce-scatter creator pass, so there it is an all-reduce then a dynamic-slice.
        assert "all-gather" in kinds
        assert "reduce-scatter" in kinds or ("all-reduce" in kinds and "dynamic-slice" in hlo)
    if name == "fsdp":
        assert full <= gathered, f"expected every weight gathered whole, got {gathered}"
    if name in ("tp", "fsdp_tp"):
        assert "all-reduce" in kinds
        whole = full & gathered
        assert not whole, f"TP weights gathered whole: {whole}"
