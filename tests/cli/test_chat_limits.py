"""chat's lengths (issue 26): a --max-len past the model's max_seq_len is refused naming both
numbers (it was cut to it silently), and a message that leaves no room for a reply is not sent:
the chat says so and goes on (it ended with a traceback)."""

import dataclasses

import jax
import pytest

import zoo
from cli import chat
from data.tokenizers import train_bpe
from training.artifacts import Artifact

TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def tiny_model(monkeypatch):
    """`--model tiny` loads a tiny Llama (max_seq_len 128) with a BPE tokenizer and a template."""
    texts = ["the quick brown fox jumps over the lazy dog; " * 4, "abc 123 def 456"] * 10
    tokenizer = zoo.from_tiktoken(train_bpe(texts, 300, name="tiny"))
    tokenizer = dataclasses.replace(tokenizer, chat_template=TEMPLATE)
    config = zoo.preset("tiny-llama", vocab_size=tokenizer.vocab_size, n_layers=1)
    model = zoo.Transformer(config, key=jax.random.key(0))
    artifact = Artifact(model, tokenizer, "preset", "tiny")
    monkeypatch.setattr(chat, "load_artifact", lambda *args, **kwargs: artifact)
    return model


def test_a_max_len_past_the_models_is_refused_naming_both(tiny_model):
    assert tiny_model.config.max_seq_len == 128
    with pytest.raises(
        ValueError,
        match=r"--max-len 100000 is more than the model's max_seq_len "
        r"128 \(it has no positions past it\): give --max-len 128 or less",
    ):
        chat.main(["--model", "tiny", "--max-len", "100000", "--message", "hi"])


def test_an_over_long_message_is_not_sent_and_the_chat_goes_on(tiny_model, capsys):
    long = "the quick brown fox jumps over the lazy dog " * 20
    replies = chat.main(["--model", "tiny", "--max-len", "64", "--max-new-tokens", "3",
                         "--message", long, "--message", "abc"])  # fmt: skip
    out = capsys.readouterr().out
    assert "(not sent: with this message the conversation is " in out
    assert (
        "tokens, and the chat holds 64 (--max-len) with room for the reply; send a shorter" in out
    )
    (reply,) = replies  # the second turn was answered, on a conversation without the first
    assert len(reply.request.prompt) < 20 and reply.request.tokens
