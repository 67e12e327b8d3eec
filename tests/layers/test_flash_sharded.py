"""Flash attention under a device mesh with sharding rules active: it runs per shard
(`jax.shard_map`), computes what naive attention computes on the whole arrays (values and
gradients), its compiled program moves no data between devices, rules it cannot follow are
refused, and the per-shard program still lowers for CUDA through Triton.

One tile per sequence (blocks of 32 over 32 tokens): the Pallas interpreter costs grid steps x
buffer bytes, and tile skipping is tested in test_flash.py."""

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
from layers.kernels import AttentionMask, BlockSizes, causal_mask, flash_attention, naive_attention
from layers.kernels.flash import DEFAULT_BLOCK_SIZES
from tests.layers.test_flash import cuda_mesh, random_segments
from training.step import compile_steps, split_model
from zoo.transformer import positions_from_segments

ONE_TILE = BlockSizes(block_q=32, block_k=32, backward_block_q=32, backward_block_k=32)
Q_AXES = "batch seq heads head_dim"
KV_AXES = "batch kv_seq kv_heads head_dim"

# Preset, mesh, (batch, heads, kv_heads): GQA groups of 2 stay whole when heads are split.
CASES = {
    "dp": ("dp", {"data": 8}, (8, 2, 1)),
    "tp": ("tp", {"data": 2, "tensor": 4}, (2, 8, 4)),
}


def inputs(b: int, h: int, kv: int, t: int = 32, d: int = 16):
    kq, kk, kv_, ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (b, t, h, d))
    k = jax.random.normal(kk, (b, t, kv, d))
    v = jax.random.normal(kv_, (b, t, kv, d))
    seg = random_segments(ks, b, t)  # packed documents: the mask rows are split with the batch
    return q, k, v, causal_mask(positions_from_segments(seg), seg)


def value_and_grads(kernel):
    def run(q, k, v, mask):
        out, vjp = jax.vjp(lambda *a: kernel(*a, mask), q, k, v)
        return out, vjp(jnp.cos(out))

    return run


def collectives(hlo: str) -> list[str]:
    ops = "all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute"
    return re.findall(rf"\b({ops})", hlo)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_flash_runs_per_shard_and_matches_naive(name):
    preset, sizes, (b, h, kv) = CASES[name]
    rules, mesh = shard.ShardingRules.preset(preset), shard.mesh(**sizes)
    q, k, v, mask = inputs(b, h, kv)
    want_out, want_grads = jax.jit(value_and_grads(naive_attention))(q, k, v, mask)

    q_sharding = shard.named_sharding(Q_AXES, rules, mesh)
    kv_sharding = shard.named_sharding(KV_AXES, rules, mesh)
    q = jax.device_put(q, q_sharding)
    k, v = jax.device_put((k, v), kv_sharding)
    flash = value_and_grads(lambda *a: flash_attention(*a, block_sizes=ONE_TILE))
    with shard.use_rules(rules, mesh):
        compiled = jax.jit(flash).lower(q, k, v, mask).compile()
    # Batch and heads are independent, so per shard nothing at all crosses devices.
    assert collectives(compiled.as_text()) == []
    out, grads = compiled(q, k, v, mask)
    assert out.sharding.is_equivalent_to(q_sharding, out.ndim)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_without_rules_xla_gathers_the_kernel_inputs():
    """What per-shard execution avoids (and proof that the HLO check above can see a gather):
    the same sharded inputs with no rules active are all-gathered for the kernel."""
    preset, sizes, (b, h, kv) = CASES["tp"]
    rules, mesh = shard.ShardingRules.preset(preset), shard.mesh(**sizes)
    q, k, v, mask = inputs(b, h, kv)
    q = jax.device_put(q, shard.named_sharding(Q_AXES, rules, mesh))
    flash = jax.jit(lambda q: flash_attention(q, k, v, mask, block_sizes=ONE_TILE))
    assert "all-gather" in collectives(flash.lower(q).compile().as_text())


