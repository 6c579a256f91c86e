"""Stored pass-cost tables are a prior, not a verdict (issue 50): a timing whose repeats disagree
is redone and, if it never settles, not stored; a stored table that this machine's one-row pass
contradicts by more than 2x, or whose costs are out of order, is re-timed and the user told; one
within 2x is read as stored. Timings are injected (a fake stopwatch, fake probes and passes), so
no test depends on how busy the machine running it is."""

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import specdecode.core.timing
import specdecode.costs.store
from specdecode.core.paths import CACHE_ENV_VAR
from specdecode.core.timing import BUSY_RETIMES, BUSY_SPREAD, Timing, best_seconds, busy_spread, is_settled
from specdecode.costs.spot_check import CONTRADICTION_FACTOR, contradiction, out_of_order, outliers
from specdecode.costs.store import DRAFT_TABLE, VERIFY_TABLE, CostStore

# The table issue 50 stored on a busy 2-core AMD machine (seconds), and the quiet machine's figures.
BUSY_TARGET = {1: 0.088, 2: 0.12, 4: 0.18, 8: 0.771, 9: 3.37}
BUSY_DRAFT_PASS, QUIET_DRAFT_PASS = 2.70, 0.0226


class FakeStopwatch:
    """Stands in for ``Stopwatch`` in core/timing.py: each timed region lasts the next of ``series``."""

    series: Iterator[float] = iter(())
    regions = 0

    def __init__(self, device: object, sync: bool) -> None:
        self.elapsed = 0.0

    def __enter__(self) -> "FakeStopwatch":
        return self

    def __exit__(self, *exc: object) -> None:
        FakeStopwatch.regions += 1
        self.elapsed = next(FakeStopwatch.series)


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[float]], None]:
    """Time every pass with the given series of seconds (cycled), counting the passes timed."""

    def use(series: list[float]) -> None:
        FakeStopwatch.series = itertools.cycle(series)
        FakeStopwatch.regions = 0

    monkeypatch.setattr(specdecode.core.timing, "Stopwatch", FakeStopwatch)
    return use


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))
    return tmp_path


def store(role: str = "draft", probe: Callable[[], float] | None = None, retime: bool = False) -> CostStore:
    return CostStore({"role": role, "model": "tiny"}, retime=retime, probe=probe)


def stored_file(cost_store: CostStore) -> dict[str, dict[str, float]]:
    return json.loads(cost_store.path.read_text())["tables"]


# --- timing under load ---------------------------------------------------------------------------

def test_a_quiet_timing_is_taken_once(fake_clock) -> None:
    fake_clock([0.5] + [0.010, 0.011] * 10)  # warm-up, then repeats that agree
    timing = best_seconds(lambda: None, None, repeats=2)  # type: ignore[arg-type]
    assert timing == 0.010 and is_settled(timing) and FakeStopwatch.regions == 1 + 2


def test_a_busy_timing_is_redone_until_it_settles_and_keeps_the_best_repeat(fake_clock) -> None:
    # Round one's repeats are 5x apart (a busy machine); round two's agree.
    fake_clock([0.5, 0.009, 0.045, 0.010, 0.0105])
    timing = best_seconds(lambda: None, None, repeats=2)  # type: ignore[arg-type]
    assert timing == 0.009 and is_settled(timing) and FakeStopwatch.regions == 1 + 2 * 2


def test_a_timing_that_never_settles_is_bounded_and_marked_unsettled(fake_clock) -> None:
    fake_clock([0.010, 0.050])  # every round's repeats 3x apart: stays busy
    timing = best_seconds(lambda: None, None, repeats=2)  # type: ignore[arg-type]
    assert timing == 0.010 and not is_settled(timing) and timing.spread > BUSY_SPREAD
    assert FakeStopwatch.regions == 1 + 2 * (1 + BUSY_RETIMES)


def test_the_busy_spread_ignores_jitter_below_the_noise_floor() -> None:
    assert busy_spread([1e-4, 5e-4, 6e-4]) == 1.0  # 5x apart, but half a millisecond: jitter
    assert busy_spread([0.01, 0.03, 0.04]) == pytest.approx(3.0)


# --- the checks, on their own --------------------------------------------------------------------

