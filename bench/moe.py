"""Tokens/s of a tiny MoE (both dispatch strategies) vs a dense model with the same active
parameters, forward and train step, printed next to zoo.math's FLOPs per token.

    python bench/moe.py [--batch 8] [--seq 256] [--repeats 5]

The MoE's k=2 experts of width d_ff/2 match the dense model's one MLP of width d_ff, so both do
the same model FLOPs per token; the difference is what routing, sorting (dropless) or padding
and one-hot einsums (capacity) cost on this machine.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import zoo
from zoo import math as zm

DENSE = zoo.Config(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, d_ff=1024, max_seq_len=512)
MOE = DENSE.replace(n_experts=8, n_experts_per_token=2, moe_d_ff=512)


def median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def loss_fn(model, tokens):
    out = model.forward(tokens[:, :-1])
    logp = jax.nn.log_softmax(out.logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()
    return nll + zoo.moe_aux_loss(out.aux, model.config)


def measure(config, batch, seq, repeats):
    model = zoo.Transformer(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, config.vocab_size)
    forward = eqx.filter_jit(lambda m, t: m.forward(t[:, :-1]).logits)
    optimizer = optax.adamw(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    fwd_s = median_seconds(forward, model, tokens, repeats=repeats)
    step_s = median_seconds(lambda t: train_step(model, opt_state, t)[2], tokens, repeats=repeats)
    return batch * seq / fwd_s, batch * seq / step_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    peak = zm.measure_matmul_flops("float32", n=1024)
    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}), {os.cpu_count()} cores")
    print(f"float32 matmul peak measured now: {peak / 1e9:.0f} GFLOP/s")
    print(f"batch {args.batch} x seq {args.seq}, float32, median of {args.repeats}")
    rows = [
        ("dense", DENSE),
        ("moe dropless", MOE),
        ("moe capacity 1.25", MOE.replace(moe_dispatch="capacity", capacity_factor=1.25)),
    ]
    header = (
        f"{'model':<18} {'params':>8} {'active':>8} {'fwd MF/tok':>10} {'+cap MF/tok':>11} "
        f"{'fwd tok/s':>10} {'fwd GF/s':>9} {'train tok/s':>11} {'train GF/s':>10}"
    )
    print(header)
    for name, config in rows:
        fwd_flops = zm.forward_flops_per_token(config, args.seq)
        extra = zm.capacity_dispatch_flops_per_token(config, args.seq)
        if config.moe_dispatch != "capacity":
            extra = 0
        fwd_tps, train_tps = measure(config, args.batch, args.seq, args.repeats)
        train_flops = zm.training_flops_per_token(config, args.seq)
        print(
            f"{name:<18} {zm.param_count(config) / 1e6:>7.2f}M "
            f"{zm.active_param_count(config) / 1e6:>7.2f}M {fwd_flops / 1e6:>10.1f} "
            f"{extra / 1e6:>11.1f} {fwd_tps:>10.0f} {fwd_tps * fwd_flops / 1e9:>9.1f} "
            f"{train_tps:>11.0f} {train_tps * train_flops / 1e9:>10.1f}"
        )
    print("GF/s = model FLOPs (zoo.math, active parameters) x measured tokens/s;")
    print("+cap = capacity dispatch's extra forward FLOPs (padded slots, one-hot einsums).")


if __name__ == "__main__":
    main()
