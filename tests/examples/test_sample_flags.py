"""examples/sample.py's flags combine as a user expects: --top-k/--top-p/--min-p sample at
temperature 1 unless --temperature is given, --temperature 0 with one of them is refused, and
every number is checked at its flag."""

import pytest

import infer
from examples.sample import make_sampler, parse_args, parser

BASE = ["--preset", "tiny-llama", "--prompt", "1,2,3"]


def sampler(*flags: str) -> infer.Sampler:
    return make_sampler(parse_args([*BASE, *flags]))


def test_filters_sample_at_temperature_one_unless_given():
    assert sampler() == infer.Greedy()
    assert sampler("--top-k", "5") == infer.TopK(k=5, temperature=1.0)  # was greedy, silently
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
        (["--top-k", "0"], "--top-k: must be a positive integer, got 0"),
        (["--top-p", "0"], "--top-p: must be a probability in (0, 1], got 0"),
        (["--top-p", "1.5"], "--top-p: must be a probability in (0, 1], got 1.5"),
        (["--min-p", "-0.1"], "--min-p: must be a number in [0, 1], got -0.1"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer, got 0"),
        (["--chunk-size", "0"], "--chunk-size: must be a positive integer, got 0"),
        (["--seed", "-1"], "--seed: must be a non-negative integer, got -1"),
        (["--stop-ids", "1,x"], "--stop-ids: must be comma-separated token ids"),
        (["--stop-ids", "-3"], "--stop-ids: token ids are non-negative"),
        (["--top-k", "5", "--top-p", "0.9"], "--top-p: not allowed with argument --top-k"),
        (["--mesh", "data=2"], "--mesh and --rules go together"),
        (["--kv-dtype", "int4"], "--kv-dtype: invalid choice: 'int4' (choose from 'float32', "
         "'bfloat16', 'float16', 'int8')"),
    ],
)  # fmt: skip
def test_bad_flags_name_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*BASE, *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_prompt_without_a_tokenizer_must_be_token_ids(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--preset", "tiny-llama", "--prompt", "Hello"])
    assert exit_.value.code == 2
    assert (
        "argument --prompt: with no tokenizer (give --tokenizer) it must be comma-separated "
        "token ids such as 0,50256, got 'Hello'" in capsys.readouterr().err
    )
