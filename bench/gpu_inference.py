"""The inference stages of `python -m bench gpu-first` (bench/gpu_first.py runs them like its
others: each its own share of the budget, results written after every row):

- quantized: the Pallas kernel (layers/kernels/quantized/pallas.py) against the specification
  (dequantize, then the product in float32) on every format it takes, in units of bfloat16's
  epsilon; then whole-model decode with bfloat16, int8 and int4 weights side by side;
- kv-int8: decode over bfloat16 vs int8 KV pools at a long context, where the cache's bytes
  weigh as much as the weights';
- engine: what `Engine` gives on the device with every default: decode steps at 1, 8 and 32 rows
  against the bandwidth roofline, mixed requests against prefill at the matmul rate plus decode at
  the bandwidth, and the cost of a verification step of k drafts in plain steps (the number
  speculative decoding's speedup divides by).

On a CPU every stage runs at tiny sizes (a smoke run, which the tests exercise).
"""

import dataclasses
import functools
import itertools
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import zoo
from bench import trace_reading
from bench.harness import median_seconds, roofline_cells
from infer import Engine
from infer.speculative import PromptLookup
from layers.kernels.paged import Int8Pages, PallasDecodeKernel, XlaPagedKernel, paged_attention
from layers.kernels.paged.decode import DecodePlan, paged_decode
from layers.kernels.paged.int8 import dequantize as dequantize_pool
from layers.kernels.paged.int8 import quantize as quantize_pool
from layers.kernels.quantized import pallas, reference_matmul
from layers.paged_cache import POOL_AXES
from layers.quantized import pack

BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)


def decode_program(
    config: zoo.Config,
    policy: zoo.Policy,
    batch: int,
    context: int,
    steps: int,
    *,
    fused: bool,
    quantized: str | None = None,
    kv_dtype: str | None = None,
    decode_kernel=None,
):
    """(run, hlo): `run(n)` runs n greedy decode steps of a random model in one jitted loop (n is
    a runtime argument: one compile serves every n) on a KV cache already holding `context` tokens
    per row, and returns the last tokens; `hlo` is the compiled loop's optimized HLO. `fused`:
    q/k/v and gate/up as one matmul each (`Policy.fused`); `quantized`: `zoo.quantize`'s kind
    (unfused only); `kv_dtype`: the cache's (`init_cache`); `decode_kernel`: the policy's (None:
    the backend's default)."""
    policy = policy.replace(storage="unrolled", fused=fused, decode_kernel=decode_kernel)
    model = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
    if quantized is not None:
        model = zoo.quantize(model, quantized)
    empty = model.init_cache(batch, context + steps, kv_dtype=kv_dtype)
    # Rows that hold `context` tokens already (zeros: the step reads them all the same).
    cache = eqx.tree_at(lambda c: c.lengths, empty, jnp.full((batch,), context, jnp.int32))

    def loop(model, cache, token, n):
        def step(_, carry):
            token, cache, _ = carry
            out = model.forward(token[:, None], cache=cache)
            token = jnp.argmax(out.logits[:, 0], axis=-1).astype(jnp.int32)
            return token, out.cache, out.logits[:, 0]

        logits = jnp.zeros((batch, config.vocab_size), policy.compute_dtype)
        return jax.lax.fori_loop(0, n, step, (token, cache, logits))[::2]

    token = jnp.ones((batch,), jnp.int32)
    compiled = jax.jit(loop).lower(model, cache, token, 1).compile()
    return (lambda n: compiled(model, cache, token, n)), compiled.as_text()


def decode_step_s(step_n, steps: int, repeats: int) -> float:
    """Seconds per step of a `decode_program`: (t(steps) - t(1)) / (steps - 1), medians."""
    t1 = median_seconds(lambda: step_n(1), repeats=repeats)
    tn = median_seconds(lambda: step_n(steps), repeats=repeats)
    return (tn - t1) / (steps - 1)


def _sizes(gpu: bool):
    """(name, config, policy, context, steps, repeats)."""
    if gpu:
        policy = zoo.Policy(compute_dtype="bfloat16", param_dtype="bfloat16")
        return "llama3-1b", zoo.preset("llama3-1b"), policy, 512, 33, 3
    config = zoo.preset("tiny-llama", n_layers=2, max_seq_len=256)
    return "tiny-llama", config, zoo.Policy(), 32, 9, 2


# --- quantized


