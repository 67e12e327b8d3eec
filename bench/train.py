"""Tokens/s and MFU of train.py's jitted step (AdamW) beside zoo.math's predicted step time, on
the matmul rate measured in this run (and, on a known GPU, its datasheet peak).

    python -m bench train

CPU: two small GPT-2-style float32 models. GPU: a ~1B dense Llama-style model (Llama 3.2 1B
shapes), bf16 compute with float32 master weights, sequence 2048, the flash kernel. The remat
policy and batch size: zoo.math.training_memory_bytes ranks the candidates (less recomputation
first, while the batch reaches 8 sequences, then larger batches), and XLA's own memory analysis
of each compiled step, best first, confirms the first that fits in 90% of the device's memory:
the paper estimate picks, the compiler checks (no out-of-memory run, no wasted device time).
Both figures are printed: predicted GB beside compiled GB.
"""

import equinox as eqx
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
from shard.axes import is_array_like
from training.optimizer import adamw, learning_rate
from training.step import compile_steps, split_model
from training.telemetry import compiled_memory_bytes
from zoo import Config, Policy, Transformer, math, preset

GPU_SEQ = 2048


OPTIMIZER = adamw(learning_rate("cosine", peak=1e-3, steps=100, warmup=10))


def candidates(config: Config, policy: Policy, seq: int, memory: float) -> list[tuple[str, int]]:
    """(remat, batch) pairs that zoo.math predicts fit in `memory` under `policy` with that
    remat, best first: for each remat policy (least recomputation first) its largest fitting
    power-of-two batch up to 64 if that reaches 8 sequences, then the remaining fitting pairs by
    batch, largest first."""
    fits = {
        remat: [
            b
            for b in (64, 32, 16, 8, 4, 2, 1)
            if math.training_memory_bytes(config, b, seq, policy.replace(remat=remat)) <= memory
        ]
        for remat in ("none", "dots", "full")
    }
    first = [(remat, b[0]) for remat, b in fits.items() if b and b[0] >= 8]
    rest = sorted(
        ((r, b) for r, bs in fits.items() for b in bs if (r, b) not in first),
        key=lambda rb: -rb[1],
    )
    return first + rest


def compile_step(config: Config, policy: Policy, batch: int, seq: int):
    """train.py's step compiled ahead of time for these shapes (abstract inputs: nothing is
    allocated) and the bytes XLA's memory analysis says it needs on the device."""
    abstract = jax.eval_shape(lambda: Transformer(config, policy=policy, key=jax.random.key(0)))
    params, static = eqx.partition(abstract, is_array_like)
    train_step, _ = compile_steps(static, OPTIMIZER)
    state = jax.eval_shape(OPTIMIZER.init, params)
    data = Batch(*(jax.ShapeDtypeStruct((batch, seq), d) for d in ("int32",) * 3 + ("float32",)))
    compiled = train_step.lower(params, state, data).compile()
    return compiled, compiled_memory_bytes(compiled)


def fit_step(config: Config, policy: Policy, seq: int, memory: float):
    """(policy with its remat setting, batch, compiled step, compiled bytes): the best candidate
    whose compiled step needs at most 90% of `memory`."""
    for remat, batch in candidates(config, policy, seq, 0.9 * memory):
        compiled, needed = compile_step(config, policy.replace(remat=remat), batch, seq)
        print(f"  remat={remat} batch={batch}: compiled step needs {needed / 1e9:.1f} GB")
        if needed <= 0.9 * memory:
            return policy.replace(remat=remat), batch, compiled, needed
    raise RuntimeError(
        f"no remat policy and batch fits a {config.n_layers}-layer d={config.d_model} step in "
        f"{memory / 1e9:.1f} GB"
    )


# The GPU model: bf16 compute over float32 master weights, the flash kernel.
GPU_POLICY = Policy(compute_dtype="bfloat16", attention="flash")


def sizes() -> list[tuple[str, Config, Policy, int | None, int]]:
    """(name, config, policy, batch or None to fit one, seq) per model of this device."""
    if not on_gpu():
        small = preset("gpt2-124m", n_layers=6, d_model=384, n_heads=6)
        return [
            ("gpt-mini", preset("gpt-mini"), Policy(), 8, 128),
            ("gpt2-style 6L d384", small, Policy(), 2, 128),
        ]
    config = preset("llama3-1b", max_seq_len=GPU_SEQ)
    return [("llama3-1b", config, GPU_POLICY, None, GPU_SEQ)]


def step_seconds(
    config: Config, policy: Policy, batch: int, seq: int, train_step, repeats: int
) -> float:
    """Median seconds of one compiled train step after two warm-up steps."""
    runner = step_runner(config, policy, batch, seq, train_step)
    return median_seconds(runner, repeats=repeats, warmup=2)


def step_runner(config: Config, policy: Policy, batch: int, seq: int, train_step):
    """A zero-argument callable running one compiled train step on a fresh model and random
    tokens (the donated state carried from call to call); returns the loss."""
    params, _ = split_model(Transformer(config, policy=policy, key=jax.random.key(0)))
    state = [params, jax.device_put(OPTIMIZER.init(params))]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq + 1)).astype(np.int32)
    ones = np.ones((batch, seq), np.int32)
    data = jax.device_put(Batch(tokens[:, :-1], tokens[:, 1:], ones, ones.astype(np.float32)))

    def step():
        state[0], state[1], metrics = train_step(state[0], state[1], data)  # donated: carry on
        return metrics.loss

    return step


def run(ceilings: Ceilings) -> Table:
    todo = sizes()
    dtype = todo[0][2].compute_dtype
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
    for name, config, policy, batch, seq in todo:
        if batch is None:
            policy, batch, compiled, needed = fit_step(config, policy, seq, device_memory_bytes())
        else:
            compiled, needed = compile_step(config, policy, batch, seq)
        repeats = 10 if on_gpu() else 3
        measured = step_seconds(config, policy, batch, seq, compiled, repeats=repeats)
        hardware = ceilings.hardware(dtype)
        predicted = math.training_step_roofline(config, batch, seq, hardware, policy)
        flops = math.training_flops_per_token(config, seq) * batch * seq
        row = {
            "model": name,
            "params": f"{math.param_count(config) / 1e6:.0f}M",
            "batch x seq": f"{batch} x {seq}",
            "remat": policy.remat,
            "attention": policy.kernel_name,
            "predicted GB": math.training_memory_bytes(config, batch, seq, policy) / 1e9,
            "compiled GB": needed / 1e9,
            "tokens/s": batch * seq / measured,
        }
        row |= roofline_cells(predicted.time_s, measured, flops, peak, "TFLOP/s")
        if datasheet is not None:
            row["MFU vs datasheet %"] = 100 * flops / measured / datasheet.peak_flops(dtype)
        table.add(row)
    return table
