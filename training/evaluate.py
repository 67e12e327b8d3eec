"""Evaluate a model: perplexity and bits per byte, multiple-choice log-likelihood, generation
with exact match or a checker; results as JSON and a printed table.

    python -m training.evaluate MODEL --task perplexity=corpus.txt
    python -m training.evaluate MODEL --task choice=arc.jsonl --task generate=gsm.jsonl \\
        --checker my_checks.py:is_correct --out results.json
    python -m training.evaluate BASE --adapter runs/tuned/adapter --task generate=held_out.jsonl
    python -m training.evaluate MODEL --lm-eval hellaswag        # EleutherAI's harness (extra)

MODEL is an HF directory, a .gguf file or a train.py run directory (its latest checkpoint and
tokenizer); `--adapter` puts a PEFT adapter on it (folded in). A task is `KIND=FILE`:

    perplexity  any text file or dataset `--data` takes (text/json/jsonl/parquet/csv, a
                `--text-column`): rolling windows of `--window` tokens; reports the NLL per
                token, perplexity = exp(mean token NLL), bits per byte and the counts
    choice      jsonl rows {"prompt": str, "choices": [str, ...], "answer": int}: each choice
                scored by log p(choice | prompt) (HellaSwag / ARC style, no chat template);
                `accuracy` picks the highest sum, `accuracy_norm` the highest per UTF-8 byte
    generate    jsonl rows {"prompt": str} or {"messages": [...]}, with "answer" for exact match
                or any fields a `--checker FILE.py:function` (or `module:function`) reads: it is
                called as checker(completion, row) and returns a bool or a number in [0, 1]. The
                prompts go through the serving engine in batches, rendered with the chat
                template when the tokenizer has one (`--no-chat` for raw text), greedy unless
                `--temperature`; `accuracy` is the mean score

`evaluate(model, tokenizer, tasks)` is the library form; `main(argv)` the command line. Bad
input is a ValueError naming the file, row and field (a choice row without choices, an answer
index out of range, a generate row without an answer and no checker, a checker that raises).
"""

import argparse
import importlib
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

import infer
from training.args import NON_NEGATIVE, POSITIVE_INT, add_arguments
from training.scoring import perplexity, score
from zoo import Transformer

KINDS = ("perplexity", "choice", "generate")
Checker = Callable[[str, Mapping[str, Any]], bool | float]


# --- models -----------------------------------------------------------------------------


def load_model(
    spec: str,
    *,
    adapter: str | None = None,
    chat_template: str | None = None,
    attention: str | None = None,
    seed: int = 0,
) -> tuple[Transformer, Any]:
    """(model, tokenizer) of any model artifact (`training.artifacts`: an HF directory, a .gguf
    file, a train.py run directory, full or LoRA) with a PEFT `adapter`, the adapters folded in
    (`folded`). The tokenizer is a `zoo.Tokenizer` (with its chat template where it has one); an
    artifact without one (a preset) cannot be evaluated on text."""
    from training.artifacts import load_artifact

    artifact = load_artifact(
        spec, adapter=adapter, chat_template=chat_template, attention=attention, seed=seed
    )
    if artifact.tokenizer is None:
        raise ValueError(
            f"model {spec!r} comes with no tokenizer: it cannot be evaluated on text; give a "
            "checkpoint or a run that has one"
        )
    return folded(artifact.model), artifact.tokenizer


def folded(model: Transformer) -> Transformer:
    """LoRA adapters folded into their base once (W + scale A B), so evaluation runs at the
    plain model's speed; a quantized base keeps them apart."""
    from layers import QuantizedLinear
    from zoo.adapter import has_lora, merge_adapter

    is_quantized = lambda n: isinstance(n, QuantizedLinear)  # noqa: E731
    if not has_lora(model) or any(map(is_quantized, jax.tree.leaves(model, is_leaf=is_quantized))):
        return model
    return merge_adapter(model)


def _encoding(tokenizer):
    return getattr(tokenizer, "encoding", tokenizer)


def completion_text(tokenizer, ids: Sequence[int], stops: Sequence[int]) -> str:
    """The text of generated `ids` without the stop tokens; ids past the tokenizer's vocabulary
    (the unused rows of a model's padded embedding, which sampling can reach) have no text."""
    size = getattr(tokenizer, "vocab_size", None) or _encoding(tokenizer).n_vocab
    return tokenizer.decode([t for t in ids if t not in stops and t < size])


