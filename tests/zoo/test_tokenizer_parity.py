"""zoo.load_tokenizer gives transformers' ids on a fixed text set for each family's tokenizer
shape (Llama 2, Mistral/Mixtral, Gemma, Phi-3 SentencePiece-style; GPT-2, Llama 3, Qwen
byte-level), built offline and saved by transformers' own classes, and for GGUF vocabularies of
both of llama.cpp's kinds, which we build from the metadata ourselves (tests/reference/
tokenizer_families.py)."""

import pytest

import zoo
from tests.reference.tokenizer_families import DIRS, GGUFS, TEXTS, tokenizer_reference  # noqa: F401
from zoo.tokenizer import content

pytestmark = pytest.mark.xdist_group("tokenizers")


@pytest.mark.parametrize("name", [*DIRS, *GGUFS])
def test_ids_and_text_equal_transformers(tokenizer_reference, name):  # noqa: F811
    expected = tokenizer_reference[name]
    tokenizer = zoo.load_tokenizer(expected["path"])
    ids = [tokenizer.encode(text) for text in TEXTS]
    for text, got, want in zip(TEXTS, ids, expected["ids"], strict=True):
        assert got == want, f"{name} ({expected['class']}) on {text!r}"
    assert [tokenizer.decode(i) for i in ids] == expected["decoded"]


def test_the_shapes_differ_where_the_families_do(tokenizer_reference):  # noqa: F811
    """Otherwise the test above could pass with one pipeline for all: the prefix-space rules of
    Llama 2 (first piece), Mistral (every piece), Gemma (none) and Phi-3 (a normalizer) differ
    on these texts, and each SentencePiece family falls back to bytes for the emoji."""
    ids = {name: tokenizer_reference[name]["ids"] for name in DIRS}
    leading = TEXTS.index(" leading space")
    after_special = TEXTS.index("<s>after special</s> and <|endoftext|> then <|im_end|>x and <eos>")
    assert ids["llama2"][after_special] != ids["mistral"][after_special]
    assert len({tuple(ids[n][leading]) for n in ("llama2", "gemma", "phi3")}) == 3
    emoji = TEXTS.index("café naïve Øresund 東京 🙂 \x04 é")
    for name in ("llama2", "gemma", "phi3", "gguf-llama", "gguf-gemma2"):
        byte_pieces = [i for i in tokenizer_reference[name]["ids"][emoji] if 3 <= i < 261]
        assert len(byte_pieces) >= 4, name  # 🙂 is four byte pieces
    assert tokenizer_reference["qwen2"]["class"] == "Qwen2Tokenizer"
    assert tokenizer_reference["gguf-phi3"]["ids"] != tokenizer_reference["gguf-llama"]["ids"]


@pytest.mark.parametrize("name", [*DIRS, *GGUFS])
def test_markers_spelled_by_sentinels_split_as_the_tokenizer_does(tokenizer_reference, name):  # noqa: F811
    """special_in_content="text" encodes a chat with each template marker spelled by a sentinel
    added token of a copy of the tokenizer: with every special token of a text a marker, that
    must give the tokenizer's own ids exactly (each family's prefix-space rule after a special
    token, byte fallback, normalizers): transformers' ids on TEXTS, and `encode`'s (equal to
    transformers' above) on texts around the family's own special tokens."""
    expected = tokenizer_reference[name]
    tokenizer = zoo.load_tokenizer(expected["path"])
    for text, want in zip(TEXTS, expected["ids"], strict=True):
        assert content.encode_marked(tokenizer, text, text) == want, f"{name} on {text!r}"
    specials = sorted(tokenizer.special_tokens)
    around = [
        "".join(f"{t}Hi there{t}\n  x" for t in specials),
        f" lead{specials[0]} after  {specials[-1]}end",
    ]
    for text in around:
        assert len(content.special_spans(tokenizer, text)) >= 2, f"{name} on {text!r}"
        assert content.encode_marked(tokenizer, text, text) == tokenizer.encode(text), name
