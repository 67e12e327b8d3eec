"""The OpenAI-compatible server (`python -m infer.serve`) against the engine it wraps, on the
real SmolLM2-135M-Instruct (GGUF, every default), side by side in one run:

- 32 concurrent streaming chat clients (OpenAI's AsyncOpenAI, in this process) against the
  server in a subprocess (8 rows), then the same 32 requests (greedy, the same prompts and
  budgets) submitted at once to an `infer.Engine` of the same configuration in this process:
  completion tokens/s of each (goal: HTTP >= 0.9x the engine), time to first token p50/p99 of
  each, and the roofline of the whole batch (zoo.math: prompt FLOPs at the matmul rate plus the
  fewest decode steps of 8 rows at the bandwidth, both measured this run);
- structured output: seconds per decode step of 8 rows all under a JSON schema (llguidance
  masks computed on the host, applied on the device, the host in step with the device) vs the
  same 8 rows unconstrained, equal step counts (goal: <= 30% overhead).

    python -m bench serve
"""

import asyncio
import os
import statistics
import subprocess
import sys
import time

import httpx2 as httpx
import numpy as np
import openai

import zoo
from bench.engine import predicted_s
from bench.harness import Ceilings, Table
from cli.flags import default_chat_model as smollm2_gguf
from infer.engine import Engine
from infer.serve.grammar import Grammars
from zoo import math as zmath

CLIENTS, ROWS, MAX_LEN, NEW_TOKENS, PORT = 32, 8, 512, 32, 8731
STEPS_CONSTRAINED, REPEATS, PASSES = 32, 5, 3
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "items": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["name", "items"],
}
TOPICS = ["the sea", "a cat", "bread", "the moon", "rain", "a train", "chess", "music"]


def messages(i: int) -> list[dict]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Tell me {i % 5 + 1} facts about {topic}." * (1 + i % 3)}]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


async def _clients(url: str) -> tuple[float, list[float], int]:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)

    async def one(i: int) -> tuple[float, int]:
        start = time.perf_counter()
        first, tokens = None, 0
        stream = await client.chat.completions.create(
            model="base", messages=messages(i), max_tokens=NEW_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first, tokens

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(CLIENTS)))
    wall = time.perf_counter() - start
    await client.close()
    return wall, [r[0] for r in results if r[0] is not None], sum(r[1] for r in results)


class HTTPServer:
    """`python -m infer.serve` in a subprocess (it compiles before its port opens)."""

    def __init__(self, gguf):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "infer.serve", str(gguf), "--port", str(PORT),
             "--max-batch", str(ROWS), "--max-len", str(MAX_LEN)],
            env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health").status_code == 200:
                    return
            except httpx.ConnectError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start: {self.process.stderr.read()}")
            time.sleep(0.5)

    def run(self) -> tuple[float, list[float], int]:
        return asyncio.run(_clients(f"http://127.0.0.1:{PORT}/v1"))

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)


def through_engine(engine, prompts, end_ids) -> tuple[float, list[float], int]:
    start = time.perf_counter()
    requests = [engine.submit(p, max_new_tokens=NEW_TOKENS, stop_tokens=end_ids)
                for p in prompts]  # fmt: skip
    engine.run()
    wall = time.perf_counter() - start
    return wall, [r.ttft_s for r in requests], sum(len(r.tokens) for r in requests)


def alternating(gguf, model, prompts, end_ids) -> dict[str, list]:
    """PASSES of each, alternating engine and HTTP (the machine's load drifts: side by side),
    after one warm-up pass of each; each pass's (wall, TTFTs, tokens)."""
    engine, server = Engine(model, max_batch=ROWS, max_len=MAX_LEN), HTTPServer(gguf)
    runs = {"engine directly": [], f"HTTP, {CLIENTS} streaming clients": []}
    try:
        for i in range(PASSES + 1):
            done = [through_engine(engine, prompts, end_ids), server.run()]
            if i:  # the first pass warms both
                for key, result in zip(runs, done, strict=True):
                    runs[key].append(result)
    finally:
        server.stop()
    return runs