def kernel_errors(run, deadline: float) -> None:
    """The Pallas kernel vs dequantize + a float32 product, every format it takes."""
    table = run.table(
        "quantized-kernel-errors",
        "Pallas quantized kernel vs the specification (dequantize, float32 product)",
        ["x in bfloat16; max |kernel - spec| / max |spec| in units of bfloat16's epsilon "
         f"({BF16_EPS:.3g}). Bound: the kernel rounds each dequantized weight to bfloat16 (at "
         "most eps/2 of it) and sums in float32 over n inputs, so |error| <= (eps/2 + "
         "n * 2^-24) * max over outputs of sum |x_i w_i|, over the same max |spec|."],
    )  # fmt: skip
    rng = np.random.default_rng(0)
    rows, cols = (4096, 2048) if run.gpu else (64, 256)
    w = jnp.asarray(rng.normal(size=(rows, cols)).astype(np.float32) * 0.02)
    for kind in ("int8", "int4"):
        weight = pack(w, kind, axes=("embed", "embed"))
        dequantized = weight.dequantize(jnp.float32)
        for tokens in (1, 8, 32):
            if time.monotonic() > deadline:
                return
            x = jnp.asarray(rng.normal(size=(tokens, cols)), jnp.bfloat16)
            spec = jax.jit(reference_matmul)(x.astype(jnp.float32), weight)
            got = jax.jit(pallas.pallas_matmul, static_argnames="interpret")(
                x, weight, interpret=not run.gpu
            )
            top = float(jnp.max(jnp.abs(spec)))
            error = float(jnp.max(jnp.abs(got.astype(jnp.float32) - spec))) / top
            magnitude = float(jnp.max(jnp.abs(x.astype(jnp.float32)) @ jnp.abs(dequantized).T))
            bound = (BF16_EPS / 2 + cols * 2.0**-24) * magnitude / top
            table.add({
                "format": kind, "shape": f"{rows}x{cols}", "tokens": tokens,
                "error (eps)": error / BF16_EPS, "bound (eps)": bound / BF16_EPS,
                "within": error <= bound,
            })  # fmt: skip
            run.write()


