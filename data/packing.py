"""Packing documents into fixed-length training rows, and the batches cut from them.

Every document is preceded by `<|endoftext|>` (the separator, in the document's own segment) and
documents are laid end to end, then cut into rows of `seq_len + 1` tokens (inputs are a row's
first `seq_len` tokens, targets its last `seq_len`). Segment ids number the documents inside a
row from 1, so attention can stay inside a document; a target from the next document is masked
out of the loss. The order of rows is a pure function of (seed, epoch): batch `i` is the same on
every run, which is what makes an exact resume possible.

Instruction data (`pack_examples`) also carries a per-token answer flag beside the tokens and
segment ids, and keeps every example whole inside one row: an answer cut away from its prompt
would teach the model to answer nothing. A row is filled with whole examples in order and its
tail padded with `<|endoftext|>` in a segment of its own, never counted. A target counts iff
it is an answer token of the same document as its input.
"""

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    """One training batch (numpy on the host, jax arrays on the device); all `[batch, seq]`."""

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray


class Example(NamedTuple):
    """One instruction example: its token ids and, per token, whether it is answer text (a target
    the loss counts). Same length; see data/supervised.py."""

    ids: Sequence[int]
    answer: Sequence[bool]


def _rows(tokens: np.ndarray, segments: np.ndarray, row_len: int) -> tuple[np.ndarray, np.ndarray]:
    n = len(tokens) // row_len
    tokens = tokens[: n * row_len].reshape(n, row_len)
    segments = segments[: n * row_len].reshape(n, row_len)
    return tokens, segments - segments[:, :1] + 1


def _stream(docs: Iterable[Sequence[int]], eot: int) -> tuple[np.ndarray, np.ndarray]:
    parts = [np.concatenate([[eot], np.asarray(doc, np.int64)]) for doc in docs]
    if not parts:
        return np.zeros(0, np.int32), np.zeros(0, np.int32)
    segments = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    return np.concatenate(parts).astype(np.int32), segments.astype(np.int32)


