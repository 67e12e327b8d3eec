"""`eqx-zoo serve`: serve any model over OpenAI's HTTP API (infer.serve: chat and text
completions, streamed as server-sent events, structured output, LoRA adapters per request).

    eqx-zoo serve --model SmolLM2.gguf --port 8000 --max-batch 16
    eqx-zoo serve --model runs/finetune                  # a fine-tuned run (LoRA: folded in)
    eqx-zoo serve --model base.gguf --adapter brief=runs/dpo/adapter --adapter terse=other/
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "base", "messages": [{"role": "user", "content": "Hi"}]}'

The model is served as --name (default: the file or directory's name) and as "base"; each
`--adapter NAME=PATH` (a PEFT adapter of that base) is served as model NAME, applied per request
on the one engine (the base weights are shared, not copied). The engine compiles its step
programs before the port opens; SIGTERM or Ctrl-C stop taking connections, let every request in
flight finish (streams included), then exit. Needs the `serve` extra.
"""

import argparse
import os
import sys

from cli import commands, flags
from training.args import NON_NEGATIVE_INT, POSITIVE_INT, Bounds

PORT = Bounds(int, 1, 65535, "a port number, 1 to 65535")


def adapter(text: str) -> tuple[str, str]:
    """`--adapter NAME=PATH` as (name, path)."""
    from infer.serve.__main__ import adapter_argument

    try:
        return adapter_argument(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be NAME=PATH (a PEFT adapter directory, served as model NAME), got {text!r}"
        ) from None


adapter.__name__ = "adapter"  # argparse names the type in its messages


def parser(prog: str = "eqx-zoo serve") -> argparse.ArgumentParser:
    p = commands.command_parser(prog, __doc__)
    flags.add_model(p, adapter=False)
    p.add_argument(
        "--adapter",
        type=adapter,
        action="append",
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter of --model served as model NAME (repeatable); to serve a "
        "model with an adapter folded in, `eqx-zoo merge` it first",
    )
    flags.add_chat_template(p)
    flags.add_special_in_content(p)
    p.add_argument("--name", help="the model's name in the API (default: --model's file name)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=PORT.flag_type(), default=8000, help="the port to listen on")
    p.add_argument(
        "--max-batch", type=POSITIVE_INT.flag_type(), default=8, help="requests decoded together"
    )
    flags.add_max_len(p, "prompt + new tokens per request")
    p.add_argument(
        "--max-waiting",
        type=NON_NEGATIVE_INT.flag_type(),
        default=64,
        help="requests queued beyond --max-batch before the server answers 429",
    )
    p.add_argument(
        "--page-size", type=POSITIVE_INT.flag_type(), default=16, help="tokens per KV-cache page"
    )
    p.add_argument(
        "--chunk",
        type=POSITIVE_INT.flag_type(),
        help="prompts are computed in chunks of this many tokens, as many per engine step as "
        "--token-budget leaves (default: the engine's, infer.engine.CHUNK)",
    )
    p.add_argument(
        "--token-budget",
        type=POSITIVE_INT.flag_type(),
        help="the most tokens one engine step runs: every decoding request's next token, then "
        "prompt chunks (default: --max-batch + infer.engine.default_prompt_tokens: 256, or with "
        "packed weights on a CPU what keeps a step within the packed kernel)",
    )
    flags.add_kv_dtype(p)
    flags.add_placement(p)
    return p


def build(argv: list[str] | None = None, prog: str = "eqx-zoo serve"):
    """(the app, its parsed flags): the model loaded, its adapters banked, the engine compiled;
    `main` serves it."""
    import zoo
    from infer.engine import Engine
    from infer.serve.app import make_app
    from shard import Placement
    from training.artifacts import load_artifact, plain

    p = parser(prog)
    args = p.parse_args(argv)
    given = args.adapter or []
    adapters = dict(given)
    if len(adapters) != len(given):
        p.error("argument --adapter: each NAME may be given once")
    placement = Placement.from_flags(args.mesh, args.rules)
    artifact = load_artifact(
        args.model, attention=args.attention, placement=placement,
        chat_template=args.chat_template,
    )  # fmt: skip
    if artifact.tokenizer is None:
        raise ValueError(
            f"--model {args.model!r} comes with no tokenizer to serve text with: give a "
            "checkpoint or a run that has one"
        )
    model = plain(artifact.model).for_decode(sharded=placement.sharded)
    if adapters:  # one base, the adapters applied per row (not a merged model each)
        adapted = [zoo.load_adapter(model, path, placement=placement) for path in adapters.values()]
        model = zoo.bank_adapters(model, adapted)
    engine = Engine(
        model, max_batch=args.max_batch, max_len=flags.max_len(args.max_len, model.config),
        page_size=args.page_size, chunk=args.chunk, token_budget=args.token_budget,
        placement=placement, kv_dtype=args.kv_dtype,
    )  # fmt: skip
    name = args.name or os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]
    app = make_app(
        engine, artifact.tokenizer, name=name, adapters=list(adapters),
        max_waiting=args.max_waiting, special_in_content=args.special_in_content,
    )  # fmt: skip
    args.name = name
    return app, args


def main(argv: list[str] | None = None, prog: str = "eqx-zoo serve") -> None:
    import uvicorn

    app, args = build(argv, prog)
    print(f"serving {args.name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
