"""How many tokens to draft each step: fixed, cost-aware (``--k auto``) or by thresholds.

A step that drafts k tokens, each accepted with probability a independently, emits
E(k) = (1 - a^(k+1)) / (1 - a) tokens (the bonus token counted; E(0) = 1, plain decoding) and
costs k draft passes plus one verify pass over k + 1 rows. The cost-aware schedule keeps a
running estimate of a and the measured costs on this machine and picks, every step, the k in
0..k_max that maximises E(k) / cost(k): k = 0 when speculation does not pay.

- acceptance: per-token, pooled over recent steps with exponential forgetting (a step that
  proposed n tokens and had m accepted tried m + 1 positions, or n if all were accepted);
- verify cost per row count: measured once per engine by timing the target on 1..k_max + 1
  rows (``SpecEngine.verify_costs``), then kept current from the live steps on the CPU by one
  factor that scales the whole table (``LiveVerifyCosts``);
- draft cost per pass: measured live from the draft time of each step.

After ``PROBE_AFTER`` plain steps in a row the schedule drafts a little again, so a prompt
whose later part becomes predictable gets speculation back; each probe that does not bring it
back doubles the wait (up to ``MAX_PROBE_AFTER``), as the batch's schedule does, so a request
where speculation never pays costs few probes. Where its price says it cannot pay even at full
acceptance (``speculation_can_pay``) those probes would only lose: the drafter is tried far more
rarely instead, so that a wrong price is corrected (``Reprobe``, ``costs/goodput.py``), and a
drafter whose measured goodput falls below plain decoding's stops (``SourceCheck``).

The threshold schedule is the seed's rule: raise k by one while the acceptance estimate is
above ``RAISE_ABOVE``, drop to ``k_min`` when it falls below ``DROP_BELOW``.

The decision is made on the host from numbers the engine already has, so it adds no device
sync. It never changes which tokens are emitted, only how many are drafted: output stays
lossless whatever k is chosen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specdecode.config import DEFAULT_K_MAX
from specdecode.costs.goodput import GoodputEstimate, Reprobe, SourceCheck, plain_goodput

ACCEPTANCE_DECAY = 0.85  # weight kept by older observations per step: a window of ~7 steps
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0  # pseudo-trials behind the prior
COST_DECAY = 0.8  # weight of the old cost estimate in a live update
PROBE_AFTER = 12  # plain steps in a row before drafting again
MAX_PROBE_AFTER = 96  # the longest wait between probes
PROBE_K = 2
RAISE_ABOVE = 0.8
DROP_BELOW = 0.4


def interpolate(points: dict[int, float], x: int) -> float:
    """A cost table's value at ``x``: linear between the nearest measured points, the first
    point's value below them, the last segment's slope extended beyond them."""
    if x in points:
        return points[x]
    known = sorted(points)
    if x < known[0]:
        return points[known[0]]
    below = max(r for r in known if r < x)
    above = [r for r in known if r > x]
    if above:
        upper = above[0]
    elif len(known) >= 2:  # extrapolate the last segment's slope
        upper, below = below, known[-2]
    else:
        return points[below] * x / below
    slope = (points[upper] - points[below]) / (upper - below)
    return points[below] + slope * (x - below)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step drafting k emits on average, the bonus token counted."""
    if k <= 0:
        return 1.0
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_plan(
    acceptance: float,
    verify_seconds: Sequence[float],
    draft_pass_seconds: float,
    k_max: int,
    *,
    k_min: int = 0,
    extra_seconds: float = 0.0,
) -> tuple[int, float]:
    """(k, expected tokens per second) for the k in k_min..k_max with the highest rate.

    verify_seconds[r - 1] is the cost of a verify pass over r rows (r = k + 1);
    ``extra_seconds`` is a cost the step pays once whatever k is (a drafter's catch-up).
    Returns (k_min, 0.0) when no k in range fits the cost table.
    """
    best, best_rate = k_min, 0.0
    for k in range(k_min, min(k_max, len(verify_seconds) - 1) + 1):
        cost = k * draft_pass_seconds + verify_seconds[k] + extra_seconds
        rate = expected_tokens(acceptance, k) / cost if cost > 0 else 0.0
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best, best_rate


