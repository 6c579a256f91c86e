"""How many tokens a whole batch drafts per step, from acceptance and measured pass costs.

The batch engine drafts one k for every speculating row (each row capped by its own request's
k and remaining tokens; an auto row's suffix chain may go past k_max, and k with it). The choice maximises the batch's expected tokens per second:

    sum_b E(a_b, k_b) / (k draft passes over the draft-model rows + one verify pass of
                         B rows x (max k_b + 1) tokens, the batch padded to its longest row;
                         on a flat batch, llama.cpp's, of sum_b (k_b + 1) tokens)

with E(a, k) = (1 - a^(k+1)) / (1 - a) (``k_policy.expected_tokens``). k = 0 decodes the whole
batch plainly, and is kept unless some k is predicted to beat it by ``SPECULATION_MARGIN``. On a bandwidth-bound device a plain pass over B rows costs little more than one
over a single row, while a speculative pass carries B x (k + 1) rows, so as the batch grows
speculation stops paying and the choice falls to plain decoding by itself.

A row that picks its source every step (method auto: ``RowChoices``) offers several
``BatchRow``s, its lookups (prompt lookup, the suffix chain: each as long as its match, at the
rate its offers agreed with the emitted tokens) and, where it holds draft KV, the draft model.
For each k it takes the option that emits most within that k (a padded batch verifies its rows
at the width of the longest, so a row's tokens up to it cost nothing more; a flat batch prices
the k as a whole), or none: plain decoding. The draft model joins as an option only where that pays for the batch (each k is
priced with and without it: its passes and read-ahead are the batch's too), so each such row
chooses its source and draft length priced as the batch pass it rides in.

Costs are per pass *shape* (rows, tokens per row): ``PassCosts`` starts from single-sequence
passes timed over a few token counts and a few batched shapes (``time_batch_costs``, through
the backend's own ``BatchModel.pass_seconds``); unseen shapes are priced by the prior scaled by what
batched passes cost relative to it, and every shape that runs keeps its own live cost.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from specdecode.backends.base import BatchModel
from specdecode.costs.goodput import Reprobe
from specdecode.costs.k_policy import (
    MAX_PROBE_AFTER,
    PROBE_AFTER,
    PROBE_K,
    blend,
    draft_not_used_note,
    expected_tokens,
    interpolate,
    speculation_can_pay,
)

OPTIMISTIC_ACCEPTANCE = 0.9  # probe only if drafts accepted this often would pay
READ_AHEAD_HORIZON = 16  # steps over which a draft read-ahead's cost is spread
SPECULATION_MARGIN = 0.1  # the predicted gain over a plain step that speculation must show


class PassCosts:
    """Seconds of one forward pass of ``batch`` rows x ``width`` tokens.

    The prior is a table of single-sequence passes over some token counts, interpolated
    linearly (and extrapolated with the last slope); a batched pass of the same token count
    costs more (every row reads its own KV), which ``scale``, the running ratio of live passes
    to the prior, accounts for. A shape that has run is priced by its own live timings.

    Rows of different widths (``pass_seconds``) cost what their batch computes: a padded batch
    (torch) B x the longest row's tokens; a ``flat`` one (llama.cpp's ``llama_batch``, one
    micro-batch with a unified KV cache) the rows' own tokens in all, so a row that drafts
    more costs its own drafts only.
    """

    def __init__(
        self, measured: dict[int, float], live: bool = True, shapes: dict[tuple[int, int], float] | None = None,
        flat: bool = False,
    ) -> None:
        """``measured``: single-sequence passes by token count; ``shapes``: batched passes timed
        by (rows, tokens per row), which also set the starting scale; ``flat``: how rows of
        different widths are priced (the class docstring)."""
        if not measured or any(rows < 1 or seconds <= 0 for rows, seconds in measured.items()):
            raise ValueError(f"PassCosts needs positive timings for token counts >= 1, got {measured}")
        self.points = dict(measured)
        self.live = live
        self.flat = flat
        self.shapes: dict[tuple[int, int], float] = dict(shapes or {})
        ratios = [seconds / self.prior(b * t) for (b, t), seconds in self.shapes.items()]
        self.scale = sum(ratios) / len(ratios) if ratios else 1.0

    def prior(self, rows: int) -> float:
        """The single-sequence pass over ``rows`` tokens, interpolated from the timed ones."""
        return interpolate(self.points, rows)

    def seconds(self, batch: int, width: int) -> float:
        """A pass of ``batch`` rows of ``width`` tokens each."""
        measured = self.shapes.get((batch, width))
        return measured if measured is not None else self.prior(batch * width) * self.scale

    def pass_seconds(self, widths: Sequence[int]) -> float:
        """A pass whose row b feeds ``widths[b]`` tokens: padded to the longest, or flat."""
        if not self.flat or min(widths) == max(widths):
            return self.seconds(len(widths), max(widths))
        return self.prior(sum(widths)) * self.scale

    def observe(self, batch: int, width: int, seconds: float) -> None:
        self.observe_pass([width] * batch, seconds)

    def observe_pass(self, widths: Sequence[int], seconds: float) -> None:
        """A live pass (rows as in ``pass_seconds``): its shape's timing, where its rows are of
        one width or padded to one, and the scale."""
        if not self.live or not widths or min(widths) < 1 or seconds <= 0:
            return
        if self.flat and min(widths) != max(widths):  # a ragged flat pass: only its tokens in all say anything
            self.scale = blend(self.scale, seconds / self.prior(sum(widths)))
            return
        batch, width = len(widths), max(widths)
        self.shapes[(batch, width)] = blend(self.shapes.get((batch, width)), seconds)
        self.scale = blend(self.scale, seconds / self.prior(batch * width))


@dataclass(slots=True, frozen=True)
class BatchRow:
    """A speculating row, as the batch's draft-length choice sees it."""

    acceptance: float
    cap: int  # the most tokens this row may draft this step
    uses_draft_model: bool
    backlog: int = 0  # committed tokens the draft model must read before this row can draft
    observed: bool = True  # False: no draft of this row verified yet (``acceptance`` is a prior)
    remaining: int = 1 << 30  # tokens the request may still generate
    stops_early: bool = False  # its drafts end at the draft model's confidence cut-off
    # Its drafts run the target itself with layers skipped (layerskip): one such pass over the
    # batch's layer-skip rows costs this fraction of a target pass over them (kept / all layers).
    self_pass_fraction: float = 0.0
    # It drafts ``cap`` tokens whatever the batch's k (its request's k policy is fixed or
    # threshold: engine/batch_rows.row_schedule); the choice prices it, never changes it.
    fixed: bool = False


