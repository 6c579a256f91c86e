"""Prefix caching in the batch engine: a request admitted after another that shares its prompt's
prefix starts from the cached blocks (torch) or slot (llama.cpp), on the target and the draft
model, and decodes exactly as without the cache (fp32 torch: exact; llama.cpp: up to the first
near-tie); under memory pressure cached blocks are evicted and no request loses a token."""

from dataclasses import replace
from pathlib import Path

import pytest
from helpers import PROMPTS, assert_greedy_equal_up_to_near_tie, decoder, greedy_margins, small_batch_engine

from specdecode import SamplingParams, SpecDecoder
from specdecode.config import SchedulerConfig
from specdecode.engine.batch import BatchEngine
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.scheduler import MIN_PREFIX_TO_WAIT_FOR

GREEDY = SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> SpecDecoder:
    return decoder(tiny_qwen2_dir, tiny_close_draft_dir)


def engine(dec: SpecDecoder, **kwargs) -> BatchEngine:
    return small_batch_engine(dec, **kwargs)


def run(eng: BatchEngine, prompts: list[list[int]], method: str, salt: str | None = None) -> tuple[list[list[int]], list[int]]:
    """Each prompt's output and cached prompt positions, the prompts run one after another."""
    outputs, cached = [], []
    for prompt in prompts:
        stats = GenerationStats()
        request_id = eng.add_request(prompt, GREEDY, method, 3, stats=stats, cache_salt=salt)
        outputs.append(eng.run()[request_id])
        cached.append(stats.cached_tokens)
    return outputs, cached


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_a_second_turn_reuses_the_first_and_decodes_as_without_the_cache(dec: SpecDecoder, method: str) -> None:
    first = dec.encode("def quicksort(arr):")
    with_cache, without = engine(dec), engine(dec, prefix_cache=False)
    turn_one, cached_one = run(with_cache, [first], method)
    second = first + turn_one[0] + dec.encode("\n# in place\n")
    turn_two, cached_two = run(with_cache, [second], method)
    reference, cached_reference = run(without, [first, second], method)
    assert [turn_one[0], turn_two[0]] == reference
    assert cached_one == [0] and cached_reference == [0, 0]
    # Full 4-token blocks of turn 1's committed tokens (all but its last token have K/V).
    assert cached_two[0] == (len(first) + len(turn_one[0]) - 1) // 4 * 4
    if method == "draft":  # the draft pool's blocks were shared too
        assert with_cache.drafter.cache.prefix_stats.hit_tokens > 0


