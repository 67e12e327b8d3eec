"""chat's --draft and --mtp: with a draft model (in int8), its head cut to a draft vocabulary or
not, or with a multi-token-prediction module saved for the model, the reply is the one chat
gives without it (greedy; whether the adaptive engine verifies depends on its measured step
costs, which the engine's own tests fix), a broken vocabulary file is refused, and two
proposers at once are refused."""

import json

import equinox as eqx
import jax
import pytest

import zoo
from cli import chat
from infer.speculative.draft import DRAFT_VOCAB
from tests.cli.test_chat_limits import tiny_model  # noqa: F401 (a fixture)


def test_a_draft_model_gives_the_plain_reply(tiny_model, tmp_path):  # noqa: F811
    turn = ["--model", "tiny", "--max-len", "64", "--max-new-tokens", "8", "--message", "abc"]
    (plain,) = chat.main(turn)
    (drafted,) = chat.main([*turn, "--draft", "tiny", "--draft-k", "3"])
    assert drafted.request.tokens == plain.request.tokens
    # A draft directory with a vocabulary (the load itself is the fixture's tiny model).
    (tmp_path / DRAFT_VOCAB).write_text(json.dumps(list(range(0, 300, 2))))
    (cut,) = chat.main([*turn, "--draft", str(tmp_path), "--draft-k", "3"])
    assert cut.request.tokens == plain.request.tokens
    (tmp_path / DRAFT_VOCAB).write_text("[1, 2")
    with pytest.raises(ValueError, match=f"{DRAFT_VOCAB} is not a JSON list of token ids"):
        chat.main([*turn, "--draft", str(tmp_path)])


def test_two_proposers_are_refused(tiny_model, capsys):  # noqa: F811
    with pytest.raises(SystemExit):
        chat.main(["--model", "tiny", "--draft", "tiny", "--prompt-lookup", "4", "--message", "a"])
    assert "--draft and --prompt-lookup are proposers of drafts: give one" in (
        capsys.readouterr().err
    )


def test_a_saved_mtp_module_gives_the_plain_reply(tiny_model, tmp_path):  # noqa: F811
    module = zoo.MTP(tiny_model.config, policy=tiny_model.policy, key=jax.random.key(3))
    module = eqx.tree_at(
        lambda m: (m.body.embed, m.body.lm_head), module, (tiny_model.embed, tiny_model.lm_head),
        is_leaf=lambda x: x is None,
    )  # fmt: skip
    zoo.save_mtp(tiny_model.with_mtp(module), tmp_path / "mtp.safetensors")
    (tmp_path / DRAFT_VOCAB).write_text(json.dumps(list(range(0, 300, 2))))
    turn = ["--model", "tiny", "--max-len", "64", "--max-new-tokens", "8", "--message", "abc"]
    (plain,) = chat.main(turn)
    (drafted,) = chat.main([*turn, "--mtp", str(tmp_path / "mtp.safetensors"), "--draft-k", "2"])
    assert drafted.request.tokens == plain.request.tokens
    assert drafted.request.drafted > 0  # the module drafted (every step verifies)
