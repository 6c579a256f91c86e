"""Method auto in the batch engine (drafters/auto_row.py): each row picks its source and draft
length every step, priced as the batch pass (costs/batch_k.py). Greedy rows equal plain
decoding (fp32: exact; llama.cpp: up to the first near-tie) in batches of mixed methods,
sampled rows keep the target's distribution (chi-square at p = 0.001, with a power check),
aborts and failures stay with their row, and no draft KV is held where the draft model cannot
pay. The pricing itself, on hand-made costs: tests/costs/test_batch_auto_pricing.py."""

import itertools
from pathlib import Path

import pytest
from helpers import (
    CHI2_CRITICAL_P001,
    DRAWS,
    PROMPTS,
    chi_square_in_mixed_batches,
    copyable_prompt,
    decoder,
    install_wrong_residual,
    run_until_done,
    small_batch_engine,
)

import specdecode.engine.batch_verify
from specdecode import SamplingParams
from specdecode.costs.batch_k import PassCosts
from specdecode.drafters.auto_row import AutoRow
from specdecode.engine.batch import BatchEngine
from specdecode.engine.metrics import GenerationStats

# Prompts that repeat themselves, so that prompt lookup and the suffix chain find matches.
REPEATING = ["def add(a, b):\n    return a + b\n\n" * 3, "1, 2, 3, 1, 2, 3, 1, 2, 3,", "the cat and the cat and the"]
LENGTHS = [24, 7, 30, 2, 16]  # 2: a row that finishes while the others decode


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path):
    return decoder(tiny_qwen2_dir, tiny_close_draft_dir)


def lookup_engine(dec, **kwargs) -> BatchEngine:
    """A batch engine without a draft model: auto chooses between its lookups and plain decoding."""
    options = {"max_batch": 4, "kv_cache_tokens": 1024, "block_size": 4} | kwargs
    return BatchEngine(dec.target.model, None, dec.eos_token_ids, **options)


def assert_pools_empty(eng: BatchEngine) -> None:
    pools = [eng.target_cache] + ([eng.drafter.cache] if eng.drafter is not None else [])
    for pool in pools:
        assert pool.free_blocks == pool.usable_blocks and not pool.tables


def cases(methods: tuple[str, ...]) -> list[tuple[str, str, int, int]]:
    """(prompt, method, k, max_new_tokens) over every prompt, repeating ones included."""
    return list(zip(REPEATING + PROMPTS, itertools.cycle(methods), itertools.cycle([1, 3, 5, 8]),
                    itertools.cycle(LENGTHS), strict=False))


def run_cases(dec, eng: BatchEngine, batch: list[tuple[str, str, int, int]]) -> tuple[list[list[int]], list[GenerationStats]]:
    stats = [GenerationStats() for _ in batch]
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k, stats=s)
           for (p, m, k, n), s in zip(batch, stats, strict=True)]
    outputs = eng.run()
    return [outputs[i] for i in ids], stats


def plain(dec, batch: list[tuple[str, str, int, int]]) -> list[list[int]]:
    return [dec.generate(p, SamplingParams(max_new_tokens=n), method="none").token_ids for p, _, _, n in batch]


def auto_stats(batch: list[tuple[str, str, int, int]], stats: list[GenerationStats]) -> list[GenerationStats]:
    return [s for (_, method, _, _), s in zip(batch, stats, strict=True) if method == "auto"]


# -- greedy: each row equals its request decoded alone ---------------------------------------------
def test_auto_rows_with_lookups_equal_plain_decoding(dec) -> None:
    """No draft model: auto rows draft from prompt lookup and the suffix chain beside none,
    ngram and suffix rows; every output equals plain greedy decoding of its request alone."""
    batch = cases(("auto", "none", "ngram", "suffix"))
    eng = lookup_engine(dec)
    outputs, stats = run_cases(dec, eng, batch)
    assert outputs == plain(dec, batch)
    assert_pools_empty(eng)
    autos = auto_stats(batch, stats)
    lookup_steps = sum(s.steps_by_source.get("ngram", 0) + s.steps_by_source.get("suffix", 0) for s in autos)
    assert lookup_steps > 0 and sum(s.draft_tokens_proposed for s in autos) > 0
    # Every step counted once, under the source that drafted it ("none": a plain step).
    assert all(s.method == "auto" and sum(s.steps_by_source.values()) == s.verify_steps > 0 for s in autos)
    assert not any("draft" in s.steps_by_source for s in autos)


