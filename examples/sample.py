"""Sample a continuation of a prompt, streamed as it is generated, with prefill and decode tokens/s.

    python -m examples.sample --checkpoint path/to/hf-dir-or.gguf --prompt "Once upon a time"
    python -m examples.sample --preset gpt2-124m --tokenizer gpt2 --prompt "Hello"
    python -m examples.sample --preset tiny-llama --prompt 1,2,3      # no tokenizer: token ids
    python -m examples.sample --preset tiny-llama --prompt 1,2,3 --top-k 5  # temperature 1
    python -m examples.sample --run runs/tiny --prompt "Once upon a time"   # a train.py run
    python -m examples.sample --run runs/tiny --prompt "Hi" --mesh data=2,tensor=4 --rules tp

A checkpoint is loaded with `zoo.load_pretrained` and its tokenizer with
`zoo.load_tokenizer`; a train.py run directory with
`training.run_dir.load_run` (the latest checkpoint and the tokenizer the run recorded); a preset
gets random weights. `--tokenizer` is a tiktoken encoding name (its BPE file must be cached
offline), a `.tiktoken` rank file or a checkpoint path. `--mesh` with `--rules` loads the weights
straight into their shardings and generates with a sharded KV cache (a `shard.Placement`).

Decoding is greedy unless asked: `--top-k`, `--top-p` or `--min-p` samples at temperature 1, or
at `--temperature`; `--temperature` alone samples from the whole distribution. `--temperature 0`
with one of them is refused (greedy would ignore it).
"""

import argparse
import os
import sys
import time

import jax

import infer
import shard
import zoo
from layers.paged_cache import KV_DTYPES
from shard.xla_flags import set_default_xla_flags
from training.args import FRACTION, NON_NEGATIVE, POSITIVE_INT, PROBABILITY, SEED
from training.run_dir import load_run


def load_tokenizer(name_or_path: str):
    if os.path.exists(name_or_path):
        return zoo.load_tokenizer(name_or_path).encoding
    import tiktoken

    return tiktoken.get_encoding(name_or_path)


def make_sampler(args: argparse.Namespace) -> infer.Sampler:
    """The sampler the flags name (after `parse_args`, which resolves the temperature)."""
    if args.temperature == 0:
        return infer.Greedy()
    if args.top_k is not None:
        return infer.TopK(k=args.top_k, temperature=args.temperature)
    if args.top_p is not None:
        return infer.TopP(p=args.top_p, temperature=args.temperature)
    if args.min_p is not None:
        return infer.MinP(p=args.min_p, temperature=args.temperature)
    return infer.Temperature(temperature=args.temperature)


def _token_ids(text: str) -> list[int]:
    """`--stop-ids 1,2`: comma-separated non-negative token ids."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated token ids such as 0,50256, got {text!r}"
        ) from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids are non-negative, got {text!r}")
    return ids


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="HF directory or .gguf file (zoo.load_pretrained)")
    source.add_argument("--run", help="a train.py run directory (its latest checkpoint)")
    source.add_argument("--preset", help="a zoo preset with random weights", choices=zoo.presets())
    p.add_argument("--tokenizer", help="tiktoken encoding name or checkpoint path")
    p.add_argument("--prompt", required=True, help="text, or comma-separated token ids")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT.flag_type(), default=64)
    p.add_argument(
        "--temperature",
        type=NON_NEGATIVE.flag_type(),
        help="softmax temperature; 0 = greedy. Default: 0 (greedy), or 1 with --top-k, --top-p "
        "or --min-p (which sample)",
    )
    sampling = p.add_mutually_exclusive_group()
    sampling.add_argument(
        "--top-k", type=POSITIVE_INT.flag_type(), help="sample from the k most likely tokens"
    )
    sampling.add_argument(
        "--top-p",
        type=PROBABILITY.flag_type(),
        help="sample from the most likely tokens whose probabilities add up to p (nucleus)",
    )
    sampling.add_argument(
        "--min-p",
        type=FRACTION.flag_type(),
        help="sample from the tokens at least p times as likely as the most likely one",
    )
    p.add_argument("--stop-ids", type=_token_ids, default=[], help="comma-separated stop token ids")
    p.add_argument(
        "--chunk-size", type=POSITIVE_INT.flag_type(), default=4, help="tokens per streamed chunk"
    )
    p.add_argument("--seed", type=SEED.flag_type(), default=0)
    p.add_argument(
        "--kv-dtype", choices=KV_DTYPES, help="KV cache pages (default: the compute dtype)"
    )
    p.add_argument("--mesh", help="device mesh, e.g. data=2,tensor=4 (needs --rules)")
    p.add_argument("--rules", choices=shard.presets(), help="sharding strategy for --mesh")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with the temperature resolved: --top-k/--top-p/--min-p sample (temperature 1
    unless given); --temperature 0 (greedy) with one of them is refused, as it would ignore it."""
    p = parser()
    args = p.parse_args(argv)
    if (args.mesh is None) != (args.rules is None):
        p.error("--mesh and --rules go together")
    filters = {"--top-k": args.top_k, "--top-p": args.top_p, "--min-p": args.min_p}
    given = [f"{flag} {value}" for flag, value in filters.items() if value is not None]
    if args.temperature is None:
        args.temperature = 1.0 if given else 0.0
    elif args.temperature == 0 and given:
        p.error(
            f"argument --temperature: 0 means greedy, which would ignore {given[0]}: drop "
            "--temperature (to sample at temperature 1) or give one above 0"
        )
    if args.preset and args.tokenizer is None:  # no tokenizer: the prompt is token ids
        try:
            _token_ids(args.prompt)
        except argparse.ArgumentTypeError as error:
            p.error(f"argument --prompt: with no tokenizer (give --tokenizer) it {error}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    placement = shard.Placement()  # one device
    if args.mesh:
        mesh = shard.mesh(**shard.parse_mesh(args.mesh))
        placement = shard.Placement(mesh, shard.ShardingRules.preset(args.rules))

    tokenizer = None
    if args.run:
        model, tokenizer = load_run(args.run, tokenizer=args.tokenizer, placement=placement)
        tokenizer_source = None
    elif args.checkpoint:
        model = zoo.load_pretrained(args.checkpoint, placement=placement)
        tokenizer_source = args.tokenizer or args.checkpoint
    else:
        config = zoo.preset(args.preset)
        model = placement.init(
            lambda key: zoo.Transformer(config, key=key), jax.random.key(args.seed)
        )
        tokenizer_source = args.tokenizer
    # The fastest decode storage (per-layer weights; load_pretrained gives it already, a run or
    # a fresh model is stacked for training): a one-time conversion.
    model = model.with_policy(storage="unrolled")
    if tokenizer_source:
        tokenizer = load_tokenizer(tokenizer_source)
    if tokenizer is None:
        try:
            prompt = _token_ids(args.prompt)
        except argparse.ArgumentTypeError as error:
            parser().error(f"argument --prompt: with no tokenizer (give --tokenizer) it {error}")
    else:
        prompt = tokenizer.encode_ordinary(args.prompt)
    stops = list(args.stop_ids)
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
            placement=placement,
            kv_dtype=args.kv_dtype,
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
