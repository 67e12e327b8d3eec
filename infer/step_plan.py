"""`StepPlan`: what the engine's host decided for one step, and how it travels to the device.

The host builds a plan as numpy arrays; a dozen small arrays would be a dozen host-to-device
copies per step, each costing the host more than its bytes (on a GPU a staged copy and a launch
each). So the integer and boolean fields travel packed in one int32 vector (`pack`) whose
layout (`PlanLayout`) is static, and the step's forward cuts them back out (`PlanLayout.unpack`,
slices and reshapes that cost nothing on the device). The fields that may already live on the
device (a draft model's `drafts` and `q`) or rarely change (`allowed`) travel as they are.
"""

import dataclasses
import math
import typing

import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int


# A NamedTuple (a pytree JAX flattens in C++) rather than an `eqx.Module`: the host builds one
# every step, and a module's construction and attribute reads cost it tens of microseconds more.
class StepPlan(typing.NamedTuple):
    """What the host decided for one step. Decode part: `decoding` rows, each row's `lengths`
    (tokens it holds before the step) and `table`. Prompt part (`[chunks]`, one of the engine's
    `prompt_shapes`, empty in a decode-only step): each chunk's engine `row` (a row's consecutive
    chunks continue one another), its `tokens` `[chunks, chunk]`, how many are real (`n`), where
    it starts (`start`), whether it ends the prompt (`final`, so its last logits give the
    request's next token) and how many tokens the request had (`had`: more than 0 after a
    preemption). Speculation: each decoding row's proposed `drafts` (`[rows, k_max]`,
    `[rows, 0]` in an engine that does not speculate), of which the first `k` are real, and
    the distributions they were drawn from (`q`; None: deterministic drafts)."""

    decoding: Bool[ArrayLike, " rows"]
    lengths: Int[ArrayLike, " rows"]
    table: Int[ArrayLike, "rows row_pages"]
    row: Int[ArrayLike, " chunks"]
    tokens: Int[ArrayLike, "chunks chunk"]
    n: Int[ArrayLike, " chunks"]
    start: Int[ArrayLike, " chunks"]
    final: Bool[ArrayLike, " chunks"]
    had: Int[ArrayLike, " chunks"]
    drafts: Int[ArrayLike, "rows drafts"]
    k: Int[ArrayLike, " rows"]
    allowed: Int[ArrayLike, "rows words"]
    q: Float[ArrayLike, "rows drafts vocab"] | None = None


# The fields packed into one int32 vector, in order, and whether each is boolean.
PACKED = (
    ("decoding", True), ("lengths", False), ("table", False), ("row", False),
    ("tokens", False), ("n", False), ("start", False), ("final", True), ("had", False),
    ("k", False),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """Where each packed field lies in the vector: the shapes of a plan of `rows` rows of
    `row_pages` pages and a prompt part of `chunks` chunks of `chunk` tokens. Hashable: a
    static argument of the step's forward (a layout is one program shape)."""

    rows: int
    row_pages: int
    chunks: int
    chunk: int

    @staticmethod
    def of(plan: StepPlan) -> "PlanLayout":
        (rows, row_pages), (chunks, chunk) = plan.table.shape, plan.tokens.shape
        return PlanLayout(rows, row_pages, chunks, chunk)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        rows, chunks = (self.rows,), (self.chunks,)
        return {
            "decoding": rows, "lengths": rows, "table": (self.rows, self.row_pages), "row": chunks,
            "tokens": (self.chunks, self.chunk), "n": chunks, "start": chunks, "final": chunks,
            "had": chunks, "k": rows,
        }  # fmt: skip

    def unpack(self, ints: Int[Array, " packed"], drafts, allowed, q) -> StepPlan:
        """Inside the step's forward: the plan of the packed vector `ints` (`pack`) and the
        fields that travel as they are."""
        fields, at, shapes = {}, 0, self.shapes()
        for name, boolean in PACKED:
            size = math.prod(shapes[name])
            value = ints[at : at + size].reshape(shapes[name])
            fields[name] = value != 0 if boolean else value
            at += size
        return StepPlan(**fields, drafts=drafts, allowed=allowed, q=q)


def pack(plan: StepPlan) -> np.ndarray:
    """The host plan's packed fields as one int32 vector (`PlanLayout.unpack` reads it)."""
    return np.concatenate([np.ravel(getattr(plan, name)) for name, _ in PACKED], dtype=np.int32)
