"""The batch engine: batch invariance under greedy, the distribution test inside a batch,
preemption, block accounting after every way a request can end, the worker thread, and the
batch's draft-length chooser."""

import itertools
import threading
from pathlib import Path

import pytest
import torch
from helpers import (
    CHI2_CRITICAL_P001,
    PROMPTS,
    chi_square_in_batches,
    copyable_prompt,
    decoder,
    install_wrong_residual,
    run_until_done,
)

import specdecode.core.sampling
import specdecode.engine.batch
import specdecode.engine.batch_verify
from specdecode import SamplingParams
from specdecode.costs.batch_k import BatchK, BatchRow, PassCosts
from specdecode.engine.batch import BatchEngine
from specdecode.errors import InvalidRequestError
from specdecode.serving.worker import BatchWorker

METHODS = ("draft", "ngram", "none")


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path):
    return decoder(tiny_qwen2_dir, tiny_close_draft_dir)


def engine(dec, **kwargs) -> BatchEngine:
    options = {"max_batch": 4, "kv_cache_tokens": 512, "block_size": 4} | kwargs
    return BatchEngine(dec.target.model, dec.draft.model, dec.eos_token_ids, **options)


def assert_pools_empty(eng: BatchEngine) -> None:
    for pool in (eng.target_cache, eng.drafter.cache):
        assert pool.free_blocks == pool.usable_blocks and not pool.tables


def single_outputs(dec, cases) -> list[list[int]]:
    return [dec.generate(prompt, SamplingParams(max_new_tokens=n), method="none").token_ids for prompt, _, _, n in cases]


def mixed_cases() -> list[tuple[str, str, int, int]]:
    """(prompt, method, k, max_new_tokens): every prompt length, method and several k and lengths."""
    return [(prompt, method, k, n) for prompt, method, k, n in zip(
        PROMPTS, itertools.cycle(METHODS), itertools.cycle([1, 3, 5, 8]), itertools.cycle([24, 7, 16, 30, 2]))]


@pytest.mark.parametrize(("policy", "confidence"), [("async", 0.0), ("sync", 0.0), ("async", 0.5)])
def test_batch_invariance_greedy(dec, policy: str, confidence: float) -> None:
    """Each request's tokens are the same alone (plain decoding) or in a batch of mixed prompt
    lengths, methods, k and output lengths, with requests joining as others leave (and with
    the draft model's confidence cut-off ending rows' drafts early)."""
    cases = mixed_cases()
    eng = engine(dec, policy=policy, draft_confidence=confidence)
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k) for p, m, k, n in cases]
    outputs = eng.run()
    assert [outputs[i] for i in ids] == single_outputs(dec, cases)
    assert_pools_empty(eng)


def test_preemption_recomputes_and_keeps_every_output(dec) -> None:
    """A pool too small for the whole batch: sequences are preempted, recomputed from their
    tokens later, and still produce exactly their single-request output."""
    cases = [(p, m, 4, 30) for p, m in zip(PROMPTS, itertools.cycle(METHODS))]
    eng = engine(dec, max_batch=8, kv_cache_tokens=96, block_size=4)
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k) for p, m, k, n in cases]
    outputs = eng.run()
    assert eng.scheduler.preemptions > 0
    assert [outputs[i] for i in ids] == single_outputs(dec, cases)
    assert_pools_empty(eng)


def test_a_request_that_can_never_fit_is_refused_up_front(dec) -> None:
    eng = engine(dec, kv_cache_tokens=64)
    with pytest.raises(InvalidRequestError, match="kv_cache_tokens="):
        eng.add_request(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=100), "draft", 4)
    with pytest.raises(InvalidRequestError, match="eagle heads"):
        eng.add_request(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=4), "eagle", 4)
    with pytest.raises(InvalidRequestError, match="k must be"):
        eng.add_request(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=4), "draft", 99)
    assert not eng.has_unfinished


def test_blocks_return_after_abort_and_after_a_failed_step(dec, monkeypatch) -> None:
    eng = engine(dec)
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=20), m, 3) for p, m in zip(PROMPTS, METHODS)]
    eng.step()
    eng.step()
    assert eng.target_cache.used_blocks > 0 and eng.drafter.cache.used_blocks > 0
    used = eng.target_cache.used_blocks
    assert eng.abort(ids[0]).stats.stop_reason == "cancelled"  # a running request
    assert eng.target_cache.used_blocks < used
    assert eng.abort(ids[0]) is None  # twice is harmless
    eng.step()

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(specdecode.engine.batch.BatchEngine, "_verify", broken)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    failed = eng.abort_all(RuntimeError("injected failure"))
    assert {o.request_id for o in failed} == set(ids[1:]) and all(o.stats.stop_reason == "error" for o in failed)
    assert not eng.has_unfinished
    assert_pools_empty(eng)


