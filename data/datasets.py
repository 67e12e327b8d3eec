"""Loading text through HF `datasets`: local files (text/json/jsonl/parquet/csv), a hub name for
users who are online, optional streaming, a named text column, and batched tokenization.

A hub name while offline fails at once with a message that says so, instead of `datasets`'
retry loop (about 20 s without HF_DATASETS_OFFLINE=1).

A local file that cannot be a corpus fails with a ValueError that names the file, the line (or
row) and what to do: an empty file, a binary or non-UTF-8 file, a malformed JSON line, a
document whose text is null, missing or not a string. The cheap checks (size, the first 64 KiB)
run before `datasets` reads anything; the file is read through only when something failed, to
find the line. With `--streaming` the text of each document is checked as it is read.

`load_examples` loads instruction data the same way and finds its format (data/formats.py).
"""

import contextlib
import csv
import json
import os
from collections.abc import Iterator
from pathlib import Path

import datasets
import tiktoken

from data.formats import Format, detect_format

_BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}


def is_offline() -> bool:
    return any(
        os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def _looks_like_path(spec: str) -> bool:
    """Hub names are `name` or `owner/name`; more slashes or a file suffix mean a path."""
    starts = spec.startswith((".", "/", "~"))
    return starts or Path(spec).suffix in _BUILDERS or spec.count("/") > 1


_TEXT_TYPES = ("string", "large_string")
ROW = "_row"  # the column `load_examples` adds: each example's 1-based row number
_HEAD = 1 << 16  # bytes of each file checked before `datasets` reads it
_WHAT_DATA = (
    "--data takes UTF-8 text (.txt, .text, .md: a document per line), JSON lines (.jsonl, .json: "
    'an object such as {"text": "..."} per line), .csv or .parquet'
)
_FIX_ROW = "fix or delete it (or, if the text is in another column, pass --text-column)"
_JSON_KINDS = {
    bool: "a boolean",
    int: "a number",
    float: "a number",
    list: "a list",
    dict: "an object",
}


def _sniff(file: Path, builder: str) -> str | None:
    """Why `file` cannot be read by `builder`, from its size and first bytes; None if it may."""
    if file.stat().st_size == 0:
        return f"is empty (0 bytes): give a file that holds documents. {_WHAT_DATA}"
    with file.open("rb") as f:
        head = f.read(_HEAD)
    if builder == "parquet":
        if not head.startswith(b"PAR1"):
            return f"is not a parquet file (it does not start with b'PAR1'). {_WHAT_DATA}"
        return None
    if b"\0" in head:
        return (
            f"is not text: it holds a NUL byte (at byte {head.index(b'\0')}), so it looks like "
            f"a binary file. {_WHAT_DATA}"
        )
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        cut = len(head) == _HEAD and error.reason == "unexpected end of data"
        if not cut:  # (a character cut at the end of the head is fine)
            return _not_utf8(head, error)
    if not head.strip() and len(head) < _HEAD:
        return f"holds only whitespace: give a file that holds documents. {_WHAT_DATA}"
    if file.suffix == ".jsonl":  # e.g. a text file named .jsonl: fails here, streamed or not
        complete = head if len(head) < _HEAD else head[: head.rfind(b"\n") + 1]
        return _json_lines_problem(complete, column=None)
    return None


def _not_utf8(data: bytes, error: UnicodeDecodeError, first_line: int = 1) -> str:
    line = first_line + data[: error.start].count(b"\n")
    column = error.start - data.rfind(b"\n", 0, error.start)
    return (
        f"line {line} is not UTF-8 text (byte 0x{data[error.start]:02x} at column {column}): "
        "re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 FILE > NEW`"
    )


def _example(column: str | None) -> str:
    return f'{{{json.dumps(column or "text")}: "..."}}'


def _record_problem(record, column: str | None) -> str | None:
    """What is wrong with one JSON record as a document (only its kind when `column` is None),
    or None."""
    if not isinstance(record, dict):
        kind = _JSON_KINDS.get(type(record), "a string")
        return f"is {kind}, not an object such as {_example(column)}"
    if column is None:
        return None
    if column not in record:
        return f"has no {column!r} key (its keys: {sorted(record)[:10]})"
    value = record[column]
    if value is None:
        return f"has {column!r}: null, not a string"
    if not isinstance(value, str):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        return f"has {column!r}: {shown}, {_JSON_KINDS[type(value)]}, not a string"
    return None


def _json_lines_problem(data: bytes, column: str | None) -> str | None:
    """The first line of JSON-lines `data` that is not a document, and why; None if all are."""
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))
        except UnicodeDecodeError as error:
            return _not_utf8(line, error, first_line=number)
        except json.JSONDecodeError as error:
            return (
                f"line {number} is not valid JSON ({error.msg}: column {error.colno}): fix or "
                "delete that line; each line of a JSON-lines file is one object such as "
                f"{_example(column)}"
            )
        problem = _record_problem(record, column)
        if problem:
            return f"line {number} {problem}: {_FIX_ROW}"
    return None


