"""The CLI: --help lists every setting; a config file sets defaults that flags override; every
number is checked at its flag (or its config key), settings that must agree are checked
together, and the error is argparse's: exit status 2, the flag named."""

import dataclasses
import json
import re

import pytest

import train
from training.args import (
    ArgError,
    Args,
    _flag_type,
    bounds_of,
    check,
    check_batch_shards,
    parse_args,
    parser,
)


def fails(argv: list[str], capsys) -> str:
    """The argparse error line of `parse_args(argv)` (which must exit with status 2)."""
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_help_lists_every_setting():
    text = parser().format_help()
    for field in dataclasses.fields(Args):
        assert f"--{field.name.replace('_', '-')}" in text


def test_every_number_has_bounds():
    """A numeric field without bounds cannot become a flag: the parser refuses to build."""
    for field in dataclasses.fields(Args):
        if field.type in (int, float, int | None, float | None):
            assert bounds_of(field) is not None, field.name

    @dataclasses.dataclass
    class New:
        count: int = dataclasses.field(default=1, metadata={"help": "a new setting"})

    with pytest.raises(TypeError, match=r"Args.count: a number needs bounds"):
        _flag_type(dataclasses.fields(New)[0], int)


def test_config_file_then_flags(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"steps": 7, "lr": 0.5, "model": "tiny-gpt2"}))
    args = parse_args(["--config", str(config), "--lr", "0.25", "--override", "n_layers=1"])
    assert (args.steps, args.lr, args.model, args.override) == (
        7,
        0.25,
        "tiny-gpt2",
        ["n_layers=1"],
    )
    toml = tmp_path / "run.toml"
    toml.write_text('schedule = "wsd"\nprogress = false\n')
    args = parse_args(["--config", str(toml)])
    assert args.schedule == "wsd" and args.progress is False


