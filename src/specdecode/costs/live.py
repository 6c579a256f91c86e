"""Pass costs kept current by the passes decoding runs, and written back to the stored table.

A stored table is a prior, not a verdict (issue 50): one timed while other work loaded the cores
priced a draft pass at 30x its cost, and every later run decoded plainly because of it. The
check at load (``costs/spot_check.py``) catches a table that this machine's one-row pass now
contradicts; what it misses (a check run under the same load, compiled passes, which are not
checked, a draft pass that costs more when it alternates with the target: 48 against 34.5 ms
stored for the demo draft) the passes of the run itself correct:

- in the run, every live pass moves one factor that scales the whole table (``LiveTable``,
  as ``k_policy.LiveVerifyCosts`` does for one request's verify costs: the table keeps its
  timed shape, and a step of several passes, a catch-up then one-row drafts, counts as the sum
  of their priced costs), so the next step is priced by what the passes cost now;
- across runs, the table is written back to its store, bounded: each run moves the stored
  figures ``WRITE_BACK_WEIGHT`` of the way (in ratio) to its live ones, and up by at most
  ``WRITE_BACK_MOST_UP``, so one busy run cannot push a quiet machine's table far, except where the live passes contradict the stored ones by
  more than ``CONTRADICTION_FACTOR`` (the stored figures too high, the direction that turns a
  source off for good): then the stored table is replaced by the live figures and the user
  reads one line saying so (``CostStore.take_notes``). A table is written once
  ``MIN_LIVE_PASSES`` passes have run, then each time their count doubles or
  ``WRITE_BACK_SECONDS`` have passed, so a short run writes its figures and a long one writes
  few times.

``LivePricing`` holds one decoder's tables (the target's verify passes, the draft model's
passes) and the decoder-wide ``Reprobe`` of a draft model its price turns off
(``costs/goodput.py``), shared by its requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdecode.core.timing import is_settled
from specdecode.costs.goodput import Reprobe
from specdecode.costs.k_policy import blend, interpolate
from specdecode.costs.spot_check import CONTRADICTION_FACTOR, contradiction, format_seconds

if TYPE_CHECKING:
    from specdecode.costs.store import CostStore

# How far (in ratio) one run's live figures move a stored one that they do not contradict: half
# the way, and up by at most WRITE_BACK_MOST_UP. Passes slower than stored are most often a busy
# machine (costs/spot_check.py), so a run under load that slowed every pass 3x leaves the stored
# table 1.25x high (under the check's 2x: no re-time at the next load), the next quiet run
# brings it back to 1.1x; a pass that really costs more in decoding than when timed alone (the
# demo draft alternating with its target: 1.4x) is reached in two runs.
WRITE_BACK_WEIGHT = 0.5
WRITE_BACK_MOST_UP = 1.25
MIN_LIVE_PASSES = 4  # live passes (not steps: a draft step of k tokens runs k) before a table is written back
WRITE_BACK_SECONDS = 30.0  # a long run writes its table back at most this often, between doublings
CATCH_UP_PROBE_ROWS = 64  # tokens in the timed draft pass that prices a catch-up per token


class LiveTable:
    """A pass-cost table (row count -> seconds) as timed or stored, kept current by live passes
    (one factor, ``scale``, over the whole table) and written back to ``store`` under ``name``
    (the module docstring). ``role`` names the model in the user's notes."""

    def __init__(self, timed: dict[int, float], store: CostStore | None = None, name: str = "", role: str = "model",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not timed or any(rows < 1 or seconds < 0 for rows, seconds in timed.items()):
            raise ValueError(f"LiveTable needs timings for row counts >= 1, got {timed}")
        self.timed = dict(timed)
        self.store, self.name, self.role, self.clock = store, name, role, clock
        self.scale: float | None = None  # live over timed; None before the first live pass
        self.passes = 0
        self._written_passes = 0
        self._written_at = clock()
        self._noted = False

    @property
    def factor(self) -> float:
        return 1.0 if self.scale is None else self.scale

    def seconds(self, rows: int) -> float:
        """A pass over ``rows`` rows now: the timed table, interpolated, times the live factor."""
        return interpolate(self.timed, rows) * self.factor

    def observe(self, rows: int | Sequence[int], seconds: float | None) -> None:
        """Live passes over ``rows`` (a count, or each pass's count: a catch-up then one-row
        drafts) took ``seconds`` in all (None: not to be learnt from)."""
        counts = [rows] if isinstance(rows, int) else list(rows)
        if seconds is None or seconds <= 0 or not counts or min(counts) < 1:
            return
        priced = sum(interpolate(self.timed, count) for count in counts)
        if priced <= 0:  # a table of nil costs (a lookup's) has nothing to scale
            return
        self.scale = blend(self.scale, seconds / priced)
        self.passes += len(counts)
        if self.passes >= MIN_LIVE_PASSES and (self.passes >= 2 * self._written_passes
                                               or self.clock() - self._written_at >= WRITE_BACK_SECONDS):
            self.write_back()

    def written_factor(self) -> tuple[float, float | None]:
        """(what the stored figures are multiplied by, how many times too high the live passes
        proved them: None where they do not contradict them)."""
        one_row = interpolate(self.timed, 1)
        too_high = contradiction(one_row, one_row * self.factor)
        if too_high is not None:
            return self.factor, too_high
        return min(self.factor ** WRITE_BACK_WEIGHT, WRITE_BACK_MOST_UP), None

    def write_back(self) -> None:
        """Store the table as the live passes correct it (a no-op without a store, or before
        ``MIN_LIVE_PASSES`` passes). Each write starts from the figures this run started from,
        so writing often moves nothing further."""
        self._written_passes, self._written_at = self.passes, self.clock()
        if self.store is None or self.scale is None or self.passes < MIN_LIVE_PASSES:
            return
        factor, too_high = self.written_factor()
        # Rows timed after this table was made (a longer verify table) are stored as timed:
        # they join the figures this run started from.
        for rows, seconds in self.store.stored(self.name).items():
            self.timed.setdefault(rows, seconds)
        # A timing whose repeats never settled is no prior to weigh: the live figure replaces it.
        self.store.put(self.name, {rows: seconds * (factor if is_settled(seconds) else self.factor)
                                   for rows, seconds in self.timed.items()})
        if too_high is not None and not self._noted:
            self._noted = True
            one_row = interpolate(self.timed, 1)
            self.store.notes.append(replaced_note(self.role, too_high, one_row, one_row * self.factor))


def replaced_note(role: str, factor: float, stored: float, live: float) -> str:
    return (f"stored {role} pass costs were {factor:.0f}x above the passes of this run (a {role} pass "
            f"{format_seconds(stored)} stored, {format_seconds(live)} live, over {CONTRADICTION_FACTOR:g}x); "
            "the stored costs were replaced by the live ones")


@dataclass(slots=True)
class LivePricing:
    """One decoder's live pass costs, shared by its requests: the target's verify passes, the
    draft model's passes (None where the decoder has none, or they were not timed), and when to
    try a draft model that its price turns off (``Reprobe``)."""

    verify: LiveTable | None = None
    draft: LiveTable | None = None
    draft_reprobe: Reprobe = field(default_factory=Reprobe)

    @property
    def draft_pass_seconds(self) -> float:
        """One draft-model pass over one token now."""
        return self.draft.seconds(1) if self.draft is not None else 0.0

    @property
    def draft_token_seconds(self) -> float:
        """The draft model's cost per token of a long catch-up pass now."""
        return self.draft.seconds(CATCH_UP_PROBE_ROWS) / CATCH_UP_PROBE_ROWS if self.draft is not None else 0.0


def draft_pricing(pass_seconds: float, token_seconds: float) -> LivePricing:
    """A request's own live draft pricing (not stored, its own ``Reprobe``) from the draft
    model's one-row pass and its cost per token of a long catch-up pass."""
    return LivePricing(draft=LiveTable({1: pass_seconds, CATCH_UP_PROBE_ROWS: token_seconds * CATCH_UP_PROBE_ROWS},
                                       role="draft"))