BROKEN_TEMPERATURE = 0.77  # the injected failure below hits requests sampling at this temperature


def test_a_request_whose_sampling_raises_fails_alone(dec, monkeypatch) -> None:
    """A request whose sampling raises (injected) fails alone with that error, in its first
    step; the greedy requests sharing its steps get their single-request tokens, and a seeded
    sampled request gets the tokens it gets in the same batch without the failing one (its
    generator is rewound before each rerun of the step)."""
    real_probs = specdecode.core.sampling.LogitsProcessor.probs

    def probs(self, logits):
        if self.temperature == BROKEN_TEMPERATURE:
            raise RuntimeError("injected sampling failure")
        return real_probs(self, logits)

    monkeypatch.setattr(specdecode.core.sampling.LogitsProcessor, "probs", probs)
    cases = mixed_cases()[:3]  # draft, ngram and none
    seeded = SamplingParams(temperature=0.9, top_k=5, max_new_tokens=16, seed=3)

    def run(with_broken: bool) -> tuple[list[list[int]], list[int], dict]:
        eng = engine(dec, max_batch=8)
        broken = SamplingParams(temperature=BROKEN_TEMPERATURE, max_new_tokens=20)
        bad = eng.add_request(dec.encode(PROMPTS[2]), broken, "draft", 3) if with_broken else None
        ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k) for p, m, k, n in cases]
        sampled = eng.add_request(dec.encode(PROMPTS[1]), seeded, "draft", 3)
        tokens, errors = run_until_done(eng)
        assert_pools_empty(eng)
        if with_broken:
            assert set(errors) == {bad} and "injected" in str(errors[bad]) and not tokens[bad]
        else:
            assert not errors
        return [tokens[i] for i in ids], tokens[sampled], errors

    greedy, sampled, _ = run(with_broken=True)
    assert greedy == single_outputs(dec, cases)
    _, sampled_alone, _ = run(with_broken=False)
    assert sampled == sampled_alone and len(sampled) > 0


def batch_chi_square(dec, policy: str, confidence: float = 0.0) -> tuple[float, int]:
    eng = BatchEngine(dec.target.model, dec.draft.model, dec.eos_token_ids, max_batch=16, kv_cache_tokens=2048,
                      block_size=8, policy=policy, draft_confidence=confidence)
    stat, df = chi_square_in_batches(dec, eng)
    assert_pools_empty(eng)
    return stat, df


@pytest.mark.parametrize(("policy", "confidence"), [("async", 0.0), ("sync", 0.0), ("async", 0.5)])
def test_sampling_inside_a_batch_matches_the_target_distribution(
    policy: str, confidence: float, tiny_qwen2_dir: Path, tiny_far_draft_dir: Path
) -> None:
    # 0.5: rows stop drafting when the draft doubts its own token, so draft lengths depend on
    # the draft's samples; verification must stay exact.
    stat, df = batch_chi_square(decoder(tiny_qwen2_dir, tiny_far_draft_dir), policy, confidence)
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_batch_distribution_test_catches_a_wrong_residual(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path, monkeypatch) -> None:
    install_wrong_residual(monkeypatch, specdecode.engine.batch_verify)
    stat, df = batch_chi_square(decoder(tiny_qwen2_dir, tiny_far_draft_dir), "async")
    assert stat > CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}: the test has no power"


def test_confidence_cut_off_shortens_batched_drafts(dec) -> None:
    proposed = {}
    for confidence in (0.0, 0.9):
        eng = engine(dec, draft_confidence=confidence)
        ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=16), "draft", 6) for p in PROMPTS[:4]]
        stats = {}
        while eng.has_unfinished:
            stats |= {o.request_id: o.stats for o in eng.step() if o.finished}
        proposed[confidence] = sum(stats[i].draft_tokens_proposed for i in ids)
    assert proposed[0.9] < proposed[0.0]


def test_sync_policy_emits_the_batch_minimum_per_step(dec) -> None:
    """Under sync every drafting row keeps the fewest accepted tokens of the step, so its tau is
    below async's for the same requests (and the outputs still match, see above)."""
    taus = {}
    for policy in ("async", "sync"):
        eng = engine(dec, policy=policy)
        stats = []
        for prompt in PROMPTS[:4]:
            eng.add_request(dec.encode(prompt), SamplingParams(max_new_tokens=24), "draft", 4)
        while eng.has_unfinished:
            stats += [o.stats for o in eng.step() if o.finished]
        taus[policy] = sum(s.emitted_by_steps for s in stats) / sum(s.verify_steps for s in stats)
    assert taus["sync"] < taus["async"]


