"""What the engine asks of a proposer of draft tokens."""

import abc

import equinox as eqx
import numpy as np
from jaxtyping import Int


class Proposer(eqx.Module):
    """Proposes up to `k` draft tokens per decoding row and step (`k` is the engine's static
    maximum: the verification group is `k + 1` tokens wide), from the tokens the row holds (its
    prompt and output). The drafts are deterministic (`q` one-hot in the rejection rule)."""

    k: eqx.AbstractVar[int]
    # Whether the engine decides per step whether to verify drafts (infer/speculative/adaptive.py);
    # a proposer that wants every step verified leaves it False.
    adaptive = False

    @abc.abstractmethod
    def propose(self, tokens: Int[np.ndarray, " seq"], k: int) -> Int[np.ndarray, " drafts"]:
        """At most `k` drafts continuing `tokens` (fewer, or none, when it has nothing)."""


def check_k(owner: str, k) -> int:
    """A proposer's `k`: an int >= 1 (0 drafts is no speculation: leave `speculative` out)."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
        raise ValueError(
            f"{owner} k must be an int >= 1 (drafts per step), got {k!r}; to decode without "
            "speculation leave speculative= out"
        )
    return int(k)
