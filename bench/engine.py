"""The serving engine on the real SmolLM2-135M-Instruct weights (GGUF, float32), side by side in
one run:

- latency of one `infer.generate` call (8 new tokens) on a prompt length it has never seen,
  after one warm-up call on another length, beside HF transformers' `generate` on the same
  weights and lengths (bench/hf_engine.py in the reference venv);
- throughput of 24 mixed requests (prompts of 4-160 tokens, 4-48 new tokens) through one
  `infer.Engine` (continuous batching, 8 rows) beside static batches of 8 through `generate`
  (each batch waits for its longest request), with every request's greedy tokens checked
  against the request run alone;
- KV-cache bytes the engine's pages held at most, beside a contiguous `8 x max_len` cache;
- prefix reuse: 8 requests sharing a 128-token system prompt, prompt tokens computed with and
  without sharing;
- sliding layers' rings vs full-length pages on a Gemma-3-shaped model (random weights): KV
  bytes held and decode tokens/s.

    python -m bench engine
"""

import json
import os
import subprocess
import time
from pathlib import Path

import jax
import numpy as np

import infer
import zoo
from bench.harness import Ceilings, Table
from cli.flags import default_chat_model as smollm2_gguf
from infer.engine import Engine
from zoo import math as zmath

NEW_TOKENS = 8
WARMUP_LEN, UNSEEN = 37, (23, 61, 118)
ROWS, MAX_LEN = 8, 256
REF_PYTHON = Path(__file__).resolve().parents[1] / ".venv-ref" / "bin" / "python"


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