def _scan(file: Path, builder: str, column: str) -> str | None:
    """The first line or row of `file` that cannot be a document, and why; None if all can.
    Reads the whole file: only called once something failed."""
    if builder == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(file)
        if column not in table.column_names:
            return None  # the column check names the columns
        for row, value in enumerate(table.column(column).to_pylist(), 1):
            if not isinstance(value, str):
                return f"row {row} has {column!r} = {value!r}, not a string: {_FIX_ROW}"
        return None
    data = file.read_bytes()
    if builder in ("text", "csv"):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            return _not_utf8(data, error)
        if builder == "text":
            return None
        reader = csv.DictReader(text.splitlines(keepends=True))
        if reader.fieldnames is None or column not in reader.fieldnames:
            return None
        for row, record in enumerate(reader, 1):
            if not record.get(column):
                return (
                    f"row {row} (line {reader.line_num}) has no text in column {column!r}: "
                    f"{_FIX_ROW}"
                )
        return None
    if file.suffix == ".json" and data.lstrip()[:1] == b"[":
        try:
            records = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # not one JSON document: read it as JSON lines below
        else:
            for index, record in enumerate(records if isinstance(records, list) else [], 1):
                problem = _record_problem(record, column)
                if problem:
                    return f"record {index} of its JSON array {problem}: {_FIX_ROW}"
            return None
    return _json_lines_problem(data, column)


def _error(spec: str, file: Path, problem: str) -> ValueError:
    """`--data 'x.jsonl': line 3 is ...`; for a file in a directory, `--data 'dir':
    'dir/x.jsonl' line 3 is ...`."""
    where = "" if file == Path(spec).expanduser() else f"{str(file)!r}: "
    return ValueError(f"--data {spec!r}: {where}{problem}")


def _located(spec: str, files: list[Path], builder: str, column: str) -> ValueError | None:
    """A ValueError naming the first file and line that cannot be a document, if any."""
    for file in files:
        problem = _scan(file, builder, column)
        if problem:
            return _error(spec, file, problem)
    return None


def _root_cause(error: BaseException) -> BaseException:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return error


def _open(
    spec: str, column: str | None, streaming: bool, split: str
) -> tuple[datasets.Dataset | datasets.IterableDataset, list[Path], str | None]:
    """(dataset, its local files, their builder) for `spec`; the file checks of `load_text`
    (`column`: the text column whose rows a failed load looks for, None for any)."""
    path = Path(spec).expanduser()
    files: list[Path] = []
    if path.exists():
        files = (
            sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS and p.is_file())
            if path.is_dir()
            else [path]
        )
        if not files:
            raise ValueError(f"--data {spec!r} holds no {sorted(_BUILDERS)} files")
        suffixes = {p.suffix for p in files}
        unknown = [p for p in files if p.suffix not in _BUILDERS]
        if unknown:  # only a single file given by name can be one
            what = "has no suffix" if not unknown[0].suffix else f"ends in {unknown[0].suffix!r}"
            raise ValueError(
                f"--data {spec!r} {what}, so its format is unknown; name it for its format: "
                f"{', '.join(sorted(_BUILDERS))} (text, json/jsonl, parquet or csv)"
            )
        builders = {_BUILDERS.get(s) for s in suffixes}
        if None in builders or len(builders) != 1:
            raise ValueError(
                f"--data {spec!r}: cannot load {sorted(suffixes)} together; use one of "
                f"{sorted(_BUILDERS)} (text, json/jsonl, parquet or csv)"
            )
        builder = builders.pop()
        for file in files:
            problem = _sniff(file, builder)
            if problem:
                raise _error(spec, file, problem)
        try:
            dataset = datasets.load_dataset(
                builder, data_files=[str(f) for f in files], split=split, streaming=streaming
            )
        except Exception as error:
            located = _located(spec, files, builder, column)
            if located is not None:
                raise located from error
            raise ValueError(
                f"--data {spec!r}: `datasets` could not read it: {_root_cause(error)!r}"
            ) from error
    elif _looks_like_path(spec):
        raise ValueError(f"--data {spec!r} does not exist (no such file or directory)")
    elif is_offline():
        raise ValueError(
            f"--data {spec!r} is not a local path, so it would be a Hugging Face hub dataset, but "
            "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set: go online (unset them) or pass a local "
            "text/json/jsonl/parquet/csv file"
        )
    else:
        builder = None
        dataset = datasets.load_dataset(spec, split=split, streaming=streaming)
    return dataset, files, builder


