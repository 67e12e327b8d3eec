"""Adaptive speculation: each step the engine decides, from each row's running acceptance rate
and the measured cost of a verification step, whether speculating pays and with how many drafts
per row (zoo.math's `speculative_speedup`, Leviathan et al. 2023, Theorem 3.8). It does not when
drafts are rarely kept (free chat under prompt lookup): the step then runs the plain one-token
program, without the verification's extra FLOPs and with the host one step behind the device
again.

Why the choice is per step, and one number of drafts for every row: the engine has two compiled
decode widths (one token per row, and `K + 1` per row; each row's `k` is data, so nothing
compiles as it varies), and a verification step's cost is its width's whatever drafts fill it,
plus, for a draft model, one draft forward per draft of the row that drafts most. A row's drafts
up to that most are free, so every row drafts that many; the step verifies `k` drafts per row
for the `k` in `[1, K]` whose mean expected speedup over the rows is largest, when it exceeds 1
(a draft kept 4 times in 10, with a draft forward costing a tenth of a target step, gains most
at k = 2: more drafts cost forwards that the rejections waste).

Each row's rate is estimated from Bernoulli trials, one per draft the target judged: `kept`
successes and, when a draft was rejected, one failure (drafts after a rejection were never
judged). Rows that do not speculate this step still observe: before each step's token is read,
the proposer's first draft for it is compared with the token (a deterministic draft `d` stays
with probability `p(d)`, the chance that the target's own token is `d`, greedy or sampled, so
the comparison is an unbiased trial). Old trials decay, so a row that starts copying its input
turns speculation on within a few steps, and one that stops turns it off."""

import collections
import dataclasses
import statistics
from collections.abc import Callable

import numpy as np

from zoo.math import speculative_speedup

# A trial's weight decays by this factor per later trial: the estimate follows the last ~10.
DECAY = 0.9
# Before any trial: 9 drafts in 10 kept, worth two trials. Speculation is tried at once (an
# input-grounded request wins from its first step), and a rejection or two turn it off where
# verifying costs a few plain steps (free chat loses a step or two).
PRIOR_KEPT, PRIOR_TRIED = 1.8, 2.0
# A draft model's request stops drafting once its running rate falls below this (about ten
# misses in a row from the prior): its verifications would keep fewer than 1 draft in 10, which
# repays no verification, and the draft's forward beside each plain step is pure cost. So a
# draft that does not fit the text costs a request about ten draft forwards, then nothing.
GIVE_UP = 0.1
# Step times kept per program (the median of the last ones is the cost: robust to one slow step).
TIMES_KEPT = 8


@dataclasses.dataclass
class Acceptance:
    """A row's running rate of kept drafts: decayed trial counts (module docstring)."""

    kept: float = PRIOR_KEPT
    tried: float = PRIOR_TRIED

    def observe(self, kept: int, tried: int) -> None:
        """`tried` trials of which the first `kept` succeeded (the rest: one rejection)."""
        for success in [1.0] * kept + [0.0] * (tried - kept):
            self.kept, self.tried = DECAY * self.kept + success, DECAY * self.tried + 1.0

    def observe_verification(self, drafts: int, kept: int) -> None:
        """A verification of `drafts` drafts that kept `kept`: a rejection is a trial only when
        one happened (kept < drafts)."""
        self.observe(kept, kept + (kept < drafts))

    @property
    def rate(self) -> float:
        return self.kept / self.tried


class StepCosts:
    """Wall seconds per decode-only step of each program, as the engine sees them between reading
    consecutive steps (the cost of a step including what the host cannot overlap): "plain" (one
    token per row) and, keyed by its number of drafts per row `k`, a verifying step (`k + 1`
    tokens per row, and a draft model's `k` forwards). `verify` names the draft counts the
    engine times before it decides (warm-up seeds them); others are added as steps run. The first
    time of each program is dropped (it may hold its compilation)."""

    def __init__(self, verify: tuple[int, ...]):
        self.verify = verify
        self.times = {kind: collections.deque(maxlen=TIMES_KEPT) for kind in ("plain", *verify)}
        self._seen = set()

    def add(self, kind: str | int, seconds: float, *, first_may_compile: bool = True) -> None:
        if first_may_compile and kind not in self._seen:
            self._seen.add(kind)
            return
        self._seen.add(kind)
        self.times.setdefault(kind, collections.deque(maxlen=TIMES_KEPT)).append(seconds)

    def unmeasured(self) -> str | int | None:
        """A program with no time yet (the engine runs it once to learn its cost)."""
        return next((kind for kind, times in self.times.items() if not times), None)

    def median(self, kind: str | int) -> float:
        """The median of the times kept for `kind` ("plain" or a verification's k), seconds."""
        return statistics.median(self.times[kind])

    def verify_cost(self, k: int | None = None) -> float:
        """A verifying step of `k` drafts per row (default: the most timed) in plain steps: the
        median at `k`, or interpolated linearly between the nearest draft counts timed (a draft
        model's forwards grow with k); 1 until measured; at least 1 (a wider step measured
        faster is noise)."""
        if self.unmeasured() is not None:
            return 1.0
        timed = sorted(kind for kind, times in self.times.items() if kind != "plain" and times)
        k = timed[-1] if k is None else k
        seconds = np.interp(k, timed, [self.median(kind) for kind in timed])
        return max(float(seconds) / self.median("plain"), 1.0)


def drafts_that_pay(rates: list[float], most: int, verify_cost: Callable[[int], float]) -> int:
    """The drafts per row (0 to `most`) a step should verify, for rows with these acceptance
    rates and a verification of `k` drafts costing `verify_cost(k)` plain steps: the `k` with the
    largest mean expected speedup (zoo.math), 0 when none exceeds 1 (module docstring)."""
    if not rates:
        return 0
    best, best_gain = 0, 1.0
    for k in range(1, most + 1):
        cost = verify_cost(k)
        gain = statistics.fmean(speculative_speedup(rate, k, verify_cost=cost) for rate in rates)
        if gain > best_gain:
            best, best_gain = k, gain
    return best
