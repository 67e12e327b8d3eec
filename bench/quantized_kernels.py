"""Weight-only quantized matrix products in isolation: every formulation measured, the losers kept.

    python -m bench quantized-kernels

One decode step's weight matrices of GPT-2 124M (12 layers of q, k, v, o, up, down, and the tied
head, 124M weights), each multiplied by its own `[tokens, in]` activations in one jitted program,
side by side in one run:

- float32 weights, XLA matmul: the baseline; the float32 kernel for a few tokens
  (layers/kernels/cpu/dense.cc) on both of its walks: `x · W` (a `Linear`'s [in, out] layout)
  and `x · W^T` (the tied head's [vocab, embed] table);
- int8 weights through XLA: (a) convert + matmul, which XLA:CPU does not fuse; (b) int8 x int8
  -> int32 `dot_general` after per-token dynamic activation quantization; (c) dequantization
  tiled inside the product (a `lax.scan` over 1024-column tiles, each converted behind an
  optimization barrier so the float tile stays in cache); bfloat16 weights for reference;
- the jax.ffi CPU kernel (layers/kernels/quantized/matmul.cc) on each packed format: the zoo's
  int8 (per output channel), int4 (groups of 32), nf4 (64), and llama.cpp's Q8_0, Q4_0, Q4_1,
  Q4_K, Q6_K (random codes: the time does not depend on them); its portable C++ path for scale.

Predicted = bytes read / bandwidth measured in this run (the matvec ceiling). Then the kernel
against dequantize + XLA matmul as the tokens grow, which sets `KERNEL_TOKENS` (the kernel
serves decode and small batches; prefill and training take the XLA path).
"""

from functools import partial

import gguf
import jax
import jax.numpy as jnp
import numpy as np

import zoo
from bench.harness import Ceilings, Table, error_note, median_seconds, roofline_cells
from layers.kernels.cpu.dense import dense_matmul
from layers.kernels.quantized import cpu_matmul, reference_matmul
from layers.quantized import PackedWeight, pack
from zoo.pretrained.gguf_blocks import PACKED_TYPES, Q

REPEATS = 10
TILE = 1024


def matrices(config: zoo.Config) -> list[tuple[int, int]]:
    """(rows, cols) of one decode step's weight matrices: every layer's projections and the head."""
    m = zoo.math.quantized_matrices(config)
    return m["projections"] + m["embeddings"]


