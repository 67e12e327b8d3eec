"""Prefill and decode of infer.generate beside the memory-bandwidth roofline (zoo.math: weights +
KV cache read once per step, over the bandwidth measured in this run) and, on CPU, HF
transformers' `generate` on the same shapes in the same run (bench/hf_decode.py under the
reference venv).

    python -m bench decode

CPU: GPT-2 124M (batch 1, 8, 32) and SmolLM2-135M (batch 1, 8) shapes, float32 random weights;
HF runs at batch <= 8 only (nan at 32), which keeps the CPU run near two minutes.
GPU: Llama 3.2 1B shapes in bfloat16 at batch 1 and 32 (no HF peer: the GPU machine has no torch).

Timing: generate with 1 new token is the prefill (plus one sample); generate with N new tokens
adds N - 1 decode steps, so one step = (t_N - t_1) / (N - 1). HF is timed the same way.

`matmuls ms` is a second, measured ceiling: one program doing only the step's weight matmuls
(every layer's projections and the LM head, `[batch, in] x [in, out]`, nothing else) at this
batch. On this CPU XLA's matmul streams the weights ~4x slower with 8 or 32 rows than with 1
(bench/RESULTS.md), so at batch >= 8 that, not the step's other work (attention, cache writes,
norms, sampling, the loop: ~4% of the step in a profile), is what separates decode from the
bandwidth roofline; `step / matmuls` near 1 says the rest costs little.
"""

import json
import math
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp

import infer
import zoo
from bench.harness import Ceilings, Table, median_seconds, on_gpu, roofline_cells
from layers import Linear

HF_PYTHON = "/work/main/.venv-ref/bin/python"


def hf_config(config: zoo.Config) -> tuple[str, dict]:
    """The HF config with the same shapes as `config`."""
    if config.position == "learned":
        return "gpt2", {
            "vocab_size": config.vocab_size,
            "n_positions": config.max_seq_len,
            "n_embd": config.d_model,
            "n_layer": config.n_layers,
            "n_head": config.n_heads,
        }
    return "llama", {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_embeddings,
    }


def hf_seconds(config: zoo.Config, batch: int, prompt_len: int, new_tokens: int, repeats: int):
    """(prefill seconds, generate seconds) of HF's generate, or None without the reference venv."""
    if not Path(HF_PYTHON).exists():
        return None
    arch, hf = hf_config(config)
    case = {
        "arch": arch,
        "config": hf,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
    }
    out = subprocess.run(
        [HF_PYTHON, str(Path(__file__).with_name("hf_decode.py")), json.dumps([case])],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ).stdout
    result = next(json.loads(line) for line in out.splitlines() if line.startswith("{"))
    return result["prefill_s"], result["generate_s"]


def matmul_seconds(model: zoo.Transformer, batch: int, repeats: int) -> float:
    """Median time of the decode step's weight matmuls alone: every Linear of every layer and
    the LM head on a `[batch, in]` input, in one jitted program."""
    linears = [
        leaf
        for block in (model.layer(i) for i in range(model.config.n_layers))
        for leaf in jax.tree.leaves(block, is_leaf=lambda x: isinstance(x, Linear))
        if isinstance(leaf, Linear)
    ]
    weights = [lin.weight.reshape(math.prod(lin.in_shape), -1) for lin in linears]
    dtype = model.policy.compute
    # Random activations passed in: constant ones built inside the program could let XLA
    # simplify a product with a broadcast constant into a row sum.
    key = jax.random.key(0)
    xs = [jax.random.normal(key, (batch, w.shape[0]), dtype) for w in weights]
    x = jax.random.normal(key, (batch, model.config.d_model), dtype)

    @jax.jit
    def matmuls(xs, weights, x, head):
        outs = [a @ w.astype(dtype) for a, w in zip(xs, weights, strict=True)]
        if model.lm_head is None:  # tied: the embedding matrix, [vocab, embed]
            return outs, jnp.einsum("bd,vd->bv", x, head.astype(dtype))
        return outs, x @ head.astype(dtype)

    head = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return median_seconds(lambda: matmuls(xs, weights, x, head), repeats=max(repeats, 3))


def cases() -> tuple[list[tuple[str, zoo.Config, zoo.Policy, int]], int, int, int]:
    """(model name, config, policy, batch) cases, prompt length, new tokens, repeats for this
    device."""
    if on_gpu():
        bf16 = zoo.Policy(compute_dtype="bfloat16", param_dtype="bfloat16")
        return [("llama3-1b", zoo.preset("llama3-1b"), bf16, b) for b in (1, 32)], 512, 129, 5
    batches = {"gpt2-124m": (1, 8, 32), "smollm2-135m": (1, 8)}
    todo = [(n, zoo.preset(n), zoo.Policy.inference(), b) for n, bs in batches.items() for b in bs]
    return todo, 32, 9, 1


def run(ceilings: Ceilings) -> Table:
    todo, prompt_len, new_tokens, repeats = cases()
    bandwidth = ceilings.bandwidth()
    table = Table(
        "decode",
        "Prefill and decode (infer.generate)",
        [
            f"Prompt {prompt_len} tokens, {new_tokens} new; median of {repeats} after a warm-up. "
            f"Ceiling: bandwidth {bandwidth / 1e9:.3g} GB/s measured in this run "
            "(copy or matvec, the larger); predicted = "
            "zoo.math.decode_step_roofline (weights + KV cache bytes, or FLOPs, whichever binds); "
            "matmuls ms = the step's weight matmuls alone at this batch, measured."
        ],
    )
    steps = new_tokens - 1
    for name, config, policy, batch in todo:
        # The decode policy load_pretrained gives (per-layer weights).
        model = zoo.Transformer(
            config, policy=policy.replace(storage="unrolled"), key=jax.random.key(0)
        )
        prompts = jax.random.randint(jax.random.key(1), (batch, prompt_len), 1, 1000).tolist()

        def generate(n, model=model, prompts=prompts):
            return infer.generate(
                model, prompts, max_new_tokens=n, sampler=infer.Greedy(), key=jax.random.key(0)
            )

        t1 = median_seconds(lambda: generate(1), repeats=repeats)
        tn = median_seconds(lambda: generate(new_tokens), repeats=repeats)
        step_s = (tn - t1) / steps
        context = prompt_len + steps // 2
        hardware = ceilings.hardware(policy.compute_dtype)
        predicted = zoo.math.decode_step_roofline(config, batch, context, hardware, policy)
        row = {
            "model": name,
            "batch": batch,
            "prefill tok/s": batch * prompt_len / t1,
            "decode tok/s": batch / step_s,
        }
        if not on_gpu():
            # HF at batch 32 alone would double the CPU run (its prefill of 1024 tokens): skipped.
            hf = hf_seconds(config, batch, prompt_len, new_tokens, repeats) if batch <= 8 else None
            hf_tps = batch * steps / (hf[1] - hf[0]) if hf else float("nan")
            row |= {"HF decode tok/s": hf_tps, "ours / HF": row["decode tok/s"] / hf_tps}
        step_bytes = zoo.math.decode_step_bytes(config, batch, context, policy)
        row |= roofline_cells(predicted.time_s, step_s, step_bytes, bandwidth, "GB/s")
        matmuls_s = matmul_seconds(model, batch, repeats)
        row |= {"matmuls ms": 1e3 * matmuls_s, "step / matmuls": step_s / matmuls_s}
        table.add(row)
        del model
    return table
