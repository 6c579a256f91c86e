"""One k (issue 45 item 3): the batch engine honours a request's k policy as the single path
does. Under ``fixed`` a chain row (draft, ngram, layerskip) drafts its k every step, under
``threshold`` its k moves with its acceptance, and under ``cost`` (the batch's default) the
batch's choice decides, up to k; greedy output is plain decoding's under every policy."""

from pathlib import Path

import pytest
from helpers import PROMPTS, decoder

from specdecode import SamplingParams, SpecDecoder
from specdecode.costs.batch_k import PROBE_K, BatchK, BatchRow, PassCosts
from specdecode.costs.goodput import Reprobe
from specdecode.engine.batch import BatchEngine
from specdecode.engine.metrics import GenerationStats
from specdecode.errors import InvalidRequestError


def steep() -> PassCosts:
    """Verify rows as dear as whole passes, and a draft pass as dear as a target pass: the batch's
    own choice is always plain decoding."""
    return PassCosts({1: 1.0, 2: 2.0, 64: 64.0})


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> SpecDecoder:
    return decoder(tiny_qwen2_dir, tiny_close_draft_dir)


def engine(dec: SpecDecoder, **kwargs) -> BatchEngine:
    options = {"max_batch": 4, "kv_cache_tokens": 512, "block_size": 4, "verify_costs": steep(),
               "draft_costs": steep()} | kwargs
    return BatchEngine(dec.target.model, dec.draft.model, dec.eos_token_ids, **options)


def run(dec: SpecDecoder, eng: BatchEngine, rows: list[tuple[str, str, int, str | None]], max_new: int = 20,
        ) -> tuple[list[list[int]], list[GenerationStats]]:
    """(prompt, method, k, k_policy) rows decoded together: their tokens and stats."""
    stats = [GenerationStats() for _ in rows]
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=max_new, ignore_eos=True), m, k,
                           stats=s, k_policy=policy) for (p, m, k, policy), s in zip(rows, stats, strict=True)]
    outputs = eng.run()
    return [outputs[i] for i in ids], stats


def plain(dec: SpecDecoder, prompt: str, max_new: int = 20) -> list[int]:
    return dec.generate(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), method="none").token_ids


def drafted_every_step(stats: GenerationStats, k: int) -> bool:
    """Every step drafted k tokens but the last two, where fewer than k + 1 tokens may be left
    to generate (and one step of slack)."""
    return len(stats.proposed_at_position) == k and stats.proposed_at_position[k - 1] >= stats.verify_steps - 3


def only_probes(stats: GenerationStats) -> bool:
    """The batch's own choice kept the row plain but for its probes (``BatchK``: PROBE_K tokens
    after a run of plain steps, where optimistic acceptance would pay)."""
    return stats.draft_tokens_proposed <= 2 * PROBE_K


def test_a_fixed_row_drafts_its_k_beside_a_cost_row_that_decodes_plainly(dec: SpecDecoder) -> None:
    """Costs say speculation never pays: the cost row decodes plainly, the fixed rows beside it
    draft their k every step anyway, and every output is plain decoding's."""
    rows = [(PROMPTS[0], "draft", 3, "fixed"), (PROMPTS[1], "draft", 3, "cost"), (PROMPTS[2], "ngram", 2, "fixed")]
    outputs, stats = run(dec, engine(dec), rows)
    assert outputs == [plain(dec, p) for p, *_ in rows]
    assert drafted_every_step(stats[0], 3)
    assert only_probes(stats[1])
    assert stats[2].verify_steps > 0 and len(stats[2].proposed_at_position) <= 2


def test_the_engines_policy_applies_where_a_request_names_none(dec: SpecDecoder) -> None:
    outputs, stats = run(dec, engine(dec, k_policy="fixed"), [(PROMPTS[3], "draft", 4, None)])
    assert outputs == [plain(dec, PROMPTS[3])] and drafted_every_step(stats[0], 4)
    _, stats = run(dec, engine(dec), [(PROMPTS[3], "draft", 4, None)])
    assert only_probes(stats[0])  # the default is cost: plain at these costs


def test_a_threshold_row_raises_its_k_while_drafts_are_accepted(dec: SpecDecoder) -> None:
    """The close draft model agrees with the target most of the time: a threshold row starting
    at k = 1 drafts further as it goes (ThresholdK: k + 1 above 80% acceptance)."""
    outputs, stats = run(dec, engine(dec, k_max=6), [(PROMPTS[0], "draft", 1, "threshold")], max_new=40)
    assert outputs == [plain(dec, PROMPTS[0], 40)]
    assert len(stats[0].proposed_at_position) > 1


def test_an_unknown_policy_is_refused(dec: SpecDecoder) -> None:
    eng = engine(dec)
    for method in ("draft", "auto", "suffix"):  # checked for every method, not only those it applies to
        with pytest.raises(InvalidRequestError, match="k policy"):
            eng.add_request(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=4), method, 3, k_policy="greedy")


