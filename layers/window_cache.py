"""A sliding-window layer's cache: each row's last keys and values in a ring of `R >= window`
slots, so the layer's memory is `rows x R` whatever the context length (Mistral's rolling buffer,
Jiang et al. 2023; Gemma 2/3's local layers). The paged cache (layers/paged_cache.py) holds a
`LayerWindow` instead of pages for each layer whose window is shorter than a row's span
(`Transformer.init_cache`, `init_pages`).

The ring is indexed by position: a token at position p of its row lives in slot p mod R, so ring
slot j of a row holding L tokens holds position L - 1 - ((L - 1 - j) mod R) when that is >= 0
(left padding and page tables play no part). A call attends over the ring as it was before the
call followed by the call's own keys and values, then keeps each row's last R tokens: a query at
position p needs the keys at (p - window, p], which the old ring and the call's tokens cover
however long the call (a prefill chunk may be longer than the window). The ring is at most the
window long, so a step over it costs the window, never `max_len`; it attends with the naive
kernel's einsums (a window-sized score row per query).
"""

import equinox as eqx
import jax.numpy as jnp
from jax.typing import DTypeLike
from jaxtyping import Array, Float, Int

from layers.kernels.mask import AttentionMask
from layers.kernels.naive import naive_attention
from layers.token_groups import TokenGroups

RING_AXES = ("batch", "kv_seq", "kv_heads", "head_dim")


class LayerWindow(eqx.Module):
    """One sliding layer's rings `[*layers, rows, R, kv_heads, head_dim]` (the kernels' layout)."""

    k: Float[Array, "*layers rows ring kv_heads head_dim"]
    v: Float[Array, "*layers rows ring kv_heads head_dim"]

    @staticmethod
    def zeros(
        rows: int, ring: int, kv_heads: int, head_dim: int, dtype: DTypeLike, *, layers=()
    ) -> "LayerWindow":
        shape = (*tuple(layers), rows, ring, kv_heads, head_dim)
        return LayerWindow(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @property
    def ring(self) -> int:
        return self.k.shape[-3]

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        return {"k": RING_AXES, "v": RING_AXES}


def ring_positions(lengths: Int[Array, " batch"], ring: int) -> Int[Array, "batch ring"]:
    """The position each ring slot holds for rows of `lengths` tokens (negative: empty)."""
    last = lengths[:, None] - 1
    return last - jnp.mod(last - jnp.arange(ring), ring)


class WindowSlot(eqx.Module):
    """One sliding layer's view for one call: its rings (`kv`, `layer` the index into stacked
    rings or None) and the call's token groups (each group's ring row, its length before the
    call, the tokens' positions and validity)."""

    kv: LayerWindow
    layer: Int[Array, ""] | None
    call: TokenGroups

    @property
    def arrays(self) -> LayerWindow:
        return self.kv

    def _read(
        self, ring: Array, rows: Int[Array, " n"]
    ) -> Float[Array, "n ring kv_heads head_dim"]:
        return ring[rows] if self.layer is None else ring[self.layer, rows]

    def _ring_and_run(
        self, ring: Array, rows: Int[Array, " n"], run: Float[Array, "run kv_heads head_dim"], seen
    ) -> Float[Array, "n keys kv_heads head_dim"]:
        """Each of the run's `n` groups' keys (or values): its ring row as it was before the
        call, then the run's new ones it may see (`run` laid out as `seen`: `(1, n * s)` all of
        them for every group, `(n, s)` each group its own)."""
        new = run.astype(ring.dtype).reshape(*seen, *run.shape[1:])
        new = jnp.broadcast_to(new, (rows.shape[0], seen[1], *run.shape[1:]))
        return jnp.concatenate([self._read(ring, rows), new], axis=1)

    def _write(self, ring: Array, new: Float[Array, "tokens kv_heads head_dim"]) -> Array:
        """Each ring row's last `R` new tokens (over all the groups that own it) into slots
        position mod R; the rest (padding, tokens a later one of the same call overwrites) are
        dropped, so no two tokens of a call write one slot."""
        size, call = ring.shape[-3], self.call
        _, after = call.ring_span()
        keep = call.valid & (call.positions >= after[call.group] - size)
        slot = jnp.where(keep, jnp.mod(call.positions, size), size)  # out of bounds: dropped
        rows = call.rows[call.group]
        index = (rows, slot) if self.layer is None else (self.layer, rows, slot)
        return ring.at[index].set(new.astype(ring.dtype), mode="drop")

    def attend(
        self,
        q: Float[Array, "batch seq heads head_dim"],
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
        *,
        window: Int[Array, ""] | int | None,
        softcap: float | None = None,
    ) -> tuple[Float[Array, "batch seq heads head_dim"], "WindowSlot"]:
        """Each run of groups attends over [its rings before this call, the run's k and v] (the
        window applies), then the rings get this call's tokens. A row may own several groups of
        a run (a prompt's chunks in one step): a group sees the run's tokens of its own ring row
        (the segment ids are ring rows), so a later chunk sees the earlier ones."""
        call = self.call
        flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
        ring_before, _ = call.ring_span()
        outs = []
        for start, first, n, s in call.runs():
            q_run = flat[0][start : start + n * s].reshape(n, s, *flat[0].shape[1:])
            rows = call.rows[first : first + n]
            old = ring_positions(ring_before[first : first + n], self.kv.ring)
            positions = call.positions[start : start + n * s].reshape(n, s)

            # The new keys a group may see: the whole run's when groups may share a ring row,
            # its own otherwise (a plain call: the run's others belong to other rows).
            seen = (1, n * s) if call.shared else (n, s)
            keys, values = (
                self._ring_and_run(ring, rows, x[start : start + n * s], seen)
                for ring, x in ((self.kv.k, flat[1]), (self.kv.v, flat[2]))
            )
            owner = rows[:, None] + 1  # segment ids: ring row + 1, 0 for nothing
            run_owner = jnp.broadcast_to(jnp.repeat(rows, s).reshape(seen) + 1, (n, seen[1]))
            run_positions = jnp.broadcast_to(positions.reshape(seen), (n, seen[1]))
            kv_positions = jnp.concatenate([old, run_positions], axis=1)
            kv_owner = jnp.concatenate([jnp.broadcast_to(owner, old.shape), run_owner], axis=1)
            mask = AttentionMask(
                q_positions=positions,
                kv_positions=kv_positions,
                q_segment_ids=jnp.where(positions >= 0, owner, 0),
                kv_segment_ids=jnp.where(kv_positions >= 0, kv_owner, 0),
                causal=True,
                sliding_window=window,
            )
            out = naive_attention(q_run, keys, values, mask, softcap=softcap)
            # A query that sees nothing (padding) outputs 0, as the paged kernels do.
            out = jnp.where((positions >= 0)[..., None, None], out, 0)
            outs.append(out.reshape(n * s, *out.shape[2:]))
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs)
        rings = LayerWindow(self._write(self.kv.k, flat[1]), self._write(self.kv.v, flat[2]))
        out = out.reshape(*q.shape[:2], *out.shape[1:])
        return out, eqx.tree_at(lambda s: s.kv, self, rings)

    def attend_latent(self, q, latent, *, window):
        raise ValueError(
            "an MLA layer got a sliding window's ring; MLA layers keep full-length latent pools "
            "(build the cache with the model's own init_cache / init_pages)"
        )
