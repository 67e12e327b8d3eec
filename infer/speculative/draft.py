"""A draft model as the proposer (Leviathan et al. 2023; Chen et al. 2023): a smaller zoo model
with the target's tokenizer proposes `k` tokens per row autoregressively, on the device, in its
own paged cache. Its pools are indexed by the target's page table (the same page ids, its own
pools: a page the engine gives a row holds the row's tokens in both models), so the engine's
host bookkeeping serves both and prefix sharing shares both.

Each step, two programs, as the engine's own step: `catch_up_program` (one per prompt part's
shape) runs one forward over each decoding row's catch-up (the one or two tokens the target
holds that the draft does not yet: the row's last token, and the last kept draft when every
draft was kept) together with the step's prompt chunks; `drafts_program` (one per drafts per
row, shared by every shape) draws the first draft from its logits, then runs up to `K - 1`
one-token forwards (a loop bounded by the step's drafts per row, which the engine chooses by
cost: infer/speculative/adaptive.py), each drawing the next draft from the draft's distribution
under the row's sampler (argmax for greedy rows), which is `q` in the rejection rule. The
one-token loop and the draws are the same in every shape, so they compile once, not once per
shape. The row's last token is read from the device (the engine's row state), so the draft
keeps up with steps whose tokens the host has not read yet.

Adaptive (`DraftModel(adaptive=True)`, the default; infer/speculative/adaptive.py): the engine
verifies only in steps where the rows' running acceptance and the measured step costs make it
pay. In the other steps it runs the one-token program, and the draft only its first forward
(`DraftRunner.observe`): it takes in the row's last token, so its cache stays level with the
target's, and its first draft, compared with the token the step gives, is the row's acceptance
trial (for a greedy row exactly the verification's; a sampled row's draft is kept with
probability sum(min(p, q)) >= sum(p q), so the trial errs low). Those steps cost one draft
forward more than plain decoding's."""

import collections
import dataclasses
import functools
import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from infer.compiling import Compile, compile_soon
from infer.rows import committed, pin_rows, row_sharding
from infer.sampling import SamplingParams
from infer.speculative.proposer import check_k
from infer.speculative.verify import target_probs
from layers import Embedding, Linear, QuantizedEmbedding, QuantizedLinear
from layers.paged_cache import PagedKVCache
from zoo.stack import Stack
from zoo.tokenizer import Tokenizer
from zoo.transformer import HeadRows, Transformer

CATCH_UP = 2  # tokens a row's draft cache may lag its target's by (module docstring)
DRAFT_VOCAB = "draft_vocab.json"  # a draft checkpoint's vocabulary (`draft_vocab`)
# How many times the draft's programs were traced (= compiled), as infer.engine.TRACES counts the
# engine's: per shape and static setting, never per step.
TRACES = collections.Counter()


class DraftModel(eqx.Module):
    """`model` proposes up to `k` drafts per row and step (the engine's static maximum);
    `adaptive`: the engine verifies only in steps where it pays (module docstring), False in
    every step. `vocab` (default: every token) the token ids the draft may propose: its head is
    cut to their rows (`head`, built here, once), so a draft forward reads `n / vocab_size` of
    the head (FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary). A token outside `vocab`
    is never drafted, so the output is unchanged (greedy and sampled: `q` is 0 there) and only
    the acceptance can drop; `draft_vocab` reads the one `python -m examples.train_draft`
    writes."""

    model: Transformer
    vocab: Int[Array, " n"] | None
    head: HeadRows | None
    k: int = eqx.field(static=True)
    adaptive: bool = eqx.field(static=True)

    def __init__(self, model: Transformer, k: int = 4, adaptive: bool = True, vocab=None):
        if not isinstance(model, Transformer):
            raise ValueError(f"DraftModel needs a zoo.Transformer, got {type(model).__name__}")
        self.model, self.k = model, check_k("DraftModel", k)
        if not isinstance(adaptive, bool):
            raise ValueError(f"DraftModel adaptive must be True or False, got {adaptive!r}")
        self.adaptive = adaptive
        self.vocab = None if vocab is None else checked_vocab(vocab, model.config.vocab_size)
        self.head = None if vocab is None else head_rows(model, self.vocab)

    def check_target(self, target: Transformer) -> None:
        """The draft must speak the target's vocabulary (its token ids are the target's)."""
        draft, ours = self.model.config, target.config
        if draft.vocab_size != ours.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the target's "
                f"({ours.vocab_size} tokens): a draft must share the target's tokenizer"
            )


