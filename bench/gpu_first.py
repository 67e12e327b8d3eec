"""`python -m bench gpu-first --budget SECONDS --out DIR`: the first run on a GPU machine, made to
fit one 10-minute device call (default budget 520 s, leaving time to start up), that says whether
the kernels are right and how far each goal is.

Stages, in order, each with its own share of the budget and its own try/except (a stage that
fails or overruns is recorded and the next one runs). DIR/results.json and DIR/results.md are
rewritten after every stage and every row of a long one, so a call cut short keeps all it got.

1. versions: Python, JAX, jaxlib, equinox, optax, jaxtyping, numpy; the device; XLA_FLAGS; the
   `nvidia-smi` line (recorded as absent where there is no such command).
2. flash-errors: flash vs naive on out, dq, dk and dv in units of the dtype's epsilon
   (bench/flash_errors.py): bfloat16 GQA head_dim 64, float32, bfloat16 head_dim 128, and
   bfloat16 packed documents with a sliding window.
3. ceilings: matmul rate per dtype on random operands, copy and matrix-vector bandwidth.
4. attention: flash, cuDNN and xla at head_dim 64 (GQA) and 128, seq 2048-8192, fwd and
   fwd+bwd (bench/attention.py; xla is skipped where its score matrices would not fit).
5. train: the ~1B Llama train step, remat policy and batch ranked by zoo.math and confirmed by
   the compiled step's memory (bench/train.py).
6. decode: batch 1 and 32, a greedy decode loop on a cache holding 512 tokens, and the number of
   kernels one step launches, read off the compiled loop (bench/hlo_count.py).
7. train-profile: a separate, untimed pass of a few train steps under the profiler and its
   reading (op time by group, top ops): never inside a timed loop, because on JAX 0.11 the
   profiler turns XLA's command buffers off and distorts timings.

Then the goals: target, predicted, measured and pass. On a CPU the same stages run at tiny sizes
(a smoke run, which the tests exercise); the speed goals are GPU goals, so their pass is "n/a".
"""

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import platform
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import jax

import zoo
from bench import attention, flash_errors, gpu_inference, hlo_count, trace_reading
from bench import train as train_bench
from bench.harness import (
    Ceilings,
    Table,
    device_memory_bytes,
    device_name,
    error_note,
    median_seconds,
    on_gpu,
    roofline_cells,
)

DEFAULT_BUDGET_S = 520.0
# Seconds a stage may run past its budget before the alarm stops it: its soft deadline is checked
# between measurements, and one compile can outlast it.
GRACE_S = 20.0
PACKAGES = ("jax", "jaxlib", "equinox", "optax", "jaxtyping", "numpy")


# --- The only code here that builds configs, models and steps with the current zoo, training
# --- and infer APIs (with bench/train.py's fit_step and step_runner, which the train stage uses).


def train_case(gpu: bool) -> tuple[str, zoo.Config, zoo.Policy, int]:
    """(name, config, policy, seq) of the train stage: Llama 3.2 1B shapes in bf16 with the flash
    kernel on a GPU, a tiny Llama on a CPU."""
    if gpu:
        config = zoo.preset("llama3-1b", max_seq_len=train_bench.GPU_SEQ)
        return "llama3-1b", config, train_bench.GPU_POLICY, train_bench.GPU_SEQ
    return "tiny-llama", zoo.preset("tiny-llama", n_layers=2, max_seq_len=64), zoo.Policy(), 64


def decode_case(gpu: bool) -> tuple[str, zoo.Config, zoo.Policy, tuple[int, ...], int, int, int]:
    """(name, config, policy, batches, context, steps, repeats) of the decode stage."""
    if gpu:
        policy = zoo.Policy(compute_dtype="bfloat16", param_dtype="bfloat16")
        return "llama3-1b", zoo.preset("llama3-1b"), policy, (1, 32), 512, 65, 5
    return "tiny-llama", zoo.preset("tiny-llama", n_layers=2), zoo.Policy(), (1, 4), 32, 33, 3


# --- The run: shared state, the files, the stages.


class StageTimeout(Exception):
    """Raised by the alarm when a stage runs past its budget plus GRACE_S."""