def random_gguf(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> PackedWeight:
    """A packed weight of llama.cpp type `qtype` from random blocks (float16 scales kept finite)."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block_weights * block_bytes), dtype=np.uint8)
    blocks = data.reshape(rows, -1, block_bytes)
    for at in {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q4_K: [0, 2], Q.Q6_K: [208]}[qtype]:
        blocks[..., at : at + 2] = np.array([1e-3], np.float16).view(np.uint8)
    return PACKED_TYPES[qtype](data, rows).weight(("embed", "embed"))


def _convert(x, w):
    q, s = w
    return (x @ q.astype(jnp.float32).T) * s


def _int8_dot(x, w):
    q, s = w
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    step = jnp.where(absmax > 0, absmax / 127, 1.0)
    xq = jnp.round(x / step).astype(jnp.int8)
    acc = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * step * s


def _tiled(x, w):
    q, s = w
    rows = q.shape[0]
    tiles = jnp.pad(q, ((0, -rows % TILE), (0, 0))).reshape(-1, TILE, q.shape[1])

    def tile(_, t):
        return None, x @ jax.lax.optimization_barrier(t.astype(jnp.float32)).T

    _, ys = jax.lax.scan(tile, None, tiles)
    return jnp.moveaxis(ys, 0, 1).reshape(x.shape[0], -1)[:, :rows] * s


def formulations(shapes: list[tuple[int, int]]) -> dict[str, tuple]:
    """name -> (product of one matrix `(x, weight) -> y`, the weights): float32 ones, int8 ones
    (codes, per-row scale) for the XLA formulations, packed ones for the kernel."""
    rng = np.random.default_rng(0)
    floats = [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for s in shapes]
    int8 = [
        (jnp.asarray(np.clip(np.round(w / 5e-4), -127, 127).astype(np.int8)), jnp.float32(5e-4))
        for w in floats
    ]
    kernel = cpu_matmul
    out = {
        "float32 XLA": (lambda x, w: x @ w.T, floats),
        "float32 kernel x · W": (dense_matmul, [jnp.asarray(np.asarray(w).T) for w in floats]),
        "float32 kernel x · W^T": (partial(dense_matmul, transposed=True), floats),
        "bfloat16 XLA": (
            lambda x, w: (x.astype(jnp.bfloat16) @ w.T).astype(jnp.float32),
            [w.astype(jnp.bfloat16) for w in floats],
        ),
        "int8 XLA convert + dot": (_convert, int8),
        "int8 XLA int8 x int8 -> int32": (_int8_dot, int8),
        "int8 XLA dequant tiled in a scan": (_tiled, int8),
    }
    for kind in ("int8", "int4", "nf4"):
        packed = [pack(w, kind, axes=("embed", "embed")) for w in floats]
        out[f"kernel {kind}"] = (kernel, packed)
        if kind == "int4":
            portable = lambda x, w: cpu_matmul(x, w, portable=True)  # noqa: E731
            out["kernel int4, portable C++ path"] = (portable, packed)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K):
        out[f"kernel {qtype.name}"] = (kernel, [random_gguf(*s, qtype, rng) for s in shapes])
    return out


def run(ceilings: Ceilings) -> Table:
    config = zoo.preset("gpt2-124m")
    shapes = matrices(config)
    bandwidth = ceilings.bandwidth()
    table = Table(
        "quantized-kernels",
        "Weight-only quantized matrix products in isolation (one GPT-2 124M decode step's weights)",
        [
            f"{len(shapes)} matrices, {sum(r * c for r, c in shapes) / 1e6:.0f}M weights, each "
            f"times its own [tokens, in] input in one program; median of {REPEATS}. Predicted = "
            f"bytes / bandwidth ({bandwidth / 1e9:.3g} GB/s, measured in this run); vs float32 = "
            "float32 XLA's time / this time at the same tokens. Crossover rows: the kernel "
            "against dequantize + XLA matmul on one matrix (vs float32 = dequant+XLA / kernel)."
        ],
    )
    rng = np.random.default_rng(1)
    cases = formulations(shapes)
    for tokens in (1, 8):
        xs = [jnp.asarray(rng.standard_normal((tokens, cols), np.float32)) for _, cols in shapes]
        baseline = None
        for name, (product, weights) in cases.items():
            n_bytes = sum(a.nbytes for a in jax.tree.leaves(weights))
            program = jax.jit(
                lambda xs, ws, f=product: [f(x, w) for x, w in zip(xs, ws, strict=True)]
            )
            row = {"tokens": tokens, "formulation": name, "MB": n_bytes / 1e6}
            try:
                seconds = median_seconds(
                    lambda p=program, w=weights, x=xs: p(x, w), repeats=REPEATS
                )
            except Exception as error:  # a formulation that fails is a row too
                table.add(row | {"formulation": f"{name}: {error_note(error)}"})
                continue
            baseline = baseline or seconds
            row |= roofline_cells(n_bytes / bandwidth, seconds, n_bytes, bandwidth, "GB/s")
            table.add(row | {"vs float32": baseline / seconds})
    crossover(table, rng)
    return table


def crossover(table: Table, rng: np.random.Generator) -> None:
    """The kernel against dequantize + XLA matmul on one 3072 x 768 matrix as tokens grow."""
    w = jnp.asarray(rng.standard_normal((3072, 768), np.float32) * 0.02)
    kernel, reference = jax.jit(cpu_matmul), jax.jit(reference_matmul)
    for kind in ("int8", "int4"):
        packed = pack(w, kind, axes=("embed", "embed"))
        for tokens in (1, 8, 32, 64, 128, 256):
            x = jnp.asarray(rng.standard_normal((tokens, 768), np.float32))
            k = median_seconds(lambda x=x, p=packed: kernel(x, p), repeats=REPEATS)
            r = median_seconds(lambda x=x, p=packed: reference(x, p), repeats=REPEATS)
            name = f"crossover {kind} 3072x768: kernel (dequant+XLA {1e3 * r:.3g} ms)"
            nan = float("nan")
            table.add(
                {
                    "tokens": tokens,
                    "formulation": name,
                    "MB": packed.nbytes / 1e6,
                    "predicted ms": nan,
                    "measured ms": 1e3 * k,
                    "achieved GB/s": nan,
                    "% of ceiling": nan,
                    "vs float32": r / k,
                }
            )
