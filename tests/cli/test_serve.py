"""`eqx-zoo serve`: any model artifact (`--model`, as every command names one) served over the
HTTP API with its `--adapter NAME=PATH` adapters, each answered as its own model; a bad adapter
argument, a repeated name and a --max-len past the model's are refused before the engine is
built."""

import openai
import pytest

import zoo
from cli.serve import build
from tests.infer.serve import tiny
from tests.infer.serve.test_cli import write_checkpoint
from tests.infer.test_adapter_bank import adapted

# A small engine: two rows of 64 tokens.
ENGINE = ["--max-batch", "2", "--max-len", "64", "--page-size", "8", "--chunk", "16"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "tiny-chat"
    folder.mkdir()
    write_checkpoint(folder)
    adapter = folder.parent / "adapter"
    zoo.save_adapter(adapted(tiny.model(), ["q_proj", "v_proj"], rank=2, alpha=4, seed=1), adapter)
    return folder, adapter


def test_a_checkpoint_and_its_adapter_are_served_by_name(checkpoint):
    folder, adapter = checkpoint
    app, args = build(["--model", str(folder), "--adapter", f"brief={adapter}", *ENGINE])
    assert args.name == "tiny-chat"
    running = tiny.Running(app)
    try:
        client = openai.OpenAI(base_url=running.url, api_key="-", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-chat", "brief"]
        for model in ("brief", "base"):
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert reply.usage.completion_tokens >= 1
    finally:
        running.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--adapter", "brief"], "argument --adapter: must be NAME=PATH (a PEFT adapter "
         "directory, served as model NAME), got 'brief'"),
        (["--adapter", "a=x", "--adapter", "a=y"], "argument --adapter: each NAME may be given "
         "once"),
        (["--port", "0"], "argument --port: must be a port number, 1 to 65535, got 0"),
        (["--max-batch", "0"], "argument --max-batch: must be a positive integer, got 0"),
    ],
)  # fmt: skip
def test_bad_flags_are_named(checkpoint, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        build(["--model", str(checkpoint[0]), *flags])
    assert exit_.value.code == 2
    assert f"eqx-zoo serve: error: {message}" in capsys.readouterr().err


def test_a_max_len_past_the_models_is_refused_naming_both(checkpoint):
    with pytest.raises(
        ValueError,
        match=r"--max-len 100000 is more than the model's max_seq_len "
        r"256 \(it has no positions past it\): give --max-len 256 or less",
    ):
        build(["--model", str(checkpoint[0]), "--max-len", "100000"])
