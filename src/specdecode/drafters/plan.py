"""What one request decodes with, as the engine reads it (``drafters/planner.py`` builds it)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specdecode.costs.k_policy import KSchedule
from specdecode.drafters.base import Drafter, TreeDrafter


@dataclass(slots=True, frozen=True)
class RequestPlan:
    """A request's method, its drafter and its draft length.

    ``k`` is the most tokens one chain step drafts; a ``schedule`` chooses each step's k
    (``KSchedule.next_k``), never above it. Plain decoding is ``drafter=None, k=0``. A tree
    drafter's steps are bounded by its tree's shape and by the tokens left, so ``k`` is 0 there.
    """

    method: str
    drafter: Drafter | TreeDrafter | None = None  # None: plain decoding
    k: int = 0
    schedule: KSchedule | None = None  # None: every chain step drafts up to k (the drafter may stop early)
    tree: bool = False  # the drafter proposes token trees (TreeDrafter), verified with tree attention
    # Method auto: steps per source (ngram, suffix, draft, none), filled as it decodes.
    steps_by_source: Counter[str] | None = field(default=None)
    # A line for the user: why the plan decodes plainly where the user asked for speculation, and
    # stored cost tables found wrong and re-timed (costs/store.py).
    note: str | None = None

    def __post_init__(self) -> None:
        if self.drafter is None and (self.k or self.tree or self.schedule is not None):
            raise ValueError("A plan without a drafter decodes plainly: k 0, no schedule, no tree.")
        if self.tree and self.k:
            raise ValueError("A tree plan's steps are bounded by its trees: k must be 0.")
        if self.drafter is not None and not self.tree and self.k < 1:
            raise ValueError(f"A chain drafter needs k >= 1, got {self.k}.")


PLAIN = RequestPlan("none")