def checked_vocab(vocab, vocab_size: int | None, owner: str = "DraftModel") -> Int[Array, " n"]:
    """A draft vocabulary: distinct token ids, at least one, in `[0, vocab_size)` (unchecked
    when None: the target is not known yet). `owner` names the proposer in the messages."""
    ids = np.asarray(vocab)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"{owner} vocab must be a non-empty 1-D array of token ids, got an array of "
            f"shape {ids.shape} and dtype {ids.dtype}"
        )
    high = np.iinfo(np.int32).max if vocab_size is None else vocab_size
    if ids.min() < 0 or ids.max() >= high or np.unique(ids).size != ids.size:
        raise ValueError(
            f"{owner} vocab must hold distinct token ids in [0, {high}) (the model's "
            f"vocabulary), got ids from {ids.min()} to {ids.max()}, "
            f"{ids.size - np.unique(ids).size} repeated"
        )
    return jnp.asarray(ids, jnp.int32)


def head_rows(model: Transformer, ids: Int[Array, " n"]) -> HeadRows:
    """`model`'s LM head rows of `ids` as a table `[n, embed]` (`Transformer.logits(head=)`),
    packed as the head is (a packed head is unpacked, cut and packed again: int8's per-row
    scales come back the same)."""
    head = model.embed if model.lm_head is None else model.lm_head
    if isinstance(head, QuantizedEmbedding | QuantizedLinear):
        return QuantizedEmbedding.from_embedding(head_rows_of(head.dequantize(), ids), head.kind)
    return head_rows_of(head, ids)


def head_rows_of(head: Embedding | Linear, ids: Int[Array, " n"]) -> Embedding:
    """A float head's rows of `ids` (an embedding table `[vocab, embed]` or a head `[embed,
    vocab]`)."""
    if isinstance(head, Embedding):
        return Embedding.of(head.weight[ids])
    return Embedding.of(head.weight[:, ids].T)


def draft_vocab(path: str | Path) -> np.ndarray | None:
    """The draft vocabulary a draft checkpoint directory holds (`DRAFT_VOCAB`: the token ids as
    a JSON list, written by `python -m examples.train_draft`), None when it has none."""
    file = Path(path) / DRAFT_VOCAB
    if not file.exists():
        return None
    try:
        ids = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{file} is not a JSON list of token ids ({error}); rewrite it with "
                         "python -m examples.train_draft or delete it") from error  # fmt: skip
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ValueError(f"{file} must hold a JSON list of token ids (ints); rewrite it with "
                         "python -m examples.train_draft or delete it")  # fmt: skip
    return np.asarray(ids, np.int64)


