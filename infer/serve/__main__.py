"""`python -m infer.serve CHECKPOINT`: serve an HF directory or a .gguf over OpenAI's HTTP API.

    python -m infer.serve path/to/SmolLM2-135M-Instruct.Q4_1.gguf --port 8000 --max-batch 16
    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
        -d '{"model": "base", "messages": [{"role": "user", "content": "Hi"}]}'

The model is loaded with its fastest decode policy (`zoo.load_pretrained`), the engine compiles
its two step programs before the port opens, and uvicorn serves until SIGTERM or Ctrl-C, which
stop taking connections, let every request in flight finish (streams included), then exit.
"""

import argparse
import os
import sys

import uvicorn

import zoo
from infer.engine import Engine
from infer.serve.app import make_app
from shard.compile_cache import use_compile_cache
from zoo.tokenizer import content


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="an HF model directory or a .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--name", help="the model's name in the API (default: the checkpoint's)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-len", type=int, default=2048, help="prompt + new tokens per request")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before 429")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--chunk",
        type=int,
        help="prompt tokens per chunk, several chunks per step (default: the engine's)",
    )
    p.add_argument(
        "--token-budget",
        type=int,
        help="the most tokens one engine step runs: the decoding requests' next tokens, then "
        "prompt chunks (default: the engine's)",
    )
    p.add_argument("--chat-template", help="a Jinja chat template, if the checkpoint has none")
    p.add_argument(
        "--special-in-content",
        choices=content.MODES,
        default="text",
        help="a special token's text inside a chat message: encoded as plain text (default), "
        "refused (400), or kept as the token (transformers' behaviour: a client can open turns)",
    )
    p.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter served as model NAME (repeatable)",
    )
    return p.parse_args(argv)


def adapter_argument(text: str) -> tuple[str, str]:
    name, _, path = text.partition("=")
    if not name or not path:
        raise ValueError(f"--adapter takes NAME=PATH (a PEFT adapter directory), got {text!r}")
    return name, path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        tokenizer = zoo.load_tokenizer(args.checkpoint, chat_template=args.chat_template)
        model = zoo.load_pretrained(args.checkpoint)
        adapters = dict(adapter_argument(a) for a in args.adapter)
        if adapters:  # one base, the adapters applied per row (not a merged model each)
            adapted = [zoo.load_adapter(model, path) for path in adapters.values()]
            model = zoo.bank_adapters(model, adapted)
        engine = Engine(model, max_batch=args.max_batch,
                        max_len=min(args.max_len, model.config.max_seq_len),
                        page_size=args.page_size, chunk=args.chunk,
                        token_budget=args.token_budget)  # fmt: skip
    except ValueError as error:
        sys.exit(f"error: {error}")
    name = args.name or os.path.splitext(os.path.basename(os.path.normpath(args.checkpoint)))[0]
    app = make_app(
        engine, tokenizer, name=name, adapters=list(adapters), max_waiting=args.max_waiting,
        special_in_content=args.special_in_content,
    )  # fmt: skip
    print(f"serving {name} on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    use_compile_cache()  # a restarted server reads its step programs back instead of compiling
    main()
