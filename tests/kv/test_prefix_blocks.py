"""Prefix caching in the paged pool (kv/paged.py): full blocks registered under (parent, tokens,
group), shared by reference, kept on an LRU list when free, never written while shared, and
forgotten all at once by ``drop_cached_prefixes``."""

import pytest
import torch
from test_paged_cache import small_pool

BLOCK = 4
TOKENS = list(range(100, 113))  # 13 tokens: 3 full blocks (12) plus one


def filled(pool, seq: int, tokens: list[int], group: str | None = None) -> int:
    """Add ``seq`` with ``tokens``, "prefill" all but the last and register them; returns the cached positions."""
    kept = pool.add(seq, tokens, group)
    pool.reserve(seq, len(tokens))
    pool.commit(seq, len(tokens) - 1)
    pool.register(seq, tokens, group)
    return kept


def test_a_second_sequence_shares_the_full_blocks_by_reference() -> None:
    pool = small_pool(num_blocks=12, block_size=BLOCK)
    assert filled(pool, 0, TOKENS) == 0
    first_blocks = list(pool.tables[0].blocks)
    # 12 valid positions -> 3 full blocks registered; the second sequence needs its last token (12) computed.
    assert pool.add(1, TOKENS) == 12
    assert pool.tables[1].blocks == first_blocks[:3] and pool.tables[1].length == 12
    assert all(pool._refs[b] == 2 for b in first_blocks[:3])
    assert pool.prefix_stats.hit_tokens == 12 and pool.cached_blocks == 3


def test_the_last_token_is_always_computed_and_a_divergence_stops_the_chain() -> None:
    pool = small_pool(num_blocks=12, block_size=BLOCK)
    filled(pool, 0, TOKENS)
    assert pool.add(1, TOKENS[:12]) == 8  # the whole prompt is cached: its last block is recomputed
    diverged = TOKENS[:5] + [7] + TOKENS[6:]
    assert pool.add(2, diverged) == 4  # block 2 differs at position 5: only block 1 is shared
    assert pool.add(3, [1] + TOKENS[1:]) == 0


def test_groups_never_share() -> None:
    pool = small_pool(num_blocks=12, block_size=BLOCK)
    filled(pool, 0, TOKENS, group="tenant-a")
    assert pool.add(1, TOKENS, "tenant-b") == 0
    assert pool.add(2, TOKENS, None) == 0
    assert pool.add(3, TOKENS, "tenant-a") == 12


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_used_first() -> None:
    pool = small_pool(num_blocks=9, block_size=BLOCK)  # 8 usable blocks
    old, new = list(range(9)), list(range(50, 59))  # two full blocks each
    filled(pool, 0, old)
    filled(pool, 1, new)
    pool.free(0, old)
    pool.free(1, new)
    assert pool.free_blocks == pool.usable_blocks and pool.cached_blocks == 4  # cached, yet free
    pool.add(2)
    pool.reserve(2, 4 * 5)  # 5 blocks: the 4 empty ones, then the least recently used cached one
    assert pool.prefix_stats.evictions == 1
    # Freed tail first, so old's second block went first: its first block is still shared.
    assert pool.add(3, old) == 4
    assert pool.add(4, new) == 8  # the recently used prefix is whole


def test_a_shared_block_is_never_written() -> None:
    pool = small_pool(num_blocks=12, block_size=BLOCK)
    filled(pool, 0, TOKENS)
    pool.add(1, TOKENS)
    pool.reserve(1, 13)
    pool.view([1], [[12]])  # past the shared blocks: fine
    with pytest.raises(AssertionError, match="never written"):
        pool.view([1], [[11]])  # inside the third shared block


def test_rollback_inside_and_past_a_shared_prefix() -> None:
    pool = small_pool(num_blocks=12, block_size=BLOCK)
    filled(pool, 0, TOKENS)
    pool.add(1, TOKENS)
    pool.reserve(1, 16)
    pool.commit(1, 15)
    pool.rollback(1, 13)  # past the prefix: only private blocks change
    assert pool.tables[1].blocks[:3] == pool.tables[0].blocks[:3]
    pool.rollback(1, 6)  # inside it: the reference to the third shared block is dropped, nothing written
    assert len(pool.tables[1].blocks) == 2 and pool._refs[pool.tables[0].blocks[2]] == 1
    assert pool.add(2, TOKENS) == 12  # the first sequence's blocks are intact


def test_shared_content_is_the_content_written() -> None:
    pool = small_pool(num_blocks=12, block_size=BLOCK)
    filled(pool, 0, TOKENS)
    for layer in range(len(pool.keys)):
        pool.keys[layer][:] = torch.arange(pool.keys[layer].numel(), dtype=torch.float32).reshape(pool.keys[layer].shape)
    pool.add(1, TOKENS)
    slots = [pool._slot(pool.tables[1], p) for p in range(12)]
    assert slots == [pool._slot(pool.tables[0], p) for p in range(12)]


def test_the_cache_off_behaves_as_before() -> None:
    pool = small_pool(num_blocks=12, block_size=BLOCK)
    pool.prefix_cache = False
    filled(pool, 0, TOKENS)
    assert pool.add(1, TOKENS) == 0 and pool.cached_blocks == 0
    pool.free(0, TOKENS)
    pool.free(1, TOKENS)
    assert pool.free_blocks == pool.usable_blocks and pool.prefix_stats.evictions == 0


def test_a_paged_pool_drops_its_cached_prefixes_and_keeps_its_sequences() -> None:
    """``drop_cached_prefixes`` (``SpecDecoder.forget_prefix``): free cached blocks go back to the
    empty free list (taking them later is no eviction); a running sequence's registered blocks
    stay its own, unregistered, and are freed when it leaves."""
    pool = small_pool(num_blocks=12, block_size=BLOCK)
    other = [token + 50 for token in TOKENS]
    filled(pool, 0, TOKENS)
    filled(pool, 1, other)  # running, its 3 full blocks registered
    pool.free(0, TOKENS)  # cached, free
    held = list(pool.tables[1].blocks)
    assert pool.cached_blocks == 6
    free_before = pool.free_blocks
    pool.drop_cached_prefixes()
    assert pool.cached_blocks == 0 and pool.free_blocks == free_before
    assert pool.add(2, TOKENS) == 0 and pool.add(3, other) == 0  # nothing found
    assert pool.tables[1].blocks == held and pool.tables[1].length == len(other) - 1
    for seq in (1, 2, 3):
        pool.free(seq)
    assert pool.free_blocks == pool.usable_blocks and pool.prefix_stats.evictions == 0
