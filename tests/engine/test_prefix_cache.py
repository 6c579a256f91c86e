"""Prefix caching on the single-request engine (engine/prefix.py; every decoder here is built
with ``engine="single"``; the batch engine's, over its paged pools: test_one_request_engine.py
and the batch tests): a request reuses the K/V of the
prompt prefix it shares with the previous request's committed tokens, on the target and on the
draft model, on both backends, and decodes exactly as without the cache.

Equality is exact in fp32 on torch: a prefill of the prompt's tail after a reused prefix runs the
same kernels over the same positions as the tail of a whole-prompt prefill (each row attends to
the same keys), and these tiny random models have no near-ties at fp32 rounding. On llama.cpp
the tail's prefill is a pass of another row count, so the comparison stops at the first near-tie
(``assert_greedy_equal_up_to_near_tie``), as the suite's other llama.cpp equality tests do.
"""

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import (
    CHI2_CRITICAL_P001,
    DRAWS,
    NEW_TOKENS,
    TOP_K,
    assert_greedy_equal_up_to_near_tie,
    exact_sequence_distribution,
    greedy_margins,
    pearson,
)

from specdecode import SamplingParams, SpecDecoder
from specdecode.engine.prefix import CachedPrefix, match_prefix

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


def fresh(target: Path, draft: Path | None, method: str, **options) -> SpecDecoder:
    return SpecDecoder.from_pretrained(str(target), str(draft) if draft else None, method=method, draft_confidence=0.0,
                                       dtype="fp32", device="cpu", show_progress=False, engine="single", **options)


def two_turns(dec: SpecDecoder, method: str, **call) -> tuple[list[int], list[int], list[int], int]:
    """Turn 1, then turn 2 whose prompt is turn 1's prompt and answer plus a new message:
    (turn-2 prompt, turn-1 output, turn-2 output, turn-2 cached tokens)."""
    first_prompt = dec.encode("def quicksort(arr):")
    first = dec.generate(first_prompt, GREEDY, method=method, **call)
    second_prompt = first_prompt + first.token_ids + dec.encode("\n# now sort in place\n")
    second = dec.generate(second_prompt, GREEDY, method=method, **call)
    return second_prompt, first.token_ids, second.token_ids, second.stats.cached_tokens


def test_match_prefix_reuses_the_shared_part_and_always_computes_the_last_prompt_token() -> None:
    cached = CachedPrefix(tokens=(1, 2, 3, 4, 5), valid=4, salt=None, epoch=7)
    match = match_prefix(cached, [1, 2, 3, 9], None, 7)
    assert (match.shared, match.keep) == (3, 3)  # rollback inside the prefix: recomputed from the diverging token
    assert match_prefix(cached, [1, 2, 3, 4, 5, 6, 7], None, 7).keep == 4  # only the valid K/V
    assert match_prefix(cached, [1, 2, 3], None, 7).keep == 2  # the whole prompt cached: its last token is fed
    assert match_prefix(cached, [1, 2, 3, 4], "tenant-b", 7).keep == 0  # another cache group
    assert match_prefix(cached, [1, 2, 3, 4], None, 8).keep == 0  # the sequence was used since
    assert match_prefix(None, [1, 2], None, 7).keep == 0


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "suffix", "auto"])
def test_second_turn_reuses_the_first_and_decodes_as_without_the_cache(
    tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, method: str
) -> None:
    draft = tiny_close_draft_dir if method in ("draft", "auto") else None
    cached = fresh(tiny_qwen2_dir, draft, method)
    uncached = fresh(tiny_qwen2_dir, draft, method, prefix_cache=False)
    prompt, first, second, cached_tokens = two_turns(cached, method)
    _, first_ref, second_ref, uncached_tokens = two_turns(uncached, method)
    assert first == first_ref and second == second_ref
    # Turn 1's prompt and all of its answer but the last token (whose K/V a request never computes).
    turn_one = len(cached.encode("def quicksort(arr):")) + len(first)
    assert cached_tokens == turn_one - 1 and uncached_tokens == 0
    assert second == fresh(tiny_qwen2_dir, draft, method).generate(prompt, GREEDY, method=method).token_ids


