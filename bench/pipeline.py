"""The GPipe bubble, measured against `zoo.math.pipeline_bubble`, on 8 fake CPU devices.

    python -m bench pipeline

A loss-and-gradient step of an 8-layer model on meshes pipeline=S, data=8/S (S = 2, 4), with
M = 4 and 8 micro-batches of the same batch. A step is M + S - 1 ticks of one micro-batch's
stage, so its time goes as (M + S - 1) / M = 1 / (1 - bubble): the bench prints the measured
ratio t(M=4) / t(M=8) beside the predicted (1 - bubble(8)) / (1 - bubble(4)), for the wall
time and for the process's CPU time (all its threads: less disturbed by other jobs on a shared
machine, but it counts the time device threads spin waiting for each other at a collective).

Fake devices share this machine's cores, and an idle stage here is not idle: it computes on
placeholder zeros whose results are thrown away (shard/pipeline.py). So the step's time is the
total work of all ticks on all devices, bubble ticks included, divided over the cores: the
ratio shows that the schedule runs M + S - 1 ticks as predicted, not the time a real stage
waits for its neighbour, nor any overlap of the collective-permutes with compute (there is
no real link between fake devices). Measured in a child process, since the 8 devices must be
set before JAX starts.
"""

import json
import os
import statistics
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import shard
import zoo
from bench.harness import Ceilings, Table
from zoo import math as zm

DEVICES = 8
CONFIG = zoo.Config(vocab_size=2048, d_model=512, n_layers=8, n_heads=8, d_ff=2048, max_seq_len=128)
BATCH, SEQ, REPEATS = 32, 128, 3


def _loss(model, tokens):
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


def step_seconds(stages: int, microbatches: int) -> tuple[float, float]:
    """Median (wall, CPU) seconds of one jitted loss-and-gradient step on mesh
    pipeline=stages, after one call that compiles it."""
    sizes = {"pipeline": stages, "data": DEVICES // stages}
    placement = shard.Placement(shard.mesh(**sizes), shard.ShardingRules.preset("dp"))
    policy = zoo.Policy(microbatches=microbatches)
    model = placement.init(
        lambda k: zoo.Transformer(CONFIG, policy=policy, key=k), jax.random.key(0)
    )
    params, static = eqx.partition(model, eqx.is_array)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, CONFIG.vocab_size)
    tokens = jax.device_put(tokens, placement.batch_sharding())

    @jax.jit
    def step(params, tokens):
        with placement.context():
            return jax.value_and_grad(lambda p: _loss(eqx.combine(p, static), tokens))(params)

    jax.block_until_ready(step(params, tokens))
    wall, cpu = [], []
    for _ in range(REPEATS):
        w, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(step(params, tokens))
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def measure() -> list[dict]:
    """The rows, measured in this process (which must hold 8 devices)."""
    rows = []
    for stages in (2, 4):
        (wall4, cpu4), (wall8, cpu8) = step_seconds(stages, 4), step_seconds(stages, 8)
        b4, b8 = zm.pipeline_bubble(stages, 4), zm.pipeline_bubble(stages, 8)
        rows.append(
            {
                "stages": stages,
                "bubble M=4": b4,
                "bubble M=8": b8,
                "wall s M=4 / M=8": f"{wall4:.2f} / {wall8:.2f}",
                "CPU s M=4 / M=8": f"{cpu4:.2f} / {cpu8:.2f}",
                "t4/t8 wall": wall4 / wall8,
                "t4/t8 CPU": cpu4 / cpu8,
                "predicted (1-b8)/(1-b4)": (1 - b8) / (1 - b4),
            }
        )
    return rows


def run(ceilings: Ceilings) -> Table:
    del ceilings  # a ratio of two step times: no ceiling involved
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
    ).strip()
    child = subprocess.run(
        [sys.executable, "-m", "bench.pipeline"], env=env, capture_output=True, text=True
    )
    if child.returncode:
        raise RuntimeError(f"bench.pipeline's child failed:\n{child.stderr[-2000:]}")
    table = Table(
        "pipeline",
        "Pipeline bubble: GPipe step time with 4 vs 8 micro-batches",
        [
            f"{CONFIG.n_layers} layers, d_model {CONFIG.d_model}, batch {BATCH} x seq {SEQ}, "
            f"float32, loss + gradient; mesh pipeline=S, data=8/S on {DEVICES} fake CPU devices "
            f"sharing {os.cpu_count()} cores (idle stages compute placeholders, so the ratio "
            "counts the schedule's ticks, not waiting; see bench/pipeline.py); median of "
            f"{REPEATS}.",
        ],
    )
    for row in json.loads(child.stdout.splitlines()[-1]):
        table.add(row)
    return table


if __name__ == "__main__":
    if jax.device_count() < DEVICES:
        sys.exit(f"bench.pipeline needs {DEVICES} devices, found {jax.device_count()}")
    print(json.dumps(measure()))
