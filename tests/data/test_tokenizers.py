"""Byte-level BPE trained locally: round trips on any Unicode, rank-file save/load, specs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data.tokenizers import EOT, get_tokenizer, load_ranks, save_ranks, train_bpe

TEXTS = [
    "def add(a, b):\n    return a + b  # naïve façade\n",
    "class Zürich:\n\tpass\r\n",
    "日本語のテキスト、emoji 🎉👩‍👩‍👧 and math ∑∫√",
] * 20


@pytest.fixture(scope="module")
def encoding():
    return train_bpe(TEXTS, 320)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=200))
def test_round_trip_any_unicode(encoding, text):
    ids = encoding.encode_ordinary(text)
    assert encoding.decode(ids) == text
    assert all(0 <= i < encoding.eot_token for i in ids)


def test_merges_compress_the_training_text(encoding):
    text = TEXTS[0]
    assert len(encoding.encode_ordinary(text)) < len(text.encode()) / 2
    assert encoding.n_vocab <= 320 and encoding.eot_token == encoding.n_vocab - 1
    assert encoding.encode(EOT, allowed_special="all") == [encoding.eot_token]


@settings(max_examples=50, deadline=None)
@given(text=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=100))
def test_rank_file_round_trip(tmp_path_factory, encoding, text):
    path = tmp_path_factory.mktemp("tok") / "bpe.tiktoken"
    save_ranks(encoding, path)
    loaded = load_ranks(path)
    assert loaded.encode_ordinary(text) == encoding.encode_ordinary(text)
    assert loaded.eot_token == encoding.eot_token


def test_cached_tokenizer_is_reused(tmp_path):
    log = []
    first = get_tokenizer("bpe", texts=TEXTS, vocab_size=300, cache_dir=tmp_path, log=log.append)
    second = get_tokenizer("bpe", texts=TEXTS, vocab_size=300, cache_dir=tmp_path, log=log.append)
    assert "trained" in log[0] and "loaded cached" in log[1]
    assert first.encode_ordinary(TEXTS[2]) == second.encode_ordinary(TEXTS[2])


def test_bad_tokenizer_specs(tmp_path):
    with pytest.raises(ValueError, match="not 'bpe'"):
        get_tokenizer("nonsense", texts=[], vocab_size=300, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        get_tokenizer(str(tmp_path / "x.tiktoken"), texts=[], vocab_size=300, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_bpe(TEXTS, 100)
