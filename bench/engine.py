"""The serving engine as a user meets it, every default, side by side in one run with HF
transformers' `generate` (bench/hf_engine.py in the reference venv) and with the roofline
(zoo.math's FLOPs and bytes over the ceilings measured in this run):

- the first-use path on GPT-2 124M (random weights written as an HF checkpoint): `load_pretrained`
  then `generate`, 16-token prompts, 64 new tokens, batch 1 and 8, against the predicted time
  (prefill FLOPs at the matmul rate, each decode step's bytes at the weight-streaming bandwidth)
  and HF's generate on the same checkpoint, with the same greedy tokens;
- on the real SmolLM2-135M-Instruct weights (GGUF, float32):
  - latency of one `generate` call (8 new tokens) on a prompt length it has never seen, after
    one warm-up call on another length, beside HF's;
  - decode step time of 8 rows holding the same live tokens under `max_len` 256 and 4096
    (attention reads the pages rows hold: the step should not care);
  - throughput of 24 mixed requests (prompts of 4-160 tokens, 4-48 new tokens) through one
    `infer.Engine` (8 rows) beside static batches of 8 through `generate` and beside the
    roofline (every prompt's FLOPs at the matmul rate plus the fewest decode steps of 8 rows at
    the bandwidth), wall and CPU seconds (the CPU is shared), the steps taken beside the fewest
    a first-come-first-served engine can take, every request's greedy tokens checked against
    the request run alone;
  - KV-cache bytes the engine's pages held at most, beside a contiguous `8 x max_len` cache;
  - prefix reuse: 8 requests sharing a 128-token system prompt;
- sliding layers' rings vs full-length pages on a Gemma-3-shaped model (random weights).

    python -m bench engine
"""

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import infer
import zoo
from bench.harness import Ceilings, Table
from cli.flags import default_chat_model as smollm2_gguf
from infer.compiling import finish_compiles
from infer.engine import CHUNK, PROMPT_TOKENS, TRACES, Engine, default_prompt_tokens
from zoo import math as zmath

NEW_TOKENS = 8
WARMUP_LEN, UNSEEN, LATENCY_PROMPTS = 37, (23, 61, 118), 3
ROWS, MAX_LEN = 8, 256
FIRST_USE_PROMPT, FIRST_USE_NEW, REPEATS = 16, 64, 3
REF_PYTHON = Path(__file__).resolve().parents[1] / ".venv-ref" / "bin" / "python"


def prompt(n: int, seed: int, high: int = 40000) -> list[int]:
    return np.random.default_rng(seed).integers(100, high, n).tolist()