@pytest.mark.parametrize("policy", ["async", "sync"])
def test_auto_rows_with_a_draft_model_equal_plain_decoding(dec, policy: str) -> None:
    """With a draft model the auto rows also draft with it (they hold draft KV); mixed with
    every other batched method, each output is still its plain greedy output."""
    batch = cases(("auto", "draft", "none", "auto", "ngram", "suffix"))
    eng = small_batch_engine(dec, policy=policy)
    outputs, stats = run_cases(dec, eng, batch)
    assert outputs == plain(dec, batch)
    assert_pools_empty(eng)
    autos = auto_stats(batch, stats)
    assert sum(s.steps_by_source.get("draft", 0) for s in autos) > 0
    assert sum(s.draft_forward_passes for s in autos) > 0


def test_auto_rows_survive_preemption(dec) -> None:
    """A pool too small for the batch: auto rows (draft KV included) are preempted, recomputed,
    and still give their plain outputs."""
    # The shorter repeating prompts: each request must fit the small pool alone.
    batch = [(p, m, 4, 30) for p, m in zip(REPEATING[1:] + PROMPTS, itertools.cycle(("auto", "draft", "ngram")))]
    eng = small_batch_engine(dec, max_batch=8, kv_cache_tokens=96)
    outputs, _ = run_cases(dec, eng, batch)
    assert eng.scheduler.preemptions > 0
    assert outputs == plain(dec, batch)
    assert_pools_empty(eng)


def test_auto_rows_on_llamacpp_equal_plain_decoding_up_to_a_near_tie(tiny_ggufs: dict[str, Path]) -> None:
    pytest.importorskip("llama_cpp")
    from helpers import assert_greedy_equal_up_to_near_tie, greedy_margins, llamacpp_decoder

    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    on_torch = llamacpp_decoder(tiny_ggufs["target"], None, backend="torch")
    batch = cases(("auto", "none", "ngram", "suffix", "draft"))
    eng = dec.batch_engine(max_batch=3, kv_cache_tokens=3 * 256, cost_aware=False)
    outputs, stats = run_cases(dec, eng, batch)
    compared = total = 0
    for (prompt, method, _, n), output in zip(batch, outputs, strict=True):
        alone = dec.generate(prompt, SamplingParams(max_new_tokens=n), method="none").token_ids
        margins = greedy_margins(on_torch, on_torch.encode(prompt), alone)
        compared += assert_greedy_equal_up_to_near_tie(output, alone, margins, f"{method} {prompt!r}")
        total += len(alone)
    assert compared >= total * 3 // 4
    assert sum(s.draft_tokens_proposed for s in auto_stats(batch, stats)) > 0
    for pool in (eng.target_cache, eng.drafter.cache):
        assert pool.free_blocks == pool.usable_blocks and not pool.slots


# -- sampling: the target's distribution ------------------------------------------------------------
def auto_chi_square(dec, eng: BatchEngine) -> tuple[float, int, int]:
    """``helpers.chi_square_in_mixed_batches`` for auto rows: 1,500 seeded auto requests (k = 2)
    of a prompt that copies itself (so lookups offer tokens the target takes 20-80% of the
    time), sharing batches with sampled requests of other prompts and methods (one in ten); the
    same statistic, cells and threshold. Also returns the tokens the auto rows drafted."""
    stat, df, stats = chi_square_in_mixed_batches(dec, eng, copyable_prompt(dec), "auto",
                                                  ("draft", "ngram", "suffix", "none"))
    return stat, df, sum(s.draft_tokens_proposed for s in stats)


def distribution_engine(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path):
    dec = decoder(tiny_qwen2_dir, tiny_far_draft_dir)
    return dec, BatchEngine(dec.target.model, dec.draft.model, dec.eos_token_ids, max_batch=16, kv_cache_tokens=2048,
                            block_size=8)


def test_sampled_auto_rows_in_a_batch_match_the_target_distribution(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path) -> None:
    dec, eng = distribution_engine(tiny_qwen2_dir, tiny_far_draft_dir)
    stat, df, drafted = auto_chi_square(dec, eng)
    assert_pools_empty(eng)
    assert drafted >= DRAWS // 2, "the auto rows should draft in most draws"
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_the_auto_distribution_test_catches_a_wrong_residual(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    install_wrong_residual(monkeypatch, specdecode.engine.batch_verify)
    dec, eng = distribution_engine(tiny_qwen2_dir, tiny_far_draft_dir)
    stat, df, _ = auto_chi_square(dec, eng)
    assert stat > CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}: the test has no power against this bug"


