"""What `logprobs` costs the serving engine per step: SmolLM2-135M shapes (random weights, float32:
the cost does not depend on the values), batch 8, decode steps, side by side in one run: no row
asks, one row asks for 5 alternatives, every row asks for 20 (the most).

    python -m bench logprobs

Predicted: a decode step streams the weights and the KV cache it reads once
(`zoo.math.decode_step_bytes`); log-probabilities add passes over the step's logits (a
log-softmax reads them and writes them, the top-k and the chosen token's gather read them
again: about 4 x rows x vocab x 4 bytes), all over the ceiling bandwidth measured in this run. A
step where no row asks should cost nothing more (one predicate). Each configuration times
whole batches (8 prompts of 16 tokens, 48 new tokens each; prefill included, ms per step =
run time / steps), the configurations interleaved, median of the repeats. Below them, the
step's log-probability computation alone (`infer.engine._logprobs` on `[8, vocab]` logits),
asked and not: a step's time on a shared machine varies by more than it.
"""

import statistics
import time

import jax
import jax.numpy as jnp

import zoo
from bench.harness import Ceilings, Table, median_seconds
from infer.engine import MAX_LOGPROBS, Engine, _logprobs
from zoo import math as zmath

BATCH, PROMPT, NEW_TOKENS, MAX_LEN, REPEATS = 8, 16, 48, 256, 5
ASKED = {"none": [None] * BATCH, "one row, 5": [5] + [None] * (BATCH - 1),
         f"every row, {MAX_LOGPROBS}": [MAX_LOGPROBS] * BATCH}  # fmt: skip


def _ms_per_step(engine: Engine, asked: list[int | None]) -> float:
    steps = engine.steps
    start = time.perf_counter()
    for i, n in enumerate(asked):
        engine.submit(list(range(i, i + PROMPT)), max_new_tokens=NEW_TOKENS, logprobs=n)
    engine.run()
    return 1e3 * (time.perf_counter() - start) / (engine.steps - steps)


def run(ceilings: Ceilings) -> Table:
    config = zoo.preset("smollm2-135m")
    policy = zoo.Policy.inference()
    model = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
    engine = Engine(
        model, max_batch=BATCH, chunk=PROMPT, token_budget=BATCH * (1 + PROMPT), max_len=MAX_LEN
    )
    bandwidth = ceilings.bandwidth()
    step_bytes = zmath.decode_step_bytes(config, BATCH, PROMPT + NEW_TOKENS // 2, policy)
    extra_bytes = 4 * BATCH * config.vocab_size * 4
    table = Table(
        "logprobs",
        "The engine's step with and without logprobs (SmolLM2-135M shapes, batch 8)",
        [
            f"Ceiling: bandwidth {bandwidth / 1e9:.3g} GB/s measured in this run; predicted = "
            "(decode step bytes + the logprob passes over the logits, when asked) / ceiling. "
            f"{BATCH} prompts of {PROMPT} tokens, {NEW_TOKENS} new tokens each, configurations "
            f"interleaved, median of {REPEATS}."
        ],
    )
    for asked in ASKED.values():  # compiles nothing new; warms the host side
        _ms_per_step(engine, asked)
    times = {name: [] for name in ASKED}
    for _ in range(REPEATS):
        for name, asked in ASKED.items():
            times[name].append(_ms_per_step(engine, asked))
    baseline = statistics.median(times["none"])
    for name, asked in ASKED.items():
        predicted = (step_bytes + (extra_bytes if any(n is not None for n in asked) else 0)) / (
            bandwidth
        )
        measured = statistics.median(times[name])
        table.add({
            "rows asking": name,
            "predicted ms/step": 1e3 * predicted,
            "measured ms/step": measured,
            "vs none": measured / baseline,
        })  # fmt: skip
    logits = jax.random.normal(jax.random.key(1), (BATCH, config.vocab_size)) * 3.0
    tokens = jnp.zeros(BATCH, jnp.int32)
    alone = jax.jit(_logprobs)
    cases = {"computation alone, none": (False, 0), "computation alone, asked": (True, extra_bytes)}
    seconds = {}
    for name, (wanted, work) in cases.items():
        flags = jnp.full(BATCH, wanted)
        seconds[name] = median_seconds(lambda f=flags: alone(logits, tokens, f), repeats=30)
        table.add({
            "rows asking": name,
            "predicted ms/step": 1e3 * work / bandwidth,
            "measured ms/step": 1e3 * seconds[name],
            "vs none": seconds[name] / seconds["computation alone, none"],
        })  # fmt: skip
    return table
