"""Medusa, EAGLE and layer skip in the batch engine (issue 45: every method batched).

One decoder over the tiny Qwen2 target carries Medusa heads, an EAGLE head (both trained on the
repeating text, conftest) and a layer to skip, so rows of every method share one batch:

- greedy rows equal their request decoded plainly alone, exactly (fp32), under both policies,
  through preemption and aborts, for rows whose prompt came from the prefix cache (an EAGLE
  row then starts its head after the cached positions, whose features were never computed) and
  for samples of one prompt forked from its first (n > 1);
- sampled rows of each method, in batches with rows of other methods, pass the chi-square test
  against the target's exact distribution (``helpers.chi_square_in_mixed_batches``: 1,500
  draws, p = 0.001);
- the drafts were used: trees proposed and accepted, layer-skip drafts accepted.
"""

import itertools
from pathlib import Path

import pytest
import torch
from helpers import CHI2_CRITICAL_P001, DRAWS, PATTERN, PROMPTS, chi_square_in_mixed_batches, run_aborting

from specdecode import SamplingParams, SpecDecoder
from specdecode.engine.batch import BatchEngine
from specdecode.engine.metrics import GenerationStats
from specdecode.errors import InvalidRequestError
from specdecode.models.heads import load_heads

SKIP = (1,)  # the tiny target has 2 layers: drafts run layer 0 only
HEADS_METHODS = ("medusa", "eagle", "layerskip")


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, medusa_dir: Path, eagle_dir: Path) -> SpecDecoder:
    decoder = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="medusa", heads=str(medusa_dir), skip_layers=SKIP,
                                          draft_confidence=0.0, dtype="fp32", device="cpu", show_progress=False)
    decoder.attach_heads(load_heads(eagle_dir, torch.float32, torch.device("cpu")))
    return decoder


def engine(dec: SpecDecoder, **kwargs) -> BatchEngine:
    # Not cost-aware: every drafting row drafts its own k each step, so every method runs.
    options = {"max_batch": 4, "kv_cache_tokens": 1024, "block_size": 4, "cost_aware": False} | kwargs
    return dec.batch_engine(**options)


def assert_pool_empty(eng: BatchEngine) -> None:
    assert eng.target_cache.free_blocks == eng.target_cache.usable_blocks and not eng.target_cache.tables


def cases(methods: tuple[str, ...], waves: int = 2) -> list[tuple[str, str, int, int]]:
    """(prompt, method, k, max_new_tokens): each prompt ``waves`` times, so that later waves find
    their prompts in the prefix cache."""
    prompts = ([PATTERN[:60], PATTERN[7:80]] + PROMPTS[:4]) * waves
    return list(zip(prompts, itertools.cycle(methods), itertools.cycle([2, 3, 4]), itertools.cycle([30, 12, 24]),
                    strict=False))


def run(dec: SpecDecoder, eng: BatchEngine, batch, abort_at: int | None = None):
    stats = [GenerationStats() for _ in batch]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, _, _, n in batch]
    ids = [eng.add_request(dec.encode(p), ps, m, k, stats=s) for (p, m, k, _), ps, s in zip(batch, params, stats, strict=True)]
    aborted = None
    if abort_at is not None:
        aborted = eng.add_request(dec.encode(PATTERN[3:70]), SamplingParams(max_new_tokens=30), "eagle", 3)
    generated = run_aborting(eng, aborted, abort_at)
    return [generated.get(i, []) for i in ids], stats


def plain(dec: SpecDecoder, batch) -> list[list[int]]:
    return [dec.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True), method="none").token_ids
            for p, _, _, n in batch]


def by_method(batch, stats: list[GenerationStats], method: str) -> list[GenerationStats]:
    return [s for (_, m, _, _), s in zip(batch, stats, strict=True) if m == method]


@pytest.mark.parametrize("policy", ["async", "sync"])
def test_every_method_batched_equals_plain_decoding(dec: SpecDecoder, policy: str) -> None:
    batch = cases((*HEADS_METHODS, "suffix", "none"))
    eng = engine(dec, policy=policy)
    outputs, stats = run(dec, eng, batch)
    assert outputs == plain(dec, batch)
    assert_pool_empty(eng)
    if policy == "sync":  # the batch keeps what its worst drafting row accepted: often nothing here
        return
    for method in ("medusa", "eagle"):
        rows = by_method(batch, stats, method)
        assert sum(s.tree_nodes_proposed for s in rows) >= sum(s.draft_tokens_proposed for s in rows) > 0, method
        assert sum(s.draft_tokens_accepted for s in rows) > 0, method
    eagle = by_method(batch, stats, "eagle")  # its trees branch (top-k 4 per node)
    assert sum(s.tree_nodes_proposed for s in eagle) > sum(s.draft_tokens_proposed for s in eagle)
    skipping = by_method(batch, stats, "layerskip")
    assert sum(s.draft_tokens_accepted for s in skipping) > 0
    assert sum(s.draft_forward_passes for s in skipping) >= sum(s.draft_tokens_proposed for s in skipping) > 0
    # The second wave found its prompts in the prefix cache, EAGLE rows too.
    assert any(s.cached_tokens > 0 for s in by_method(batch, stats, "eagle"))


def test_heads_and_layerskip_rows_survive_preemption_and_aborts(dec: SpecDecoder) -> None:
    batch = cases(HEADS_METHODS + ("none",))
    eng = engine(dec, max_batch=8, kv_cache_tokens=96)
    outputs, stats = run(dec, eng, batch, abort_at=5)
    assert eng.scheduler.preemptions > 0
    assert outputs == plain(dec, batch)
    assert sum(s.draft_tokens_accepted for s in stats) > 0
    assert_pool_empty(eng)


def test_forked_samples_draft_from_heads_without_the_prompts_features(dec: SpecDecoder) -> None:
    # Samples after the first start from its prompt K/V: their heads never saw the prompt's features.
    eng = engine(dec)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    expected = dec.generate(PATTERN[:60], params, method="none").token_ids
    for method in ("eagle", "medusa"):
        results = dec.generate_batch([PATTERN[:60]], params, method=method, k=3, n=3, engine=eng)
        assert [r.token_ids for r in results] == [expected] * 3, method
        assert all(r.stats.tree_nodes_proposed > 0 for r in results), method  # the forked samples' heads drafted
    assert_pool_empty(eng)


def test_an_engine_without_heads_or_layers_refuses_their_methods(tiny_qwen2_dir: Path) -> None:
    bare = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu",
                                       show_progress=False)
    eng = engine(bare)
    prompt = bare.encode(PROMPTS[0])
    for method, needs in (("medusa", "heads"), ("eagle", "heads"), ("layerskip", "skip_layers")):
        with pytest.raises(InvalidRequestError, match=needs):
            eng.add_request(prompt, SamplingParams(max_new_tokens=4), method, 3)
    assert not eng.has_unfinished


@pytest.mark.parametrize("method", HEADS_METHODS)
def test_sampled_rows_match_the_target_distribution(dec: SpecDecoder, method: str) -> None:
    eng = engine(dec, max_batch=16, kv_cache_tokens=2048, block_size=8)
    stat, df, stats = chi_square_in_mixed_batches(dec, eng, dec.encode("def quicksort(arr):"), method,
                                                  tuple(m for m in (*HEADS_METHODS, "none") if m != method))
    assert_pool_empty(eng)
    assert sum(s.draft_tokens_proposed for s in stats) >= DRAWS // 2, "the rows should draft in most draws"
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"
