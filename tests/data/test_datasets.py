"""Loading local files through `datasets`, the offline hub-name error, batched tokenization."""

import json

import datasets
import pytest

from data.datasets import load_text, tokenize
from data.prefetch import Prefetcher
from data.tokenizers import train_bpe

DOCS = ["first document", "second one, with ünïcode", "third\nhas two lines"]


def _write(tmp_path, kind: str):
    import pandas as pd

    frame = pd.DataFrame({"body": DOCS, "id": [1, 2, 3]})
    path = tmp_path / f"docs.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in frame.to_dict("records")))
    elif kind == "csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    return path


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet"])
def test_local_files_with_a_named_column(tmp_path, kind):
    dataset = load_text(str(_write(tmp_path, kind)), column="body")
    assert list(dataset["body"]) == DOCS


def test_plain_text_and_streaming(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(DOCS[:2]) + "\n")
    assert list(load_text(str(path))["text"]) == DOCS[:2]
    streamed = load_text(str(path), streaming=True)
    assert [row["text"] for row in streamed] == DOCS[:2]


def test_tokenize_batched_matches_encoding(tmp_path):
    encoding = train_bpe(DOCS * 5, 280)
    dataset = load_text(str(_write(tmp_path, "jsonl")), column="body")
    ids = tokenize(dataset, encoding, column="body")
    assert ids.column_names == ["ids"]
    assert list(ids["ids"]) == [encoding.encode_ordinary(d) for d in DOCS]


def test_hub_name_offline_fails_fast(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("load_dataset was called: that is the ~20 s retry loop")

    # Failing fast means deciding before `datasets` is asked at all.
    monkeypatch.setattr(datasets, "load_dataset", never)
    with pytest.raises(ValueError, match="HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set"):
        load_text("someone/some-dataset")


def test_bad_paths_and_columns(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_text(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"no text column 'text'.*'body'"):
        load_text(str(_write(tmp_path, "jsonl")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        load_text(str(tmp_path / "empty"))


def test_prefetch_keeps_order_and_reports_errors():
    placed = []
    fetch = Prefetcher(iter(range(5)), lambda x: placed.append(x) or x * 10)
    assert list(fetch) == [0, 10, 20, 30, 40] and placed == [0, 1, 2, 3, 4]
    assert fetch.wait_s >= 0

    def broken():
        yield 1
        raise OSError("disk went away")

    fetch = Prefetcher(broken(), lambda x: x)
    assert next(fetch) == 1
    with pytest.raises(OSError, match="disk went away"):
        next(fetch)
