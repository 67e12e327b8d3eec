"""Packing: separators, segment ids, masks, deterministic order, streaming == in-memory."""

import itertools
from collections import Counter

import numpy as np
import pytest

from data.packing import Batches, StreamBatches, pack, pack_stream, split_documents, to_batch

EOT = 99


def _docs(seed: int = 0, n: int = 30) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 50, rng.integers(1, 20))) for _ in range(n)]


def test_rows_are_the_documents_with_separators_and_segments():
    docs = _docs()
    tokens, segments = pack(docs, seq_len=7, eot=EOT)
    assert tokens.shape == segments.shape and tokens.shape[1] == 8
    stream = [t for d in docs for t in [EOT, *d]]
    np.testing.assert_array_equal(tokens.ravel(), stream[: tokens.size])
    for row, seg in zip(tokens, segments, strict=True):
        assert seg[0] == 1 and np.all(np.diff(seg) >= 0)
        starts = np.flatnonzero(np.diff(seg)) + 1
        assert np.all(row[starts] == EOT)  # a new segment starts exactly at a separator
        assert not np.any(row[1:][np.diff(seg) == 0] == EOT)  # EOT never inside a segment


def test_targets_across_documents_are_masked():
    tokens, segments = pack(_docs(), seq_len=7, eot=EOT)
    batch = to_batch(tokens, segments)
    np.testing.assert_array_equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    # Masked exactly where the target is the next document's separator.
    np.testing.assert_array_equal(batch.loss_mask == 0, (batch.targets == EOT))


def test_corpus_smaller_than_one_sequence():
    with pytest.raises(ValueError, match="fewer than one sequence"):
        pack([[1, 2], [3]], seq_len=8, eot=EOT)


def test_order_is_deterministic_and_each_epoch_is_a_permutation():
    tokens, segments = pack(_docs(n=60), seq_len=7, eot=EOT)
    a, b = Batches(tokens, segments, 4, seed=1), Batches(tokens, segments, 4, seed=1)
    c = Batches(tokens, segments, 4, seed=2)
    for i in [0, 3, a.per_epoch + 1]:
        np.testing.assert_array_equal(a.batch(i).inputs, b.batch(i).inputs)
    assert not np.array_equal(a.batch(0).inputs, c.batch(0).inputs)
    seen = np.concatenate([a.batch(i).inputs for i in range(a.per_epoch)])
    # One epoch takes distinct rows: never more copies of a row than the corpus has.
    assert len(seen) == a.per_epoch * 4
    assert not Counter(r.tobytes() for r in seen) - Counter(r.tobytes() for r in tokens[:, :-1])
    resumed = next(a.iterate(start=5))
    np.testing.assert_array_equal(resumed.inputs, a.batch(5).inputs)


def test_too_few_rows_for_a_batch():
    tokens, segments = pack(_docs(n=3), seq_len=7, eot=EOT)
    with pytest.raises(ValueError, match="fewer than one batch"):
        Batches(tokens, segments, 64, seed=0)


def test_streaming_packs_the_same_rows():
    docs = _docs()
    tokens, segments = pack(docs, seq_len=7, eot=EOT)
    rows = list(pack_stream(iter(docs), seq_len=7, eot=EOT))
    np.testing.assert_array_equal(np.stack([r[0] for r in rows]), tokens)
    np.testing.assert_array_equal(np.stack([r[1] for r in rows]), segments)
    stream = StreamBatches(lambda: iter(docs), 7, EOT, batch_size=3)
    third = next(stream.iterate(start=2))
    np.testing.assert_array_equal(third.inputs, to_batch(tokens[6:9], segments[6:9]).inputs)
    # The stream is reopened when it runs out: more batches than one pass holds keep coming.
    many = list(itertools.islice(stream.iterate(), 3 * len(tokens) // 3))
    assert len(many) == 3 * len(tokens) // 3


def test_validation_split_is_disjoint_and_seeded():
    train, val = split_documents(100, 0.1, seed=3)
    assert len(val) == 10 and not set(train) & set(val) and len(train) + len(val) == 100
    np.testing.assert_array_equal(val, split_documents(100, 0.1, seed=3)[1])
    with pytest.raises(ValueError, match="too few"):
        split_documents(1, 0.5, seed=0)


def test_a_process_loads_its_rows_of_the_same_batches():
    """Several processes split each batch by rows (`rows`, from `Placement.process_rows`):
    their shares put together are the one-process batches, loaded or streamed, from any
    start."""
    docs = _docs(n=60)
    tokens, segments = pack(docs, seq_len=7, eot=EOT)
    halves = [slice(0, 2), slice(2, 4)]
    loaded = Batches(tokens, segments, 4, seed=1)
    streamed = StreamBatches(lambda: iter(docs), seq_len=7, eot=EOT, batch_size=4)
    for batches in (loaded, streamed):
        whole = list(itertools.islice(batches.iterate(3), 2))
        parts = [list(itertools.islice(batches.iterate(3, r), 2)) for r in halves]
        for i, batch in enumerate(whole):
            for field in batch._fields:
                joined = np.concatenate([getattr(part[i], field) for part in parts])
                np.testing.assert_array_equal(joined, getattr(batch, field))
    evaluation = [loaded.in_order(2, r) for r in halves]
    for i, batch in enumerate(loaded.in_order(2)):
        joined = np.concatenate([part[i].inputs for part in evaluation])
        np.testing.assert_array_equal(joined, batch.inputs)
