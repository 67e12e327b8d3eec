"""Preference data (chosen vs rejected responses to one prompt) as token pairs with response
masks, for DPO and its variants (training/preference.py).

A row holds a prompt and two responses, in one of TRL's layouts:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                   strings
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}     conversations: the
        prompt's turns, then each side's assistant turn(s) (the last one is the response)
    {"chosen": [messages], "rejected": [messages]}                           whole conversations
        sharing every turn but the last assistant one (the prompt is what they share)

Each side is the conversation (prompt + response) rendered with the checkpoint's chat template
and encoded whole, as supervised fine-tuning does (data/supervised.py); the response mask flags
the last assistant turn's tokens alone, so a preference loss sees log pi(response | prompt).
Without a template (a plain BPE) a side is the prompt text followed by the response text.

A pair is laid out as two rows `[2, seq_len + 1]` (chosen first), each `<|endoftext|>` +
the conversation + padding in a segment of its own: one pair per row pair, no packing, so a
sequence's log-probability is a sum over its own row. Bad rows are errors naming the row: a
missing or null side, a side that is not a string or a list of messages, identical chosen and
rejected responses, a response longer than `--seq-len` without `--truncate`.
"""

import dataclasses
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from data.formats import row_messages
from data.packing import Batches, Example, to_batch
from data.supervised import Counts, encode_example

SIDES = ("chosen", "rejected")


class PreferenceBatch(NamedTuple):
    """One batch of pairs: `inputs`, `targets`, `segment_ids`, `loss_mask` are `[pairs, 2, seq]`
    (index 0 chosen, 1 rejected; the mask on response targets only); `reference` `[pairs, 2]`
    holds the reference model's summed response log-probabilities (zeros for losses without a
    reference)."""

    inputs: np.ndarray
    targets: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    reference: np.ndarray


def _side(row: Mapping[str, Any], number: int, side: str) -> Any:
    value = row.get(side)
    if value is None:
        other = SIDES[1 - SIDES.index(side)]
        raise ValueError(
            f"row {number} has no {side!r} response (it is missing or null): a preference row "
            f"needs both 'chosen' and '{other}'; fill it in or drop the row"
        )
    return value


def _is_messages(value: Any) -> bool:
    return isinstance(value, list)