def test_worker_serves_threads_and_an_early_close_cancels(dec) -> None:
    worker = BatchWorker(engine(dec))
    try:
        cases = mixed_cases()[:5]
        expected = single_outputs(dec, cases)
        results: list[list[int] | None] = [None] * len(cases)

        def run(i: int) -> None:
            prompt, method, k, n = cases[i]
            chunks, _ = worker.submit(dec.encode(prompt), SamplingParams(max_new_tokens=n), method, k)
            results[i] = [t for chunk in chunks for t in chunk]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results == expected
        chunks, stats = worker.submit(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=200), "draft", 3)
        next(chunks)
        chunks.close()  # the caller leaves after the first chunk
        deadline = threading.Event()
        for _ in range(200):
            if not worker.engine.has_unfinished:
                break
            deadline.wait(0.05)
        assert not worker.engine.has_unfinished and stats.stop_reason == "cancelled"
        assert_pools_empty(worker.engine)
        with pytest.raises(InvalidRequestError):
            worker.submit(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=4), "medusa", 3)
    finally:
        worker.close()


def test_a_stop_string_stays_the_stop_reason_after_the_worker_takes_the_request_out(dec) -> None:
    # The reader finds the stop string and closes the worker's iterator while the worker is still
    # stepping the request: those steps ("running") and the abort ("cancelled") must not be the
    # reason that stays.
    worker = BatchWorker(engine(dec))
    try:
        prompt = dec.encode(PROMPTS[0])
        chunks, _ = worker.submit(prompt, SamplingParams(max_new_tokens=300), "none")
        text = dec.tokenizer.decode([t for chunk in chunks for t in chunk])
        # An ASCII piece from early in the greedy text: the stream stops there, far from its end.
        start = next(i for i in range(10, len(text) - 4) if text[i:i + 4].isascii() and text[i:i + 4].strip())
        stop = text[start:start + 4]
        params = SamplingParams(max_new_tokens=300, stop=[stop])
        chunks, stats = worker.submit(prompt, params, "none")
        out = "".join(dec.token_stream(chunks, stats, params))
        assert stop not in out and len(out) <= start
        assert not worker.engine.has_unfinished  # the close returned after the request left
        assert stats.stop_reason == "stop_string"
        assert_pools_empty(worker.engine)
    finally:
        worker.close()


def test_pass_costs_interpolate_scale_and_learn_each_shape() -> None:
    costs = PassCosts({1: 1.0, 4: 1.3, 8: 2.0})
    assert costs.seconds(2, 1) == pytest.approx(1.1) and costs.seconds(4, 4) == pytest.approx(3.4)
    costs.observe(4, 1, 2.6)  # a batched pass of 4 rows cost twice the 4-token prior
    assert costs.seconds(4, 1) == 2.6  # a shape's first timing is taken as is
    assert costs.seconds(2, 4) == pytest.approx(2.0 * (0.8 + 0.2 * 2.0))  # unseen shapes: prior x scale
    costs.observe(4, 1, 1.6)
    assert 1.6 < costs.seconds(4, 1) < 2.6
    with pytest.raises(ValueError):
        PassCosts({0: 1.0})


def test_batch_k_falls_back_to_plain_as_the_batch_grows() -> None:
    # Memory-bound until 8 rows, then compute-bound: 60 ms per row.
    verify = PassCosts({1: 0.2, 8: 0.21, 16: 0.7, 64: 3.6})
    draft = PassCosts({1: 0.05, 8: 0.06, 16: 0.12})
    chooser = BatchK(k_max=8, verify=verify, draft=draft)
    row = BatchRow(acceptance=0.8, cap=8, uses_draft_model=True)
    assert chooser.choose([row], batch_size=1) >= 3
    assert chooser.choose([row] * 16, batch_size=16) == 0
    assert chooser.choose([BatchRow(0.8, 2, True)], batch_size=1) == 2  # a row's cap bounds the useful k
    assert BatchK(k_max=5).choose([BatchRow(0.1, 5, True)], 1) == 5  # no costs: a fixed k
    assert chooser.choose([], batch_size=4) == 0  # nothing speculative
    for _ in range(12):
        chooser.observe(widths=[1] * 16, drafted=0, verify_seconds=0.7, draft_rows=0, draft_passes=0, draft_seconds=0.0)
    # No probe: even drafts accepted 90% of the time would not pay for 16 rows here.
    assert chooser.choose([row] * 16, batch_size=16) == 0 and chooser.plain_streak == 0