def best_k(acceptance: float, verify_seconds: Sequence[float], draft_pass_seconds: float, k_max: int) -> int:
    """The k in 0..k_max maximising expected tokens per second (0 = plain decoding)."""
    return best_plan(acceptance, verify_seconds, draft_pass_seconds, k_max)[0]


def speculation_can_pay(verify_seconds: Sequence[float], draft_pass_seconds: float, k_max: int) -> bool:
    """Whether drafting beats plain decoding at all when every drafted token is accepted.

    Where a verify row costs nearly a whole pass (a compute-bound target, as ggml's CPU kernels
    on a small machine) and a draft pass is not free, no k pays even at full acceptance, and
    trying one (a probe) only loses time.
    """
    return best_k(1.0, verify_seconds, draft_pass_seconds, k_max) > 0


def draft_not_used_note(verify_seconds: Sequence[float], draft_pass_seconds: float) -> str:
    """The line a request priced out of its draft model tells the user (``speculation_can_pay``
    false): what a verified row and a draft pass cost here, in target passes, and what to try."""
    plain = verify_seconds[0]
    row = (verify_seconds[1] - plain) / plain  # what one more verified row adds, in target passes
    return (f"draft model not used: on this machine a verified row costs {row:.2f} of a target pass and a "
            f"draft pass {draft_pass_seconds / plain:.2f}, so no draft length beats plain decoding even if every "
            "token is accepted; decoded plainly, the draft model tried now and then in case its price is wrong "
            "(docs/methods.md#draft-length). --method auto drafts from prompt "
            "lookup and earlier answers where they pay, with no draft pass")


def blend(old: float | None, new: float) -> float:
    """A live cost estimate moved towards a new measurement (the first one taken as is)."""
    return new if old is None else COST_DECAY * old + (1 - COST_DECAY) * new


class LiveVerifyCosts:
    """A verify-cost table (index r - 1: a pass over r rows) kept current by live steps.

    Each live pass over r rows moves one factor, the running ratio of live time to the start-up
    time of r rows, and the whole table is that factor times the start-up table. So the table's
    shape, what r rows cost against one, stays as timed at start-up (best of several tries in
    one sitting). Blending each row count on its own let the counts that run often (one row,
    the usual draft lengths) drift with live noise and the step's host work, while the counts
    that run rarely kept their best-of figures, and that bent the draft-length choices: on the
    bench's HumanEval prompts on llama.cpp, auto took 85-86% of the oracle ceiling with per-row
    updates and 89% with the start-up shape (benchmarks/RESULTS.md, 2026-12-05). The factor
    still follows the machine's drift and a growing context, which scale all row counts about
    alike, so verify costs stay comparable with a draft model's measured seconds.
    """

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = seconds  # updated in place: whoever holds the list reads the current costs
        self._start = tuple(seconds)
        self.scale = 1.0

    def observe(self, rows: int, seconds: float | None) -> None:
        """A live verify pass over ``rows`` rows took ``seconds`` (None: a pass that also fed a
        prompt's tail, whose time says nothing of verifying)."""
        if seconds is None or not 1 <= rows <= len(self._start) or self._start[rows - 1] <= 0 or seconds <= 0:
            return
        self.scale = blend(self.scale, seconds / self._start[rows - 1])
        for i, start in enumerate(self._start):
            self.seconds[i] = start * self.scale