def test_model_step_with_flash_under_fsdp_tp_matches_unsharded_naive():
    """A training step of a model (scanned, checkpointed blocks) under FSDP x TP: the flash
    model's loss and SGD update equal the unsharded naive model's, and only weights are
    gathered, never an attention input [batch, seq, heads, head_dim]."""
    config = zoo.preset(
        "tiny-llama", n_layers=1, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=256, max_seq_len=32
    )
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (4, 33)).astype(np.int32)

    def loss_fn(model, tokens):
        logits = model.forward(tokens[:, :-1]).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    naive = zoo.Transformer(config, policy=zoo.Policy(attention="naive"), key=jax.random.key(0))
    want_loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(naive, tokens)
    want = jax.tree.map(lambda p, g: p - g, eqx.filter(naive, eqx.is_array), grads)

    placement = shard.Placement(shard.mesh(fsdp=2, tensor=4), shard.ShardingRules.preset("fsdp_tp"))
    flash_policy = zoo.Policy(attention="flash")
    model = placement.init(
        lambda key: zoo.Transformer(config, policy=flash_policy, key=key), jax.random.key(0)
    )
    optimizer = optax.sgd(1.0)
    params, static = split_model(model)
    state = placement.init_opt_state(optimizer, params)
    batch = placement.batch(to_batch(tokens, np.ones_like(tokens)))
    step, _ = compile_steps(static, optimizer, placement=placement, model=model)
    compiled = step.lower(params, state, batch).compile()
    gathered = re.findall(r"= (\S+) all-gather", compiled.as_text())
    assert gathered, "FSDP gathers its weights: the pattern above must see them"
    assert not [shape for shape in gathered if re.match(r"\w+\[\d+,32,\d+,16\]", shape)]
    params, _, metrics = compiled(params, state, batch)
    np.testing.assert_allclose(metrics.loss, want_loss, rtol=1e-5)
    for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ((("batch", "data"), ("seq", "tensor")), "split 'seq' over mesh axes 'tensor'"),
        ((("batch", "data"), ("kv_seq", "tensor")), "split 'kv_seq'"),
        ((("batch", "data"), ("head_dim", "tensor")), "split 'head_dim'"),
        ((("batch", "data"), ("heads", "tensor")), "'kv_heads' over None"),
    ],
)
def test_rules_it_cannot_follow_are_refused(mapping, message):
    q, k, v, mask = inputs(2, 4, 2)
    rules, mesh = shard.ShardingRules(mapping), shard.mesh(data=2, tensor=4)
    with shard.use_rules(rules, mesh), pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, mask, block_sizes=ONE_TILE)


def test_heads_that_do_not_divide_by_the_mesh_are_refused():
    q, k, v, mask = inputs(2, 4, 2)  # 2 K/V heads on 4 tensor devices
    rules, mesh = shard.ShardingRules.preset("tp"), shard.mesh(data=2, tensor=4)
    message = "'kv_heads' of size 2 does not divide"
    with shard.use_rules(rules, mesh), pytest.raises(ValueError, match=message):
        flash_attention(q, k, v, mask, block_sizes=ONE_TILE)


def test_sharded_kernels_lower_for_cuda_through_triton():
    """The per-shard program (real kernels, default blocks) lowers for CUDA on a CPU machine:
    the forward and backward Triton calls each take one device's shard."""
    device = cuda_mesh().abstract_device
    concrete = shard.mesh(data=2, tensor=4)
    mesh = jax.sharding.AbstractMesh(
        concrete.axis_sizes, concrete.axis_names, concrete.axis_types, abstract_device=device
    )
    q, k, v, _ = inputs(2, 8, 4, t=128, d=64)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    pos = jnp.broadcast_to(jnp.arange(128), (2, 128))
    mask = AttentionMask(q_positions=pos, kv_positions=pos)

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(lambda *a: flash_attention(*a, mask, interpret=False), q, k, v)
        return out, vjp(out)

    rules = shard.ShardingRules.preset("tp")
    with shard.use_rules(rules, mesh), jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fwd_bwd).trace(q, k, v).lower(lowering_platforms=("cuda",))
    calls = [line for line in lowered.as_text().splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 1 + DEFAULT_BLOCK_SIZES.backward_kernels
    # Each kernel sees one device's q: batch 2 / 2 data devices, heads 8 / 4 tensor devices.
    assert all("1x128x2x64xbf16" in call and "2x128x8x64" not in call for call in calls)
