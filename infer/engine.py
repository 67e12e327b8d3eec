"""`Engine`: the serving loop. Continuous batching over a paged KV cache, chunked prefill, per-row
samplers, streaming, prefix reuse.

- A fixed batch of `max_batch` rows. A request takes a free row when the page pool can hold its
  worst case (infer/pages.py); a finished row is freed at once and a waiting request joins at the
  next step. Requests submitted while `run()` is going join too.
- Two programs, both compiled when the engine starts and never again: a prefill step (each of up
  to `prefill_rows` requests writes its next `chunk` prompt tokens into its pages and, on its
  last chunk, samples its first token) and a decode step (every decoding row writes one token
  and samples the next). Every engine step runs one of each that has work, so prefills
  interleave with the others' decode. A prompt of any length up to `max_len` is a number of
  chunks: no new shapes, so no new compilation; `max_new_tokens`, stop tokens and sampler
  settings are host data or runtime arrays.
- The model's own forward does the work (`Transformer.forward` with a `PagedKVCache`); the
  engine keeps only host bookkeeping: rows, page tables, lengths, the pool's free list.

The host reads each step's new tokens (stop tokens, streaming and page allocation need them):
one device-to-host copy of `max_batch` ints per step.
"""

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray

from infer.pages import PagePool
from infer.sampling import Greedy, Sampler, SamplingParams, sample
from infer.step import check_prompts, check_tokens
from layers.kernels.paged import PallasDecodeKernel
from layers.paged_cache import PagedKVCache, pools_and_rings
from shard import Placement
from shard.rules import check_divisible
from zoo.math import kv_cache_bytes_per_token
from zoo.transformer import Transformer

OnTokens = Callable[[list[int]], None]

# How many times each program was traced (= compiled): the engine's programs depend only on
# shapes and static settings, so engines of one configuration share them.
TRACES = collections.Counter()


def _forward(
    model, pages, tokens, valid, table, lengths, rows, logits_at, decode_kernel, placement
):
    cache = PagedKVCache(pages, table, lengths, decode_kernel, rows)
    with placement.context():
        out = model.forward(tokens, segment_ids=valid, cache=cache, logits_at=logits_at)
    return out.logits[:, 0], out.cache.layers


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("decode_kernel", "placement"))
def _prefill_program(
    model, pages, tokens, n_valid, table, lengths, rows, params, key, *, decode_kernel, placement
):
    """Rows `[prefill_rows, chunk]`: row r (the engine's row `rows[r]`) writes its first
    `n_valid[r]` tokens (none when 0) and samples from the logits of its last one."""
    TRACES["prefill"] += 1
    valid = (jnp.arange(tokens.shape[1])[None, :] < n_valid[:, None]).astype(jnp.int32)
    last = jnp.maximum(n_valid - 1, 0)[:, None]
    logits, pages = _forward(
        model, pages, tokens, valid, table, lengths, rows, last, decode_kernel, placement
    )
    return pages, sample(logits, params, key)


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("decode_kernel", "placement"))
def _decode_program(
    model, pages, tokens, active, table, lengths, params, key, *, decode_kernel, placement
):
    """Every active row writes one token at its next position and samples the next."""
    TRACES["decode"] += 1
    valid = active[:, None].astype(jnp.int32)
    at = jnp.zeros((tokens.shape[0], 1), jnp.int32)
    logits, pages = _forward(
        model, pages, tokens[:, None], valid, table, lengths, None, at, decode_kernel, placement
    )
    return pages, sample(logits, params, key)


@dataclasses.dataclass(eq=False)
class Request:
    """One submitted prompt. `tokens` grows as the engine generates (ending with the stop token
    that ended it, if any); `done` once finished; `error` if a callback of it failed (the
    others go on). `ttft_s` and `decode_s` time it: submit to first token, first to last."""

    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    stop_tokens: frozenset[int]
    on_tokens: OnTokens | None
    tokens: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    error: Exception | None = None
    ttft_s: float | None = None
    decode_s: float | None = None
    reused_tokens: int = 0
    # Engine bookkeeping.
    row: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    cached: int = 0  # prompt tokens in the cache
    reserved: int = 0  # pages reserved and not yet allocated
    submitted: float = 0.0
    first_token: float = 0.0


