"""The int8 paged pool: it stores what ``Int8KVCache`` stores (same quantization, scales carried
through fork's copy-on-write, rollback and keep_path), a batch model over it scores tokens as the
single-request int8 path does, and it holds the same tokens in about half a bf16 pool's bytes."""

from pathlib import Path

import pytest
import torch
from helpers import decoder

from specdecode.backends.torch_backend import TorchSequence
from specdecode.backends.torch_batch import PagedBatchModel
from specdecode.config import ModelConfig
from specdecode.errors import InvalidRequestError
from specdecode.kv.paged import PagedKVCache
from specdecode.kv.paged_view import PagedView
from specdecode.kv.static import Int8KVCache

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 2, 2, 8, 4


def config(head_dim: int = HEAD_DIM) -> ModelConfig:
    return ModelConfig(
        model_type="llama",
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_layers=LAYERS,
        num_heads=2,
        num_kv_heads=KV_HEADS,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=False,
    )


class Written:
    """The K/V written to one sequence, by position: (LAYERS, 2, 1, H_kv, length, D)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.kv = torch.zeros((LAYERS, 2, 1, KV_HEADS, 0, HEAD_DIM), dtype=dtype)

    def rolled_back(self, length: int) -> "Written":
        self.kv = self.kv[..., :length, :]
        return self

    def then(self, new: torch.Tensor) -> None:  # new: (LAYERS, 2, 1, H_kv, T, D), appended
        self.kv = torch.cat([self.kv, new], dim=-2)


def fresh_kv(tokens: int, dtype: torch.dtype, rows: int = 1) -> torch.Tensor:  # -> (LAYERS, 2, rows, H_kv, T, D)
    # Spread magnitudes, so that scales differ from token to token and head to head.
    return (
        torch.randn((LAYERS, 2, rows, KV_HEADS, tokens, HEAD_DIM)) * torch.rand((1, 1, rows, KV_HEADS, tokens, 1)) * 5
    ).to(dtype)


def write(
    pool: PagedKVCache,
    seqs: list[int],
    rows: list[list[int]],  # row b's positions; shorter rows are padded (the null block)
    kv: torch.Tensor,  # (LAYERS, 2, B, H_kv, T_max, D): keys then values
) -> None:
    """One pass of ``PagedView.write`` over the rows, every layer; then the rows are committed."""
    for seq, row in zip(seqs, rows):
        pool.reserve(seq, row[-1] + 1)
    view, positions = pool.view(seqs, rows)
    for layer in range(LAYERS):
        view.write(layer, positions, kv[layer, 0], kv[layer, 1])
    for seq, row in zip(seqs, rows):
        pool.commit(seq, row[-1] + 1)


def assert_reads_as_int8_cache(pool: PagedKVCache, seq: int, written: Written) -> None:
    """``PagedView.read`` of the sequence's slots equals ``Int8KVCache.read`` of the same K/V, bit for bit."""
    length = written.kv.shape[-2]
    assert pool.length(seq) == length
    slots = torch.tensor([[pool._slot(pool.tables[seq], p) for p in range(length)]])
    view = PagedView(kv_len=length, mask=None, cache=pool, read_slots=slots)
    static = Int8KVCache(LAYERS, 1, KV_HEADS, HEAD_DIM, length, pool.dtype, "cpu")
    for layer in range(LAYERS):
        static.write(layer, torch.arange(length)[None], written.kv[layer, 0], written.kv[layer, 1], contiguous_start=0)
        for got, want in zip(view.read(layer, length), static.read(layer, length), strict=True):
            assert got.dtype == pool.dtype
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_int8_reads_equal_the_int8_cache_through_fork_rollback_and_keep_path(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    pool = PagedKVCache(config(), 12, dtype, "cpu", BLOCK, kv_dtype="int8")
    parent, child = Written(dtype), Written(dtype)
    pool.add(0)
    kv = fresh_kv(7, dtype)
    write(pool, [0], [list(range(7))], kv)  # the second block holds 3 of 4
    parent.then(kv)
    assert_reads_as_int8_cache(pool, 0, parent)

    pool.fork(0, 1)
    child.then(parent.kv)
    shared = pool.tables[1].blocks[1]
    kv = fresh_kv(1, dtype)
    write(pool, [1], [[7]], kv)  # copy-on-write of the shared, partly filled block: scales too
    child.then(kv)
    assert pool.tables[1].blocks[1] != shared
    kv = fresh_kv(1, dtype)
    write(pool, [0], [[7]], kv)  # the parent writes its own position 7 in place
    parent.then(kv)
    assert_reads_as_int8_cache(pool, 0, parent)
    assert_reads_as_int8_cache(pool, 1, child)

    pool.rollback(0, 3)  # drop 5 and write 6 others in their place: new blocks past the first
    parent.rolled_back(3)
    kv = fresh_kv(6, dtype)
    write(pool, [0], [list(range(3, 9))], kv)
    parent.then(kv)
    assert_reads_as_int8_cache(pool, 0, parent)

    # One padded pass of both: a token for the parent (its other two are padding, sent to the
    # null block) and a tree of 3 nodes for the child, of which the path [0, 2] stays.
    kv = fresh_kv(3, dtype, rows=2)
    write(pool, [0, 1], [[9], [8, 9, 10]], kv)
    parent.then(kv[:, :, :1, :, :1])
    pool.keep_path(1, 8, [0, 2])
    pool.rollback(1, 10)
    child.then(kv[:, :, 1:, :, [0, 2]])
    assert_reads_as_int8_cache(pool, 0, parent)
    assert_reads_as_int8_cache(pool, 1, child)
    pool.free(0)
    pool.free(1)
    assert pool.free_blocks == pool.usable_blocks


def test_a_batch_model_over_an_int8_pool_scores_as_the_single_request_int8_path(tiny_qwen2_dir: Path) -> None:
    """Two prompts prefilled in one padded pass, then three passes of one and two tokens per row:
    every row's logits equal ``TorchSequence(model, "int8")``'s for its own tokens."""
    model = decoder(tiny_qwen2_dir, None, "none").target.model
    torch.manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,)) for n in (9, 5)]
    batch = PagedBatchModel.with_pool(model, 64, block_size=BLOCK, kv_dtype="int8")
    plain = PagedBatchModel.with_pool(model, 64, block_size=BLOCK)
    singles = [TorchSequence(model, "int8") for _ in prompts]
    with torch.inference_mode():
        feeds, starts = list(prompts), [0, 0]
        for step in range(4):
            for pool_model in (batch, plain):
                for seq, (feed, start) in enumerate(zip(feeds, starts)):
                    if step == 0:
                        pool_model.pool.add(seq)
                    pool_model.pool.reserve(seq, start + feed.shape[0])
            got = batch.forward([0, 1], feeds, starts)  # (2, T_max, V)
            unquantized = plain.forward([0, 1], feeds, starts)
            assert not torch.allclose(got, unquantized, atol=1e-4)  # the pool did quantize
            for seq, (feed, start, single) in enumerate(zip(feeds, starts, singles)):
                if step == 0:
                    single.begin(32)
                want = single.extend(feed[None], start).logits[0]  # (T, V)
                # Not bit for bit: a padded batch runs matmuls and attention of other shapes (here
                # up to 4e-6 apart); the stored K/V are identical (the test above).
                torch.testing.assert_close(got[seq, : feed.shape[0]], want, rtol=0, atol=1e-5)
                single.commit(start + feed.shape[0])
                for pool_model in (batch, plain):
                    pool_model.commit(seq, start + feed.shape[0])
            starts = [start + feed.shape[0] for feed, start in zip(feeds, starts)]
            picked = got.argmax(-1)  # (2, T_max): any tokens do; rows of two and one (padded) next
            feeds = [picked[0, :2], picked[1, :1]]