@dataclasses.dataclass
class Goal:
    goal: str
    target: str
    predicted: float | None
    measured: float | None
    unit: str
    passed: bool | None  # None: not judged here (a GPU goal on a CPU, or nothing measured)
    note: str = ""


class Run:
    """What the stages share (sizes, ceilings, the compiled train step) and what is written."""

    def __init__(self, out_dir: Path, budget_s: float, xla_flags: str):
        self.out_dir, self.budget_s, self.xla_flags = out_dir, budget_s, xla_flags
        self.gpu = on_gpu()
        self.ceilings = Ceilings()
        self.datasheet = zoo.math.datasheet_hardware()
        self.start = time.monotonic()
        self.info: dict[str, str] = {}
        self.stages: list[dict] = []
        self.tables: list[Table] = []
        self.goals: list[Goal] = []
        self.readings: list[str] = []
        self.train_step: Callable[[], jax.Array] | None = None

    def table(self, name: str, title: str, notes: list[str]) -> Table:
        self.tables.append(Table(name, title, notes))
        return self.tables[-1]

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = {
            "device": device_name(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "budget_s": self.budget_s,
            "wall_s": time.monotonic() - self.start,
            "info": self.info,
            "stages": self.stages,
            "ceilings": self.ceilings.as_dict(),
            "tables": [dataclasses.asdict(t) for t in self.tables],
            "goals": [dataclasses.asdict(g) for g in self.goals],
            "profile": self.readings,
        }
        (self.out_dir / "results.json").write_text(json.dumps(data, indent=1, default=str))
        (self.out_dir / "results.md").write_text(self.markdown(data))

    def markdown(self, data: dict) -> str:
        lines = [
            f"## gpu-first: {data['device']}, {data['date']}",
            "",
            f"Budget {self.budget_s:.0f} s, wall {data['wall_s']:.0f} s so far. "
            f"Sizes for a {'GPU' if self.gpu else 'CPU (smoke run, tiny sizes)'}.",
            "",
            *(f"- {key}: {value}" for key, value in self.info.items()),
            "",
            "| stage | status | s | budget s | note |",
            "|---|---|---|---|---|",
            *(
                f"| {s['stage']} | {s['status']} | {s['seconds']:.0f} | {s['budget_s']:.0f} | "
                f"{s['note']} |"
                for s in self.stages
            ),
            "",
        ]
        lines += [t.markdown() for t in self.tables] + self.readings
        lines += ["### Goals", "", "| goal | target | predicted | measured | pass | note |"]
        lines.append("|---|---|---|---|---|---|")
        for g in self.goals:
            passed = {True: "yes", False: "NO", None: "n/a"}[g.passed]
            lines.append(
                f"| {g.goal} | {g.target} | {_number(g.predicted, g.unit)} | "
                f"{_number(g.measured, g.unit)} | {passed} | {g.note} |"
            )
        return "\n".join(lines) + "\n"


def _number(value: float | None, unit: str) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.3g}{unit}"


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise StageTimeout in the main thread after `seconds` (where signals can be used)."""

    def expire(signum, frame):
        raise StageTimeout(f"stage ran past its budget + {GRACE_S:.0f} s")

    try:
        previous = signal.signal(signal.SIGALRM, expire)
    except ValueError:  # not the main thread: soft deadlines only
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- Stages: each takes the run and its soft deadline (a time.monotonic() value).


def versions(run: Run, deadline: float) -> None:
    run.info["python"] = platform.python_version()
    for package in PACKAGES:
        try:
            run.info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            run.info[package] = "absent"
    run.info["backend"] = f"{jax.default_backend()}, {jax.device_count()} device(s)"
    run.info["device"] = device_name()
    run.info["device memory GB"] = f"{device_memory_bytes() / 1e9:.1f}"
    run.info["XLA_FLAGS"] = f"`{run.xla_flags}`"
    run.info["nvidia-smi"] = nvidia_smi()


def nvidia_smi() -> str:
    """One line per GPU (name, driver, memory, max SM clock, power limit), or why there is none."""
    query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except FileNotFoundError:
        return "absent (no nvidia-smi command)"
    except subprocess.TimeoutExpired:
        return "no answer within 20 s"
    if out.returncode != 0:
        return f"failed (exit {out.returncode}): {out.stderr.strip()[:200]}"
    return "; ".join(out.stdout.strip().splitlines())


def errors_stage(run: Run, deadline: float) -> None:
    table = run.table(
        "flash-errors",
        "Flash vs naive: max error in units of the dtype's epsilon",
        [
            "Relative to the reference's largest value; allowed: "
            + ", ".join(f"{k} {v:g}" for k, v in flash_errors.ERROR_TOLERANCE.items())
            + ". Reference: naive in float32, matmul precision highest."
        ],
    )
    cases, allowed = flash_errors.error_cases(run.gpu), flash_errors.ERROR_TOLERANCE
    ratios, failed = [], []  # error / allowed of every measured output; cases that raised
    for case in cases:
        row = {
            "case": case.name,
            "shape": f"{case.batch}x{case.seq}, {case.heads}/{case.kv_heads} heads of "
            f"{case.head_dim}",
        }
        errors, note = dict.fromkeys(allowed, math.nan), "not run: budget spent"
        if time.monotonic() <= deadline:
            try:
                errors, note = flash_errors.max_errors(case), ""
                ratios += [errors[k] / allowed[k] for k in errors]
            except Exception as error:  # recorded in the row; the other cases run
                note = error_note(error)
                failed.append(case.name)
        table.add(row | errors | {"note": note})
        run.write()
    worst = max(ratios, default=math.nan)
    complete = len(ratios) == len(allowed) * len(cases)
    run.goals.append(
        Goal(
            "flash == naive (out, dq, dk, dv)",
            "error <= allowed",
            None,
            100 * worst,
            "% of allowed",
            False if failed or worst > 1 else (True if complete else None),
            f"failed: {', '.join(failed)}" if failed else "" if complete else "not all cases run",
        )
    )


def ceilings(run: Run, deadline: float) -> None:
    dtypes = ("bfloat16", "float32") if run.gpu else ("float32", "bfloat16")
    table = run.table(
        "ceilings",
        "Ceilings measured in this run",
        ["Matmul on random operands (n=8192 on a GPU); bandwidth: device copy and matvec."],
    )
    for dtype in dtypes:
        rate = run.ceilings.matmul_flops(dtype)
        sheet = run.datasheet.flops.get(dtype) if run.datasheet else None
        table.add(_ceiling_row(f"matmul {dtype}", rate / 1e12, "TFLOP/s", sheet and sheet / 1e12))
    run.ceilings.bandwidth()
    sheet = run.datasheet.bandwidth / 1e9 if run.datasheet else None
    for name in ("copy_bandwidth", "matvec_bandwidth"):
        value = run.ceilings.as_dict()[name] / 1e9
        table.add(_ceiling_row(name.replace("_", " "), value, "GB/s", sheet))


def _ceiling_row(what: str, value: float, unit: str, datasheet: float | None) -> dict:
    return {
        "what": what,
        "measured": value,
        "unit": unit,
        "datasheet": datasheet or float("nan"),
        "% of datasheet": 100 * value / datasheet if datasheet else float("nan"),
    }


def attention_stage(run: Run, deadline: float) -> None:
    shapes = sorted(attention.shapes(run.gpu), key=lambda s: (s.seq < 4096, s.seq, s.head_dim))
    dtype = shapes[0].dtype
    peak = run.ceilings.matmul_flops(dtype)
    table = run.table(
        "attention",
        "Attention kernels (causal): flash vs cuDNN vs xla",
        [f"{dtype}; predicted = FLOPs / measured {dtype} matmul ({peak / 1e12:.3g} TFLOP/s)."],
    )
    ratios = []
    for shape in shapes:
        rates = attention.measure(
            table,
            shape,
            ("flash", "cudnn", "xla"),
            peak,
            repeats=5 if run.gpu else 1,
            deadline=deadline,
        )
        run.write()
        if shape.seq >= 4096 and ("flash", "fwd+bwd") in rates and ("cudnn", "fwd+bwd") in rates:
            ratios.append((rates["flash", "fwd+bwd"] / rates["cudnn", "fwd+bwd"], shape.label()))
    worst = min(ratios, default=None)
    run.goals.append(
        Goal(
            "flash fwd+bwd vs cuDNN, seq >= 4096",
            ">= 70%",
            None,
            None if worst is None else 100 * worst[0],
            "%",
            None if worst is None else worst[0] >= 0.7,
            "worst: " + worst[1] if worst else "no cuDNN/flash pair at seq >= 4096 measured",
        )
    )


def train_stage(run: Run, deadline: float) -> None:
    name, config, policy, seq = train_case(run.gpu)
    dtype = policy.compute_dtype
    peak = run.ceilings.matmul_flops(dtype)
    memory = device_memory_bytes()
    policy, batch, compiled, needed = train_bench.fit_step(config, policy, seq, memory)
    step = train_bench.step_runner(config, policy, batch, seq, compiled)
    measured = median_seconds(step, repeats=10 if run.gpu else 2, warmup=2)
    run.train_step = step
    hardware = run.ceilings.hardware(dtype)
    predicted = zoo.math.training_step_roofline(config, batch, seq, hardware, policy)
    flops = zoo.math.training_flops_per_token(config, seq) * batch * seq
    table = run.table(
        "train",
        "Training step (train.py's jitted step, AdamW)",
        [f"{dtype} compute; % of ceiling = MFU on the measured {dtype} matmul rate."],
    )
    row = {
        "model": name,
        "params": f"{zoo.math.param_count(config) / 1e6:.0f}M",
        "batch x seq": f"{batch} x {seq}",
        "remat": policy.remat,
        "attention": policy.kernel_name,
        "predicted GB": zoo.math.training_memory_bytes(config, batch, seq, policy) / 1e9,
        "compiled GB": needed / 1e9,
        "tokens/s": batch * seq / measured,
    }
    row |= roofline_cells(predicted.time_s, measured, flops, peak, "TFLOP/s")
    reference = run.datasheet.peak_flops(dtype) if run.datasheet else peak
    row["MFU vs datasheet %"] = 100 * flops / measured / reference if run.datasheet else math.nan
    table.add(row)
    run.goals.append(
        Goal(
            f"train MFU, {name} seq {seq}",
            ">= 50% of the datasheet peak",
            100 * flops / predicted.time_s / reference,
            100 * flops / measured / reference,
            "%",
            flops / measured / reference >= 0.5 if run.datasheet else None,
            "" if run.datasheet else "no datasheet for this device: % of the measured matmul",
        )
    )


def decode_stage(run: Run, deadline: float) -> None:
    name, config, policy, batches, context, steps, repeats = decode_case(run.gpu)
    bandwidth = run.ceilings.bandwidth()
    table = run.table(
        "decode",
        "Decode: a jitted loop of greedy steps",
        [
            f"{name}, {policy.param_dtype} weights, a cache holding {context} tokens per row, "
            f"{steps} steps; step = (t({steps}) - t(1)) / {steps - 1}. Ceiling: bandwidth "
            f"{bandwidth / 1e9:.3g} GB/s measured in this run; predicted = "
            "zoo.math.decode_step_roofline. kernels/step: read off the compiled loop's body. "
            "projections: q/k/v and gate/up as separate matmuls or fused (Policy.fused)."
        ],
    )
    for batch, fused in itertools.product(batches, (False, True)):
        if time.monotonic() > deadline:
            print(f"decode batch {batch} (fused={fused}): not run, the stage's budget is spent")
            continue
        step_n, hlo = gpu_inference.decode_program(
            config, policy, batch, context, steps, fused=fused
        )
        step_s = gpu_inference.decode_step_s(step_n, steps, repeats)
        mid = context + steps // 2
        hardware = run.ceilings.hardware(policy.compute_dtype)
        predicted = zoo.math.decode_step_roofline(config, batch, mid, hardware, policy)
        n_bytes = zoo.math.decode_step_bytes(config, batch, mid, policy)
        row = {"model": name, "batch": batch, "projections": "fused" if fused else "separate"}
        row["tokens/s"] = batch / step_s
        row |= roofline_cells(predicted.time_s, step_s, n_bytes, bandwidth, "GB/s")
        row["kernels/step"] = hlo_count.kernel_count(hlo, loop_body=True)
        table.add(row)
        run.write()
        if batch == 1 and fused:  # the decode path a GPU caller takes
            run.goals.append(
                Goal(
                    "decode batch 1, share of measured bandwidth",
                    ">= 75%",
                    100 * n_bytes / predicted.time_s / bandwidth,
                    row["% of ceiling"],
                    "%",
                    row["% of ceiling"] >= 75 if run.gpu else None,
                    f"{row['kernels/step']} kernels per step",
                )
            )


def train_profile(run: Run, deadline: float) -> None:
    if run.train_step is None:
        raise RuntimeError("the train stage left no compiled step to profile")
    trace_dir = run.out_dir / "profile" / "train"
    with trace_reading.trace(trace_dir):
        for _ in range(3):
            jax.block_until_ready(run.train_step())
    run.readings.append(trace_reading.summary(trace_dir))


# (name, share of the budget, stage)
STAGES: list[tuple[str, float, Callable[[Run, float], None]]] = [
    ("versions", 0.02, versions),
    ("flash-errors", 0.12, errors_stage),
    ("ceilings", 0.06, ceilings),
    ("attention", 0.30, attention_stage),
    ("train", 0.25, train_stage),
    ("decode", 0.17, decode_stage),
    ("train-profile", 0.08, train_profile),
    ("quantized", 0.25, gpu_inference.quantized_stage),
    ("quantized-sweep", 0.25, gpu_inference.quantized_sweep_stage),
    ("kv-int8", 0.10, gpu_inference.kv_int8_stage),
    ("engine", 0.25, gpu_inference.engine_stage),
    ("paged-check", 0.05, gpu_inference.paged_check_stage),
    ("engine-profile", 0.08, gpu_inference.engine_profile_stage),
]


def run_stages(run: Run, names: list[str]) -> None:
    """The chosen stages in STAGES' order, each given its share of the budget (shares scaled
    to sum to 1 over the chosen stages)."""
    chosen = [(name, share, stage) for name, share, stage in STAGES if name in names]
    total = sum(share for _, share, _ in chosen)
    for name, share, stage in chosen:
        budget = share / total * run.budget_s
        left = run.start + run.budget_s - time.monotonic()
        record = {"stage": name, "status": "ok", "seconds": 0.0, "budget_s": budget, "note": ""}
        run.stages.append(record)
        print(f"\n== {name} (budget {budget:.0f} s, {left:.0f} s left in the run)", flush=True)
        if left < 0.25 * budget:
            record.update(status="skipped", note="the run's budget is spent")
            run.write()
            continue
        start = time.monotonic()
        try:
            with _alarm(min(budget, left) + GRACE_S):
                stage(run, start + min(budget, left))
        except Exception as error:  # recorded; the next stage runs
            record.update(status="error", note=f"{type(error).__name__}: {str(error)[:300]}")
            traceback.print_exc()
        record["seconds"] = time.monotonic() - start
        run.write()


def main(argv: list[str] | None = None, xla_flags: str | None = None) -> Run:
    """Parse `argv`, run the stages, return the run. `xla_flags`: what `python -m bench` set
    (recorded); None records the current XLA_FLAGS."""
    parser = argparse.ArgumentParser(
        prog="python -m bench gpu-first", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds in all")
    parser.add_argument("--out", type=Path, required=True, help="directory for the results")
    parser.add_argument(
        "--stages",
        default=",".join(name for name, _, _ in STAGES),
        help="comma-separated subset of the stages, run in the usual order",
    )
    args = parser.parse_args(argv)
    names = args.stages.split(",")
    unknown = sorted(set(names) - {name for name, _, _ in STAGES})
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; known: {[n for n, _, _ in STAGES]}")
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    run = Run(args.out, args.budget, flags)
    print(f"gpu-first on {device_name()}, budget {args.budget:.0f} s -> {args.out}", flush=True)
    run.write()
    run_stages(run, names)
    print("\n" + run.markdown(json.loads((args.out / "results.json").read_text())), flush=True)
    return run
