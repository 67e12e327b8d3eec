"""A tiny served model for the server tests: a byte-level tokenizer (256 byte tokens and three
ChatML specials, vocabulary 259) with a ChatML template, a random 2-layer Llama over it, and the
real server (uvicorn on a loopback port, in a thread) around an engine of 4 rows."""

import contextlib
import dataclasses
import socket
import threading
import time

import jax
import uvicorn

import zoo
from infer.engine import Engine
from infer.serve import make_app
from zoo.tokenizer.load import from_tiktoken_ranks

SPECIALS = {"<|im_start|>": 256, "<|im_end|>": 257, "<|endoftext|>": 258}
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONFIG = zoo.preset("tiny-llama", n_layers=2, max_seq_len=256, vocab_size=259)


def tokenizer(chat_template: str | None = CHATML) -> zoo.Tokenizer:
    ranks = {bytes([i]): i for i in range(256)}
    base = from_tiktoken_ranks(ranks, r"[^\s]+|\s+", SPECIALS, "the tiny test tokenizer")
    return dataclasses.replace(
        base, named_tokens={"eos_token": "<|endoftext|>"}, chat_template=chat_template
    )


def model() -> zoo.Transformer:
    policy = zoo.Policy(storage="unrolled")
    return zoo.Transformer(CONFIG, policy=policy, key=jax.random.key(3))


def engine(served: zoo.Transformer | None = None, **kwargs) -> Engine:
    """An engine of the test server's configuration over `served` (default: `model()`)."""
    settings = {"max_batch": 4, "max_len": 256, "page_size": 8, "chunk": 16, **kwargs}
    return Engine(served or model(), **settings)


class Running:
    """uvicorn serving `app` on a free loopback port in a thread; `url` is its /v1."""

    def __init__(self, app):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


@contextlib.contextmanager
def serving(**engine_kwargs):
    running = Running(make_app(engine(**engine_kwargs), tokenizer(), name="tiny", max_waiting=16))
    try:
        yield running
    finally:
        running.stop()
