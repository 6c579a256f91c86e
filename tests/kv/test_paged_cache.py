"""The paged KV cache: block accounting, rollback, fork with copy-on-write, and attention
through block tables equal to the static cache's."""

from pathlib import Path

import pytest
import torch
from helpers import decoder

from specdecode.core.tree import TokenTree
from specdecode.kv.paged import NULL_BLOCK, OutOfBlocks, PagedKVCache
from specdecode.kv.static import KVCache, tree_view


def small_pool(num_blocks: int = 9, block_size: int = 4) -> PagedKVCache:
    from specdecode.config import ModelConfig

    cfg = ModelConfig(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128,
                      tie_word_embeddings=False, attention_bias=False)
    return PagedKVCache(cfg, num_blocks, torch.float32, "cpu", block_size)


def test_blocks_are_taken_per_block_and_rollback_frees_emptied_blocks() -> None:
    pool = small_pool()
    assert pool.free_blocks == pool.usable_blocks == 8
    pool.add(0)
    pool.reserve(0, 9)  # 9 slots of 4 -> 3 blocks
    assert pool.used_blocks == 3 and NULL_BLOCK not in pool.tables[0].blocks
    pool.commit(0, 9)
    pool.rollback(0, 5)  # blocks 0, 1 still hold tokens; the third became empty
    assert pool.used_blocks == 2 and pool.length(0) == 5
    pool.rollback(0, 4)
    assert pool.used_blocks == 1
    with pytest.raises(ValueError):
        pool.rollback(0, 6)  # cannot roll forward
    pool.free(0)
    assert pool.free_blocks == 8 and 0 not in pool.tables


def test_reserve_is_all_or_nothing_when_blocks_run_out() -> None:
    pool = small_pool()
    pool.add(0)
    pool.reserve(0, 20)  # 5 blocks
    pool.add(1)
    with pytest.raises(OutOfBlocks):
        pool.reserve(1, 16)  # needs 4, 3 are free
    assert pool.used_blocks == 5 and pool.tables[1].blocks == []
    pool.reserve(1, 12)
    assert pool.free_blocks == 0
    pool.free(0)
    pool.free(1)
    assert pool.free_blocks == 8


def test_fork_shares_blocks_and_copies_a_shared_block_before_writing() -> None:
    pool = small_pool()
    pool.add(0)
    pool.reserve(0, 6)
    pool.commit(0, 6)
    pool.keys[0][:] = 0
    for position in range(6):  # mark each slot with its position
        pool.keys[0][pool._slot(pool.tables[0], position)] = float(position)
    pool.fork(0, 1)
    assert pool.tables[1].blocks == pool.tables[0].blocks and pool.used_blocks == 2  # nothing copied yet
    pool.reserve(1, 7)  # the child writes position 6 into the shared, partly filled block
    assert pool.tables[1].blocks[0] == pool.tables[0].blocks[0]  # the full block stays shared
    assert pool.tables[1].blocks[1] != pool.tables[0].blocks[1] and pool.used_blocks == 3
    child_slot = pool._slot(pool.tables[1], 5)
    assert pool.keys[0][child_slot].eq(5.0).all()  # the copy kept the prefix
    pool.keys[0][pool._slot(pool.tables[1], 6)] = -1.0
    assert pool.keys[0][pool._slot(pool.tables[0], 5)].eq(5.0).all()  # the parent is untouched
    pool.free(0)
    assert pool.used_blocks == 2  # the child still holds the shared block and its copy
    pool.free(1)
    assert pool.free_blocks == 8