# --- task files -------------------------------------------------------------------------


def read_rows(path: str | Path) -> list[dict]:
    """The objects of a JSON-lines file; a ValueError naming the file and line if one is not."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r} does not exist")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: line {number} is not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {number} is {type(row).__name__}, not an object")
        rows.append({**row, "_line": number})
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def _field(path, row: dict, name: str, kind: type, shape: str):
    """Row `row`'s `name`, which must be a `kind`; a ValueError naming the file and line."""
    value = row.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{path}: line {row['_line']}: {name!r} is {value!r:.60}, not {shape}")
    return value


def load_checker(spec: str) -> Checker:
    """`FILE.py:function` or `package.module:function` as a callable."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--checker {spec!r}: give FILE.py:function or module:function")
    if where.endswith(".py"):
        if not Path(where).is_file():
            raise ValueError(f"--checker {spec!r}: {where} does not exist")
        loader = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ValueError(f"--checker {spec!r}: cannot import {where!r} ({error})") from None
    checker = getattr(module, name, None)
    if not callable(checker):
        raise ValueError(f"--checker {spec!r}: {where} has no function {name!r}")
    return checker


# --- tasks ------------------------------------------------------------------------------


def choice_task(model: Transformer, tokenizer, path, *, batch_size: int = 8) -> dict:
    """Multiple choice by log-likelihood (module docstring)."""
    encoding = _encoding(tokenizer)
    rows, requests, n_choices = read_rows(path), [], []
    for row in rows:
        prompt = _field(path, row, "prompt", str, "a string")
        choices = _field(path, row, "choices", list, "a list of strings")
        answer = row.get("answer", row.get("label"))
        row["answer"] = answer
        _field(path, row, "answer", int, "an integer index into 'choices'")
        if len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(
                f"{path}: line {row['_line']}: 'choices' must hold two or more non-empty strings"
            )
        if not 0 <= answer < len(choices):
            raise ValueError(
                f"{path}: line {row['_line']}: 'answer' {answer} is not an index into its "
                f"{len(choices)} choices (0 to {len(choices) - 1})"
            )
        context = [encoding.eot_token, *encoding.encode_ordinary(prompt)]
        requests += [(context, encoding.encode_ordinary(c)) for c in choices]
        n_choices.append(len(choices))
    scored = iter(score(model, requests, batch_size=batch_size))
    hits = hits_norm = 0
    for row, n in zip(rows, n_choices, strict=True):
        logps = np.array([next(scored).logprob for _ in range(n)])
        lengths = np.array([len(c.encode("utf-8")) for c in row["choices"]])
        hits += int(np.argmax(logps) == row["answer"])
        hits_norm += int(np.argmax(logps / lengths) == row["answer"])
    return {"accuracy": hits / len(rows), "accuracy_norm": hits_norm / len(rows), "n": len(rows)}


def _prompt_ids(tokenizer, row: dict, path, chat: bool) -> list[int]:
    if "messages" in row:
        if not (chat and getattr(tokenizer, "chat_template", None)):
            raise ValueError(
                f"{path}: line {row['_line']} gives 'messages', which need a chat template; the "
                "tokenizer has none (or --no-chat): give a 'prompt' string"
            )
        return tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True)
    prompt = _field(path, row, "prompt", str, "a string (or give 'messages')")
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    encoding = _encoding(tokenizer)
    return [encoding.eot_token, *encoding.encode_ordinary(prompt)]


def exact_match(completion: str, row: Mapping[str, Any]) -> bool:
    """The completion equals the row's "answer", both stripped of surrounding whitespace."""
    return completion.strip() == str(row["answer"]).strip()


