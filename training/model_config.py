"""The model a run's flags ask for: an architecture (`zoo.Config`) and a run-time policy
(`zoo.Policy`).

A fresh run: the `--model` preset with `--override FIELD=VALUE` applied (architecture fields,
type-checked by the Config). `--init-from`: the checkpoint's architecture, where an `--override`
is refused unless it repeats the checkpoint's value. Either way the policy comes from the
run-time flags (`--dtype`, `--param-dtype`, `--remat`, `--attention`, `--moe-dispatch`,
`--capacity-factor`), and the tokenizer and `--seq-len` must fit the model. A mesh that splits
the sequence picks its context-parallel kernel unless `--attention` names one.
"""

import json
from typing import Any

from layers.moe import Capacity, Dropless
from shard import Placement
from training.args import Args, accumulation, pipeline_stages
from training.loss import AuxWeights
from training.telemetry import hardware
from zoo import Config, Policy, Transformer, preset
from zoo import math as zmath

DEFAULT_MODEL = "gpt-mini"


def overrides(args: Args) -> dict[str, Any]:
    """`--override FIELD=VALUE` items as {field: value}; a value is JSON if it parses as JSON
    (numbers, true/false, null), else a string. The Config checks each value's type."""
    changes = {}
    for item in args.override:
        name, sep, value = item.partition("=")
        if not sep or name not in Config.__dataclass_fields__:
            raise ValueError(
                f"--override {item!r} must be FIELD=VALUE with a zoo.Config field; fields: "
                f"{sorted(Config.__dataclass_fields__)}"
            )
        try:
            changes[name] = json.loads(value)
        except json.JSONDecodeError:
            changes[name] = value
    return changes


def policy(args: Args) -> Policy:
    """The run-time flags as a Policy."""
    dispatch = Dropless() if args.moe_dispatch == "dropless" else Capacity(args.capacity_factor)
    return Policy(
        compute_dtype=args.dtype,
        param_dtype=args.param_dtype,
        remat=args.remat,
        attention=args.attention or "xla",
        moe_dispatch=dispatch,
        microbatches=accumulation(args)[1],
        pipeline_schedule=args.pipeline_schedule,
        virtual_stages=args.virtual_stages,
    )


def with_context_kernel(model: Transformer, args: Args, placement: Placement) -> Transformer:
    """`model` as built, unless the mesh splits the sequence (context parallelism) and no
    `--attention` was given: then under the context-parallel kernel (`ring` or `allgather`)
    that zoo.math predicts faster on this hardware (`--peak-flops`/`--peak-bandwidth`, else
    detected; without an interconnect figure the memory bandwidth stands in for the link).
    The choice does not depend on the batch: both kernels' FLOPs and bytes grow with it. A 1F1B
    pipeline takes `allgather` (zoo/pipeline_loss.py refuses the ring kernel there)."""
    n = placement.sequence_shards
    if n == 1 or args.attention is not None:
        return model
    if pipeline_stages(args) > 1 and args.pipeline_schedule == "1f1b":
        return model.with_policy(attention="allgather")  # 1F1B refuses the ring kernel
    hw = hardware(args.peak_flops, args.peak_bandwidth, model.policy.compute_dtype)
    kernel = zmath.cheaper_context_kernel(
        model.config, model.policy, batch=1, seq=args.seq_len, context=n, hardware=hw
    )
    return model.with_policy(attention=kernel)


def aux_weights(args: Args) -> AuxWeights:
    return AuxWeights(
        load_balancing=args.moe_balance_weight,
        z_loss=args.moe_z_weight,
        bias_rate=args.router_bias_rate,
    )


def preset_config(args: Args, n_vocab: int) -> Config:
    """The `--model` preset with the `--override`s applied."""
    name = args.model or DEFAULT_MODEL
    try:
        config = preset(name, **overrides(args))
    except ValueError as error:
        raise ValueError(f"--model {name!r} with --override: {error}") from error
    check_fits(config, args, n_vocab, name)
    return config


def check_imported(args: Args, config: Config) -> None:
    """`--model` and architecture `--override`s cannot change the model `--init-from` loads."""
    if args.model is not None:
        raise ValueError(
            f"--model {args.model!r} and --init-from {args.init_from!r} both name the model: "
            "drop --model (the architecture comes from the checkpoint)"
        )
    for name, value in overrides(args).items():
        if value != getattr(config, name):
            raise ValueError(
                f"--override {name}={value!r} contradicts --init-from {args.init_from!r}, whose "
                f"{name} is {getattr(config, name)!r}: the architecture comes from the "
                "checkpoint (run-time settings are flags: --dtype, --remat, --attention, ...)"
            )


def check_fits(config: Config, args: Args, n_vocab: int, name: str) -> None:
    """A token id the embedding table has no row for would be silently clipped by the lookup;
    no sequence may exceed `max_seq_len`."""
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
    try:
        config.check_length(args.seq_len, f"--seq-len {args.seq_len}")
    except ValueError as error:
        raise ValueError(f"model {name!r}: {error}") from error
