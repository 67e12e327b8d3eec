"""The sequence split over devices (context parallelism): which mesh axis the active rules
split `seq` over, and the zig-zag order that balances causal attention across it.

With the sequence cut into 2n chunks, device i of n holds chunks i and 2n - 1 - i (Brandon et
al. 2023, "Striped Attention", and the zig-zag layout of ring-flash-attention): under a causal
mask early chunks see little and late chunks see much, so pairing one of each gives every
device, and every ring step, the same amount of work. Only the order of tokens changes; the
positions and segment ids travel with them, so attention stays exact in any order.
"""

import numpy as np
from jaxtyping import Array, Shaped

from shard.rules import active, mesh_axes_of


def sequence_axis() -> tuple[str | None, int]:
    """(the mesh axis the active rules split `seq` over, its size); (None, 1) when the
    sequence is whole (no active rules, or a `context` axis of size 1)."""
    current = active()
    if current is None:
        return None, 1
    rules, mesh = current
    axes = mesh_axes_of(rules.mesh_axes("seq"))
    if len(axes) > 1:
        raise ValueError(
            f"the rules split 'seq' over several mesh axes {axes}; context parallelism "
            "runs its ring over one axis"
        )
    if not axes or mesh.shape[axes[0]] == 1:
        return None, 1
    return axes[0], mesh.shape[axes[0]]


def check_sequence_length(seq: int, n: int) -> None:
    """A clear error unless a sequence of `seq` tokens cuts into the 2n zig-zag chunks (on one
    device, `n` = 1, nothing is cut: any length)."""
    if n > 1 and seq % (2 * n):
        raise ValueError(
            f"context parallelism over {n} devices cuts the sequence into 2 x {n} = {2 * n} "
            f"equal chunks (zig-zag load balancing), but the sequence has {seq} tokens; make "
            f"it a multiple of {2 * n}"
        )


def zigzag_order(seq: int, n: int) -> np.ndarray:
    """The token order in which device i of n holds chunks i and 2n - 1 - i of the sequence
    (`x[:, order]` puts a sequence in it). `seq` must divide by 2n, unless `n` = 1 (the
    sequence's own order)."""
    check_sequence_length(seq, n)
    if n == 1:
        return np.arange(seq)
    chunks = np.arange(seq).reshape(2 * n, seq // (2 * n))
    return np.concatenate([chunks[[i, 2 * n - 1 - i]].ravel() for i in range(n)])


def to_zigzag(x: Shaped[Array, "batch seq *rest"], n: int) -> Shaped[Array, "batch seq *rest"]:
    """`x` with its sequence dim (axis 1) put in the zig-zag order for `n` devices."""
    return x[:, zigzag_order(x.shape[1], n)]


def from_zigzag(x: Shaped[Array, "batch seq *rest"], n: int) -> Shaped[Array, "batch seq *rest"]:
    """The inverse of `to_zigzag`: the sequence back in its own order."""
    return x[:, np.argsort(zigzag_order(x.shape[1], n))]