def hf_calls(path: Path, calls: list[dict]) -> list[dict] | None:
    """HF's generate on `path` for each call (bench/hf_engine.py), or None without the venv."""
    python = os.environ.get("ZOO_REF_PYTHON") or str(REF_PYTHON)
    if not Path(python).exists():
        return None
    out = subprocess.run(
        [python, str(Path(__file__).with_name("hf_engine.py")),
         json.dumps({"path": str(path), "calls": calls})],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"bench/hf_engine.py failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def held_bytes(model) -> int:
    """The bytes of the model's weights as loaded (packed weights as packed: SmolLM2's GGUF
    holds ~97 MB, not float32's 538)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(model))


def decode_step_s(model, ceilings: Ceilings, rows: int, context: int) -> float:
    """zoo.math's roofline of one decode step of `rows` rows at `context` cached tokens: its
    bytes (the weights as held, once; each row's cache) at the bandwidth or its FLOPs at the
    matmul rate, whichever binds (at 8 rows on a CPU the FLOPs can), both measured this run."""
    hardware = ceilings.hardware("float32")
    return zmath.decode_step_roofline(
        model.config, rows, context, hardware, weights=held_bytes(model)
    ).time_s


def predicted_s(model, ceilings: Ceilings, prompt_lens: list[int], steps: int, rows: int):
    """zoo.math's roofline: every prompt's forward FLOPs at the matmul rate, then `steps` decode
    steps of `rows` rows at their mean context (`decode_step_s`)."""
    flops = sum(n * zmath.forward_flops_per_token(model.config, n) for n in prompt_lens)
    context = sum(prompt_lens) // len(prompt_lens) + steps // 2
    prompts = flops / ceilings.matmul_flops("float32")
    return prompts + steps * decode_step_s(model, ceilings, rows, context)


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def first_use(table: Table, ceilings: Ceilings) -> None:
    """`load_pretrained` + `generate` with every default, GPT-2 124M, beside HF and the
    roofline."""
    config = zoo.preset("gpt2-124m")
    with tempfile.TemporaryDirectory() as directory:
        zoo.save_pretrained(zoo.Transformer(config, key=jax.random.key(0)), directory)
        model = zoo.load_pretrained(directory)
        batches = {b: [prompt(FIRST_USE_PROMPT, 10 + i, 50000) for i in range(b)] for b in (1, 8)}
        calls = [{"prompts": p, "new_tokens": FIRST_USE_NEW, "warmup": True, "repeats": REPEATS}
                 for p in batches.values()]  # fmt: skip
        hf = hf_calls(Path(directory), calls)
    for i, (batch, prompts) in enumerate(batches.items()):

        def call(prompts=prompts):
            return infer.generate(
                model, prompts, max_new_tokens=FIRST_USE_NEW, sampler=infer.Greedy(),
                key=jax.random.key(0),
            )  # fmt: skip

        first_s, _ = _timed(call)  # compiles the engine's programs for this batch bucket
        runs = [_timed(call) for _ in range(REPEATS)]
        ours_s, tokens = statistics.median(s for s, _ in runs), runs[-1][1]
        predicted = predicted_s(model, ceilings, [FIRST_USE_PROMPT] * batch, FIRST_USE_NEW - 1,
                                batch)  # fmt: skip
        new = batch * FIRST_USE_NEW
        peer = "-" if hf is None else f"{new / hf[i]['seconds']:.1f} tok/s (HF generate)"
        same = (
            "-" if hf is None else sum(a == b for a, b in zip(tokens, hf[i]["tokens"], strict=True))
        )
        table.add({
            "what": f"load_pretrained + generate, GPT-2 124M, batch {batch}, "
            f"{FIRST_USE_PROMPT}-token prompts, {FIRST_USE_NEW} new",
            "predicted": f"{new / predicted:.1f} tok/s",
            "ours": f"{new / ours_s:.1f} tok/s ({100 * predicted / ours_s:.0f}% of predicted)",
            "peer": peer,
            "ratio": "-" if hf is None else f"{hf[i]['seconds'] / ours_s:.2f}x",
            "note": f"same greedy tokens as HF: {same}/{batch} rows; first call (compiles) "
            f"{first_s:.1f} s",
        })  # fmt: skip


def latency(model, table: Table, gguf: Path, ceilings: Ceilings) -> None:
    """One `generate` call per prompt, the median of `LATENCY_PROMPTS` prompts of each unseen
    length: one call per row moved with the host's noise (bench/RESULTS.md)."""
    seeds = {n: [n + 1000 * i for i in range(LATENCY_PROMPTS)] for n in UNSEEN}
    calls = [{"prompts": [prompt(WARMUP_LEN, WARMUP_LEN)], "new_tokens": NEW_TOKENS,
              "warmup": False, "repeats": 1}]  # fmt: skip
    calls += [{"prompts": [prompt(n, seed)], "new_tokens": NEW_TOKENS, "warmup": False,
               "repeats": 1} for n in UNSEEN for seed in seeds[n]]  # fmt: skip
    hf = hf_calls(gguf, calls)

    def call(n, seed):
        return _timed(lambda: infer.generate(
            model, [prompt(n, seed)], max_new_tokens=NEW_TOKENS, sampler=infer.Greedy(),
            key=jax.random.key(0),
        ))[0]  # fmt: skip

    # Lowers every program of a batch-1 engine and waits for the two this request runs (the
    # larger prompt parts compile behind it: infer/compiling.py).
    first = call(WARMUP_LEN, WARMUP_LEN)
    predicted = predicted_s(model, ceilings, [WARMUP_LEN], NEW_TOKENS - 1, 1)
    table.add({
        "what": f"the first generate call of the process, {WARMUP_LEN}-token prompt, "
        f"{NEW_TOKENS} new",
        "predicted": f"{predicted * 1e3:.0f} ms",
        "ours": f"{first * 1e3:.0f} ms",
        "peer": "-" if hf is None else f"{hf[0]['seconds'] * 1e3:.0f} ms (HF's first generate)",
        "ratio": "-" if hf is None else f"{hf[0]['seconds'] / first:.2f}x",
        "note": "ours compiles the step programs this request runs here (the engine's other "
        "prompt-part shapes compile behind it)",
    })  # fmt: skip
    traces = sum(TRACES.values())
    for i, n in enumerate(UNSEEN):
        ours = statistics.median(call(n, seed) for seed in seeds[n])
        compiled = sum(TRACES.values()) - traces
        predicted = predicted_s(model, ceilings, [n], NEW_TOKENS - 1, 1)
        first = 1 + i * LATENCY_PROMPTS
        peer = None if hf is None else statistics.median(
            c["seconds"] for c in hf[first : first + LATENCY_PROMPTS]
        )  # fmt: skip
        table.add({
            "what": f"one generate call, unseen prompt of {n} tokens, {NEW_TOKENS} new "
            f"(median of {LATENCY_PROMPTS} prompts)",
            "predicted": f"{predicted * 1e3:.0f} ms",
            "ours": f"{ours * 1e3:.0f} ms",
            "peer": "-" if peer is None else f"{peer * 1e3:.0f} ms (HF generate)",
            "ratio": "-" if peer is None else f"{peer / ours:.2f}x",
            "note": f"programs compiled since the warm-up: {compiled}",
        })  # fmt: skip


def _timed_decode_step(engine: Engine, rows: int) -> float | None:
    """One `engine.step()` call: its wall seconds if the step it read had all `rows` decoding
    (no prompt chunk), else None. A call dispatches one step and waits for the one before (the
    host runs one step behind), so it lasts one step once the device is the bound; a step's own
    record spans two (from its dispatch to its read after the next dispatch)."""
    start = time.perf_counter()
    engine.step()
    read = engine.records[-1] if engine.records else None
    if read is not None and read.chunks == 0 and read.decode_rows == rows:
        return time.perf_counter() - start
    return None


def decode_step_ms(engine: Engine, rows: int) -> float:
    """Run the engine's requests; the median wall ms of a step while all `rows` decode."""
    times = []
    while engine.busy:
        if (seconds := _timed_decode_step(engine, rows)) is not None:
            times.append(seconds)
    if len(times) < 2:
        raise RuntimeError(
            f"decode_step_ms: {len(times)} step(s) had all {rows} rows decoding; give the "
            "requests more new tokens or finish the engine's compiles first"
        )
    return 1e3 * statistics.median(times[1:])


def interleaved_step_ms(engines: list[Engine], rows: int) -> list[float]:
    """`decode_step_ms` of each engine, their steps taken in turn (one step of each, then the
    next), so that a drift of the shared machine hits them alike."""
    times: list[list[float]] = [[] for _ in engines]
    while any(engine.busy for engine in engines):
        for engine, kept in zip(engines, times, strict=True):
            if engine.busy and (seconds := _timed_decode_step(engine, rows)) is not None:
                kept.append(seconds)
    return [1e3 * statistics.median(kept[1:]) for kept in times]


def max_len_independence(model, table: Table, ceilings: Ceilings) -> None:
    """Decode steps with every row decoding, rows holding ~25-90 tokens (25-token prompts, 64
    new), under max_len 256 and 4096: two engines stepped in turn."""
    context = 25 + 32
    for rows in (1, ROWS):
        engines = [Engine(model, max_batch=rows, max_len=max_len) for max_len in (256, 4096)]
        for engine in engines:
            for i in range(rows):
                engine.submit(prompt(25, 300 + i), max_new_tokens=64)
        short, long = interleaved_step_ms(engines, rows)
        predicted = decode_step_s(model, ceilings, rows, context)
        table.add({
            "what": f"decode step, {rows} row(s) holding 25-89 tokens, max_len 4096 vs 256",
            "predicted": f"{predicted * 1e3:.1f} ms (either)",
            "ours": f"{long:.1f} ms (max_len 4096)",
            "peer": f"{short:.1f} ms (max_len 256)",
            "ratio": f"{long / short:.2f}x",
            "note": "goal: within 10%; the two engines stepped in turn",
        })  # fmt: skip


def mixed_requests() -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(7)
    return [(prompt(int(rng.integers(4, 161)), s), int(rng.integers(4, 49))) for s in range(24)]


def fewest_fcfs_steps(new_tokens: list[int], rows: int) -> int:
    """Steps of a first-come-first-served engine of `rows` rows that never wastes one: each
    request takes the first free row for as many steps as it has new tokens (its whole prompt
    in the step of its first token)."""
    free = [0] * rows
    for n in new_tokens:
        row = free.index(min(free))
        free[row] += n
    return max(free)


def throughput(model, table: Table, ceilings: Ceilings) -> None:
    cases = mixed_requests()
    generated = sum(n for _, n in cases)
    steps = -(-(generated - len(cases)) // ROWS)  # the fewest decode steps of ROWS rows
    lens = [len(p) for p, _ in cases]
    predicted = predicted_s(model, ceilings, lens, steps, ROWS)
    # What continuous batching gains at the roofline with prompts and decode steps costed
    # apart: static batches run as many steps as their longest request, first come first
    # served at best the `fewest_fcfs_steps`; both compute the same prompts, so the more a
    # prompt costs beside a decode step, the less the saved steps count. Not a bound: a
    # mixed step's decode rows ride on its prompt chunks' read of the weights, which the
    # engine does more often than static batches (each of those prefills before it decodes).
    static_steps = sum(max(n for _, n in cases[i : i + ROWS]) for i in range(0, len(cases), ROWS))
    fcfs_steps = fewest_fcfs_steps([n for _, n in cases], ROWS)
    allowed = predicted_s(model, ceilings, lens, static_steps, ROWS) / predicted_s(
        model, ceilings, lens, fcfs_steps, ROWS
    )

    def continuous() -> tuple[Engine, list]:
        engine = Engine(model, max_batch=ROWS, max_len=MAX_LEN, prefix_sharing=False)
        requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
        engine.run()
        return engine, requests

    def static() -> list[list[int]]:
        tokens = []
        for first in range(0, len(cases), ROWS):
            batch = cases[first : first + ROWS]
            out = infer.generate(
                model, [p for p, _ in batch], max_new_tokens=max(n for _, n in batch),
                sampler=infer.Greedy(), key=jax.random.key(0), max_len=MAX_LEN,
            )  # fmt: skip
            tokens += [t[:n] for t, (_, n) in zip(out, batch, strict=True)]
        return tokens

    # Each side once untimed, then every program compiled, those made ahead included (which
    # wait for an idle engine, and meanwhile steps take the smaller prompt parts): the timed
    # runs find every program they use compiled (the first call's compiles have their own row).
    continuous(), static()
    finish_compiles()
    start, cpu = time.perf_counter(), time.process_time()
    engine, requests = continuous()
    engine_s, engine_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    static_tokens = static()
    static_s, static_cpu = time.perf_counter() - start, time.process_time() - cpu

    alone = Engine(model, max_batch=1, max_len=MAX_LEN, prefix_sharing=False)
    same = 0
    for (p, n), request in zip(cases, requests, strict=True):
        single = alone.submit(p, max_new_tokens=n)
        alone.run()
        same += single.tokens == request.tokens
    table.add({
        "what": f"{len(cases)} mixed requests (prompts 4-160, 4-48 new), {ROWS} rows",
        "predicted": f"{generated / predicted:.1f} tok/s ({predicted:.1f} s: prompts at the "
        f"matmul rate + {steps} steps of {ROWS} rows)",
        "ours": f"{generated / engine_s:.1f} tok/s ({engine.steps} engine steps, "
        f"{engine_cpu:.1f} CPU-s, {100 * predicted / engine_s:.0f}% of predicted)",
        "peer": f"{generated / static_s:.1f} tok/s (static batches of {ROWS}, generate; "
        f"{static_cpu:.1f} CPU-s)",
        "ratio": f"{static_s / engine_s:.2f}x (CPU-s {static_cpu / engine_cpu:.2f}x)",
        "note": f"at the roofline, prompts and steps costed apart: {allowed:.2f}x "
        f"({static_steps} static steps, {fcfs_steps} first come first served at best); "
        f"same greedy tokens as alone: "
        f"{same}/{len(cases)}; static batches "
        f"agree: {static_tokens == [r.tokens for r in requests]}",
    })  # fmt: skip
    table.add({
        "what": "KV cache held (engine's peak pages vs a contiguous cache)",
        "predicted": "-",
        "ours": f"{engine.peak_kv_bytes() / 2**20:.1f} MiB",
        "peer": f"{engine.contiguous_kv_bytes() / 2**20:.1f} MiB ({ROWS} x {MAX_LEN} slots)",
        "ratio": f"{engine.contiguous_kv_bytes() / engine.peak_kv_bytes():.2f}x",
        "note": "",
    })  # fmt: skip


def prefix_reuse(model, table: Table) -> None:
    system = prompt(128, 99)
    questions = [prompt(12, 100 + i) for i in range(8)]
    results = {}
    for sharing in (True, False):
        engine = Engine(model, max_batch=ROWS, max_len=MAX_LEN, prefix_sharing=sharing)
        start = time.perf_counter()
        first = engine.submit(system + questions[0], max_new_tokens=8)
        engine.run()  # the system prompt is in the cache before the others arrive
        rest = [engine.submit(system + q, max_new_tokens=8) for q in questions[1:]]
        engine.run()
        results[sharing] = (engine.prefill_tokens, time.perf_counter() - start,
                            [r.tokens for r in [first, *rest]])  # fmt: skip
    (shared, shared_s, a), (alone, alone_s, b) = results[True], results[False]
    table.add({
        "what": "8 requests sharing a 128-token system prompt",
        "predicted": f"{8 * 140 - 7 * 128} prompt tokens computed",
        "ours": f"{shared} prompt tokens computed, {shared_s:.1f} s (pages shared)",
        "peer": f"{alone} prompt tokens computed, {alone_s:.1f} s (no sharing)",
        "ratio": f"{alone_s / shared_s:.2f}x",
        "note": f"same tokens: {a == b}",
    })  # fmt: skip


# Gemma 3's shape, scaled down (random weights): a period of 5 sliding layers and 1 global.
GEMMA_LIKE = dict(
    vocab_size=4096, d_model=256, n_layers=12, n_heads=4, n_kv_heads=1, head_dim=64, d_ff=768,
    max_seq_len=2048, position="rope", norm="rmsnorm", mlp="geglu", bias=False,
    sliding_window=128, layer_types=(("sliding",) * 5 + ("full",)) * 2, local_rope_theta=1e4,
)  # fmt: skip
WINDOW_ROWS, WINDOW_PROMPT, WINDOW_NEW = 4, 1024, 32


def window_rings(table: Table, ceilings: Ceilings) -> None:
    """Sliding layers' rings (layers/window_cache.py) vs full-length pages for every layer, side
    by side: KV bytes held and decode tokens/s, each beside zoo.math's bytes and roofline."""
    config = zoo.Config(**GEMMA_LIKE)
    model = zoo.Transformer(config, policy=zoo.Policy.inference(), key=jax.random.key(0))
    rng = np.random.default_rng(200)
    cases = [rng.integers(0, config.vocab_size, WINDOW_PROMPT).tolist() for _ in range(WINDOW_ROWS)]
    context = WINDOW_PROMPT + WINDOW_NEW // 2
    full_row = context * zmath.kv_cache_bytes_per_token(config)
    predicted = {True: zmath.kv_cache_bytes(config, context), False: full_row}
    results = {}
    for rings in (True, False):
        engine = Engine(model, max_batch=WINDOW_ROWS, max_len=WINDOW_PROMPT + WINDOW_NEW,
                        window_cache=rings)  # fmt: skip
        # Its larger prompt parts compiled, so the prompts go in whole-budget steps (a fresh
        # engine's first prompt goes in its smallest part until they are).
        finish_compiles()
        requests = [engine.submit(p, max_new_tokens=WINDOW_NEW) for p in cases]
        # Steps with every row decoding: the budget prefills the prompts oldest first, so the
        # first rows decode beside the later ones' prompts.
        step = decode_step_ms(engine, WINDOW_ROWS)
        step_bytes = zmath.weight_bytes(config) + WINDOW_ROWS * predicted[rings]
        results[rings] = (
            engine.peak_kv_bytes(), WINDOW_ROWS * 1e3 / step,
            WINDOW_ROWS * ceilings.bandwidth() / step_bytes, [r.tokens for r in requests],
        )  # fmt: skip
    (ring_kv, ring_tps, ring_pred, a), (full_kv, full_tps, full_pred, b) = (
        results[True],
        results[False],
    )
    shape = f"{WINDOW_ROWS} rows, {WINDOW_PROMPT}-token prompts, window {config.sliding_window}"
    table.add({
        "what": f"KV held, Gemma-3-shaped 12 layers (10 sliding), {shape}",
        "predicted": f"{WINDOW_ROWS * predicted[True] / 2**20:.1f} vs "
        f"{WINDOW_ROWS * predicted[False] / 2**20:.1f} MiB",
        "ours": f"{ring_kv / 2**20:.1f} MiB (rings)",
        "peer": f"{full_kv / 2**20:.1f} MiB (full-length pages)",
        "ratio": f"{full_kv / ring_kv:.2f}x",
        "note": "",
    })  # fmt: skip
    table.add({
        "what": f"decode, same model, {shape}",
        "predicted": f"{ring_pred:.0f} vs {full_pred:.0f} tok/s",
        "ours": f"{ring_tps:.0f} tok/s (rings)",
        "peer": f"{full_tps:.0f} tok/s (full-length pages)",
        "ratio": f"{ring_tps / full_tps:.2f}x",
        "note": f"same greedy tokens: {a == b}",
    })  # fmt: skip


def run(ceilings: Ceilings) -> Table:
    gguf = smollm2_gguf()
    model = zoo.load_pretrained(gguf)  # every default: the fastest decode storage
    packed = default_prompt_tokens(model, ROWS, CHUNK)
    table = Table(
        "engine",
        "Serving engine, every default (float32)",
        [f"Engine: {ROWS} rows, max_len {MAX_LEN}, pages of 16, a token budget per step of the "
         f"decode rows + {PROMPT_TOKENS} prompt tokens (SmolLM2's packed weights on this "
         f"backend: {packed}) in chunks of {CHUNK} (one program per step); HF transformers' "
         "generate in the reference venv on the same checkpoints."],
    )  # fmt: skip
    first_use(table, ceilings)
    latency(model, table, gguf, ceilings)
    max_len_independence(model, table, ceilings)
    throughput(model, table, ceilings)
    prefix_reuse(model, table)
    window_rings(table, ceilings)
    return table
