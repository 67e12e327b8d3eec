"""A MoE (both dispatch strategies) vs a dense model with the same active parameters, forward and
train step, beside the compute roofline of zoo.math's FLOPs per token (active parameters; for
capacity dispatch plus its padded slots and one-hot einsums).

    python -m bench moe

The MoE's k=2 experts of width d_ff/2 match the dense model's one MLP of width d_ff, so both do
the same model FLOPs per token; the difference is what routing, sorting (dropless) or padding
and one-hot einsums (capacity) cost on this device.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import zoo
from bench.harness import Ceilings, Table, median_seconds, on_gpu, roofline_cells
from layers.moe import aux_loss
from layers.moe.dispatch import Capacity, Dropless
from zoo import math as zm


def configs() -> tuple[zoo.Config, zoo.Policy, int, int, int]:
    """(dense config, policy, batch, seq, repeats) for this device."""
    if on_gpu():
        dense = zoo.Config(
            vocab_size=32768,
            d_model=1024,
            n_layers=8,
            n_heads=16,
            d_ff=4096,
            max_seq_len=2048,
        )
        return dense, zoo.Policy.of_dtype("bfloat16"), 8, 2048, 10
    dense = zoo.Config(
        vocab_size=2048, d_model=256, n_layers=4, n_heads=4, d_ff=1024, max_seq_len=512
    )
    return dense, zoo.Policy(), 4, 128, 3


def loss_fn(model, tokens):
    out = model.forward(tokens[:, :-1])
    logp = jax.nn.log_softmax(out.logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    return nll + aux_loss(out.aux, load_balancing_weight=0.01, z_loss_weight=0.001)


def measure(
    config: zoo.Config, policy: zoo.Policy, batch: int, seq: int, repeats: int
) -> tuple[float, float]:
    """(forward seconds, train step seconds)."""
    model = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, config.vocab_size)
    forward = eqx.filter_jit(lambda m, t: m.forward(t[:, :-1]).logits)
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    fwd_s = median_seconds(lambda: forward(model, tokens), repeats=repeats)
    step_s = median_seconds(lambda: train_step(model, opt_state, tokens)[2], repeats=repeats)
    return fwd_s, step_s


def run(ceilings: Ceilings) -> Table:
    dense, policy, batch, seq, repeats = configs()
    moe = dense.replace(n_experts=8, n_experts_per_token=2, moe_d_ff=dense.d_ff // 2)
    dtype = policy.compute_dtype
    peak = ceilings.matmul_flops(dtype)
    table = Table(
        "moe",
        "MoE vs dense (same active FLOPs)",
        [
            f"batch {batch} x seq {seq}, {dtype}, AdamW; ceiling: {dtype} matmul "
            f"{peak / 1e12:.3g} TFLOP/s measured in this run; predicted = model FLOPs / ceiling."
        ],
    )
    capacity = Capacity(1.25)
    for name, config, dispatch in [
        ("dense", dense, Dropless()),
        ("moe dropless", moe, Dropless()),
        ("moe capacity 1.25", moe, capacity),
    ]:
        fwd_per_token = zm.forward_flops_per_token(config, seq)
        if isinstance(dispatch, Capacity):
            fwd_per_token += zm.capacity_dispatch_flops_per_token(
                config, seq, capacity.capacity_factor
            )
        fwd_s, step_s = measure(config, policy.replace(moe_dispatch=dispatch), batch, seq, repeats)
        for pass_, measured, flops in [
            ("forward", fwd_s, fwd_per_token * batch * seq),
            ("train step", step_s, 3 * fwd_per_token * batch * seq),
        ]:
            row = {
                "model": name,
                "params": f"{zm.param_count(config) / 1e6:.2f}M",
                "active": f"{zm.active_param_count(config) / 1e6:.2f}M",
                "pass": pass_,
                "tokens/s": batch * seq / measured,
            }
            table.add(row | roofline_cells(flops / peak, measured, flops, peak, "TFLOP/s"))
    return table
