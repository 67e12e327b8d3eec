"""Decode and prefill tokens/s of infer.generate on GPT-2 124M and SmolLM2-135M shapes (random
float32 weights) at batch 1 and 8, beside the memory-bandwidth limit (zoo.math.decode_step_bytes
over the bandwidth measured now) and HF transformers' `generate` in the same run.

    python -m bench.decode [--new-tokens 17] [--prompt-len 64] [--repeats 2]

Timing: generate with 1 new token is the prefill (plus one sample); generate with N new tokens
adds N - 1 decode steps, so decode tokens/s = batch x (N - 1) / (t_N - t_1). HF is timed the same
way. Each timing is a median after a warm-up.
"""

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import infer
import zoo

HF_PYTHON = "/work/main/.venv-ref/bin/python"


def hf_config(name: str) -> tuple[str, dict]:
    """The HF config with the same shapes as our preset."""
    c = zoo.preset(name)
    if c.position == "learned":
        return "gpt2", {
            "vocab_size": c.vocab_size,
            "n_positions": c.max_seq_len,
            "n_embd": c.d_model,
            "n_layer": c.n_layers,
            "n_head": c.n_heads,
        }
    return "llama", {
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "max_position_embeddings": c.max_seq_len,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
    }


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matvec_bandwidth(rows: int = 4096, cols: int = 8192) -> float:
    """Bytes/s of a float32 matrix-vector product (the decode ceiling: weights streamed once)."""
    w = jnp.ones((rows, cols), jnp.float32)
    x = jnp.ones((1, rows), jnp.float32)
    f = jax.jit(jnp.matmul)
    return w.nbytes / median_seconds(lambda: jax.block_until_ready(f(x, w)), 10)


def ours(name: str, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> tuple:
    model = zoo.Transformer(zoo.preset(name), key=jax.random.key(0)).unstack_layers()
    prompts = jax.random.randint(jax.random.key(1), (batch, prompt_len), 1, 1000).tolist()

    def run(n):
        return lambda: infer.generate(
            model, prompts, max_new_tokens=n, sampler=infer.Greedy(), key=jax.random.key(0)
        )

    return median_seconds(run(1), repeats), median_seconds(run(new_tokens), repeats)


def hf_seconds(name: str, batch: int, args: argparse.Namespace) -> dict:
    """HF's generate timings for one case, from bench/hf_decode.py under the reference venv."""
    arch, config = hf_config(name)
    case = {
        "arch": arch,
        "config": config,
        "batch": batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
    }
    out = subprocess.run(
        [HF_PYTHON, str(Path(__file__).with_name("hf_decode.py")), json.dumps([case])],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    return next(json.loads(line) for line in out.splitlines() if line.startswith("{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cases = [(name, batch) for name in ["gpt2-124m", "smollm2-135m"] for batch in [1, 8]]

    print(
        "| model | batch | prefill tok/s ours / HF | decode tok/s ours | HF | ours / HF "
        "| bandwidth GB/s matvec / copy | limit tok/s matvec / copy | ours / matvec limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, batch in cases:
        # HF, the ceilings, then ours, case by case: the machine is shared and its load drifts.
        ref = hf_seconds(name, batch, args)
        copy_bw, matvec_bw = zoo.math.measure_copy_bandwidth(), matvec_bandwidth()
        t1, tn = ours(name, batch, args.prompt_len, args.new_tokens, args.repeats)
        steps = args.new_tokens - 1
        decode = batch * steps / (tn - t1)
        hf_decode = batch * steps / (ref["generate_s"] - ref["prefill_s"])
        prefill = batch * args.prompt_len / t1
        hf_prefill = batch * args.prompt_len / ref["prefill_s"]
        config = zoo.preset(name)
        step_bytes = zoo.math.decode_step_bytes(config, batch, args.prompt_len + steps // 2)
        limit_mv, limit_copy = batch * matvec_bw / step_bytes, batch * copy_bw / step_bytes
        print(
            f"| {name} | {batch} | {prefill:.0f} / {hf_prefill:.0f} | {decode:.1f} | "
            f"{hf_decode:.1f} | {decode / hf_decode:.2f}x | {matvec_bw / 1e9:.1f} / "
            f"{copy_bw / 1e9:.1f} | {limit_mv:.1f} / {limit_copy:.1f} | {decode / limit_mv:.0%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