def seconds_per_step(model, prompts, grammars: Grammars) -> tuple[float, float]:
    """Wall seconds per engine step of 8 rows decoding `STEPS_CONSTRAINED` tokens each (no stop
    token, so every run takes the same steps), unconstrained and under the JSON schema: REPEATS
    of each, alternating (the machine's load drifts), medians."""
    engine = Engine(model, max_batch=ROWS, max_len=MAX_LEN)
    grammar = grammars.grammar(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    )
    times = {False: [], True: []}
    for _ in range(REPEATS):
        for constrained in times:
            steps, start = engine.steps, time.perf_counter()
            for p in prompts[:ROWS]:
                constraint = grammars.constraint(grammar) if constrained else None
                engine.submit(
                    p, max_new_tokens=STEPS_CONSTRAINED,
                    allowed=constraint and constraint.allowed,
                    on_tokens=constraint and constraint.consume,
                )  # fmt: skip
            engine.run()
            times[constrained].append((time.perf_counter() - start) / (engine.steps - steps))
    return statistics.median(times[False]), statistics.median(times[True])


def run(ceilings: Ceilings) -> Table:
    gguf = smollm2_gguf()
    tokenizer, model = zoo.load_tokenizer(gguf), zoo.load_pretrained(gguf)
    end_ids = tokenizer.end_of_turn_ids
    prompts = [tokenizer.apply_chat_template(messages(i), add_generation_prompt=True)
               for i in range(CLIENTS)]  # fmt: skip
    table = Table(
        "serve",
        f"Serving SmolLM2-135M-Instruct (GGUF Q4_1): {CLIENTS} streaming clients over HTTP vs "
        f"the engine directly ({ROWS} rows, greedy, <= {NEW_TOKENS} new tokens)",
        [
            f"Prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens. HTTP: `python "
            "-m infer.serve` in a subprocess, AsyncOpenAI clients in the bench process. Engine: "
            f"the same requests submitted at once. {PASSES} passes of each, alternating, after "
            "a warm-up pass of each: medians (TTFT percentiles over every request of every "
            "pass, from sending (HTTP) or submitting (engine) to the first token)."
        ],
    )
    runs = alternating(gguf, model, prompts, end_ids)
    tokens = runs["engine directly"][0][2]
    steps = -(-(tokens - CLIENTS) // ROWS)
    predicted = predicted_s(model.config, ceilings, list(map(len, prompts)), steps, ROWS)
    rate = {key: statistics.median(t / wall for wall, _, t in passes)
            for key, passes in runs.items()}  # fmt: skip
    for what, passes in runs.items():
        ttft = [t for _, ttfts, _ in passes for t in ttfts]
        table.add({
            "what": what,
            "predicted s": predicted,
            "measured s": statistics.median(wall for wall, _, _ in passes),
            "tokens": passes[0][2],
            "tokens/s": rate[what],
            "vs engine": rate[what] / rate["engine directly"],
            "TTFT p50 ms": 1e3 * percentile(ttft, 50),
            "TTFT p99 ms": 1e3 * percentile(ttft, 99),
        })  # fmt: skip
    grammars = Grammars(tokenizer, vocab_size=model.config.vocab_size, end_ids=end_ids)
    free, constrained = seconds_per_step(model, prompts, grammars)
    context = statistics.mean(map(len, prompts[:ROWS])) + STEPS_CONSTRAINED // 2
    step = zmath.decode_step_bytes(model.config, ROWS, int(context)) / ceilings.bandwidth()
    for what, seconds in (("decode, unconstrained", free), ("decode, JSON schema", constrained)):
        table.add({
            "what": f"{what} ({ROWS} rows, {STEPS_CONSTRAINED} tokens each)",
            "predicted s": step,
            "measured s": seconds,
            "tokens": ROWS * STEPS_CONSTRAINED,
            "tokens/s": ROWS / seconds,
            "vs engine": free / seconds,
            "TTFT p50 ms": "-",
            "TTFT p99 ms": f"overhead {100 * (seconds / free - 1):.0f}% (goal <= 30%)",
        })  # fmt: skip
    return table