@dataclass(slots=True, frozen=True)
class RowChoices:
    """A row that picks one of ``options`` (or plain decoding) every step: method auto."""

    options: tuple[BatchRow, ...]

    @property
    def has_model(self) -> bool:
        return any(option.uses_draft_model for option in self.options)


class RowPick(NamedTuple):
    """What a row drafts at one batch k: ``option`` (None: plain decoding), its index in the
    row's options, the acceptance it is priced at and its draft length."""

    option: BatchRow | None
    index: int | None
    acceptance: float
    k: int


def uses_model(row: BatchRow | RowChoices) -> bool:
    return row.has_model if isinstance(row, RowChoices) else row.uses_draft_model


@dataclass(slots=True)
class BatchK:
    """The batch's k (module docstring). Drafting after plain steps first costs a read-ahead
    pass over the draft-model rows' backlogs, priced in and spread over the next
    ``READ_AHEAD_HORIZON`` steps (the rows then stay caught up). A lone row whose drafts were
    never verified counts as ``OPTIMISTIC_ACCEPTANCE`` until they are.

    Without cost tables it drafts each row's cap (a fixed k). After ``probe_after`` plain steps
    in a row it drafts ``PROBE_K`` tokens, so the acceptance estimates stay current, but only
    if speculation would pay with optimistic acceptance; each probe that does not bring
    speculation back doubles the wait (up to ``MAX_PROBE_AFTER``), so a load where speculation
    never pays costs few probes.

    A draft model whose pass costs say it never pays (``model_can_pay``) would never run, and
    so never be re-priced: after ``reprobe``'s wait (``costs/goodput.py``: doubling while the
    tries confirm the price, their cost a bounded share) ``choose`` sets ``model_try`` and the
    engine times a few of its one-token passes on a row that may draft with it
    (``BatchDraftModel.time_passes``), which ``observe_try`` prices it by. A try that drafted
    would first read the row's whole backlog (a turn's prompt: 1.6 s, measured); its drafts say
    nothing the price needs (``model_can_pay`` is judged at full acceptance).
    """

    k_max: int
    verify: PassCosts | None = None
    draft: PassCosts | None = None
    plain_streak: int = 0
    probe_after: int = PROBE_AFTER
    probing: bool = False
    # Whether rows that pick their source (``RowChoices``) may pick the draft model at the k of
    # the last ``choose`` (``pick``).
    model_allowed: bool = True
    reprobe: Reprobe = field(default_factory=Reprobe)  # when to try a draft model priced out
    model_try: bool = False  # the last ``choose`` asks the engine to time the priced-out model

    def choose(self, speculative: Sequence[BatchRow | RowChoices], batch_size: int) -> int:
        """The batch's k; each ``RowChoices`` row then drafts what ``pick`` says at it."""
        self.model_allowed = True
        self.model_try = (self.draft is not None and self.draft.live and any(uses_model(row) for row in speculative)
                          and not model_can_pay(self.verify, self.draft, self.k_max) and self.reprobe.due())
        if not speculative:
            # Steps with no row that could draft are not plain steps the probes wait out: a
            # draft request joining after a run of plain-only requests starts a fresh count.
            self.plain_streak = 0
            return 0
        if self.verify is None or (self.draft is None and any(uses_model(row) for row in speculative)):
            return self.k_max
        # A lookup's offers are scored every step, drafted or not (drafters/auto.py
        # LookupAgreement): only rows with a model or a fixed drafter need probes.
        if self.plain_streak >= self.probe_after and any(uses_model(row) or isinstance(row, BatchRow)
                                                         for row in speculative):
            # Probe only where fresh estimates could change the answer.
            if self._best(speculative, batch_size, OPTIMISTIC_ACCEPTANCE)[0] > 0:
                self.probing = True
                return min(PROBE_K, self.k_max)
            self.plain_streak = 0
        best, self.model_allowed = self._best(speculative, batch_size)
        if best > 0:
            self.probe_after = PROBE_AFTER  # speculation pays again: probe at the usual rate later
            lone = speculative[0]
            if batch_size == 1 and isinstance(lone, BatchRow) and lone.stops_early:
                # A lone row whose drafts stop where the draft model is unsure: the cut-off, not
                # k, should end them (priced as k full passes, long drafts look dearer than they
                # are: at one request the batch engine made 1.48x plain with the chosen k, 1.61x
                # with k = 4, measured in bench_batch_policies). The verify pass is as wide as
                # the draft turned out, so an early stop wastes nothing.
                return speculative[0].cap
        elif self.probing:
            self.probe_after = min(2 * self.probe_after, MAX_PROBE_AFTER)
        self.probing = False
        return best

    def pick(self, row: RowChoices, k: int, batch_size: int) -> RowPick:
        """What a row that picks its source drafts at the batch's ``k`` (from ``choose``)."""
        return self._pick(row, k, batch_size, self.model_allowed, None)

    def _pick(self, row: BatchRow | RowChoices, k: int, batch_size: int, model_allowed: bool,
              acceptance: float | None) -> RowPick:
        """A fixed row drafts min(k, its cap); a ``RowChoices`` row the option that emits most
        at k (ties to the earlier option: lookups come before the draft model), or nothing.
        ``acceptance`` replaces a fixed row's or a draft model's estimate (a probe's optimism),
        never a lookup's scores."""
        if isinstance(row, BatchRow):
            return RowPick(row, 0, self._rate(row, batch_size, acceptance), row.cap if row.fixed else min(k, row.cap))
        best, most = RowPick(None, None, 0.0, 0), 1.0  # plain decoding emits one token
        for index, option in enumerate(row.options):
            if option.uses_draft_model and not model_allowed:
                continue
            rate = self._rate(option, batch_size, acceptance if option.uses_draft_model else None)
            drafted = min(k, option.cap)
            if drafted > 0 and expected_tokens(rate, drafted) > most * (1 + 1e-9):
                best, most = RowPick(option, index, rate, drafted), expected_tokens(rate, drafted)
        return best

    @staticmethod
    def _rate(row: BatchRow, batch_size: int, acceptance: float | None) -> float:
        if acceptance is not None:
            return acceptance
        # A lone row not yet verified gets the benefit of the doubt once: its first step
        # measures its acceptance (as CostAwareK drafts its first k before any measurement).
        # In a batch of several the doubt is dearer (every row's verify is padded to the
        # longest draft; the rows' prompts are read into the draft model first) and the
        # rows' own estimates (the pooled rate, or the prior) stand: a fresh server's first
        # batch of 4 took 90% on trust and ran at 0.89x plain (benchmarks/replay_load.py).
        if row.observed or batch_size > 1:
            return row.acceptance
        return OPTIMISTIC_ACCEPTANCE

    def _read_ahead(self, model_rows: Sequence[BatchRow]) -> float:
        """A step's share of reading the model rows' backlogs (``READ_AHEAD_HORIZON``)."""
        behind = [row for row in model_rows if row.backlog > 0]
        if not behind:
            return 0.0
        assert self.draft is not None
        # Two tokens a step is a modest guess of how many steps the rows have left.
        horizon = max(1, min(READ_AHEAD_HORIZON, min(row.remaining for row in behind) // 2))
        return self.draft.seconds(len(behind), max(row.backlog for row in behind)) / horizon

    def _best(self, speculative: Sequence[BatchRow | RowChoices], batch_size: int,
              acceptance: float | None = None) -> tuple[int, bool]:
        """(k, whether ``RowChoices`` rows may pick the draft model) with the highest expected
        rate; ``acceptance`` replaces every estimate but lookups' (``_pick``)."""
        ways = (False, True) if any(isinstance(row, RowChoices) and row.has_model for row in speculative) else (True,)
        # Speculate only for a clear predicted gain: the cost model's error on a busy CPU is
        # about this size, and a marginal gain is lost to read-aheads and probes.
        # k = 0 is the baseline (every row plain but those of a fixed k policy, which draft
        # anyway); another k must beat it by the margin.
        best, best_model = 0, True
        best_rate = self._rate_at(0, speculative, batch_size, True, acceptance) * (1 + SPECULATION_MARGIN)
        # A lookup may offer more than k_max tokens (an auto row's suffix chain): k goes as far
        # as the longest offer; every other row drafts at most its own cap.
        longest = max([self.k_max, *(option.cap for row in speculative if isinstance(row, RowChoices)
                                     for option in row.options)])
        for k in range(1, longest + 1):
            for model_allowed in ways:
                rate = self._rate_at(k, speculative, batch_size, model_allowed, acceptance)
                if rate > best_rate * (1 + 1e-9):
                    best, best_model, best_rate = k, model_allowed, rate
        return best, best_model

    def _rate_at(self, k: int, speculative: Sequence[BatchRow | RowChoices], batch_size: int, model_allowed: bool,
                 acceptance: float | None) -> float:
        """The batch's expected tokens per second at ``k`` (``_best``)."""
        assert self.verify is not None
        picks = [self._pick(row, k, batch_size, model_allowed, acceptance) for row in speculative]
        plain_rows = batch_size - len(speculative)
        tokens = plain_rows + sum(expected_tokens(p.acceptance, p.k) for p in picks)
        seconds = self.verify.pass_seconds([1] * plain_rows + [1 + p.k for p in picks])
        # The draft model runs one pass per token of its longest draft over the rows it drafts for.
        model_picks = [p for p in picks if p.option is not None and p.option.uses_draft_model and p.k > 0]
        if model_picks:
            assert self.draft is not None
            model_rows = [p.option for p in model_picks if p.option is not None]
            seconds += (max(p.k for p in model_picks) * self.draft.seconds(len(model_rows), 1)
                        + self._read_ahead(model_rows))
        skipping = [p for p in picks if p.option is not None and p.option.self_pass_fraction > 0 and p.k > 0]
        if skipping:  # a pass of the target's kept layers over those rows per token of the longest
            fraction = max(p.option.self_pass_fraction for p in skipping if p.option is not None)
            seconds += max(p.k for p in skipping) * fraction * self.verify.seconds(len(skipping), 1)
        return tokens / seconds

    def observe(
        self, widths: Sequence[int], drafted: int, verify_seconds: float | None,
        draft_rows: int, draft_passes: int, draft_seconds: float,
    ) -> None:
        """A step's verify pass (row b fed ``widths[b]`` tokens, ``drafted`` of them drafts in
        all; its time None where a row also fed a prompt's tail: not to be learnt from) and its
        draft passes over ``draft_rows`` rows (0 passes: not to be learnt from)."""
        self.plain_streak = 0 if drafted else self.plain_streak + 1
        if self.verify is not None and verify_seconds is not None:
            self.verify.observe_pass(widths, verify_seconds)
        if self.draft is not None and draft_passes > 0:
            self.draft.observe(draft_rows, 1, draft_seconds / draft_passes)
        self.reprobe.step(draft_seconds + (verify_seconds or 0.0), ran=draft_rows > 0)

    def observe_try(self, seconds: Sequence[float]) -> None:
        """The engine timed one-token passes of the priced-out draft model (``model_try``): the
        quickest prices it, and the try's outcome sets the wait for the next."""
        assert self.draft is not None and seconds
        self.model_try = False
        self.draft.observe(1, 1, min(seconds))
        self.reprobe.outcome(model_can_pay(self.verify, self.draft, self.k_max), sum(seconds))


def time_batch_costs(
    model: BatchModel, row_counts: Sequence[int], shapes: Sequence[tuple[int, int]], live: bool, repeats: int,
    stored: Mapping[int, float] | None = None,
) -> PassCosts:
    """A ``PassCosts`` for ``model`` from its own passes: one sequence over each of ``row_counts``
    tokens (the prior; those in ``stored``, an earlier run's table, are not timed again) and the
    batched ``shapes``, timed on scratch sequences of its pool's kind."""
    stored = stored or {}
    wanted = [(1, rows) for rows in row_counts if rows not in stored] + list(shapes)
    timed = model.pass_seconds(wanted, repeats) if wanted else {}
    prior = {rows: stored[rows] if rows in stored else timed[(1, rows)] for rows in row_counts}
    # A backend that merges a prompt into the verify rows runs flat batches (backends/base.py).
    return PassCosts(prior, live=live, shapes={shape: timed[shape] for shape in shapes} or None,
                     flat=model.merges_prefill)


def draft_model_note(verify: PassCosts | None, draft: PassCosts | None, k_max: int) -> str | None:
    """Why a draft model row decodes plainly where the timed passes rule drafting out
    (``model_can_pay`` false; ``k_policy.draft_not_used_note``), else None."""
    if verify is None or draft is None or model_can_pay(verify, draft, k_max):
        return None
    return draft_not_used_note([verify.seconds(1, width) for width in range(1, k_max + 2)], draft.seconds(1, 1))


def model_can_pay(verify: PassCosts | None, draft: PassCosts | None, k_max: int) -> bool:
    """Whether one row drafting with the draft model beats plain decoding at all, at full
    acceptance (``k_policy.speculation_can_pay`` on the timed single-row passes); True where
    the passes were not timed (nothing says it cannot)."""
    if verify is None or draft is None:
        return True
    rows = [verify.seconds(1, width) for width in range(1, k_max + 2)]
    return speculation_can_pay(rows, draft.seconds(1, 1), k_max)
