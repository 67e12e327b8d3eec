"""Talk to `python -m infer.serve` with OpenAI's own Python client: a chat reply, the same
streamed, a completion with a stop string, and a reply that must follow a JSON schema.

    python -m infer.serve path/to/SmolLM2-135M-Instruct.Q4_1.gguf --port 8000 &
    python -m examples.client --url http://127.0.0.1:8000/v1
"""

import argparse
import json

import openai

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="base")
    args = p.parse_args(argv)
    client = openai.OpenAI(base_url=args.url, api_key="unused")
    chat = [{"role": "user", "content": "What is the capital of France?"}]

    reply = client.chat.completions.create(model=args.model, messages=chat, max_tokens=64)
    print("chat:", reply.choices[0].message.content, f"({reply.usage.completion_tokens} tokens)")

    print("streamed: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=args.model, messages=chat, max_tokens=64, stream=True
    )
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()

    done = client.completions.create(
        model=args.model, prompt="1, 2, 3, 4,", max_tokens=32, temperature=0, stop=[" 8"]
    )
    print("completion up to ' 8':", repr(done.choices[0].text))

    person = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": "Invent a person."}],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    print("JSON:", json.loads(person.choices[0].message.content))


if __name__ == "__main__":
    main()
