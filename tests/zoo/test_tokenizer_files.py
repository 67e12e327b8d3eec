"""Tokenizer files of every kind load (HF directory, tokenizer.json, GGUF, tiktoken ranks): the
SmolLM2 GGUF gives the reference tokenizer's ids (HF `tokenizers` on the tokenizer.json
transformers derives from it), tiktoken ranks give tiktoken's ids, named special tokens are
matched whole, and each bad file is an error saying what is wrong."""

import json

import gguf
import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from data.tokenizers import train_bpe
from tests.reference.runner import smollm2_gguf
from tests.reference.smollm2 import TEXTS, smollm2_reference  # noqa: F401
from zoo.tokenizer import from_tiktoken, load_tokenizer
from zoo.tokenizer.bpe import GPT2_PATTERN, from_ranks

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


def write_tiny(folder, config: dict | None = None) -> None:
    """A tiny byte-level BPE (a, b, c, ab, bc) as folder/tokenizer.json (+ tokenizer_config)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("b", "c")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_tiny_tokenizer_json(tmp_path):
    write_tiny(tmp_path)
    assert load_tokenizer(tmp_path).encode("abcab") == [3, 2, 3]
    assert load_tokenizer(tmp_path / "tokenizer.json").decode([3, 2, 3]) == "abcab"


def test_named_special_tokens_are_matched_whole(tmp_path):
    """A named token that the vocabulary holds as an ordinary piece is matched whole in text, as
    transformers adds it to its added tokens (compared with transformers in test_tokenizer.py)."""
    write_tiny(tmp_path)
    assert load_tokenizer(tmp_path).encode("abc") == [3, 2]
    write_tiny(tmp_path, {"eos_token": "bc"})
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("abc") == [0, 4] and tokenizer.eos_token_id == 4
    assert tokenizer.encode_ordinary("abc") == [3, 2]  # special strings as text
    assert tokenizer.eot_token == 4  # no <|endoftext|>: eos separates documents


def test_named_token_missing_from_the_vocabulary(tmp_path):
    write_tiny(tmp_path, {"eos_token": "</s>"})
    with pytest.raises(ValueError, match="names the special token '</s>', which is neither"):
        load_tokenizer(tmp_path)


def test_a_tokenizer_json_the_library_cannot_read(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    with pytest.raises(ValueError, match=r"is not a tokenizer\.json the tokenizers library reads"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"is not a tokenizer\.json the tokenizers library reads"):
        load_tokenizer(tmp_path)


def test_not_a_tokenizer(tmp_path):
    with pytest.raises(ValueError, match=r"has no tokenizer\.json; write one with transformers"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(ValueError, match=r"a SentencePiece tokenizer\.model is there alone"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="is not a tokenizer"):
        load_tokenizer(tmp_path / "vocab.txt")
    with pytest.raises(ValueError, match=r"model\.gguf' does not exist"):
        load_tokenizer(tmp_path / "model.gguf")


def write_gguf(path, model: str, **fields) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([1, 1, 1])
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("model", "fields", "message"),
    [
        ("bert", {}, "GGUF tokenizer model 'bert' is not supported; known: 'gpt2'"),
        ("gpt2", {"tokenizer_pre": "falcon"}, "GGUF pre-tokenizer 'falcon' is not supported"),
        ("llama", {}, "a SentencePiece vocabulary without merges needs its token scores"),
    ],
)
def test_unsupported_gguf_vocabularies(tmp_path, model, fields, message):
    write_gguf(tmp_path / "v.gguf", model, **fields)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(tmp_path / "v.gguf")


@pytest.fixture(scope="module")
def trained() -> tiktoken.Encoding:
    texts = [TEXTS[0] * 3, "the theory of the thing, 123 + 456 = 579", "café 東京 🙂"] * 20
    return train_bpe(texts, 320, name="tiny")


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=80))
def test_tiktoken_ranks_give_tiktokens_ids(trained, text):
    """A BPE train.py trained (tiktoken ranks) as a `tokenizers` vocabulary + merges: the same
    ids on any text, and <|endoftext|> whole."""
    tokenizer = from_tiktoken(trained)
    assert tokenizer.encode_ordinary(text) == trained.encode_ordinary(text)
    assert tokenizer.encode(text + "<|endoftext|>")[-1] == trained.eot_token == tokenizer.eot_token
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_rank_file_loads(trained, tmp_path):
    from data.tokenizers import save_ranks

    save_ranks(trained, tmp_path / "bpe.tiktoken")
    loaded = load_tokenizer(tmp_path / "bpe.tiktoken")
    assert loaded.encode_ordinary(TEXTS[1]) == trained.encode_ordinary(TEXTS[1])


def test_ranks_that_are_no_bpe_are_refused():
    ranks = {bytes([b]): b for b in range(256)} | {b"abc": 256}  # no merge makes "abc"
    with pytest.raises(ValueError, match=r"rank 256 \(b'abc'\) is not made by one merge"):
        from_ranks(ranks, GPT2_PATTERN)