def truncated_draft(model: Transformer, n_layers: int) -> Transformer:
    """The target's first `n_layers` layers under its embedding, final norm and head: a draft
    that costs `n_layers / model.config.n_layers` of a target step, with the target's tokenizer
    by construction (the early-exit drafts of self-speculative decoding, Zhang et al. 2024,
    "Draft & Verify", without their layer choice), in the target's layer storage. Unrolled
    layers are the target's own arrays (no copy), stacked ones their first layers' slices (a
    copy of those layers); the model's layers must form one stack."""
    config = model.config
    if (
        isinstance(n_layers, bool)
        or not isinstance(n_layers, int)
        or not 0 < n_layers < config.n_layers
    ):
        raise ValueError(
            f"truncated_draft n_layers must be an int in [1, {config.n_layers - 1}] (fewer "
            f"than the target's layers), got {n_layers!r}"
        )
    if len(model.stacks) != 1:
        raise ValueError(
            f"truncated_draft takes a model whose layers form one stack, got "
            f"{len(model.stacks)} stacks (dense layers before experts)"
        )
    (stack,) = model.stacks
    if n_layers % stack.period:
        raise ValueError(
            f"truncated_draft n_layers={n_layers} cuts the model's attention pattern (a period "
            f"of {stack.period} layers); give a multiple of {stack.period}"
        )
    repeats = n_layers // stack.period
    if stack.stacked:
        first = lambda w: w[:repeats] if eqx.is_array(w) else w  # noqa: E731
        stack = Stack(jax.tree.map(first, stack.blocks), repeats, stack.period, stacked=True)
    else:
        stack = Stack(stack.blocks[:n_layers], repeats, stack.period, stacked=False)
    types = config.layer_types and config.layer_types[:n_layers]
    draft = eqx.tree_at(lambda m: m.stacks, model, (stack,))
    # A static field: rebuilt from the same leaves (no copy), as Transformer.with_policy does.
    draft = jax.tree.map(lambda leaf: leaf, draft)
    object.__setattr__(
        draft, "config", dataclasses.replace(config, n_layers=n_layers, layer_types=types)
    )
    return draft


def check_tokenizers(target: Tokenizer, draft: Tokenizer) -> None:
    """A draft checkpoint's tokenizer must be the target's: the same vocabulary size, special
    tokens and encoding of a probe text; the error names both."""
    probe = "Speculative decoding: 12345 tokens, naïve café, 東京, </s> <|im_end|>."
    same = (
        target.vocab_size == draft.vocab_size
        and dict(target.special_tokens) == dict(draft.special_tokens)
        and target.encode(probe) == draft.encode(probe)
    )
    if not same:
        raise ValueError(
            f"the draft's tokenizer ({draft.source}, {draft.vocab_size} tokens) is not the "
            f"target's ({target.source}, {target.vocab_size} tokens): a draft model must share "
            "the target's tokenizer"
        )


