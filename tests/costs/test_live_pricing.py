"""Pricing as decoding runs (issue 50), on hand-made timings: live passes correct a cost table
and are written back to its store, bounded, a stored table the live passes prove over 2x too high
is replaced (and the user told); a source priced out is tried again after a wait that grows while
the tries confirm the price, at a bounded share of the time; a source whose measured goodput falls
below plain decoding's stops for the request. The same on tiny models, with passes slowed by a
sleep: tests/costs/test_live_pricing_models.py."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdecode.core.paths import CACHE_ENV_VAR
from specdecode.costs.batch_k import PROBE_K, BatchK, BatchRow, PassCosts, RowChoices, model_can_pay
from specdecode.costs.goodput import (
    MIN_JUDGED_STEPS,
    REPROBE_FIRST_AFTER,
    REPROBE_MAX_AFTER,
    REPROBE_SHARE,
    Reprobe,
    SourceCheck,
)
from specdecode.costs.k_policy import CostAwareK, speculation_can_pay
from specdecode.costs.live import (
    MIN_LIVE_PASSES,
    WRITE_BACK_MOST_UP,
    WRITE_BACK_SECONDS,
    WRITE_BACK_WEIGHT,
    LivePricing,
    LiveTable,
)
from specdecode.costs.spot_check import CONTRADICTION_FACTOR
from specdecode.costs.store import DRAFT_TABLE, CostStore
from specdecode.drafters.auto import AutoDrafter
from specdecode.drafters.ngram import NgramDrafter

# A bandwidth-bound target (seconds): extra verify rows nearly free.
FLAT_VERIFY = [0.030 + 0.001 * r for r in range(9)]
DRAFT_PASS = 0.003  # what a draft pass really costs: a tenth of a target pass
TOO_HIGH = 30  # issue 50's stored draft table was 30-120x too high
STORED_DRAFT = {1: TOO_HIGH * DRAFT_PASS, 64: TOO_HIGH * 0.005}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    return tmp_path


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def draft_store() -> CostStore:
    return CostStore({"role": "draft", "model": "tiny"})


def stored(store: CostStore) -> dict[int, float]:
    return {int(r): s for r, s in json.loads(store.path.read_text())["tables"][DRAFT_TABLE].items()}


# --- live tables and their write-back ------------------------------------------------------------

def test_live_passes_scale_the_whole_table_a_catch_up_counted_at_its_rows() -> None:
    table = LiveTable({1: 0.010, 64: 0.100})
    table.observe([1, 1, 1], 0.015)  # three one-row passes at half their timed cost
    assert table.seconds(1) == pytest.approx(0.005) and table.seconds(64) == pytest.approx(0.050)
    shape = LiveTable({1: 0.010, 64: 0.100})
    catch_up = 0.010 + (0.100 - 0.010) * 32 / 63  # a 33-row pass, interpolated
    shape.observe([33, 1], 0.5 * (catch_up + 0.010))  # a 33-row catch-up, then a one-row draft, at half
    assert shape.factor == pytest.approx(0.5)
    shape.observe(1, None)  # a pass not to learn from
    shape.observe([], 1.0)
    assert shape.passes == 2


@pytest.mark.parametrize(("live_over_stored", "moved"), [
    (0.6, 0.6 ** WRITE_BACK_WEIGHT),  # faster, within 2x: half the way (in ratio)
    (1.4, 1.4 ** WRITE_BACK_WEIGHT),  # slower: half the way too (a pass dearer in decoding than alone) ...
    (5.0, WRITE_BACK_MOST_UP),  # ... but by at most WRITE_BACK_MOST_UP: a run 5x slower is most often load
])
def test_live_figures_that_do_not_contradict_move_the_stored_table_a_bounded_way(
        cache: Path, live_over_stored: float, moved: float) -> None:
    store, clock = draft_store(), Clock()
    store.put(DRAFT_TABLE, {1: 0.010, 64: 0.100})
    table = LiveTable(store.get(DRAFT_TABLE), store, DRAFT_TABLE, "draft", clock=clock)
    for _ in range(MIN_LIVE_PASSES - 1):
        table.observe(1, 0.010 * live_over_stored)
    assert stored(store) == {1: 0.010, 64: 0.100}  # too few passes to write
    table.observe(1, 0.010 * live_over_stored)
    assert stored(store) == pytest.approx({1: 0.010 * moved, 64: 0.100 * moved})
    table.write_back()  # writing again starts from the run's own prior: nothing compounds
    assert stored(store) == pytest.approx({1: 0.010 * moved, 64: 0.100 * moved})
    assert store.take_notes() == []


def test_a_stored_table_the_live_passes_prove_30x_too_high_is_replaced_and_the_user_told(cache: Path) -> None:
    store = draft_store()
    store.put(DRAFT_TABLE, STORED_DRAFT)
    table = LiveTable(store.get(DRAFT_TABLE), store, DRAFT_TABLE, "draft")
    for _ in range(MIN_LIVE_PASSES):
        table.observe(1, DRAFT_PASS)
    assert stored(store) == pytest.approx({1: DRAFT_PASS, 64: 0.005})
    [note] = store.take_notes()
    assert note.startswith("stored draft pass costs were 30x above the passes of this run")
    assert f"over {CONTRADICTION_FACTOR:g}x" in note and note.endswith("replaced by the live ones")
    for _ in range(4 * MIN_LIVE_PASSES):
        table.observe(1, DRAFT_PASS)
    assert store.take_notes() == []  # told once


def test_writes_are_bounded_by_doubling_pass_counts_or_time(cache: Path) -> None:
    store, clock = draft_store(), Clock()
    table = LiveTable({1: 0.010}, store, DRAFT_TABLE, clock=clock)
    writes = []
    table.write_back = lambda: writes.append(table.passes) or LiveTable.write_back(table)  # type: ignore[method-assign]
    for _ in range(100):
        table.observe(1, 0.010)
    assert writes == [MIN_LIVE_PASSES * 2**i for i in range(5) if MIN_LIVE_PASSES * 2**i <= 100]
    clock.now += WRITE_BACK_SECONDS
    table.observe(1, 0.010)
    assert writes[-1] == 101


# --- when to try again, and when to stop ---------------------------------------------------------

def test_a_reprobe_waits_longer_after_each_try_that_confirms_and_starts_over_after_one_that_pays() -> None:
    reprobe = Reprobe(first_after=4, max_after=16, share=1.0)
    waits = []
    for _ in range(4):
        wait = 0
        while not reprobe.due():
            reprobe.step(1.0, ran=False)
            wait += 1
        reprobe.step(1.0, ran=True)
        reprobe.outcome(paid=False, seconds=1.0)
        waits.append(wait)
    assert waits == [4, 8, 16, 16]
    reprobe.outcome(paid=True, seconds=1.0)
    assert reprobe.after == 4


def test_failed_tries_cost_at_most_their_share_of_the_time() -> None:
    reprobe = Reprobe(first_after=1)
    reprobe.step(1.0, ran=False)
    assert reprobe.due()
    reprobe.outcome(paid=False, seconds=3.0)  # a dear try: 3 s
    steps = 0
    while not reprobe.due():
        reprobe.step(1.0, ran=False)
        steps += 1
    assert reprobe.spent <= REPROBE_SHARE * reprobe.seconds and steps >= 3.0 / REPROBE_SHARE - 2


def test_a_source_slower_than_plain_stops_and_a_try_that_pays_brings_it_back() -> None:
    check, plain_rate = SourceCheck(), 1 / 0.030
    for step in range(MIN_JUDGED_STEPS):
        assert not check.off
        assert check.observe(2, 0.080, plain_rate) is None  # 2 tokens in 80 ms: 0.75x plain
    assert check.off
    assert check.observe(2, 0.080, plain_rate) is False  # a try as slow: still off
    assert check.observe(4, 0.080, plain_rate) is True and not check.off  # 1.5x plain: back, a fresh window
    assert check.steps == 1


# --- the draft-length schedule (method draft, --k auto) ------------------------------------------

def run_cost_aware(schedule: CostAwareK, steps: int, draft_pass: float, accepted_share: float = 1.0,
                   verify: list[float] = FLAT_VERIFY) -> list[int]:
    """``steps`` steps of ``schedule`` whose drafter's passes really take ``draft_pass`` (the
    first draft of a request reads the prompt: 20 passes' worth) with ``accepted_share`` of
    each draft accepted; the k of each step."""
    ks, drafted = [], False
    for _ in range(steps):
        k = schedule.next_k()
        ks.append(k)
        backlog = 0.0 if drafted or k == 0 else 20 * draft_pass
        accepted = int(k * accepted_share)
        schedule.observe(k, accepted, backlog + k * draft_pass, k, verify[k])
        drafted = drafted or k > 0
    return ks


def test_a_draft_priced_30x_too_high_is_tried_corrected_and_used_again() -> None:
    """The table's price says the draft never pays (first_k 0): it is tried after
    REPROBE_FIRST_AFTER steps, twice (the first try reads the prompt, the second times a pass),
    its measured pass prices it back, and it drafts from then on."""
    assert not speculation_can_pay(FLAT_VERIFY, STORED_DRAFT[1], 8) and speculation_can_pay(FLAT_VERIFY, DRAFT_PASS, 8)
    table = LiveTable(dict(STORED_DRAFT), role="draft")
    schedule = CostAwareK(list(FLAT_VERIFY), k_max=8, first_k=0, draft_live=table)
    ks = run_cost_aware(schedule, REPROBE_FIRST_AFTER + 20, DRAFT_PASS)
    first = next(i for i, k in enumerate(ks) if k > 0)
    assert first == REPROBE_FIRST_AFTER and ks[first:first + 2] == [PROBE_K, PROBE_K]
    assert all(k > 0 for k in ks[first + 2:]) and max(ks) > PROBE_K
    assert schedule.draft_pass_seconds == pytest.approx(DRAFT_PASS)
    assert table.seconds(1) < STORED_DRAFT[1] / CONTRADICTION_FACTOR  # the decoder's price too


def test_a_draft_that_really_never_pays_is_tried_ever_more_rarely_at_a_bounded_share() -> None:
    dear = FLAT_VERIFY[0]  # a draft pass as dear as a target pass: no k pays at full acceptance
    schedule = CostAwareK(list(FLAT_VERIFY), k_max=8, first_k=0)
    ks = run_cost_aware(schedule, 5000, dear)
    tries = [i for i, k in enumerate(ks) if k > 0]
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False) if b - a > 1]
    # The first try read the prompt: the share of time it spent stretches the first wait.
    assert tries[0] == REPROBE_FIRST_AFTER and len(gaps) >= 3 and gaps[1:] == sorted(gaps[1:])
    assert min(gaps) >= 2 * REPROBE_FIRST_AFTER and max(gaps) <= max(gaps[0], REPROBE_MAX_AFTER + 1)
    # Every try after the first fits in REPROBE_SHARE of the time: a draft model that loses
    # costs a run about the first try and a few percent.
    try_seconds = [ks[i] * dear + FLAT_VERIFY[ks[i]] for i in tries[2:]]
    total = sum(FLAT_VERIFY[k] + k * dear for k in ks)
    assert sum(try_seconds) <= REPROBE_SHARE * total
    assert schedule.reprobe is not None and schedule.reprobe.after <= REPROBE_MAX_AFTER


def test_a_draft_slower_than_plain_by_measurement_stops_for_the_request() -> None:
    """Drafts the cost model says pay (cheap passes, verify rows priced nearly free), but whose
    verify passes really cost 60 ms more than the table says (a table of the wrong shape, which
    live passes only scale): the measured goodput sees it, and the draft stops."""
    schedule = CostAwareK(list(FLAT_VERIFY), k_max=8, first_k=5)
    ks = []
    for _ in range(60):
        k = schedule.next_k()
        ks.append(k)
        # 2 tokens accepted: 3 tokens in ~0.11 s against plain decoding's 0.03 s a token.
        schedule.observe(k, min(k, 2), k * DRAFT_PASS, k, FLAT_VERIFY[k] + (0.060 if k else 0.0))
    assert schedule.check.off
    drafting = [i for i, k in enumerate(ks) if k > 0]
    # The first step (the prompt's read, not judged), the judged steps, then a few probes.
    assert drafting[:MIN_JUDGED_STEPS + 1] == list(range(MIN_JUDGED_STEPS + 1))
    assert len(drafting) <= MIN_JUDGED_STEPS + 1 + 3


# --- auto on the single path ---------------------------------------------------------------------

def test_auto_tries_a_draft_priced_30x_too_high_and_uses_it_again() -> None:
    draft = SimpleNamespace(cached_len=0)
    pricing = LivePricing(draft=LiveTable(dict(STORED_DRAFT), role="draft"))
    auto = AutoDrafter(NgramDrafter(), draft, list(FLAT_VERIFY), k_max=8, draft_k=5, pricing=pricing)  # type: ignore[arg-type]
    auto._capacity = 1000
    assert not auto.draft_can_pay
    sources = []
    for step in range(REPROBE_FIRST_AFTER + 10):
        source, k = auto.plan(100 + step, 8, 0, 0)
        sources.append(source)
        auto.source = source
        if source == "draft":
            auto._catch_up = 100 + step - draft.cached_len
            draft_seconds = (auto._catch_up / 64 * 0.005 if auto._catch_up > 2 else 0.0) + k * DRAFT_PASS
            auto.observe(k, k, draft_seconds, k, FLAT_VERIFY[k])
            draft.cached_len = 100 + step + k
        else:
            auto.observe(0, 0, 0.0, 0, FLAT_VERIFY[0])
    first = sources.index("draft")
    assert first == REPROBE_FIRST_AFTER and auto.draft_can_pay
    assert sources[first + 1:] == ["draft"] * (len(sources) - first - 1)
    assert auto.draft_pass_seconds < STORED_DRAFT[1] / CONTRADICTION_FACTOR


def test_auto_stops_a_lookup_slower_than_plain_by_measurement() -> None:
    """Verify rows priced nearly free, so every match is drafted, but each lookup step really
    takes 2.5 plain steps for its 2 tokens: after MIN_JUDGED_STEPS of them the lookup stops
    (tried again only after a growing wait), and plain steps take over."""
    auto = AutoDrafter(NgramDrafter(), None, list(FLAT_VERIFY), k_max=8)
    sources = []
    for _ in range(80):
        source, k = auto.plan(100, 8, lookup_tokens=4)
        sources.append(source)
        auto.source = source
        if source == "ngram":
            auto.agreement["ngram"].offer([1, 2, 3, 4])
            auto.agreement["ngram"].score([1, 9])  # one of four accepted
            auto.observe(k, 1, 0.0, 0, 2.5 * FLAT_VERIFY[0])
        else:
            auto.observe(0, 0, 0.0, 0, FLAT_VERIFY[0])
    lookups = sources.count("ngram")
    assert auto.checks["ngram"].off and sources[MIN_JUDGED_STEPS] == "none"
    assert lookups <= MIN_JUDGED_STEPS + 4  # the judged steps and a few tries


# --- the batch's chooser -------------------------------------------------------------------------

def test_the_batch_times_a_priced_out_draft_model_and_its_timed_passes_price_it_back() -> None:
    verify = PassCosts({1: 0.030, 16: 0.040})
    draft = PassCosts({1: TOO_HIGH * DRAFT_PASS, 16: TOO_HIGH * 0.004})
    assert not model_can_pay(verify, draft, 8)
    chooser = BatchK(8, verify, draft)
    row = RowChoices((BatchRow(0.8, 5, uses_draft_model=True),))
    ks, tries = [], []
    for step in range(REPROBE_FIRST_AFTER + 6):
        k = chooser.choose([row], 1)
        ks.append(k)
        if chooser.model_try:  # the engine times two one-token passes (BatchDraftModel.time_passes)
            tries.append(step)
            chooser.observe_try([1.5 * DRAFT_PASS, DRAFT_PASS])
        pick = chooser.pick(row, k, 1) if k else None
        model = pick is not None and pick.option is not None and pick.option.uses_draft_model
        chooser.observe([1 + (pick.k if pick else 0)], pick.k if pick else 0, 0.030, 1 if model else 0,
                        pick.k if model else 0, pick.k * DRAFT_PASS if model else 0.0)
    # One try, after the wait; it drafted nothing (a drafting try read the row's whole backlog first).
    assert tries == [REPROBE_FIRST_AFTER] and ks[:REPROBE_FIRST_AFTER + 1] == [0] * (REPROBE_FIRST_AFTER + 1)
    # The quickest timed pass priced the model back in: the row drafts with it from the next step on.
    assert model_can_pay(verify, draft, 8) and all(k > 0 for k in ks[REPROBE_FIRST_AFTER + 1:])


def test_a_timed_try_that_confirms_the_price_doubles_the_wait() -> None:
    verify = PassCosts({1: 0.030, 16: 0.040})
    draft = PassCosts({1: TOO_HIGH * DRAFT_PASS, 16: TOO_HIGH * 0.004})
    chooser = BatchK(8, verify, draft)
    row = RowChoices((BatchRow(0.8, 5, uses_draft_model=True),))
    tries = []
    for step in range(300):
        chooser.choose([row], 1)
        if chooser.model_try:
            tries.append(step)
            chooser.observe_try([TOO_HIGH * DRAFT_PASS] * 2)  # the price was right
        chooser.observe([1], 0, 0.030, 0, 0, 0.0)
    assert not model_can_pay(verify, draft, 8)
    # The wait doubles after a try that confirms, and the tries cost at most their share (each
    # costs its two passes, here 3x a target pass: the second waits for the time seen to cover it).
    assert tries[0] == REPROBE_FIRST_AFTER and tries[1] - tries[0] >= 2 * REPROBE_FIRST_AFTER
    assert chooser.reprobe.spent <= REPROBE_SHARE * chooser.reprobe.seconds + 2 * TOO_HIGH * DRAFT_PASS