def test_a_stored_figure_is_contradicted_when_over_2x_too_high_never_by_a_slower_machine_now() -> None:
    assert contradiction(BUSY_DRAFT_PASS, QUIET_DRAFT_PASS) == pytest.approx(BUSY_DRAFT_PASS / QUIET_DRAFT_PASS)
    assert contradiction(0.030, 0.020) is None  # 1.5x: within the factor
    assert contradiction(0.010, 0.030) is None  # slower now: most often a busy machine, settled or not
    assert contradiction(0.010, Timing(0.030, settled=False)) is None
    assert contradiction(BUSY_DRAFT_PASS, Timing(QUIET_DRAFT_PASS, settled=False)) is not None  # faster is proof
    assert contradiction(2e-4, 6e-4) is None  # under the noise floor


def test_the_issues_busy_table_is_out_of_order_and_its_9_row_pass_is_an_outlier() -> None:
    assert out_of_order(BUSY_TARGET) is not None and 9 in outliers(BUSY_TARGET)
    # A draft table timed on a busy machine: its 64-row catch-up pass cheaper than one row.
    assert outliers({1: 1.80, 64: 1.07}) == [1, 64] and outliers({1: 0.040, 64: 1.07}) == []
    # The issue's quiet tables (llama-bench, 1/2/4/8/16 rows) are in order, the repacked one's
    # 4-row pass cheaper than its 2-row one included.
    for quiet in ({1: 0.080, 2: 0.114, 4: 0.172, 8: 0.241, 16: 0.251}, {1: 0.079, 2: 0.097, 4: 0.095, 8: 0.163},
                  {1: 0.043, 2: 0.060, 4: 0.092, 8: 0.184}):
        assert out_of_order(quiet) is None and outliers(quiet) == []


# --- the store -----------------------------------------------------------------------------------

def test_a_stored_draft_table_30x_too_high_is_re_timed_and_the_new_figures_stored(cache: Path) -> None:
    store("draft").put(DRAFT_TABLE, {1: BUSY_DRAFT_PASS, 64: 64 * BUSY_DRAFT_PASS / 4})
    probes: list[float] = []
    reread = store("draft", probe=lambda: probes.append(QUIET_DRAFT_PASS) or QUIET_DRAFT_PASS)
    assert reread.get(DRAFT_TABLE) == {} and len(probes) == 1  # dropped: its users time it afresh
    [note] = reread.take_notes()
    assert note.startswith("stored draft pass costs were 119x off") and "2.70 s stored, 22.6 ms now" in note
    assert reread.take_notes() == []  # each note once
    reread.put(DRAFT_TABLE, {1: QUIET_DRAFT_PASS, 64: 0.4})
    assert stored_file(reread)[DRAFT_TABLE] == {"1": QUIET_DRAFT_PASS, "64": 0.4}
    # The next run's probe agrees with the new figures: they stand.
    assert store("draft", probe=lambda: QUIET_DRAFT_PASS * 1.2).get(DRAFT_TABLE) == {1: QUIET_DRAFT_PASS, 64: 0.4}


@pytest.mark.parametrize("now_over_stored", [1 / CONTRADICTION_FACTOR + 0.05, 1.0, CONTRADICTION_FACTOR - 0.05])
def test_a_stored_table_within_2x_is_read_as_stored_and_checked_once(cache: Path, now_over_stored: float) -> None:
    table = {1: 0.050, 2: 0.070, 4: 0.110, 8: 0.200}
    store("target").put(VERIFY_TABLE, table)
    probes: list[float] = []
    reread = store("target", probe=lambda: probes.append(1.0) or 0.050 * now_over_stored)
    assert reread.get(VERIFY_TABLE) == table and reread.get(VERIFY_TABLE) == table
    assert len(probes) == 1 and reread.take_notes() == []


def test_a_stored_table_out_of_order_is_re_timed_without_a_probe(cache: Path) -> None:
    store("target").put(VERIFY_TABLE, BUSY_TARGET)  # its outliers are left out as it is stored...
    assert set(stored_file(store("target"))[VERIFY_TABLE]) == {"1", "2"}
    # ... and a table stored out of order by an earlier version is dropped when read.
    old = store("target")
    old.path.write_text(json.dumps({"key": old.key, "tables": {VERIFY_TABLE: {str(r): s for r, s in BUSY_TARGET.items()}}}))
    reread = store("target", probe=lambda: pytest.fail("an out-of-order table needs no probe"))
    assert reread.get(VERIFY_TABLE) == {} and VERIFY_TABLE not in stored_file(reread)
    [note] = reread.take_notes()
    assert note.startswith("stored target pass costs were out of order (a 9-row pass 3.37 s")