def draw_drafts(
    logits: Float[Array, "rows n"],
    params: SamplingParams,
    key: PRNGKeyArray,
    vocab: Int[Array, " n"] | None = None,
    vocab_size: int | None = None,
) -> tuple[Int[Array, " rows"], Float[Array, "rows vocab"]]:
    """Each row's draft and the distribution it came from (greedy rows: the argmax), over the
    whole vocabulary. `logits` score every token, or, with `vocab`, those ids of a vocabulary of
    `vocab_size` (the others' probability 0). When every row is greedy nothing is drawn: a draw
    over the whole vocabulary costs several times the argmax per draft."""
    greedy = params.temperature == 0
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    probs = target_probs(logits[:, None], params)[:, 0]

    def drawn():
        token = jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
        return jnp.where(greedy, argmax, token)

    token = jax.lax.cond(jnp.all(greedy), lambda: argmax, drawn)
    if vocab is None:
        return token, probs
    every = jnp.zeros((logits.shape[0], vocab_size), probs.dtype).at[:, vocab].set(probs)
    return vocab[token], every


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("page_size", "placement"))
def catch_up_program(
    draft, pages, table, catch_up, catch_up_n, last, lengths, chunks, *, page_size, placement
):  # fmt: skip
    """The draft's first forward of one engine step (`draft` the `DraftModel`): one per prompt
    part's shape. `table` `[rows, row_pages]` the engine's page table; per row: `catch_up`
    `[rows, CATCH_UP]` tokens (`catch_up_n` real, 0 for a row that is not decoding), the last of
    which is replaced by `last` `[rows]` (the row's last token, on the device), `lengths` the
    tokens its draft cache holds; `chunks` the step's prompt chunks `(row, tokens, n, start)`.
    Returns the pools and each row's logits at its last catch-up token `[rows, n]` (the head's
    `n` rows: every token, or the draft vocabulary), pinned to one sharding whatever the shape,
    for `drafts_program`."""
    model, head = draft.model, draft.head
    row, chunk_tokens, n, start = chunks
    rows, (n_chunks, width) = table.shape[0], chunk_tokens.shape
    TRACES["mixed" if n_chunks else "decode"] += 1
    in_chunk = jnp.arange(width)[None, :] < n[:, None]
    in_catch_up = jnp.arange(CATCH_UP)[None, :] < catch_up_n[:, None]
    is_last = jnp.arange(CATCH_UP)[None, :] == (catch_up_n - 1)[:, None]
    catch_up = jnp.where(is_last, last[:, None], catch_up)
    segments = ((rows, CATCH_UP), (n_chunks, width)) if n_chunks else ((rows, CATCH_UP),)
    cache = PagedKVCache(
        pages,
        jnp.concatenate([table, table[row]]),
        jnp.concatenate([lengths, start]),
        rows=jnp.concatenate([jnp.arange(rows), row]),
        segments=segments,
        kernel=model.policy.decode_kernel,
        page_size=page_size,
    )
    tokens = jnp.concatenate([catch_up.reshape(-1), chunk_tokens.reshape(-1)])
    valid = jnp.concatenate([in_catch_up.reshape(-1), in_chunk.reshape(-1)])
    at = jnp.arange(rows) * CATCH_UP + jnp.maximum(catch_up_n - 1, 0)
    with placement.context():
        out = model.forward(
            tokens[:, None], valid=valid[:, None], cache=cache, logits_at=at, head=head
        )
    return out.cache.layers, pin_rows(out.logits, placement, vocab=True)


@functools.partial(jax.jit, donate_argnums=1, static_argnames=("drafts", "page_size", "placement"))
def drafts_program(
    draft, pages, table, lengths, k, forwards, logits, sampling, key, step, *, drafts, page_size,
    placement,
):  # fmt: skip
    """The draft's proposals of one engine step, after `catch_up_program`: one per `drafts`
    (the most per row), whatever the step's prompt part. Each row's first draft is drawn from
    `logits` `[rows, n]` under its sampler (`sampling`; argmax for greedy rows), then up to
    `drafts - 1` one-token forwards each draw the next (a loop bounded by `forwards`, at least
    every row's `k` and at most `drafts`, so a step whose rows draft fewer than `drafts` pays
    only for what they draft). `lengths` `[rows]` the tokens each row's draft cache holds after
    the catch-up. Returns the pools, the drafts `[rows, drafts]` and their distributions
    `[rows, drafts, vocab]` (past `forwards`: zeros)."""
    model, vocab, head = draft.model, draft.vocab, draft.head
    rows = table.shape[0]
    TRACES[f"k={drafts}"] += 1
    draw = functools.partial(
        draw_drafts, params=sampling, vocab=vocab, vocab_size=model.config.vocab_size
    )
    key = jax.random.fold_in(key, step)
    token, q = draw(logits, key=jax.random.fold_in(key, 0))
    proposed = jnp.zeros((rows, drafts), jnp.int32).at[:, 0].set(token)
    probs = jnp.zeros((rows, drafts, q.shape[-1]), q.dtype).at[:, 0].set(q)

    def next_draft(carry):
        j, token, lengths, pages, proposed, probs = carry
        live = k > j  # the row wants a draft after this one
        cache = PagedKVCache(
            pages, table, lengths, kernel=model.policy.decode_kernel, page_size=page_size
        )
        with placement.context():
            out = model.forward(token[:, None], valid=live[:, None], cache=cache, head=head)
        token, q = draw(out.logits[:, 0], key=jax.random.fold_in(key, j))
        proposed, probs = proposed.at[:, j].set(token), probs.at[:, j].set(q)
        return j + 1, token, lengths + live, out.cache.layers, proposed, probs

    carry = (1, token, lengths, pages, proposed, probs)
    if drafts > 1:
        carry = jax.lax.while_loop(lambda c: c[0] < forwards, next_draft, carry)
    # Pinned, as the engine's sampling program (compiled before any draft is made) takes them.
    return carry[3], pin_rows(carry[4], placement), pin_rows(carry[5], placement, vocab=True)