# The reproductions of the issue ("silent wrong results", "deep tracebacks") and their kin.
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
        (["--lr", "-1"], "argument --lr: must be a positive finite number, got -1"),
        (["--lr", "nan"], "argument --lr: must be a positive finite number, got nan"),
        (["--lr", "1e400"], "argument --lr: must be a positive finite number, got 1e400"),
        (["--batch-size", "-2"], "argument --batch-size: must be a positive integer, got -2"),
        (["--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
        (["--grad-accum", "0"], "argument --grad-accum: must be a positive integer, got 0"),
        (["--eval-batches", "0"], "argument --eval-batches: must be a positive integer, got 0"),
        (["--eval-every", "0"], "argument --eval-every: must be a positive integer, got 0"),
        (["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
        (
            ["--checkpoint-every", "0"],
            "argument --checkpoint-every: must be a positive integer, got 0",
        ),
        (["--keep", "0"], "argument --keep: must be a positive integer, got 0"),
        (["--seq-len", "-1"], "argument --seq-len: must be a positive integer, got -1"),
        (["--steps", "1.5"], "argument --steps: must be a positive integer, got '1.5'"),
        (["--warmup", "-1"], "argument --warmup: must be a non-negative integer, got -1"),
        (["--seed", "-1"], "argument --seed: must be a non-negative integer, got -1"),
        (["--seed", str(2**64)], f"argument --seed: must be at most {2**63 - 1}"),
        (["--steps", str(10**12)], "argument --steps: must be at most 2147483647"),
        (["--vocab-size", "0"], "argument --vocab-size: must be an integer of at least 257"),
        (["--vocab-size", str(10**11)], "argument --vocab-size: must be at most 1048576"),
        (["--clip", "-1"], "argument --clip: must be a non-negative finite number, got -1"),
        (["--weight-decay", "-0.1"], "argument --weight-decay: must be a non-negative finite"),
        (["--min-lr-ratio", "2"], "argument --min-lr-ratio: must be a number in [0, 1], got 2"),
        (["--val-fraction", "0"], "argument --val-fraction: must be a number in (0, 1), got 0"),
        (["--val-fraction", "1"], "argument --val-fraction: must be a number in (0, 1), got 1"),
        (["--peak-flops", "-1"], "argument --peak-flops: must be a non-negative finite number"),
        (["--peak-flops", "inf"], "argument --peak-flops: must be a non-negative finite number"),
    ],
)
def test_bad_number_names_its_flag(argv, message, capsys):
    line = fails(argv, capsys)
    assert line.startswith(f"{parser().prog}: error: {message}")


def test_settings_that_must_agree(capsys):
    line = fails(["--batch-size", "4", "--grad-accum", "3"], capsys)
    assert "argument --grad-accum: --batch-size 4 is not divisible by --grad-accum 3" in line
    line = fails(["--steps", "10", "--warmup", "11"], capsys)
    assert "argument --warmup: 11 is more than --steps 10" in line
    line = fails(["--peak-flops", "1e12"], capsys)
    assert "argument --peak-bandwidth: --peak-flops is given, so --peak-bandwidth is needed" in line
    line = fails(["--peak-bandwidth", "1e12"], capsys)
    assert "argument --peak-flops: --peak-bandwidth is given" in line
    # Processes: an id beyond the count, a coordinator that is not HOST:PORT (both before any
    # attempt to connect).
    for argv, message in [
        (["--num-processes", "2", "--process-id", "2"], "--process-id: 2 is not below "
         "--num-processes 2: the processes are numbered 0 .. 1"),
        (["--coordinator", "host0"], "--coordinator: 'host0' is not HOST:PORT"),
        (["--coordinator", "host0:99999"], "--coordinator: 'host0:99999' is not HOST:PORT"),
    ]:  # fmt: skip
        assert f"argument {message}" in fails(argv, capsys)
    # The default warm-up fits a short run; an explicit one is kept.
    assert parse_args(["--steps", "10"]).warmup == 10
    assert parse_args([]).warmup == 30
    assert parse_args(["--steps", "10", "--warmup", "0"]).warmup == 0


def test_args_in_python_are_checked_too():
    """`Args(...)` (a run started from Python) is held to what the CLI accepts."""
    with pytest.raises(ArgError, match="argument --batch-size: must be a positive integer"):
        Args(batch_size=0)
    with pytest.raises(ArgError, match="argument --lr: must be a positive finite number"):
        Args(lr=float("nan"))
    with pytest.raises(ArgError, match="argument --grad-accum: --batch-size 6 is not divisible"):
        Args(batch_size=6, grad_accum=4)
    args = Args(steps=4)
    assert args.warmup == 4
    args.grad_accum = 3  # changed after the fact: check() says so
    with pytest.raises(ArgError, match="not divisible"):
        check(args)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"steps": -2}', "'steps' (--steps) must be a positive integer, got -2"),
        ('{"steps": "10"}', "'steps' (--steps) must be a positive integer, got the string"),
        ('{"steps": 2.5}', "'steps' (--steps) must be a positive integer, got 2.5"),
        ('{"steps": true}', "'steps' (--steps) must be a positive integer, got true"),
        ('{"lr": NaN}', "'lr' (--lr) must be a positive finite number, got NaN"),
        ('{"schedule": "linear"}', "'schedule' (--schedule) must be one of ['cosine', 'wsd']"),
        ('{"progress": 1}', "'progress' (--progress) must be true or false, got 1"),
        ('{"override": "n_layers=2"}', "'override' (--override) must be a list of strings"),
        ('{"data": 5}', "'data' (--data) must be a string, got 5"),
        ('{"stepz": 3}', "unknown settings ['stepz']"),
        ('{"steps": 3,}', "is not valid JSON (or name it .toml): Expecting property name"),
        ("[1, 2]", "must hold an object of settings"),
    ],
)
def test_bad_config_value_names_file_and_key(tmp_path, text, message, capsys):
    config = tmp_path / "run.json"
    config.write_text(text)
    line = fails(["--config", str(config)], capsys)
    assert f"error: --config {str(config)!r}" in line and message in line