def test_unsettled_timings_are_used_but_not_stored(cache: Path) -> None:
    timed = store("target")
    timed.put(VERIFY_TABLE, {1: Timing(0.05), 2: Timing(0.07), 4: Timing(0.30, settled=False, spread=3.2)})
    assert stored_file(timed)[VERIFY_TABLE] == {"1": 0.05, "2": 0.07}
    [note] = timed.take_notes()
    assert "over 4 rows did not settle (repeats 3.2x apart" in note and "next run times them again" in note
    assert store("target").get(VERIFY_TABLE) == {1: 0.05, 2: 0.07}  # the next run times the 4-row pass


def test_retime_ignores_the_stored_table_without_a_probe(cache: Path) -> None:
    store("draft").put(DRAFT_TABLE, {1: BUSY_DRAFT_PASS, 64: 1.0})
    forced = store("draft", probe=lambda: pytest.fail("--retime-costs times everything anyway"), retime=True)
    assert forced.get(DRAFT_TABLE) == {}
    forced.put(DRAFT_TABLE, {1: QUIET_DRAFT_PASS, 64: 0.4})
    assert stored_file(forced)[DRAFT_TABLE] == {"1": QUIET_DRAFT_PASS, "64": 0.4}


# --- a decoder over tiny models ------------------------------------------------------------------

# Fake costs, seconds: a verify pass over r rows; the draft's one-row and 64-row catch-up passes.
VERIFY = {r: 0.020 * (1 + 0.1 * (r - 1)) for r in range(1, 65)}
QUIET_DRAFT = {1: 0.001, 64: 0.010}
BUSY_DRAFT = {rows: 30 * seconds for rows, seconds in QUIET_DRAFT.items()}  # 1.5 target passes: cannot pay


def test_a_decoder_re_times_a_draft_table_30x_too_high_and_drafts_again(
        tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode import SamplingParams, SpecDecoder

    draft_now = {"seconds": BUSY_DRAFT[1]}  # what the draft's one-row pass takes on the machine now
    monkeypatch.setattr(specdecode.costs.store, "one_row_probe", lambda loaded, *_: (
        (lambda: draft_now["seconds"]) if Path(loaded.folder) == tiny_close_draft_dir else (lambda: VERIFY[1])))

    def load(draft_table: dict[int, float], **options) -> tuple[SpecDecoder, list[list[int]]]:
        decoder = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), str(tiny_close_draft_dir), dtype="fp32",
                                              device="cpu", show_progress=False, engine="single", **options)
        timed: list[list[int]] = []
        monkeypatch.setattr(decoder.engine.target, "pass_seconds", lambda rows, *a, **k: {r: VERIFY[r] for r in rows})
        monkeypatch.setattr(decoder.drafters["draft"].model, "pass_seconds", lambda rows, *a, **k: (
            timed.append(list(rows)) or {r: draft_table[r] for r in rows}))
        return decoder, timed

    busy, _ = load(BUSY_DRAFT)  # the first run, timed on a busy machine
    assert busy.plan("draft", k="auto").note.startswith("draft model not used")
    draft_store = busy.costs.draft_store
    assert draft_store is not None and draft_store.get(DRAFT_TABLE) == BUSY_DRAFT

    draft_now["seconds"] = QUIET_DRAFT[1]  # later, on the quiet machine
    quiet, timed = load(QUIET_DRAFT)
    note = quiet.plan("draft", k="auto").note
    assert timed == [[1, 64]] and note is not None and "draft model not used" not in note
    assert note.startswith("stored draft pass costs were 30x off") and note.endswith("re-timed")
    assert json.loads(draft_store.path.read_text())["tables"][DRAFT_TABLE] == {"1": 0.001, "64": 0.01}
    stats = quiet.generate("def quicksort(arr):", SamplingParams(max_new_tokens=8), method="draft", k="auto").stats
    assert stats.draft_tokens_proposed > 0 and stats.note == ""  # drafts again; the note was shown once

    again, timed = load(QUIET_DRAFT)  # within 2x now: read as stored
    assert again.plan("draft", k="auto").note is None and timed == []

    forced, timed = load(QUIET_DRAFT, retime_costs=True)  # --retime-costs still times it all
    forced.plan("draft", k="auto")
    assert timed == [[1, 64]]


def test_a_decoder_does_not_store_timings_that_never_settle(tiny_qwen2_dir: Path, cache: Path, fake_clock) -> None:
    from specdecode import SpecDecoder

    fake_clock([0.010, 0.050])  # every pass's repeats 3x apart, through the real timing loop
    noisy = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu",
                                        show_progress=False)
    assert noisy.engine.verify_costs(4) == [0.010] * 4  # used for this run
    cost_store = noisy.engine.cost_store
    assert cost_store is not None and cost_store.get(VERIFY_TABLE) == {}
    assert stored_file(cost_store)[VERIFY_TABLE] == {}
    assert "did not settle" in noisy.costs.take_notes()[0]


