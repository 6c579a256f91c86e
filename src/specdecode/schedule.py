"""How many tokens to draft each step: fixed, cost-aware (``--k auto``) or by thresholds.

A step that drafts k tokens, each accepted with probability a independently, emits
E(k) = (1 - a^(k+1)) / (1 - a) tokens (the bonus token counted; E(0) = 1, plain decoding) and
costs k draft passes plus one verify pass over k + 1 rows. The cost-aware schedule keeps a
running estimate of a and the measured costs on this machine and picks, every step, the k in
0..k_max that maximises E(k) / cost(k): k = 0 when speculation does not pay.

- acceptance: per-token, pooled over recent steps with exponential forgetting (a step that
  proposed n tokens and had m accepted tried m + 1 positions, or n if all were accepted);
- verify cost per row count: measured once per engine by timing the target on 1..k_max + 1
  rows (``SpecEngine.verify_costs``), then kept current from the live steps on the CPU;
- draft cost per pass: measured live from the draft time of each step.

After ``PROBE_AFTER`` plain steps in a row the schedule drafts a little again, so a prompt
whose later part becomes predictable gets speculation back.

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

from .config import DEFAULT_K_MAX

ACCEPTANCE_DECAY = 0.85  # weight kept by older observations per step: a window of ~7 steps
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0  # pseudo-trials behind the prior
# Goodput comes in runs (easy and hard stretches of text) that recent steps predict poorly; a
# window of ~30 steps judges a source over the request, so a few bad steps do not switch off
# a source that pays overall.
GOODPUT_DECAY = 0.97
COST_DECAY = 0.8  # weight of the old cost estimate in a live update
PROBE_AFTER = 12  # plain steps in a row before drafting again
PROBE_K = 2
MAX_PROBE_AFTER = 96  # the batch engine's longest wait between probes
OPTIMISTIC_ACCEPTANCE = 0.9  # the batch engine probes only if drafts accepted this often would pay
READ_AHEAD_HORIZON = 16  # steps over which the batch engine spreads a draft read-ahead's cost
RAISE_ABOVE = 0.8
DROP_BELOW = 0.4


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


def blend(old: float | None, new: float) -> float:
    """A live cost estimate moved towards a new measurement (the first one taken as is)."""
    return new if old is None else COST_DECAY * old + (1 - COST_DECAY) * new


def update_verify_cost(verify_seconds: list[float], proposed: int, seconds: float) -> None:
    """Blend a live verify pass over ``proposed`` + 1 rows into the per-row-count cost table."""
    if proposed + 1 <= len(verify_seconds):
        verify_seconds[proposed] = blend(verify_seconds[proposed], seconds)


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


@dataclass(slots=True)
class GoodputEstimate:
    """Tokens per second of one way of stepping, pooled over its recent steps with forgetting.

    Starts as ``prior_seconds`` of decoding at ``prior_rate``, so a source that has not run yet
    has a rate to compare (a hopeful prior gets it tried); the prior fades like any old step.
    """

    prior_rate: float
    prior_seconds: float
    tokens: float = 0.0
    seconds: float = 0.0
    decay: float = GOODPUT_DECAY

    def __post_init__(self) -> None:
        self.tokens += self.prior_rate * self.prior_seconds
        self.seconds += self.prior_seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.seconds = self.seconds * self.decay + seconds


class KSchedule(Protocol):
    def next_k(self) -> int:
        """Tokens to draft this step (0 = plain step)."""

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int, verify_seconds: float) -> None:
        """What the step did: drafts proposed and accepted, its measured draft and verify time."""


@dataclass(slots=True)
class FixedK:
    k: int

    def next_k(self) -> int:
        return self.k

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int, verify_seconds: float) -> None:
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

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int, verify_seconds: float) -> None:
        self.acceptance.observe(proposed, accepted)
        rate = self.acceptance.rate
        if rate > RAISE_ABOVE:
            self.k = min(self.k + 1, self.k_max)
        elif rate < DROP_BELOW:
            self.k = self.k_min


@dataclass(slots=True)
class CostAwareK:
    """Pick the k that maximises E(k) / measured cost(k) each step."""

    verify_seconds: list[float]  # index r - 1: a verify pass over r rows; at least k_max + 1 entries
    k_max: int = DEFAULT_K_MAX
    first_k: int = 5  # before any draft cost is measured
    live_costs: bool = True  # update verify costs from steps; False where timings are asynchronous
    draft_pass_seconds: float | None = None
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    plain_streak: int = 0
    steps: int = 0

    def next_k(self) -> int:
        if self.draft_pass_seconds is None:  # no draft pass measured yet
            k = min(self.first_k, self.k_max)
        elif self.plain_streak >= PROBE_AFTER:
            k = min(PROBE_K, self.k_max)
        else:
            k = best_k(self.acceptance.rate, self.verify_seconds, self.draft_pass_seconds, self.k_max)
        return k

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int, verify_seconds: float) -> None:
        self.plain_streak = self.plain_streak + 1 if proposed == 0 else 0
        self.acceptance.observe(proposed, accepted)
        self.steps += 1
        if proposed > 0 and self.steps > 1:
            # The first step's draft time includes the drafter's own prefill of the prompt, so it
            # says nothing about a draft pass. A drafter that proposes without model passes
            # (n-gram lookup) costs its host time per token.
            per_pass = draft_seconds / (draft_passes if draft_passes > 0 else proposed)
            self.draft_pass_seconds = blend(self.draft_pass_seconds, per_pass)
        if self.live_costs:
            update_verify_cost(self.verify_seconds, proposed, verify_seconds)


class RowCosts:
    """Seconds of one forward pass as a function of the rows (tokens) it carries, B x T padded.

    Starts from a few measured row counts (``engine.time_passes``) and interpolates linearly
    between them (extrapolating the last slope past the largest); live passes blend into the
    table at their own row count, so the estimate follows what the batch really costs.
    """

    def __init__(self, measured: dict[int, float], live: bool = True) -> None:
        if not measured or any(rows < 1 or seconds <= 0 for rows, seconds in measured.items()):
            raise ValueError(f"RowCosts needs positive timings for row counts >= 1, got {measured}")
        self.points = dict(measured)
        self.live = live

    def seconds(self, rows: int) -> float:
        known = sorted(self.points)
        if rows in self.points:
            return self.points[rows]
        if rows < known[0]:
            return self.points[known[0]]
        below = max(r for r in known if r < rows)
        above = [r for r in known if r > rows]
        if above:
            upper = above[0]
        elif len(known) >= 2:  # extrapolate the last segment's slope
            upper, below = below, known[-2]
        else:
            return self.points[below] * rows / below
        slope = (self.points[upper] - self.points[below]) / (upper - below)
        return self.points[below] + slope * (rows - below)

    def observe(self, rows: int, seconds: float) -> None:
        if self.live and rows >= 1 and seconds > 0:
            self.points[rows] = blend(self.seconds(rows), seconds)


@dataclass(slots=True, frozen=True)
class BatchRow:
    """A speculating row, as the batch's draft-length choice sees it."""

    acceptance: float
    cap: int  # the most tokens this row may draft this step
    uses_draft_model: bool
    backlog: int = 0  # committed tokens the draft model must read before this row can draft
    observed: bool = True  # False: no draft of this row verified yet (``acceptance`` is a prior)
    remaining: int = 1 << 30  # tokens the request may still generate


