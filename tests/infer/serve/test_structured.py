"""Structured output through the real server: JSON-schema and regex outputs of a random model
always parse and validate (the mask is applied on the device inside the engine's step), greedy
and sampled, streamed or not; a schema llguidance refuses is a 400 with its message; nothing
recompiles."""

import concurrent.futures
import json
import re

import jsonschema
import openai
import pytest

from infer.engine import TRACES

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
CHAT = [{"role": "user", "content": "a person, as JSON"}]


def test_json_schema_output_validates(client):
    before = dict(TRACES)  # the server's engine compiled its programs when it started
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        reply = client.chat.completions.create(
            model="tiny", messages=CHAT, response_format=FORMAT, max_tokens=150,
            temperature=temperature, seed=seed, n=2,
        )  # fmt: skip
        for choice in reply.choices:
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            assert choice.finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="tiny", messages=CHAT, response_format=FORMAT, max_tokens=150, temperature=1.0,
        seed=1, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert dict(TRACES) == before


def test_a_free_row_beside_constrained_ones_is_unchanged(client):
    """The mask is per row: an unconstrained request's greedy text is the same alone and
    sharing the batch with constrained ones (sent at the same time)."""
    plain = {"model": "tiny", "prompt": "xyz", "max_tokens": 40, "temperature": 0}
    alone = client.completions.create(**plain).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        constrained = [
            pool.submit(
                client.chat.completions.create, model="tiny", messages=CHAT, max_tokens=150,
                response_format=FORMAT, temperature=1.0, seed=seed,
            )
            for seed in (3, 4)
        ]  # fmt: skip
        beside = pool.submit(client.completions.create, **plain)
        assert beside.result().choices[0].text == alone
        for reply in constrained:
            jsonschema.validate(json.loads(reply.result().choices[0].message.content), SCHEMA)


def test_regex_and_lark_grammars(client):
    reply = client.completions.create(
        model="tiny", prompt="code:", max_tokens=20, temperature=1.0, seed=5, n=3,
        extra_body={"guided_regex": r"[a-c]{3}-\d{2}"},
    )  # fmt: skip
    for choice in reply.choices:
        assert re.fullmatch(r"[a-c]{3}-\d{2}", choice.text)
    lark = 'start: ("yes" | "no") " " NUMBER\nNUMBER: /[0-9]{1,3}/'
    reply = client.completions.create(
        model="tiny", prompt="answer:", max_tokens=20, temperature=1.0, seed=6,
        extra_body={"guided_grammar": lark},
    )  # fmt: skip
    assert re.fullmatch(r"(yes|no) [0-9]{1,3}", reply.choices[0].text)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
         "the output constraint was refused: .*nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "json_schema needs"),
        ({"response_format": {"type": "yaml"}}, "response_format type 'yaml' is not one of"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "the output constraint was refused"),
        ({"extra_body": {"guided_regex": "a", "guided_grammar": "start: \"a\""}},
         "give one output constraint, got regex and lark"),
    ],
)  # fmt: skip
def test_refused_constraints_are_400s(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, **extra)