class DraftRunner:
    """The engine's side of a `DraftModel`: the draft's pools (the engine's page ids, its own
    arrays) and how many tokens each engine row's draft cache holds, as the host knows it (what
    it dispatched: exact, since a row's draft cache is rolled back only after a verification,
    which the engine reads before the next step)."""

    def __init__(self, draft: DraftModel, pages, *, rows: int, page_size: int, placement, key):
        self.draft, self.pages, self.page_size, self.placement = draft, pages, page_size, placement
        self.key = key
        self.lengths = np.zeros(rows, np.int32)
        self._compiles: dict[tuple, Compile] = {}  # `compile_soon`'s, by program and shape
        self._proposals: dict[int, tuple] = {}  # the drafts program's outputs, by drafts per row

    def propose(
        self, plan, sequences: dict[int, tuple[list[int], int]], last, sampling, step: int,
        forwards: int,
    ):  # fmt: skip
        """`plan` with the drafts (and their distributions `q`) of every decoding row, from
        `forwards` draft forwards (at least the most drafts a row of `plan` has); `sequences`
        maps each decoding row to the tokens the host has read (prompt and output) and how many
        the target's cache holds (the row's last token, at that position, is `last`'s, on the
        device). Also feeds the step's prompt chunks to the draft's cache."""
        drafts, q = self._run(
            plan, sequences, last, sampling, step, drafts=self.draft.k, forwards=forwards
        )
        return eqx.tree_at(
            lambda p: (p.drafts, p.q), plan, (drafts, q), is_leaf=lambda x: x is None
        )

    def observe(self, plan, sequences, last, sampling, step: int):
        """For a step that verifies nothing (`plan` one token per row): the draft takes in each
        decoding row's last token and the step's prompt chunks, and returns its guess `[rows]`
        at the token the step gives (module docstring: the row's acceptance trial)."""
        return self._run(plan, sequences, last, sampling, step, drafts=1, forwards=1)[0][:, 0]

    def compile_soon(
        self, plan, last, sampling, step: int, *, drafts: int, ahead: bool = False
    ):  # fmt: skip
        """Lower the two programs a step of `plan`'s shape with `drafts` per row runs, on an
        idle step's arguments (nothing runs, nothing changes), and compile them on the
        background threads (`infer.compiling`; `ahead`: no step waits for them yet). JAX keeps
        what they compile: the step's own calls then find the programs compiled (waiting for
        them if they are still compiling) instead of compiling them by running. Returns `plan`
        as `propose` would (zero drafts, placed as the drafts program places its own), for the
        engine to lower its programs on."""
        catch_up, lengths = self._catch_up_arguments(plan, {}, last)
        lowered = catch_up_program.lower(
            self.draft, self.pages, *catch_up, page_size=self.page_size, placement=self.placement
        )
        self._compiles[("catch-up", plan.tokens.shape)] = compile_soon(lowered, ahead=ahead)
        if ("drafts", drafts) not in self._compiles:
            self._compile_drafts(plan, lowered, lengths, sampling, step, drafts)
        _, proposed, q = self._proposals[drafts]
        zeros = lambda x, **vocab: jax.device_put(  # noqa: E731
            jnp.zeros(x.shape, x.dtype), row_sharding(self.placement, x.ndim, **vocab)
        )
        return eqx.tree_at(
            lambda p: (p.drafts, p.q), plan, committed((zeros(proposed), zeros(q, vocab=True))),
            is_leaf=lambda x: x is None,
        )  # fmt: skip

    def compiles(self, chunks: int) -> list[Compile]:
        """The compiles (queued, running or done) of the draft's programs for a step whose
        prompt part holds `chunks` chunks."""
        return [
            job for (program, shape), job in self._compiles.items()
            if program == "catch-up" and shape[0] == chunks
        ]  # fmt: skip

    def _compile_drafts(self, plan, catch_up, lengths, sampling, step: int, drafts: int) -> None:
        """`compile_soon`'s drafts program, lowered on what `catch_up` (lowered) hands it."""
        # What the catch-up hands over: the pools as they lie, the logits as `pin_rows` places
        # them (the catch-up's lowering does not know where its outputs will lie).
        lying = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
        pages = jax.tree.map(lambda x: lying(x, x.sharding), self.pages)
        _, logits = catch_up.out_info
        device = jax.tree.leaves(self.pages)[0].sharding
        logits = lying(logits, row_sharding(self.placement, 2, vocab=True) or device)
        lowered = drafts_program.lower(
            self.draft, pages, *self._drafts_arguments(plan, lengths, logits, sampling, step, 0),
            drafts=drafts, page_size=self.page_size, placement=self.placement,
        )  # fmt: skip
        self._compiles[("drafts", drafts)] = compile_soon(lowered)
        self._proposals[drafts] = lowered.out_info

    def _run(self, plan, sequences, last, sampling, step: int, *, drafts: int, forwards: int):
        catch_up, lengths = self._catch_up_arguments(plan, sequences, last)
        self._wait(("catch-up", plan.tokens.shape))
        self.pages, logits = catch_up_program(
            self.draft, self.pages, *catch_up, page_size=self.page_size, placement=self.placement
        )
        self._wait(("drafts", drafts))
        self.pages, proposed, q = drafts_program(
            self.draft, self.pages,
            *self._drafts_arguments(plan, lengths, logits, sampling, step, forwards),
            drafts=drafts, page_size=self.page_size, placement=self.placement,
        )  # fmt: skip
        return proposed, q

    def _catch_up_arguments(self, plan, sequences, last):
        """`catch_up_program`'s arguments after the pools, and the lengths its rows' draft caches
        hold before it; notes what each row's holds after the step."""
        rows = self.lengths.size
        catch_up = np.zeros((rows, CATCH_UP), np.int32)
        catch_up_n = np.zeros(rows, np.int32)
        lengths = self.lengths.copy()
        for row, (tokens, cached) in sequences.items():
            lag = tokens[self.lengths[row] : cached]  # then the last token, from the device
            catch_up[row, : len(lag)], catch_up_n[row] = lag, len(lag) + 1
            self.lengths[row] = cached + max(int(plan.k[row]), 1)
        for row, n, start in zip(plan.row, plan.n, plan.start, strict=True):
            if n:
                self.lengths[row] = start + n
        chunks = (plan.row, plan.tokens, plan.n, plan.start)
        return (plan.table, catch_up, catch_up_n, last, lengths, chunks), lengths + catch_up_n

    def _drafts_arguments(self, plan, lengths, logits, sampling, step: int, forwards: int):
        """`drafts_program`'s arguments after the pools."""
        return (
            plan.table, lengths, plan.k, np.int32(forwards), logits, sampling, self.key,
            np.int32(step),
        )  # fmt: skip

    def _wait(self, program: tuple) -> None:
        """Wait for `program` if `compile_soon` started compiling it (once compiled: at once)."""
        job = self._compiles.get(program)
        if job is not None:
            job.result()

    def kept(self, row: int, cached: int) -> None:
        """After a verification: the row's draft cache holds no more than the target kept."""
        self.lengths[row] = min(self.lengths[row], cached)