# -- aborts and failures ----------------------------------------------------------------------------
def test_aborting_an_auto_row_mid_decode_frees_its_blocks(dec) -> None:
    eng = small_batch_engine(dec)
    auto = eng.add_request(dec.encode(REPEATING[0]), SamplingParams(max_new_tokens=30), "auto", 4)
    others = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=20), m, 3)
              for p, m in zip(PROMPTS, ("draft", "ngram"))]
    for _ in range(4):
        eng.step()
    seq = eng._requests[auto]
    assert seq.uses_draft and seq.seq_id in eng.target_cache.tables and seq.seq_id in eng.drafter.cache.tables
    target_used, draft_used = eng.target_cache.used_blocks, eng.drafter.cache.used_blocks
    assert eng.abort(auto).stats.stop_reason == "cancelled"
    assert eng.target_cache.used_blocks < target_used and eng.drafter.cache.used_blocks < draft_used
    assert seq.seq_id not in eng.target_cache.tables and seq.seq_id not in eng.drafter.cache.tables
    outputs = eng.run()
    assert set(outputs) <= set(others)
    assert_pools_empty(eng)


@pytest.mark.parametrize("where", ["choices", "match"])
def test_a_failing_auto_row_fails_alone(dec, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """An auto row whose lookups raise (injected) fails alone with that error, whether they
    raise while it offers its options (before the batch's k is chosen) or while it hands over
    its draft; the rows sharing its steps, auto rows among them, get their plain outputs."""
    bad_prompt = dec.encode(REPEATING[1])
    real = getattr(AutoRow, where)

    def broken(self, *args):
        if self.history[: len(bad_prompt)] == bad_prompt:
            raise RuntimeError("injected lookup failure")
        return real(self, *args)

    monkeypatch.setattr(AutoRow, where, broken)
    batch = [(REPEATING[0], "auto", 4, 20), (PROMPTS[0], "none", 1, 12), (REPEATING[2], "auto", 4, 16)]
    eng = lookup_engine(dec, max_batch=8)
    bad = eng.add_request(bad_prompt, SamplingParams(max_new_tokens=20), "auto", 4)
    ids = [eng.add_request(dec.encode(p), SamplingParams(max_new_tokens=n), m, k) for p, m, k, n in batch]
    tokens, errors = run_until_done(eng)
    assert set(errors) == {bad} and "injected" in str(errors[bad])
    assert [tokens[i] for i in ids] == plain(dec, batch)
    assert_pools_empty(eng)


# -- the draft model where it cannot pay, and generate_batch ----------------------------------------
def test_auto_rows_hold_no_draft_kv_where_the_draft_model_cannot_pay(dec) -> None:
    """A CPU-like verify pass (each row 30% of a pass) and a draft pass as dear as a target pass:
    the draft model cannot pay even at full acceptance, so an auto row holds no draft KV."""
    steep, dear_draft = PassCosts({1: 1.0, 2: 1.3, 3: 1.6, 16: 5.5}), PassCosts({1: 1.0, 16: 16.0})
    eng = small_batch_engine(dec, verify_costs=steep, draft_costs=dear_draft)
    request_id = eng.add_request(dec.encode(REPEATING[0]), SamplingParams(max_new_tokens=12), "auto", 4)
    assert not eng.model_can_pay and not eng._requests[request_id].uses_draft
    for _ in range(3):
        eng.step()
    assert eng.target_cache.used_blocks > 0 and eng.drafter.cache.used_blocks == 0
    eng.run()
    assert_pools_empty(eng)


def test_generate_batch_runs_auto(dec) -> None:
    prompts = REPEATING[:2] + PROMPTS[:2]
    results = dec.generate_batch(prompts, SamplingParams(max_new_tokens=12), method="auto",
                                 engine=small_batch_engine(dec))
    assert [r.token_ids for r in results] == [dec.generate(p, SamplingParams(max_new_tokens=12), method="none").token_ids
                                             for p in prompts]
    assert all(r.stats.method == "auto" and r.stats.steps_by_source for r in results)


def test_an_auto_rows_suffix_chain_drafts_past_k_max(dec) -> None:
    """The second time a prompt runs in its group, the suffix chain holds the whole earlier
    answer: with cheap extra verify rows the row drafts past the engine's k_max in one step (as
    the single path's auto does, up to AUTO_DEPTH), and the output is still plain decoding's."""
    k_max = 4
    eng = lookup_engine(dec, max_batch=1, k_max=k_max, verify_costs=PassCosts({1: 1.0, 64: 1.1}))
    prompt, params = dec.encode(REPEATING[1]), SamplingParams(max_new_tokens=40, ignore_eos=True)
    outputs, stats = [], []
    for _ in range(2):
        stats.append(GenerationStats())
        request_id = eng.add_request(prompt, params, "auto", None, stats=stats[-1], suffix_group="g")
        outputs.append(eng.run()[request_id])
    assert outputs[0] == outputs[1] == dec.generate(prompt, params, method="none").token_ids
    assert len(stats[1].proposed_at_position) > k_max, stats[1].proposed_at_position
    assert stats[1].steps_by_source.get("suffix", 0) > 0
