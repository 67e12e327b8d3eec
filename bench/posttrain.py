"""GRPO's two halves, timed apart: rollout tokens/s (the serving engine sampling G completions
of each prompt on the current weights) and update tokens/s (the policy's forward and backward
plus the reference's forward over prompt + completion), beside zoo.math's predictions.

    python -m bench posttrain

SmolLM2-135M shapes (random weights: speed does not depend on their values), 4 layers of it on
a CPU and all 30 on a GPU, LoRA rank 8 on every projection, float32. A reward of the completion's
length keeps the advantages non-zero. Predicted rollout: the prompts' prefill (forward FLOPs)
plus `max_new_tokens` decode steps of all rows (zoo.math.decode_step_roofline at the mean
context); predicted update: training FLOPs of the rows plus one forward for the reference, on the
measured matmul ceiling. The first step (compilation) is left out; the median of the rest.
"""

import jax
import numpy as np

import zoo
from bench.harness import Ceilings, Table, on_gpu
from training import grpo
from zoo import math as zmath

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Tokens:
    """A stand-in tokenizer over ids: prompts are given as ids, completions decode to their
    length in characters (the reward reads that)."""

    chat_template = None
    end_of_turn_ids = ()

    def __init__(self, vocab: int):
        self.vocab_size = vocab
        self.encoding = self

    eot_token = 0

    def encode_ordinary(self, text: str) -> list[int]:
        return [1 + (ord(c) % 200) for c in text]

    def decode(self, ids) -> str:
        return "x" * len(ids)


def run(ceilings: Ceilings) -> Table:
    gpu = on_gpu()
    config = zoo.preset("smollm2-135m", **({} if gpu else {"n_layers": 4}))
    policy = zoo.Policy()
    prompts, group, prompt_len, new = (16, 8, 128, 128) if gpu else (4, 4, 32, 16)
    steps = 5 if gpu else 4
    model = zoo.Transformer(config, policy=policy, key=jax.random.key(0))
    model = zoo.add_lora(model, TARGETS, 8, 16, key=jax.random.key(1))
    rng = np.random.default_rng(0)
    text = lambda: "".join(chr(97 + int(i)) for i in rng.integers(0, 26, prompt_len - 1))  # noqa: E731
    settings = grpo.GRPOSettings(
        group_size=group, prompts_per_step=prompts, steps=steps, max_new_tokens=new,
        max_prompt_len=prompt_len, log_every=steps,
    )  # fmt: skip
    result = grpo.train(
        model, _Tokens(config.vocab_size), lambda _, n: [{"prompt": text()} for _ in range(n)],
        [lambda completion, row: float(len(completion))], settings, log=lambda _: None,
    )  # fmt: skip
    rows = prompts * group
    roll_s = float(np.median(result.rollout_s[1:]))
    update_s = float(np.median(result.update_s[1:]))
    roll_tokens = float(np.median(result.rollout_tokens[1:]))
    update_tokens = float(np.median(result.update_tokens[1:]))
    hw = ceilings.hardware(policy.compute_dtype)
    prefill = zmath.roofline(
        zmath.forward_flops_per_token(config, prompt_len) * rows * prompt_len,
        zmath.weight_bytes(config, policy), hw, policy.compute_dtype,
    )  # fmt: skip
    decode = zmath.decode_step_roofline(config, rows, prompt_len + new // 2, hw, policy)
    predicted_roll = prefill.time_s + new * decode.time_s
    seq = prompt_len + new
    flops = (zmath.training_flops_per_token(config, seq)
             + zmath.forward_flops_per_token(config, seq)) * rows * seq  # fmt: skip
    update = zmath.roofline(flops, zmath.weight_bytes(config, policy), hw, policy.compute_dtype)
    table = Table(
        "posttrain",
        "GRPO: rollout vs update (LoRA, engine rollouts on the current weights)",
        [
            f"SmolLM2-135M shapes, {config.n_layers} layers, LoRA rank 8; {prompts} prompts x "
            f"G={group} completions, prompts {prompt_len} tokens, {new} new tokens; float32; "
            f"median of {steps - 1} steps after the first. predicted = zoo.math rooflines on the "
            f"measured ceilings ({hw.peak_flops(policy.compute_dtype) / 1e9:.0f} GFLOP/s, "
            f"{hw.bandwidth / 1e9:.0f} GB/s)."
        ],
    )
    for phase, predicted, measured, tokens in (
        ("rollout (generated tokens)", predicted_roll, roll_s, roll_tokens),
        ("update (prompt + completion tokens)", update.time_s, update_s, update_tokens),
    ):
        table.add(
            {
                "phase": phase,
                "predicted s": predicted,
                "measured s": measured,
                "tokens": tokens,
                "tokens/s": tokens / measured,
                "predicted / measured": predicted / measured,
                "share of step": measured / (roll_s + update_s),
            }
        )
    return table