def test_int8_pool_holds_the_same_tokens_in_about_half_a_bf16_pools_bytes() -> None:
    cfg = config(head_dim=64)
    bf16 = PagedKVCache(cfg, 9, torch.bfloat16, "cpu", 16)
    int8 = PagedKVCache(cfg, 9, torch.bfloat16, "cpu", 16, kv_dtype="int8")
    assert int8.capacity_tokens() == bf16.capacity_tokens() == 128
    assert int8.dtype == bf16.dtype == torch.bfloat16  # what reads return
    assert int8.keys[0].dtype == torch.int8 and int8.key_scales[0].dtype == torch.float32
    # Per (slot, head): D int8 bytes + one fp32 scale against 2 D bytes.
    assert int8.nbytes / bf16.nbytes == pytest.approx((64 + 4) / (2 * 64))
    assert int8.nbytes < 0.55 * bf16.nbytes
    with pytest.raises(InvalidRequestError, match="kv_dtype"):
        PagedKVCache(cfg, 9, torch.bfloat16, "cpu", 16, kv_dtype="fp8")


def test_with_pool_keeps_the_token_capacity_for_int8(tiny_qwen2_dir: Path) -> None:
    model = decoder(tiny_qwen2_dir, None, "none").target.model
    plain = PagedBatchModel.with_pool(model, 64, block_size=BLOCK)
    int8 = PagedBatchModel.with_pool(model, 64, block_size=BLOCK, kv_dtype="int8")
    assert int8.pool.capacity_tokens() == plain.pool.capacity_tokens()
    head_dim = model.config.head_dim  # fp32 model: (D + 4) of 4 D bytes per (slot, head)
    assert int8.pool.nbytes / plain.pool.nbytes == pytest.approx((head_dim + 4) / (4 * head_dim))
