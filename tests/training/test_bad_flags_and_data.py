"""The issue's reproductions through train.py itself: a bad number exits as argparse does
(status 2, the flag named) before any work; a bad data file names the file, the line and what
to do, before a model is built."""

import pytest

import train


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--steps", "0", "must be a positive integer, got 0"),  # exited 0, trained nothing
        ("--lr", "-1", "must be a positive finite number, got -1"),  # trained, exit 0
        ("--batch-size", "-2", "must be a positive integer, got -2"),  # trained / numpy error
        ("--batch-size", "0", "must be a positive integer, got 0"),  # ZeroDivisionError
        ("--grad-accum", "0", "must be a positive integer, got 0"),  # ZeroDivisionError
        ("--eval-batches", "0", "must be a positive integer, got 0"),  # ZeroDivisionError
        ("--checkpoint-every", "0", "must be a positive integer, got 0"),  # after compiling
        ("--seed", "-1", "must be a non-negative integer, got -1"),  # numpy error
        ("--grad-accum", "3", "--batch-size 4 is not divisible by --grad-accum 3"),
    ],
)
def test_bad_number_exits_2_naming_the_flag(tmp_path, tiny_argv, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        train.main([*tiny_argv(tmp_path / "run"), flag, value])
    assert exit_.value.code == 2
    assert f"error: argument {flag}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was made


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty (0 bytes)"),
        (b"\x7fELF\x02\x01\x01\x00", "is not text: it holds a NUL byte"),
        (b'{"text": "a"}\n{"text": "b\n', "line 2 is not valid JSON"),
        (b'{"text": "a"}\n{"text": null}\n', "line 2 has 'text': null, not a string"),
    ],
)
def test_bad_data_file_names_file_and_line(tmp_path, tiny_argv, content, message):
    data = tmp_path / "corpus.jsonl"
    data.write_bytes(content)
    with pytest.raises(ValueError) as error:
        train.main(tiny_argv(tmp_path / "run", data=data))
    assert str(error.value).startswith(f"--data {str(data)!r}: ") and message in str(error.value)