def test_draft_model_reads_only_the_new_tokens_on_the_second_turn(
    tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dec = fresh(tiny_qwen2_dir, tiny_close_draft_dir, "draft")
    draft_seq = dec.drafters["draft"].model
    fed: list[tuple[int, int]] = []  # (start, rows) of every draft pass
    original = draft_seq.extend

    def counting(tokens: torch.Tensor, start: int, **kwargs):
        fed.append((start, tokens.shape[1]))
        return original(tokens, start, **kwargs)

    monkeypatch.setattr(draft_seq, "extend", counting)
    first_prompt = dec.encode("def quicksort(arr):")
    first = dec.generate(first_prompt, GREEDY)
    fed.clear()
    second_prompt = first_prompt + first.token_ids + dec.encode("\n# again\n")
    dec.generate(second_prompt, GREEDY)
    catch_up_start, catch_up_rows = fed[0]
    # The draft's first pass of turn 2 starts where its cache of turn 1 ended, inside turn 1's answer.
    assert catch_up_start >= len(first_prompt) and catch_up_start + catch_up_rows == len(second_prompt)
    assert catch_up_rows < len(second_prompt) - len(first_prompt)



def test_a_request_without_the_draft_model_in_between_leaves_it_nothing_stale(
    tiny_qwen2_dir: Path, tiny_close_draft_dir: Path
) -> None:
    """The engine's shared prefix counts against the target's previous request; when that one was
    an ngram request, the draft model's cache still follows the one before, with other tokens.
    The drafter checks the prompt against its own record, so it drafts as a fresh decoder does
    (greedy drafts are deterministic: the same cache gives the same proposals and acceptance).
    Before the fix it kept the old request's K/V and its acceptance under a grammar fell to 0."""
    prompt = "The quick brown fox jumps over"
    dec = fresh(tiny_qwen2_dir, tiny_close_draft_dir, "draft")
    dec.generate("def quicksort(arr):", GREEDY, method="draft")  # the draft cache: this request
    other = dec.generate(prompt, GREEDY, method="ngram")  # the target's record: this one
    turn = dec.encode(prompt) + other.token_ids
    after = dec.generate(turn, GREEDY, method="draft", k=3)
    alone = fresh(tiny_qwen2_dir, tiny_close_draft_dir, "draft").generate(turn, GREEDY, method="draft", k=3)
    assert after.token_ids == alone.token_ids
    assert after.stats.draft_tokens_accepted == alone.stats.draft_tokens_accepted
    assert after.stats.draft_tokens_proposed == alone.stats.draft_tokens_proposed

def test_a_whole_cached_prompt_still_computes_its_last_token(tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir, None, "none")
    prompt = dec.encode("The quick brown fox")
    first = dec.generate(prompt, GREEDY)
    again = dec.generate(prompt, GREEDY)
    assert again.token_ids == first.token_ids
    assert again.stats.cached_tokens == len(prompt) - 1 and again.stats.target_forward_passes == again.stats.verify_steps


def test_a_prefix_is_shared_only_within_its_cache_group(tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir, None, "none")
    prompt = dec.encode("import numpy as np\n\nclass Counter:")
    dec.generate(prompt, GREEDY, cache_salt="tenant-a")
    other = dec.generate(prompt, GREEDY, cache_salt="tenant-b")
    assert other.stats.cached_tokens == 0
    dec.generate(prompt, GREEDY, cache_salt="tenant-a")  # b's request replaced the record
    same = dec.generate(prompt, GREEDY, cache_salt="tenant-a")
    assert same.stats.cached_tokens == len(prompt) - 1


def test_using_the_target_elsewhere_invalidates_the_record(tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir, None, "none")
    prompt = dec.encode("for i in range(10):\n    print(i)\n")
    reference = dec.generate(prompt, GREEDY).token_ids
    greedy_margins(dec, prompt, reference)  # a pass on the engine's own sequence, outside decoding
    after = dec.generate(prompt, GREEDY)
    assert after.stats.cached_tokens == 0 and after.token_ids == reference
    dec.engine.target.pass_seconds([1, 2], 1)  # timing passes overwrite the cache too
    assert dec.generate(prompt, GREEDY).stats.cached_tokens == 0


def test_a_stream_closed_early_leaves_a_usable_prefix(tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir, None, "none")
    prompt = dec.encode("Once upon a time, in a land far away, there lived")
    full = dec.generate(prompt, GREEDY).token_ids
    deltas = iter(dec.stream(prompt, GREEDY))
    next(deltas)
    deltas.close()  # as a stop string or a client that left does
    follow = prompt + full[:5]
    result = dec.generate(follow, GREEDY)
    assert result.stats.cached_tokens >= len(prompt)
    assert result.token_ids == fresh(tiny_qwen2_dir, None, "none", prefix_cache=False).generate(follow, GREEDY).token_ids


def test_a_longer_conversation_grows_the_cache_without_changing_output(tiny_qwen2_dir: Path) -> None:
    """Each turn's prompt outgrows the cache allocated for the one before: the kept prefix is
    copied into the larger cache."""
    dec = fresh(tiny_qwen2_dir, None, "none")
    ref = fresh(tiny_qwen2_dir, None, "none", prefix_cache=False)
    conversation = dec.encode("1, 2, 3, 4, 5,")
    for turn in range(4):
        got = dec.generate(conversation, SamplingParams(max_new_tokens=16 + 8 * turn, ignore_eos=True))
        want = ref.generate(conversation, SamplingParams(max_new_tokens=16 + 8 * turn, ignore_eos=True))
        assert got.token_ids == want.token_ids
        if turn:
            assert got.stats.cached_tokens > 0
        conversation = conversation + got.token_ids + dec.encode(f" turn {turn}:")


def test_greedy_with_the_cache_equals_plain_decoding_on_llamacpp(tiny_ggufs: dict[str, Path]) -> None:
    for method, draft in (("none", None), ("draft", tiny_ggufs["close"])):
        dec = SpecDecoder.from_pretrained(str(tiny_ggufs["target"]), str(draft) if draft else None, method=method,
                                          draft_confidence=0.0, dtype="fp32", backend="llama.cpp", k=3,
                                          show_progress=False, engine="single")
        plain = SpecDecoder.from_pretrained(str(tiny_ggufs["target"]), method="none", dtype="fp32", backend="llama.cpp",
                                            prefix_cache=False, show_progress=False, engine="single")
        prompt, _, second, cached_tokens = two_turns(dec, method)
        assert cached_tokens > 0
        reference = plain.generate(prompt, GREEDY).token_ids
        compared = assert_greedy_equal_up_to_near_tie(second, reference, greedy_margins(plain, prompt, reference),
                                                      f"llama.cpp {method} with the prefix cache")
        assert compared >= len(reference) // 2


def test_sampling_after_a_cached_prefix_follows_the_target(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    """The chi-square test (helpers.py: 1,500 draws, the first 3 tokens at temperature 1 and
    top-k 3, p = 0.001) with every draw after the first reusing the prompt's prefix, which
    another draw's answer shares: method draft, k = 2."""
    dec = fresh(tiny_qwen2_dir, tiny_close_draft_dir, "draft")
    prompt = dec.encode("def quicksort(arr):")
    exact = exact_sequence_distribution(dec, prompt)
    counts: Counter = Counter()
    cached = 0
    for seed in range(DRAWS):
        params = SamplingParams(temperature=1.0, top_k=TOP_K, max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True)
        result = dec.generate(prompt, params, k=2)
        counts[tuple(result.token_ids)] += 1
        cached += result.stats.cached_tokens > 0
    assert cached == DRAWS - 1
    stat, df = pearson(exact, counts)
    assert stat < CHI2_CRITICAL_P001[df], f"chi-square {stat:.1f} with {df} df"


def test_the_flag_turns_it_off(tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir, None, "none", prefix_cache=False)
    prompt = dec.encode("x")
    dec.generate(prompt, GREEDY)
    assert dec.generate(prompt, GREEDY).stats.cached_tokens == 0
    assert replace(dec.config, prefix_cache=True).prefix_cache


def test_two_decoders_over_one_llamacpp_model_never_reuse_each_others_kv(tiny_ggufs: dict[str, Path]) -> None:
    """llama.cpp's memory belongs to the model, not to a decoder's wrapper of it: a request of
    one decoder overwrites what another decoder over the same model had cached."""
    first = SpecDecoder.from_pretrained(str(tiny_ggufs["target"]), method="none", dtype="fp32", backend="llama.cpp",
                                        show_progress=False, engine="single")
    second = SpecDecoder(first.target, None, first.config)
    prompt, other = first.encode("def quicksort(arr):"), first.encode("The quick brown fox")
    reference = first.generate(prompt, GREEDY).token_ids
    second.generate(other, GREEDY)
    again = first.generate(prompt, GREEDY)
    assert again.stats.cached_tokens == 0 and again.token_ids == reference
