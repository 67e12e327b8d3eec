"""`eqx-zoo sample`: continue a prompt, streamed as it is generated, with prefill and decode
tokens/s.

    eqx-zoo sample --model path/to/hf-dir-or.gguf --prompt "Once upon a time"
    eqx-zoo sample --model runs/default --prompt "def main("             # a train.py run
    eqx-zoo sample --model tiny-llama --prompt 1,2,3                     # no tokenizer: ids
    eqx-zoo sample --model runs/tiny --prompt "Hi" --top-k 5 --stop "\\n\\n"
    eqx-zoo sample --model runs/tiny --prompt "Hi" --mesh data=2,tensor=4 --rules tp

The model is any artifact (`--model`, `--adapter`: training/artifacts.py); a preset gets random
weights and, having no tokenizer, takes its prompt as comma-separated token ids. The prompt is
encoded as HF's `tokenizer(prompt)` encodes it (with the BOS a tokenizer adds). Generation stops
at the model's end-of-sequence and end-of-turn tokens (`Tokenizer.stop_ids()`), a `--stop` text,
or `--max-new-tokens`. Decoding is greedy unless asked: `--top-k`, `--top-p` or `--min-p` samples
at temperature 1, or at `--temperature`; `--temperature` alone samples from the whole
distribution. `--mesh` with `--rules` loads the weights straight into their shardings.
"""

import argparse
import sys
import time

import jax

import infer
import shard
from cli import commands, flags, stream
from training import run_dir as runs
from training.artifacts import load_artifact, plain


def token_ids(text: str) -> list[int]:
    """`--prompt 1,2,3` without a tokenizer: comma-separated non-negative token ids."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(
            f"must be comma-separated token ids such as 0,50256, got {text!r}"
        ) from None
    if not ids or any(i < 0 for i in ids):
        raise ValueError(f"must be non-negative token ids such as 0,50256, got {text!r}")
    return ids


def parser(prog: str = "eqx-zoo sample") -> argparse.ArgumentParser:
    p = commands.command_parser(prog, __doc__)
    flags.add_model(p)
    p.add_argument(
        "--prompt", required=True, help="text, or comma-separated token ids without a tokenizer"
    )
    flags.add_stopping(p)
    flags.add_sampling(p)
    flags.add_kv_dtype(p)
    flags.add_placement(p)
    return p


def parse_args(argv: list[str] | None = None, prog: str = "eqx-zoo sample") -> argparse.Namespace:
    p = parser(prog)
    args = p.parse_args(argv)
    flags.resolve_sampling(p, args)
    return args


def main(argv: list[str] | None = None, prog: str = "eqx-zoo sample") -> stream.Reply | list[int]:
    args = parse_args(argv, prog)
    placement = shard.Placement.from_flags(args.mesh, args.rules)
    artifact = load_artifact(
        args.model, adapter=args.adapter, attention=args.attention, placement=placement,
        seed=args.seed,
    )  # fmt: skip
    tokenizer = artifact.tokenizer
    if tokenizer is None:
        try:
            prompt = token_ids(args.prompt)
        except ValueError as error:
            if artifact.kind == "run":  # train.py records a run's tokenizer: this one lost it
                runs.recorded_tokenizer_spec(args.model)  # the error naming the missing files
            parser(prog).error(f"argument --prompt: with no tokenizer it {error}")
    else:
        prompt = tokenizer.encode(args.prompt, add_special_tokens=True)
    model = plain(artifact.model).for_decode(sharded=placement.sharded)  # at most one copy
    max_len = min(len(prompt) + args.max_new_tokens, model.config.max_seq_len)
    start = time.perf_counter()
    print("compiling the engine (prefill and decode programs) ...", file=sys.stderr, flush=True)
    engine = infer.Engine(
        model, max_batch=1, max_len=max_len, placement=placement, key=jax.random.key(args.seed),
        kv_dtype=args.kv_dtype, first_prompts=[len(prompt)],
    )  # fmt: skip
    print(f"(compiled in {time.perf_counter() - start:.1f} s)", file=sys.stderr)
    budget = max_len - len(prompt)
    if budget < 1:
        raise ValueError(
            f"the prompt ({len(prompt)} tokens) fills the model's max_seq_len "
            f"({model.config.max_seq_len}): shorten it"
        )
    print(args.prompt, end="", flush=True)
    if tokenizer is None:
        request = engine.submit(
            prompt, max_new_tokens=budget, sampler=flags.sampler(args),
            on_tokens=lambda t: print("".join(f" {i}" for i in t), end="", flush=True),
        )  # fmt: skip
        engine.run()
        print()
        _rates(len(prompt), request)
        return request.tokens
    answer = stream.reply(
        engine, tokenizer, prompt, max_new_tokens=budget, sampler=flags.sampler(args),
        stop_texts=args.stop or (), write=lambda s: print(s, end="", flush=True),
    )  # fmt: skip
    print()
    _rates(len(prompt), answer.request, answer.stopped_by)
    return answer


def _rates(n_prompt: int, request: infer.Request, stopped_by: str = "length") -> None:
    # The first token comes right after the prefill; the rest are decode steps.
    n = len(request.tokens)
    rate = (n - 1) / request.decode_s if n > 1 and request.decode_s else float("nan")
    print(
        f"prompt {n_prompt} tokens, first new token after {request.ttft_s * 1e3:.0f} ms | "
        f"decode: {n} tokens, {rate:.1f} tokens/s | stopped by {stopped_by}",
        file=sys.stderr,
    )