def test_bad_config_file(tmp_path, capsys):
    assert "does not exist" in fails(["--config", str(tmp_path / "none.json")], capsys)
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 3\nsteps = 4\n")
    assert "is not valid TOML: Cannot overwrite a value (at line 2" in fails(
        ["--config", str(toml)], capsys
    )
    binary = tmp_path / "run.json"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "is not UTF-8 text" in fails(["--config", str(binary)], capsys)
    # A config's value is checked against the flags given with it.
    toml.write_text("warmup = 50\n")
    assert "argument --warmup: 50 is more than --steps 10" in fails(
        ["--config", str(toml), "--steps", "10"], capsys
    )


def test_lora_settings_without_a_lora_rank_are_refused(capsys):
    """--lora-targets (any name, known or not) names what a LoRA run adapts: without
    --lora-rank it used to start a full fine-tune without a word."""
    for targets in ("wq", "q_proj,v_proj"):
        line = fails(["--lora-targets", targets], capsys)
        assert f"argument --lora-targets: {targets!r} names projections to adapt" in line
        assert "give --lora-rank too, or drop --lora-targets" in line
    assert parse_args(["--lora-rank", "4"]).lora_targets.split(",")[:2] == ["q_proj", "k_proj"]
    assert parse_args(["--lora-rank", "4", "--lora-targets", "wq"]).lora_targets == "wq"
    assert parse_args([]).lora_targets is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "data=8", "--batch-size", "4"], "argument --batch-size: 4 does not split "
         "evenly over the 8 devices that --mesh data=8 (rules default) gives the batch: give a "
         "--batch-size that is a multiple of 8"),
        (["--mesh", "fsdp=4,tensor=2", "--batch-size", "12", "--grad-accum", "6"], "argument "
         "--batch-size: 12 in --grad-accum 6 parts of 2 does not split evenly over the 4 devices "
         "that --mesh fsdp=4,tensor=2 (rules default) gives the batch: give a --batch-size that "
         "is a multiple of 24"),
        (["--mesh", "data=2,tensor=4", "--batch-size", "3"], "argument --batch-size: 3 does not "
         "split evenly over the 2 devices"),
    ],
)  # fmt: skip
def test_a_mesh_that_does_not_divide_the_batch_is_named(argv, message, tmp_path, tiny_argv):
    """Before any data, tokenizer or model: it used to be XLA's sharding error after them."""
    with pytest.raises(ArgError) as error:
        check_batch_shards(parse_args(argv))
    assert message in str(error.value)
    with pytest.raises(ArgError, match=re.escape(message)):
        train.main(tiny_argv(tmp_path / "run", *argv, "--data", "/does/not/exist"))
    assert not (tmp_path / "run").exists()
    check_batch_shards(parse_args(["--mesh", "data=2,tensor=4", "--batch-size", "4"]))


def test_a_bad_mesh_is_a_flag_error(capsys):
    assert "argument --mesh: bad mesh entry 'data8'" in fails(["--mesh", "data8"], capsys)
    assert "argument --mesh: unknown mesh axis 'model'" in fails(["--mesh", "model=8"], capsys)


def test_a_checkpoint_to_start_from_must_be_one(tmp_path, capsys):
    """--model / --init-from a missing path, a file that is no checkpoint or a bare directory:
    named at the flag (they used to reach tiktoken: "Unknown encoding", "Error parsing line")."""
    random_file = tmp_path / "notes.txt"
    random_file.write_text("vm\n")
    for flag in ("--model", "--init-from"):
        line = fails([flag, str(tmp_path / "missing")], capsys)
        assert f"argument {flag}: {str(tmp_path / 'missing')!r} is neither a zoo preset (" in line
        line = fails([flag, str(random_file)], capsys)
        assert f"argument {flag}: {str(random_file)!r} is none of: a zoo preset name, an HF" in line
        assert "a .gguf file or a train.py run directory" in line
        line = fails([flag, str(tmp_path)], capsys)
        assert f"argument {flag}: {str(tmp_path)!r} is a directory but none of" in line
    line = fails(["--init-from", "tiny-llama"], capsys)
    assert "argument --init-from: 'tiny-llama' is a zoo preset, not a checkpoint" in line