def test_a_lone_row_that_stops_at_the_confidence_cut_off_drafts_up_to_its_cap() -> None:
    # Drafts dear enough that the cost model alone picks a short k ...
    verify = PassCosts({1: 0.2, 8: 0.21, 16: 0.7})
    draft = PassCosts({1: 0.06, 8: 0.07, 16: 0.12})
    chooser = BatchK(k_max=8, verify=verify, draft=draft)
    chosen = chooser.choose([BatchRow(0.6, 6, True)], batch_size=1)
    assert 1 <= chosen < 6
    # ... but a lone row whose drafts end where the draft is unsure drafts up to its cap,
    assert chooser.choose([BatchRow(0.6, 6, True, stops_early=True)], batch_size=1) == 6
    # not where speculation does not pay at all, and not in a batch of several rows.
    assert chooser.choose([BatchRow(0.05, 6, True, stops_early=True)], batch_size=1) == 0
    assert chooser.choose([BatchRow(0.6, 6, True, stops_early=True)] * 2, batch_size=2) == chooser.choose(
        [BatchRow(0.6, 6, True)] * 2, batch_size=2)


def test_batch_k_prices_the_draft_backlog_and_backs_off_its_probes() -> None:
    verify = PassCosts({1: 0.2, 4: 0.22, 8: 0.3, 16: 0.6})
    draft = PassCosts({1: 0.05, 4: 0.06, 64: 0.5, 128: 1.0, 1024: 8.0})
    chooser = BatchK(k_max=8, verify=verify, draft=draft)
    caught_up = [BatchRow(0.8, 8, True)] * 2
    behind = [BatchRow(0.8, 8, True, backlog=500, remaining=100)] * 2  # a read-ahead of ~8 s
    assert chooser.choose(caught_up, 2) > 0 and chooser.choose(behind, 2) == 0
    # The same backlog spread over a long future pays; over a short one it does not.
    assert chooser.choose([BatchRow(0.8, 8, True, backlog=60, remaining=100)] * 2, 2) > 0
    assert chooser.choose([BatchRow(0.8, 8, True, backlog=60, remaining=4)] * 2, 2) == 0
    # A lone row never verified is given the optimistic acceptance once; rows in a batch of
    # several keep their own estimates.
    assert chooser.choose([BatchRow(0.2, 8, True, observed=False)], 1) > 0
    assert chooser.choose([BatchRow(0.2, 8, True, observed=False)] * 2, 2) == 0
    assert chooser.choose([BatchRow(0.2, 8, True)], 1) == 0

    def plain_steps(n: int) -> None:
        for _ in range(n):
            chooser.observe(widths=[1, 1], drafted=0, verify_seconds=0.2, draft_rows=0, draft_passes=0, draft_seconds=0.0)

    poor = [BatchRow(0.3, 8, True)] * 2
    assert chooser.choose(poor, 2) == 0
    plain_steps(12)
    assert chooser.choose([], 2) == 0  # a step with nothing to draft ...
    plain_steps(1)
    assert chooser.choose(poor, 2) == 0  # ... restarts the count: no probe yet
    plain_steps(11)
    assert chooser.choose(poor, 2) == 2  # the probe after 12 plain steps
    chooser.observe(widths=[3, 3], drafted=4, verify_seconds=0.25, draft_rows=2, draft_passes=2, draft_seconds=0.1)
    assert chooser.choose(poor, 2) == 0 and chooser.probe_after == 24  # it did not pay: wait twice as long
    plain_steps(12)
    assert chooser.choose(poor, 2) == 0
    plain_steps(12)
    assert chooser.choose(poor, 2) == 2


def test_plain_batch_step_costs_one_target_pass_for_every_row(dec) -> None:
    eng = engine(dec)
    for prompt in PROMPTS[:4]:
        eng.add_request(dec.encode(prompt), SamplingParams(max_new_tokens=6), "none")
    calls = []
    real_forward = dec.target.model.forward

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real_forward(*args, **kwargs)

    dec.target.model.forward = counting
    try:
        eng.step()  # admits all four (one padded prefill pass), then one decode pass of 4 rows
        eng.step()
    finally:
        del dec.target.model.forward
    longest_prefill = max(len(dec.encode(p)) for p in PROMPTS[:4]) - 1
    assert calls == [torch.Size([4, longest_prefill]), torch.Size([4, 1]), torch.Size([4, 1])]


