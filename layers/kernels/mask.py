"""Who may attend to whom, described by structure (positions, segments, causality, window)
rather than as a dense matrix, so that block-sparse kernels can skip whole tiles."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


class AttentionMask(eqx.Module):
    """Query i may see key j iff (segments match) and (not causal or kv_pos[j] <= q_pos[i]) and
    (no window or q_pos[i] - kv_pos[j] < sliding_window).

    Segment ids separate packed documents; a key slot with a segment id no query has (e.g. 0 for
    an unwritten KV-cache slot or left padding) is invisible.

    `sliding_window` is data, not a static setting: a Python int, or a traced int scalar (a
    per-layer window carried through `lax.scan`, zoo/pattern.py); None (static) means no window
    at all, so models without windows build no window test.
    """

    q_positions: Int[Array, "batch seq"]
    kv_positions: Int[Array, "batch kv_seq"]
    q_segment_ids: Int[Array, "batch seq"] | None = None
    kv_segment_ids: Int[Array, "batch kv_seq"] | None = None
    causal: bool = eqx.field(static=True, default=True)
    sliding_window: Int[Array, ""] | int | None = None

    def __check_init__(self):
        if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
            raise ValueError(
                "AttentionMask needs both q_segment_ids and kv_segment_ids, or neither"
            )
        window = self.sliding_window
        if isinstance(window, int) and not isinstance(window, bool) and window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

    def with_window(self, window: Int[Array, ""] | int | None) -> "AttentionMask":
        """The same mask with another sliding window (e.g. one layer's, under `lax.scan`)."""
        return AttentionMask(
            self.q_positions, self.kv_positions, self.q_segment_ids, self.kv_segment_ids,
            self.causal, window,
        )  # fmt: skip

    def dense(self) -> Bool[Array, "batch seq kv_seq"]:
        """The full boolean mask (what naive and xla consume; flash never builds it)."""
        q_pos = self.q_positions[:, :, None]
        kv_pos = self.kv_positions[:, None, :]
        allowed = jnp.ones(jnp.broadcast_shapes(q_pos.shape, kv_pos.shape), bool)
        if self.causal:
            allowed &= kv_pos <= q_pos
        if self.sliding_window is not None:
            allowed &= q_pos - kv_pos < self.sliding_window
        if self.q_segment_ids is not None:
            allowed &= self.q_segment_ids[:, :, None] == self.kv_segment_ids[:, None, :]
        return allowed


def causal_mask(
    positions: Int[Array, "batch seq"],
    segment_ids: Int[Array, "batch seq"] | None = None,
    *,
    sliding_window: int | None = None,
) -> AttentionMask:
    """Self-attention over one (possibly packed) sequence: queries and keys share positions."""
    return AttentionMask(
        q_positions=positions,
        kv_positions=positions,
        q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids,
        causal=True,
        sliding_window=sliding_window,
    )