def pack(docs: Iterable[Sequence[int]], seq_len: int, eot: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and segment ids, both `[rows, seq_len + 1]`; the incomplete tail is dropped."""
    tokens, segments = _stream(docs, eot)
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the corpus has {len(tokens)} tokens (with separators), fewer than one sequence of "
            f"--seq-len + 1 = {seq_len + 1}: use more data or a shorter --seq-len"
        )
    return _rows(tokens, segments, seq_len + 1)


def pack_stream(
    docs: Iterable[Sequence[int]], seq_len: int, eot: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The same rows as `pack`, one at a time, for corpora too large to hold (streaming)."""
    row_len, buffer, buffer_segments = seq_len + 1, [], []
    for doc_index, doc in enumerate(docs):
        buffer += [eot, *doc]
        buffer_segments += [doc_index] * (len(doc) + 1)
        n = len(buffer) // row_len * row_len
        if n:
            tokens, segments = _rows(np.array(buffer[:n]), np.array(buffer_segments[:n]), row_len)
            yield from zip(tokens.astype(np.int32), segments.astype(np.int32), strict=True)
            buffer, buffer_segments = buffer[n:], buffer_segments[n:]


def _example_rows(
    examples: Iterable[Example], seq_len: int, eot: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Rows (tokens, segments, answers), each `[seq_len + 1]`, of whole examples with separators,
    the tail of each row padded (see the module docstring)."""
    row_len = seq_len + 1
    tokens, segments, answers = [], [], []

    def flush():
        pad = row_len - len(tokens)
        segment = (segments[-1] + 1) if segments else 1
        row = (
            np.array([*tokens, *[eot] * pad], np.int32),
            np.array([*segments, *[segment] * pad], np.int32),
            np.array([*answers, *[False] * pad], bool),
        )
        tokens.clear(), segments.clear(), answers.clear()
        return row

    for example in examples:
        if len(example.ids) != len(example.answer):
            raise ValueError(
                f"an example has {len(example.ids)} ids but {len(example.answer)} answer flags"
            )
        if len(example.ids) + 1 > row_len:
            raise ValueError(
                f"an example of {len(example.ids)} tokens does not fit a row of --seq-len "
                f"{seq_len} (with its separator): cut it first (data.supervised.fit)"
            )
        if len(tokens) + len(example.ids) + 1 > row_len:
            yield flush()
        segment = (segments[-1] + 1) if segments else 1
        tokens += [eot, *example.ids]
        segments += [segment] * (len(example.ids) + 1)
        answers += [False, *map(bool, example.answer)]
    if tokens:
        yield flush()


def pack_examples(
    examples: Iterable[Example], seq_len: int, eot: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, segment ids and answer flags of whole examples, all `[rows, seq_len + 1]`; the
    last row is padded, not dropped (no example is lost)."""
    rows = list(_example_rows(examples, seq_len, eot))
    if not rows:
        raise ValueError("no examples to pack: the data holds none with an answer token")
    tokens, segments, answers = map(np.stack, zip(*rows, strict=True))
    return tokens, segments, answers


def pack_examples_stream(
    examples: Iterable[Example], seq_len: int, eot: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The rows of `pack_examples`, one at a time (streaming)."""
    return _example_rows(examples, seq_len, eot)


def to_batch(tokens: np.ndarray, segments: np.ndarray, answers: np.ndarray | None = None) -> Batch:
    """Shift rows `[..., seq + 1]` (`[batch, seq + 1]`, or `[pairs, 2, seq + 1]` for preference
    data) into inputs and targets; mask targets across documents and, given `answers` (same
    shape), targets that are not answer tokens."""
    mask = segments[..., 1:] == segments[..., :-1]
    if answers is not None:
        mask = mask & answers[..., 1:]
    return Batch(
        inputs=tokens[..., :-1],
        targets=tokens[..., 1:],
        segment_ids=segments[..., :-1],
        loss_mask=mask.astype(np.float32),
    )


def split_documents(n_docs: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of training and held-out validation documents (a seeded shuffle, then a cut)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    order = np.random.default_rng(seed).permutation(n_docs)
    n_val = max(1, round(n_docs * val_fraction))
    if n_docs - n_val < 1:
        raise ValueError(
            f"the corpus has {n_docs} document(s): too few to hold out --val-fraction "
            f"{val_fraction} of them ({n_val}) for validation and train on the rest: use more "
            "documents or a smaller --val-fraction"
        )
    return np.sort(order[n_val:]), np.sort(order[:n_val])


@dataclasses.dataclass(frozen=True)
class Batches:
    """Random-access batches of packed rows: `batch(i)` is a pure function of (rows, seed, i).
    Each epoch visits every row once in a fresh seeded order (the last partial batch is skipped).
    `answers` (from `pack_examples`) limits the loss to answer tokens; None counts every token."""

    tokens: np.ndarray
    segments: np.ndarray
    batch_size: int
    seed: int
    answers: np.ndarray | None = None

    def __post_init__(self):
        if len(self.tokens) < self.batch_size:
            raise ValueError(
                f"the corpus packs into {len(self.tokens)} rows of {self.tokens.shape[1]} tokens, "
                f"fewer than one batch of --batch-size={self.batch_size}: use more data or a "
                "smaller --batch-size / --seq-len"
            )

    @property
    def per_epoch(self) -> int:
        return len(self.tokens) // self.batch_size

    def rows(self, index: int) -> np.ndarray:
        """The rows of batch `index`: epoch `index // per_epoch`'s seeded order, cut."""
        epoch, i = divmod(index, self.per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))
        return order[i * self.batch_size : (i + 1) * self.batch_size]

    def batch(self, index: int, rows: slice = slice(None)) -> Batch:
        """Batch `index`; `rows` picks some of its rows (a process's share, the same whatever
        the number of processes)."""
        return self._batch(self.rows(index)[rows])

    def _batch(self, rows) -> Batch:
        answers = None if self.answers is None else self.answers[rows]
        return to_batch(self.tokens[rows], self.segments[rows], answers)

    def iterate(self, start: int = 0, rows: slice = slice(None)) -> Iterator[Batch]:
        return (self.batch(i, rows) for i in itertools.count(start))

    def in_order(self, n_batches: int, rows: slice = slice(None)) -> list[Batch]:
        """The first `n_batches` batches without shuffling (fixed evaluation batches), each
        cut to `rows`."""
        n = min(n_batches, self.per_epoch)
        b = self.batch_size
        return [self._batch(np.arange(i * b, (i + 1) * b)[rows]) for i in range(n)]


@dataclasses.dataclass
class StreamBatches:
    """Sequential batches packed on the fly from a streamed corpus; `docs()` opens the stream
    (already shuffled) from its start, and is opened again when it runs out (the next epoch).
    Resuming at batch `start` replays and skips the first `start` batches. With `examples`,
    `docs()` yields `Example`s, packed whole with their answer flags (`pack_examples_stream`)."""

    docs: Callable[[], Iterable[Sequence[int]]]
    seq_len: int
    eot: int
    batch_size: int
    examples: bool = False

    def iterate(self, start: int = 0, rows: slice = slice(None)) -> Iterator[Batch]:
        """Batches from number `start` on, each cut to `rows` (the stream is read whole)."""

        def epochs() -> Iterator[Sequence[int]]:
            while True:
                empty = True
                for doc in self.docs():
                    empty = False
                    yield doc
                if empty:
                    raise ValueError("the streamed training corpus is empty")

        pack_rows = pack_examples_stream if self.examples else pack_stream
        packed = pack_rows(epochs(), self.seq_len, self.eot)
        batches = (
            to_batch(*(np.stack(part)[rows] for part in zip(*chunk, strict=True)))
            for chunk in itertools.batched(packed, self.batch_size)
            if len(chunk) == self.batch_size
        )
        return itertools.islice(batches, start, None)
