"""The pipeline schedules (GPipe, interleaved, 1F1B) measured against zoo.math on 8 fake CPU
devices: each one's bubble (step time against the same work without a pipeline) and its
compiled memory per device (against `zoo.math.pipeline_activation_bytes`).

    python -m bench pipeline

A loss-and-gradient step of an 8-layer model on the mesh pipeline=4, data=2 (the schedules run
through training/loss.py, as train.py's step does), beside the same step on data=8 without a
pipeline: the same FLOPs, spread over the same devices (with remat="full" beside 1F1B and
interleaved, which run each stage or chunk again in its backward, and beside GPipe with
remat="full"). The measured bubble is 1 - t(no pipeline) / t(pipeline) at M = 8 micro-batches,
for wall time and for the process's CPU time (all its threads: less disturbed by other jobs on a
shared machine, but it counts the time device threads spin at a collective). Predicted:
`zoo.math.pipeline_bubble`.

Fake devices share this machine's cores. An idle GPipe or interleaved stage computes on
placeholders (shard/pipeline.py), so a step's CPU time is the work of all ticks on all stages
and the bubble shows as time; an idle 1F1B slot is skipped (`lax.cond`), which frees the cores
for the other stages' work, so its bubble does not show here (on real devices it is GPipe's).
Memory at M = 16: XLA's memory analysis of the compiled step (temporaries per device) beside the
predicted activation bytes per stage; the difference between schedules is what to compare, the
rest (gradients, buffers) being alike. Measured in a child process, since the 8 devices must be
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
import numpy as np

import shard
import zoo
from bench.harness import Ceilings, Table
from data.packing import to_batch
from zoo import math as zm

DEVICES, STAGES = 8, 4
CONFIG = zoo.Config(vocab_size=2048, d_model=512, n_layers=8, n_heads=8, d_ff=2048, max_seq_len=128)
BATCH, SEQ, REPEATS = 32, 128, 3
TIMED_M, MEMORY_M = 8, 16
# (schedule, virtual stages, Policy.remat): GPipe both ways; 1F1B and interleaved recompute each
# stage (chunk) in its backward whatever the policy (zoo/pipeline_loss.py).
ROWS = (("gpipe", 1, "none"), ("gpipe", 1, "full"), ("interleaved", 2, "none"), ("1f1b", 1, "none"))
REMATS = ("none", "full")


def _step(sizes: dict, policy: zoo.Policy):
    """(jitted loss-and-gradient step, params, batch) on a mesh of `sizes`."""
    from training.loss import loss_terms

    placement = shard.Placement(shard.mesh(**sizes), shard.rules_for(sizes))
    model = placement.init(lambda k: zoo.Transformer(CONFIG, policy=policy, key=k),
                           jax.random.key(0))  # fmt: skip
    params, static = eqx.partition(model, eqx.is_inexact_array)
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (BATCH, SEQ + 1))
    batch = placement.batch(to_batch(tokens.astype(np.int32), np.ones_like(tokens, np.int32)))

    @jax.jit
    def step(params, batch):
        with placement.context():
            total = jnp.sum(batch.loss_mask)

            def objective(p):
                return loss_terms(eqx.combine(p, static), batch, nll_scale=1 / total).objective

            return jax.value_and_grad(objective)(params)

    return step, params, batch


def seconds(sizes: dict, policy: zoo.Policy) -> tuple[float, float]:
    """Median (wall, CPU) seconds of one step, after one call that compiles it."""
    step, params, batch = _step(sizes, policy)
    jax.block_until_ready(step(params, batch))
    wall, cpu = [], []
    for _ in range(REPEATS):
        w, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(step(params, batch))
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def temp_bytes(policy: zoo.Policy) -> int:
    step, params, batch = _step({"pipeline": STAGES, "data": DEVICES // STAGES}, policy)
    return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def measure() -> list[dict]:
    """The rows, measured in this process (which must hold 8 devices)."""
    plain = zoo.Policy()
    pipeline = {"pipeline": STAGES, "data": DEVICES // STAGES}
    tokens = BATCH * SEQ // (DEVICES // STAGES)  # one stage's share of the step's tokens
    # The same work without a pipeline: 1F1B and interleaved run each stage again in its
    # backward, as remat="full" does.
    t0 = {remat: seconds({"data": DEVICES}, plain.replace(remat=remat)) for remat in REMATS}
    rows = []
    for schedule, virtual, remat in ROWS:
        policy = plain.replace(remat=remat, pipeline_schedule=schedule, virtual_stages=2)
        wall, cpu = seconds(pipeline, policy.replace(microbatches=TIMED_M))
        work = "full" if schedule != "gpipe" else remat
        wall0, cpu0 = t0[work]
        bubble = zm.pipeline_bubble(STAGES, TIMED_M, virtual=virtual)
        predicted = zm.pipeline_activation_bytes(
            CONFIG, SEQ, policy, tokens=tokens, stages=STAGES, microbatches=MEMORY_M,
            schedule=schedule, virtual=virtual,
        )  # fmt: skip
        rows.append(
            {
                "schedule": schedule + (f" (V={virtual})" if virtual > 1 else ""),
                "remat": remat if schedule == "gpipe" else "(stage)",
                "predicted bubble M=8": bubble,
                "measured bubble, wall": 1 - wall0 / wall,
                "measured bubble, CPU": 1 - cpu0 / cpu,
                "wall s (t0)": f"{wall:.2f} ({wall0:.2f})",
                "predicted activations MB M=16": predicted / 1e6,
                "compiled temp MB M=16": temp_bytes(policy.replace(microbatches=MEMORY_M)) / 1e6,
            }
        )
    return rows


def run(ceilings: Ceilings) -> Table:
    del ceilings  # ratios of step times and byte counts: no ceiling involved
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
        "Pipeline schedules: bubble and memory per device, measured vs zoo.math",
        [
            f"{CONFIG.n_layers} layers, d_model {CONFIG.d_model}, batch {BATCH} x seq {SEQ}, "
            f"float32, loss + gradient, mesh pipeline={STAGES}, data={DEVICES // STAGES} on "
            f"{DEVICES} fake CPU devices sharing {os.cpu_count()} cores; t0: the same step on "
            f"data={DEVICES} without a pipeline (remat full beside 1F1B, interleaved and GPipe "
            f"with remat full); median of {REPEATS}. An idle 1F1B slot is skipped, which frees "
            "the shared cores, so its bubble does not show as time here (see bench/pipeline.py).",
        ],
    )
    for row in json.loads(child.stdout.splitlines()[-1]):
        table.add(row)
    return table


if __name__ == "__main__":
    if jax.device_count() < DEVICES:
        sys.exit(f"bench.pipeline needs {DEVICES} devices, found {jax.device_count()}")
    print(json.dumps(measure()))
