"""How one cached call's tokens map onto the cache's rows.

A call's `[batch, seq]` tokens, flattened in row-major order, form runs of groups: `segments`
lists `(groups, tokens_per_group)` per run, and group g continues row g of the cache's page table
(and ring row `rows[g]`). A plain call has one run, one group per batch row (`seq` tokens each); a
serving step (infer/engine.py) lays out `[tokens, 1]` as a run of decode groups of one token and
a run of prompt chunks of `C` tokens, so one forward serves both and reads the weights once.

Within a group, the real tokens (`valid`) take the positions after the row's length in order;
the others get position -1 (they write nothing and see nothing).
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
    each group's ring row."""

    segments: Segments = eqx.field(static=True)
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
            positions=jnp.concatenate(positions),
            valid=flat > 0,
            group=jnp.asarray(np.concatenate(group), jnp.int32),
            before=lengths,
            after=lengths + jnp.concatenate(counts),
            rows=jnp.arange(lengths.shape[0]) if rows is None else rows,
        )

    def runs(self):
        """(first token, first group, groups, tokens per group) of each run."""
        start, first = 0, 0
        for n, s in self.segments:
            yield start, first, n, s
            start, first = start + n * s, first + n
