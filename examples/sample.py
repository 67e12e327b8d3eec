"""Sample a continuation of a prompt, streamed as it is generated, with prefill and decode tokens/s.

    python -m examples.sample --checkpoint path/to/hf-dir-or.gguf --prompt "Once upon a time"
    python -m examples.sample --preset gpt2-124m --tokenizer gpt2 --prompt "Hello"
    python -m examples.sample --preset tiny-llama --prompt 1,2,3      # no tokenizer: token ids
    python -m examples.sample --run runs/tiny --prompt "Once upon a time"   # a train.py run
    python -m examples.sample --run runs/tiny --prompt "Hi" --mesh data=2,tensor=4 --rules tp

A checkpoint is loaded with `zoo.load_pretrained` and its tokenizer with
`zoo.load_tokenizer`; a train.py run directory with
`training.checkpoint.load_run` (the latest checkpoint and the tokenizer the run recorded); a preset
gets random weights. `--tokenizer` is a tiktoken encoding name (its BPE file must be cached
offline), a `.tiktoken` rank file or a checkpoint path. `--mesh` with `--rules` generates with
sharded weights and KV cache (infer.generate's mesh/rules).
"""

import argparse
import os
import sys
import time

import jax

import infer
import shard
import zoo
from shard.xla_flags import set_default_xla_flags
from training.checkpoint import load_run


def load_tokenizer(name_or_path: str):
    if os.path.exists(name_or_path):
        return zoo.load_tokenizer(name_or_path).encoding
    import tiktoken

    return tiktoken.get_encoding(name_or_path)


def make_sampler(args: argparse.Namespace) -> infer.Sampler:
    if args.temperature == 0:
        return infer.Greedy()
    if args.top_k is not None:
        return infer.TopK(k=args.top_k, temperature=args.temperature)
    if args.top_p is not None:
        return infer.TopP(p=args.top_p, temperature=args.temperature)
    if args.min_p is not None:
        return infer.MinP(p=args.min_p, temperature=args.temperature)
    return infer.Temperature(temperature=args.temperature)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="HF directory or .gguf file (zoo.load_pretrained)")
    source.add_argument("--run", help="a train.py run directory (its latest checkpoint)")
    source.add_argument("--preset", help="a zoo preset with random weights", choices=zoo.presets())
    parser.add_argument("--tokenizer", help="tiktoken encoding name or checkpoint path")
    parser.add_argument("--prompt", required=True, help="text, or comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sampling = parser.add_mutually_exclusive_group()
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--min-p", type=float)
    parser.add_argument("--stop-ids", default="", help="comma-separated stop token ids")
    parser.add_argument("--chunk-size", type=int, default=4, help="tokens per streamed chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mesh", help="device mesh, e.g. data=2,tensor=4 (needs --rules)")
    parser.add_argument("--rules", choices=shard.presets(), help="sharding strategy for --mesh")
    args = parser.parse_args()
    if (args.mesh is None) != (args.rules is None):
        parser.error("--mesh and --rules go together")
    mesh = shard.mesh(**shard.parse_mesh(args.mesh)) if args.mesh else None
    rules = shard.ShardingRules.preset(args.rules) if args.rules else None

    tokenizer = None
    if args.run:
        model, tokenizer = load_run(args.run, tokenizer=args.tokenizer)
        tokenizer_source = None
    elif args.checkpoint:
        model = zoo.load_pretrained(args.checkpoint)
        tokenizer_source = args.tokenizer or args.checkpoint
    else:
        model = zoo.Transformer(zoo.preset(args.preset), key=jax.random.key(args.seed))
        tokenizer_source = args.tokenizer
    model = model.unstack_layers()  # per-layer weights: the fast decode layout on CPU
    if tokenizer_source:
        tokenizer = load_tokenizer(tokenizer_source)
    if tokenizer is None:
        prompt = [int(t) for t in args.prompt.split(",")]
    else:
        prompt = tokenizer.encode_ordinary(args.prompt)
    stops = [int(t) for t in args.stop_ids.split(",") if t]
    if tokenizer is not None and "<|endoftext|>" in tokenizer.special_tokens_set:
        stops.append(tokenizer.encode_single_token("<|endoftext|>"))

    generated: list[int] = []
    shown = ""
    arrivals: list[float] = []

    def show(chunk: list[list[int]]) -> None:
        nonlocal shown
        arrivals.append(time.perf_counter())
        generated.extend(chunk[0])
        if tokenizer is None:
            print("".join(f" {t}" for t in chunk[0]), end="", flush=True)
            return
        text = tokenizer.decode(generated)  # whole text: a chunk may split a character
        print(text[len(shown) :], end="", flush=True)
        shown = text

    def run(on_tokens):
        return infer.generate(
            model,
            [prompt],
            max_new_tokens=args.max_new_tokens,
            sampler=make_sampler(args),
            key=jax.random.key(args.seed),
            stop_tokens=stops,
            on_tokens=on_tokens,
            chunk_size=args.chunk_size,
            mesh=mesh,
            rules=rules,
        )

    print("compiling ...", file=sys.stderr, flush=True)
    run(lambda chunk: None)  # same program, so the timed run below does not compile
    print(args.prompt, end="", flush=True)
    start = time.perf_counter()
    out = run(show)
    end = time.perf_counter()
    print()
    # The first token is streamed right after the prefill; the rest are decode steps.
    prefill_s, decode_s = arrivals[0] - start, end - arrivals[0]
    n_decoded = len(out[0]) - 1
    print(
        f"prefill: {len(prompt)} tokens, {len(prompt) / prefill_s:.0f} tokens/s | decode: "
        f"{n_decoded} tokens, {n_decoded / max(decode_s, 1e-9):.1f} tokens/s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    set_default_xla_flags()  # before the first computation: XLA reads its flags once
    main()
