"""LoRA and QLoRA vs a full fine-tune: the train step's memory (zoo.math's prediction beside XLA's
compiled memory analysis), its optimizer state, and tokens/s, measured side by side in one run.

    python -m bench lora

Measured on SmolLM2-135M shapes (random weights: memory and speed do not depend on their values)
at batch 8 x 128 on a CPU, batch 8 x 2048 on a GPU, LoRA rank 8 on every projection (q, k, v, o,
gate, up, down), float32 compute: full, LoRA over a float32 base, LoRA over an int8 base and over
an NF4 base. Then zoo.math alone for Llama 3 8B at batch 1 x 2048 (bf16 compute, full remat), so
a user can see what fits one 80 GB GPU. The held-out loss of a real LoRA fine-tune comes from
`python -m examples.finetune` (bench/RESULTS.md).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import zoo
from bench.harness import Ceilings, Table, median_seconds, on_gpu
from training.optimizer import adamw, learning_rate
from training.step import abstract_batch, compile_steps, split_model
from training.telemetry import compiled_memory_bytes
from zoo import math as zmath

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK = 8
OPTIMIZER = adamw(learning_rate("cosine", peak=1e-3, steps=100, warmup=10))


# (label, trains LoRA, quantized base kind): the variants measured side by side.
VARIANTS = (
    ("full", False, None),
    ("lora float32 base", True, None),
    ("lora int8 base", True, "int8"),
    ("lora nf4 base", True, "nf4"),
)


def variant(model: zoo.Transformer, lora: bool, kind: str | None) -> zoo.Transformer:
    """`model` as trained: every weight, or rank-8 LoRA over a base held as is or quantized."""
    if not lora:
        return model
    if kind:
        model = zoo.quantize_base(model, kind, block=64)
    return zoo.add_lora(model, TARGETS, RANK, 2 * RANK, key=jax.random.key(1))


def predicted_bytes(config, policy, batch, seq, lora: bool, kind: str | None) -> float:
    """zoo.math's memory of one train step."""
    if not lora:
        return zmath.training_memory_bytes(config, batch, seq, policy)
    return zmath.training_memory_bytes(
        config, batch, seq, policy,
        trainable=zmath.lora_param_count(config, TARGETS, RANK),
        frozen_bytes=zmath.frozen_base_bytes(config, kind, policy, block=64),
    )  # fmt: skip


def measure(model: zoo.Transformer, batch: int, seq: int, repeats: int) -> dict:
    """Compiled memory, optimizer-state bytes and tokens/s of train.py's step for `model`."""
    params, static = split_model(model)
    train_step, _ = compile_steps(static, OPTIMIZER)
    opt_state = OPTIMIZER.init(params)
    compiled = train_step.lower(params, opt_state, abstract_batch(batch, seq)).compile()
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(opt_state, eqx.is_array)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, (batch, seq + 1)).astype(np.int32)
    data = abstract_batch(batch, seq)._replace(
        inputs=jnp.asarray(tokens[:, :-1]), targets=jnp.asarray(tokens[:, 1:]),
        segment_ids=jnp.ones((batch, seq), jnp.int32), loss_mask=jnp.ones((batch, seq)),
    )  # fmt: skip
    state = [params, opt_state]

    def step():
        state[0], state[1], metrics = compiled(state[0], state[1], data)
        return metrics.loss

    seconds = median_seconds(step, repeats=repeats, warmup=1)
    return {
        "compiled": compiled_memory_bytes(compiled),
        "state": state_bytes,
        "tokens/s": batch * seq / seconds,
    }


def run(ceilings: Ceilings) -> Table:
    del ceilings  # memory and relative speed; no roofline here
    config = zoo.preset("smollm2-135m")
    policy = zoo.Policy()
    batch, seq, repeats = (8, 2048, 10) if on_gpu() else (8, 128, 3)
    table = Table(
        "lora",
        "LoRA / QLoRA vs full fine-tune (train step)",
        [
            f"SmolLM2-135M shapes, batch {batch} x {seq}, float32 compute, AdamW; LoRA rank {RANK} "
            "on q, k, v, o, gate, up, down. predicted = zoo.math.training_memory_bytes; compiled "
            "= XLA's memory analysis of the step; optimizer state = the AdamW moments' bytes. "
            "Llama 3 8B rows: zoo.math only, batch 1 x 2048, bf16 compute, full remat."
        ],
    )
    full = None
    for name, lora, kind in VARIANTS:
        # A fresh model each time: the step donates (and so deletes) what it trains.
        base = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
        measured = measure(variant(base, lora, kind), batch, seq, repeats)
        full = full or measured
        table.add(
            {
                "model": "smollm2-135m",
                "training": name,
                "predicted GB": predicted_bytes(config, policy, batch, seq, lora, kind) / 1e9,
                "compiled GB": measured["compiled"] / 1e9,
                "compiled / full": measured["compiled"] / full["compiled"],
                "optimizer state MB": measured["state"] / 1e6,
                "state / full": measured["state"] / full["state"],
                "tokens/s": measured["tokens/s"],
            }
        )
    big = zoo.preset("llama3-8b")
    bf16 = zoo.Policy(compute_dtype="bfloat16", param_dtype="bfloat16", remat="full")
    for name, lora, kind in VARIANTS:
        table.add(
            {
                "model": "llama3-8b",
                "training": name.replace("float32 base", "bfloat16 base"),
                "predicted GB": predicted_bytes(big, bf16, 1, 2048, lora, kind) / 1e9,
                "compiled GB": float("nan"),
                "compiled / full": float("nan"),
                "optimizer state MB": float("nan"),
                "state / full": float("nan"),
                "tokens/s": float("nan"),
            }
        )
    return table
