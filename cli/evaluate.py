"""`eqx-zoo evaluate`: score any model on tasks (training.evaluate): perplexity and bits per byte
of a text file, multiple-choice log-likelihood, generations by exact match or a checker; a table
and, with --out, a JSON file.

    eqx-zoo evaluate --model SmolLM2.gguf --task perplexity=corpus.txt
    eqx-zoo evaluate --model runs/finetune --task generate=held_out.jsonl \\
        --checker examples.brevity:brief --out results.json      # a LoRA run, adapters folded in
    eqx-zoo evaluate --model base.gguf --adapter adapter/ --task choice=arc.jsonl
    eqx-zoo evaluate --model hf-dir/ --lm-eval hellaswag               # EleutherAI's harness

A task is KIND=FILE: `perplexity` (any text file or dataset --data takes), `choice` (jsonl rows
{"prompt", "choices", "answer"}), `generate` (jsonl rows {"prompt"} or {"messages"}, with
"answer" or what --checker reads); `python -m training.evaluate --help` describes each.
"""

import argparse

from cli import commands, flags
from training import evaluate


def parser(prog: str = "eqx-zoo evaluate") -> argparse.ArgumentParser:
    p = commands.command_parser(prog, __doc__)
    flags.add_model(p)
    flags.add_chat_template(p)
    evaluate.add_task_arguments(p)
    return p


def main(argv: list[str] | None = None, prog: str = "eqx-zoo evaluate") -> dict[str, dict]:
    p = parser(prog)
    args = p.parse_args(argv)
    evaluate.check_tasks(p, args)
    checker = evaluate.load_checker(args.checker) if args.checker else None  # before the model
    model, tokenizer = evaluate.load_model(
        args.model, adapter=args.adapter, chat_template=args.chat_template,
        attention=args.attention, seed=args.seed,
    )  # fmt: skip
    return evaluate.run(args, model, tokenizer, checker=checker)