def quantized_decode(run, deadline: float) -> None:
    """Whole-model decode, bfloat16 vs int8 vs int4 weights, batch 1 and 8."""
    name, config, policy, context, steps, repeats = _sizes(run.gpu)
    bandwidth = run.ceilings.bandwidth()
    table = run.table(
        "quantized-decode",
        "Decode with packed weights (zoo.quantize, embeddings int8): a jitted loop of greedy steps",
        [f"{name}, {context}-token cache, unfused projections; predicted = (weight + KV bytes) / "
         f"measured bandwidth {bandwidth / 1e9:.3g} GB/s; speedup vs the same batch's bfloat16."],
    )  # fmt: skip
    for batch in (1, 8) if run.gpu else (1,):
        base = None
        for kind in (None, "int8", "int4"):
            if time.monotonic() > deadline:
                return
            step_n, _ = decode_program(config, policy, batch, context, steps, fused=False,
                                       quantized=kind)  # fmt: skip
            step_s = decode_step_s(step_n, steps, repeats)
            base = step_s if kind is None else base
            n_bytes = zoo.math.quantized_weight_bytes(config, kind, policy) + batch * (
                zoo.math.kv_cache_bytes(config, context + steps // 2, policy)
            )
            row = {"weights": kind or policy.param_dtype, "batch": batch}
            row["tokens/s"] = batch / step_s
            row |= roofline_cells(n_bytes / bandwidth, step_s, n_bytes, bandwidth, "GB/s")
            row["speedup"] = f"{base / step_s:.2f}x"
            table.add(row)
            run.write()


def quantized_stage(run, deadline: float) -> None:
    kernel_errors(run, deadline)
    quantized_decode(run, deadline)


# --- int8 KV cache


def kv_int8_stage(run, deadline: float) -> None:
    """bfloat16 vs int8 pools. Every row starts from the same token over zero pools, and a random
    model's bfloat16 logits hold near-ties at the top, so any perturbation (int8's half step, or
    only another reader's float32 rounding) may flip a greedy token; the rows then decode other
    sequences and the last step compares unrelated logits. The comparison that measures the
    pools is the first step's logits (the same inputs); on a GPU a third row, the bfloat16 pools
    through the other reader (XLA instead of the Pallas kernel), gives the noise floor of that
    comparison: a perturbation of float32 rounding alone."""
    name, config, policy, _, steps, repeats = _sizes(run.gpu)
    batch, context = (32, 4096) if run.gpu else (4, 64)
    bandwidth = run.ceilings.bandwidth()
    table = run.table(
        "kv-int8",
        "Decode over bfloat16 vs int8 KV pages (the default decode kernel)",
        [f"{name}, batch {batch}, a cache holding {context} tokens per row; predicted = (weights "
         f"+ KV bytes) / measured bandwidth {bandwidth / 1e9:.3g} GB/s; greedy: the share of the "
         "last step's tokens equal to the bfloat16 pool's; logits error: max |difference| / max "
         "|logits|, at the first step (the same inputs: what the pools change) and at the last "
         "(after a flipped greedy token, the rows decode other sequences). 'bfloat16, XLA "
         "reader': the noise floor, bfloat16 pools read by the other decode kernel."],
    )  # fmt: skip
    base = None
    variants = [(None, None), ("int8", None)]
    if run.gpu:
        variants.append((None, XlaPagedKernel()))
    for kv_dtype, kernel in variants:
        if time.monotonic() > deadline:
            return
        step_n, _ = decode_program(config, policy, batch, context, steps, fused=True,
                                   kv_dtype=kv_dtype, decode_kernel=kernel)  # fmt: skip
        step_s = decode_step_s(step_n, steps, repeats)
        first = np.asarray(step_n(1)[1], np.float32)
        tokens, logits = (np.asarray(a, np.float32) for a in step_n(steps))
        if base is None:
            base = step_s, first, tokens, logits
        mid = context + steps // 2
        n_bytes = zoo.math.decode_step_bytes(config, batch, mid, policy, kv_dtype=kv_dtype)
        pools = kv_dtype or policy.compute_dtype
        row = {"KV pages": pools if kernel is None else f"{pools}, XLA reader"}
        row["tokens/s"] = batch / step_s
        row |= roofline_cells(n_bytes / bandwidth, step_s, n_bytes, bandwidth, "GB/s")
        row["speedup"] = f"{base[0] / step_s:.2f}x"
        row["greedy equal"] = f"{np.mean(tokens == base[2]):.2f}"
        for label, got, want in (("first", first, base[1]), ("last", logits, base[3])):
            row[f"logits error ({label} step)"] = float(
                np.max(np.abs(got - want)) / np.max(np.abs(want))
            )
        table.add(row)
        run.write()


# --- the engine


def _engine_max_len(gpu: bool) -> int:
    """The engines' cache length: on a CPU the smoke run's requests fit 64 tokens, and a shorter
    cache has fewer prompt shapes to compile (the engine-profile stage reuses the programs)."""
    return 1024 if gpu else 64


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def engine_stage(run, deadline: float) -> None:
    """The engine with every default: decode steps at 1 and 8 rows, 24 mixed requests, the cost
    of a verification step, then 32 rows (the row the stage can best do without when its budget
    runs out: an H200 run spent its budget before the mixed requests)."""
    name, config, policy, _, _, _ = _sizes(run.gpu)
    model = zoo.Transformer(config, policy=policy.replace(storage="unrolled"),
                            key=jax.random.key(0))  # fmt: skip
    bandwidth, max_len = run.ceilings.bandwidth(), _engine_max_len(run.gpu)
    new = 64 if run.gpu else 8
    # Mixed requests: (count, longest prompt, most new tokens); a CPU's fit its smaller cache.
    mixed, longest, most_new = (24, 160, 48) if run.gpu else (8, 40, 16)
    table = run.table(
        "engine",
        "Engine with every default on the device (random weights, greedy)",
        [f"{name} {policy.param_dtype}, max_len {max_len}. Decode: the run's wall time per step, "
         f"every row decoding after the prompt steps (25-token prompts, {new} new); predicted = "
         f"bytes / measured bandwidth {bandwidth / 1e9:.3g} GB/s. Mixed: {mixed} requests "
         f"(prompts 4-{longest}, 4-{most_new} new) on 8 rows; predicted = prompts' FLOPs at the "
         "measured matmul rate + the fewest 8-row decode steps."],
    )  # fmt: skip
    vocab = config.vocab_size
    nan = float("nan")

    def decode(rows: int) -> None:
        engine = Engine(model, max_batch=rows, max_len=max_len)
        for i in range(rows):
            engine.submit(_prompt(25, 300 + i, vocab), max_new_tokens=new)
        before, start = engine.steps, time.perf_counter()
        engine.run()
        # Wall time over steps: a step's record spans its dispatch to its read after the next
        # step's dispatch (the host runs one step behind), so records overlap.
        step_s = (time.perf_counter() - start) / (engine.steps - before)
        n_bytes = zoo.math.decode_step_bytes(config, rows, 25 + new // 2, model.policy)
        row = {"what": f"decode step, {rows} row(s)", "tokens/s": rows / step_s}
        table.add(row | roofline_cells(n_bytes / bandwidth, step_s, n_bytes, bandwidth, "GB/s"))

    def mixed_requests() -> None:
        rng = np.random.default_rng(7)
        cases = [(_prompt(int(rng.integers(4, longest + 1)), s, vocab),
                  int(rng.integers(4, most_new + 1))) for s in range(mixed)]  # fmt: skip
        engine = Engine(model, max_batch=8, max_len=max_len)
        start = time.perf_counter()
        for p, n in cases:
            engine.submit(p, max_new_tokens=n)
        engine.run()
        seconds = time.perf_counter() - start
        generated = sum(n for _, n in cases)
        steps = -(-(generated - len(cases)) // 8)
        flops = sum(len(p) * zoo.math.forward_flops_per_token(config, len(p)) for p, _ in cases)
        predicted = flops / run.ceilings.matmul_flops(policy.compute_dtype) + steps * (
            zoo.math.decode_step_bytes(config, 8, 100, model.policy) / bandwidth
        )
        table.add({
            "what": f"{mixed} mixed requests, 8 rows ({engine.steps} engine steps, fewest {steps})",
            "tokens/s": generated / seconds, "predicted ms": 1e3 * predicted,
            "measured ms": 1e3 * seconds, "achieved GB/s": nan,
            "% of ceiling": 100 * predicted / seconds,
        })  # fmt: skip

    def verification() -> None:
        # Verification's cost: the adaptive proposer times its plain and its k-draft steps.
        k = 6
        engine = Engine(model, max_batch=1, max_len=max_len, speculative=PromptLookup(k=k))
        engine.submit(_prompt(8, 1, vocab) * (8 if run.gpu else 4), max_new_tokens=new)
        engine.run()
        table.add({
            "what": f"a verification step of k={k} drafts, 1 row: "
            f"{engine.costs.verify_cost():.2f} plain steps",
            "tokens/s": nan, "predicted ms": nan, "measured ms": nan, "achieved GB/s": nan,
            "% of ceiling": nan,
        })  # fmt: skip

    parts = [lambda: decode(1)]
    if run.gpu:
        parts += [lambda: decode(8), mixed_requests, verification, lambda: decode(32)]
    else:
        parts += [mixed_requests, verification]
    for part in parts:
        if time.monotonic() > deadline:
            return
        part()
        run.write()


# --- the Pallas quantized kernel's plan, swept


def _matrices(config: zoo.Config) -> list[tuple[int, int]]:
    """One layer's weight matrices (each shape once) and the head: (rows, cols)."""
    projections = sorted(set(zoo.math.quantized_matrices(config)["projections"]))
    return [*projections, (config.vocab_size, config.d_model)]


def _plan(weight, knobs, interpret: bool):
    """plan_for's plan with the sweep's knobs (rows, splits, cols, warps), or None where they do
    not tile the weight."""
    rows, splits, cols, warps = knobs
    cols = min(cols, weight.shape[1] & -weight.shape[1])
    if weight.shape[1] // cols % splits or weight.shape[0] % rows:
        return None
    base = pallas.plan_for(weight, interpret=interpret)
    return dataclasses.replace(base, block_rows=rows, splits=splits, block_cols=cols,
                               num_warps=warps)  # fmt: skip


def _timed_products(xs, weights, knob, interpret: bool) -> tuple[list, float]:
    """Every `x · W^T` in one jitted program under one plan (`knob`: "default" for plan_for's,
    None for dequantize + XLA's product, else the sweep's knobs); the outputs and the median
    seconds."""

    def one(x, w):
        if knob is None:
            return x @ w.dequantize(x.dtype).T
        plan = None if knob == "default" else _plan(w, knob, interpret)
        return pallas.pallas_matmul(x, w, interpret=interpret, plan=plan)

    f = jax.jit(lambda xs, ws: [one(x, w) for x, w in zip(xs, ws, strict=True)])
    return f(xs, weights), median_seconds(lambda: f(xs, weights), repeats=20)


def quantized_sweep_stage(run, deadline: float) -> None:
    """Plans around `plan_for`'s defaults on one layer's matrices and the head at 1 token, against
    the dense bfloat16 product and dequantize + XLA's product."""
    name, config, *_ = _sizes(run.gpu)
    shapes = _matrices(config) if run.gpu else [(64, 256), (128, 256)]
    bandwidth = run.ceilings.bandwidth()
    table = run.table(
        "quantized-plans",
        "Pallas quantized kernel plans: one layer's matrices + the head, 1 token",
        [f"{name} shapes {shapes}; bfloat16 x; predicted = packed bytes / measured bandwidth "
         f"{bandwidth / 1e9:.3g} GB/s; error vs dequantize + float32 product in bf16 eps; a plan "
         "that does not tile a matrix leaves it to plan_for's."],
    )  # fmt: skip
    rng = np.random.default_rng(0)
    dense = [jnp.asarray(rng.normal(size=s) * 0.02, jnp.bfloat16) for s in shapes]
    xs = [jnp.asarray(rng.normal(size=(1, s[1])), jnp.bfloat16) for s in shapes]
    dense_f = jax.jit(lambda xs, ws: [x @ w.T for x, w in zip(xs, ws, strict=True)])
    dense_s = median_seconds(lambda: dense_f(xs, dense), repeats=20)
    dense_bytes = sum(2 * r * c for r, c in shapes)
    table.add({"kind": "bfloat16 dense", "plan": "XLA", "error (eps)": 0.0,
               "measured ms": 1e3 * dense_s, "achieved GB/s": dense_bytes / dense_s / 1e9,
               "% of ceiling": 100 * dense_bytes / dense_s / bandwidth,
               "vs dense": "1.00x"})  # fmt: skip
    run.write()
    knobs = [(r, s, 256, w) for r, s, w in itertools.product((64, 128), (4, 8, 16), (4, 8))]
    knobs = knobs if run.gpu else knobs[:1]  # a CPU runs the interpreter: one plan of the grid
    plans = [("plan_for (the default)", "default"), ("dequantize + XLA", None)]
    plans += [("rows {}, splits {}, cols {}, warps {}".format(*k), k) for k in knobs]
    for kind in ("int8", "int4"):
        weights = [pack(w.astype(jnp.float32), kind, axes=("embed", "embed")) for w in dense]
        n_bytes = sum(zoo.math.packed_bytes(r, c, kind) for r, c in shapes)
        specs = [reference_matmul(x.astype(jnp.float32), w)
                 for x, w in zip(xs, weights, strict=True)]  # fmt: skip
        for label, knob in plans:
            if time.monotonic() > deadline:
                return
            got, seconds = _timed_products(xs, weights, knob, not run.gpu)
            error = max(
                float(jnp.max(jnp.abs(g.astype(jnp.float32) - s)) / jnp.max(jnp.abs(s)))
                for g, s in zip(got, specs, strict=True)
            )
            table.add({"kind": kind, "plan": label, "error (eps)": error / BF16_EPS,
                       "measured ms": 1e3 * seconds, "achieved GB/s": n_bytes / seconds / 1e9,
                       "% of ceiling": 100 * n_bytes / seconds / bandwidth,
                       "vs dense": f"{dense_s / seconds:.2f}x"})  # fmt: skip
            run.write()


# --- every paged decode path against a float32 reference


def _paged_paths(heads: int, kv_heads: int, head_dim: int, gpu: bool) -> dict:
    """{(pools, path): error in bfloat16 eps, or the failure's text} for random keys and values
    in bfloat16 and int8 pools (rows of `length` tokens)."""
    interpret = not gpu
    rows, length, page = (4, 1000, 16) if gpu else (2, 40, 16)
    row_pages = -(-length // page)
    rng = np.random.default_rng(heads)
    pool = jnp.asarray(rng.normal(size=(kv_heads, rows * row_pages, page, head_dim)), jnp.bfloat16)
    int8 = Int8Pages(*quantize_pool(pool), POOL_AXES)
    q = jnp.asarray(rng.normal(size=(rows, 1, heads, head_dim)), jnp.bfloat16)
    table = jnp.arange(rows * row_pages, dtype=jnp.int32).reshape(rows, row_pages)
    lengths = jnp.full((rows,), length, jnp.int32)
    q_pos = lengths[:, None] - 1
    plan = DecodePlan(windowed=False, softcap=None, scale=head_dim**-0.5, pages_per_block=4,
                      splits=4, num_warps=4, num_stages=2, interpret=interpret)  # fmt: skip

    @functools.partial(jax.jit, static_argnames="kernel")
    def attend(q, k, v, kernel):
        if kernel == "pallas-int8":  # below paged_attention's refusal of int8 pools on a GPU
            return paged_decode(q, k, v, table, lengths, q_pos, None, plan)
        return paged_attention(q, k, v, table, lengths, q_positions=q_pos, kernel=kernel)

    f32 = lambda x: jax.tree.map(lambda a: a.astype(jnp.float32), x)  # noqa: E731
    xla, compiled = XlaPagedKernel(), PallasDecodeKernel(interpret=interpret)
    references = {
        "bfloat16": attend(f32(q), f32(pool), f32(pool), xla),
        "int8": attend(f32(q), dequantize_pool(int8), dequantize_pool(int8), xla),
    }
    calls = {
        ("bfloat16", "xla"): (pool, xla), ("bfloat16", "pallas"): (pool, compiled),
        ("int8", "xla"): (int8, xla), ("int8", "pallas"): (int8, "pallas-int8"),
    }  # fmt: skip
    errors = {}
    for (pools, path), (k, kernel) in calls.items():
        reference = references[pools]
        try:
            out = attend(q, k, k, kernel).astype(jnp.float32)
        except Exception as failure:  # recorded; the next path runs
            errors[pools, path] = str(failure)[:120]
            continue
        error = jnp.max(jnp.abs(out - reference)) / jnp.max(jnp.abs(reference))
        errors[pools, path] = float(error) / BF16_EPS
    return errors


def paged_check_stage(run, deadline: float) -> None:
    """The paged decode paths on the device over the same keys and values: XLA and the compiled
    Pallas kernel, on bfloat16 pools and on int8 pools (the kernel called below its refusal of
    int8 pools on a GPU, which this check exists to lift or confirm), each against the XLA path in
    float32 over the values the pools stand for."""
    table = run.table(
        "paged-check",
        "Paged decode paths vs a float32 reference over the same pools",
        ["max |out - reference| / max |reference| in bfloat16 eps; reference: XlaPagedKernel in "
         "float32 over the pools' own values (bfloat16, or int8 numbers times their scales)."],
    )  # fmt: skip
    configs = ((32, 8, 64), (16, 16, 128)) if run.gpu else ((4, 2, 64),)
    for heads, kv_heads, head_dim in configs:
        if time.monotonic() > deadline:
            return
        for (pools, path), error in _paged_paths(heads, kv_heads, head_dim, run.gpu).items():
            failed = isinstance(error, str)
            table.add({"heads": f"{heads}/{kv_heads} of {head_dim}", "pools": pools,
                       "path": path, "error (eps)": float("nan") if failed else error,
                       "note": error if failed else ""})  # fmt: skip
        run.write()


# --- where an engine step's time goes


def engine_profile_stage(run, deadline: float) -> None:
    """Decode-only engine steps at 1 row under the profiler (a separate, untimed pass: the
    profiler turns XLA's command buffers off) and the reading of the trace: the device's op
    time per group and the top ops, beside the step's wall time."""
    _, config, policy, *_ = _sizes(run.gpu)
    model = zoo.Transformer(config, policy=policy.replace(storage="unrolled"),
                            key=jax.random.key(0))  # fmt: skip
    engine = Engine(model, max_batch=1, max_len=_engine_max_len(run.gpu))
    engine.submit(_prompt(25, 1, config.vocab_size), max_new_tokens=8)
    engine.run()
    trace_dir = run.out_dir / "profile" / "engine"
    first = len(engine.records)
    with trace_reading.trace(trace_dir):
        engine.submit(_prompt(25, 2, config.vocab_size), max_new_tokens=32)
        engine.run()
    steps = [r.ms for r in engine.records[first:] if r.chunks == 0]
    run.info["engine steps profiled"] = f"{len(steps)}, median {statistics.median(steps):.2f} ms"
    run.readings.append(trace_reading.summary(trace_dir))
