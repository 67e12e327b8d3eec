"""Run telemetry, the "profile" step: metrics to JSON lines, MFU, predicted vs measured step time
and a loss-curve PNG.

MFU (Chowdhery et al. 2022, PaLM appendix B) = model FLOPs per second / the device's peak, with
model FLOPs from `zoo.math.training_flops_per_token` (6N plus attention, no remat recompute) and
the peak from the datasheet table for known accelerators or measured once at start-up on a CPU.
"""

import json
import time
from pathlib import Path

from zoo import Config, Policy
from zoo import math as zmath


def hardware(peak_flops: float = 0.0, bandwidth: float = 0.0, dtype: str = "float32"):
    """The device's ceilings: given numbers when both are set, else detected/measured."""
    if peak_flops > 0 and bandwidth > 0:
        return zmath.Hardware(name="given", flops={dtype: peak_flops}, bandwidth=bandwidth)
    return zmath.detect_hardware()


def compiled_memory_bytes(compiled) -> int:
    """Device bytes a compiled program needs, from XLA's memory analysis: its arguments and outputs
    (a donated argument's output reuses its buffer) and its temporaries."""
    m = compiled.memory_analysis()
    used = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return used + m.temp_size_in_bytes


METRICS, ABANDONED = "metrics.jsonl", "metrics.abandoned.jsonl"


def set_aside_abandoned(run_dir: Path, step: int) -> str | None:
    """Keep metrics.jsonl one timeline when a run resumes from `step` while it holds records of
    later steps (a resume from an earlier checkpoint, or after a crash past the last one): those
    records move to metrics.abandoned.jsonl, after a line saying from which resume, and
    metrics.jsonl is rewritten (atomically) without them. Returns what was done, for the console;
    None when nothing was abandoned. Lines that are not JSON records stay where they are."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return None
    kept, abandoned = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        later = isinstance(record, dict) and isinstance(record.get("step"), int)
        (abandoned if later and record["step"] > step else kept).append(line)
    if not abandoned:
        return None
    with (path.parent / ABANDONED).open("a") as f:
        f.write(json.dumps({"resumed_at_step": step, "abandoned_records": len(abandoned)}) + "\n")
        f.writelines(line if line.endswith("\n") else line + "\n" for line in abandoned)
    tmp = path.with_name(f".{METRICS}.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
    return (
        f"metrics: {len(abandoned)} record(s) of steps after {step} belong to the timeline this "
        f"resume abandons; moved to {ABANDONED}, so {METRICS} holds one timeline"
    )


class Telemetry:
    """Writes `metrics.jsonl` in the run directory and turns step timings into MFU."""

    def __init__(
        self,
        run_dir: Path,
        config: Config,
        policy: Policy,
        batch: int,
        seq_len: int,
        hw: zmath.Hardware,
        *,
        accum: int = 1,
        lora: tuple[int, int] | None = None,
        write: bool = True,
    ):
        """`lora`: (trainable parameters, frozen base bytes) of a LoRA run; `write`: append the
        records to `metrics.jsonl` (only one process of a multi-process run does)."""
        self.write = write
        self.path = Path(run_dir) / METRICS
        self.config, self.policy = config, policy
        # Activations are live for one micro-batch at a time.
        micro = batch // accum
        self.full_bytes = zmath.training_memory_bytes(config, micro, seq_len, policy)
        self.predicted_bytes = self.full_bytes
        if lora is not None:
            trainable, frozen = lora
            self.predicted_bytes = zmath.training_memory_bytes(
                config, micro, seq_len, policy, trainable=trainable, frozen_bytes=frozen
            )
        self.lora = lora is not None
        self.tokens_per_step = batch * seq_len
        self.flops_per_token = zmath.training_flops_per_token(
            config, seq_len, weight_grads=not self.lora
        )
        self.peak = hw.peak_flops(policy.compute_dtype)
        self.hardware = hw
        self.predicted = zmath.training_step_roofline(config, batch, seq_len, hw, policy)
        self.records: list[dict] = []
        self.start = time.time()

    def forget_after(self, step: int) -> None:
        """Drop the records of steps after `step` from `metrics.jsonl`: a run resumed from the
        checkpoint of `step` trains those steps again (a stopped run may have logged some past
        its last checkpoint), and each step is recorded once."""
        if not (self.write and self.path.is_file()):
            return
        lines = self.path.read_text().splitlines()
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.rename(self.path)

    def mfu(self, step_s: float) -> float:
        return self.flops_per_token * self.tokens_per_step / step_s / self.peak

    def log(self, **record) -> dict:
        record = {"time": round(time.time() - self.start, 3), **record}
        self.records.append(record)
        if self.write:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        return record

    def predicted_line(self, measured_s: float) -> str:
        p = self.predicted
        return (
            f"step time: predicted {p.time_s * 1e3:.1f} ms ({p.bound}-bound roofline at "
            f"{self.peak / 1e9:.0f} GFLOP/s, {self.hardware.bandwidth / 1e9:.0f} GB/s on "
            f"{self.hardware.name}) vs measured {measured_s * 1e3:.1f} ms"
        )

    def memory_line(self, compiled_bytes: int, devices: int) -> str:
        full = (
            f"; the full fine-tune it replaces: {self.full_bytes / 1e9:.2f} GB predicted"
            if self.lora
            else ""
        )
        return (
            f"memory: predicted {self.predicted_bytes / 1e9:.2f} GB (zoo.math, remat="
            f"{self.policy.remat}, all on one device) vs compiled {compiled_bytes / 1e9:.2f} GB "
            f"per device (XLA's memory analysis of the train step, {devices} device(s)){full}"
        )

    def plot(self, path: Path, entropy: float | None = None) -> Path:
        """Training and validation loss against step, with the unigram entropy as a line."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        train = [(r["step"], r["loss"]) for r in self.records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in self.records if "val_loss" in r]
        for points, label in [(train, "train"), (val, "validation")]:
            if points:
                ax.plot(
                    *zip(*points, strict=True),
                    label=label,
                    marker="." if label != "train" else None,
                )
        if entropy is not None:
            ax.axhline(entropy, color="gray", linestyle="--", label="unigram entropy")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
