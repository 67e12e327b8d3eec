"""The real server (uvicorn on a loopback port) driven by OpenAI's own client on a tiny random
model: chat and completions equal the engine's greedy tokens, streamed chunks concatenate to the
non-streamed text, stop strings, seeds, n, usage; the errors of bad requests."""

import json
import re

import httpx2 as httpx
import openai
import pytest

from infer.serve.protocol import error_body
from tests.infer.serve import tiny

CHAT = [{"role": "user", "content": "hello"}]


def greedy_text(prompt: list[int], n: int) -> tuple[str, list[int]]:
    """The engine's own greedy tokens for a prompt (what the server must serve: an engine of
    the server's configuration, driven directly), as text with the end-of-turn tokens hidden."""
    tokenizer, engine = tiny.tokenizer(), tiny.engine()
    request = engine.submit(prompt, max_new_tokens=n, stop_tokens=tokenizer.end_of_turn_ids)
    engine.run()
    tokens = request.tokens
    shown = [t for t in tokens if t not in tokenizer.end_of_turn_ids]
    return tokenizer.decode(shown), tokens


def test_chat_is_the_engines_greedy_continuation_of_the_template(client):
    prompt = tiny.tokenizer().apply_chat_template(CHAT, add_generation_prompt=True)
    text, tokens = greedy_text(prompt, 12)
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0
    )
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == ("stop" if len(tokens) < 12 else "length")
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(tokens)


def test_completion_of_text_and_of_token_ids(client):
    prompt = tiny.tokenizer().encode("The cat")
    text, tokens = greedy_text(prompt, 10)
    for given in ("The cat", prompt):
        reply = client.completions.create(model="base", prompt=given, max_tokens=10, temperature=0)
        assert reply.choices[0].text == text
        assert reply.usage.completion_tokens == len(tokens)


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_chunks_concatenate_to_the_whole_text(client, chat):
    settings = {"model": "tiny", "max_tokens": 24, "temperature": 0.8, "seed": 7}
    if chat:
        whole = client.chat.completions.create(messages=CHAT, **settings)
        chunks = list(client.chat.completions.create(
            messages=CHAT, stream=True, stream_options={"include_usage": True}, **settings
        ))  # fmt: skip
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        text = whole.choices[0].message.content
    else:
        whole = client.completions.create(prompt="abc", **settings)
        chunks = list(client.completions.create(
            prompt="abc", stream=True, stream_options={"include_usage": True}, **settings
        ))  # fmt: skip
        pieces = [c.choices[0].text for c in chunks if c.choices]
        text = whole.choices[0].text
    assert len(pieces) > 2 and "".join(pieces) == text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_stop_string_ends_the_text_before_it(client):
    """A stop string taken from the middle of the unconstrained text (so it spans whatever
    tokens it spans): the text ends right before its first occurrence, streamed or not."""
    full = client.completions.create(model="tiny", prompt="Hi", max_tokens=30, temperature=0)
    text = full.choices[0].text
    stop = text[10:13]
    expected = text[: text.find(stop)]
    stopped = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=30, temperature=0, stop=[stop, "never seen"]
    )
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < full.usage.completion_tokens
    streamed = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seed_repeats_a_draw_and_n_draws_distinct_choices(client):
    settings = {"model": "tiny", "prompt": "abc", "max_tokens": 16, "temperature": 1.0}
    first = client.completions.create(seed=11, n=2, **settings)
    again = client.completions.create(seed=11, n=2, **settings)
    other = client.completions.create(seed=12, **settings)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert texts[0] != texts[1] and other.choices[0].text != texts[0]
    assert [c.index for c in first.choices] == [0, 1]
    assert first.usage.completion_tokens == 32


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    health = httpx.get(server.url.removesuffix("/v1") + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def post(server, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, **kwargs)


@pytest.mark.parametrize(
    "path, body, status, message",
    [
        ("/completions", {"model": "gpt-4", "prompt": "x"}, 404,
         "model 'gpt-4' is not served here; the served models are: tiny"),
        ("/completions", {"model": "tiny", "prompt": "x" * 250, "max_tokens": 20}, 400,
         r"the prompt \(250 tokens\) \+ max_tokens \(20\) = 270 exceeds the server's max_len=256"),
        ("/completions", {"model": "tiny", "prompt": "x" * 260}, 400,
         r"the prompt \(260 tokens\) leaves no room in the server's max_len=256"),
        ("/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400,
         "invalid request: temperature: Input should be a valid number"),
        ("/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400,
         "max_tokens: Input should be greater than or equal to 1"),
        ("/completions", {"model": "tiny", "prompt": "x", "n": 5}, 400,
         "n=5 exceeds the server's limit of 4 choices"),
        ("/completions", {"model": "tiny", "prompt": [1, 999]}, 400,
         r"prompt token ids must be in \[0, 259\)"),
        ("/completions", {"model": "tiny", "prompt": ""}, 400, "the prompt is empty"),
        ("/completions", {"model": "tiny", "prompt": "x", "logit_bias": {"1": 5}}, 400,
         "logit_bias is not supported by this server"),
        ("/chat/completions", {"model": "tiny", "messages": []}, 400,
         "messages: List should have at least 1 item"),
        ("/chat/completions", {"model": "tiny"}, 400, "messages: Field required"),
        ("/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400,
         "the request body is not UTF-8 .*; send UTF-8 JSON"),
        ("/completions", b'{"model": "tiny", "prompt": ', 400,
         "the request body is not valid JSON: Expecting value: line 1 column 29"),
        ("/completions", b"[1]", 400, "body: Input should be a valid dictionary"),
        ("/completions", b"{}" + b" " * (5 << 20), 413,
         "the request body .* exceeds the server's limit of 4194304 bytes"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(server, path, body, status, message):
    response = post(server, path, body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == set(error_body("")["error"])
    assert re.search(message, error["message"]), error["message"]


def test_the_openai_client_raises_on_those_errors(client):
    with pytest.raises(openai.NotFoundError, match="served models are: tiny"):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_len=256"):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=500)