class Engine:
    """`Engine(model, max_batch=8, max_len=1024)`; `engine.submit(prompt, max_new_tokens=...)`
    returns a `Request`; `engine.run()` steps until every request is done.

    `page_size` tokens per page (a power of two dividing 64); `n_pages` in the pool (default:
    enough for `max_batch` rows of `max_len`, plus the scratch page); `chunk` prompt tokens per
    prefill step (a multiple of 16: flash tiles); `prefill_rows` requests prefilled per step;
    `decode_kernel` a paged attention kernel for decode steps (`PallasDecodeKernel()` on a GPU;
    default: gather each row's pages and run the model's own kernel); `placement` where the
    model lives (pools and batches follow it); `window_cache` gives each sliding layer whose
    window is shorter than `max_len` a ring of its window per row instead of pages
    (layers/window_cache.py: Gemma's local layers, Mistral's window); `prefix_sharing` reuses
    full pages of prompts that start alike (a shared system prompt is prefilled once), default
    on unless a layer keeps a ring (a ring holds one row's own tokens, so a shared prefix could
    not fill it: choose `window_cache=False` to share prefixes); `warm_up` compiles both
    programs now (an engine of the same configuration compiled before shares them).

    Use a model with unrolled layers (`model.unstacked()`) where per-layer arrays decode faster
    (XLA:CPU); the engine never copies the weights.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        max_batch: int,
        max_len: int,
        page_size: int = 16,
        n_pages: int | None = None,
        chunk: int = 64,
        prefill_rows: int = 1,
        decode_kernel: PallasDecodeKernel | None = None,
        placement: Placement | None = None,
        window_cache: bool = True,
        prefix_sharing: bool | None = None,
        key: PRNGKeyArray | None = None,
        warm_up: bool = True,
    ):
        for name, value in [("max_batch", max_batch), ("max_len", max_len), ("chunk", chunk),
                            ("prefill_rows", prefill_rows)]:  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine {name} must be a positive int, got {value!r}")
        if page_size < 1 or page_size & (page_size - 1) or 64 % page_size:
            raise ValueError(
                f"Engine page_size must be a power of two dividing 64, got {page_size}"
            )
        if chunk % 16:
            raise ValueError(f"Engine chunk must be a multiple of 16 (flash tiles), got {chunk}")
        if prefill_rows > max_batch:
            raise ValueError(f"Engine prefill_rows={prefill_rows} exceeds max_batch={max_batch}")
        model.config.check_length(max_len, "Engine max_len")
        if decode_kernel is not None and any(stack.stacked for stack in model.stacks):
            raise ValueError(
                "the paged decode kernel reads one layer's pool at a time: give the engine a "
                "model with unrolled layers (model.unstacked()), or no decode_kernel"
            )
        self.model, self.max_batch, self.max_len = model, max_batch, max_len
        self.page_size, self.chunk, self.prefill_rows = page_size, chunk, prefill_rows
        # Each row's table spans a multiple of 64 tokens: the gathered view fits flash's tiles.
        span = -(-max_len // 64) * 64
        self.row_pages = span // page_size
        n_pages = n_pages if n_pages is not None else max_batch * self.row_pages + 1
        self.pool = PagePool(n_pages, page_size)
        self.decode_kernel = decode_kernel
        self.placement = placement or Placement()
        self.key = jax.random.key(0) if key is None else key
        self.steps = 0
        self.prefill_tokens = 0  # prompt tokens computed
        self.pages = self.placement.place_arrays(
            model.init_pages(
                n_pages, page_size, rows=max_batch if window_cache else 0, span=max_len
            )
        )
        pools, rings = pools_and_rings(self.pages)
        nbytes = lambda layers: sum(x.nbytes for x in jax.tree.leaves(layers))  # noqa: E731
        self.page_bytes, self.ring_bytes = nbytes(pools) // n_pages, nbytes(rings) // max_batch
        if prefix_sharing and self.ring_bytes:
            raise ValueError(
                "Engine prefix_sharing=True, but the model's sliding layers keep rings of their "
                "window per row (window_cache=True), which a shared prefix cannot fill; pass "
                "window_cache=False (full-length pages for every layer) to share prefixes"
            )
        self.prefix_sharing = not self.ring_bytes if prefix_sharing is None else prefix_sharing
        self.peak_bytes = 0
        if self.placement.sharded:
            for rows, what in ((max_batch, "max_batch"), (prefill_rows, "prefill_rows")):
                spec = self.placement.batch_sharding("batch").spec
                check_divisible(f"Engine {what}", (rows,), ("batch",), spec,
                                dict(self.placement.mesh.shape))  # fmt: skip
        self.table = np.zeros((max_batch, self.row_pages), np.int32)
        self.lengths = np.zeros(max_batch, np.int32)
        self.rows: list[Request | None] = [None] * max_batch
        self.waiting: list[Request] = []
        self._prefill = functools.partial(
            _prefill_program, decode_kernel=decode_kernel, placement=self.placement
        )
        self._decode = functools.partial(
            _decode_program, decode_kernel=decode_kernel, placement=self.placement
        )
        if warm_up:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile both programs now (rows idle: nothing written), not on the first request."""
        rows = self.prefill_rows
        idle = Greedy().params().broadcast(rows)
        self.pages, _ = self._prefill(
            self.model, self.pages, np.zeros((rows, self.chunk), np.int32),
            np.zeros(rows, np.int32), self.table[:rows], self.lengths[:rows],
            np.zeros(rows, np.int32), idle, self.key,
        )  # fmt: skip
        b = self.max_batch
        self.pages, _ = self._decode(
            self.model, self.pages, np.zeros(b, np.int32), np.zeros(b, bool), self.table,
            self.lengths, Greedy().params().broadcast(b), self.key,
        )  # fmt: skip

    # --- requests ---------------------------------------------------------------------------

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # The last new token is returned, never written: it needs no slot.
        return -(-(prompt_len + max_new_tokens - 1) // self.page_size)

    def submit(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampler: Sampler | None = None,
        stop_tokens: Sequence[int] = (),
        on_tokens: OnTokens | None = None,
    ) -> Request:
        """Queue a prompt (a list of token ids). Bad input is a ValueError here, before it can
        disturb anything in flight: an empty prompt, ids outside the vocabulary, a prompt plus
        `max_new_tokens` beyond `max_len` or beyond the whole page pool."""
        (row,) = check_prompts([prompt], self.model.config.vocab_size)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        total = row.size + max_new_tokens
        if total > self.max_len:
            raise ValueError(
                f"the prompt ({row.size} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds the engine's max_len={self.max_len}"
            )
        if self.pages_needed(row.size, max_new_tokens) > self.pool.usable:
            raise ValueError(
                f"the prompt ({row.size} tokens) + max_new_tokens ({max_new_tokens}) needs "
                f"{self.pages_needed(row.size, max_new_tokens)} pages of {self.page_size} tokens "
                f"but the pool holds {self.pool.usable}; give the engine more n_pages"
            )
        stops = np.asarray(list(stop_tokens)).reshape(-1)
        check_tokens(stops if stops.size else stops.astype(np.int64),
                     self.model.config.vocab_size, "stop_tokens")  # fmt: skip
        request = Request(
            prompt=[int(t) for t in row],
            max_new_tokens=max_new_tokens,
            sampler=sampler if sampler is not None else Greedy(),
            stop_tokens=frozenset(int(t) for t in stops),
            on_tokens=on_tokens,
            submitted=time.perf_counter(),
        )
        request.sampler.params()  # a bad sampler fails here, not mid-batch
        self.waiting.append(request)
        return request

    def run(self) -> None:
        """Step until every submitted request (including those submitted meanwhile) is done."""
        while self.waiting or any(self.rows):
            self.step()

    # --- one engine step --------------------------------------------------------------------

    def step(self) -> None:
        self._admit()
        # A request whose prefill ends in this step decodes from the next one.
        decoding = [r for r in self.rows if r is not None and r.cached == len(r.prompt)]
        prefilling = [r for r in self.rows if r is not None and r.cached < len(r.prompt)]
        if prefilling:
            self._prefill_chunk(prefilling[: self.prefill_rows])
        decoding = [r for r in decoding if not r.done]
        if decoding:
            self._decode_rows(decoding)
        self.steps += 1
        self.peak_bytes = max(self.peak_bytes, self.kv_bytes_in_use())

    def _admit(self) -> None:
        """Waiting requests, oldest first, into free rows while the pool can hold them."""
        while self.waiting and None in self.rows:
            request = self.waiting[0]
            shared = self._shared_prefix(request)
            need = self.pages_needed(len(request.prompt), request.max_new_tokens) - len(shared)
            if not self.pool.reserve(need):
                self.pool.release(shared)
                return
            self.waiting.pop(0)
            request.row, request.reserved, request.pages = self.rows.index(None), need, shared
            request.cached = request.reused_tokens = len(shared) * self.page_size
            self.rows[request.row] = request
            self.table[request.row] = 0
            self.table[request.row, : len(shared)] = shared
            self.lengths[request.row] = request.cached

    def _shared_prefix(self, request: Request) -> list[int]:
        """Cached pages of the prompt's leading full pages; at least one prompt token is left
        to compute (its logits give the first new token)."""
        if not self.prefix_sharing:
            return []
        shared = []
        for key in self.pool.prefix_keys(request.prompt[:-1]):
            page = self.pool.lookup(key)
            if page is None:
                break
            shared.append(page)
        return shared

    def _cover(self, request: Request, n_tokens: int) -> None:
        """Allocate pages until the request's first `n_tokens` positions have one."""
        while len(request.pages) * self.page_size < n_tokens:
            page = self.pool.allocate()
            request.reserved -= 1
            self.table[request.row, len(request.pages)] = page
            request.pages.append(page)

    def _params(self, requests: list[Request | None]) -> SamplingParams:
        rows = [(r.sampler if r is not None else Greedy()).params() for r in requests]
        return jax.tree.map(lambda *x: jnp.concatenate(x), *rows)

    def _next_key(self) -> PRNGKeyArray:
        return jax.random.fold_in(self.key, self.steps)

    def _prefill_chunk(self, requests: list[Request]) -> None:
        rows = self.prefill_rows
        tokens = np.zeros((rows, self.chunk), np.int32)
        n_valid = np.zeros(rows, np.int32)
        table = np.zeros((rows, self.row_pages), np.int32)
        lengths, owners = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
        for i, r in enumerate(requests):
            n = min(self.chunk, len(r.prompt) - r.cached)
            self._cover(r, r.cached + n)
            tokens[i, :n] = r.prompt[r.cached : r.cached + n]
            n_valid[i], table[i], lengths[i], owners[i] = n, self.table[r.row], r.cached, r.row
        padded = requests + [None] * (rows - len(requests))
        self.pages, first = self._prefill(
            self.model, self.pages, tokens, n_valid, table, lengths, owners,
            self._params(padded), self._next_key(),
        )  # fmt: skip
        first = np.asarray(first)
        for i, r in enumerate(requests):
            r.cached += int(n_valid[i])
            self.prefill_tokens += int(n_valid[i])
            self.lengths[r.row] = r.cached
            if r.cached == len(r.prompt):
                self._share_pages(r, r.prompt)
                r.first_token = time.perf_counter()
                r.ttft_s = r.first_token - r.submitted
                self._emit(r, int(first[i]))

    def _share_pages(self, request: Request, tokens: list[int]) -> None:
        """Offer the full pages holding `tokens` (the request's first ones) for reuse."""
        if self.prefix_sharing:
            for key, page in zip(self.pool.prefix_keys(tokens), request.pages, strict=False):
                self.pool.share(key, page)

    def _decode_rows(self, requests: list[Request]) -> None:
        tokens = np.zeros(self.max_batch, np.int32)
        active = np.zeros(self.max_batch, bool)
        for r in requests:
            self._cover(r, int(self.lengths[r.row]) + 1)
            tokens[r.row], active[r.row] = r.tokens[-1], True
        self.pages, new = self._decode(
            self.model, self.pages, tokens, active, self.table, self.lengths,
            self._params(self.rows), self._next_key(),
        )  # fmt: skip
        new = np.asarray(new)
        for r in requests:
            self.lengths[r.row] += 1
            self._emit(r, int(new[r.row]))

    def _emit(self, request: Request, token: int) -> None:
        """Record a new token, stream it, and finish the request at a stop token or its
        budget (a failing callback finishes only its own request)."""
        request.tokens.append(token)
        if request.on_tokens is not None:
            try:
                request.on_tokens([token])
            except Exception as error:
                request.error = error
                self._finish(request)
                return
        if token in request.stop_tokens or len(request.tokens) >= request.max_new_tokens:
            self._finish(request)

    def _finish(self, request: Request) -> None:
        # What the request wrote (its prompt and all but its last new token) stays reusable:
        # the next turn of a conversation starts with it.
        written = int(self.lengths[request.row])
        self._share_pages(request, (request.prompt + request.tokens)[:written])
        request.done = True
        request.decode_s = time.perf_counter() - request.first_token
        self.pool.release(request.pages)
        self.pool.unreserve(request.reserved)
        self.rows[request.row] = None
        self.lengths[request.row] = 0
        request.pages, request.reserved = [], 0

    # --- what it holds ----------------------------------------------------------------------

    def kv_bytes_in_use(self) -> int:
        """Bytes of the pages that running requests hold (shared pages once), plus the rings
        of the rows they occupy."""
        rows = sum(r is not None for r in self.rows)
        return self.pool.in_use * self.page_bytes + rows * self.ring_bytes

    def peak_kv_bytes(self) -> int:
        """The most bytes of KV cache that running requests held at once."""
        return self.peak_bytes

    def contiguous_kv_bytes(self) -> int:
        """What a contiguous cache of `max_batch x max_len` with full-length layers would hold."""
        per_token = kv_cache_bytes_per_token(self.model.config, self.model.policy)
        return self.max_batch * self.max_len * per_token
