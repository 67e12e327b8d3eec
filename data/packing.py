"""Packing documents into fixed-length training rows, and the batches cut from them.

Every document is preceded by `<|endoftext|>` (the separator, in the document's own segment) and
documents are laid end to end, then cut into rows of `seq_len + 1` tokens (inputs are a row's
first `seq_len` tokens, targets its last `seq_len`). Segment ids number the documents inside a
row from 1, so attention can stay inside a document; a target from the next document is masked
out of the loss. The order of rows is a pure function of (seed, epoch): batch `i` is the same on
every run, which is what makes an exact resume possible.
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


def to_batch(tokens: np.ndarray, segments: np.ndarray) -> Batch:
    """Shift rows `[batch, seq + 1]` into inputs and targets; mask targets across documents."""
    return Batch(
        inputs=tokens[:, :-1],
        targets=tokens[:, 1:],
        segment_ids=segments[:, :-1],
        loss_mask=(segments[:, 1:] == segments[:, :-1]).astype(np.float32),
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
    Each epoch visits every row once in a fresh seeded order (the last partial batch is skipped)."""

    tokens: np.ndarray
    segments: np.ndarray
    batch_size: int
    seed: int

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

    def batch(self, index: int) -> Batch:
        epoch, i = divmod(index, self.per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))
        rows = order[i * self.batch_size : (i + 1) * self.batch_size]
        return to_batch(self.tokens[rows], self.segments[rows])

    def iterate(self, start: int = 0) -> Iterator[Batch]:
        return (self.batch(i) for i in itertools.count(start))

    def in_order(self, n_batches: int) -> list[Batch]:
        """The first `n_batches` batches without shuffling (fixed evaluation batches)."""
        n = min(n_batches, self.per_epoch)
        b = self.batch_size
        return [
            to_batch(self.tokens[i * b : (i + 1) * b], self.segments[i * b : (i + 1) * b])
            for i in range(n)
        ]


@dataclasses.dataclass
class StreamBatches:
    """Sequential batches packed on the fly from a streamed corpus; `docs()` opens the stream
    (already shuffled) from its start, and is opened again when it runs out (the next epoch).
    Resuming at batch `start` replays and skips the first `start` batches."""

    docs: Callable[[], Iterable[Sequence[int]]]
    seq_len: int
    eot: int
    batch_size: int

    def iterate(self, start: int = 0) -> Iterator[Batch]:
        def epochs() -> Iterator[Sequence[int]]:
            while True:
                empty = True
                for doc in self.docs():
                    empty = False
                    yield doc
                if empty:
                    raise ValueError("the streamed training corpus is empty")

        rows = pack_stream(epochs(), self.seq_len, self.eot)
        batches = (
            to_batch(*map(np.stack, zip(*chunk, strict=True)))
            for chunk in itertools.batched(rows, self.batch_size)
            if len(chunk) == self.batch_size
        )
        return itertools.islice(batches, start, None)
