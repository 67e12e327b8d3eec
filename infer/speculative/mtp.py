"""DeepSeek-V3's multi-token-prediction module as the proposer (self-speculation: the model's
own `mtp`, zoo/mtp.py): drafts from the target's final hidden state at each row's last
accepted position, with the module's own KV pages (indexed by the engine's page table, as a
draft model's are).

After each engine step, on the device, before the host reads anything (two programs, as the
engine's own step: `catch_up_program`, one per step shape, runs 1 and step 2's forward;
`drafts_program`, one per drafts per row and shared by every shape, the draws and step 3):
1. Catch-up: one forward of the module over every position the step added to the target's
   cache, each with its next token and the target's hidden state there (the step program hands
   them over): a decoding row's emitted tokens (its last token and the drafts kept, each
   followed by the next emitted one), and the step's prompt chunks (each token followed by the
   next prompt token, the prompt's last by the first token drawn). This fills the module's cache
   with exactly what it would hold had it run beside the target from the start.
2. The first draft: the module's logits at each row's last new position (its last token with
   the target's hidden state before it), drawn under the row's sampler (argmax for greedy
   rows: `q` in the rejection rule).
3. `k - 1` more drafts, each one token through the module with its own previous output
   standing in for the target's hidden state (which the target has not computed yet).
The drafts wait on the device for the next step. Positions the module drafted past what the
target kept are rolled back by length, as the target's are.

A page a row shares with another request (prefix sharing) holds the module's entries of the
request that wrote it; at the page's last position that entry saw the writer's next token. The
drafts may then differ, never the output (verification decides)."""

import collections
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from infer.rows import committed, pin_rows
from infer.speculative.draft import checked_vocab, draw_drafts, head_rows
from infer.speculative.proposer import check_k
from layers.paged_cache import PagedKVCache
from zoo.transformer import Transformer

MTP_FILE = "mtp.safetensors"  # a trained module's file in its directory (examples/train_draft.py)
# How many times the module's programs were traced (= compiled), as infer.engine.TRACES counts.
TRACES = collections.Counter()


class MTPDraft(eqx.Module):
    """Up to `k` drafts per row and step (the engine's static maximum) from the target's own
    multi-token-prediction module (`model.mtp`: DeepSeek-V3 checkpoints, `zoo.load_pretrained`;
    a module trained for any model, `zoo.load_mtp`). `vocab` (default: every token) the token
    ids it may propose: the module's head is cut to their rows, as `DraftModel(vocab=)` cuts a
    draft model's (the output unchanged, only the acceptance can drop)."""

    vocab: Int[Array, " n"] | None
    k: int = eqx.field(static=True)

    def __init__(self, k: int = 1, vocab=None):
        self.k = check_k("MTPDraft", k)
        self.vocab = None if vocab is None else checked_vocab(vocab, None, "MTPDraft")

    def check_target(self, target: Transformer) -> None:
        """The target must have an MTP module."""
        if target.mtp is None:
            raise ValueError(
                "speculative=MTPDraft(...) drafts with the model's multi-token-prediction module, "
                "but this model has none (model.mtp is None): its checkpoint holds no MTP "
                "tensors (DeepSeek-V3 stores them as layer num_hidden_layers, with "
                "num_nextn_predict_layers > 0 in config.json); use PromptLookup or DraftModel"
            )
        if self.vocab is not None:
            checked_vocab(self.vocab, target.config.vocab_size, "MTPDraft")


@functools.partial(jax.jit, donate_argnums=3, static_argnames=("page_size", "placement"))
def catch_up_program(
    final_norm, mtp, head, pages, plan, report, hidden, chunk_next, *, page_size, placement
):  # fmt: skip
    """Steps 1 and 2's forward after one engine step (module docstring), one per step shape:
    `final_norm` the target's final norm (the module takes normed hidden states: the target's
    norm alone is passed, not the whole target, which each call would flatten), `head` the
    module's head cut to the draft vocabulary (None: every token), `plan` the step's StepPlan,
    `report` its `[rows, group + 2]` report, `hidden` the target's last-layer output
    at each of its tokens (`[tokens, embed]`, the step's layout), `chunk_next` `[chunks, chunk]`
    the prompt token after each chunk token (the host's; the prompt's last is replaced by the
    token drawn). Returns the pools and, per row, for `drafts_program` (pinned to one sharding
    whatever the shape): the module's logits `[rows, n]` and its output `[rows, embed]` at the
    row's last new position, whether the row has one, and the tokens its cache then holds."""
    rows, group = plan.decoding.shape[0], plan.drafts.shape[1] + 1
    chunks, width = plan.tokens.shape
    TRACES["mixed" if chunks else "decode"] += 1
    new, emitted = report[:, :group], report[:, group]
    positions = jnp.arange(group)[None, :]
    # Rows that finished their prompt this step report 1 token without decoding.
    in_group = plan.decoding[:, None] & (positions < emitted[:, None])
    last_of_chunk = jnp.arange(width)[None, :] == (plan.n - 1)[:, None]
    first = new[plan.row, 0][:, None]
    chunk_next = jnp.where(last_of_chunk & plan.final[:, None], first, chunk_next)
    in_chunk = jnp.arange(width)[None, :] < plan.n[:, None]
    tokens = jnp.concatenate([new.reshape(-1), chunk_next.reshape(-1)])
    valid = jnp.concatenate([in_group.reshape(-1), in_chunk.reshape(-1)])
    # Each row's last new position: its last emitted token, or the end of its final chunk.
    at = jnp.arange(rows) * group + jnp.maximum(emitted - 1, 0)
    ends = rows * group + jnp.arange(chunks) * width + jnp.maximum(plan.n - 1, 0)
    final_row = jnp.where(plan.final, plan.row, rows)  # rows: dropped
    at = at.at[final_row].set(ends, mode="drop")
    has = (plan.decoding & (emitted > 0)).at[final_row].set(True, mode="drop")
    length = (
        (plan.lengths + jnp.where(plan.decoding, emitted, 0))
        .at[final_row]
        .set(plan.start + plan.n, mode="drop")
    )
    cache = PagedKVCache(
        pages,
        jnp.concatenate([plan.table, plan.table[plan.row]]),
        jnp.concatenate([plan.lengths, plan.start]),
        rows=jnp.concatenate([jnp.arange(rows), plan.row]),
        segments=((rows, group), (chunks, width)) if chunks else ((rows, group),),
        kernel=mtp.body.policy.decode_kernel,
        page_size=page_size,
    )
    with placement.context():
        out = mtp.forward(
            tokens[:, None], final_norm(hidden)[:, None], valid=valid[:, None],
            cache=cache, logits_at=at, head=head,
        )  # fmt: skip
    own = out.hidden.reshape(-1, out.hidden.shape[-1])[at]
    logits = pin_rows(out.logits, placement, vocab=True)
    return out.cache.layers, logits, *pin_rows((own, has, length), placement)


