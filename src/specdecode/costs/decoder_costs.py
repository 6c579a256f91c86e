"""The pass costs one decoder times, once, and the draft-length schedules built on them.

The single-request engine times its target's verify passes (``SpecEngine.verify_costs``);
``DecoderCosts`` adds the draft model's (one pass over one token, and a token's share of a
long catch-up pass, for the auto method) and builds each request's ``KSchedule``;
``batch_pass_costs`` times the shapes the batch engine will run.

Both tables are priors that the requests' live passes correct (``LivePricing``,
``costs/live.py``): the decoder's copy follows every request's passes, the next request is
priced by it, and it is written back to the stored table, bounded. A draft model priced out is
tried again now and then (``Reprobe``, one per decoder, so a price its tries confirm costs ever
rarer tries across requests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from specdecode.core.timing import COST_PROBE_ROWS, VERIFY_COST_REPEATS
from specdecode.costs.batch_k import PassCosts, time_batch_costs
from specdecode.costs.goodput import Reprobe
from specdecode.costs.k_policy import CostAwareK, KSchedule, ThresholdK, draft_not_used_note, speculation_can_pay
from specdecode.costs.live import CATCH_UP_PROBE_ROWS, LivePricing, LiveTable
from specdecode.costs.store import DRAFT_TABLE, VERIFY_TABLE, CostStore

if TYPE_CHECKING:
    import torch

    from specdecode.backends.base import BatchModel, SequenceModel


# The engine and the drafters sit above the costs: what the costs read of them is named here.
class VerifyingEngine(Protocol):
    """The engine whose target passes are timed (engine/single.py's ``SpecEngine``)."""

    sync_timing: bool  # its stopwatches synchronise: step timings are right on a GPU too

    @property
    def device(self) -> torch.device: ...

    def verify_costs(self, max_rows: int) -> list[float]: ...  # seconds over 1..max_rows rows


class ModelDrafter(Protocol):
    """A drafter with a model of its own (drafters/draft_model.py's ``DraftModelDrafter``)."""

    model: SequenceModel  # the draft model's sequence


BATCH_PROBE_MAX_ROWS = 64  # the largest pass timed for the batch engine's costs; larger ones extrapolate


class DecoderCosts:
    """The costs a decoder's policies read, each timed on first use and kept."""

    def __init__(self, engine: VerifyingEngine, draft: ModelDrafter | None, draft_store: CostStore | None = None) -> None:
        self.engine = engine
        self.draft = draft
        self.draft_store = draft_store  # the draft model's timings from an earlier run (costs/store.py)
        self._draft_table: LiveTable | None = None  # a draft pass, and a catch-up pass, as live passes correct them
        self._verify_table: LiveTable | None = None
        self.draft_reprobe = Reprobe()  # when to try a draft model its price turns off

    @property
    def live(self) -> bool:
        """Whether step timings may update the costs: on an asynchronous device they are only
        right with synchronising stopwatches."""
        return self.engine.device.type == "cpu" or self.engine.sync_timing

    def verify(self, max_rows: int) -> list[float]:
        """Seconds of a target pass over 1..max_rows rows (``SpecEngine.verify_costs``)."""
        return self.engine.verify_costs(max_rows)

    def draft_model(self) -> tuple[float, float]:
        """Seconds of one draft-model pass over one token, and per token of a long catch-up
        pass (timed once per decoder, then kept current by live passes): whether the draft
        model can pay at all on this machine, and what reading the tokens it missed costs the
        auto method."""
        table = self.draft_table()
        return table.seconds(1), table.seconds(CATCH_UP_PROBE_ROWS) / CATCH_UP_PROBE_ROWS

    def draft_table(self) -> LiveTable:
        """The draft model's pass costs (stored, or timed once), kept current by live passes."""
        if self._draft_table is None:
            assert self.draft is not None
            rows = CATCH_UP_PROBE_ROWS
            seconds = self.draft_store.get(DRAFT_TABLE) if self.draft_store is not None else {}
            if not {1, rows} <= set(seconds):
                seconds = self.draft.model.pass_seconds([1, rows], VERIFY_COST_REPEATS, logits_last=1)
                if self.draft_store is not None:
                    self.draft_store.put(DRAFT_TABLE, seconds)
            self._draft_table = LiveTable({1: seconds[1], rows: seconds[rows]}, self.draft_store, DRAFT_TABLE, "draft")
        return self._draft_table

    def verify_table(self, max_rows: int) -> LiveTable:
        """The target's verify costs over the rows the engine timed up to ``max_rows``, kept
        current by live passes and written back to its stored table."""
        costs = self.verify(max_rows)
        timed = {rows: costs[rows - 1] for rows in range(1, max_rows + 1) if rows in COST_PROBE_ROWS or rows == max_rows}
        if self._verify_table is None:
            self._verify_table = LiveTable(timed, getattr(self.engine, "cost_store", None), VERIFY_TABLE, "target")
        for rows, seconds in timed.items():  # a longer table (suffix decoding's) adds its rows
            self._verify_table.timed.setdefault(rows, seconds)
        return self._verify_table

    def live_pricing(self, max_rows: int) -> LivePricing | None:
        """The live costs a request's schedule reports its passes to and reads the draft model's
        price from (verify rows up to ``max_rows``); None where step timings are asynchronous."""
        if not self.live:
            return None
        return LivePricing(self.verify_table(max_rows), self.draft_table() if self.draft is not None else None,
                           self.draft_reprobe)

    def schedule(self, policy: str, k: int, k_max: int, with_draft_model: bool, model_free: bool = False) -> KSchedule | None:
        """A fresh per-request draft-length schedule (None: fixed k); the cost-aware one drafts
        with a draft model whose priced pass rules out any gain only when the decoder's
        ``draft_reprobe`` tries it, reports its passes to the decoder's live tables, and prices
        a model-free drafter's (prompt lookup's) drafts from its first step."""
        if policy == "threshold":
            return ThresholdK(k=min(k, k_max), k_max=k_max)
        if policy == "cost":
            costs = self.engine.verify_costs(k_max + 1)
            pricing = self.live_pricing(k_max + 1)
            verify_live = pricing.verify if pricing is not None else None
            if model_free:
                # A lookup costs no model pass: its draft cost is known (nil) from the first step,
                # so the first match is priced like any other. Drafting k blindly there put a
                # (k + 1)-row verify on every request's first matches: about 3 passes lost per
                # failed match where rows cost 0.6-0.7 of a pass (llama.cpp on 2 cores).
                return CostAwareK(costs, k_max=k_max, draft_pass_seconds=0.0, live_costs=self.live,
                                  reads_backlog=False, reprobe=None, verify_live=verify_live)
            if not with_draft_model:  # model passes not timed up front (layer skip): its first k, then measured
                return CostAwareK(costs, k_max=k_max, first_k=min(k, k_max), live_costs=self.live, verify_live=verify_live)
            # A draft model whose pass costs too much next to the target's extra verify rows
            # loses to plain decoding even when every token is accepted: it drafts only when
            # tried again (CostAwareK.reprobe), in case its price is wrong.
            can_pay = speculation_can_pay(costs, self.draft_model()[0], k_max)
            return CostAwareK(costs, k_max=k_max, first_k=min(k, k_max) if can_pay else 0, live_costs=self.live,
                              reprobe=self.draft_reprobe, verify_live=verify_live,
                              draft_live=pricing.draft if pricing is not None else None)
        return None

    def take_notes(self) -> list[str]:
        """Lines for the user about the stored cost tables this decoder read, once each: a table
        the machine contradicted and that was re-timed, timings too disturbed to store
        (``CostStore.notes``). A request that plans after a timing shows them."""
        stores = (getattr(self.engine, "cost_store", None), self.draft_store)
        return [note for store in stores if store is not None for note in store.take_notes()]

    def draft_model_note(self, k_max: int) -> str | None:
        """One line saying why the cost-aware k never drafts with the draft model, where the
        measured pass costs rule it out, followed by what the check of the stored tables those
        costs came from found (``take_notes``); None where the draft can pay and there is no news.
        """
        costs = self.engine.verify_costs(k_max + 1)
        draft_pass = self.draft_model()[0]
        lines = []
        if not speculation_can_pay(costs, draft_pass, k_max):
            lines.append(draft_not_used_note(costs, draft_pass))
        # After the timings above: a stored table they read may just have been re-timed.
        lines += self.take_notes()
        return "; ".join(lines) or None


def batch_pass_costs(
    target: BatchModel, draft: BatchModel | None, max_batch: int, k_max: int, live: bool, longest_draft: int = 0,
    store: CostStore | None = None,
) -> tuple[PassCosts, PassCosts | None]:
    """(target, draft) pass costs for a batch engine of ``max_batch`` rows drafting up to
    ``k_max`` (one row's lookup up to ``longest_draft``): one sequence over 1..64 rows, and the
    batched shapes it will run often. ``store``: the target's cost store, whose verify table
    (a pass over r rows, the single path's too) gives the one-sequence passes an earlier run
    timed and keeps the ones timed now, so that a server or script started again on this
    machine does not time them again (the few batched shapes are timed each time)."""
    most_rows = max(max_batch * (k_max + 1), longest_draft + 1)
    rows = sorted({1, 2, 4, 8, 16, 32, 64, most_rows} & set(range(1, min(most_rows, BATCH_PROBE_MAX_ROWS) + 1)))
    # Batched shapes the engine will run often: plain steps and short drafts, at a middling and
    # the largest batch.
    shapes = sorted({(b, t) for b in {min(4, max_batch), max_batch} if b > 1 for t in (1, 3)})
    stored = store.get(VERIFY_TABLE) if store is not None else {}
    verify_costs = time_batch_costs(target, rows, shapes, live, VERIFY_COST_REPEATS, stored)
    fresh = {row: verify_costs.points[row] for row in rows if row not in stored}
    if store is not None and fresh:
        store.put(VERIFY_TABLE, fresh)
    if draft is None:
        return verify_costs, None
    draft_rows = [r for r in rows if r <= 2 * max_batch] or [1]
    draft_costs = time_batch_costs(draft, draft_rows, [(b, 1) for b, t in shapes if t == 1], live, VERIFY_COST_REPEATS)
    return verify_costs, draft_costs
