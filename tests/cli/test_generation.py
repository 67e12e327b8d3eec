"""sample and chat's generation flags combine as a user expects (--top-k/--top-p/--min-p sample
at temperature 1 unless --temperature is given; every number checked at its flag), and a reply
stops where the model says stop (its stop ids) or at a stop text, on a real engine."""

import dataclasses

import jax
import pytest

import infer
import zoo
from cli import stream
from cli.flags import sampler as make_sampler
from cli.sample import main as sample_main
from cli.sample import parse_args, parser
from data.tokenizers import train_bpe

BASE = ["--model", "tiny-llama", "--prompt", "1,2,3"]


def sampler(*flags: str) -> infer.Sampler:
    return make_sampler(parse_args([*BASE, *flags]))


def test_filters_sample_at_temperature_one_unless_given():
    assert sampler() == infer.Greedy()
    assert sampler("--top-k", "5") == infer.TopK(k=5, temperature=1.0)
    assert sampler("--top-p", "0.9") == infer.TopP(p=0.9, temperature=1.0)
    assert sampler("--min-p", "0.1") == infer.MinP(p=0.1, temperature=1.0)
    assert sampler("--top-k", "5", "--temperature", "0.7") == infer.TopK(k=5, temperature=0.7)
    assert sampler("--temperature", "0.7") == infer.Temperature(temperature=0.7)
    assert sampler("--temperature", "0") == infer.Greedy()
    assert "or 1 with --top-k, --top-p or --min-p" in " ".join(parser().format_help().split())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "0", "--top-k", "5"], "--temperature: 0 means greedy, which would "
         "ignore --top-k 5"),
        (["--temperature", "0", "--top-p", "0.9"], "would ignore --top-p 0.9"),
        (["--temperature", "-1"], "--temperature: must be a non-negative finite number, got -1"),
        (["--temperature", "nan"], "--temperature: must be a non-negative finite number"),
        (["--temperature", "inf"], "--temperature: must be a non-negative finite number, got "
         "inf"),
        (["--top-k", "0"], "--top-k: must be a positive integer, got 0"),
        (["--top-p", "0"], "--top-p: must be a probability in (0, 1], got 0"),
        (["--top-p", "1.5"], "--top-p: must be a probability in (0, 1], got 1.5"),
        (["--min-p", "-0.1"], "--min-p: must be a number in [0, 1], got -0.1"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer, got 0"),
        (["--seed", "-1"], "--seed: must be a non-negative integer, got -1"),
        (["--stop", ""], "--stop: an empty text would stop at once"),
        (["--top-k", "5", "--top-p", "0.9"], "--top-p: not allowed with argument --top-k"),
        (["--attention", "fast"], "--attention: invalid choice: 'fast'"),
        (["--kv-dtype", "int4"], "--kv-dtype: invalid choice: 'int4' (choose from 'float32', "
         "'bfloat16', 'float16', 'int8')"),
    ],
)  # fmt: skip
def test_bad_flags_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*BASE, *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_prompt_without_a_tokenizer_must_be_token_ids(capsys):
    with pytest.raises(SystemExit) as exit_:
        sample_main(["--model", "tiny-llama", "--prompt", "Hello"])
    assert exit_.value.code == 2
    assert (
        "argument --prompt: with no tokenizer it must be comma-separated token ids such as "
        "0,50256, got 'Hello'" in capsys.readouterr().err
    )


@pytest.fixture(scope="module")
def engine_and_tokenizer():
    texts = ["the quick brown fox jumps over the lazy dog; " * 4, "abc 123 def 456"] * 10
    tokenizer = zoo.from_tiktoken(train_bpe(texts, 300, name="tiny"))
    config = zoo.preset("tiny-llama", vocab_size=tokenizer.vocab_size)
    model = zoo.Transformer(config, key=jax.random.key(3))
    return infer.Engine(model, max_batch=1, max_len=64), tokenizer


def run(engine, tokenizer, **kwargs) -> tuple[stream.Reply, str]:
    written = []
    reply = stream.reply(
        engine, tokenizer, tokenizer.encode("the quick"), max_new_tokens=12,
        sampler=infer.Greedy(), write=written.append, **kwargs,
    )  # fmt: skip
    return reply, "".join(written)


def test_a_reply_stops_at_a_stop_text_and_shows_nothing_after_it(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    full, shown = run(engine, tokenizer)
    assert full.stopped_by == "length" and len(full.request.tokens) == 12 and shown == full.text
    assert len(full.text) >= 8  # room for a stop text inside it
    stop = full.text[4:7]
    cut, shown = run(engine, tokenizer, stop_texts=[stop])
    assert cut.stopped_by == "stop text"
    assert cut.text == shown == full.text[: full.text.find(stop)]
    assert len(cut.request.tokens) < 12  # the request ended there: no tokens wasted after it
    assert not any(engine.rows)  # its row was freed


def test_a_reply_stops_at_the_models_stop_ids(engine_and_tokenizer):
    engine, tokenizer = engine_and_tokenizer
    full, _ = run(engine, tokenizer)
    third = full.request.tokens[2]
    stopping = dataclasses.replace(tokenizer, eos_ids=(third,))
    assert third in stopping.stop_ids()
    ended, shown = run(engine, stopping)
    assert ended.stopped_by == "stop token" and ended.request.tokens[-1] == third
    assert ended.request.tokens == full.request.tokens[: full.request.tokens.index(third) + 1]
    assert ended.text == shown == tokenizer.decode([t for t in ended.request.tokens if t != third])
