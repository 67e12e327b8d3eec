"""What every benchmark shares: the device's size class, median timing after a warm-up, the
ceilings (matmul rate per dtype, copy bandwidth) measured once per run, result tables printed as
Markdown and written as JSON, and the optional profiler trace.

A table's standard columns follow the course's loop (predict, measure, compare): `predicted ms`
(zoo.math roofline on the ceilings measured now), `measured ms`, the achieved rate (TFLOP/s or
GB/s of the model's work over the measured time) and `% of ceiling`.
"""

import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from zoo import math


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def device_name() -> str:
    device = jax.devices()[0]
    return f"{device.platform} ({device.device_kind})"


def device_memory_bytes() -> int:
    """Memory of the first device as the backend reports it (GPUs do), else (CPUs) the host's
    physical memory."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def error_note(error: BaseException) -> str:
    """One short line for a table cell: the error's type and the first line of its message."""
    first = (str(error).strip().splitlines() or [""])[0]
    return f"error: {type(error).__name__}: {first[:160]}"


def median_seconds(fn: Callable[[], Any], *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `fn()` (its result blocked on) after `warmup` calls (compilation)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest CPU cache Linux reports under `caches` (sysfs `index*/size`, e.g. "48K",
    "307200K"): the last level, shared by the cores. 0 where none is reported."""
    sizes = [0]
    for entry in caches.glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def cpu_streaming_bytes() -> int:
    """The buffer a CPU's bandwidth is measured over: 256 MiB, or four times the last-level
    cache where that is larger, so the bytes come from memory as a decode step's weights do (a
    300 MiB L3 served a 64 MiB matvec at 33 GB/s against 26 from memory, and a step streaming
    GPT-2's 498 MB gets the latter). Four times, not two: the ceiling is a fastest run, which
    at twice the cache is the run the cache happened to serve most (bench/RESULTS.md, "Ceilings
    from the fastest run")."""
    return max(256 * 2**20, 4 * last_level_cache_bytes())


def matvec_bandwidth(n_bytes: int) -> float:
    """Bytes/s of a float32 matrix-vector product over an `n_bytes` matrix (read once), its
    fastest of 30 runs: a ceiling, as zoo.math measures the others (a run takes a few
    ms on a CPU, so a median of a few follows whatever else the host was running then)."""
    cols = 8192
    w = jnp.ones((n_bytes // (4 * cols), cols), jnp.float32)
    x = jnp.ones((1, w.shape[0]), jnp.float32)
    return w.nbytes / math.fastest_seconds(jax.jit(jnp.matmul), x, w, repeats=30)


class Ceilings:
    """Matmul FLOP/s per dtype and copy bandwidth, each measured the first time it is asked for
    and then shared by every benchmark of the run."""

    def __init__(self):
        self._flops: dict[str, float] = {}
        self._bandwidth: float | None = None
        self._copy = self._matvec = None

    def matmul_flops(self, dtype: str) -> float:
        if dtype not in self._flops:
            self._flops[dtype] = float(
                math.measure_matmul_flops(dtype, n=8192 if on_gpu() else 1024)
            )
        return self._flops[dtype]

    def bandwidth(self) -> float:
        """The larger of a device copy's and a float32 matrix-vector product's bytes/s: both only
        stream memory, but XLA:CPU runs the elementwise copy on one thread, so on a CPU the copy
        alone understates what decode (a matvec per weight) can stream."""
        if self._bandwidth is None:
            n_bytes = 2**31 if on_gpu() else cpu_streaming_bytes()
            self._copy = float(math.measure_copy_bandwidth(n_bytes))
            self._matvec = matvec_bandwidth(n_bytes)
            self._bandwidth = max(self._copy, self._matvec)
        return self._bandwidth

    def hardware(self, dtype: str) -> math.Hardware:
        """These ceilings as a zoo.math Hardware, for its rooflines."""
        return math.Hardware(
            name=f"measured {device_name()}",
            flops={dtype: self.matmul_flops(dtype)},
            bandwidth=self.bandwidth(),
        )

    def as_dict(self) -> dict:
        return {
            "matmul_flops": dict(self._flops),
            "bandwidth": self._bandwidth,
            "copy_bandwidth": self._copy,
            "matvec_bandwidth": self._matvec,
        }


def roofline_cells(
    predicted_s: float, measured_s: float, work: float, ceiling: float, unit: str
) -> dict:
    """The standard columns: `work` is FLOPs (unit "TFLOP/s") or bytes (unit "GB/s") done in
    `measured_s`; `ceiling` the matching measured rate."""
    scale = 1e12 if unit == "TFLOP/s" else 1e9
    rate = work / measured_s
    return {
        "predicted ms": 1e3 * predicted_s,
        "measured ms": 1e3 * measured_s,
        f"achieved {unit}": rate / scale,
        "% of ceiling": 100 * rate / ceiling,
    }


@dataclasses.dataclass
class Table:
    """One benchmark's result: a title, notes (the ceilings and sizes used) and rows of cells."""

    name: str
    title: str
    notes: list[str] = dataclasses.field(default_factory=list)
    rows: list[dict] = dataclasses.field(default_factory=list)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        if len(self.rows) == 1:
            print(f"\n### {self.title}\n", *(f"{n}\n" for n in self.notes), sep="\n", end="")
            print("\n" + _header(row))
        print(_cells(row), flush=True)

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", *self.notes, ""]
        if self.rows:
            lines += [_header(self.rows[0]), *(_cells(r) for r in self.rows)]
        return "\n".join(lines) + "\n"


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _header(row: dict) -> str:
    return "| " + " | ".join(row) + " |\n|" + "---|" * len(row)


def _cells(row: dict) -> str:
    return "| " + " | ".join(_format(v) for v in row.values()) + " |"


def write(
    out_dir: Path,
    tables: list[Table],
    ceilings: Ceilings,
    seconds: float,
    profiles: list[str],
    xla_flags: str,
) -> None:
    """`results.json` (every row's raw numbers) and `results.md` (the tables and any profile
    readings) in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "device": device_name(),
        "devices": jax.device_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "ceilings": ceilings.as_dict(),
        "wall_s": seconds,
        "xla_flags": xla_flags,
    }
    data = {**header, "benchmarks": [dataclasses.asdict(t) for t in tables]}
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    flops = ", ".join(
        f"{d} {r / 1e12:.3g} TFLOP/s" for d, r in ceilings.as_dict()["matmul_flops"].items()
    )
    gb = {k: (v or 0) / 1e9 for k, v in ceilings.as_dict().items() if k.endswith("bandwidth")}
    intro = (
        f"{header['device']}, {header['date']}; ceilings measured in this run: matmul {flops}; "
        f"bandwidth {gb['bandwidth']:.3g} GB/s (the larger of copy {gb['copy_bandwidth']:.3g} "
        f"and float32 matvec {gb['matvec_bandwidth']:.3g}). Whole run {seconds:.0f} s. "
        f"XLA_FLAGS: `{xla_flags}`.\n\n"
    )
    body = "\n".join([*(t.markdown() for t in tables), *profiles])
    (out_dir / "results.md").write_text(intro + body)
