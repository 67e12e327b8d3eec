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


# Files that cannot be a corpus: the error names the file, the line (or row) and what to do,
# whether the file is loaded whole or streamed.
GOOD = '{"text": "a"}\n'
BAD_FILES = [
    ("empty.jsonl", b"", r"is empty \(0 bytes\): give a file that holds documents"),
    ("empty.txt", b"", r"is empty \(0 bytes\)"),
    ("blank.jsonl", b"\n  \n", "holds only whitespace"),
    (
        "binary.txt",
        b"\x7fELF\x02\x01\x01\x00\x00\x00",
        r"not text: it holds a NUL byte \(at byte 7",
    ),
    ("binary.jsonl", b"PK\x03\x04\x00\x00", "looks like a binary file. --data takes UTF-8 text"),
    ("latin1.txt", "ok\ncafé\n".encode("latin-1"), r"line 2 is not UTF-8 text \(byte 0xe9 at"),
    ("fake.parquet", b"text\na\n", "is not a parquet file"),
    (
        "malformed.jsonl",
        (GOOD * 2 + '{"text": "c\n' + GOOD).encode(),
        r"line 3 is not valid JSON \(Unterminated string.*column 10\): fix or delete that line",
    ),
    ("plain.jsonl", b"just text\n", r"line 1 is not valid JSON.*one object such as \{\"text\""),
    ("null.jsonl", (GOOD + '{"text": null}\n').encode(), r"line 2 has 'text': null, not a string"),
    ("missing.jsonl", (GOOD + '{"body": "b"}\n').encode(), r"line 2 has no 'text' key.*'body'"),
    ("number.jsonl", (GOOD + '{"text": 5}\n').encode(), "line 2 has 'text': 5, a number, not a"),
    ("list.jsonl", b"[1, 2]\n", r"line 1 is a list, not an object such as \{\"text\": \"...\"\}"),
    (
        "array.json",
        b'[{"text": "a"}, {"text": null}]',
        "record 2 of its JSON array has 'text': null",
    ),
    ("blank.csv", b"text,id\na,1\n,2\n", r"row 2 \(line 3\) has no text in column 'text'"),
]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(("name", "content", "message"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_bad_file_is_named_with_its_line(tmp_path, name, content, message, streaming):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        list(load_text(str(path), streaming=streaming))
    assert str(error.value).startswith(f"--data {str(path)!r}: ")


def test_a_bad_file_in_a_directory_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text(GOOD * 3)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(GOOD + "{oops}\n")
    bad = str(tmp_path / "sub" / "b.jsonl")
    with pytest.raises(ValueError, match=rf"--data '{tmp_path}': '{bad}': line 2 is not valid"):
        load_text(str(tmp_path))
    (tmp_path / "sub" / "b.jsonl").write_text("")
    with pytest.raises(ValueError, match=rf"'{bad}': is empty"):
        load_text(str(tmp_path))


def test_good_files_still_load(tmp_path):
    """A byte-order mark, blank lines, a JSON array file and a large file pass the checks."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (GOOD + "\n" + GOOD).encode())
    assert list(load_text(str(path))["text"]) == ["a", "a"]
    path = tmp_path / "records.json"
    path.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    assert list(load_text(str(path))["text"]) == ["a", "b"]
    path = tmp_path / "big.jsonl"  # longer than the checked head, which ends mid-character
    line = json.dumps({"text": "a" + "ü" * 97}, ensure_ascii=False) + "\n"
    path.write_text(line * 1000, encoding="utf-8")
    with pytest.raises(UnicodeDecodeError, match="unexpected end of data"):
        path.read_bytes()[: 1 << 16].decode()
    assert len(load_text(str(path))) == 1000


def test_a_bad_line_past_the_head_of_a_stream_is_named(tmp_path):
    """Streaming reads each document's text as it comes: a null past the checked head stops
    the stream with the file's line (a malformed line there is `datasets`' own error)."""
    path = tmp_path / "late.jsonl"
    lines = [json.dumps({"text": "x" * 200}) + "\n" for _ in range(500)]
    path.write_text("".join(lines) + '{"text": null}\n')
    with pytest.raises(ValueError, match="line 501 has 'text': null"):
        list(load_text(str(path), streaming=True))


def test_quiet_progress_turns_datasets_bars_off_and_back():
    """train.py reads data inside it: datasets' own bars would print through its lines."""
    import datasets

    from data.datasets import quiet_progress

    before = datasets.are_progress_bars_disabled()
    with quiet_progress():
        assert datasets.are_progress_bars_disabled()
    assert datasets.are_progress_bars_disabled() == before
