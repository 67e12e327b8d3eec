"""`--profile`: a jax.profiler trace of a benchmark and the course's reading of it, the ops that
took the most device time grouped as matmul fusions vs collectives vs everything else
(elementwise fusions, copies).

The trace is written with `create_perfetto_trace=True`, whose `*.trace.json.gz` (Chrome trace
events) is parsed here, so no TensorBoard/xprof install is needed. Op events are the complete
("X") events that carry an `hlo_op` argument: one execution of an HLO instruction of a compiled
program (`fusion.12`, `dot.3`, `all-reduce.1`, ...); compilation and host dispatch events are
left out.
"""

import collections
import contextlib
import gzip
import json
from pathlib import Path

import jax

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "nccl",
    "allreduce",
    "allgather",
)
# Matmul-bearing ops: XLA's dots and GEMM fusions, cuBLAS/cuDNN/CUTLASS/Triton kernels, the Pallas
# flash kernel, and XLA:CPU's `ynn_fusion` (a dot fused with its neighbours, run by YNNPACK).
# Plain loop fusions (elementwise, copies, transposes) count as "other".
MATMUL_FUSION = (
    "dot",
    "gemm",
    "matmul",
    "convolution",
    "cublas",
    "cutlass",
    "triton",
    "cudnn",
    "flash",
    "ynn_fusion",
)


def group(name: str) -> str:
    lower = name.lower()
    if any(c in lower for c in COLLECTIVES):
        return "collective"
    if any(m in lower for m in MATMUL_FUSION):
        return "matmul/fusion"
    return "other"


@contextlib.contextmanager
def trace(out_dir: Path):
    """Profile the block into `out_dir` (TensorBoard/xprof-readable, plus a Perfetto trace)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out_dir), create_perfetto_trace=True):
        yield


def op_times(out_dir: Path) -> dict[str, float]:
    """Total microseconds per op name from the newest Perfetto trace under `out_dir`."""
    files = sorted(out_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise ValueError(f"no *.trace.json.gz under {out_dir}: the profiler wrote no trace")
    with gzip.open(files[-1]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals: dict[str, float] = collections.defaultdict(float)
    for event in events:
        op = event.get("args", {}).get("hlo_op")
        if event.get("ph") == "X" and op:
            totals[op] += float(event.get("dur", 0))
    return dict(totals)


def summary(out_dir: Path, top: int = 15) -> str:
    """A Markdown reading of the trace: time per group, then the top ops."""
    totals = op_times(out_dir)
    groups: dict[str, float] = collections.defaultdict(float)
    for name, us in totals.items():
        groups[group(name)] += us
    whole = sum(groups.values()) or 1.0
    lines = [f"Profile {out_dir}: op time by group", "", "| group | ms | % |", "|---|---|---|"]
    lines += [
        f"| {g} | {us / 1e3:.1f} | {100 * us / whole:.0f} |"
        for g, us in sorted(groups.items(), key=lambda kv: -kv[1])
    ]
    lines += ["", "| top op | group | ms | % |", "|---|---|---|---|"]
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name[:60]} | {group(name)} | {us / 1e3:.1f} | {100 * us / whole:.1f} |")
    return "\n".join(lines) + "\n"