def generate_task(
    model: Transformer,
    tokenizer,
    path,
    *,
    checker: Checker | None = None,
    max_new_tokens: int = 64,
    batch_size: int = 8,
    chat: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
    samples: int = 5,
) -> dict:
    """Generation scored by exact match or `checker` (module docstring); the first `samples`
    completions are returned for reading."""
    rows = read_rows(path)
    if checker is None:
        missing = [r["_line"] for r in rows if "answer" not in r]
        if missing:
            raise ValueError(
                f"{path}: line {missing[0]} has no 'answer' to match exactly: add one, or give "
                "--checker FILE.py:function to score the completions"
            )
    prompts = [_prompt_ids(tokenizer, row, path, chat) for row in rows]
    stops = tuple(getattr(tokenizer, "end_of_turn_ids", ())) or (_encoding(tokenizer).eot_token,)
    completions = generate_batched(
        model, prompts, max_new_tokens=max_new_tokens, stop_tokens=stops, batch_size=batch_size,
        temperature=temperature, seed=seed,
    )  # fmt: skip
    scores, shown = [], []
    for row, ids in zip(rows, completions, strict=True):
        text = completion_text(tokenizer, ids, stops)
        try:
            value = (checker or exact_match)(text, row)
        except Exception as error:
            raise ValueError(
                f"{path}: line {row['_line']}: the checker raised {error!r} on the completion "
                f"{text!r:.80}"
            ) from error
        value = float(value)
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise ValueError(
                f"{path}: line {row['_line']}: the checker returned {value}, not a bool or a "
                "number in [0, 1]"
            )
        scores.append(value)
        if len(shown) < samples:
            shown.append({"line": row["_line"], "completion": text, "score": value})
    generated = sum(len(c) for c in completions)
    return {"accuracy": float(np.mean(scores)), "n": len(rows), "new_tokens": generated,
            "samples": shown}  # fmt: skip


def generate_batched(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_tokens: Sequence[int],
    batch_size: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """New tokens for every prompt through one `infer.Engine` of `batch_size` rows: all are
    submitted, the engine refills rows as requests finish (continuous batching)."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    model.config.check_length(longest, "the longest prompt + --max-new-tokens")
    max_len = min(-(-longest // 64) * 64, model.config.max_seq_len)
    engine = infer.Engine(model, max_batch=batch_size, max_len=max_len, key=jax.random.key(seed))
    sampler = infer.Greedy() if temperature == 0 else infer.Temperature(temperature)
    requests = [
        engine.submit(list(p), max_new_tokens=max_new_tokens, sampler=sampler,
                      stop_tokens=stop_tokens)
        for p in prompts
    ]  # fmt: skip
    engine.run()
    return [r.tokens for r in requests]


def perplexity_task(
    model: Transformer, tokenizer, path, *, text_column: str = "text", window: int | None = None,
    batch_size: int = 8,
) -> dict:  # fmt: skip
    """Perplexity and bits per byte of every document of a text dataset (module docstring)."""
    from data.datasets import load_text

    dataset = load_text(str(path), column=text_column)
    result = perplexity(
        model, _encoding(tokenizer), dataset[text_column], window=window, batch_size=batch_size
    )
    return {**result.as_dict(), "documents": len(dataset)}


def evaluate(
    model: Transformer,
    tokenizer,
    tasks: Sequence[tuple[str, str]],
    **settings,
) -> dict[str, dict]:
    """{"KIND:FILE": metrics} for each (kind, file) task. `settings` go to the task functions
    that take them (checker, max_new_tokens, batch_size, chat, temperature, text_column, window,
    seed)."""
    runners = {"perplexity": perplexity_task, "choice": choice_task, "generate": generate_task}
    takes = {
        "perplexity": ("text_column", "window", "batch_size"),
        "choice": ("batch_size",),
        "generate": ("checker", "max_new_tokens", "batch_size", "chat", "temperature", "seed"),
    }
    results = {}
    for kind, path in tasks:
        if kind not in runners:
            raise ValueError(f"--task {kind}={path}: the kinds are {list(KINDS)}")
        kwargs = {k: v for k, v in settings.items() if k in takes[kind]}
        t0 = time.perf_counter()
        results[f"{kind}:{path}"] = {**runners[kind](model, tokenizer, path, **kwargs),
                                     "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip
    return results


def table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """The results as a Markdown table: one row per task, its numeric metrics."""
    lines = ["| task | metric | value |", "|---|---|---|"]
    for task, metrics in results.items():
        for name, value in metrics.items():
            if isinstance(value, bool | int | float):
                shown = f"{value:,}" if isinstance(value, int) else f"{value:.4f}"
                lines.append(f"| {task} | {name} | {shown} |")
    return "\n".join(lines)


# --- the command line -------------------------------------------------------------------


def _task(text: str) -> tuple[str, str]:
    kind, sep, path = text.partition("=")
    if not sep or kind not in KINDS or not path:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KIND=FILE with KIND one of {', '.join(KINDS)}"
        )
    return kind, path


def add_task_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of what to evaluate and how (every flag but the model's): shared by `python -m
    training.evaluate` and `eqx-zoo evaluate`. Numbers are checked at their flag (training.args'
    `Bounds`); the flags other commands have too mean the same there."""
    kinds = ", ".join(KINDS)
    p.add_argument("--task", action="append", type=_task, default=[], metavar="KIND=FILE",
                   help=f"a task to run (repeatable); KIND is one of {kinds}")  # fmt: skip
    p.add_argument("--lm-eval", metavar="TASKS",
                   help="comma-separated lm-eval tasks (needs the `eval` extra)")  # fmt: skip
    p.add_argument("--lm-eval-include", metavar="DIR", help="a directory of local lm-eval tasks")
    p.add_argument("--checker", help="FILE.py:function or module:function scoring generations")
    p.add_argument(
        "--max-new-tokens", type=POSITIVE_INT.flag_type(), default=64,
        help="most tokens to generate per generate row (fewer where the model's end of turn or "
        "sequence comes first)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=POSITIVE_INT.flag_type(), metavar="INT", default=8,
                   help="rows scored or generated together")  # fmt: skip
    p.add_argument("--window", type=POSITIVE_INT.flag_type(),
                   help="perplexity window (default max_seq_len)")  # fmt: skip
    add_arguments(p, ("text_column",))
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="render generate prompts with the chat template if any")  # fmt: skip
    p.add_argument("--temperature", type=NON_NEGATIVE.flag_type(),
                   help="for generate tasks; default 0 (greedy)")  # fmt: skip
    add_arguments(p, ("seed",))
    p.add_argument("--out", type=str, help="write the results as JSON here")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.evaluate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "model", help="any model artifact: an HF directory, .gguf file or train.py run directory"
    )
    p.add_argument("--adapter", help="a PEFT adapter directory to put on the model")
    p.add_argument("--chat-template", help="a .jinja file replacing the checkpoint's template")
    add_task_arguments(p)
    return p


