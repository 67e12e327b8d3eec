"""`generate`: a batch of prompts through the serving engine (infer/engine.py), all submitted at
once, with optional streaming of the new tokens in chunks.

The engine's shapes are bucketed (rows to a power of two, the cache span to a multiple of 256
tokens), so calls of other batch sizes or prompt lengths in the same buckets compile nothing.
"""

from collections.abc import Callable, Sequence

import numpy as np
from jaxtyping import PRNGKeyArray

from infer.engine import Engine
from infer.sampling import Sampler
from infer.speculative.draft import DraftModel
from infer.speculative.mtp import MTPDraft
from infer.speculative.proposer import Proposer
from infer.step import check_prompts, check_tokens
from shard import Placement
from zoo import arguments
from zoo.tokenizer import Tokenizer
from zoo.transformer import Transformer

OnTokens = Callable[[list[list[int]]], None]
SPAN = 256


def _bucket_rows(n: int) -> int:
    return 1 << (n - 1).bit_length()


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int] | np.ndarray],
    *,
    max_new_tokens: int | np.integer,
    sampler: Sampler,
    key: PRNGKeyArray,
    stop_tokens: Sequence[int] | None = None,
    tokenizer: Tokenizer | None = None,
    on_tokens: OnTokens | None = None,
    chunk_size: int | np.integer = 16,
    max_len: int | np.integer | None = None,
    placement: Placement | None = None,
    kv_dtype: str | None = None,
    speculative: Proposer | DraftModel | MTPDraft | None = None,
) -> list[list[int]]:
    """New tokens for each prompt (up to `max_new_tokens`, ending at the first stop token, which
    is included). The stop tokens are `stop_tokens`, by default the model's end of turn and end
    of sequence when its `tokenizer` is given (`tokenizer.stop_ids()`), else none.

    `prompts` is a list of prompts (each a list or 1-D array of token ids) or a 2-D array; each
    row's positions start at 0 at its first token. `on_tokens(new_tokens_per_row)` is called
    once every row has its first token, then whenever every running row has `chunk_size` more,
    and once at the end for the rest (the engine's token budget may finish some prompts a step
    before others: those rows are a token or so ahead). The engine's cache spans `max_len`
    tokens per row (default: the longest prompt + max_new_tokens, rounded up to a multiple of
    256, at most the model's max_seq_len), its pages in `kv_dtype` (the `Engine`'s: None, the
    compute dtype, or "int8"). Bad input is a ValueError before anything runs.

    Decode runs as the model's policy says: `zoo.load_pretrained` gives the fastest decode's
    layer storage (`Policy.inference`: stacked on one CPU device in float32, each projection's
    kernel reading its layer in place; one array per layer elsewhere); any model works the same,
    slower per token where a stacked weight's slice is copied (bfloat16, a mesh, a GPU:
    `model.for_decode()` converts once). Nothing copies the weights per call.
    Sharded generation: give the `placement` the model was created or loaded in
    (`shard.Placement(mesh, rules)`); the rows must divide by the mesh's batch axes.
    `speculative` a proposer of draft tokens (`infer.speculative.PromptLookup(k=4)`,
    `DraftModel`, `MTPDraft`: the `Engine`'s): the same tokens (greedy) or the same
    distribution (sampling), fewer target forwards.
    """
    config = arguments.instance(model, "model", Transformer, "zoo.load_pretrained(path)").config
    rows = check_prompts(prompts, config.vocab_size)
    max_new_tokens = arguments.count(max_new_tokens, "max_new_tokens")
    chunk_size = arguments.count(chunk_size, "chunk_size")
    max_len = arguments.optional_count(max_len, "max_len")
    arguments.callback(on_tokens, "on_tokens", "new tokens per row -> None")
    if tokenizer is not None:
        arguments.instance(tokenizer, "tokenizer", Tokenizer, "zoo.load_tokenizer(path)")
    if placement is not None:
        arguments.instance(placement, "placement", Placement, "shard.Placement(mesh, rules)")
    if stop_tokens is not None and not isinstance(stop_tokens, Sequence | np.ndarray):
        raise ValueError(f"stop_tokens must be a list of token ids, got {stop_tokens!r}")
    if stop_tokens is None:
        stop_tokens = () if tokenizer is None else tokenizer.stop_ids()
    stops = np.asarray(list(stop_tokens)).reshape(-1)
    check_tokens(stops if stops.size else stops.astype(np.int64), config.vocab_size, "stop_tokens")
    needed = max(row.size for row in rows) + max_new_tokens
    if max_len is not None and needed > max_len:
        raise ValueError(
            f"the longest prompt ({needed - max_new_tokens} tokens) + max_new_tokens "
            f"({max_new_tokens}) = {needed} exceeds the KV cache max_len={max_len}"
        )
    config.check_length(needed, "the longest prompt + max_new_tokens")
    span = max_len or min(-(-needed // SPAN) * SPAN, config.max_seq_len)
    # The engine compiles every step shape when it starts (the first call of a configuration;
    # later calls look them up), so no prompt length compiles anything later.
    batch = _bucket_rows(len(rows))
    engine = Engine(
        model,
        max_batch=batch,
        max_len=span,
        placement=placement,
        kv_dtype=kv_dtype,
        key=key,
        stop_tokens=stops.tolist(),
        speculative=speculative,
        first_prompts=[row.size for row in rows],
    )
    requests = [
        engine.submit(row.tolist(), max_new_tokens=max_new_tokens, sampler=sampler) for row in rows
    ]
    sent, next_emit = [0] * len(requests), 1
    while not all(r.done for r in requests):
        engine.step()
        # Stream when every running row has the next chunk (a finished row holds nobody up).
        running = [len(r.tokens) for r in requests if not r.done] or [max_new_tokens]
        if on_tokens is not None and min(running) >= next_emit:
            on_tokens([r.tokens[s:] for r, s in zip(requests, sent, strict=True)])
            sent, next_emit = [len(r.tokens) for r in requests], min(running) + chunk_size
    if on_tokens is not None and any(
        len(r.tokens) > s for r, s in zip(requests, sent, strict=True)
    ):
        on_tokens([r.tokens[s:] for r, s in zip(requests, sent, strict=True)])
    return [request.tokens for request in requests]
