"""The batch engine on llama.cpp: sequences as llama.cpp sequence ids of one context, decoded
together in one ``llama_decode`` per pass, each with its own rollbacks.

As in test_llamacpp_engine.py the decoders run the F32 files in llama.cpp's exact mode, where a
pass over several rows still rounds differently from a one-row pass (by ~3e-6): greedy
equality with single-request decoding is asserted up to the target's first near-tie
(helpers.NEAR_TIE), and each test checks that most tokens were compared.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")

from helpers import (
    CHI2_CRITICAL_P001,
    PROMPTS,
    assert_greedy_equal_up_to_near_tie,
    chi_square_in_batches,
    greedy_margins,
    install_wrong_residual,
    llamacpp_decoder,
)

import specdecode.engine.batch_verify
from specdecode import SamplingParams
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.backends.llamacpp_batch import LlamaCppBatchModel
from specdecode.config import SchedulerConfig
from specdecode.engine.batch import BatchEngine
from specdecode.errors import InvalidRequestError

METHODS = ("draft", "ngram", "none")


def assert_slots_free(eng: BatchEngine) -> None:
    for pool in (eng.target_cache, eng.drafter.cache):
        assert pool.free_blocks == pool.usable_blocks and not pool.slots


def test_forward_batch_of_ragged_rows_equals_each_row_alone(tiny_ggufs: dict[str, Path]) -> None:
    """Rows of different lengths at different positions, padded to (B, T_max, V): each row's
    logits equal the same tokens fed to that sequence alone (within the multi-row rounding)."""
    with LlamaCppModel(tiny_ggufs["target"], n_ctx=64, n_seq_max=3, kv_type="f32", flash_attn=False) as model:
        batch = LlamaCppBatchModel(model)
        prompts = [[5, 9, 13, 2, 7], [4, 4], [11, 3, 8, 1]]
        for seq in range(3):
            batch.pool.add(seq)
        batch.forward([0, 1, 2], [torch.tensor(p) for p in prompts], [0, 0, 0], logits="none")
        rows = [torch.tensor([6, 1, 2]), torch.tensor([3]), torch.tensor([9, 9])]
        starts = [len(p) for p in prompts]
        together = batch.forward([0, 1, 2], rows, starts)  # (3, 3, V)
        assert together.shape == (3, 3, model.vocab_size)
        for seq, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
            model.clear(seq)
            alone = model.forward(seq, prompt + row.tolist(), 0)[len(prompt):]
            torch.testing.assert_close(together[seq, : len(row)], alone, rtol=0, atol=1e-4)
            assert not together[seq, len(row):].any()  # padding rows are zeros
        batch.commit(0, starts[0] + 1)  # rollback of two rows
        assert model.cached_length(0) == starts[0] + 1
        batch.pool.free(1)
        assert model.cached_length(1) == 0 and batch.pool.free_blocks == 1


@pytest.mark.parametrize("policy", ["async", "sync"])
def test_batch_greedy_equals_single_request_greedy(tiny_ggufs: dict[str, Path], policy: str) -> None:
    """Mixed prompts, methods (draft model, lookup, plain), k and lengths, more requests than
    slots (they join as others leave): each output is its single-request plain output."""
    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    on_torch = llamacpp_decoder(tiny_ggufs["target"], None, backend="torch")
    cases = [(p, m, k, n) for p, m, k, n in zip(PROMPTS, itertools.cycle(METHODS), itertools.cycle([1, 3, 5, 8]),
                                                itertools.cycle([24, 7, 16, 30, 2]))]
    eng = dec.batch_engine(max_batch=3, kv_cache_tokens=3 * 256, policy=policy, cost_aware=False)
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k) for p, m, k, n in cases]
    outputs = eng.run()
    assert_slots_free(eng)
    compared = total = 0
    for (prompt, method, _, n), request_id in zip(cases, ids, strict=True):
        alone = dec.generate(prompt, SamplingParams(max_new_tokens=n), method="none").token_ids
        margins = greedy_margins(on_torch, on_torch.encode(prompt), alone)
        compared += assert_greedy_equal_up_to_near_tie(outputs[request_id], alone, margins, f"{method} {prompt!r}")
        total += len(alone)
    assert compared >= total * 3 // 4
    assert eng.scheduler.preemptions == 0  # a slot, once given, is never taken back


def test_a_request_longer_than_a_slot_is_refused_up_front(tiny_ggufs: dict[str, Path]) -> None:
    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    eng = dec.batch_engine(max_batch=2, kv_cache_tokens=2 * 256, cost_aware=False)
    with pytest.raises(InvalidRequestError, match="at most 256"):
        eng.add_request(dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=300), "draft", 3)
    with pytest.raises(InvalidRequestError, match="positions per llama.cpp sequence"):
        dec.batch_engine(max_batch=8, kv_cache_tokens=1024, cost_aware=False)


def test_cost_aware_engine_times_llamacpp_passes(tiny_ggufs: dict[str, Path]) -> None:
    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    eng = dec.batch_engine(max_batch=2, kv_cache_tokens=2 * 256)
    costs = eng.chooser.verify
    assert {(2, 1), (2, 3)} <= set(costs.shapes) and all(s > 0 for s in costs.points.values())
    assert_slots_free(eng)  # the timing's scratch sequences are gone


def test_sampling_inside_a_llamacpp_batch_matches_the_target_distribution(tiny_ggufs: dict[str, Path]) -> None:
    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["far"])
    eng = dec.batch_engine(max_batch=16, kv_cache_tokens=16 * 256, cost_aware=False)
    stat, df = chi_square_in_batches(dec, eng)
    assert_slots_free(eng)
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_llamacpp_batch_distribution_test_has_power(tiny_ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    install_wrong_residual(monkeypatch, specdecode.engine.batch_verify)
    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["far"])
    stat, df = chi_square_in_batches(dec, dec.batch_engine(max_batch=16, kv_cache_tokens=16 * 256, cost_aware=False))
    assert stat > CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}: the test has no power"


@pytest.mark.parametrize("spare_slots", [1, 0])
def test_fair_preemption_keeps_the_preempted_requests_kv_in_a_spare_slot(tiny_ggufs: dict[str, Path],
                                                                         spare_slots: int) -> None:
    """Two long generations fill a two-seat batch; a short request arriving after they ran a time
    slice takes a seat in the next step, and the one it preempted waits in a spare slot with its
    K/V, resuming without recomputing them (the slot's prefix hit covers all but its last token).
    Without a spare slot a preemption would cost a whole recompute, so none happens: the short
    request waits as before. Outputs equal single-request ones up to the first near-tie."""
    from specdecode import SchedulerConfig

    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    on_torch = llamacpp_decoder(tiny_ggufs["target"], None, backend="torch")
    eng = dec.batch_engine(max_batch=2, kv_cache_tokens=2 * 256, cost_aware=False,
                           scheduling=SchedulerConfig(time_slice=4, spare_slots=spare_slots))
    assert eng.target_cache.usable_blocks == 2 + spare_slots
    cases = [(PROMPTS[0], 30, "draft"), (PROMPTS[1], 30, "none"), (PROMPTS[2], 3, "ngram")]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n, _ in cases]
    ids = [eng.add_request(dec.encode(p), sp, m, 3) for (p, _, m), sp in zip(cases[:2], params, strict=False)]
    generated: dict[str, list[int]] = {}

    def step() -> None:
        for output in eng.step():
            generated.setdefault(output.request_id, []).extend(output.new_tokens)

    for _ in range(6):
        step()
    hits = eng.target_cache.prefix_stats.hit_tokens
    ids.append(eng.add_request(dec.encode(cases[2][0]), params[2], cases[2][2], 3))
    step()
    if spare_slots:
        assert generated.get(ids[2]) and eng.scheduler.fair_preemptions == 1
    else:
        assert not generated.get(ids[2]) and eng.scheduler.fair_preemptions == 0
    while eng.has_unfinished:
        step()
    if spare_slots:  # the preempted request's whole context came back from its slot
        shortest = min(len(dec.encode(prompt)) for prompt, _, _ in cases[:2])
        assert eng.target_cache.prefix_stats.hit_tokens - hits >= shortest + 6 - 1
    assert_slots_free(eng)
    for (prompt, n, method), request_id, sp in zip(cases, ids, params, strict=True):
        expected = dec.generate(prompt, sp, method="none").token_ids
        margins = greedy_margins(on_torch, on_torch.encode(prompt), expected)
        compared = assert_greedy_equal_up_to_near_tie(generated[request_id], expected, margins, f"{method} {prompt!r}")
        assert compared >= len(expected) // 2


def test_a_preempted_sequences_slot_waits_for_it(tiny_ggufs: dict[str, Path]) -> None:
    """A slot left by a preempted sequence (``returning``) is not taken by a new sequence sharing
    a prefix with it while another slot is free (the new one would win it by prefix length and
    leave the preempted one a whole context to recompute); its owner gets it back whole; once
    the owner leaves the queue instead, the slot serves the prefix cache like any other."""
    with LlamaCppModel(tiny_ggufs["target"], n_ctx=64, n_seq_max=3, kv_type="f32", flash_attn=False) as model:
        batch = LlamaCppBatchModel(model)
        pool = batch.pool
        system = [5, 9, 13, 2, 7, 1, 1, 4]
        owner_tokens = system + [3, 3, 8, 6]
        pool.add(0, owner_tokens)
        batch.forward([0], [torch.tensor(owner_tokens[:-1])], [0], logits="none")
        batch.commit(0, len(owner_tokens) - 1)
        pool.free(0, owner_tokens, returning=True)
        assert pool.add(1, system + [11, 12]) == 0  # an empty slot, not the owner's
        assert pool.add(0, owner_tokens) == len(owner_tokens) - 1  # the owner's whole context
        pool.free(0, owner_tokens, returning=True)
        pool.free(0)  # the owner left the queue (cancelled while waiting)
        assert pool.add(2, system + [11, 12]) == len(system)  # now anyone's prefix


def test_a_preempted_sequences_kv_is_saved_when_its_slot_is_needed(tiny_ggufs: dict[str, Path]) -> None:
    """With every free slot kept for a preempted sequence, a new sequence takes one, but the K/V
    there are first saved to host memory; the preempted sequence comes back to another slot with
    them restored (all its positions kept) and its next logits equal what they were before."""
    with LlamaCppModel(tiny_ggufs["target"], n_ctx=64, n_seq_max=2, kv_type="f32", flash_attn=False) as model:
        batch = LlamaCppBatchModel(model)
        pool = batch.pool
        tokens = [5, 9, 13, 2, 7, 1, 1, 4, 3, 3]
        pool.add(0, tokens)
        pool.add(1, [8, 8])
        batch.forward([0], [torch.tensor(tokens[:-1])], [0], logits="none")
        batch.commit(0, len(tokens) - 1)
        before = batch.forward([0], [torch.tensor(tokens[-1:])], [len(tokens) - 1])[0, -1]
        batch.commit(0, len(tokens) - 1)
        pool.free(0, tokens, returning=True)
        # Only the kept slot is free: saved first, then its prefix serves the new sequence too.
        assert pool.add(2, tokens[:4] + [11]) == 4 and pool.swaps == 1
        pool.free(1)  # slot of sequence 1 is free again
        assert pool.add(0, tokens) == len(tokens) - 1  # restored into the other slot
        after = batch.forward([0], [torch.tensor(tokens[-1:])], [len(tokens) - 1])[0, -1]
        assert torch.equal(before, after)
        assert not pool.saved


def test_a_prompts_last_chunk_is_fed_with_its_first_step(tiny_ggufs: dict[str, Path]) -> None:
    """On llama.cpp's flat batches a new request's first token costs one ``llama_decode``: its
    prompt's last chunk goes into the step's pass (logits for its last token only), where the
    running request decodes too. Earlier chunks of a long prompt are still prefilled apart.
    Outputs equal single-request decoding up to the first near-tie."""
    dec = llamacpp_decoder(tiny_ggufs["target"], None)
    eng = dec.batch_engine(max_batch=2, kv_cache_tokens=2 * 256, cost_aware=False,
                           scheduling=SchedulerConfig(prefill_chunk=16))
    model = eng.target.model
    calls: list[list[tuple[int, int, object]]] = []  # per forward_batch: (start, tokens, logits) per request
    real = model.forward_batch

    def counting(requests, out=None):
        calls.append([(start, len(tokens), mode) for _, tokens, start, mode in requests])
        return real(requests, out)

    model.forward_batch = counting
    try:
        short_ids = dec.encode(PROMPTS[0])
        short = eng.add_request(short_ids, SamplingParams(max_new_tokens=12), "none")
        generated = {short: eng.step()[0].new_tokens}
        assert len(generated[short]) == 1 and calls == [[(0, len(short_ids), 1)]]
        long_ids = list(reversed(dec.encode(" ".join(PROMPTS)) * 3))[:40]
        assert long_ids[0] != short_ids[0]  # nothing for the prefix cache to share
        long = eng.add_request(long_ids, SamplingParams(max_new_tokens=6), "none")
        calls.clear()
        while not generated.get(long):
            for output in eng.step():
                generated.setdefault(output.request_id, []).extend(output.new_tokens)
        # Chunks of 16 over its first 39 positions: two prefills of 16, then the last 7 and its
        # last token (logits for that one only) in the pass where the short request decodes.
        assert [c for c in calls if c[0][2] == "none"] == [[(0, 16, "none")], [(16, 16, "none")]]
        assert len(calls) == 5 and (32, 8, 1) in calls[-1] and len(calls[-1]) == 2  # 2 + 2 + 1 passes
        for request_id, tokens in eng.run().items():
            generated[request_id].extend(tokens)
    finally:
        model.forward_batch = real
    for request_id, ids, n in ((short, short_ids, 12), (long, long_ids, 6)):
        expected = dec.generate(ids, SamplingParams(max_new_tokens=n), method="none").token_ids
        margins = greedy_margins(dec, ids, expected)
        assert assert_greedy_equal_up_to_near_tie(generated[request_id], expected, margins, request_id) >= n // 2