def test_paged_attention_equals_the_static_cache(tiny_qwen2_dir: Path) -> None:
    """Three sequences in a fragmented pool (blocks interleaved, one rolled back and regrown),
    decoded in one padded batch: every row's logits equal a static-cache decode of that row."""
    model = decoder(tiny_qwen2_dir, None, "none").target.model
    cfg = model.config
    torch.manual_seed(0)
    lengths = [11, 3, 7]
    prompts = [torch.randint(0, cfg.vocab_size, (n + 3,)) for n in lengths]
    pool = PagedKVCache(cfg, 20, model.dtype, model.device, block_size=4)
    with torch.inference_mode():
        for seq in range(3):
            pool.add(seq)
        # Prefill one token at a time, round robin, so the sequences' blocks interleave.
        for position in range(max(lengths)):
            for seq, n in enumerate(lengths):
                if position < n:
                    pool.reserve(seq, position + 1)
                    view, pos = pool.view([seq], [[position]])
                    model(prompts[seq][None, position : position + 1], pos, view, view, compute_logits=False)
                    pool.commit(seq, position + 1)
        pool.rollback(0, 6)  # drop 5 tokens of sequence 0 and write them again (new blocks)
        pool.reserve(0, 11)
        view, pos = pool.view([0], [list(range(6, 11))])
        model(prompts[0][None, 6:11], pos, view, view, compute_logits=False)
        pool.commit(0, 11)
        # One padded pass: rows of 3, 1 and 2 new tokens.
        news = [3, 1, 2]
        rows = [list(range(n, n + m)) for n, m in zip(lengths, news)]
        for seq, row in enumerate(rows):
            pool.reserve(seq, row[-1] + 1)
        view, pos = pool.view([0, 1, 2], rows)
        tokens = torch.stack([torch.nn.functional.pad(p[n : n + m], (0, 3 - m)) for p, n, m in zip(prompts, lengths, news)])
        batched = model(tokens, pos, view, view).logits
        for seq, (n, m) in enumerate(zip(lengths, news)):
            static = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, 32, model.dtype, model.device)
            expected = model.extend(static, prompts[seq][None, : n + m], 0).logits[0, n : n + m]
            torch.testing.assert_close(batched[seq, :m], expected, rtol=1e-4, atol=1e-4)
    for seq in range(3):
        pool.free(seq)
    assert pool.free_blocks == pool.usable_blocks


def test_fork_of_a_prefix_shares_its_blocks_and_copies_a_registered_one_before_writing() -> None:
    """A fork of the first 5 positions of a 7-token sequence (blocks of 4): one full block and a
    partly used one shared; once the source has left, the second block is registered in the
    prefix cache, so the fork copies it before writing although it is its only user."""
    pool = small_pool()
    tokens = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    pool.add(0, tokens[:8])
    pool.reserve(0, 8)
    pool.commit(0, 8)
    for position in range(8):
        pool.keys[0][pool._slot(pool.tables[0], position)] = float(position)
    assert pool.fork(0, 1, 5) == 5 and pool.fork(0, 2, 50) == 8  # at most the source's length
    assert pool.tables[1].blocks == pool.tables[0].blocks and pool.tables[1].length == 5
    pool.free(0, tokens[:8])  # registers both full blocks of the source
    pool.free(2)
    shared = pool.tables[1].blocks[1]
    pool.reserve(1, 6)
    assert pool.tables[1].blocks[1] != shared  # copied: the registered block keeps its content
    assert pool.keys[0][pool._slot(pool.tables[1], 4)].eq(4.0).all()
    assert pool.add(3, tokens) == 8  # both registered blocks still serve a later request
    pool.free(1)
    pool.free(3)
    assert pool.free_blocks == pool.usable_blocks


@pytest.mark.parametrize("window", [None, 3])
def test_a_tree_row_sees_what_the_single_sequence_tree_view_sees(window: int | None) -> None:
    """A tree row of a paged pass (root at position 3, beside a plain row) gets the mask and
    rotary positions of ``kv/static.tree_view`` for the same tree, sliding window included."""
    parents = [-1, 0, 0, 1, 1, 2, 3]  # depths 0, 1, 1, 2, 2, 2, 3
    tree = TokenTree(parents, torch.zeros(len(parents), dtype=torch.long), [False] * len(parents))
    pool = small_pool()
    for seq in (0, 1):
        pool.add(seq)
        pool.reserve(seq, 3 + len(parents))
    view, rotary = pool.view([0, 1], [list(range(3, 10)), [3, 4]], sliding_window=window, trees=[parents, None])
    want = tree_view(tree, 3, "cpu", window)
    assert torch.equal(view.mask[0, 0, :, : want.kv_len], want.mask[0, 0])
    assert rotary[0].tolist() == tree.positions(3, "cpu")[0].tolist()
    assert rotary[1, :2].tolist() == [3, 4]  # the plain row: stored where it is rotated
