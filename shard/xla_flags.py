"""XLA flags this library sets by default for GPUs, merged into `XLA_FLAGS` before JAX starts its
backend (XLA reads the variable once, when the first computation initialises the backend).

train.py and `python -m bench` call `set_default_xla_flags()` first thing. A flag the user already
names in `XLA_FLAGS` keeps the user's value, so any default can be switched off for a side-by-side
measurement (e.g. `XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false`). The flags only
touch XLA:GPU's compiler; on a CPU they are parsed and ignored.

- `xla_gpu_enable_latency_hiding_scheduler`: schedule collectives (FSDP's all-gathers and
  reduce-scatters, data parallelism's all-reduce) to overlap with compute instead of in line
  (JAX's GPU performance guide; NVIDIA's JAX containers set it). It matters on more than one GPU.
- `xla_gpu_enable_highest_priority_async_stream`: run those collectives on the highest-priority
  stream, so the overlapped communication is not starved by the compute kernels (same guide).
- `xla_gpu_enable_command_buffer`: XLA's default kinds (fusions, cuBLAS, cuBLASLt, custom calls,
  cuDNN) plus `CONDITIONAL` and `WHILE`, so a program's `lax.cond` and data-bounded loops run inside
  the CUDA graph instead of splitting it. Without them the host copies each predicate back and
  waits for the device, so the next call's launch cannot overlap this one: the serving engine's
  step (a cond for sampling, one for log-probabilities, a bounded loop in the sampler's filters)
  pays that every step (bench/RESULTS.md, "GPU: NVIDIA H200, 2026-11-28").

bench/RESULTS.md records the flags each run used.
"""

import os

from jax._src import xla_bridge

GPU_DEFAULTS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_highest_priority_async_stream": "true",
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE",
}


def merged_xla_flags(user_flags: str) -> str:
    """`user_flags` plus every GPU default the user did not set (the user's value wins)."""
    named = {flag.lstrip("-").split("=")[0] for flag in user_flags.split()}
    added = [f"--{name}={value}" for name, value in GPU_DEFAULTS.items() if name not in named]
    return " ".join([*user_flags.split(), *added])


def set_default_xla_flags() -> str:
    """Merge the defaults into `os.environ["XLA_FLAGS"]` and return the result. Must run before the
    first JAX computation: afterwards XLA has read its flags and this raises a RuntimeError."""
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "set_default_xla_flags() ran after JAX initialised its backend, so XLA would ignore "
            "the flags; call it before the first JAX computation (at the top of the script)"
        )
    os.environ["XLA_FLAGS"] = merged_xla_flags(os.environ.get("XLA_FLAGS", ""))
    return os.environ["XLA_FLAGS"]