@dataclass(slots=True)
class AcceptanceEstimate:
    """Per-token acceptance pooled over recent steps, starting from a weak prior."""

    trials: float = 0.0
    accepted: float = 0.0
    decay: float = ACCEPTANCE_DECAY

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.trials = self.trials * self.decay + accepted + (1 if accepted < proposed else 0)
        self.accepted = self.accepted * self.decay + accepted

    def prior(self, most_trials: float) -> AcceptanceEstimate:
        """A fresh estimate that starts from this one's rate, weighing at most ``most_trials``
        of its trials (a new request inherits a pooled estimate without being bound by it)."""
        if self.trials <= 0:
            return AcceptanceEstimate()
        weight = min(1.0, most_trials / self.trials)
        return AcceptanceEstimate(trials=self.trials * weight, accepted=self.accepted * weight)


class KSchedule(Protocol):
    def next_k(self) -> int:
        """Tokens to draft this step (0 = plain step)."""

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int,
                verify_seconds: float | None) -> None:
        """What the step did: drafts proposed and accepted, its measured draft and verify time
        (None for a pass that also fed the prompt's tail: its time is mostly prefill)."""


@dataclass(slots=True)
class FixedK:
    k: int

    def next_k(self) -> int:
        return self.k

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int,
                verify_seconds: float | None) -> None:
        pass


@dataclass(slots=True)
class ThresholdK:
    """Raise k above RAISE_ABOVE acceptance, drop to k_min below DROP_BELOW."""

    k: int
    k_min: int = 1
    k_max: int = DEFAULT_K_MAX
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    def next_k(self) -> int:
        return self.k

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int,
                verify_seconds: float | None) -> None:
        self.acceptance.observe(proposed, accepted)
        rate = self.acceptance.rate
        if rate > RAISE_ABOVE:
            self.k = min(self.k + 1, self.k_max)
        elif rate < DROP_BELOW:
            self.k = self.k_min


class PassObserver(Protocol):
    """Hears a request's live passes for the whole decoder (``costs/live.LiveTable``: kept
    current for its other requests, and written back to the stored table)."""

    def observe(self, rows: int | Sequence[int], seconds: float | None) -> None:
        """Passes over ``rows`` (a count, or each pass's count) took ``seconds`` in all."""


