"""Checkpoint tokenizers converted to tiktoken give the reference tokenizer's ids (HF
`tokenizers` on the tokenizer.json transformers derives from the SmolLM2 GGUF)."""

import json

import gguf
import pytest

from data.pretrained_tokenizer import tokenizer_from_pretrained
from tests.reference.runner import smollm2_gguf
from tests.reference.smollm2 import TEXTS, smollm2_reference  # noqa: F401

pytestmark = pytest.mark.xdist_group("smollm2")


def encode_all(encoding, texts):
    return [encoding.encode(t, allowed_special="all") for t in texts]


def test_gguf_tokenizer_matches_reference(smollm2_reference):  # noqa: F811
    encoding = tokenizer_from_pretrained(smollm2_gguf())
    assert encode_all(encoding, TEXTS) == smollm2_reference["ids"]["smollm"]
    assert [encoding.decode(ids) for ids in encode_all(encoding, TEXTS)] == TEXTS


@pytest.mark.parametrize("variant", ["smollm", "plain"])
def test_tokenizer_json_matches_reference(smollm2_reference, variant):  # noqa: F811
    """smollm: Digits + ByteLevel pre-tokenizer (SmolLM2's own); plain: ByteLevel only (GPT-2's
    regex, as transformers' GGUF conversion writes it)."""
    encoding = tokenizer_from_pretrained(smollm2_reference["dir"] / variant / "tokenizer.json")
    assert encode_all(encoding, TEXTS) == smollm2_reference["ids"][variant]


def test_the_two_pretokenizers_differ_on_this_text(smollm2_reference):  # noqa: F811
    # Otherwise the test above could not tell the regexes apart.
    assert smollm2_reference["ids"]["smollm"] != smollm2_reference["ids"]["plain"]


def test_special_tokens_include_chat_role_markers():
    encoding = tokenizer_from_pretrained(smollm2_gguf())
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= encoding.special_tokens_set
    assert encoding.encode("<|im_start|>", allowed_special="all") == [1]
    with pytest.raises(ValueError, match="disallowed special token"):
        encoding.encode("<|im_end|>")


def test_hf_directory_reads_chat_template_markers(tmp_path, smollm2_reference):  # noqa: F811
    """A marker that the vocabulary lists as an ordinary token but the chat template uses becomes
    special (tokenizer_config.json's chat_template)."""
    spec = json.loads((smollm2_reference["dir"] / "plain" / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|im_end|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    template = "{{ '<|im_start|>' + message['content'] + '<|im_end|>' }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    assert "<|im_end|>" in tokenizer_from_pretrained(tmp_path).special_tokens_set
    assert (
        "<|im_end|>"
        not in tokenizer_from_pretrained(tmp_path / "tokenizer.json").special_tokens_set
    )


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
    assert tokenizer_from_pretrained(tmp_path).encode("abcab") == [3, 2, 3]


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
    ],
)
def test_unconvertible_tokenizer_json(tmp_path, changes, message):
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_json(**changes)))
    with pytest.raises(ValueError, match=message):
        tokenizer_from_pretrained(tmp_path / "tokenizer.json")


def test_not_a_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        tokenizer_from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is not a tokenizer"):
        tokenizer_from_pretrained(tmp_path / "vocab.txt")


def test_gguf_with_a_sentencepiece_tokenizer(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF tokenizer model 'llama' is not supported"):
        tokenizer_from_pretrained(tmp_path / "spm.gguf")
