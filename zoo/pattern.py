"""Per-layer attention patterns (Gemma 2/3: sliding-window layers between global ones, each kind
with its own rotary theta) as data, scanned with the weights: no Python branch per layer type and
no recompilation per layer, whatever the stack's period (zoo/stack.py makes a dense model's period
its pattern's so that KV caches can be sized per block; an MoE period may mix kinds).

Each layer carries its window (an int; global layers carry `FULL_WINDOW`, wider than any
sequence) and whether it uses the local rotary table. Both rotary tables are computed once per
forward; a layer picks its own with `jnp.where` on its flag.
"""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from layers.kernels import AttentionMask
from zoo.config import Config

Rope = tuple[Float[Array, "batch seq half"], Float[Array, "batch seq half"]]

# The window of a global layer among windowed ones: q_pos - kv_pos < FULL_WINDOW always holds
# (positions are bounded by max_seq_len), and it stays far from int32 overflow.
FULL_WINDOW = 2**30


class LayerPattern(eqx.Module):
    """`window` and `local` per layer (leading dims `*layers`: `[n_layers]` for the model,
    `[repeats, period]` for one stack, scalars for one layer)."""

    window: Int[Array, "*layers"]
    local: Bool[Array, "*layers"]

    @staticmethod
    def of(config: Config) -> "LayerPattern | None":
        """The model's pattern, or None when every layer attends alike (`has_layer_pattern`)."""
        if not config.has_layer_pattern:
            return None
        windows = [FULL_WINDOW if w is None else w for w in config.layer_windows]
        local = [
            config.local_rope_theta is not None and w is not None for w in config.layer_windows
        ]
        return LayerPattern(jnp.asarray(windows, jnp.int32), jnp.asarray(local, bool))

    def layers(self, start: int, repeats: int, period: int) -> "LayerPattern":
        """Layers [start, start + repeats * period) as `[repeats, period]` (one stack's share)."""
        stop = start + repeats * period
        return LayerPattern(
            self.window[start:stop].reshape(repeats, period),
            self.local[start:stop].reshape(repeats, period),
        )

    def at(self, *index) -> "LayerPattern":
        return LayerPattern(self.window[index], self.local[index])

    def apply(
        self, mask: AttentionMask, rope: Rope | None, local_rope: Rope | None
    ) -> tuple[AttentionMask, Rope | None]:
        """One layer's mask (its window) and rotary table (local or global by its flag)."""
        mask = mask.with_window(self.window)
        if local_rope is None:
            return mask, rope
        pick = lambda g, lo: jnp.where(self.local, lo, g)  # noqa: E731
        return mask, (pick(rope[0], local_rope[0]), pick(rope[1], local_rope[1]))