@functools.partial(
    jax.jit, donate_argnums=2, static_argnames=("drafts", "vocab_size", "page_size", "placement")
)
def drafts_program(
    mtp, head, pages, table, logits, own, has, length, vocab, sampling, key, step, *, drafts,
    vocab_size, page_size, placement,
):  # fmt: skip
    """Steps 2 and 3 (module docstring), one per `drafts`, whatever the step's shape: the first
    draft drawn from `catch_up_program`'s `logits`, then `drafts - 1` more, each one token
    through the module with its own previous output `own` in place of the target's hidden state
    (`vocab` the draft vocabulary's ids, None: every token of the target's `vocab_size`).
    Returns the pools, the drafts `[rows, drafts]` and their distributions `[rows, drafts,
    vocab]`."""
    TRACES[f"k={drafts}"] += 1
    key = jax.random.fold_in(key, step)
    token, q = draw_drafts(logits, sampling, jax.random.fold_in(key, 0), vocab, vocab_size)
    proposed, probs = [token], [q]
    for j in range(1, drafts):
        cache = PagedKVCache(
            pages, table, length, kernel=mtp.body.policy.decode_kernel, page_size=page_size
        )
        with placement.context():
            out = mtp.forward(
                token[:, None], own[:, None], valid=has[:, None], cache=cache, head=head
            )
        token, q = draw_drafts(
            out.logits[:, 0], sampling, jax.random.fold_in(key, j), vocab, vocab_size
        )
        own, length, pages = out.hidden[:, 0], length + has, out.cache.layers
        proposed.append(token)
        probs.append(q)
    return pages, jnp.stack(proposed, axis=1), jnp.stack(probs, axis=1)


class MTPRunner:
    """The engine's side of an `MTPDraft`: the module's pools (the engine's page ids, its own
    arrays) and the drafts its last run left for the next step."""

    def __init__(self, draft: MTPDraft, model: Transformer, *, rows: int, n_pages: int,
                 page_size: int, max_len: int, window_rows: int, placement, key):  # fmt: skip
        self.draft, self.page_size, self.placement, self.key = draft, page_size, placement, key
        pages = model.mtp.body.init_pages(
            n_pages, page_size, rows=window_rows, span=max_len, ring_extra=draft.k
        )
        self.pages = committed(placement.place_arrays(pages))
        self.head = None if draft.vocab is None else head_rows(model.mtp.body, draft.vocab)
        vocab = model.config.vocab_size
        self.drafts = jnp.zeros((rows, draft.k), jnp.int32)
        self.q = jnp.zeros((rows, draft.k, vocab), jnp.float32)

    def propose(self, plan, sequences, last, sampling, step: int, forwards: int):
        """`plan` with the drafts the module left (a decoding row's were drawn after its
        previous step, which decoded it or ended its prompt)."""
        del sequences, last, sampling, step, forwards  # the drafts are already drawn
        return eqx.tree_at(
            lambda p: (p.drafts, p.q), plan, (self.drafts, self.q), is_leaf=lambda x: x is None
        )

    def after_step(self, model: Transformer, plan, report, hidden, chunk_next, sampling, step):
        """Run the module over what the step added and draw the next step's drafts."""
        self.pages, *handed = catch_up_program(
            model.final_norm, model.mtp, self.head, self.pages, plan, report, hidden, chunk_next,
            page_size=self.page_size, placement=self.placement,
        )  # fmt: skip
        self.pages, self.drafts, self.q = drafts_program(
            model.mtp, self.head, self.pages, plan.table, *handed, self.draft.vocab, sampling,
            self.key, np.int32(step), drafts=self.draft.k, vocab_size=model.config.vocab_size,
            page_size=self.page_size, placement=self.placement,
        )  # fmt: skip

    def kept(self, row: int, cached: int) -> None:
        """Nothing to do: the module's cache follows the plan's lengths."""


def chunk_next_tokens(chunks, width: int, chunk: int) -> np.ndarray:
    """`[width, chunk]`: after each prompt chunk token (`chunks`: the step's `(sequence, start,
    n)`), the sequence's next token (0 past its end: the token drawn goes there)."""
    following = np.zeros((width, chunk), np.int32)
    for i, (sequence, start, n) in enumerate(chunks):
        after = sequence[start + 1 : start + n + 1]
        following[i, : len(after)] = after
    return following
