"""One entry point for every benchmark: `python -m bench all --out RESULTS_DIR` runs them all
(train step, attention kernels, prefill/decode, decode layouts, MoE, flash block sizes,
samplers, the serving engine and its host cost per step, the HTTP server, speculative
decoding, LoRA/QLoRA vs full fine-tuning, the pipeline bubble, asynchronous vs synchronous
checkpoint saves, quantized inference and its kernels, GRPO rollout vs update, the int8 KV
cache, logprobs) with sizes for
the device found, each printing predicted (zoo.math roofline) vs measured beside the ceilings
measured once in this run, and writes `results.json` and `results.md` to RESULTS_DIR.

    python -m bench all --out results/
    python -m bench decode                 # one benchmark
    python -m bench train --profile        # plus a jax.profiler trace and its top ops
    python -m bench gpu-first --out DIR    # a new GPU's first run (bench/gpu_first.py)
"""

import argparse
import importlib
import sys
import time
from pathlib import Path

from bench import gpu_first, harness, trace_reading
from shard.xla_flags import set_default_xla_flags

BENCHMARKS = {
    "train": "bench.train",
    "attention": "bench.attention",
    "decode": "bench.decode",
    "layout": "bench.decode_layout",
    "moe": "bench.moe",
    "flash-blocks": "bench.flash_blocks",
    "sampling": "bench.sampling",
    "engine": "bench.engine",
    "engine-host": "bench.engine_host",
    "speculative": "bench.speculative",
    "serve": "bench.serve",
    "lora": "bench.lora",
    "context": "bench.context",
    "pipeline": "bench.pipeline",
    "checkpoint": "bench.checkpoint",
    "quantized": "bench.quantized",
    "quantized-kernels": "bench.quantized_kernels",
    "posttrain": "bench.posttrain",
    "kv-int8": "bench.kv_int8",
    "logprobs": "bench.logprobs",
}


def parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("name", choices=["all", "gpu-first", *BENCHMARKS], help="which benchmark to run")
    p.add_argument("--out", type=str, help="directory for results.json and results.md")
    p.add_argument(
        "--profile", action="store_true", help="after each benchmark, run it again under "
        "jax.profiler (untimed) into --out (default bench-profile/) and print its top ops"
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu-first"]:
        gpu_first.main(argv[1:], xla_flags=set_default_xla_flags())
        return
    args = parser(prog).parse_args(argv)
    args.out = args.out and Path(args.out)
    xla_flags = set_default_xla_flags()
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    start = time.perf_counter()
    ceilings = harness.Ceilings()
    print(f"device: {harness.device_name()}; sizes for a {'GPU' if harness.on_gpu() else 'CPU'}")
    print(f"XLA_FLAGS: {xla_flags}")
    tables, readings = [], []
    for name in names:
        run = importlib.import_module(BENCHMARKS[name]).run
        tables.append(run(ceilings))
        if args.profile:
            # A second pass under the profiler, its timings thrown away: the timed pass above
            # never runs under it (on JAX 0.11 the profiler turns XLA's command buffers off,
            # which slows decode's many small kernels).
            trace_dir = (args.out or Path("bench-profile")) / "profile" / name
            print(f"\nprofiling {name} in a separate pass (its timings are discarded)")
            with trace_reading.trace(trace_dir):
                run(ceilings)
            readings.append(trace_reading.summary(trace_dir))
            print("\n" + readings[-1], flush=True)
    seconds = time.perf_counter() - start
    print(f"\n{len(tables)} benchmark(s) in {seconds:.0f} s")
    if args.out:
        harness.write(args.out, tables, ceilings, seconds, readings, xla_flags)
        print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")


if __name__ == "__main__":
    main()
