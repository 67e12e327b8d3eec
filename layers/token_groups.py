"""How one cached call's tokens map onto the cache's rows.

A call's `[batch, seq]` tokens, flattened in row-major order, form runs of groups: `segments`
lists `(groups, tokens_per_group)` per run, and group g continues row g of the cache's page table
(and ring row `rows[g]`). A plain call has one run, one group per batch row (`seq` tokens each); a
serving step (infer/engine.py) lays out `[tokens, 1]` as a run of decode groups of one token and
a run of prompt chunks of `C` tokens, so one forward serves both and reads the weights once.

Within a group, the real tokens (`valid`) take the positions after the row's length in order;
the others get position -1 (they write nothing and see nothing). A row may own several groups of
one run (the engine puts a prompt's consecutive chunks in one step): each continues where the one
before ends, and `ring_span` gives the row's length around the whole call.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

Segments = tuple[tuple[int, int], ...]


def check_segments(segments: Segments, batch: int, seq: int, groups: int) -> None:
    """The segments must tile the call's tokens and name one group per page-table row."""
    tokens = sum(n * s for n, s in segments)
    if tokens != batch * seq or sum(n for n, _ in segments) != groups:
        raise ValueError(
            f"the cache's segments {segments} cover {tokens} tokens in "
            f"{sum(n for n, _ in segments)} groups, but the call has {batch} x {seq} tokens and "
            f"the page table {groups} rows"
        )


class TokenGroups(eqx.Module):
    """One call's layout: `positions` and `valid` per token `[tokens]` (flattened), `group` the
    page-table row of each token, `before`/`after` each group's length around the call, `rows`
    each group's ring row; `shared` whether groups may share a ring row (the caller named the
    rows; one group per batch row otherwise)."""

    segments: Segments = eqx.field(static=True)
    shared: bool = eqx.field(static=True)
    positions: Int[Array, " tokens"]
    valid: Bool[Array, " tokens"]
    group: Int[Array, " tokens"]
    before: Int[Array, " groups"]
    after: Int[Array, " groups"]
    rows: Int[Array, " groups"]

    @staticmethod
    def of(
        valid: Bool[Array, "batch seq"],
        lengths: Int[Array, " groups"],
        rows: Int[Array, " groups"] | None,
        segments: Segments,
    ) -> "TokenGroups":
        flat = valid.reshape(-1).astype(jnp.int32)
        positions, counts, group, start, first = [], [], [], 0, 0
        for n, s in segments:
            run = flat[start : start + n * s].reshape(n, s)
            place = lengths[first : first + n, None] + jnp.cumsum(run, axis=1) - 1
            positions.append(jnp.where(run > 0, place, -1).reshape(-1))
            counts.append(run.sum(axis=1))
            group.append(np.repeat(np.arange(first, first + n), s))
            start, first = start + n * s, first + n
        return TokenGroups(
            segments=segments,
            shared=rows is not None,
            positions=jnp.concatenate(positions),
            valid=flat > 0,
            group=jnp.asarray(np.concatenate(group), jnp.int32),
            before=lengths,
            after=lengths + jnp.concatenate(counts),
            rows=jnp.arange(lengths.shape[0]) if rows is None else rows,
        )

    def ring_span(self) -> tuple[Int[Array, " groups"], Int[Array, " groups"]]:
        """Each group's ring row's length before and after the whole call: the fewest tokens
        before and the most after among the groups that own the row and hold a real token (a
        group without any, such as an unused prompt slot, speaks only for itself)."""
        real = self.after > self.before
        peers = (self.rows[:, None] == self.rows[None, :]) & real[None, :]
        peers |= jnp.eye(self.rows.shape[0], dtype=bool)
        before = jnp.min(jnp.where(peers, self.before[None, :], jnp.iinfo(jnp.int32).max), 1)
        return before, jnp.max(jnp.where(peers, self.after[None, :], 0), axis=1)

    def runs(self):
        """(first token, first group, groups, tokens per group) of each run."""
        start, first = 0, 0
        for n, s in self.segments:
            yield start, first, n, s
            start, first = start + n * s, first + n
