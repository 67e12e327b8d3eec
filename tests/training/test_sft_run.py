"""train.py on instruction data: the format is printed and recorded (a resume may not switch
it), the answer-token counts are printed, and chat data without a chat template is refused."""

import json

import pytest

import train
from training.args import ArgError


def _completion_data(path):
    rows = [
        {"prompt": f"Q{i % 4}: capital? ",
         "completion": "Tessaly."}
        for i in range(40)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_completion_data_trains_on_the_completions(tmp_path, tiny_argv, capsys):
    data = _completion_data(tmp_path / "qa.jsonl")
    out = tmp_path / "run"
    result = train.main(tiny_argv(out, "--seq-len", "32", data=data))
    printed = capsys.readouterr().out
    assert "data: format completion" in printed and "answer tokens counted" in printed
    assert result.val_loss is not None
    settings = json.loads((out / "run.json").read_text())["settings"]
    assert settings["data_format"] == "completion" and settings["truncate"] is False
    with pytest.raises(ArgError, match="--data-format"):
        train.main([*tiny_argv(out, data=data), "--resume", str(out), "--steps", "6",
                    "--data-format", "text"])  # fmt: skip


def test_too_long_names_the_row_and_the_flag(tmp_path, tiny_argv):
    data = _completion_data(tmp_path / "qa.jsonl")
    with pytest.raises(ValueError, match=r"row \d+ is \d+ tokens long, more than --seq-len 8.*"
                       "--truncate"):  # fmt: skip
        train.main(tiny_argv(tmp_path / "run", "--seq-len", "8", data=data))


def test_chat_data_without_a_chat_template_is_refused(tmp_path, tiny_argv):
    data = tmp_path / "chat.jsonl"
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text((json.dumps({"messages": turn}) + "\n") * 10)
    with pytest.raises(ValueError, match=r"--data-format chat: .* has none: pass --init-from"):
        train.main(tiny_argv(tmp_path / "run", data=data))