def hf_latency(gguf: Path) -> list[float] | None:
    python = os.environ.get("ZOO_REF_PYTHON") or str(REF_PYTHON)
    if not Path(python).exists():
        return None
    job = {"gguf": str(gguf), "warmup_len": WARMUP_LEN, "lengths": list(UNSEEN),
           "new_tokens": NEW_TOKENS}  # fmt: skip
    out = subprocess.run(
        [python, str(Path(__file__).with_name("hf_engine.py")), json.dumps(job)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    if out.returncode:
        raise RuntimeError(f"bench/hf_engine.py failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["latency_s"]


def predicted_s(config, ceilings: Ceilings, prompt_len: int, new_tokens: int, batch: int = 1):
    """zoo.math's roofline: the prompt's forward FLOPs at the matmul rate, then each decode
    step's bytes (weights once, each row's cache) at the bandwidth, both measured this run."""
    flops = batch * prompt_len * zmath.forward_flops_per_token(config, prompt_len)
    prefill = flops / ceilings.matmul_flops("float32")
    step = zmath.decode_step_bytes(config, batch, prompt_len + new_tokens // 2)
    return prefill + (new_tokens - 1) * step / ceilings.bandwidth()


def latency(model, table: Table, hf: list[float] | None, ceilings: Ceilings) -> None:
    def call(n):
        start = time.perf_counter()
        infer.generate(model, [prompt(n, n)], max_new_tokens=NEW_TOKENS, sampler=infer.Greedy(),
                       key=jax.random.key(0))  # fmt: skip
        return time.perf_counter() - start

    call(WARMUP_LEN)
    for i, n in enumerate(UNSEEN):
        ours = call(n)
        predicted = predicted_s(model.config, ceilings, n, NEW_TOKENS)
        table.add({
            "what": f"one generate call, unseen prompt of {n} tokens, {NEW_TOKENS} new",
            "predicted": f"{predicted * 1e3:.0f} ms",
            "ours": f"{ours * 1e3:.0f} ms",
            "peer": "-" if hf is None else f"{hf[i] * 1e3:.0f} ms (HF generate)",
            "ratio": "-" if hf is None else f"{hf[i] / ours:.2f}x",
            "note": "",
        })  # fmt: skip


def mixed_requests() -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(7)
    return [(prompt(int(rng.integers(4, 161)), s), int(rng.integers(4, 49))) for s in range(24)]


def throughput(model, table: Table, ceilings: Ceilings) -> None:
    cases = mixed_requests()
    context = sum(len(p) + n // 2 for p, n in cases) // len(cases)
    # The decode roofline of a full batch (weights once, every row's cache), prefill aside.
    step_s = zmath.decode_step_bytes(model.config, ROWS, context) / ceilings.bandwidth()
    engine = Engine(model, max_batch=ROWS, max_len=MAX_LEN, prefix_sharing=False)
    start = time.perf_counter()
    requests = [engine.submit(p, max_new_tokens=n) for p, n in cases]
    engine.run()
    engine_s = time.perf_counter() - start
    generated = sum(len(r.tokens) for r in requests)

    static_tokens, start = [], time.perf_counter()
    for first in range(0, len(cases), ROWS):
        batch = cases[first : first + ROWS]
        out = infer.generate(
            model, [p for p, _ in batch], max_new_tokens=max(n for _, n in batch),
            sampler=infer.Greedy(), key=jax.random.key(0), max_len=MAX_LEN,
        )  # fmt: skip
        static_tokens += [tokens[:n] for tokens, (_, n) in zip(out, batch, strict=True)]
    static_s = time.perf_counter() - start

    alone = Engine(model, max_batch=1, max_len=MAX_LEN, prefix_sharing=False)
    same = 0
    for (p, n), request in zip(cases, requests, strict=True):
        single = alone.submit(p, max_new_tokens=n)
        alone.run()
        same += single.tokens == request.tokens
    table.add({
        "what": f"{len(cases)} mixed requests (prompts 4-160, 4-48 new), {ROWS} rows",
        "predicted": f"{ROWS / step_s:.1f} tok/s (a full batch of {ROWS} rows decoding)",
        "ours": f"{generated / engine_s:.1f} tok/s (engine, continuous batching)",
        "peer": f"{generated / static_s:.1f} tok/s (static batches of {ROWS}, generate)",
        "ratio": f"{static_s / engine_s:.2f}x",
        "note": f"same greedy tokens as alone: {same}/{len(cases)}; "
        f"static batches agree: {static_tokens == [r.tokens for r in requests]}",
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
    model = zoo.Transformer(config, key=jax.random.key(0)).unstacked()
    rng = np.random.default_rng(200)
    cases = [rng.integers(0, config.vocab_size, WINDOW_PROMPT).tolist() for _ in range(WINDOW_ROWS)]
    context = WINDOW_PROMPT + WINDOW_NEW // 2
    full_row = context * zmath.kv_cache_bytes_per_token(config)
    predicted = {True: zmath.kv_cache_bytes(config, context), False: full_row}
    results = {}
    for rings in (True, False):
        engine = Engine(model, max_batch=WINDOW_ROWS, max_len=WINDOW_PROMPT + WINDOW_NEW,
                        prefill_rows=WINDOW_ROWS, window_cache=rings)  # fmt: skip
        requests = [engine.submit(p, max_new_tokens=WINDOW_NEW) for p in cases]
        engine.run()
        decode_s = max(r.decode_s for r in requests)
        step_bytes = zmath.weight_bytes(config) + WINDOW_ROWS * predicted[rings]
        results[rings] = (
            engine.peak_kv_bytes(), WINDOW_ROWS * (WINDOW_NEW - 1) / decode_s,
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
    # Unrolled layers: the one-time conversion a CPU caller makes for decode (bench/decode.py).
    model = zoo.load_pretrained(gguf).unstacked()
    table = Table(
        "engine",
        "Serving engine on SmolLM2-135M-Instruct (float32)",
        [f"Engine: {ROWS} rows, max_len {MAX_LEN}, pages of 16, prefill chunks of 64; "
         "HF transformers' generate in the reference venv on the same GGUF weights."],
    )  # fmt: skip
    latency(model, table, hf_latency(gguf), ceilings)
    throughput(model, table, ceilings)
    prefix_reuse(model, table)
    window_rings(table, ceilings)
    return table