def load_text(
    spec: str, *, column: str = "text", streaming: bool = False, split: str = "train"
) -> datasets.Dataset | datasets.IterableDataset:
    """A dataset with a `column` of strings, from a local file/directory or a hub name."""
    dataset, files, builder = _open(spec, column, streaming, split)
    return _text(dataset, spec, files, builder, column, streaming)


def _text(
    dataset: datasets.Dataset | datasets.IterableDataset,
    spec: str,
    files: list[Path],
    builder: str | None,
    column: str,
    streaming: bool,
) -> datasets.Dataset | datasets.IterableDataset:
    """`dataset` with its text `column` checked (every row a string)."""
    names = dataset.column_names
    if names is not None and column not in names:
        raise ValueError(
            f"--data {spec!r} has no text column {column!r}; its columns are {names}: "
            "pass --text-column with one of them"
        )
    if streaming:
        return _checked_stream(dataset, spec, files, builder, column)
    _check_column(dataset, spec, files, builder, column)
    return dataset


def _check_column(
    dataset: datasets.Dataset, spec: str, files: list[Path], builder: str | None, column: str
) -> None:
    """Every row's `column` a string (arrow's type and null count: no pass over the rows)."""
    if len(dataset) == 0:
        raise ValueError(f"--data {spec!r} holds no documents. {_WHAT_DATA}")
    feature = dataset.features[column]
    values = dataset.data.column(column)
    if getattr(feature, "dtype", None) in _TEXT_TYPES and values.null_count == 0:
        return
    located = _located(spec, files, builder, column) if files else None
    if located is not None:
        raise located
    if values.null_count:
        import pyarrow.compute as pc

        row = pc.index(pc.is_null(values), True).as_py() + 1
        raise ValueError(f"--data {spec!r}: row {row} has no text in column {column!r}")
    raise ValueError(
        f"--data {spec!r}: column {column!r} holds {feature}, not text: pass --text-column "
        "with the column that holds the documents"
    )


def _checked_stream(
    dataset: datasets.IterableDataset,
    spec: str,
    files: list[Path],
    builder: str | None,
    column: str,
) -> datasets.IterableDataset:
    """The stream with each document's text checked as it is read: a row that is not a string
    stops it with the file and line (found by reading the files, then)."""

    def check(example: dict) -> dict:
        if not isinstance(example[column], str):
            located = _located(spec, files, builder, column) if files else None
            raise located or ValueError(
                f"--data {spec!r}: a document has {column!r} = {example[column]!r}, not a string"
            )
        return example

    return dataset.map(check, features=dataset.features)


def load_examples(
    spec: str,
    *,
    data_format: str = "auto",
    text_column: str = "text",
    streaming: bool = False,
    split: str = "train",
) -> tuple[datasets.Dataset | datasets.IterableDataset, Format]:
    """(dataset, its format): `load_text`'s dataset for text, else the rows of a chat, completion
    or alpaca dataset (data/formats.py), each with its 1-based row number added as `ROW` (so an
    error names it even after a shuffle). `data_format` `auto` detects the format from the
    columns."""
    dataset, files, builder = _open(spec, None, streaming, split)
    names = dataset.column_names
    if names is None:  # a streamed hub dataset may not know its columns before its first row
        names = list(next(iter(dataset)))
    try:
        found = detect_format(names, data_format, text_column)
    except ValueError as error:
        raise ValueError(f"--data {spec!r}: {error}") from None
    if found == "text":
        return _text(dataset, spec, files, builder, text_column, streaming), found
    if not streaming and len(dataset) == 0:
        raise ValueError(f"--data {spec!r} holds no examples. {_WHAT_DATA}")
    numbered = dataset.map(lambda _, index: {ROW: index + 1}, with_indices=True)
    return numbered, found


def tokenize(
    dataset: datasets.Dataset | datasets.IterableDataset,
    encoding: tiktoken.Encoding,
    *,
    column: str = "text",
) -> datasets.Dataset | datasets.IterableDataset:
    """Replace the columns by `ids`: each document's tokens (no EOT; packing adds separators)."""

    def encode(batch: dict) -> dict:
        return {"ids": encoding.encode_ordinary_batch(batch[column])}

    names = dataset.column_names
    return dataset.map(encode, batched=True, remove_columns=names)


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """datasets' own progress bars off inside (its "Map" and "Generating split" bars would
    print through train.py's lines and bar, which say what the data step does instead)."""
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()
