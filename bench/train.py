"""Tokens/s and MFU of train.py's jitted step for two model sizes on this machine, against the
peak matmul rate measured in the same run, with zoo.math's predicted step time next to the
measured one. Appends a table to bench/RESULTS.md with --write.

    python bench/train.py [--write]
"""

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.packing import Batch
from training.optimizer import adamw, learning_rate
from training.step import compile_steps, place, split_model
from zoo import Transformer, math, preset

SIZES = {
    "gpt-mini (default)": (preset("gpt-mini"), 16, 128),
    "gpt2-style 6L d384": (preset("gpt2-124m", n_layers=6, d_model=384, n_heads=6), 8, 256),
}


def measure(config, batch: int, seq: int, repeats: int = 5) -> float:
    """Median seconds of one train step (after a compile step and a warm-up step)."""
    params, static = split_model(Transformer(config, key=jax.random.key(0)))
    optimizer = adamw(learning_rate("cosine", peak=1e-3, steps=100, warmup=10))
    opt_state = place(optimizer.init(params))
    train_step, _ = compile_steps(static, optimizer)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32)
    ones = np.ones((batch, seq), np.int32)
    data = place(Batch(tokens[:, :-1], tokens[:, 1:], ones, ones.astype(np.float32)))
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        params, opt_state, metrics = train_step(params, opt_state, data)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = p.parse_args()
    hw = math.measure_this_machine(("float32",))
    peak = hw.peak_flops("float32")
    rows = [
        f"CPU peak measured in this run: {peak / 1e9:.0f} GFLOP/s float32 matmul, "
        f"{hw.bandwidth / 1e9:.0f} GB/s copy",
        "",
        "| model | params | batch x seq | predicted step | measured step | tokens/s | MFU |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (config, batch, seq) in SIZES.items():
        step_s = measure(config, batch, seq)
        predicted = math.training_step_roofline(config, batch, seq, hw)
        flops = math.training_flops_per_token(config, seq) * batch * seq
        rows.append(
            f"| {name} | {math.param_count(config) / 1e6:.1f}M | {batch} x {seq} | "
            f"{predicted.time_s * 1e3:.0f} ms ({predicted.bound}) | {step_s * 1e3:.0f} ms | "
            f"{batch * seq / step_s:,.0f} | {flops / step_s / peak:.0%} |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows[:2]))
    if args.write:
        date = datetime.date.today().isoformat()
        header = (
            f"\n## Training step (bench/train.py), this CPU, {os.cpu_count()} cores, {date}\n\n"
            "float32, AdamW, no remat, xla attention; machine shared with other jobs "
            "(numbers are noisy).\n\n"
        )
        with (Path(__file__).parent / "RESULTS.md").open("a") as f:
            f.write(header + "\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
