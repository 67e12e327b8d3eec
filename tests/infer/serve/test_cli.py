"""`python -m infer.serve CHECKPOINT` as a user runs it: a tiny HF checkpoint written to disk
(random weights, a byte-level tokenizer.json with a ChatML template), the server started as a
process, a chat answered through OpenAI's client, and a real SIGTERM mid-stream: the stream
still ends with its finish reason, then the process shuts down (uvicorn's graceful shutdown)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

import zoo
from tests.infer.serve import tiny


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level tokenizer.json files use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


def write_checkpoint(folder) -> None:
    zoo.save_pretrained(tiny.model(), folder)
    chars = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in tiny.SPECIALS])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": tiny.CHATML, "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_serves_and_drains_on_sigterm(tmp_path):
    folder = tmp_path / "tiny-chat"
    folder.mkdir()
    write_checkpoint(folder)
    assert zoo.load_tokenizer(folder).encode("hi<|im_end|>") == tiny.tokenizer().encode(
        "hi<|im_end|>"
    )
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "infer.serve", str(folder), "--port", str(port),
         "--max-batch", "2", "--max-len", "128", "--page-size", "8", "--chunk", "16"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "the server did not start in 300 s"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-chat"]
        reply = client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert reply.usage.completion_tokens >= 1
        stream = client.completions.create(
            model="base", prompt="a", max_tokens=100, temperature=1.0, seed=0, stream=True
        )
        chunks = [next(iter(stream))]
        server.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        # uvicorn re-raises the signal after its graceful shutdown: the status names it.
        assert server.wait(timeout=60) == -signal.SIGTERM
        assert "Finished server process" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")
