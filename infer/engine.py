"""`Engine`: the serving loop. Continuous batching over a paged KV cache, chunked prefill riding
along with decode in one program per step, per-row samplers, stop checks on the device, the host
one step behind, streaming, prefix reuse, preemption.

- A fixed batch of `max_batch` rows. A request takes a free row when the page pool holds its
  prompt; a finished row is freed and a waiting request joins at the next step. Requests submitted
  while `run()` is going join too.
- One forward per step: a ragged batch of tokens run as one forward over the paged cache
  (layers/token_groups.py), so the weights are read once per step. Sampling, verification, stop
  checks and log-probabilities follow in a second program whose shapes are the rows' alone
  (each row samples from one group of logits the forward lays out), so one sampling program
  serves every step shape: its compile work is paid once per engine (and once for engines of
  the same rows and vocabulary), not once per shape. A step holds at most
  `token_budget` tokens (vLLM's scheduler): every decoding row's next token first, then prompt
  chunks of `chunk` tokens, oldest request first, as many as fit: several prompts' chunks, and
  several consecutive chunks of one prompt, in one step. Attention reads only the pages each row
  holds. The prompt part comes in a few fixed sizes (`Engine.prompt_shapes`: 1, 4, 16, ...
  chunks up to the budget; a step takes the largest size its waiting chunks fill, so padding is
  at most each prompt's last chunk, or, when no row decodes, the smallest size that holds them
  all where its padding costs less than the steps it saves: `prompt_part`), each one compiled
  forward. All are lowered when the engine starts, beside the decode-only one, and compiled on
  background threads (infer/compiling.py): the smallest prompt part's at once (a new request's
  first step waits for them), the larger ones ahead, while no engine holds a request. A step
  takes only prompt parts whose programs are compiled (hurrying the one it would rather take),
  so no step waits for a program made ahead. No prompt length, batch mix or sampler setting
  makes a new program (`TRACES` counts them).
- The device keeps what the next step needs: each row's last token, how many it generated and
  whether it is done (a stop token or its budget). Sampling, stop checks and the per-row sampler
  settings and stop tokens (uploaded when a request joins) live there, so the host dispatches step
  k+1 before it reads step k's tokens and its Python bookkeeping (streaming, freeing rows and
  pages) overlaps the device.
- Speculative decoding (`speculative=`, infer/speculative/): a decoding row's group holds its last
  token and up to `k` proposed tokens, verified by the same forward (the decode run of groups is
  `k_max + 1` wide; a row's `k` is data, so no `k` or acceptance compiles anything new); the
  device accepts, draws the extra token, and reports up to `k + 1` tokens per row. Rejected
  tokens are rolled back by the row's length: their pages stay with the row and are written over.
  The host proposes from the tokens it has read, so a speculating engine reads each step's
  tokens before it dispatches the next.
- Log-probabilities (`submit(..., logprobs=N)`, N up to `MAX_LOGPROBS`): the step also reports
  each emitted token's log-probability and the N most likely tokens at its position, from the
  model's raw distribution (`TokenLogprob`); computed only in steps where some row asks.
- Pages are allocated as tokens arrive. When the pool runs dry, the youngest running request is
  preempted: its pages go back, it returns to the head of the queue and is recomputed (its prompt
  and the tokens it already has, prefilled again) when pages free up; its tokens are kept.
- The model's own forward does the work (`Transformer.forward` with a `PagedKVCache`); the
  engine keeps only host bookkeeping: rows, page tables, lengths, the pool's free list.
"""

import collections
import concurrent.futures
import dataclasses
import functools
import math
import threading
import time
import typing
import weakref
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32
from jaxtyping import Array, Bool, Float, Int, Key, PRNGKeyArray, UInt32

from infer.compiling import Compile, Hold, compile_soon
from infer.pages import PagePool
from infer.rows import committed, pin_rows, row_sharding
from infer.sampling import Greedy, Sampler, SamplingParams, check_settings, sample
from infer.speculative.adaptive import GIVE_UP, Acceptance, StepCosts, drafts_that_pay
from infer.speculative.draft import DraftModel, DraftRunner
from infer.speculative.mtp import MTPDraft, MTPRunner, chunk_next_tokens
from infer.speculative.proposer import Proposer
from infer.speculative.verify import verify
from infer.step import check_prompts, check_tokens
from infer.step_plan import PlanLayout, StepPlan, pack
from layers.kernels.quantized import kernel_tokens
from layers.lora_bank import adapters_in, with_adapter_rows
from layers.paged_cache import PagedKVCache, check_kv_dtype, pools_and_rings
from layers.quantized import PackedWeight
from shard import Placement
from shard.rules import check_divisible
from zoo import arguments
from zoo.math import kv_cache_bytes_per_token
from zoo.transformer import Transformer

OnTokens = Callable[[list[int]], None]
# A constrained request's allowed next tokens, asked just before each step that samples for it
# (after its previous token was streamed): an int32 bitmask [allowed_words(vocab)].
AllowedTokens = Callable[[], np.ndarray]
Count = int | np.integer  # numpy's integers count too
# The most alternatives per token a request may ask for (`submit(logprobs=)`, OpenAI's limit on
# top_logprobs): the step always has room for this many, so no request's setting compiles anything.
MAX_LOGPROBS = 20
# The step's defaults (token budget and prompt shapes), measured on the mixed-requests bench
# (bench/engine.py, bench/RESULTS.md): prompt tokens of a step beside the decode rows, tokens per
# prompt chunk, and the ratio of one prompt-part size to the next.
PROMPT_TOKENS = 256
CHUNK = 16
SHAPE_STEP = 4
# What a step costs beyond its tokens, in prompt tokens: a prompt part padded by up to this many
# tokens per step it saves goes in fewer steps (`prompt_part`). SmolLM2's packed steps on this
# CPU cost about 40 ms + 1.2 ms a token (bench/RESULTS.md, "A new prompt's chunks in one step").
STEP_TOKENS = 32

# Times each decode-only program is timed at an adaptive engine's warm-up (the median counts:
# one slow step on a shared machine does not decide).
WARM_UP_TIMINGS = 3
# How many times each program was traced (= compiled): the engine's programs depend only on
# shapes and static settings, so engines of one configuration share them.
TRACES = collections.Counter()


class RowState(eqx.Module):
    """What the device carries from step to step, per row: the page pools (and rings), the last
    token (the next step's input), the tokens generated so far and whether the row is done."""

    pages: tuple
    last: Int[Array, " rows"]
    count: Int[Array, " rows"]
    done: Bool[Array, " rows"]


class RowParams(eqx.Module):
    """Each row's request settings on the device, uploaded when a request joins: its sampler,
    its stop tokens (`-1` pads), its budget of new tokens and its seed (a row's i-th new token
    is drawn with `draw_keys(key, seed, i)`: the same request and seed give the same tokens
    whatever else is in the batch), its LoRA adapter (-1: none; a model with
    `LoRABank`s, `zoo.bank_adapters`) and whether it wants log-probabilities."""

    sampling: SamplingParams
    stops: Int[Array, "rows stops"]
    budget: Int[Array, " rows"]
    seed: Int[Array, " rows"]
    adapter: Int[Array, " rows"]
    logprobs: Bool[Array, " rows"]


class Logprobs(eqx.Module):
    """A step's log-probabilities, laid out as its report's tokens: each row's emitted tokens'
    `[rows, group]`, and the most likely tokens at their positions with theirs `[rows, group,
    top]` (`top = min(MAX_LOGPROBS, vocab)`, most likely first). All zeros in a step where no
    row asked (nothing is computed then)."""

    chosen: Float[Array, "rows group"]
    top_tokens: Int[Array, "rows group top"]
    top: Float[Array, "rows group top"]


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the model and the most likely tokens at its
    position with theirs, most likely first (as many as the request asked for)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _logprobs(
    logits: Float[Array, "n vocab"], tokens: Int[Array, " n"], wanted: Bool[Array, " n"]
) -> tuple[Float[Array, " n"], Int[Array, "n top"], Float[Array, "n top"]]:
    """The log-softmax of the raw `logits` at each position: the emitted `tokens`' values and
    the most likely tokens'. Skipped (zeros) unless some position is `wanted`: a step where no
    row asks pays one predicate, not a softmax and a top-k over the vocabulary."""
    n, vocab = logits.shape
    top = min(MAX_LOGPROBS, vocab)

    def compute():
        scores = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        # XLA:GPU sorts a single row over the vocabulary with CUB (a custom call that keeps this
        # branch, and so the whole step, out of a command buffer: the host then waits for the
        # device every step); two rows take its own sort kernel (bench/RESULTS.md, H200).
        rows = scores if n > 1 else jnp.concatenate([scores, scores])
        best, best_tokens = jax.lax.top_k(rows, top)
        chosen = jnp.take_along_axis(scores, tokens[:, None], axis=1)[:, 0]
        return chosen, best_tokens[:n].astype(jnp.int32), best[:n]

    def skip():
        return jnp.zeros(n), jnp.zeros((n, top), jnp.int32), jnp.zeros((n, top))

    return jax.lax.cond(jnp.any(wanted), compute, skip)


