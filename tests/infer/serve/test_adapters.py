"""Adapters per request through the server: two LoRA adapters banked on one base, requests for
either and for the base sent at once (one batch), each answered with the greedy text of its
adapter alone (the banked engine driven directly with that one request: tests/infer/
test_adapter_bank.py shows that equals the adapted model itself); the models list names them;
an unknown name is a 404 listing them."""

import concurrent.futures

import openai
import pytest

import zoo
from tests.infer.serve import tiny
from tests.infer.test_adapter_bank import adapted


def alone_text(banked, adapter: int, prompt: list[int], n: int) -> str:
    engine = tiny.engine(banked)  # the server's configuration: its compiled programs
    end = tiny.tokenizer().end_of_turn_ids
    request = engine.submit(prompt, max_new_tokens=n, stop_tokens=end, adapter=adapter)
    engine.run()
    hidden = set(tiny.tokenizer().end_of_turn_ids)
    return tiny.tokenizer().decode([t for t in request.tokens if t not in hidden])


def test_two_adapters_and_the_base_in_one_batch():
    base = tiny.model()
    models = {
        "first": adapted(base, ["q_proj", "v_proj"], rank=4, alpha=8, seed=1),
        "second": adapted(base, ["o_proj", "up_proj"], rank=2, alpha=2, seed=2),
        "base": base,
    }
    banked = zoo.bank_adapters(base, [models["first"], models["second"]])
    app = tiny.make_app(tiny.engine(banked), tiny.tokenizer(), name="tiny",
                        adapters=["first", "second"])  # fmt: skip
    running = tiny.Running(app)
    try:
        client = openai.OpenAI(base_url=running.url, api_key="-", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny", "first", "second"]
        prompt = tiny.tokenizer().encode("Once upon")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            replies = {name: pool.submit(client.completions.create, model=name, prompt=prompt,
                                         max_tokens=12, temperature=0)
                       for name in models}  # fmt: skip
            texts = {name: reply.result().choices[0].text for name, reply in replies.items()}
        for adapter, name in enumerate(["first", "second", "base"]):
            assert texts[name] == alone_text(banked, adapter if adapter < 2 else -1, prompt, 12)
        assert len(set(texts.values())) == 3
        with pytest.raises(
            openai.NotFoundError,
            match=r"served models are: tiny \(also called base\), first, second",
        ):
            client.completions.create(model="third", prompt="x")
    finally:
        running.stop()