def test_generate_batch_reads_k_as_generate_does(dec: SpecDecoder) -> None:
    """A k given alone is a fixed draft length in generate_batch too; the engine built for the
    call then drafts it every step whatever its costs say."""
    eng = engine(dec)
    result = dec.generate_batch([PROMPTS[4]], SamplingParams(max_new_tokens=20, ignore_eos=True), method="draft",
                                k=2, engine=eng)[0]
    assert result.token_ids == plain(dec, PROMPTS[4]) and drafted_every_step(result.stats, 2)
    # A fresh engine: the fixed row's live passes would re-price the steep table by this
    # machine's timings of the tiny models (CI once saw the cost row draft after them).
    result = dec.generate_batch([PROMPTS[4]], SamplingParams(max_new_tokens=20, ignore_eos=True), method="draft",
                                engine=engine(dec))[0]
    assert only_probes(result.stats)


def test_the_chooser_prices_a_fixed_row_at_its_cap_at_every_k() -> None:
    """A fixed row drafts its cap whatever k the batch takes, so k = 0 (the baseline) prices it
    drafting too: a doubtful cost row beside it still decodes plainly."""
    fixed = BatchRow(0.9, 5, uses_draft_model=False, fixed=True)
    doubtful = BatchRow(0.1, 5, uses_draft_model=False)
    chooser = BatchK(8, steep())
    assert chooser.choose([fixed, doubtful], 2) == 0
    assert chooser.pick(fixed, 0, 2).k == 5 and chooser.pick(doubtful, 0, 2).k == 0


@pytest.mark.parametrize("method", ["draft", "auto"])
def test_a_priced_out_draft_model_is_tried_by_timing_passes_not_by_reading_the_prompt(
        dec: SpecDecoder, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The batch re-prices a draft model its table priced out by timing two one-token passes
    (``BatchDraftModel.time_passes``): a try that drafted read the row's whole prompt first
    (1.6 s of a 7.7 s turn on the demo pair). Those passes price it back in, and it drafts."""
    flat = PassCosts({1: 1.0, 64: 1.1}, live=False)  # verify rows nearly free: a cheap draft pays
    # A draft pass 3x a target pass: priced out. (The read of a row's backlog is priced by this
    # table too, which the one-token passes correct only in part.)
    eng = engine(dec, verify_costs=flat, draft_costs=PassCosts({1: 3.0, 64: 3.5}))
    eng.chooser.reprobe = Reprobe(first_after=0)  # a try due from the start
    assert eng.drafter is not None
    fed: list[list[int]] = []
    forward = eng.drafter.model.forward

    def recording(seqs, inputs, starts, logits="all"):  # noqa: ANN001, ANN202 - the batch model's own signature
        fed.append([x.shape[0] for x in inputs])
        return forward(seqs, inputs, starts, logits=logits)

    monkeypatch.setattr(eng.drafter.model, "forward", recording)
    steps: list[int] = []  # the step each draft-model proposal ran in
    propose, step = eng.drafter.propose, eng.step
    monkeypatch.setattr(eng.drafter, "propose", lambda rows: steps.append(eng.chooser.reprobe.tries) or propose(rows))

    def stepping() -> list:
        fed.append([])  # a step boundary
        return step()

    monkeypatch.setattr(eng, "step", stepping)
    prompt = " ".join(PROMPTS[:3])
    outputs, stats = run(dec, eng, [(prompt, method, 4, None)])
    assert outputs == [plain(dec, prompt)]
    assert eng.chooser.reprobe.tries == 1 and len(dec.encode(prompt)) > 20
    passes = [widths for widths in fed if widths]
    assert passes[:2] == [[1], [1]]  # the try: one token a pass, not the prompt
    try_step = next(i for i, widths in enumerate(fed) if widths == [1])
    assert fed[try_step + 1] == [1] and fed[try_step + 2] == []  # ... and the step drafted nothing
    assert stats[0].draft_tokens_proposed > 0 and steps  # priced back in by them


def test_a_try_whose_passes_raise_fails_its_own_row_alone(dec: SpecDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed passes of a try run outside the step's rerun: an error there is its row's."""
    flat = PassCosts({1: 1.0, 64: 1.1}, live=False)
    eng = engine(dec, verify_costs=flat, draft_costs=PassCosts({1: 3.0, 64: 3.5}))
    eng.chooser.reprobe = Reprobe(first_after=0)
    assert eng.drafter is not None

    time_passes, calls = eng.drafter.time_passes, []

    def broken(*args) -> list[float]:  # noqa: ANN002 - time_passes' own arguments
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("the draft model's pass failed")
        return time_passes(*args)

    monkeypatch.setattr(eng.drafter, "time_passes", broken)
    stats = [GenerationStats(), GenerationStats()]
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=12, ignore_eos=True), "draft", 4, stats=s)
           for p, s in zip(PROMPTS[:2], stats, strict=True)]
    outputs = eng.run()
    reasons = [s.stop_reason for s in stats]
    assert sorted(reasons) == ["error", "length"]
    survivor = reasons.index("length")
    assert outputs[ids[survivor]] == plain(dec, PROMPTS[survivor], 12)