@dataclass(slots=True)
class BatchK:
    """One draft length for a whole batch: the k that maximises the batch's expected tokens per
    second, sum_b E(a_b, k_b) / (k draft passes over the draft-model rows + one verify pass over
    B x (max k_b + 1) rows, the batch padded to its longest row), with k_b = min(k, row b's cap).
    Drafting after plain steps first costs a read-ahead pass over the rows' backlogs, priced in
    (spread over the next ``READ_AHEAD_HORIZON`` steps, since the rows then stay caught up). A
    row whose drafts were never verified counts as ``OPTIMISTIC_ACCEPTANCE`` until they are.
    k = 0 decodes the whole batch plainly: as the batch grows a plain pass gets relatively
    cheaper (more rows per weight read) and a speculative one dearer (B x (k + 1) rows), so
    speculation fades out where it stops paying.

    Without cost tables it drafts each row's cap (a fixed k). After ``probe_after`` plain steps
    in a row it drafts ``PROBE_K`` tokens, so the acceptance estimates stay current, but only
    if speculation would pay with optimistic acceptance (``OPTIMISTIC_ACCEPTANCE``); each probe
    that does not bring speculation back doubles the wait (up to ``MAX_PROBE_AFTER``), so a load
    where speculation never pays costs few probes.
    """

    k_max: int
    verify: RowCosts | None = None
    draft: RowCosts | None = None
    plain_streak: int = 0
    probe_after: int = PROBE_AFTER
    probing: bool = False

    def choose(self, speculative: Sequence[BatchRow], batch_size: int) -> int:
        if not speculative:
            return 0
        if self.verify is None or (self.draft is None and any(row.uses_draft_model for row in speculative)):
            return self.k_max
        if self.plain_streak >= self.probe_after:
            # Probe only where fresh estimates could change the answer: if even drafts accepted
            # at OPTIMISTIC_ACCEPTANCE would not pay at this batch size, the estimates are not
            # what keeps the batch plain.
            if self._best(speculative, batch_size, OPTIMISTIC_ACCEPTANCE) > 0:
                self.probing = True
                return min(PROBE_K, self.k_max)
            self.plain_streak = 0
        best = self._best(speculative, batch_size)
        if best > 0:
            self.probe_after = PROBE_AFTER  # speculation pays again: probe at the usual rate later
        elif self.probing:
            self.probe_after = min(2 * self.probe_after, MAX_PROBE_AFTER)
        self.probing = False
        return best

    def _best(self, speculative: Sequence[BatchRow], batch_size: int, acceptance: float | None = None) -> int:
        """The k with the highest expected rate; ``acceptance`` replaces every row's estimate."""
        assert self.verify is not None
        model_rows = [row for row in speculative if row.uses_draft_model]
        plain_rows = batch_size - len(speculative)
        behind = [row for row in model_rows if row.backlog > 0]
        read_ahead = 0.0
        if behind:
            assert self.draft is not None
            # One pass reads every backlog; the rows then draft for many steps: spread its cost
            # over as many steps as they are likely to have left (two tokens a step).
            horizon = max(1, min(READ_AHEAD_HORIZON, min(row.remaining for row in behind) // 2))
            read_ahead = self.draft.seconds(len(behind) * max(row.backlog for row in behind)) / horizon
        best, best_rate = 0, batch_size / self.verify.seconds(batch_size)

        def rate_of(row: BatchRow) -> float:
            if acceptance is not None:
                return acceptance
            # A row not yet verified is given the benefit of the doubt once: its first step
            # measures its acceptance (as CostAwareK drafts its first k before any measurement).
            return row.acceptance if row.observed else OPTIMISTIC_ACCEPTANCE

        for k in range(1, self.k_max + 1):
            capped = [(rate_of(row), min(k, row.cap)) for row in speculative]
            tokens = plain_rows + sum(expected_tokens(a, kb) for a, kb in capped)
            rows = batch_size * (1 + max(kb for _, kb in capped))  # the pass is padded to the longest row
            seconds = self.verify.seconds(rows)
            if model_rows:
                assert self.draft is not None
                seconds += k * self.draft.seconds(len(model_rows)) + read_ahead
            if tokens / seconds > best_rate * (1 + 1e-9):
                best, best_rate = k, tokens / seconds
        return best

    def observe(
        self, rows: int, drafted: int, verify_seconds: float, draft_rows: int, draft_passes: int, draft_seconds: float
    ) -> None:
        """A step's verify pass over ``rows`` rows (``drafted`` of them drafts) and its draft passes."""
        self.plain_streak = 0 if drafted else self.plain_streak + 1
        if self.verify is not None:
            self.verify.observe(rows, verify_seconds)
        if self.draft is not None and draft_passes > 0:
            self.draft.observe(draft_rows, draft_seconds / draft_passes)
