"""The CLI: --help lists every setting; a config file sets defaults that flags override."""

import dataclasses
import json

import pytest

from training.args import Args, parse_args, parser


def test_help_lists_every_setting():
    text = parser().format_help()
    for field in dataclasses.fields(Args):
        assert f"--{field.name.replace('_', '-')}" in text


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


def test_bad_config_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        parse_args(["--config", str(tmp_path / "none.json")])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"stepz": 3}))
    with pytest.raises(ValueError, match="unknown settings \\['stepz'\\]"):
        parse_args(["--config", str(bad)])
