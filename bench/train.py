"""Tokens/s and MFU of train.py's jitted step (AdamW) beside zoo.math's predicted step time, on
the matmul rate measured in this run (and, on a known GPU, its datasheet peak).

    python -m bench train

CPU: two small GPT-2-style float32 models. GPU: a ~1B dense Llama-style model (Llama 3.2 1B
shapes), bf16 compute with float32 master weights, sequence 2048, the flash kernel; the remat
policy and batch size are the largest that zoo.math.training_memory_bytes fits in 85% of the
device's memory, preferring less recomputation while the batch reaches 8 sequences.
"""

import jax
import numpy as np

from bench.harness import (
    Ceilings,
    Table,
    device_memory_bytes,
    median_seconds,
    on_gpu,
    roofline_cells,
)
from data.packing import Batch
from training.optimizer import adamw, learning_rate
from training.step import compile_steps, split_model
from zoo import Config, Transformer, math, preset

GPU_SEQ = 2048


def fit_remat_and_batch(config: Config, seq: int, memory: float) -> tuple[str, int]:
    """The least recomputation whose largest fitting batch (a power of two up to 64) is >= 8,
    else the policy with the largest fitting batch."""
    best = ("full", 1)
    for remat in ("none", "dots", "full"):
        fits = [
            b
            for b in (1, 2, 4, 8, 16, 32, 64)
            if math.training_memory_bytes(config, b, seq, remat=remat) <= 0.85 * memory
        ]
        if fits and fits[-1] >= 8:
            return remat, fits[-1]
        if fits and fits[-1] > best[1]:
            best = (remat, fits[-1])
    return best


def sizes() -> list[tuple[str, Config, int, int]]:
    if not on_gpu():
        return [
            ("gpt-mini", preset("gpt-mini"), 8, 128),
            ("gpt2-style 6L d384", preset("gpt2-124m", n_layers=6, d_model=384, n_heads=6), 2, 128),
        ]
    config = preset("llama3-1b", dtype="bfloat16", attention="flash", max_seq_len=GPU_SEQ)
    remat, batch = fit_remat_and_batch(config, GPU_SEQ, device_memory_bytes() or 80e9)
    return [("llama3-1b", config.replace(remat=remat), batch, GPU_SEQ)]


def step_seconds(config: Config, batch: int, seq: int, repeats: int) -> float:
    """Median seconds of one train step after a compile step and a warm-up step."""
    params, static = split_model(Transformer(config, key=jax.random.key(0)))
    optimizer = adamw(learning_rate("cosine", peak=1e-3, steps=100, warmup=10))
    state = [params, jax.device_put(optimizer.init(params))]
    train_step, _ = compile_steps(static, optimizer)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32)
    ones = np.ones((batch, seq), np.int32)
    data = jax.device_put(Batch(tokens[:, :-1], tokens[:, 1:], ones, ones.astype(np.float32)))

    def step():
        state[0], state[1], metrics = train_step(state[0], state[1], data)  # donated: carry on
        return metrics.loss

    return median_seconds(step, repeats=repeats, warmup=2)


def run(ceilings: Ceilings) -> Table:
    todo = sizes()
    dtype = todo[0][1].dtype
    peak = ceilings.matmul_flops(dtype)
    datasheet = math.detect_hardware() if on_gpu() else None
    table = Table(
        "train",
        "Training step (train.py's jitted step, AdamW)",
        [
            f"{dtype} compute; ceiling: {dtype} matmul {peak / 1e12:.3g} TFLOP/s measured in this "
            "run; predicted = zoo.math.training_step_roofline; % of ceiling = MFU (6N + attention "
            "FLOPs per token)."
        ],
    )
    for name, config, batch, seq in todo:
        measured = step_seconds(config, batch, seq, repeats=10 if on_gpu() else 3)
        predicted = math.training_step_roofline(config, batch, seq, ceilings.hardware(dtype))
        flops = math.training_flops_per_token(config, seq) * batch * seq
        row = {
            "model": name,
            "params": f"{math.param_count(config) / 1e6:.0f}M",
            "batch x seq": f"{batch} x {seq}",
            "remat": config.remat,
            "attention": config.attention,
            "tokens/s": batch * seq / measured,
        }
        row |= roofline_cells(predicted.time_s, measured, flops, peak, "TFLOP/s")
        if datasheet is not None:
            row["MFU vs datasheet %"] = 100 * flops / measured / datasheet.peak_flops(dtype)
        table.add(row)
    return table
