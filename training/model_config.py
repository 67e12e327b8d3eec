"""The model a run's flags ask for. A fresh run: a preset (`--model`) with the run-time flags
(`--dtype`, `--param-dtype`, `--remat`, `--attention`) and `--override FIELD=VALUE` applied.
`--init-from`: the checkpoint's architecture, with the same run-time flags and the run-time
`--override`s applied to it (`zoo.with_runtime`); a flag that would change the architecture is
refused, naming the flag. Either way the tokenizer and `--seq-len` must fit the model.
"""

import json
from typing import Any

from training.args import Args
from zoo import RUNTIME_FIELDS, Config, preset

DEFAULT_MODEL = "gpt-mini"


def overrides(args: Args) -> dict[str, Any]:
    """`--override FIELD=VALUE` items as {field: value}; a value is JSON if it parses as JSON
    (numbers, true/false, null), else a string."""
    changes = {}
    for item in args.override:
        name, sep, value = item.partition("=")
        if not sep or name not in Config.__dataclass_fields__:
            raise ValueError(f"--override {item!r} must be FIELD=VALUE with a zoo.Config field")
        try:
            changes[name] = json.loads(value)
        except json.JSONDecodeError:
            changes[name] = value
    return changes


def runtime_settings(args: Args) -> dict[str, Any]:
    """The run-time flags as Config changes (`--attention` only when given: else the model's)."""
    settings = {"dtype": args.dtype, "param_dtype": args.param_dtype, "remat": args.remat}
    if args.attention:
        settings["attention"] = args.attention
    return settings


def preset_config(args: Args, n_vocab: int) -> Config:
    """The `--model` preset with the run-time flags, then the `--override`s, applied."""
    name = args.model or DEFAULT_MODEL
    config = preset(name, **{**runtime_settings(args), **overrides(args)})
    check_fits(config, args, n_vocab, name)
    return config


def imported_changes(args: Args, config: Config) -> dict[str, Any]:
    """The run-time changes (for `zoo.with_runtime`) that the flags ask of the model loaded from
    `--init-from`, whose config is `config`. An `--override` of an architecture field is refused
    unless it repeats the checkpoint's value; so is `--model`."""
    if args.model is not None:
        raise ValueError(
            f"--model {args.model!r} and --init-from {args.init_from!r} both name the model: "
            "drop --model (the architecture comes from the checkpoint)"
        )
    changes = runtime_settings(args)
    for name, value in overrides(args).items():
        if name in RUNTIME_FIELDS:
            changes[name] = value
        elif value != getattr(config, name):
            raise ValueError(
                f"--override {name}={value!r} contradicts --init-from {args.init_from!r}, whose "
                f"{name} is {getattr(config, name)!r}: the architecture comes from the "
                f"checkpoint; --override can change only the run-time fields {RUNTIME_FIELDS}"
            )
    return changes


def check_fits(config: Config, args: Args, n_vocab: int, name: str) -> None:
    """A token id the embedding table has no row for would be silently clipped by the lookup;
    learned positions have no row past `max_seq_len`."""
    if n_vocab > config.vocab_size:
        fix = (
            "use a tokenizer with fewer tokens"
            if args.init_from
            else f"use a smaller --vocab-size or --override vocab_size={n_vocab}"
        )
        raise ValueError(
            f"the tokenizer has {n_vocab} tokens but model {name!r} has vocab_size="
            f"{config.vocab_size}: {fix}"
        )
    if config.position == "learned" and args.seq_len > config.max_seq_len:
        raise ValueError(
            f"--seq-len {args.seq_len} exceeds model {name!r}'s max_seq_len={config.max_seq_len}"
        )