def row_pair(
    row: Mapping[str, Any], number: int, roles: Collection[str]
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Row `number` (1-based) as two conversations (chosen, rejected) that differ only in their
    last assistant turn. Raises ValueError naming the row for the bad rows of the module
    docstring."""
    chosen, rejected = (_side(row, number, side) for side in SIDES)
    prompt = row.get("prompt")
    sides = []
    for side, value in zip(SIDES, (chosen, rejected), strict=True):
        if isinstance(value, str):
            if prompt is None:
                raise ValueError(
                    f"row {number}: {side!r} is a string but the row has no 'prompt': give the "
                    "prompt the responses answer, or write each side as a list of messages"
                )
            value = [{"role": "assistant", "content": value}]
        elif not _is_messages(value):
            raise ValueError(
                f"row {number}: {side!r} is {type(value).__name__} {value!r:.60}, not a string "
                'or a list of {"role": ..., "content": ...} messages'
            )
        if prompt is None:
            head = []
        elif isinstance(prompt, str):
            head = [{"role": "user", "content": prompt}]
        elif _is_messages(prompt):
            head = list(prompt)
        else:
            raise ValueError(
                f"row {number}: 'prompt' is {type(prompt).__name__} {prompt!r:.60}, not a "
                "string or a list of messages"
            )
        messages = row_messages({"messages": head + value}, "chat", number, roles)
        if messages[-1]["role"] != "assistant":
            raise ValueError(
                f"row {number}: the {side!r} conversation ends with a {messages[-1]['role']!r} "
                "turn; its last turn must be the assistant's response"
            )
        sides.append(messages)
    if sides[0][:-1] != sides[1][:-1]:
        raise ValueError(
            f"row {number}: 'chosen' and 'rejected' differ before their last assistant turn; a "
            "pair answers one prompt, so everything before the responses must be the same"
        )
    if sides[0][-1]["content"] == sides[1][-1]["content"]:
        raise ValueError(
            f"row {number}: 'chosen' and 'rejected' are the same response "
            f"({sides[0][-1]['content']!r:.60}), which says nothing to prefer; drop the row"
        )
    return sides[0], sides[1]


def encode_pair(tokenizer, chosen: list[dict], rejected: list[dict]) -> tuple[Example, Example]:
    """Both sides as token ids with their response flags (the last assistant turn)."""
    sides = (chosen, rejected)
    return tuple(encode_example(tokenizer, side, last_answer_only=True) for side in sides)


def fit_pairs(
    pairs: Iterable[tuple[int, tuple[Example, Example]]],
    seq_len: int,
    *,
    truncate: bool,
    counts: Counts,
) -> Iterator[tuple[Example, Example]]:
    """The (row number, pair) items whose sides fit a row of `seq_len` tokens: a longer side is
    an error naming its row, or with `truncate` cut, and the pair dropped if a side keeps no
    response token. `counts` tallies pairs (`examples`), cut and dropped pairs, and tokens."""
    for number, pair in pairs:
        longest = max(len(side.ids) for side in pair)
        if longest > seq_len:
            if not truncate:
                raise ValueError(
                    f"row {number} has a response of {longest} tokens with its prompt, more than "
                    f"--seq-len {seq_len}: pass --truncate to cut such pairs (those left without "
                    "a response token are dropped), or raise --seq-len"
                )
            pair = tuple(Example(s.ids[:seq_len], s.answer[:seq_len]) for s in pair)
            counts.truncated += 1
            if not all(np.any(s.answer) for s in pair):
                counts.dropped += 1
                continue
        counts.examples += 1
        counts.answer_tokens += sum(int(np.sum(s.answer)) for s in pair)
        counts.tokens += sum(len(s.ids) for s in pair)
        yield pair


def pair_rows(
    pairs: Iterable[tuple[Example, Example]], seq_len: int, eot: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, segment ids and response flags, each `[pairs, 2, seq_len + 1]` (see the module
    docstring)."""
    row_len = seq_len + 1
    tokens, segments, answers = [], [], []
    for pair in pairs:
        for side in pair:
            n = len(side.ids) + 1
            tokens.append([eot, *side.ids] + [eot] * (row_len - n))
            segments.append([1] * n + [2] * (row_len - n))
            answers.append([False, *map(bool, side.answer)] + [False] * (row_len - n))
    if not tokens:
        raise ValueError("no preference pairs: the data holds none with a response token")
    shape = (-1, 2, row_len)
    return (
        np.asarray(tokens, np.int32).reshape(shape),
        np.asarray(segments, np.int32).reshape(shape),
        np.asarray(answers, bool).reshape(shape),
    )


@dataclasses.dataclass(frozen=True)
class PreferenceBatches:
    """Random-access batches of pairs in `Batches`' seeded epoch order (a pure function of
    (pairs, seed, index): resumable), each a `PreferenceBatch`; `reference` `[pairs, 2]` is the
    cached reference log-probability of every side (`with_reference` sets it)."""

    pairs: Batches
    reference: np.ndarray

    @staticmethod
    def of(
        tokens: np.ndarray, segments: np.ndarray, answers: np.ndarray, batch_size: int, seed: int
    ) -> "PreferenceBatches":
        if len(tokens) < batch_size:
            raise ValueError(
                f"the data holds {len(tokens)} preference pairs, fewer than one batch of "
                f"--batch-size={batch_size}: use more pairs or a smaller --batch-size"
            )
        pairs = Batches(tokens, segments, batch_size, seed, answers)
        return PreferenceBatches(pairs, np.zeros(tokens.shape[:2], np.float32))

    def __len__(self) -> int:
        return len(self.pairs.tokens)

    def with_reference(self, reference: np.ndarray) -> "PreferenceBatches":
        if reference.shape != self.reference.shape:
            raise ValueError(
                f"reference log-probabilities of shape {reference.shape} do not match the "
                f"{self.reference.shape} sides of the data"
            )
        return dataclasses.replace(self, reference=reference.astype(np.float32))

    def _batch(self, rows) -> PreferenceBatch:
        p = self.pairs
        batch = to_batch(p.tokens[rows], p.segments[rows], p.answers[rows])
        return PreferenceBatch(*batch, reference=self.reference[rows])

    def batch(self, index: int) -> PreferenceBatch:
        return self._batch(self.pairs.rows(index))

    def iterate(self, start: int = 0) -> Iterator[PreferenceBatch]:
        return (self.batch(i) for i in range(start, 2**62))

    def in_order(self, n_batches: int, batch_size: int | None = None) -> list[PreferenceBatch]:
        """The first `n_batches` batches without shuffling (fixed evaluation batches)."""
        b = batch_size or self.pairs.batch_size
        n = min(n_batches, len(self) // b)
        return [self._batch(slice(i * b, (i + 1) * b)) for i in range(n)]

    def all_in_order(self, batch_size: int) -> Iterator[tuple[slice, PreferenceBatch]]:
        """Every pair once, in order, in batches of `batch_size` (the last one padded by
        repeating its final pair, so every batch has one shape): (the pairs it holds, batch)."""
        n = len(self)
        for start in range(0, n, batch_size):
            rows = np.minimum(np.arange(start, start + batch_size), n - 1)
            yield slice(start, min(start + batch_size, n)), self._batch(rows)