def check_tasks(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """At least one task; the temperature resolved (None: greedy)."""
    if not args.task and not args.lm_eval:
        p.error("give at least one --task KIND=FILE (or --lm-eval TASKS)")
    if args.temperature is None:
        args.temperature = 0.0


def run(
    args: argparse.Namespace, model: Transformer, tokenizer, *, checker: Checker | None = None
) -> dict[str, dict]:
    """The tasks `args` name (`add_task_arguments`'s flags) run on `model`, generations scored
    by `checker` (`load_checker(args.checker)`): the table printed, the results written to
    `--out` as JSON; returns them."""
    results = evaluate(
        model, tokenizer, args.task, checker=checker, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, chat=args.chat, temperature=args.temperature,
        text_column=args.text_column, window=args.window, seed=args.seed,
    )  # fmt: skip
    if args.lm_eval:
        from training.lm_eval_adapter import run_lm_eval

        tasks = args.lm_eval.split(",")
        include, batch = args.lm_eval_include, args.batch_size
        results.update(run_lm_eval(model, tokenizer, tasks, include=include, batch_size=batch))
    print(f"model: {args.model}" + (f" + adapter {args.adapter}" if args.adapter else ""))
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "adapter": args.adapter,
                                              "results": results}, indent=1))  # fmt: skip
        print(f"results written to {args.out}")
    return results


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """The command line; returns the results."""
    p = parser()
    args = p.parse_args(argv)
    check_tasks(p, args)
    checker = load_checker(args.checker) if args.checker else None  # fails before the model
    model, tokenizer = load_model(
        args.model, adapter=args.adapter, chat_template=args.chat_template, seed=args.seed
    )
    return run(args, model, tokenizer, checker=checker)


if __name__ == "__main__":
    from shard.xla_flags import set_default_xla_flags

    set_default_xla_flags()
    try:
        main()
    except (ValueError, OSError) as error:
        sys.exit(f"training.evaluate: error: {error}")
