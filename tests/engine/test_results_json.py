"""Every method's result, single and batched, is plain JSON (``specdecode generate --json``, the
server's metrics): ``json.dumps`` of ``to_dict()`` round-trips."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from specdecode import SamplingParams, SpecDecoder
from specdecode.core import registry
from specdecode.costs.batch_k import PassCosts, draft_model_note
from specdecode.engine.batch import BATCH_METHODS

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> SpecDecoder:
    return SpecDecoder.from_pretrained(str(tiny_qwen2_dir), str(tiny_close_draft_dir), dtype="fp32", device="cpu",
                                       skip_layers=[0], show_progress=False)


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "auto", "suffix", "layerskip"])
def test_a_single_result_round_trips_through_json(dec: SpecDecoder, method: str) -> None:
    data = dec.generate("def quicksort(arr):", PARAMS, method=method, k="auto" if method != "layerskip" else 3).to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["stats"]["method"] == method


def test_batched_results_round_trip_through_json(dec: SpecDecoder) -> None:
    for method in (m for m in BATCH_METHODS if not registry.BY_NAME[m].needs_heads):  # this decoder has no heads
        for result in dec.generate_batch(["def quicksort(arr):", "The quick brown fox"], PARAMS, method=method):
            data = result.to_dict()
            assert json.loads(json.dumps(data)) == data


def test_the_metrics_say_why_the_draft_model_was_not_used(dec: SpecDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the measured pass costs rule the draft model out (forced here, on the single-request
    engine, whose cost-aware k reads the forced verdict alone), the cost-aware k decodes plainly
    and the metrics say so in one line, with the costs that decided it. The batch engine's own
    line: ``test_the_batch_engine_says_why_from_its_own_pass_costs``."""
    import specdecode.costs.decoder_costs as decoder_costs

    monkeypatch.setattr(decoder_costs, "speculation_can_pay", lambda *args: False)
    monkeypatch.setattr(dec, "config", replace(dec.config, engine="single"))
    result = dec.generate("def quicksort(arr):", PARAMS, method="draft", k="auto")
    assert result.stats.note.startswith("draft model not used: on this machine a verified row costs")
    assert result.stats.note in result.stats.summary() and result.stats.draft_tokens_proposed == 0
    monkeypatch.undo()
    assert dec.generate("def quicksort(arr):", PARAMS, method="draft", k=3).stats.note == ""


def test_the_batch_engine_says_why_from_its_own_pass_costs(dec: SpecDecoder) -> None:
    """The batch engine's note (``costs/batch_k.draft_model_note``) reads its timed passes: a
    draft pass dearer than what a full-acceptance draft saves gives the line, with the costs in
    target passes; a cheap one gives none. And a decode on it says so where its costs rule the
    draft out, as the single engine does."""
    verify = PassCosts({1: 0.010, 2: 0.018, 4: 0.034, 8: 0.066, 16: 0.130}, live=False)
    note = draft_model_note(verify, PassCosts({1: 0.009, 2: 0.010}, live=False), k_max=8)
    assert note is not None and note.startswith("draft model not used: on this machine a verified row costs 0.80 of a "
                                                "target pass and a draft pass 0.90")
    assert draft_model_note(verify, PassCosts({1: 0.001, 2: 0.0012}, live=False), k_max=8) is None
    assert draft_model_note(None, None, k_max=8) is None  # not timed: nothing to say
    engine = dec.one_request.engine_for(256)
    engine.chooser.draft = PassCosts({1: 100 * engine.chooser.verify.seconds(1, 1)}, live=False)  # priced out
    result = dec.generate("def quicksort(arr):", PARAMS, method="draft", k="auto")
    assert result.stats.note.startswith("draft model not used")