def test_generate_batch_equals_generate_per_prompt(dec) -> None:
    params = [SamplingParams(max_new_tokens=n, stop=stop) for n, stop in zip([12, 20, 6, 16], [(), (), (), ("\n",)])]
    eng = dec.batch_engine(max_batch=3, kv_cache_tokens=512, cost_aware=False)
    for method in ("draft", "ngram", "none"):
        results = dec.generate_batch(PROMPTS[:4], params, method=method, k=3, engine=eng)
        for prompt, p, result in zip(PROMPTS[:4], params, results):
            alone = dec.generate(prompt, p, method="none")
            assert (result.text, result.token_ids) == (alone.text, alone.token_ids)
            assert result.stats.method == method and result.stats.new_tokens >= len(result.token_ids)
    assert_pools_empty(eng)
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        dec.generate_batch(PROMPTS[:2], params, engine=eng)


def test_cost_aware_engine_times_batched_shapes(dec) -> None:
    eng = dec.batch_engine(max_batch=4, kv_cache_tokens=512)
    assert set(eng.chooser.verify.shapes) == {(4, 1), (4, 3)} and set(eng.chooser.draft.shapes) == {(4, 1)}
    assert eng.chooser.verify.scale > 0
    cases = mixed_cases()[:6]
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k) for p, m, k, n in cases]
    outputs = eng.run()
    assert [outputs[i] for i in ids] == single_outputs(dec, cases)


def test_a_new_request_starts_from_the_pooled_acceptance(dec) -> None:
    eng = engine(dec)
    eng.add_request(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=16), "draft", 3)
    eng.run()
    pooled = eng._pooled_acceptance["draft"]
    assert pooled.trials > 0
    request_id = eng.add_request(dec.encode(PROMPTS[1]), SamplingParams(max_new_tokens=4), "draft", 3)
    fresh = eng._requests[request_id].state.acceptance
    assert 0 < fresh.trials <= 6.0 + 1e-9 and fresh.rate == pytest.approx(pooled.rate, abs=0.1)
    eng.run()


def test_a_requests_first_token_may_be_speculated_but_not_by_the_draft_model(dec) -> None:
    # A lookup drafts from a row's first step (its drafts ride in the pass that feeds the
    # prompt's last token); the draft model waits for the second (its first token would pay for
    # the draft model reading the whole prompt). Either way the output is the target's own.
    eng = engine(dec)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = copyable_prompt(dec)  # its tail matches earlier in it: a lookup proposes at once
    lookup = eng.add_request(prompt, params, "ngram", 3)
    model = eng.add_request(prompt, params, "draft", 3)
    first = {output.request_id: output for output in eng.step()}
    assert first[lookup].stats.draft_tokens_proposed > 0 and first[lookup].stats.verify_steps == 1
    assert first[model].stats.draft_tokens_proposed == 0 and len(first[model].new_tokens) == 1
    second = {output.request_id: output for output in eng.step()}
    assert second[model].stats.draft_tokens_proposed == 3
    generated = eng.run()
    expected = dec.generate(prompt, params, method="none").token_ids
    for request_id in (lookup, model):
        assert first[request_id].new_tokens + second[request_id].new_tokens + generated[request_id] == expected
    assert_pools_empty(eng)


def test_paged_forward_keeps_the_logit_rows_asked_for(dec) -> None:
    """``logit_rows`` on the paged model: row b's last r_b rows of the full pass, at [b, :r_b],
    zeros past them (the batch engine merges no prompt on torch, but the interface holds)."""
    from specdecode.backends.torch_batch import PagedBatchModel

    batch = PagedBatchModel.with_pool(dec.target.model, 256, 4)
    inputs = [torch.tensor(dec.encode(p)) for p in PROMPTS[:3]]
    for seq, x in enumerate(inputs):
        batch.pool.add(seq)
        batch.pool.reserve(seq, x.shape[0])
    full = batch.forward([0, 1, 2], inputs, [0, 0, 0])  # (3, T_max, V)
    kept = batch.forward([0, 1, 2], inputs, [0, 0, 0], logit_rows=[1, 3, 2])
    assert kept.shape == (3, 3, full.shape[-1])
    for b, (x, rows) in enumerate(zip(inputs, [1, 3, 2], strict=True)):
        torch.testing.assert_close(kept[b, :rows], full[b, x.shape[0] - rows : x.shape[0]], rtol=1e-5, atol=1e-5)
        assert not kept[b, rows:].any()
    assert not batch.merges_prefill
