"""Checkpoint tokenizers converted to tiktoken give the reference tokenizer's ids (HF
`tokenizers` on the tokenizer.json transformers derives from the SmolLM2 GGUF), and refuse the
vocabularies tiktoken would encode differently."""

import json

import gguf
import pytest

from tests.reference.runner import smollm2_gguf
from tests.reference.smollm2 import TEXTS, smollm2_reference  # noqa: F401
from zoo.tokenizer import load_tokenizer

pytestmark = pytest.mark.xdist_group("smollm2")


def encode_all(tokenizer, texts):
    return [tokenizer.encode(t) for t in texts]


def test_gguf_tokenizer_matches_reference(smollm2_reference):  # noqa: F811
    tokenizer = load_tokenizer(smollm2_gguf())
    assert encode_all(tokenizer, TEXTS) == smollm2_reference["ids"]["smollm"]
    assert [tokenizer.decode(ids) for ids in encode_all(tokenizer, TEXTS)] == TEXTS


@pytest.mark.parametrize("variant", ["smollm", "plain"])
def test_tokenizer_json_matches_reference(smollm2_reference, variant):  # noqa: F811
    """smollm: Digits + ByteLevel pre-tokenizer (SmolLM2's own); plain: ByteLevel only (GPT-2's
    regex, as transformers' GGUF conversion writes it)."""
    tokenizer = load_tokenizer(smollm2_reference["dir"] / variant / "tokenizer.json")
    assert encode_all(tokenizer, TEXTS) == smollm2_reference["ids"][variant]


def test_the_two_pretokenizers_differ_on_this_text(smollm2_reference):  # noqa: F811
    # Otherwise the test above could not tell the regexes apart.
    assert smollm2_reference["ids"]["smollm"] != smollm2_reference["ids"]["plain"]


def test_special_tokens_are_the_gguf_control_tokens():
    tokenizer = load_tokenizer(smollm2_gguf())
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(tokenizer.special_tokens)
    assert tokenizer.special_tokens["<|im_start|>"] == 1
    assert tokenizer.encode("<|im_start|>") == [1]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


VOCAB, MERGES = {"a": 0, "b": 1, "c": 2}, ["a b", "b c"]


def byte_level_json(**changes) -> dict:
    """A tiny valid byte-level BPE tokenizer.json (a, b, c, ab, bc), with changes."""
    spec = {
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
        "model": {"type": "BPE", "vocab": VOCAB | {"ab": 3, "bc": 4}, "merges": MERGES},
    }
    return spec | changes


def test_tiny_tokenizer_json_converts(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_json()))
    assert load_tokenizer(tmp_path).encode("abcab") == [3, 2, 3]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": {"type": "Unigram", "vocab": []}}, "not byte-level BPE"),
        ({"pre_tokenizer": {"type": "Metaspace"}}, "pre_tokenizer .*Metaspace.* is not supported"),
        ({"normalizer": {"type": "NFC"}}, r"a normalizer \(NFC\) is not supported"),
        (
            # HF would split "abc" as ab|c (first merge first), tiktoken as a|bc (lower id).
            {"model": {"type": "BPE", "vocab": VOCAB | {"ab": 4, "bc": 3}, "merges": MERGES}},
            "ids grow with merge order",
        ),
        (
            {"added_tokens": [{"id": 5, "content": "<m>", "lstrip": True, "special": True}]},
            "added token '<m>' has lstrip=true, which tiktoken cannot reproduce",
        ),
    ],
)
def test_unconvertible_tokenizer_json(tmp_path, changes, message):
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_json(**changes)))
    with pytest.raises(ValueError, match=message):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_named_special_tokens_are_matched_whole(tmp_path):
    """A named token that the vocabulary holds as an ordinary piece is matched whole in text, as
    transformers adds it to its added tokens (compared with transformers in test_tokenizer.py)."""
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_json()))
    assert load_tokenizer(tmp_path).encode("abc") == [3, 2]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "bc"}))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("abc") == [0, 4] and tokenizer.eos_token_id == 4


def test_named_token_missing_from_the_vocabulary(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_json()))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="names the special token '</s>', which is neither"):
        load_tokenizer(tmp_path)


def test_not_a_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="is not a tokenizer"):
        load_tokenizer(tmp_path / "vocab.txt")
    with pytest.raises(ValueError, match=r"model\.gguf' does not exist"):
        load_tokenizer(tmp_path / "model.gguf")


def test_gguf_with_a_sentencepiece_tokenizer(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF tokenizer model 'llama' is not supported"):
        load_tokenizer(tmp_path / "spm.gguf")
