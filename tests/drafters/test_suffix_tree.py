"""Suffix decoding's data structures on hand-made sequences: the suffix tree's counts against a
brute-force count of every run (token by token, interleaved, after removals), the longest match,
frequency ranking, draft limits, incremental drafts equal to rebuilt ones, and the cache's token
budget, LRU eviction and groups."""

import random
import tracemalloc
from collections import Counter

import pytest

from specdecode.drafters.suffix_cache import MAX_OPEN_RESPONSES, SuffixCache
from specdecode.drafters.suffix_tree import SuffixTree
from specdecode.errors import InvalidRequestError


def brute_counts(sequences: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """Every run of at most ``depth`` tokens starting anywhere, and how often it occurs."""
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for length in range(1, min(depth, len(seq) - start) + 1):
                counts[tuple(seq[start : start + length])] += 1
    return dict(counts)


def draft_of(tree: SuffixTree, context: list[int], **limits) -> tuple[list[int], list[int], list[float], int]:
    settings = {"max_nodes": 16, "max_depth": 8, "min_prob": 0.0, "max_match": tree.max_depth - 1} | limits
    draft = tree.draft(context, **settings)
    return draft.tokens, draft.parents, [round(p, 9) for p in draft.probs], draft.match_len


@pytest.mark.parametrize("seed", range(4))
def test_counts_equal_a_brute_force_count_through_any_history(seed: int) -> None:
    # Random sequences over tiny vocabularies (so runs repeat and nodes split and fuse), some
    # copied from others (long repeats), grown a few tokens at a time in any order, closed and
    # removed along the way: after every operation the tree holds exactly the runs of the live
    # sequences with their counts.
    rng = random.Random(seed)
    for _ in range(40):
        depth, vocab = rng.randint(2, 10), rng.choice([1, 2, 3, 5])
        tree = SuffixTree(depth)
        live: dict[int, list[int]] = {}
        growing: set[int] = set()
        for _ in range(rng.randint(5, 40)):
            roll = rng.random()
            source = rng.choice(list(live.values())) if live else []
            at = rng.randrange(len(source) + 1)
            if roll < 0.15 or not live:
                tokens = source[at : at + rng.randint(0, 30)] if rng.random() < 0.5 else []
                seq_id = tree.add_sequence(tokens)
                live[seq_id] = list(tokens)
                growing.add(seq_id)
            elif roll < 0.25:
                seq_id = rng.choice(list(live))
                tree.remove(seq_id)
                del live[seq_id]
                growing.discard(seq_id)
            elif roll < 0.3 and growing:
                seq_id = rng.choice(list(growing))
                tree.close(seq_id)
                growing.discard(seq_id)
            elif growing:
                seq_id = rng.choice(list(growing))
                copied = source[at : at + rng.randint(1, 8)]
                tokens = copied if copied and rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
                tree.extend(seq_id, tokens)
                live[seq_id] += tokens
            assert tree.counts() == brute_counts(list(live.values()), depth)
            assert tree.num_tokens == sum(map(len, live.values()))
        for seq_id in list(live):
            tree.remove(seq_id)
        assert tree.num_nodes == 0 and tree.counts() == {} and tree.num_tokens == 0


def test_a_repeat_costs_few_nodes() -> None:
    # Path compression: a second copy of a long novel sequence adds a handful of nodes per
    # position, not one per position and depth (here 24 x 400 without it).
    rng = random.Random(0)
    text = [rng.randrange(1000, 5000) for _ in range(400)]
    tree = SuffixTree(24)
    tree.add_sequence(text)
    before = tree.num_nodes
    tree.add_sequence(text)
    assert tree.num_nodes - before < 3 * len(text)
    assert tree.counts() == brute_counts([text, text], 24)


@pytest.mark.parametrize(
    "sequences, context, max_len, expected",
    [
        ([[1, 2, 3, 4, 1, 2, 3, 5]], [9, 1, 2, 3], 8, 3),  # "1 2 3" occurred (twice, with 4 and 5 after)
        ([[1, 2, 3, 1, 2]], [1, 2], 8, 2),  # the later "1 2" ends the sequence; the earlier one goes on
        ([[5, 6, 7]], [8, 6], 8, 1),  # only "6" matches
        ([[5, 6, 7]], [1, 2], 8, 0),  # nothing matches
        ([[1, 2, 3, 4, 1, 2, 3, 5]], [9, 1, 2, 3], 2, 2),  # at most max_len tokens
        ([[4, 4, 4, 4]], [4, 4, 4, 4], 8, 3),  # the whole context only ends the sequence
    ],
)
def test_longest_match_with_a_continuation(sequences: list[list[int]], context: list[int], max_len: int, expected: int) -> None:
    tree = SuffixTree(8)
    for seq in sequences:
        tree.add_sequence(seq)
    found = tree.match(context, max_len)
    assert (found[1] if found else 0) == expected


@pytest.mark.parametrize("seed", range(3))
def test_longest_match_equals_a_brute_force_search(seed: int) -> None:
    # The match is binary-searched over lengths; a brute-force scan of every suffix against every
    # stored run (with a token after it, within the depth bound) must agree on random histories
    # with repeats, sequences removed, and a growing sequence whose own end matches nothing.
    rng = random.Random(seed)
    for _ in range(60):
        depth, vocab = rng.randint(2, 12), rng.choice([2, 3, 5])
        tree = SuffixTree(depth)
        live: dict[int, list[int]] = {}
        for _ in range(rng.randint(1, 5)):
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
            live[tree.add_sequence(tokens)] = tokens
        if len(live) > 1 and rng.random() < 0.5:
            gone = rng.choice(list(live))
            tree.remove(gone)
            del live[gone]
        runs = brute_counts(list(live.values()), depth)
        for _ in range(10):
            context = [rng.randrange(vocab) for _ in range(rng.randint(1, 15))]
            max_len = rng.randint(1, depth)
            want = max((n for n in range(1, min(max_len, len(context)) + 1)
                        if any(tuple(context[-n:]) + (t,) in runs for t in range(vocab))), default=0)
            found = tree.match(context, max_len)
            assert (found[1] if found else 0) == want, (context, max_len, live)


def test_children_ranked_by_frequency_and_path_probabilities() -> None:
    # After "1 2": 3 twice, 4 once; after "1 2 3": 7 then 8 (once each).
    tree = SuffixTree(8)
    tree.add_sequence([1, 2, 3, 7, 1, 2, 4, 1, 2, 3, 8, 1, 2])
    tokens, parents, probs, match_len = draft_of(tree, [1, 2], max_depth=2)
    assert match_len == 2
    assert tokens == [3, 4, 7, 8, 1] and parents == [-1, -1, 0, 0, 1]  # best first; ties: the earlier found
    assert probs == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    # A chain follows the most frequent child at each step (ties: the lower token id).
    assert draft_of(tree, [1, 2], max_depth=3, branching=1)[:2] == ([3, 7, 1], [-1, 0, 1])


def test_draft_limits() -> None:
    tree = SuffixTree(16)
    tree.add_sequence([1, 2, 3, 7, 1, 2, 4, 1, 2, 3, 8, 1, 2])
    assert draft_of(tree, [1, 2], max_depth=2, min_prob=0.5)[0] == [3]  # 4, 7 and 8 are below 0.5
    assert draft_of(tree, [1, 2], max_depth=2, max_nodes=2)[0] == [3, 4]
    assert draft_of(tree, [1, 2], max_depth=1)[0] == [3, 4]
    # The paper's rule: at most spec_factor x the match length deep.
    assert max(_depths(draft_of(tree, [2], max_depth=5, spec_factor=1.0)[1])) == 1
    assert max(_depths(draft_of(tree, [1, 2], max_depth=5, spec_factor=1.0)[1])) == 2
    assert draft_of(tree, [9], max_depth=5) == ([], [], [], 0)


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def test_paths_end_at_the_depth_bound() -> None:
    tree = SuffixTree(6)
    tree.add_sequence(list(range(20)) * 2)
    tokens, parents, _, match_len = draft_of(tree, list(range(10)), max_depth=10, max_match=3)
    assert match_len == 3 and tokens == [10, 11, 12]  # 3 matched + 3 drafted = the bound of 6
    assert _depths(parents) == [1, 2, 3]


def test_incremental_drafts_equal_rebuilt_drafts() -> None:
    # Two sequences grown token by token, interleaved: at every step a tree rebuilt from the
    # whole sequences drafts exactly what the incrementally built one drafts.
    rng = random.Random(3)
    base = [rng.randrange(6) for _ in range(30)]
    first, second = base + base[:20], [rng.randrange(6) for _ in range(10)] + base[5:30]
    growing = SuffixTree(10)
    ids = (growing.add_sequence(), growing.add_sequence())
    for end in range(1, max(len(first), len(second)) + 1):
        for seq_id, seq in zip(ids, (first, second), strict=True):
            if end <= len(seq):
                growing.extend(seq_id, seq[end - 1 : end])
        rebuilt = SuffixTree(10)
        rebuilt.add_sequence(first[:end])
        rebuilt.add_sequence(second[:end])
        for context in (first[:end], second[:end]):
            assert draft_of(growing, context) == draft_of(rebuilt, context)


def test_memory_bytes_is_close_to_what_the_heap_holds() -> None:
    rng = random.Random(1)
    words = [rng.randrange(300, 2000) for _ in range(50)]
    text = [rng.choice(words) for _ in range(3000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tree = SuffixTree(24)
        tree.add_sequence(text)
        tree.add_sequence(text[1000:2500])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert tree.memory_bytes() == pytest.approx(held, rel=0.15)


# ---------------------------------------------------------------- the cache of responses


def write(cache: SuffixCache, group: str, tokens: list[int]):
    handle = cache.open(group)
    cache.append(handle, tokens)
    return handle


def cache_draft(cache: SuffixCache, group: str, context: list[int]) -> list[int]:
    return cache.draft(group, context, max_nodes=8, max_depth=4, min_prob=0.0, max_match=8, branching=1).tokens


def test_token_budget_evicts_the_least_recently_used_response() -> None:
    cache = SuffixCache(max_tokens=10, max_depth=8)
    write(cache, "", [1, 2, 3, 4])
    write(cache, "", [5, 6, 7, 8])
    assert cache_draft(cache, "", [1, 2]) == [3, 4]  # reading the first response uses it
    write(cache, "", [9, 10, 11, 12])  # 12 tokens > 10: the least recently used goes
    assert cache_draft(cache, "", [5, 6]) == []
    assert cache_draft(cache, "", [1, 2]) == [3, 4] and cache_draft(cache, "", [9, 10]) == [11, 12]
    assert cache.stats().tokens == 8 and cache.stats().responses == 2


def test_responses_are_written_as_they_grow_and_stop_when_closed() -> None:
    cache = SuffixCache(max_tokens=100, max_depth=8)
    handle = write(cache, "", [1, 2])
    cache.append(handle, [3])
    assert cache_draft(cache, "", [1]) == [2, 3]
    cache.close(handle)
    cache.append(handle, [4])  # a closed response takes no more tokens
    assert cache_draft(cache, "", [1]) == [2, 3] and cache.stats().tokens == 3


def test_groups_never_read_each_other() -> None:
    cache = SuffixCache(max_tokens=100, max_depth=8)
    write(cache, "tenant:a", [1, 2, 3])
    assert cache_draft(cache, "tenant:a", [1]) == [2, 3]
    assert cache_draft(cache, "tenant:b", [1]) == [] and cache_draft(cache, "", [1]) == []
    assert cache.stats().groups == 1


def test_an_evicted_group_is_dropped_and_open_responses_are_bounded() -> None:
    cache = SuffixCache(max_tokens=4, max_depth=8)
    write(cache, "a", [1, 2, 3, 4])
    write(cache, "b", [5, 6, 7, 8])
    assert cache.stats().groups == 1 and cache_draft(cache, "a", [1]) == []
    many = SuffixCache(max_tokens=10_000, max_depth=8)
    handles = [write(many, "", [i, i + 1]) for i in range(MAX_OPEN_RESPONSES + 3)]
    many.append(handles[0], [99])  # the least recently written responses were closed
    many.append(handles[-1], [99])
    assert many.stats().tokens == 2 * len(handles) + 1


def test_a_cache_of_zero_tokens_keeps_nothing() -> None:
    cache = SuffixCache(max_tokens=0)
    assert cache.open("") is None and not cache.enabled
    with pytest.raises(InvalidRequestError, match="suffix_cache_tokens"):
        SuffixCache(max_tokens=-1)