@dataclass(slots=True)
class CostAwareK:
    """Pick the k that maximises E(k) / measured cost(k) each step.

    Two checks keep its choices honest where the prices are wrong (issue 50): a drafter its
    price says never pays (``first_k`` 0 from the cost table, or its measured pass cost) is
    tried again after ``reprobe``'s wait (two steps where the first read the drafter's backlog:
    the second times a pass), so a table too high is corrected by the drafter's own passes; and
    a drafter whose measured goodput falls below plain decoding's stops drafting for the
    request (``check``, ``costs/goodput.py``) until a probe drafts at least as fast as plain.
    """

    verify_seconds: list[float]  # index r - 1: a verify pass over r rows; at least k_max + 1 entries
    k_max: int = DEFAULT_K_MAX
    first_k: int = 5  # before any draft cost is measured (0: the drafter's priced pass says it never pays)
    live_costs: bool = True  # update verify costs from steps; False where timings are asynchronous
    draft_pass_seconds: float | None = None
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    plain_streak: int = 0
    steps: int = 0
    probe_after: int = PROBE_AFTER
    probing: bool = False  # the last next_k() was a probe
    # False for a drafter with nothing to catch up on (a lookup): every step after the first
    # times its drafting. A model drafter's first pass after plain steps reads what it missed.
    reads_backlog: bool = True
    # When to try a drafter priced out (the decoder's, shared by its requests); None: never (a
    # lookup, whose only price is the verify table's shape, which no live pass re-shapes).
    reprobe: Reprobe | None = field(default_factory=Reprobe)
    check: SourceCheck = field(default_factory=SourceCheck)
    verify_live: PassObserver | None = None  # the decoder's tables, told of this request's passes
    draft_live: PassObserver | None = None
    _live: LiveVerifyCosts | None = field(default=None, init=False, repr=False)
    _plain: GoodputEstimate = field(init=False, repr=False)
    _drafted_last: bool = field(default=False, init=False, repr=False)
    _drafted_ever: bool = field(default=False, init=False, repr=False)
    _price_probe: bool = field(default=False, init=False, repr=False)  # the last next_k() tried a priced-out drafter
    _follow_up: bool = field(default=False, init=False, repr=False)  # ... and its pass is still to be timed
    _probe_seconds: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.live_costs:
            self._live = LiveVerifyCosts(self.verify_seconds)
        self._plain = plain_goodput(self.verify_seconds[0])

    def can_pay(self) -> bool:
        """Whether the drafter's price lets it beat plain decoding at all: ``first_k`` before a
        pass is measured, then ``speculation_can_pay`` at the measured pass."""
        if self.draft_pass_seconds is None:
            return self.first_k > 0
        return speculation_can_pay(self.verify_seconds, self.draft_pass_seconds, self.k_max)

    def next_k(self) -> int:
        self.probing = self._price_probe = False
        if not self.can_pay():
            if self._follow_up or (self.reprobe is not None and self.reprobe.due()):
                self._price_probe = True
                return min(PROBE_K, self.k_max)
            return 0
        if self.draft_pass_seconds is None:  # no draft pass measured yet
            return min(self.first_k, self.k_max)
        if self.plain_streak >= self.probe_after:
            self.probing = True
            return min(PROBE_K, self.k_max)
        if self.check.off:  # measured slower than plain: plain steps until a probe pays
            return 0
        return best_k(self.acceptance.rate, self.verify_seconds, self.draft_pass_seconds, self.k_max)

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int,
                verify_seconds: float | None) -> None:
        self.plain_streak = self.plain_streak + 1 if proposed == 0 else 0
        self.acceptance.observe(proposed, accepted)
        self.steps += 1
        step_seconds = draft_seconds + (verify_seconds or 0.0)
        # A step's draft time is its passes' only where the first pass read no backlog: the
        # request's first draft reads the prompt, one after plain steps the tokens they emitted.
        timed = proposed > 0 and (self._drafted_last if self.reads_backlog else self.steps > 1)
        if timed:
            # A drafter that proposes without model passes (n-gram lookup) costs its host time per token.
            per_pass = draft_seconds / (draft_passes if draft_passes > 0 else proposed)
            self.draft_pass_seconds = blend(self.draft_pass_seconds, per_pass)
            if self.draft_live is not None and draft_passes > 0:
                self.draft_live.observe([1] * draft_passes, draft_seconds)
        if self._live is not None:
            self._live.observe(proposed + 1, verify_seconds)
            if self.verify_live is not None:
                self.verify_live.observe(proposed + 1, verify_seconds)
        self._judge(proposed, accepted, step_seconds, verify_seconds)
        if self.probing and proposed > 0:  # a probe that drafted: did it bring speculation back?
            assert self.draft_pass_seconds is not None
            pays = best_k(self.acceptance.rate, self.verify_seconds, self.draft_pass_seconds, self.k_max) > 0
            pays = pays and not self.check.off
            self.probe_after = PROBE_AFTER if pays else min(2 * self.probe_after, MAX_PROBE_AFTER)
        if self.reprobe is not None:
            self.reprobe.step(step_seconds, ran=proposed > 0)
            if self._price_probe and proposed > 0:  # a try of a priced-out drafter: did its pass price it back?
                self._probe_seconds += step_seconds
                self._follow_up = not timed
                if timed:
                    self.reprobe.outcome(self.can_pay(), self._probe_seconds)
                    self._probe_seconds = 0.0
        self._drafted_ever = self._drafted_ever or proposed > 0
        self._drafted_last = proposed > 0

    def _judge(self, proposed: int, accepted: int, step_seconds: float, verify_seconds: float | None) -> None:
        """Measured goodput: plain steps' for plain decoding, drafting steps' (catch-up included,
        the prompt's first read not: a cost already paid) for the drafter (``SourceCheck``)."""
        if verify_seconds is None:  # a pass that also fed the prompt's tail
            return
        if proposed == 0:
            self._plain.observe(1, verify_seconds)
        elif self._drafted_ever and not self._price_probe:
            self.check.observe(accepted + 1, step_seconds, self._plain.rate)
