"""The eqx-zoo command line speaks one vocabulary: every subcommand's flags enumerated, a flag
shared by two commands means the same thing with the same default (unless the command declares
that it sets its own, shown in its --help), the old names are gone, the generating commands share
their sampling and stopping flags, and the console script is declared."""

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

from cli.commands import BY_NAME, COMMANDS
from cli.main import usage
from cli.train import finetune_defaults
from training.args import flag_name

ROOT = Path(__file__).resolve().parents[2]
PARSERS = {c.name: c.build_parser() for c in COMMANDS}
# Names the issue found split or ambiguous: one name each now (--model, --batch-size, ...).
# (--microbatches, once plan's name for --grad-accum, is now only a pipeline's micro-batch count.)
RETIRED = ("--checkpoint", "--preset", "--run", "--init-from", "--batch", "--seq",
           "--stop-ids", "--hardware")  # fmt: skip


def shown_flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        option: action
        for action in p._actions
        for option in action.option_strings
        if option.startswith("--") and action.help != argparse.SUPPRESS and option != "--help"
    }


def kind(action: argparse.Action) -> tuple:
    """What a flag accepts: its action, choices, value type and bounds (the parser of a number
    flag is a fresh closure per parser, so its name and metavar stand for it)."""
    type_name = getattr(action.type, "__name__", None)
    return (type(action).__name__, tuple(action.choices or ()), type_name, action.metavar)


FLAGS = {name: shown_flags(p) for name, p in PARSERS.items()}
SHARED = sorted({f for flags in FLAGS.values() for f in flags
                 if sum(f in other for other in FLAGS.values()) > 1})  # fmt: skip


def test_every_command_is_in_the_table_and_its_help():
    assert list(BY_NAME) == ["train", "finetune", "sample", "chat", "merge", "export",
                             "evaluate", "serve", "plan", "bench"]  # fmt: skip
    listing = " ".join(usage().split())
    for command in COMMANDS:
        assert f"{command.name} {command.summary}" in listing
        assert f"({command.duration})" in listing
        help_text = " ".join(PARSERS[command.name].format_help().split())
        assert f"expected duration: {command.duration}" in help_text


@pytest.mark.parametrize("flag", SHARED)
def test_a_shared_flag_means_one_thing_with_one_default(flag):
    users = {name: flags[flag] for name, flags in FLAGS.items() if flag in flags}
    kinds = {name: kind(action) for name, action in users.items()
             if flag not in BY_NAME[name].own_kinds}  # fmt: skip
    assert len(set(kinds.values())) == 1, f"{flag} accepts different values: {kinds}"
    plain = {name: a.default for name, a in users.items()
             if flag not in BY_NAME[name].own_defaults}  # fmt: skip
    assert len({repr(d) for d in plain.values()}) <= 1, f"{flag} has several defaults: {plain}"


def test_own_defaults_are_declared_and_shown():
    """finetune's own defaults are exactly the ones it declares, and --help shows them."""
    declared = set(BY_NAME["finetune"].own_defaults)
    assert declared == {flag_name(name) for name in finetune_defaults()}
    help_text = " ".join(PARSERS["finetune"].format_help().split())
    assert "(default: runs/finetune)" in help_text and "(default: 8)" in help_text
    train, finetune = FLAGS["train"], FLAGS["finetune"]
    assert any(train[f].default != finetune[f].default for f in declared)
    for command in COMMANDS:  # a declared flag is one the command has
        assert set(command.own_defaults) <= set(FLAGS[command.name])


def test_own_kinds_are_declared_shared_and_really_differ():
    """serve's --adapter is NAME=PATH, repeatable (each adapter served as its own model); every
    other command's is one PEFT directory added to --model. Declared, and nowhere else."""
    assert {c.name: c.own_kinds for c in COMMANDS if c.own_kinds} == {"serve": ("--adapter",)}
    serve, sample = FLAGS["serve"]["--adapter"], FLAGS["sample"]["--adapter"]
    assert kind(serve) != kind(sample) and serve.metavar == "NAME=PATH"
    assert "--adapter" in SHARED


@pytest.mark.parametrize("name", list(BY_NAME))
def test_retired_names_are_gone(name):
    assert not set(RETIRED) & set(FLAGS[name])


def test_every_command_that_takes_a_model_names_it_one_way():
    for name in ("train", "finetune", "sample", "chat", "merge", "export", "evaluate", "serve",
                 "plan"):  # fmt: skip
        assert "--model" in FLAGS[name], name
    for name in ("sample", "chat", "merge", "export", "evaluate", "serve"):  # any artifact
        assert {"--adapter", "--attention"} <= set(FLAGS[name]), name
        assert FLAGS[name]["--model"].help == FLAGS["sample"]["--model"].help, name
    assert {"--batch-size", "--seq-len", "--grad-accum"} <= set(FLAGS["plan"]) & set(FLAGS["train"])


def test_sample_and_chat_share_their_generation_flags():
    generation = {"--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--max-new-tokens",
                  "--stop"}  # fmt: skip
    assert generation <= set(FLAGS["sample"]) and generation <= set(FLAGS["chat"])
    assert FLAGS["sample"]["--max-new-tokens"].default == FLAGS["chat"]["--max-new-tokens"].default


def test_the_console_script_is_declared_and_packaged():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = project["project"]["scripts"]["eqx-zoo"]
    module, function = target.split(":")
    assert callable(getattr(importlib.import_module(module), function))
    setuptools = project["tool"]["setuptools"]
    assert "train" in setuptools["py-modules"]  # the loop `train` and `finetune` run
    assert {"cli*", "examples*"} <= set(setuptools["packages"]["find"]["include"])
    assert "data/*.jsonl" in setuptools["package-data"]["examples"]  # finetune's default data