def test_concurrent_requests_share_a_system_prompt_once_it_is_prefilled(dec: SpecDecoder) -> None:
    system = dec.encode("You are a helpful assistant that writes Python. " * 4)
    prompts = [system + dec.encode(p) for p in PROMPTS[:6]]
    eng = engine(dec, max_batch=2)  # two at a time: later ones are admitted after the first prefill
    ids = [eng.add_request(p, GREEDY, "none") for p in prompts]
    outputs = eng.run()
    plain = engine(dec, prefix_cache=False)
    ids_plain = [plain.add_request(p, GREEDY, "none") for p in prompts]
    reference = plain.run()
    assert [outputs[i] for i in ids] == [reference[i] for i in ids_plain]
    assert eng.target_cache.prefix_stats.hit_tokens >= 4 * (len(system) // 4 * 4)


def add_together(eng: BatchEngine, prompts: list[list[int]], salts: list[str | None]) -> tuple[list[str], list[GenerationStats]]:
    stats = [GenerationStats() for _ in prompts]
    ids = [eng.add_request(p, GREEDY, "none", stats=s, cache_salt=salt) for p, s, salt in zip(prompts, stats, salts, strict=True)]
    return ids, stats


def test_requests_sent_together_compute_a_shared_system_prompt_once(dec: SpecDecoder) -> None:
    """Four requests sharing a long system prompt, added at once with seats for all: the first
    prefills it, the others wait for it and start from its blocks; outputs as without the cache.
    Without waiting (the engine before) all four prefill it in one padded pass."""
    system = dec.encode("You are a helpful assistant that writes Python. " * 8)
    prompts = [system + dec.encode(p) for p in PROMPTS[:4]]
    assert len(system) >= 64 + 4
    eng = engine(dec, kv_cache_tokens=4096)  # room for all four prompts at once
    ids, stats = add_together(eng, prompts, [None] * 4)
    outputs = eng.run()
    assert stats[0].cached_tokens == 0
    assert [s.cached_tokens for s in stats[1:]] == [len(system) // 4 * 4] * 3
    eager = engine(dec, kv_cache_tokens=4096)
    eager.scheduler.wait_for_prefix = False
    _, eager_stats = add_together(eager, prompts, [None] * 4)
    eager_outputs = eager.run()
    assert [s.cached_tokens for s in eager_stats] == [0] * 4
    plain = engine(dec, prefix_cache=False, kv_cache_tokens=4096)
    ids_plain, _ = add_together(plain, prompts, [None] * 4)
    reference = plain.run()
    assert [outputs[i] for i in ids] == [reference[i] for i in ids_plain] == list(eager_outputs.values())


def test_a_request_waits_for_the_rest_of_a_prefix_prefilled_in_chunks(dec: SpecDecoder) -> None:
    """The first request's prefill spans several steps (32-token chunks): the others wait for
    the shared prefix past its first chunks, until less than MIN_PREFIX_TO_WAIT_FOR is left."""
    system = dec.encode("You are a helpful assistant that writes Python. " * 8)
    prompts = [system + dec.encode(p) for p in PROMPTS[:3]]
    eng = engine(dec, kv_cache_tokens=4096, scheduling=SchedulerConfig(prefill_chunk=32))
    _, stats = add_together(eng, prompts, [None] * 3)
    eng.run()
    assert stats[0].cached_tokens == 0
    assert all(len(system) - MIN_PREFIX_TO_WAIT_FOR <= s.cached_tokens <= len(system) for s in stats[1:])


def test_a_request_waits_only_for_its_own_groups_prefix_and_a_long_one(dec: SpecDecoder) -> None:
    system = dec.encode("You are a helpful assistant that writes Python. " * 8)
    long_tail = dec.encode(" ".join(PROMPTS) * 2)  # its own text is most of its prompt
    eng = engine(dec, kv_cache_tokens=4096)
    _, stats = add_together(eng, [system + dec.encode(PROMPTS[0]), system + dec.encode(PROMPTS[1]),
                                  system + long_tail], ["a", "b", "a"])
    eng.run()
    assert [s.cached_tokens for s in stats] == [0, 0, 0]  # group b's is not a's; the third shares < half


def test_cache_groups_are_isolated(dec: SpecDecoder) -> None:
    prompt = dec.encode("import numpy as np\n\nclass Counter:")
    eng = engine(dec)
    _, cached = run(eng, [prompt], "none", salt="a")
    _, other = run(eng, [prompt], "none", salt="b")
    _, same = run(eng, [prompt], "none", salt="a")
    assert cached == [0] and other == [0] and same[0] > 0


def test_eviction_under_memory_pressure_loses_no_request_and_no_token(dec: SpecDecoder) -> None:
    """A pool of 48 four-token blocks, two requests at a time, 12 distinct prompts and the first
    again: cached blocks are evicted for new ones, memory stays bounded, outputs stay exact."""
    prompts = [dec.encode(p) for p in PROMPTS] + [dec.encode(p + " again") for p in PROMPTS[:4]] + [dec.encode(PROMPTS[0])]
    eng = engine(dec, max_batch=2, kv_cache_tokens=4 * 49)
    ids = [eng.add_request(p, GREEDY, m) for p, m in zip(prompts, ["none", "draft", "ngram"] * 5, strict=False)]
    outputs = eng.run()
    plain = engine(dec, prefix_cache=False, max_batch=2, kv_cache_tokens=4 * 49)
    ids_plain = [plain.add_request(p, GREEDY, m) for p, m in zip(prompts, ["none", "draft", "ngram"] * 5, strict=False)]
    reference = plain.run()
    assert [outputs[i] for i in ids] == [reference[i] for i in ids_plain]
    pool = eng.target_cache
    assert pool.prefix_stats.evictions > 0 and pool.cached_blocks <= pool.usable_blocks
    assert pool.free_blocks == pool.usable_blocks and not pool.tables  # nothing held, all reclaimable


def test_the_llamacpp_batch_picks_the_slot_holding_the_longest_prefix(tiny_ggufs: dict[str, Path]) -> None:
    dec = SpecDecoder.from_pretrained(str(tiny_ggufs["target"]), method="none", dtype="fp32", backend="llama.cpp",
                                      show_progress=False)
    eng = dec.batch_engine(max_batch=2, kv_cache_tokens=1024, cost_aware=False)
    plain_eng = SpecDecoder(dec.target, None, replace(dec.config, prefix_cache=False)).batch_engine(
        max_batch=2, kv_cache_tokens=1024, cost_aware=False)
    first, other = dec.encode("def quicksort(arr):"), dec.encode("The quick brown fox")
    out_first, _ = run(eng, [first], "none")
    run(eng, [other], "none")  # the second slot now holds another prompt
    second = first + out_first[0] + dec.encode(" # again")
    (got,), (cached,) = run(eng, [second], "none")
    assert cached == len(first) + len(out_first[0]) - 1  # the first slot's whole committed prefix
    (want,), _ = run(plain_eng, [second], "none")
    compared = assert_greedy_equal_up_to_near_tie(got, want, greedy_margins(dec, second, want), "llama.cpp batch, cached")
    assert compared >= len(want) // 2
    assert eng.target_cache.prefix_stats.hit_tokens == cached


def test_the_llamacpp_batch_copies_a_prefix_from_a_running_sequence(tiny_ggufs: dict[str, Path]) -> None:
    """Requests sharing a system prompt, sent together: the first prefills it, the others copy
    its slot's K/V (llama_memory_seq_cp) while it still decodes; outputs as without the cache up
    to the first near-tie."""
    dec = SpecDecoder.from_pretrained(str(tiny_ggufs["target"]), method="none", dtype="fp32", backend="llama.cpp",
                                      show_progress=False)
    eng = dec.batch_engine(max_batch=3, kv_cache_tokens=1536, cost_aware=False)
    plain_eng = SpecDecoder(dec.target, None, replace(dec.config, prefix_cache=False)).batch_engine(
        max_batch=3, kv_cache_tokens=1536, cost_aware=False)
    system = dec.encode("You are a helpful assistant that writes Python. " * 8)
    prompts = [system + dec.encode(p) for p in PROMPTS[:3]]
    ids, stats = add_together(eng, prompts, [None] * 3)
    outputs = eng.run()
    pool = eng.target_cache
    assert pool.copies == 2 and stats[0].cached_tokens == 0
    assert [s.cached_tokens for s in stats[1:]] == [len(system)] * 2  # the whole shared prefix, no blocks here
    plain_ids, _ = add_together(plain_eng, prompts, [None] * 3)
    reference = plain_eng.run()
    compared = 0
    for prompt, request_id, plain_id in zip(prompts, ids, plain_ids, strict=True):
        want = reference[plain_id]
        compared += assert_greedy_equal_up_to_near_tie(outputs[request_id], want, greedy_margins(dec, prompt, want),
                                                       "llama.cpp batch, copied prefix")
    assert compared >= len(prompts) * GREEDY.max_new_tokens // 2
    assert not pool.running and pool.free_blocks == pool.usable_blocks

