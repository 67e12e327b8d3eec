"""Log-probabilities through the real server and OpenAI's client: chat (`logprobs`,
`top_logprobs`) and completions (`logprobs: k`) carry the engine's own values for every shown
token, in OpenAI's shapes; streamed chunks carry the same entries as the whole response; bad
values are 400s."""

import openai
import pytest

from infer.engine import MAX_LOGPROBS
from tests.infer.serve import tiny
from tests.infer.serve.test_server import CHAT


def engine_entries(prompt: list[int], n: int, top: int):
    """What an engine of the server's configuration reports, greedy, for the shown tokens."""
    tokenizer, engine = tiny.tokenizer(), tiny.engine()
    request = engine.submit(
        prompt, max_new_tokens=n, stop_tokens=tokenizer.end_of_turn_ids, logprobs=top
    )
    engine.run()
    return [e for e in request.token_logprobs if e.token not in tokenizer.end_of_turn_ids]


def test_chat_logprobs_are_the_engines(client):
    tokenizer = tiny.tokenizer()
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    expected = engine_entries(prompt, 12, 3)
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == [e.logprob for e in expected]
    for c, e in zip(content, expected, strict=True):
        assert [t.logprob for t in c.top_logprobs] == [v for _, v in e.top]
        assert c.top_logprobs[0].logprob == c.logprob  # greedy: the most likely token
        assert bytes(c.bytes) == bytes([e.token])  # the byte-level vocabulary: token t is byte t
        if c.token.startswith("bytes:"):  # part of a character, as OpenAI writes it
            assert c.token == f"bytes:\\x{e.token:02x}"
        else:
            assert c.token == tokenizer.decode([e.token])
    shown = bytes(b for c in content for b in c.bytes).decode(errors="replace")
    assert shown == reply.choices[0].message.content
    plain = client.chat.completions.create(  # null is as good as unset
        model="tiny", messages=CHAT, max_tokens=2, extra_body={"logprobs": None}
    )
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_logprobs_are_the_whole_responses(client, chat):
    """Sampled, two choices: each choice's entries across its chunks equal the non-streamed
    response's (same seed); completions' top_logprobs hold the k most likely and the chosen."""
    settings = {"model": "tiny", "max_tokens": 16, "temperature": 1.0, "seed": 5, "n": 2}
    if chat:
        create, extra = client.chat.completions.create, {"messages": CHAT}
        extra |= {"logprobs": True, "top_logprobs": 2}
    else:
        create, extra = client.completions.create, {"prompt": "abc", "logprobs": 2}
    whole = create(**settings, **extra)
    chunks = list(create(stream=True, **settings, **extra))
    for i, choice in enumerate(whole.choices):
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].index == i]
        parts = [p for p in parts if p is not None]
        if chat:
            assert [e for p in parts for e in p.content] == choice.logprobs.content
            assert len(choice.logprobs.content) == whole.usage.completion_tokens // 2 - (
                choice.finish_reason == "stop"
            )  # the hidden end of turn has none
            continue
        logprobs = choice.logprobs
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in parts for x in getattr(p, field)] == getattr(logprobs, field)
        # Each byte token decodes to one character (itself, or U+FFFD for part of one).
        assert logprobs.text_offset == list(range(len(logprobs.tokens)))
        for token, value, top in zip(
            logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
        ):
            assert top[token] == value and len(top) in (2, 3)  # 2 most likely + the chosen
            assert value <= max(top.values())


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"top_logprobs": 3}, "top_logprobs=3 needs logprobs: true"),
        ({"logprobs": True, "top_logprobs": MAX_LOGPROBS + 1},
         "top_logprobs: Input should be less than or equal to 20"),
        ({"logprobs": "yes"}, "logprobs: Input should be a valid boolean"),
    ],
)  # fmt: skip
def test_bad_chat_logprobs_are_400s(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, **extra)


@pytest.mark.parametrize(
    "value, message",
    [
        (MAX_LOGPROBS + 1, "logprobs: Input should be less than or equal to 20"),
        (-1, "logprobs: Input should be greater than or equal to 0"),
        (True, "logprobs: Input should be a valid integer"),
    ],
)
def test_bad_completion_logprobs_are_400s(client, value, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=value)