@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_the_spot_check_times_a_one_row_pass_and_leaves_decoding_as_it_was(
        tiny_ggufs: dict[str, Path], cache: Path, backend: str) -> None:
    """The probe runs on a sequence of its own over the decoder's models, through the backend
    protocol: it times something real, and the next request (whose prompt the prefix cache holds)
    decodes exactly as before, since the probe's begin moved the models' epochs on."""
    from helpers import llamacpp_decoder

    from specdecode import SamplingParams
    from specdecode.costs.store import one_row_probe

    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"], backend=backend)
    params = SamplingParams(max_new_tokens=12)
    before = dec.generate("def quicksort(arr):", params, method="draft", k=3).token_ids
    for loaded in (dec.target, dec.draft):
        probe = one_row_probe(loaded, "auto", None)
        assert probe is not None
        seconds = probe()
        assert isinstance(seconds, Timing) and 0.0 < seconds < 1.0
    assert one_row_probe(dec.target, "auto", "default") is None  # compiled passes are not spot-checked
    assert dec.generate("def quicksort(arr):", params, method="draft", k=3).token_ids == before


def test_rows_left_out_are_noted_once_however_often_the_table_is_put(cache: Path) -> None:
    timed = store("target")
    busy_row = Timing(0.30, settled=False, spread=3.2)
    timed.put(VERIFY_TABLE, {1: Timing(0.05), 4: busy_row})
    timed.put(VERIFY_TABLE, {1: Timing(0.05), 4: busy_row, 8: Timing(0.09)})  # the caller timed 8 rows more
    assert len(timed.take_notes()) == 1 and stored_file(timed)[VERIFY_TABLE] == {"1": 0.05, "8": 0.09}


def test_a_re_timed_table_is_told_once_whatever_the_method(tiny_qwen2_dir: Path, cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A target table stored 30x too high is re-timed at load, and the next request says so in its
    note, for method none too (SpecDecoder.stream reads DecoderCosts.take_notes), once."""
    from specdecode import SamplingParams, SpecDecoder

    monkeypatch.setattr(specdecode.costs.store, "one_row_probe", lambda *_: (lambda: VERIFY[1]))

    def load() -> SpecDecoder:
        return SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu",
                                           show_progress=False)

    busy = load()
    monkeypatch.setattr(busy.engine.target, "pass_seconds", lambda rows, *a, **k: {r: 30 * VERIFY[r] for r in rows})
    busy.engine.verify_costs(4)  # timed on a busy machine, and stored
    quiet = load()
    first = quiet.generate("def quicksort(arr):", SamplingParams(max_new_tokens=4), method="none").stats.note
    assert "pass costs were 30x off" in first and first.endswith("re-timed")
    assert quiet.generate("def quicksort(arr):", SamplingParams(max_new_tokens=4), method="none").stats.note == ""


def test_a_batch_engine_keeps_its_one_sequence_passes_in_the_targets_store(
        tiny_qwen2_dir: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cost-aware batch engine times the target's one-sequence passes once per machine: they
    go into the target's verify table (the single path's too), and a later decoder's engine
    reads them there and times only the batched shapes (as a server started again would)."""
    from specdecode import SpecDecoder
    from specdecode.backends.torch_batch import PagedBatchModel

    timed: list[list[tuple[int, int]]] = []

    def fake_pass_seconds(self, shapes, repeats):  # noqa: ANN001, ANN202 - PagedBatchModel.pass_seconds
        timed.append(list(shapes))
        return {(batch, width): 0.01 * batch * width for batch, width in shapes}

    monkeypatch.setattr(PagedBatchModel, "pass_seconds", fake_pass_seconds)
    monkeypatch.setattr(specdecode.costs.store, "one_row_probe", lambda *_: (lambda: 0.01))

    def load() -> SpecDecoder:
        return SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="ngram", dtype="fp32", device="cpu",
                                           show_progress=False)

    first = load()
    first.batch_engine(max_batch=4)
    single_rows = {rows for batch, rows in timed[0] if batch == 1}
    assert single_rows and {1, 2, 4, 8}.issubset(single_rows)
    store = first.engine.cost_store
    assert store is not None and set(store.stored(VERIFY_TABLE)) >= single_rows
    timed.clear()
    load().batch_engine(max_batch=4)
    assert timed and all(batch > 1 for batch, _ in timed[0])  # the batched shapes only
