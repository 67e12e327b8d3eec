"""Attention kernels side by side: naive, xla, flash (Pallas) and, on a GPU, cuDNN through
`jax.nn.dot_product_attention(implementation="cudnn")`. For each shape: forward and
forward+backward time beside the compute roofline (FLOPs over the matmul rate measured in this
run).

    python -m bench attention

GPU: causal, bfloat16, Llama 3.2 1B's heads (32 query / 8 K/V heads of 64, GQA) and 16 heads of
128, seq 2048, 4096 and 8192 at 16k tokens per batch. CPU: tiny float32 shapes (flash runs in the
Pallas interpreter on CPU: a correctness path, not a speed path, so its CPU numbers say nothing
about the kernel's GPU speed).

FLOPs: forward = 4 x batch x heads x seq x kv_seq x head_dim (QK^T and PV), halved when causal;
forward+backward = 3.5 x forward (the backward's five matmuls, without the recompute of P).

naive and xla build the whole score matrix: a (shape, kernel) whose float32 score matrices would
not fit in the device's memory (`fits_in_memory`) is skipped and says so, and any other error of
one (shape, kernel) is recorded in its row; the run goes on.
"""

import dataclasses
import time

import jax
import jax.numpy as jnp

from bench.harness import (
    Ceilings,
    Table,
    device_memory_bytes,
    error_note,
    median_seconds,
    on_gpu,
    roofline_cells,
)
from layers.kernels import AttentionMask, causal_mask, kernel_named

# Float32 score-sized buffers alive at the peak: scores and probabilities in the forward, plus
# their two gradients in the backward (XLA may fuse some away; this errs on the safe side).
SCORE_BUFFERS = {"fwd": 2, "fwd+bwd": 4}
# Share of the device's memory the score matrices may take (the rest: q, k, v, outputs, XLA's
# scratch).
MEMORY_SHARE = 0.6
PASSES = {"fwd": 1.0, "fwd+bwd": 3.5}  # FLOPs relative to the forward


@dataclasses.dataclass(frozen=True)
class Shape:
    """One causal self-attention problem: q [batch, seq, heads, head_dim], k/v with kv_heads."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str

    def flops(self, pass_: str) -> float:
        return PASSES[pass_] * attention_flops(
            self.batch, self.heads, self.seq, self.head_dim, causal=True
        )

    def score_bytes(self) -> int:
        """One float32 [batch, heads, seq, seq] score matrix."""
        return 4 * self.batch * self.heads * self.seq * self.seq

    def label(self) -> str:
        return f"{self.batch}x{self.seq}, {self.heads}/{self.kv_heads} heads of {self.head_dim}"


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> float:
    flops = 4.0 * batch * heads * seq * seq * head_dim
    return flops / 2 if causal else flops


def shapes(gpu: bool) -> list[Shape]:
    if gpu:
        return [
            Shape(16384 // seq, seq, heads, kv_heads, head_dim, "bfloat16")
            for heads, kv_heads, head_dim in ((32, 8, 64), (16, 16, 128))
            for seq in (2048, 4096, 8192)
        ]
    return [Shape(1, seq, 4, 2, 64, "float32") for seq in (128, 256)]


def cudnn_attention(q, k, v, mask: AttentionMask):
    """cuDNN's fused attention; only the plain causal / bidirectional masks are handed over."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=mask.causal, implementation="cudnn")


def kernels(names: tuple[str, ...]) -> dict:
    """The kernels called `names` that exist on this backend (cuDNN only on a GPU)."""
    found = {name: kernel_named(name) for name in names if name != "cudnn"}
    if "cudnn" in names and on_gpu():
        found["cudnn"] = cudnn_attention
    return found


def fits_in_memory(shape: Shape, pass_: str, memory: float) -> bool:
    """Whether the score matrices a materialising kernel (naive, xla) keeps fit in `memory`."""
    return SCORE_BUFFERS[pass_] * shape.score_bytes() <= MEMORY_SHARE * memory


def inputs(shape: Shape):
    keys = jax.random.split(jax.random.key(shape.seq), 3)
    q = jax.random.normal(keys[0], (shape.batch, shape.seq, shape.heads, shape.head_dim))
    k, v = (
        jax.random.normal(key, (shape.batch, shape.seq, shape.kv_heads, shape.head_dim))
        for key in keys[1:]
    )
    mask = causal_mask(jnp.broadcast_to(jnp.arange(shape.seq), (shape.batch, shape.seq)))
    return *(x.astype(shape.dtype) for x in (q, k, v)), mask


def programs(kernel):
    """(forward, forward+backward) jitted for one kernel."""

    def forward(q, k, v, mask):
        return kernel(q, k, v, mask)

    def loss(q, k, v, mask):
        return jnp.sum(kernel(q, k, v, mask).astype(jnp.float32))

    return {"fwd": jax.jit(forward), "fwd+bwd": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}


def measure(
    table: Table,
    shape: Shape,
    names: tuple[str, ...],
    peak: float,
    *,
    repeats: int,
    deadline: float | None = None,
) -> dict[tuple[str, str], float]:
    """Time every kernel in `names` on `shape`, forward and forward+backward, adding a row each;
    returns achieved FLOP/s per (kernel, pass). Each (kernel, pass) has its own try/except: an
    error (out of memory, a shape the kernel refuses) fills its row's note. Nothing new starts
    after `deadline` (a time.monotonic() value)."""
    memory = device_memory_bytes()
    qkv_mask = inputs(shape)
    rates = {}
    for name, kernel in kernels(names).items():
        fns = programs(kernel)
        for pass_, fn in fns.items():
            row = {"kernel": name, "shape": shape.label(), "pass": pass_}
            flops = shape.flops(pass_)
            measured, note = float("nan"), ""
            if deadline is not None and time.monotonic() > deadline:
                note = "not run: stage budget spent"
            elif name in ("naive", "xla") and not fits_in_memory(shape, pass_, memory):
                need = SCORE_BUFFERS[pass_] * shape.score_bytes()
                note = (
                    f"skipped: needs ~{need / 1e9:.0f} GB of scores, device has {memory / 1e9:.0f}"
                )
            else:
                try:
                    measured = median_seconds(lambda fn=fn: fn(*qkv_mask), repeats=repeats)
                    rates[name, pass_] = flops / measured
                except Exception as error:  # recorded in the row; the run goes on
                    note = error_note(error)
            cells = roofline_cells(flops / peak, measured, flops, peak, "TFLOP/s")
            table.add(row | cells | {"note": note})
    return rates


def run(ceilings: Ceilings) -> Table:
    gpu = on_gpu()
    todo = shapes(gpu)
    dtype = todo[0].dtype
    peak = ceilings.matmul_flops(dtype)
    table = Table(
        "attention",
        "Attention kernels (causal)",
        [
            f"{dtype}; ceiling: {dtype} matmul {peak / 1e12:.3g} TFLOP/s measured in this run; "
            "predicted = FLOPs / ceiling; shape = batch x seq, query/K/V heads of head_dim."
        ],
    )
    for shape in todo:
        measure(table, shape, ("naive", "xla", "flash", "cudnn"), peak, repeats=10 if gpu else 2)
    return table