def allowed_words(vocab_size: int) -> int:
    """int32 words of a row's allowed-token bitmask (bit `t % 32` of word `t // 32`)."""
    return -(-vocab_size // 32)


def _unpack_allowed(bits: Int[Array, "rows words"], vocab: int) -> Bool[Array, "rows vocab"]:
    token = jnp.arange(vocab)
    return (bits[:, token // 32] >> (token % 32)) & 1 == 1


def _stopped(tokens, stops, count, budget):
    return jnp.any(tokens[:, None] == stops, axis=1) | (count >= budget)


def draw_keys(
    key: UInt32[Array, "2"], seeds: Int[Array, " rows"], drawn: Int[Array, " rows"]
) -> Key[Array, " rows"]:
    """Each row's key for its next draw: the Threefry-2x32 hash (Salmon et al. 2011) of the
    counter (seed, tokens drawn so far) under the engine's draw `key` (`Engine.draw_key`). A
    request's i-th token depends only on its seed and i, never on the batch around it;
    distinct (seed, i) are distinct counters, so no two draws share a key. One hash per row
    where `fold_in(fold_in(key, seed), i)` hashed twice: each hash is a rolled loop of ~20
    kernels on XLA:CPU, compiled into every step program."""
    counters = jnp.concatenate([seeds, drawn]).astype(jnp.uint32)
    bits = threefry_2x32(key, counters).reshape(2, -1)
    return jax.random.wrap_key_data(bits.T, impl="threefry2x32")


def _cut_at_stops(tokens, n, stops, count, budget):
    """A row's run of `n` new tokens ends at its first stop token (kept) and at its budget:
    the tokens it emits and whether it is done."""
    stop = jnp.any(tokens[:, :, None] == stops[:, None, :], axis=2)
    stop &= jnp.arange(tokens.shape[1])[None, :] < n[:, None]
    n = jnp.where(jnp.any(stop, axis=1), jnp.argmax(stop, axis=1) + 1, n)
    n = jnp.clip(budget - count, 0, n)  # a row that is not live emits nothing (n = 0)
    return n, jnp.any(stop, axis=1) | (count + n >= budget)


class RowPlan(typing.NamedTuple):
    """What a step's sampling needs of its plan, one entry per engine row (the forward program
    derives it, so the sampling program's shapes are the same for every prompt part): whether
    the row decodes in this step and is not done (`live`), how many of its `drafts` are real
    (`k`, 0 unless live), whether its prompt ends in this step (`ends`: its first token is drawn
    from its last chunk's logits) and how many tokens it had then (`had`)."""

    live: Bool[Array, " rows"]
    k: Int[Array, " rows"]
    drafts: Int[Array, "rows drafts"]
    ends: Bool[Array, " rows"]
    had: Int[Array, " rows"]


@functools.partial(
    jax.jit,
    donate_argnums=1,
    static_argnames=("model_def", "pages_def", "layout", "page_size", "placement", "keep_hidden"),
)
def _forward_program(
    weights, pages, last, done, adapter, ints, drafts, *, model_def, pages_def,
    layout: PlanLayout, page_size, placement, keep_hidden=False,
):  # fmt: skip
    """`_forward` as the engine calls it, on arguments that cost the host little per call: the
    model and the page pools as flat lists of leaves (`weights` and `pages`; `model_def` and
    `pages_def` their structures: flattening the layers' modules on every call costs the host
    more than a small step) and the plan packed into one int32 vector `ints` beside its
    `drafts` (infer/step_plan.py). Returns the pools' leaves, then as `_forward`."""
    model = jax.tree.unflatten(model_def, weights)
    plan = layout.unpack(ints, drafts, allowed=None, q=None)
    pages, *out = _forward(
        model, jax.tree.unflatten(pages_def, pages), last, done, adapter, plan,
        page_size=page_size, placement=placement, keep_hidden=keep_hidden,
    )  # fmt: skip
    return jax.tree.leaves(pages), *out


def _forward(model, pages, last, done, adapter, plan, *, page_size, placement, keep_hidden):
    """A step's forward: decode rows (each its `last` token and its drafts, a group of
    `k_max + 1`) and prompt chunks as one ragged batch over the paged cache. Returns the
    pools, the logits each row samples from `[rows, k_max + 1, vocab]` (a decoding row's
    group; a row whose prompt ends here its last chunk's at slot 0), the `RowPlan`, and with
    `keep_hidden` the last layer's output at every token `[tokens, embed]` (what DeepSeek's MTP
    module drafts from; None otherwise). One program per prompt-part shape and width."""
    rows, (chunks, width) = plan.decoding.shape[0], plan.tokens.shape
    group = plan.drafts.shape[1] + 1
    kind = f"mixed {chunks}x{width}" if chunks else "decode"
    TRACES[kind + (f" k={group - 1}" if group > 1 else "")] += 1
    live = plan.decoding & ~done
    k = jnp.where(live, plan.k, 0)
    in_chunk = jnp.arange(width)[None, :] < plan.n[:, None]
    in_group = live[:, None] & (jnp.arange(group)[None, :] <= k[:, None])
    tokens = jnp.concatenate([last[:, None], plan.drafts], axis=1).reshape(-1)
    tokens = jnp.concatenate([tokens, plan.tokens.reshape(-1)])
    valid = jnp.concatenate([in_group.reshape(-1), in_chunk.reshape(-1)])
    last_of_chunk = rows * group + jnp.arange(chunks) * width + jnp.maximum(plan.n - 1, 0)
    if adapters_in(model):  # each token's row's adapter: decode groups, then the prompt chunks
        model = with_adapter_rows(
            model,
            jnp.concatenate([jnp.repeat(adapter, group), jnp.repeat(adapter[plan.row], width)]),
        )
    cache = PagedKVCache(
        pages,
        jnp.concatenate([plan.table, plan.table[plan.row]]),
        jnp.concatenate([plan.lengths, plan.start]),
        rows=jnp.concatenate([jnp.arange(rows), plan.row]),
        segments=((rows, group), (chunks, width)) if chunks else ((rows, group),),
        kernel=model.policy.decode_kernel,
        page_size=page_size,
    )
    with placement.context():
        out = model.forward(
            tokens[:, None], valid=valid[:, None], cache=cache,
            logits_at=jnp.concatenate([jnp.arange(rows * group), last_of_chunk]),
        )  # fmt: skip
    # Rows whose prompt ends here take their last chunk's logits (other chunks write nothing).
    row = jnp.where(plan.final, plan.row, rows)
    logits = out.logits[: rows * group].reshape(rows, group, -1)
    logits = logits.at[row, 0].set(out.logits[rows * group :], mode="drop")
    ends = jnp.zeros(rows, bool).at[row].set(True, mode="drop")
    had = jnp.zeros(rows, jnp.int32).at[row].set(plan.had, mode="drop")
    hidden = out.hidden[:, 0] if keep_hidden else None
    rows_plan = pin_rows(RowPlan(live, k, plan.drafts, ends, had), placement)
    return out.cache.layers, pin_rows(logits, placement, vocab=True), rows_plan, hidden


@functools.partial(jax.jit, static_argnames="placement")
def _sample_program(
    logits, plan: RowPlan, last, count, done, params, allowed, q, key, *, placement
):
    """A step's sampling or verification (each row its own keys and allowed tokens), stop
    checks and the rows' `last`, `count` and `done`, from `_forward`'s logits and `RowPlan`.
    Its shapes are the rows', the width's and the vocabulary's only: one program serves every
    prompt-part shape of an engine (and engines of the same rows and vocabulary). Returns the
    rows' new `(last, count, done)`, `[rows, k_max + 3]` int32: each row's new tokens
    `[k_max + 1]`, how many it emitted, whether it is done, and their `Logprobs` (computed when
    a row that emits asks for them)."""
    rows, group, vocab = logits.shape
    TRACES["sample" + (f" k={group - 1}" if group > 1 else "")] += 1
    live, k, ends = plan.live, plan.k, plan.ends
    allowed = _unpack_allowed(allowed, vocab)[:, None, :]
    masked = jnp.where(allowed, logits, -jnp.inf)
    # Each row's keys (`draw_keys`): a row whose prompt ends draws its first token.
    keys = draw_keys(key, params.seed, jnp.where(ends, plan.had, count))
    if group == 1:
        new = sample(masked[:, 0], params.sampling, keys)[:, None]
        n, first = live.astype(jnp.int32), new[:, 0]
    else:
        new, n = verify(masked, plan.drafts, k, q, params.sampling, keys)
        n = jnp.where(live, n, 0)
        first = jax.lax.cond(
            jnp.any(ends),
            lambda: sample(masked[:, 0], params.sampling, keys),
            lambda: jnp.zeros(rows, jnp.int32),
        )
    n, stopped = _cut_at_stops(new, n, params.stops, count, params.budget)
    ended = jnp.take_along_axis(new, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
    last = jnp.where(n > 0, ended, last)
    count, done = count + n, done | (live & stopped)
    # Rows whose prompt ends here: their first token.
    had = plan.had + 1
    last = jnp.where(ends, first, last)
    new = new.at[:, 0].set(jnp.where(ends, first, new[:, 0]))
    count = jnp.where(ends, had, count)
    done = jnp.where(ends, _stopped(first, params.stops, had, params.budget), done)
    n = jnp.where(ends, 1, n)
    report = jnp.concatenate([new, n[:, None], done[:, None].astype(jnp.int32)], axis=1)
    # Log-probabilities of every position's emitted token, from the raw logits: the decode
    # groups' (a verified group's accepted drafts and its extra token), a prompt's first token.
    wanted = params.logprobs[:, None] & (
        live[:, None] | (ends[:, None] & (jnp.arange(group) == 0)[None, :])
    )
    scores = _logprobs(logits.reshape(rows * group, vocab), new.reshape(-1), wanted.reshape(-1))
    logprobs = Logprobs(*(x.reshape(rows, group, *x.shape[1:]) for x in scores))
    return pin_rows((last, count, done), placement), report, logprobs


def _token_logprobs(scores: Logprobs, row: int, tokens: list[int], top: int) -> list[TokenLogprob]:
    """A row's emitted `tokens`' entries from a step's `Logprobs` read to the host."""
    entries = []
    for i, token in enumerate(tokens):
        ids, values = scores.top_tokens[row, i, :top].tolist(), scores.top[row, i, :top].tolist()
        best = zip(ids, values, strict=True)
        entries.append(TokenLogprob(token, float(scores.chosen[row, i]), tuple(best)))
    return entries


@dataclasses.dataclass(eq=False)
class Request:
    """One submitted prompt. `tokens` grows as the engine generates (ending with the stop token
    that ended it, if any); `done` once finished; `error` if a callback of it failed (the
    others go on); `cancelled` once `Engine.cancel` ended it. `ttft_s` and `decode_s` time it:
    submit to first token, first to last (as the host sees them); `preemptions` counts how often
    the pool ran dry and it was recomputed. `seed` fixes its draws, `allowed` constrains them.
    Speculation: up to `draft_tokens` drafts per step (set to 0 by an adaptive draft model's
    engine once they are rarely kept: `infer.speculative.adaptive.GIVE_UP`), `drafted` of them
    verified and `accepted` kept, `rejected` verifications that rejected one (`accepted /
    (accepted + rejected)`: the rate at which the target keeps a draft it judges, the
    acceptance rate of Leviathan et al. and zoo.math). `logprobs` (None: not asked)
    alternatives per token: `token_logprobs` then holds one `TokenLogprob` per token."""

    prompt: list[int]
    max_new_tokens: int
    sampler: Sampler
    stop_tokens: frozenset[int]
    on_tokens: OnTokens | None
    seed: int = 0
    allowed: AllowedTokens | None = None
    adapter: int = -1
    logprobs: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    done: bool = False
    error: Exception | None = None
    cancelled: bool = False
    ttft_s: float | None = None
    decode_s: float | None = None
    reused_tokens: int = 0
    preemptions: int = 0
    draft_tokens: int = 0  # drafts proposed per step at most (0: no speculation)
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts the target kept
    rejected: int = 0  # verifications that rejected a draft (the drafts after it: never judged)
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)  # running rate
    # Engine bookkeeping.
    order: int = 0  # submission order: the youngest is preempted first
    row: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    sequence: list[int] = dataclasses.field(default_factory=list)  # what the cache must hold
    cached: int = 0  # tokens of `sequence` (then of the decode) in the cache, dispatched steps
    scheduled: int = 0  # tokens the dispatched steps will have emitted
    submitted: float = 0.0
    first_token: float = 0.0

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.sequence)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one step did: decode rows, prompt chunks and their real tokens, the prompt part's
    size in chunks (its program: one of `Engine.prompt_shapes`, 0 for decode only), pages held
    after it, and the wall time from dispatching it to reading its tokens (the host one step
    behind: consecutive records overlap)."""

    step: int
    decode_rows: int
    chunks: int
    prompt_tokens: int
    shape: int
    pages_in_use: int
    ms: float

    def __str__(self) -> str:
        return (
            f"step {self.step}: {self.decode_rows} decoding, {self.chunks} prompt chunk(s) "
            f"({self.prompt_tokens} tokens) in a prompt part of {self.shape}, "
            f"{self.pages_in_use} pages held, {self.ms:.1f} ms"
        )


@dataclasses.dataclass
class _Launched:
    step: int
    report: Array
    logprobs: Logprobs
    owners: list[Request | None]
    record: StepRecord
    started: float
    drafts: dict[int, int]  # each verified row's drafts (empty: a plain step)
    guesses: Array | None = None  # an adaptive draft model's first draft per row (plain steps)


def prompt_shapes(most: int) -> tuple[int, ...]:
    """The prompt part's sizes in chunks: 1, then `SHAPE_STEP` times the one before while below
    `most`, then `most`: few programs to compile, and a step that takes the largest size its
    waiting chunks fill leaves less than `SHAPE_STEP` times its chunks for the next."""
    shapes = [1]
    while shapes[-1] * SHAPE_STEP < most:
        shapes.append(shapes[-1] * SHAPE_STEP)
    return tuple(shapes) + ((most,) if most > shapes[-1] else ())


def prompt_part(waiting: int, shapes: tuple[int, ...], chunk: int, *, decoding: bool) -> int:
    """The size (in chunks, one of `shapes`, which hold 1) of a step's prompt part for `waiting`
    chunks: the largest size they fill, so only a prompt's last chunk is padded. When no row
    decodes, the smaller steps would advance nothing else: then the smallest size that holds
    them all, if its padding costs fewer tokens than the steps it saves are worth
    (`STEP_TOKENS` each), so a new prompt on an idle engine takes as few steps as pay."""
    fills = max((c for c in shapes if c <= waiting), default=0)
    holds = min((c for c in shapes if c >= waiting), default=fills)
    if decoding or holds == fills:
        return fills
    steps, left = 0, waiting  # the steps of the largest sizes they fill, one after another
    while left:
        left -= max(c for c in shapes if c <= left)
        steps += 1
    return holds if (holds - waiting) * chunk <= (steps - 1) * STEP_TOKENS else fills


def default_prompt_tokens(model: Transformer, decode_tokens: int, chunk: int) -> int:
    """A step's prompt tokens beside its `decode_tokens` by default: `PROMPT_TOKENS`; with packed
    (quantized) weights on a CPU that the kernel takes only up to `KERNEL_TOKENS` tokens
    (`kernel_tokens`), the whole chunks (at least one) that keep the step within it, since a
    step of more tokens dequantizes every weight to run XLA's product, every step
    (bench/RESULTS.md: fewer tokens a step cost less in all)."""
    is_packed = lambda x: isinstance(x, PackedWeight)  # noqa: E731
    packed = [w for w in jax.tree.leaves(model, is_leaf=is_packed) if is_packed(w)]
    most = min(map(kernel_tokens, packed), default=math.inf)
    if most == math.inf or jax.default_backend() != "cpu":
        return PROMPT_TOKENS
    return max(1, (int(most) - decode_tokens) // chunk) * chunk


def _forward_shape(plan: StepPlan) -> tuple[int, int]:
    """What a step's forward program is compiled for: its tokens and drafts per row."""
    return plan.tokens.shape[0], plan.drafts.shape[1]


def _width(plan: StepPlan) -> tuple[int, bool]:
    """What a step's sampling program is compiled for: drafts per row, and whether the drafts
    come without their probabilities `q`."""
    return plan.drafts.shape[1], plan.q is None


def _check_count(name: str, value, *, low: int = 1) -> int:
    """A count argument: an int (numpy's included, bool not) of at least `low`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"Engine {name} must be an int >= {low}, got {value!r}")
    return int(value)


class Engine:
    """`Engine(model, max_batch=8, max_len=1024)`; `engine.submit(prompt, max_new_tokens=...)`
    returns a `Request`; `engine.run()` steps until every request is done.

    `page_size` tokens per page; `n_pages` in the pool (default: enough for `max_batch` rows of
    `max_len`, plus the scratch page); `token_budget` the most tokens one step runs (vLLM's
    `max_num_batched_tokens`): every decoding row's token first (`max_batch` of them, times
    `k + 1` when speculating), then chunks of `chunk` prompt tokens (None: `CHUNK`), oldest
    request first, as many as fit (None: the decode rows plus `default_prompt_tokens`: 256, or
    with packed weights on a CPU what keeps a step within the packed kernel); the prompt part
    comes in the sizes `engine.prompt_shapes` (in chunks), a compiled program each, so a larger
    budget means fewer steps for long prompts and more programs to compile; `placement`
    where the model lives (pools and batches follow it); `window_cache` gives each sliding layer
    whose window is shorter than `max_len` a ring of its window per row instead of pages
    (layers/window_cache.py: Gemma's local layers, Mistral's window); `prefix_sharing` reuses
    full pages of prompts that start alike (a shared system prompt is prefilled once), default
    on unless a layer keeps a ring (a ring holds one row's own tokens, so a shared prefix could
    not fill it: choose `window_cache=False` to share prefixes); `max_stop_tokens` per request;
    `stop_tokens` those of a request submitted without its own (give `tokenizer.stop_ids()`,
    the model's end of turn and end of sequence, and every request stops where the model says
    stop); `kv_dtype` the pools' dtype (None: the compute dtype; "int8": numbers with a scale per
    token and K/V head, about twice the pages of bfloat16 in the same bytes; the choices are
    `layers.paged_cache.KV_DTYPES`); `warm_up` lowers every step program now and compiles them
    on background threads, a step waiting only for its own (an engine of the same
    configuration built before shares them, compiled or compiling; without it each step shape
    compiles at its first step); `first_prompts` the lengths of prompts about to be submitted
    at once (`generate` gives its own): the prompt part their first step takes compiles at once,
    beside the smallest, instead of ahead; `log_steps` prints a `StepRecord` per
    step (`engine.records` keeps them); `speculative` a proposer (infer/speculative/:
    `PromptLookup(k=4)`, `DraftModel(small, k=4)`, `MTPDraft(k=1)`: the model's own DeepSeek
    MTP module) whose `k` is the most drafts a row verifies per step (each request may ask for
    fewer, or none: `submit(..., draft_tokens=)`); an adaptive proposer's engine verifies only in
    steps where it pays (infer/speculative/adaptive.py; `engine.costs` holds the step times it
    measured).

    Threads: `submit` and `cancel` may be called from any thread while one thread steps the
    engine (they only queue; the stepping thread takes the queue at its next step, and `busy`
    says whether there is anything to step). A constrained request (`submit(allowed=...)`)
    needs its last token before its next mask, so while one runs the host waits for each step
    before dispatching the next (no overlap).

    The model runs as its policy says (`model.policy`: layer storage, paged decode kernel);
    `zoo.load_pretrained` gives the fastest decode policy. `engine.model` may be replaced by a
    model of the same structure between steps (new weights): nothing recompiles. The engine
    never copies the weights.
    """

    def __init__(
        self,
        model: Transformer,
        *,
        max_batch: Count,
        max_len: Count,
        page_size: Count = 16,
        n_pages: Count | None = None,
        chunk: Count | None = None,
        token_budget: Count | None = None,
        placement: Placement | None = None,
        window_cache: bool = True,
        prefix_sharing: bool | None = None,
        max_stop_tokens: Count = 16,
        stop_tokens: Sequence[int] = (),
        kv_dtype: str | None = None,
        key: PRNGKeyArray | None = None,
        warm_up: bool = True,
        first_prompts: Sequence[int] = (),
        log_steps: bool = False,
        speculative: Proposer | DraftModel | MTPDraft | None = None,
    ):
        if not isinstance(model, Transformer):
            raise ValueError(f"Engine needs a zoo.Transformer, got {type(model).__name__}")
        max_batch, max_len = _check_count("max_batch", max_batch), _check_count("max_len", max_len)
        page_size = _check_count("page_size", page_size)
        chunk = _check_count("chunk", CHUNK if chunk is None else chunk)
        max_stop_tokens = _check_count("max_stop_tokens", max_stop_tokens)
        model.config.check_length(max_len, "Engine max_len")
        self.model, self.max_batch, self.max_len = model, max_batch, max_len
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.page_size, self.chunk = page_size, chunk
        self.row_pages = -(-max_len // page_size)
        default_pages = max_batch * self.row_pages + 1
        n_pages = default_pages if n_pages is None else _check_count("n_pages", n_pages, low=2)
        self.pool = PagePool(n_pages, page_size)
        self.placement = (
            Placement()
            if placement is None
            else arguments.instance(
                placement, "Engine placement", Placement, "shard.Placement(mesh, rules)"
            )
        )
        if key is not None and not (
            isinstance(key, jax.Array)
            and jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            and key.shape == ()
        ):
            raise ValueError(
                f"Engine key must be a jax.random.key(...) (one key, not a batch), got {key!r}"
            )
        self.key = jax.random.key(0) if key is None else key
        # The key of every row's draws (`draw_keys`): a threefry key's own words, or two words
        # drawn from a key of another implementation.
        self.draw_key = (
            jax.random.key_data(self.key)
            if str(jax.random.key_impl(self.key)) == "threefry2x32"
            else jax.random.bits(self.key, (2,), jnp.uint32)
        )
        self.max_stop_tokens, self.log_steps = max_stop_tokens, log_steps
        self.stop_tokens = self._checked_stops(stop_tokens)
        if speculative is not None and not isinstance(
            speculative, Proposer | DraftModel | MTPDraft
        ):
            raise ValueError(
                f"Engine speculative must be a proposer (infer.speculative.PromptLookup, "
                f"DraftModel or MTPDraft), got {speculative!r}"
            )
        if isinstance(speculative, DraftModel | MTPDraft):
            speculative.check_target(model)
        self.proposer = speculative
        self.max_drafts = 0 if speculative is None else speculative.k
        decode_tokens = max_batch * (self.max_drafts + 1)
        if token_budget is None:
            token_budget = decode_tokens + default_prompt_tokens(model, decode_tokens, chunk)
        self.token_budget = _check_count("token_budget", token_budget)
        if self.token_budget < decode_tokens + chunk:
            raise ValueError(
                f"Engine token_budget={self.token_budget} leaves no room for a prompt chunk: the "
                f"decoding rows take {decode_tokens} tokens (max_batch x (k + 1)) and a chunk "
                f"{chunk}; give at least {decode_tokens + chunk}"
            )
        # A step never needs more chunks than every row's whole prompt.
        most = max_batch * -(-max_len // chunk)
        self.prompt_shapes = prompt_shapes(min((self.token_budget - decode_tokens) // chunk, most))
        # The prompt parts compiled at once, not ahead: none (decode only), the smallest (any
        # new request's first step) and the one `first_prompts` take in their first step.
        if isinstance(first_prompts, str | bytes) or any(
            isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1
            for n in first_prompts
        ):
            raise ValueError(
                f"Engine first_prompts must be prompt lengths (ints >= 1), got {first_prompts!r}"
            )
        waiting = sum(-(-int(n) // chunk) for n in first_prompts[:max_batch])
        first = prompt_part(waiting, self.prompt_shapes, chunk, decoding=False)
        self._at_once = {0, self.prompt_shapes[0], first}  # 0: decode only
        # Speculation decided per step from acceptance and cost (infer/speculative/adaptive.py).
        self.adaptive = isinstance(speculative, Proposer | DraftModel) and speculative.adaptive
        # A draft model's verification costs its forwards: timed at 1 draft and at K.
        timed = (1, self.max_drafts) if isinstance(speculative, DraftModel) else (self.max_drafts,)
        self.costs = StepCosts(tuple(sorted(set(timed))))
        self._consumed: tuple[int, float] | None = None  # the last step read, and when
        self.steps = 0
        self.prefill_tokens = 0  # prompt tokens computed
        self.records: list[StepRecord] = []
        pages = self.placement.place_arrays(
            model.init_pages(
                n_pages,
                page_size,
                kv_dtype=self.kv_dtype,
                rows=max_batch if window_cache else 0,
                span=max_len,
                ring_extra=self.max_drafts,
            )
        )
        pools, rings = pools_and_rings(pages)
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
            spec = self.placement.batch_sharding("batch").spec
            mesh = dict(self.placement.mesh.shape)
            check_divisible("Engine max_batch", (max_batch,), ("batch",), spec, mesh)
            for chunks in self.prompt_shapes:
                what = f"Engine step of max_batch + {chunks} x chunk tokens"
                check_divisible(what, (max_batch + chunks * chunk,), ("batch",), spec, mesh)
        self.table = np.zeros((max_batch, self.row_pages), np.int32)
        self.rows: list[Request | None] = [None] * max_batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.submitted = 0
        # What other threads hand the stepping thread: new requests and cancellations.
        self._lock = threading.Lock()
        # Held while warming up, from a submission until every request is done and while timing
        # steps: compiles made ahead wait for it (`infer.compiling`), also if the engine is
        # dropped holding it.
        self._hold = Hold()
        weakref.finalize(self, self._hold.set, False)
        self._inbox: list[Request] = []
        self._cancels: list[Request] = []
        self._everything_allowed = jnp.full(
            (max_batch, allowed_words(model.config.vocab_size)), -1, jnp.int32
        )
        rows = committed(jax.device_put(
            (jnp.zeros(max_batch, jnp.int32), jnp.zeros(max_batch, jnp.int32),
             jnp.ones(max_batch, bool)),
            row_sharding(self.placement, 1),
        ))  # fmt: skip
        self.state = RowState(pages, *rows)
        self._params_host = {
            "temperature": np.zeros(max_batch, np.float32),
            "top_k": np.zeros(max_batch, np.int32),
            "top_p": np.ones(max_batch, np.float32),
            "min_p": np.zeros(max_batch, np.float32),
            "stops": np.full((max_batch, max_stop_tokens), -1, np.int32),
            "budget": np.ones(max_batch, np.int32),
            "seed": np.zeros(max_batch, np.int32),
            "adapter": np.full(max_batch, -1, np.int32),
            "logprobs": np.zeros(max_batch, bool),
        }
        self._params: RowParams | None = None
        self._launched: _Launched | None = None
        self.drafter = None
        if isinstance(speculative, DraftModel):
            draft_pages = speculative.model.init_pages(
                n_pages, page_size, rows=max_batch if window_cache else 0, span=max_len,
                ring_extra=self.max_drafts,
            )  # fmt: skip
            self.drafter = DraftRunner(
                speculative, committed(self.placement.place_arrays(draft_pages)), rows=max_batch,
                page_size=page_size, placement=self.placement, key=jax.random.split(self.key)[1],
            )  # fmt: skip
        elif isinstance(speculative, MTPDraft):
            self.drafter = MTPRunner(
                speculative, model, rows=max_batch, n_pages=n_pages, page_size=page_size,
                max_len=max_len, window_rows=max_batch if window_cache else 0,
                placement=self.placement, key=jax.random.split(self.key)[1],
            )  # fmt: skip
        self._static = dict(
            page_size=page_size, placement=self.placement,
            keep_hidden=isinstance(speculative, MTPDraft),
        )  # fmt: skip
        # Each step shape's forward, by (prompt chunks, drafts per row), and each width's
        # sampling program, by `_width`: compiled or compiling (`infer.compiling`).
        self._programs: dict[tuple[int, int], Compile] = {}
        self._samplers: dict[tuple[int, bool], Compile] = {}
        # `self.model`'s leaves, flattened once per model (`_weights`), and its structure.
        self._flat: tuple[Transformer, list, jax.tree_util.PyTreeDef] | None = None
        # A step that verifies nothing passes these (an upload of nothing still costs a call).
        self._no_drafts = jnp.zeros((max_batch, 0), jnp.int32)
        if warm_up:
            with self._hold:  # no compile made ahead starts beside the warm-up's own work
                self._warm_up()

    # --- requests ---------------------------------------------------------------------------

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # The last new token is returned, never written: it needs no slot.
        return -(-(prompt_len + max_new_tokens - 1) // self.page_size)

    def submit(
        self,
        prompt: Sequence[int] | np.ndarray,
        *,
        max_new_tokens: Count,
        sampler: Sampler | None = None,
        stop_tokens: Sequence[int] | None = None,
        on_tokens: OnTokens | None = None,
        draft_tokens: Count | None = None,
        seed: int | None = None,
        allowed: AllowedTokens | None = None,
        adapter: int = -1,
        logprobs: Count | None = None,
    ) -> Request:
        """Queue a prompt (a list of token ids), ending at one of `stop_tokens` (default: the
        engine's `stop_tokens`; `()`: none) or after `max_new_tokens`. Bad input is a ValueError
        here, before it can disturb anything in flight: an empty prompt, ids outside the
        vocabulary, a prompt plus `max_new_tokens` beyond `max_len` or beyond the whole page pool,
        more stop tokens than `max_stop_tokens`, a sampler or callback of the wrong type, a seed
        outside int32, `draft_tokens` outside `[0, k]` of the engine's proposer (default: its
        `k`; 0: this request does not speculate; a constrained request never does).

        `seed` fixes the request's draws (default: its submission number); `allowed` constrains
        its tokens (see `AllowedTokens`; a failing one ends only its request, as `error`);
        `adapter` picks one of the model's banked LoRA adapters (`zoo.bank_adapters`; -1: the
        base model).

        `logprobs=N` (0 to `MAX_LOGPROBS`; None: none) fills `request.token_logprobs`: for every
        token it generates (drafts a verification accepted included) its log-probability and
        the N most likely tokens at its position with theirs, before `on_tokens` sees it. They
        are the model's own distribution, the log-softmax of its raw logits over the whole
        vocabulary: before temperature, top-k/top-p/min-p and the `allowed` mask (vLLM's
        default, "raw" logprobs). So they say what the model thinks of the text, the same for a
        text whatever settings drew it (comparable across requests, usable for scoring), and a
        greedy token is its position's most likely one; a sampled or constrained token may
        not be among the top N."""
        (row,) = check_prompts([prompt], self.model.config.vocab_size)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer):
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        total = row.size + max_new_tokens
        if total > self.max_len:
            raise ValueError(
                f"the prompt ({row.size} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
                f"exceeds the engine's max_len={self.max_len}"
            )
        need = self.pages_needed(row.size, max_new_tokens)
        if need > self.pool.usable:
            raise ValueError(
                f"the prompt ({row.size} tokens) + max_new_tokens ({max_new_tokens}) needs "
                f"{need} pages of {self.page_size} tokens but the pool holds {self.pool.usable}; "
                "give the engine more n_pages"
            )
        if sampler is not None and not isinstance(sampler, Sampler):
            raise ValueError(
                f"sampler must be an infer sampler (Greedy(), Temperature(t), TopK(k), TopP(p), "
                f"MinP(p)), got {sampler!r}"
            )
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"on_tokens must be callable (tokens -> None), got {on_tokens!r}")
        if allowed is not None and not callable(allowed):
            raise ValueError(f"allowed must be callable (() -> int32 bitmask), got {allowed!r}")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int | np.integer)
            or not -(2**31) <= seed < 2**31
        ):  # fmt: skip
            raise ValueError(f"seed must be an int in [-2**31, 2**31), got {seed!r}")
        n_adapters = adapters_in(self.model)
        if (
            isinstance(adapter, bool)
            or not isinstance(adapter, int | np.integer)
            or not (-1 <= adapter < n_adapters)
        ):
            raise ValueError(
                f"adapter must be -1 (the base model) or the index of one of the model's "
                f"{n_adapters} banked adapters, got {adapter!r}"
            )
        if logprobs is not None and (
            isinstance(logprobs, bool) or not isinstance(logprobs, int | np.integer)
            or not 0 <= logprobs <= MAX_LOGPROBS
        ):  # fmt: skip
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}] (how many most likely "
                f"tokens to report per token), got {logprobs!r}"
            )
        stops = self.stop_tokens if stop_tokens is None else self._checked_stops(stop_tokens)
        drafts = self._check_draft_tokens(draft_tokens)
        if allowed is not None and draft_tokens:  # a draft's mask would need the tokens before it
            raise ValueError(
                f"draft_tokens={draft_tokens!r} with allowed=: a constrained request does not "
                "speculate (leave draft_tokens unset or 0)"
            )
        request = Request(
            draft_tokens=0 if allowed is not None else drafts,
            prompt=[int(t) for t in row],
            max_new_tokens=max_new_tokens,
            sampler=sampler if sampler is not None else Greedy(),
            stop_tokens=stops,
            on_tokens=on_tokens,
            allowed=allowed,
            adapter=int(adapter),
            logprobs=None if logprobs is None else int(logprobs),
            submitted=time.perf_counter(),
        )
        check_settings(request.sampler.settings(), "sampler")  # here, not mid-batch
        with self._lock:
            request.order = self.submitted
            request.seed = request.order if seed is None else int(seed)
            self.submitted += 1
            self._inbox.append(request)
        self._hold.set(True)
        return request

    def _checked_stops(self, stop_tokens: Sequence[int]) -> frozenset[int]:
        if isinstance(stop_tokens, str | bytes):
            raise ValueError(f"stop_tokens must be token ids, got the string {stop_tokens!r}")
        stops = np.asarray(list(stop_tokens)).reshape(-1)
        check_tokens(stops if stops.size else stops.astype(np.int64),
                     self.model.config.vocab_size, "stop_tokens")  # fmt: skip
        stops = frozenset(int(t) for t in stops)
        if len(stops) > self.max_stop_tokens:
            raise ValueError(
                f"{len(stops)} stop tokens, but the engine holds at most max_stop_tokens="
                f"{self.max_stop_tokens} per request; make the engine with a larger one"
            )
        return stops

    def _check_draft_tokens(self, draft_tokens) -> int:
        if draft_tokens is None:
            return self.max_drafts
        if self.proposer is None and not (isinstance(draft_tokens, int) and draft_tokens == 0):
            raise ValueError(
                f"draft_tokens={draft_tokens!r}, but the engine does not speculate; make it with "
                "speculative=PromptLookup(k=...)"
            )
        if (
            isinstance(draft_tokens, bool)
            or not isinstance(draft_tokens, int | np.integer)
            or not 0 <= draft_tokens <= self.max_drafts
        ):
            raise ValueError(
                f"draft_tokens must be an int in [0, {self.max_drafts}] (the engine proposer's "
                f"k, the static maximum; 0: no speculation), got {draft_tokens!r}"
            )
        return int(draft_tokens)

    def cancel(self, request: Request) -> None:
        """End a request (from any thread): its row and pages are freed at the next step; a
        finished one is left as it is."""
        with self._lock:
            self._cancels.append(request)

    @property
    def busy(self) -> bool:
        """Whether a step has anything to do: requests queued, running or in flight."""
        return bool(
            self._inbox or self._cancels or self.waiting or any(self.rows)
            or self._launched is not None
        )  # fmt: skip

    def run(self) -> None:
        """Step until every submitted request (including those submitted meanwhile) is done."""
        while self.busy:
            self.step()

    # --- one engine step --------------------------------------------------------------------

    def step(self) -> None:
        """Dispatch the next step (when there is work), then read the previous step's tokens:
        the host runs one step behind the device (in step with it while a constrained request
        runs, its next mask needs its last token, and before a step that verifies drafts or
        after one: proposals continue the previous step's tokens, and accepted drafts move the
        rows' lengths)."""
        drafts = self._step_drafts()
        if self._launched is not None and (
            drafts
            or self._launched.drafts  # its accepted drafts move the rows' lengths
            or any(r is not None and r.allowed for r in self.rows)
        ):
            self._consume(self._launched)
            self._launched = None
        launched = self._dispatch(drafts)
        if self._launched is not None:
            self._consume(self._launched)
        self._launched = launched
        if not self.busy:
            self._hold.set(False)

    def _step_drafts(self) -> int:
        """How many drafts per row the next step verifies at most (0: none, one token per
        row). An adaptive proposer's engine decides from the running rows' acceptance rates and
        the measured step costs (infer/speculative/adaptive.py; a program not yet timed is run
        to time it)."""
        if self.proposer is None or not self.adaptive:
            return self.max_drafts
        rows = [r for r in self.rows if r is not None and r.draft_tokens and not r.prefilling]
        if not rows:
            return 0
        untimed = self.costs.unmeasured()
        if untimed is not None:
            return 0 if untimed == "plain" else untimed
        rates = [r.acceptance.rate for r in rows]
        return drafts_that_pay(rates, self.max_drafts, self.costs.verify_cost)

    def _widths(self) -> list[dict | None]:
        """The decode widths this engine runs: one token per row (None) and, speculating, the
        verification's `k + 1` (`{}`: no drafts yet); an adaptive engine runs both."""
        if self.adaptive:
            return [None, {}]
        return [None] if self.proposer is None else [{}]

    def _warm_up(self) -> None:
        """Start compiling the programs now: without prompt chunks and with each of
        `prompt_shapes`, at each width (one token per row and, speculating, `k + 1`). Every
        program is lowered here, before anything runs (a program lowered for the engine's fresh
        state is the one another engine of this configuration looks up; the state a run leaves
        is committed to its devices, which is another lowering) and compiled on background
        threads (`infer.compiling`): a step waits only for its own program; a draft model's
        too (`DraftRunner.compile_soon`). An MTP module's programs compile by running, every row
        idle (nothing written, nothing emitted), one step per shape, while the threads compile
        the target's programs; an adaptive engine then times its decode-only programs
        (`time_steps`)."""
        plans = [
            self._plan([], [], chunks, {}, drafts)
            for drafts in self._widths()
            for chunks in (0, *self.prompt_shapes)
        ]
        if isinstance(self.drafter, DraftRunner):
            plans = [self._compile_drafter(plan) for plan in plans]
        self._compile_ahead(plans)
        if isinstance(self.drafter, MTPRunner):
            for plan in plans:
                self._launch(self._with_drafter(plan, [], [], warm_up=True)[0], [])
            self._rows[0].block_until_ready()
        if self.adaptive:
            self.time_steps(WARM_UP_TIMINGS)

    def _compile_drafter(self, plan: StepPlan) -> StepPlan:
        """Start compiling the draft model's programs for `plan`'s shape, and return the plan a
        step of that shape hands the target's programs (a verifying one: with drafts)."""
        observing = self.adaptive and plan.drafts.shape[1] == 0  # as `_with_drafter` decides
        drafts = 1 if observing else self.drafter.draft.k
        sampling = self._row_params().sampling
        proposed = self.drafter.compile_soon(
            plan, self._rows[0], sampling, self.steps, drafts=drafts, ahead=self._made_ahead(plan)
        )
        return plan if observing else proposed

    def time_steps(self, repeats: int) -> None:
        """Run each compiled decode-only program `repeats` times on idle rows (nothing written)
        and add the wall times, with the draft model's work beside each, to `costs`: what one
        plain step and a verifying one of each of `costs.verify` drafts per row cost here (an
        adaptive engine's warm-up does it; a benchmark may ask for more). Call it between runs,
        not while requests are running."""
        kinds = [
            kind for drafts in self._widths()
            for kind in (["plain"] if drafts is None else self.costs.verify)
        ]  # fmt: skip
        self._hold.set(True)  # no compile made ahead starts beside the timed steps
        try:
            for kind in kinds:
                for _ in range(repeats):
                    started = time.perf_counter()
                    plan = self._plan([], [], 0, {}, None if kind == "plain" else {})
                    forwards = 1 if kind == "plain" else kind
                    plan, _ = self._with_drafter(plan, [], [], warm_up=True, forwards=forwards)
                    self._launch(plan, [])[0].block_until_ready()
                    self.costs.add(kind, time.perf_counter() - started, first_may_compile=False)
        finally:
            self._hold.set(self.busy)

    def _compile_ahead(self, plans: list[StepPlan]) -> None:
        """Lower each plan's forward here (tracing holds Python's lock) and compile it on the
        background threads, and each width's sampling program, lowered from whichever of that
        width's first two forwards (no prompt part, the smallest one) compiles first: the
        sampler takes the forward's outputs as they are placed. The threads take the programs in
        the order a new request needs them: those two forwards, the sampler, then, compiled
        ahead on otherwise idle cores, the larger prompt parts (bench/RESULTS.md, "The first
        `generate`")."""
        widths: dict[tuple[int, bool], list[StepPlan]] = {}
        for plan in plans:
            widths.setdefault(_width(plan), []).append(plan)
        for plan in plans:
            if not self._made_ahead(plan):
                self._compile_forward(plan)
        for width, same in widths.items():
            if width not in self._samplers:
                first = [plan for plan in same if not self._made_ahead(plan)]
                forwards = {self._programs[_forward_shape(plan)].future: plan for plan in first}
                done, _ = concurrent.futures.wait(forwards, return_when="FIRST_COMPLETED")
                plan = forwards[next(iter(done))]
                forward = self._programs[_forward_shape(plan)]
                self._samplers[width] = compile_soon(self._lower_sampler(plan, forward))
        for plan in plans:
            if self._made_ahead(plan):
                self._compile_forward(plan, ahead=True)

    def _made_ahead(self, plan: StepPlan) -> bool:
        """Whether `plan`'s programs are compiled ahead, on otherwise idle cores: its prompt part
        is neither the smallest (any new request's first step) nor `first_prompts`' first."""
        return plan.tokens.shape[0] not in self._at_once

    def _compile_forward(self, plan: StepPlan, *, ahead: bool = False) -> Compile:
        """The forward for `plan`'s shape, compiled or compiling (`ahead`: no step waits for it
        yet, `infer.compiling`)."""
        shape = _forward_shape(plan)
        if shape not in self._programs:
            self._programs[shape] = compile_soon(self._lower(plan, self.state), ahead=ahead)
        return self._programs[shape]

    def _compiled(self, plan: StepPlan) -> tuple[jax.stages.Compiled, jax.stages.Compiled]:
        """The step's two programs for `plan`'s shape, waiting for them if they are still
        compiling: its forward (one per prompt-part shape and width) and its sampling program
        (one per width, whatever the prompt part). JAX keeps what it lowered and compiled:
        engines of one configuration share the programs, and a later engine's warm-up only looks
        them up."""
        forward = self._compile_forward(plan)
        width = _width(plan)
        if width not in self._samplers:
            self._samplers[width] = compile_soon(self._lower_sampler(plan, forward))
        return forward.result(), self._samplers[width].result()

    def _lower_sampler(self, plan: StepPlan, forward: Compile) -> jax.stages.Lowered:
        """The sampling program for `plan`'s width, lowered on the outputs of `forward` (a
        compiled or compiling forward of that width)."""
        _, logits, row_plan, _ = forward.result().out_info
        args = (logits, row_plan, *self._rows, self._row_params(), plan.allowed, plan.q)
        return _sample_program.lower(*args, self.draw_key, placement=self.placement)

    def _lower(self, plan: StepPlan, state: RowState) -> jax.stages.Lowered:
        """The step's forward lowered for `plan`'s shape and `state` (real or abstract)."""
        args = self._arguments(plan)
        args[1], pages_def = jax.tree.flatten(state.pages)
        return _forward_program.lower(
            *args, model_def=self._weights()[1], pages_def=pages_def, layout=PlanLayout.of(plan),
            **self._static,
        )  # fmt: skip

    def _arguments(self, plan: StepPlan) -> list:
        """The step's forward's arguments for `plan`, in order (`_forward_program`): one host
        array (the packed plan) beside what already lives on the device."""
        last, _, done = self._rows
        return [
            self._weights()[0], self._pages, last, done, self._row_params().adapter, pack(plan),
            plan.drafts,
        ]  # fmt: skip

    @property
    def state(self) -> RowState:
        """What the device carries from step to step. The engine holds the pools' leaves (what
        the forward takes and returns: no modules to flatten per step) and the rows' `last`,
        `count` and `done` (what the sampling program takes and returns)."""
        return RowState(jax.tree.unflatten(self._pages_def, self._pages), *self._rows)

    @state.setter
    def state(self, state: RowState) -> None:
        self._pages, self._pages_def = jax.tree.flatten(state.pages)
        self._rows = (state.last, state.count, state.done)

    def _weights(self) -> tuple[list, jax.tree_util.PyTreeDef]:
        """`self.model`'s leaves and structure, flattened when the model was replaced (new
        weights of the same structure run the programs already compiled)."""
        if self._flat is None or self._flat[0] is not self.model:
            weights, model_def = jax.tree.flatten(self.model)
            if self._flat is not None and model_def != self._flat[2]:
                raise ValueError(
                    "engine.model was replaced by a model of another structure; the engine's "
                    "programs run models of the structure it was made with (new weights only)"
                )
            self._flat = (self.model, weights, model_def)
        return self._flat[1], self._flat[2]

    def _with_drafter(
        self, plan: StepPlan, decode: list[Request], pieces: list[tuple[Request, int, int]], *,
        warm_up: bool = False, forwards: int | None = None,
    ) -> tuple[StepPlan, Array | None]:  # fmt: skip
        """The plan with a draft model's drafts (or an MTP module's), and, for a step that
        verifies nothing in an adaptive draft model's engine, the draft's guess at each row's
        token instead (infer/speculative/draft.py); the draft takes in only the rows that still
        draft (none: it does not run, except to compile at `warm_up`). A draft model runs
        `forwards` forwards (default: the most drafts a row of `plan` has)."""
        if self.drafter is None:
            return plan, None
        sampling = self._row_params().sampling
        sequences = {r.row: (r.prompt + r.tokens, r.cached) for r in decode if r.draft_tokens}
        if self.adaptive and plan.drafts.shape[1] == 0:
            if not (warm_up or sequences or any(r.draft_tokens for r, *_ in pieces)):
                return plan, None
            return plan, self.drafter.observe(plan, sequences, self._rows[0], sampling, self.steps)
        forwards = int(plan.k.max(initial=0)) if forwards is None else forwards
        proposed = self.drafter.propose(
            plan, sequences, self._rows[0], sampling, self.steps, forwards
        )
        return proposed, None

    def _launch(self, plan: StepPlan, chunks: list[tuple[list[int], int, int]]):
        """Run the step's programs on `plan` (and an MTP module over what it added: `chunks`
        the step's prompt chunks as `(sequence, start, n)`, in the plan's order); the step's
        report and logprobs."""
        forward, sampler = self._compiled(plan)
        self._pages, logits, row_plan, hidden = forward(*self._arguments(plan))
        self._rows, report, logprobs = sampler(
            logits, row_plan, *self._rows, self._row_params(), plan.allowed, plan.q, self.draw_key
        )
        if hidden is not None:
            following = chunk_next_tokens(chunks, plan.tokens.shape[0], self.chunk)
            self.drafter.after_step(
                self.model,
                plan,
                report,
                hidden,
                following,
                self._row_params().sampling,
                self.steps,
            )
        return report, logprobs

    def _take_inbox(self) -> None:
        """What other threads handed over since the last step: new requests join the queue,
        cancelled ones end (a step in flight may still write a cancelled row's pages: they are
        not offered for sharing)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        self.waiting.extend(inbox)
        for request in cancels:
            if not request.done:
                request.cancelled = True
                self._finish(request, share=False)

    def _masks(self) -> dict[int, np.ndarray]:
        """Each running constrained request's allowed next tokens, by row; a request whose
        `allowed` fails ends with that error."""
        masks = {}
        for request in [r for r in self.rows if r is not None and r.allowed]:
            try:
                masks[request.row] = request.allowed()
            except Exception as error:
                request.error = error
                self._finish(request, share=False)
        return masks

    def _admit(self) -> None:
        """Waiting requests, oldest first (preempted ones are at the head), into free rows
        while the pool holds their prompt and their first new token."""
        while self.waiting and None in self.rows:
            request = self.waiting[0]
            sequence = request.prompt + request.tokens
            shared = self._shared_prefix(sequence, request.adapter)
            need = -(-(len(sequence) + 1) // self.page_size) - len(shared)
            if need > self.pool.available():
                self.pool.release(shared)
                return
            self.waiting.popleft()
            row = self.rows.index(None)
            request.row, request.pages, request.sequence = row, shared, sequence
            request.cached = request.reused_tokens = len(shared) * self.page_size
            request.scheduled = len(request.tokens)
            self.rows[row] = request
            self.table[row] = 0
            self.table[row, : len(shared)] = shared
            self._set_params(row, request)

    def _shared_prefix(self, sequence: list[int], adapter: int) -> list[int]:
        """Cached pages of the sequence's leading full pages (computed with the same adapter);
        at least one token is left to compute (its logits give the next token)."""
        if not self.prefix_sharing:
            return []
        shared = []
        for key in self.pool.prefix_keys(sequence[:-1], model=adapter):
            page = self.pool.lookup(key)
            if page is None:
                break
            shared.append(page)
        return shared

    def _set_params(self, row: int, request: Request) -> None:
        host = self._params_host
        for name, value in request.sampler.settings()._asdict().items():
            host[name][row] = np.asarray(value)  # no device op: a step may be running
        host["stops"][row] = -1
        host["stops"][row, : len(request.stop_tokens)] = sorted(request.stop_tokens)
        host["budget"][row] = request.max_new_tokens
        host["seed"][row] = request.seed
        host["adapter"][row] = request.adapter
        host["logprobs"][row] = request.logprobs is not None
        self._params = None  # uploaded again before the next step

    def _row_params(self) -> RowParams:
        """The rows' settings on the device (uploaded only after a request joined)."""
        if self._params is None:
            host = jax.device_put(self._params_host)
            sampling = SamplingParams(
                temperature=host["temperature"], top_k=host["top_k"], top_p=host["top_p"],
                min_p=host["min_p"],
            )  # fmt: skip
            self._params = RowParams(
                sampling, host["stops"], host["budget"], host["seed"], host["adapter"],
                host["logprobs"],
            )  # fmt: skip
        return self._params

    def _cover(self, request: Request, n_tokens: int) -> bool:
        """Pages until the request's first `n_tokens` positions have one; False when the pool
        is dry (what it got so far stays with it)."""
        while len(request.pages) * self.page_size < n_tokens:
            page = self.pool.allocate()
            if page is None:
                return False
            self.table[request.row, len(request.pages)] = page
            request.pages.append(page)
        return True

    def _preempt(self, request: Request) -> None:
        """Back to the head of the queue, pages returned; recomputed from its prompt and the
        tokens it has when it is admitted again (a step in flight may still add one)."""
        self.pool.release(request.pages)
        self.rows[request.row] = None
        request.row, request.pages, request.cached = -1, [], 0
        request.preemptions += 1
        self.waiting.appendleft(request)

    def _schedule(self) -> tuple[list[Request], list[tuple[Request, int]], tuple[int, ...]]:
        """This step's decode rows and prompt tokens (each prompting request's next `n`), with
        their pages, and the prompt part sizes it may take (`_compiled_shapes`): oldest requests
        first; every decoding row, then prompt chunks within `prompt_part` (a request cut short
        by it ends on a whole chunk); when the pool is dry the youngest running request is
        preempted."""
        running = sorted((r for r in self.rows if r is not None), key=lambda r: r.order)
        waiting = sum(-(-(len(r.sequence) - r.cached) // self.chunk)
                      for r in running if r.prefilling)  # fmt: skip
        decoding = any(not r.prefilling for r in running)
        wanted = prompt_part(waiting, self.prompt_shapes, self.chunk, decoding=decoding)
        shapes = self._compiled_shapes(wanted) if waiting else self.prompt_shapes
        room = prompt_part(waiting, shapes, self.chunk, decoding=decoding) * self.chunk
        decode, chunks = [], []
        for request in running:
            if request.row < 0:  # preempted below for an older request
                continue
            if request.prefilling:
                if not room:
                    continue
                n = min(room, len(request.sequence) - request.cached)
                room -= -(-n // self.chunk) * self.chunk
                need = request.cached + n
            elif request.scheduled < request.max_new_tokens:
                n, need = 0, request.cached + 1
            else:
                continue  # its budget is spent; the device reports it done
            while not self._cover(request, need):
                victim = max((r for r in self.rows if r is not None), key=lambda r: r.order)
                self._preempt(victim)
                if victim is request:
                    break
            if request.row < 0:
                continue
            if n:
                chunks.append((request, n))
            else:
                decode.append(request)
        # Victims are always younger than the request that needed the page, so none of them
        # was scheduled before it.
        return decode, chunks, shapes

    def _compiled_shapes(self, wanted: int) -> tuple[int, ...]:
        """The prompt part sizes (in chunks) a step may take now: the smallest (a new request's
        first step waits for its programs) and every larger one whose programs are compiled.
        `wanted`, if not among them, is hurried (a compile made ahead waits for an idle engine:
        `infer.compiling`), and steps take the sizes compiled meanwhile: no step, and so no
        running request, waits for a program made ahead."""
        smallest = self.prompt_shapes[0]
        shapes = tuple(
            c for c in self.prompt_shapes
            if c == smallest or all(job.done() for job in self._shape_compiles(c))
        )  # fmt: skip
        if wanted and wanted not in shapes:
            for job in self._shape_compiles(wanted):
                job.hurry()
        return shapes

    def _shape_compiles(self, chunks: int) -> list[Compile]:
        """The compiles of every program a step with a prompt part of `chunks` chunks runs (at
        any width, the draft model's included)."""
        jobs = [job for (tokens, _), job in self._programs.items() if tokens == chunks]
        if isinstance(self.drafter, DraftRunner):
            jobs += self.drafter.compiles(chunks)
        return jobs

    def _pieces(self, chunks: list[tuple[Request, int]]) -> list[tuple[Request, int, int]]:
        """The step's prompt tokens (`(request, n)`, from each request's `cached`) cut into
        chunks `(request, start, n)`, in order."""
        return [
            (r, r.cached + at, min(self.chunk, n - at))
            for r, n in chunks
            for at in range(0, n, self.chunk)
        ]

    def _plan(
        self,
        decode: list[Request],
        pieces: list[tuple[Request, int, int]],
        width: int,
        masks: dict[int, np.ndarray] | None = None,
        drafts: dict[int, np.ndarray] | None = None,
    ) -> StepPlan:
        """The step's `StepPlan`: `pieces` the prompt chunks (`_pieces`) in a prompt part of
        `width` chunks."""
        rows, size = self.max_batch, self.chunk
        plan = {
            "decoding": np.zeros(rows, bool),
            "lengths": np.zeros(rows, np.int32),
            "table": self.table.copy(),
            "row": np.zeros(width, np.int32),
            "tokens": np.zeros((width, size), np.int32),
            "n": np.zeros(width, np.int32),
            "start": np.zeros(width, np.int32),
            "final": np.zeros(width, bool),
            "had": np.zeros(width, np.int32),
            "drafts": self._no_drafts
            if drafts is None
            else np.zeros((rows, self.max_drafts), np.int32),
            "k": np.zeros(rows, np.int32),
            "allowed": self._everything_allowed,
        }
        for row, proposed in (drafts or {}).items():
            plan["drafts"][row, : proposed.size], plan["k"][row] = proposed, proposed.size
        if masks:
            allowed = np.full(self._everything_allowed.shape, -1, np.int32)
            for row, mask in masks.items():
                allowed[row] = mask
            plan["allowed"] = jnp.asarray(allowed)  # as the default is: no new compilation
        for r in decode:
            plan["decoding"][r.row], plan["lengths"][r.row] = True, r.cached
        for i, (r, start, n) in enumerate(pieces):
            plan["row"][i], plan["n"][i], plan["start"][i] = r.row, n, start
            plan["tokens"][i, :n] = r.sequence[start : start + n]
            plan["final"][i] = start + n == len(r.sequence)
            plan["had"][i] = len(r.sequence) - len(r.prompt)
        return StepPlan(**plan)

    def _propose(self, decode: list[Request], most: int) -> dict[int, np.ndarray]:
        """Each speculating row's drafts: at most `most` and its `draft_tokens`, what its budget
        can still emit after the target's own token, and what pages it holds or the pool can give
        without preempting anyone (a dry pool shortens the drafts, nothing more)."""
        drafts = {}
        for r in decode:
            k = min(r.draft_tokens, most, r.max_new_tokens - r.scheduled - 1)
            if k < 1:
                continue
            if self.drafter is None:
                proposed = self.proposer.propose(np.asarray(r.prompt + r.tokens), k)
            else:  # drawn on the device by the draft model
                proposed = np.zeros(k, np.int32)
            self._cover(r, r.cached + 1 + proposed.size)
            room = len(r.pages) * self.page_size - r.cached - 1
            drafts[r.row] = proposed[:room]
            r.drafted += drafts[r.row].size
        return drafts

    def _dispatch(self, drafts_per_row: int) -> _Launched | None:
        """Admit, schedule, launch this step's program (without waiting for it): verifying up
        to `drafts_per_row` drafts per row when some row has any, one token per row otherwise."""
        self._take_inbox()
        self._admit()
        masks = self._masks()
        decode, chunks, shapes = self._schedule()
        if not decode and not chunks:
            return None
        drafts = self._propose(decode, drafts_per_row) if drafts_per_row else None
        if self.adaptive and drafts is not None and not any(d.size for d in drafts.values()):
            drafts = None  # nothing to verify: the one-token program is the cheaper one
        pieces = self._pieces(chunks)
        width = min((c for c in shapes if c >= len(pieces)), default=0) if pieces else 0
        plan = self._plan(decode, pieces, width, masks, drafts)
        plan, guesses = self._with_drafter(plan, decode, pieces)
        report, logprobs = self._launch(plan, [(r.sequence, start, n) for r, start, n in pieces])
        owners = list(self.rows)
        for r in decode:
            r.cached += 1
            r.scheduled += 1
        for r, n in chunks:
            r.cached += n
            self.prefill_tokens += n
            if not r.prefilling:
                r.scheduled += 1
                self._share_pages(r, r.sequence)
        record = StepRecord(
            self.steps, len(decode), len(pieces), sum(n for _, n in chunks), width,
            self.pool.in_use, 0.0,
        )  # fmt: skip
        self.steps += 1
        self.peak_bytes = max(self.peak_bytes, self.kv_bytes_in_use())
        verified = {row: d.size for row, d in (drafts or {}).items()}
        return _Launched(
            record.step, report, logprobs, owners, record, time.perf_counter(), verified, guesses
        )

    def _consume(self, launched: _Launched) -> None:
        """Read a dispatched step's tokens (waiting for it) and act on them: record, stream,
        finish the requests the device found done."""
        report = np.asarray(launched.report)
        tokens, emitted, done = report[:, :-2], report[:, -2], report[:, -1]
        now = time.perf_counter()
        record = dataclasses.replace(launched.record, ms=(now - launched.started) * 1e3)
        if self.adaptive:
            self._time_step(launched, now)
        self.records.append(record)
        if self.log_steps:
            print(record, flush=True)
        asked = any(r is not None and r.logprobs is not None for r in launched.owners)
        scores = jax.device_get(launched.logprobs) if asked else None  # read only when asked
        guesses = None if launched.guesses is None else np.asarray(launched.guesses)
        for row, request in enumerate(launched.owners):
            if request is None or request.done or not emitted[row]:
                continue
            extra = int(emitted[row]) - 1  # accepted drafts: past the one token dispatch counted
            request.cached, request.scheduled = request.cached + extra, request.scheduled + extra
            request.accepted += extra
            # A run cut short by a stop or the budget is not a rejection.
            request.rejected += extra < launched.drafts.get(row, 0) and not done[row]
            if self.adaptive and request.draft_tokens:
                guess = None if guesses is None else int(guesses[row])
                self._observe(
                    request, launched.drafts.get(row, 0), extra, int(tokens[row, 0]), guess
                )
            if self.drafter is not None:
                self.drafter.kept(row, request.cached)
            new = tokens[row, : emitted[row]].tolist()
            if request.logprobs is not None:
                request.token_logprobs.extend(_token_logprobs(scores, row, new, request.logprobs))
            self._emit(request, new, bool(done[row]))

    def _time_step(self, launched: _Launched, now: float) -> None:
        """A decode-only step's cost: the wall time since the previous step was read (the
        step's own time once the device is the bound, host one step behind or not)."""
        previous, self._consumed = self._consumed, (launched.step, now)
        if previous is not None and previous[0] == launched.step - 1 and not launched.record.chunks:
            kind = max(launched.drafts.values()) if launched.drafts else "plain"
            self.costs.add(kind, now - previous[1])

    def _observe(
        self, request: Request, drafts: int, kept: int, first: int, guess: int | None
    ) -> None:
        """The row's acceptance trials from this step (infer/speculative/adaptive.py): the
        verification's, or whether the first draft is the token the step gave (a draft model's
        `guess`, drawn beside the step; a proposer's, asked now)."""
        if drafts:
            request.acceptance.observe_verification(drafts, kept)
            return
        if guess is None and isinstance(self.proposer, Proposer):
            proposed = self.proposer.propose(np.asarray(request.prompt + request.tokens), 1)
            guess = int(proposed[0]) if proposed.size else None
        if guess is not None:
            request.acceptance.observe(int(guess == first), 1)
        if self.drafter is not None and request.acceptance.rate < GIVE_UP:
            request.draft_tokens = 0  # its draft's forwards would be pure cost (GIVE_UP)

    def _share_pages(self, request: Request, tokens: list[int]) -> None:
        """Offer the full pages holding `tokens` (the request's first ones) for reuse."""
        if self.prefix_sharing:
            keys = self.pool.prefix_keys(tokens, model=request.adapter)
            for key, page in zip(keys, request.pages, strict=False):
                self.pool.share(key, page)

    def _emit(self, request: Request, tokens: list[int], done: bool) -> None:
        """Record new tokens, stream them, and finish the request when the device says it is
        done (a failing callback finishes only its own request)."""
        now = time.perf_counter()
        if not request.tokens:
            request.first_token = now
            request.ttft_s = now - request.submitted
        request.tokens.extend(tokens)
        if request.on_tokens is not None:
            try:
                request.on_tokens(tokens)
            except Exception as error:
                request.error = error
                self._finish(request, share=False)
                return
        if done:
            self._finish(request, share=True)

    def _finish(self, request: Request, *, share: bool) -> None:
        """Free the request's row and pages. What it wrote (its prompt and all but its last new
        token) stays reusable when the device finished it (`share`): the next turn of a
        conversation starts with it. A request the host ends (a failing callback) may still be
        written by the step in flight, so its pages are not offered."""
        request.done = True
        request.decode_s = time.perf_counter() - request.first_token
        if request.row < 0:  # preempted: waiting to be recomputed
            self.waiting.remove(request)
            return
        if share:
            written = len(request.prompt) + len(request.tokens) - 1
            self._share_pages(request, (request.prompt + request.tokens)[:written])
        self.pool.release(request.pages)
        self.rows[request.row] = None
        request.row, request.pages = -1, []

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
        per_token = kv_cache_bytes_per_token(
            self.model.config, self.model.policy, kv_dtype=self.kv_dtype
        )
        return self.max_batch * self.max_len * per_token
