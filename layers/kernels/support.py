"""What an attention kernel can compute, declared by the kernel, and what a model asks of one.

Every kernel object carries `supports: Supports` (soft-capping, sliding windows fixed or per
layer, head dims, sequence lengths, backends). A model states its `Needs` (zoo reads them off its
config), and `refusal(kernel, needs)` says why a kernel cannot serve them, naming the kernel, the
feature and the kernels that can, so that a policy is refused when a model is built, not on its
first call. `default_kernel` is the first kernel of a preference order that supports the needs
and compiles on the backend: the default policy always runs the model it is given.
"""

import dataclasses
from collections.abc import Sequence

import jax


@dataclasses.dataclass(frozen=True, kw_only=True)
class Supports:
    """A kernel's declaration. `softcap`: Gemma 2's score capping. `window`: a fixed sliding
    window; `per_layer_window`: a window that differs by layer (a traced value under `lax.scan`,
    Gemma 2/3's pattern). `head_dims`: the head widths it takes (None: any). `lengths`: which
    sequence lengths it takes, in words. `dtypes`: the compute dtypes it takes (None: any).
    `compiles_on`: the backends it compiles for;
    `interprets_on`: those where it runs interpreted (correct, for tests, but slow)."""

    softcap: bool = True
    window: bool = True
    per_layer_window: bool = True
    head_dims: tuple[int, ...] | None = None
    lengths: str = "any"
    dtypes: tuple[str, ...] | None = None
    compiles_on: tuple[str, ...] = ("cpu", "gpu", "tpu")
    interprets_on: tuple[str, ...] = ()

    def runs_on(self, backend: str) -> bool:
        return backend in self.compiles_on or backend in self.interprets_on


@dataclasses.dataclass(frozen=True, kw_only=True)
class Needs:
    """What a model asks of its attention kernel: soft-capping, a fixed window or per-layer
    windows, the width of the heads the kernel sees and the dtype it computes in (None: not
    said)."""

    softcap: float | None = None
    window: bool = False
    per_layer_window: bool = False
    head_dim: int
    dtype: str | None = None


def _missing(supports: Supports, needs: Needs) -> str | None:
    """The first feature of `needs` that `supports` lacks, in words; None if none."""
    if needs.softcap is not None and not supports.softcap:
        return f"soft-capping of attention scores (softcap={needs.softcap})"
    if needs.per_layer_window and not supports.per_layer_window:
        return "a sliding window that differs by layer (Config.layer_types)"
    if needs.window and not supports.window:
        return "a sliding window"
    if supports.head_dims is not None and needs.head_dim not in supports.head_dims:
        return f"head_dim={needs.head_dim} (it takes {list(supports.head_dims)})"
    if (
        supports.dtypes is not None
        and needs.dtype is not None
        and needs.dtype not in supports.dtypes
    ):
        return f"in {needs.dtype} (it computes in {' or '.join(supports.dtypes)})"
    return None


def refusal(kernel, needs: Needs, *, candidates: Sequence = ()) -> str | None:
    """Why `kernel` cannot serve `needs` (naming the kernel, the feature and, among
    `candidates`, the kernels that can), or None when it can."""
    missing = _missing(kernel.supports, needs)
    if missing is None:
        return None
    able = [k.name for k in candidates if _missing(k.supports, needs) is None]
    which = f"kernels that can: {', '.join(able)}" if able else "no kernel can"
    return f"attention kernel {kernel.name!r} cannot compute {missing}; {which}"


def default_kernel(needs: Needs, preference: Sequence, backend: str | None = None):
    """The first kernel of `preference` that serves `needs` and compiles on `backend` (default:
    JAX's default backend), else the first that serves them at all (e.g. interpreted)."""
    backend = backend or jax.default_backend()
    able = [k for k in preference if _missing(k.supports, needs) is None]
    compiled = [k for k in able if backend in k.supports.compiles_on]
    if not able:
        raise ValueError(
            f"no attention kernel of {[k.name for k in preference]} serves this model "
            f"({refusal(preference[0], needs)})"
        )
    return (compiled or able)[0]
