"""Log-likelihoods under a model, in fixed-shape batches: the one primitive behind perplexity,
multiple-choice scoring and lm-eval's `loglikelihood` (training/evaluate.py,
training/lm_eval_adapter.py).

A request is token ids split into a context and a continuation; its score is the sum of
log p(continuation token | everything before it) and whether each continuation token is the
model's greedy choice. Rows are `<context><continuation>` left-cut to the window (the model's
`max_seq_len` or less) and right-padded to a length bucket (a power of two from 64), batches to
`batch_size` rows: a handful of shapes, each compiled once (`SCORE_TRACES` counts them), however
many requests and lengths come. A padded row lives in a segment of its own and counts nothing.

Perplexity scores a document as rolling windows: the document, preceded by `<|endoftext|>`,
cut into windows of `window` predicted tokens, each token predicted once, with the window's
earlier tokens as its context (lm-eval's `loglikelihood_rolling` with no overlap).
"""

import collections
from collections.abc import Sequence
from typing import NamedTuple

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax

from zoo import Transformer

SCORE_TRACES = collections.Counter()
MIN_BUCKET = 64


class Scored(NamedTuple):
    """One request's summed continuation log-probability (nats), its continuation token count,
    and whether every continuation token was the model's argmax."""

    logprob: float
    tokens: int
    greedy: bool


@eqx.filter_jit
def _score(model: Transformer, tokens, segments, mask):
    """Per row: (summed log-prob of the masked targets, all masked targets are the argmax)."""
    SCORE_TRACES[tokens.shape] += 1
    logits = model(tokens[:, :-1], segment_ids=segments[:, :-1]).astype(jnp.float32)
    targets = tokens[:, 1:]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    m = mask[:, 1:]
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == targets) | ~m, axis=-1)
    return -jnp.sum(nll * m, axis=-1), greedy


def bucket(length: int, limit: int) -> int:
    """The row length for `length` tokens: the next power of two from `MIN_BUCKET`, at most
    `limit`."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), limit)


def score(
    model: Transformer,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 8,
    window: int | None = None,
) -> list[Scored]:
    """The `Scored` of each (context ids, continuation ids) request. The context is cut from the
    left so that a row holds at most `window + 1` tokens (default: the model's max_seq_len + 1);
    a continuation longer than the window, or empty, is an error naming the request."""
    limit = (window or model.config.max_seq_len) + 1
    rows = []
    for index, (context, continuation) in enumerate(requests):
        if not continuation:
            raise ValueError(f"request {index} has an empty continuation: nothing to score")
        if len(continuation) >= limit:
            raise ValueError(
                f"request {index}'s continuation is {len(continuation)} tokens, more than the "
                f"window of {limit - 1} the model scores at once"
            )
        if not context:
            raise ValueError(
                f"request {index} has an empty context: its first token would have nothing to "
                "be predicted from (prepend <|endoftext|>)"
            )
        ids = [*context, *continuation][-limit:]
        rows.append((ids, len(continuation)))
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))  # similar lengths together
    out: list[Scored | None] = [None] * len(rows)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        length = bucket(max(len(rows[i][0]) for i in chunk), limit)
        tokens = np.zeros((batch_size, length), np.int32)
        segments = np.full((batch_size, length), 2, np.int32)
        mask = np.zeros((batch_size, length), bool)
        for r, i in enumerate(chunk):
            ids, n = rows[i]
            tokens[r, : len(ids)], segments[r, : len(ids)] = ids, 1
            mask[r, len(ids) - n : len(ids)] = True
        logprob, greedy = map(np.asarray, _score(model, tokens, segments, mask))
        for r, i in enumerate(chunk):
            out[i] = Scored(float(logprob[r]), rows[i][1], bool(greedy[r]))
    return out


def rolling_requests(ids: Sequence[int], eot: int, window: int) -> list[tuple[list, list]]:
    """A document's token ids as (context, continuation) requests that predict every token
    once: `<|endoftext|>` + the ids cut into windows of `window` tokens, each window's context
    the token before it (the window's own earlier tokens are context inside its row)."""
    full = [eot, *ids]
    return [
        (full[start - 1 : start], full[start : start + window])
        for start in range(1, len(full), window)
    ]


class Perplexity(NamedTuple):
    """Summed NLL (nats) over `tokens` predicted tokens of documents holding `bytes` UTF-8
    bytes: perplexity exp(nll / tokens), bits per byte nll / ln 2 / bytes."""

    nll: float
    tokens: int
    bytes: int

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll / self.tokens))

    @property
    def bits_per_byte(self) -> float:
        return self.nll / np.log(2.0) / self.bytes

    def as_dict(self) -> dict[str, float]:
        return {
            "nll_per_token": self.nll / self.tokens,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
            "tokens": self.tokens,
            "bytes": self.bytes,
        }


def perplexity(
    model: Transformer,
    encoding,
    texts: Sequence[str],
    *,
    window: int | None = None,
    batch_size: int = 8,
) -> Perplexity:
    """The perplexity and bits per byte of `texts` (each encoded with the tiktoken `encoding`,
    no special tokens) under `model`, in rolling windows of `window` tokens (default: the
    model's max_seq_len)."""
    window = window or model.config.max_seq_len
    requests, n_bytes = [], 0
    for text in texts:
        ids = encoding.encode_ordinary(text)
        requests += rolling_requests(ids, encoding.eot_token, window) if ids else []
        n_bytes += len(text.encode("utf-8"))
    if not requests:
        raise ValueError("the texts hold no tokens: nothing to score")
    scored = score(model, requests, batch_size=batch_size, window=window)
    return Perplexity(-sum(s.logprob for s in scored), sum(s.tokens for s in scored), n_bytes)
