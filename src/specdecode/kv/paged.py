"""A paged KV cache: a pool of fixed-size blocks shared by many sequences.

Each model (target, draft) gets one ``PagedKVCache``: per layer, keys and values for
``num_blocks * block_size`` slots, stored as (slots, H_kv, D). A sequence owns a *block table*
(the list of its blocks in order); its token at position p lives in slot
``table[p // block_size] * block_size + p % block_size``. Sequences grow a block at a time and
roll back by lowering their length, which frees every block that became empty: rejected draft
tokens cost no copy, and a finished or cancelled request returns all its blocks at once.

A forward pass reads through ``PagedView`` (``kv/paged_view.py``): built on the host from the block tables of the
sequences in the batch, it maps each new token to its slot (the write) and gathers each row's
visible slots into a contiguous (B, H_kv, kv_len, D) tensor (the read). The gather is a copy of
the batch's visible KV per layer; on this project's CPU it cost 0.5% to 4.6% of a demo-target
pass for 1 to 16 sequences of 200 cached tokens (``python benchmarks/bench_batch.py``), and it
keeps the model's attention code the same as for the static cache. Block 0 is never handed out: padding rows of a ragged batch
write into it and read from it, and the attention mask hides it.

``fork`` starts a new sequence from another's first positions: their blocks are shared
(reference counts) and a partly filled last block is copied on the first write, so n samples of
one prompt (parallel sampling, OpenAI's ``n``) cost one prefill and one block of copying each.

Prefix caching (vLLM's automatic prefix caching, in outline): a full block of committed tokens
is registered under a key of (its parent block's key id, its tokens, the cache group), so a
key names the whole prefix up to the block's end in one group. ``add(seq, tokens, group)`` maps
the longest chain of registered blocks that the new sequence's tokens start with into its
table (reference counts, no copy; never its last token, whose logits it needs) and returns how
many positions that covers. A registered block whose last user leaves stays cached on an LRU
list, counted as free: a block is taken from the empty free list first, then from the least
recently used cached ones (an eviction). Shared and registered blocks are never written: a
sequence writes at or past its committed length, which a registered block lies below, and
``view`` asserts it.

``kv_dtype="int8"`` stores keys and values as int8 (slots, H_kv, D) with one fp32 scale per
(slot, head), quantized as ``kv/static.Int8KVCache`` does: writes quantize, reads dequantize the
gathered slots to the model dtype. The pool holds as many tokens as before in (D + 4) / (2 D)
of the bytes of a bf16/fp16 pool (53% at D = 64), (D + 4) / (4 D) of an fp32 one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specdecode.config import ModelConfig
from specdecode.core.device import host_to_device
from specdecode.core.tree_mask import ancestor_rows, tree_depths
from specdecode.kv.paged_view import PagedView
from specdecode.kv.static import check_kv_dtype

NULL_BLOCK = 0  # never allocated: the write target and read source of padding
DEFAULT_BLOCK_SIZE = 16


class OutOfBlocks(RuntimeError):
    """The pool has too few free blocks for this; the scheduler waits or preempts."""


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def stack_padded(rows: Sequence[torch.Tensor], value: int = 0) -> torch.Tensor:
    """Rows of different lengths (T_b,) as one (B, T_max) tensor, padded at the end with
    ``value``: the token layout of a ragged batch that ``PagedKVCache.view`` describes."""
    width = max(row.shape[0] for row in rows)
    return torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[0]), value=value) for row in rows])


# (parent block's key id or -1, the block's tokens, the cache group): a full block's identity.
BlockKey = tuple[int, tuple[int, ...], str | None]


@dataclass(slots=True)
class PrefixCacheStats:
    hit_tokens: int = 0  # positions served from cached blocks
    queried_tokens: int = 0  # positions looked up (each sequence's tokens but the last)
    evictions: int = 0  # cached blocks taken for new content


@dataclass(slots=True)
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose K/V are valid


class PagedKVCache:
    """Block storage for one model plus every sequence's block table and the free list.

    ``dtype`` is the model's: what reads return (``.dtype``). ``kv_dtype`` (``KV_DTYPES``) is
    what is stored: "auto" that same dtype, "int8" int8 plus scales (module docstring).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_dtype: str = "auto",
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a paged cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = check_kv_dtype(kv_dtype)
        self.compute_dtype = dtype
        quantized = kv_dtype == "int8"
        slots = num_blocks * block_size
        shape = (slots, cfg.num_kv_heads, cfg.head_dim)
        stored = torch.int8 if quantized else dtype
        self.keys = [torch.zeros(shape, dtype=stored, device=device) for _ in range(cfg.num_layers)]
        self.values = [torch.zeros(shape, dtype=stored, device=device) for _ in range(cfg.num_layers)]
        # Ones, not zeros: never-written slots (the null block) then read as finite zeros.
        layers_of_scales = cfg.num_layers if quantized else 0
        self.key_scales = [torch.ones((slots, cfg.num_kv_heads, 1), device=device) for _ in range(layers_of_scales)]
        self.value_scales = [torch.ones((slots, cfg.num_kv_heads, 1), device=device) for _ in range(layers_of_scales)]
        # Lowest ids first, so a fresh pool hands out blocks in order (easier to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))
        self._refs = [0] * num_blocks
        self.tables: dict[int, BlockTable] = {}
        # Prefix caching (module docstring): registered blocks by key and back, and the cached
        # blocks no sequence holds, least recently used first.
        self.prefix_cache = True  # the batch engine turns it off (BatchEngine(prefix_cache=False))
        self._block_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, tuple[BlockKey, int]] = {}  # block -> (its key, its key id)
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._key_ids = 0
        self.prefix_stats = PrefixCacheStats()

    # -- accounting ----------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence may take: empty ones and cached ones no sequence holds."""
        return len(self._free) + len(self._cached_free)

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        """Registered blocks (held or not): what the prefix cache can serve."""
        return len(self._key_of)

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype reads return (int8 storage included)."""
        return self.compute_dtype

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage, scales included."""
        return sum(t.numel() * t.element_size() for tensors in self._storages() for t in tensors)

    def _storages(self) -> list[list[torch.Tensor]]:
        """Every per-layer tensor list indexed by slot: keys, values and (int8) their scales."""
        return [self.keys, self.values, self.key_scales, self.value_scales]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def length(self, seq: int) -> int:
        return self.tables[seq].length

    def fits(self, tokens: int) -> bool:
        """Whether one sequence of ``tokens`` slots fits in the empty pool."""
        return blocks_for(tokens, self.block_size) <= self.usable_blocks

    def capacity_tokens(self) -> int:
        return self.usable_blocks * self.block_size

    def blocks_needed(self, seq: int | None, tokens: int) -> int:
        """Blocks to allocate so that ``seq`` (None: a new sequence) can hold ``tokens`` slots."""
        have = 0 if seq is None or seq not in self.tables else len(self.tables[seq].blocks)
        return max(0, blocks_for(tokens, self.block_size) - have)

    # -- sequence lifecycle ----------------------------------------------------------------
    def add(self, seq: int, tokens: Sequence[int] = (), group: str | None = None) -> int:
        """A new sequence whose committed tokens will be ``tokens``: the longest chain of cached
        blocks they start with (in ``group``) goes into its table, shared; returns the positions
        it covers, whose K/V need no prefill (0 with the prefix cache off)."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq} already has a block table")
        table = self.tables[seq] = BlockTable()
        if not self.prefix_cache or len(tokens) < 2:
            return 0
        size = self.block_size
        parent = -1
        self.prefix_stats.queried_tokens += len(tokens) - 1
        for start in range(0, len(tokens) - 1 - size + 1, size):  # full blocks before the last token
            block = self._block_of.get((parent, tuple(tokens[start : start + size]), group))
            if block is None:
                break
            if self._refs[block] == 0:
                self._cached_free.pop(block)
            self._refs[block] += 1
            table.blocks.append(block)
            parent = self._key_of[block][1]
        table.length = len(table.blocks) * size
        self.prefix_stats.hit_tokens += table.length
        return table.length

    def register(self, seq: int, tokens: Sequence[int], group: str | None = None) -> None:
        """Make ``seq``'s full blocks of valid K/V (``tokens`` are its committed tokens) findable
        by later sequences of ``group``. A block whose content another block already holds
        stays unregistered (freed as usual when its sequence leaves)."""
        if not self.prefix_cache:
            return
        table = self.tables[seq]
        size = self.block_size
        parent = -1
        for index in range(min(table.length, len(tokens)) // size):
            block = table.blocks[index]
            known = self._key_of.get(block)
            if known is not None:
                parent = known[1]
                continue
            key: BlockKey = (parent, tuple(tokens[index * size : (index + 1) * size]), group)
            holder = self._block_of.get(key)
            if holder is not None:
                parent = self._key_of[holder][1]
                continue
            self._key_ids += 1
            self._block_of[key] = block
            self._key_of[block] = (key, self._key_ids)
            parent = self._key_ids

    def drop_cached_prefixes(self) -> None:
        """Forget every registered block (``SpecDecoder.forget_prefix``): later sequences find no
        cached prefix. Cached blocks no sequence holds go back to the empty free list; held ones
        stay with their sequences, unregistered, and are freed as usual when those leave."""
        for block in self._cached_free:
            self._free.append(block)
        self._cached_free.clear()
        self._block_of.clear()
        self._key_of.clear()

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._cached_free:
            block, _ = self._cached_free.popitem(last=False)  # the least recently used
            key, _ = self._key_of.pop(block)
            del self._block_of[key]
            self.prefix_stats.evictions += 1
        else:
            raise OutOfBlocks("no free KV block")
        self._refs[block] = 1
        return block

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._cached_free[block] = None  # most recently used last
            else:
                self._free.append(block)

    def reserve(self, seq: int, tokens: int) -> None:
        """Make room for slots [0, tokens) of ``seq``; all or nothing (raises OutOfBlocks)."""
        table = self.tables[seq]
        needed = self.blocks_needed(seq, tokens)
        if needed > self.free_blocks:
            raise OutOfBlocks(f"sequence {seq} needs {needed} more blocks, {self.free_blocks} are free")
        self._make_last_block_private(table, tokens)
        table.blocks.extend(self._take() for _ in range(needed))

    def _make_last_block_private(self, table: BlockTable, tokens: int) -> None:
        """Copy-on-write: before writing into a shared or registered, partly filled last block, copy it."""
        if not table.blocks or table.length % self.block_size == 0 or tokens <= table.length:
            return
        last = table.blocks[-1]
        # A fork can end inside a block its source filled and registered: that block stays as
        # it is for later requests even when the fork is its only user.
        if self._refs[last] == 1 and last not in self._key_of:
            return
        if not self.free_blocks:
            raise OutOfBlocks("no free KV block for a copy-on-write")
        private = self._take()
        self._copy_block(last, private)
        self._release(last)
        table.blocks[-1] = private

    def _copy_block(self, source: int, dest: int) -> None:
        size = self.block_size
        for tensors in self._storages():
            for storage in tensors:
                storage[dest * size : (dest + 1) * size] = storage[source * size : (source + 1) * size]

    def commit(self, seq: int, length: int) -> None:
        """Declare slots [0, length) valid after a forward wrote them; frees blocks past them."""
        table = self.tables[seq]
        if length > len(table.blocks) * self.block_size:
            raise ValueError(f"length {length} exceeds sequence {seq}'s {len(table.blocks)} reserved blocks")
        table.length = length
        self._trim(table)

    def rollback(self, seq: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq``; blocks that became empty are freed."""
        table = self.tables[seq]
        if not 0 <= length <= table.length:
            raise ValueError(f"cannot roll sequence {seq} back to {length} from {table.length}")
        table.length = length
        self._trim(table)

    def _trim(self, table: BlockTable) -> None:
        keep = blocks_for(table.length, self.block_size)
        while len(table.blocks) > keep:
            self._release(table.blocks.pop())

    def free(self, seq: int, tokens: Sequence[int] = (), group: str | None = None, returning: bool = False) -> None:
        """The sequence ended (finished, cancelled, failed or preempted): return its blocks, its
        full blocks of ``tokens`` (its committed tokens) first registered for ``group``. A
        preempted sequence (``returning``) is treated alike: it finds its blocks again on the LRU
        list while nobody evicted them."""
        if seq in self.tables and tokens:
            self.register(seq, tokens, group)
        table = self.tables.pop(seq, None)
        if table is not None:
            # Tail first: on the LRU list a prefix's later blocks then go before its first ones,
            # which more sequences share (vLLM frees in the same order).
            for block in reversed(table.blocks):
                self._release(block)

    def fork(self, source: int, dest: int, length: int | None = None) -> int:
        """A new sequence ``dest`` that starts from ``source``'s first ``length`` positions (all
        of its committed ones by default, at most those): their blocks are shared, reference
        counted; a partly filled last block is copied by whichever sequence writes into it first
        (``reserve``). Returns the positions ``dest`` starts with."""
        parent = self.tables[source]
        kept = parent.length if length is None else max(0, min(length, parent.length))
        self.add(dest)
        child = self.tables[dest]
        child.blocks = parent.blocks[: blocks_for(kept, self.block_size)]
        for block in child.blocks:
            self._refs[block] += 1
        child.length = kept
        return kept

    # -- views for one forward pass -----------------------------------------------------------
    def _slot(self, table: BlockTable, position: int) -> int:
        return table.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slot_rows(
        self,
        seqs: Sequence[int],
        host_positions: Sequence[Sequence[int]],
        kv_width: int | None = None,
    ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
        """``view``'s host side: each row's positions and write slots padded to the longest row, and
        its visible slots in position order padded to ``kv_width`` (at least the longest row's)."""
        width = max(len(row) for row in host_positions)
        kv_len = max(max(row[-1] for row in host_positions) + 1, kv_width or 0)
        null_slot = NULL_BLOCK * self.block_size
        positions, write_slots, read_slots = [], [], []
        for seq, row in zip(seqs, host_positions, strict=True):
            table = self.tables[seq]
            positions.append(list(row) + [row[-1]] * (width - len(row)))
            for block in {table.blocks[p // self.block_size] for p in row}:
                # A shared or registered block holds another sequence's (or a later one's) K/V.
                assert self._refs[block] == 1 and block not in self._key_of, "a shared KV block is never written"
            write_slots.append([self._slot(table, p) for p in row] + [null_slot] * (width - len(row)))
            visible = row[-1] + 1
            read_slots.append([self._slot(table, p) for p in range(visible)] + [null_slot] * (kv_len - visible))
        return positions, write_slots, read_slots

    def view(
        self,
        seqs: Sequence[int],
        host_positions: Sequence[Sequence[int]],
        sliding_window: int | None = None,
        trees: Sequence[Sequence[int] | None] | None = None,
    ) -> tuple[PagedView, torch.Tensor]:
        """The cache view and the (B, T_max) rotary-position tensor for one forward pass.

        Row b feeds tokens at ``host_positions[b]`` (consecutive, its slots reserved) for
        sequence ``seqs[b]``; shorter rows are padded to the longest: a padding token repeats
        the row's last position, writes into the null block and its output is to be ignored.
        Row b sees its own slots up to each query's position (and the sliding window).

        ``trees[b]`` (a token tree's parents, ``core/tree.py``; None: a plain row) makes row b
        a tree whose root is its first token: node i is written at ``host_positions[b][i]`` as
        usual (the nodes of one pass lie contiguously after the committed ones) but rotated as
        position root + depth(i), and it sees the slots before the root and, among the tree's,
        its own ancestors only (``core/tree_mask.py``). ``keep_path`` then keeps one path.
        """
        positions, write_slots, read_slots = self.slot_rows(seqs, host_positions)
        width, kv_len = len(positions[0]), len(read_slots[0])
        device = self.device
        slot_positions = host_to_device(positions, torch.long, device)  # (B, T): where each token is stored
        key_pos = torch.arange(kv_len, device=device)
        mask = key_pos[None, None, :] <= slot_positions[:, :, None]  # (B, T, kv_len)
        rotary, key_rotary = slot_positions, key_pos[None, :]  # a plain row is rotated where it is stored
        tree_rows = [(b, parents) for b, parents in enumerate(trees or ()) if parents is not None]
        if tree_rows:
            rotary_host = [list(row) for row in positions]
            for b, parents in tree_rows:
                root, size = host_positions[b][0], len(parents)
                if len(host_positions[b]) != size:
                    raise ValueError(f"row {b} feeds {len(host_positions[b])} tokens for a tree of {size} nodes")
                depths = [root + depth for depth in tree_depths(parents)]
                rotary_host[b] = depths + [depths[-1]] * (width - size)
                mask[b, :size, root : root + size] = host_to_device(ancestor_rows(parents), torch.bool, device)
            rotary = host_to_device(rotary_host, torch.long, device)
            if sliding_window is not None:  # a tree's keys sit at its nodes' rotary positions too
                key_rotary = key_pos[None, :].repeat(len(seqs), 1)
                for b, parents in tree_rows:
                    root = host_positions[b][0]
                    key_rotary[b, root : root + len(parents)] = rotary[b, : len(parents)]
        if sliding_window is not None:
            mask &= key_rotary[:, None, :] > rotary[:, :, None] - sliding_window
        view = PagedView(
            cache=self,
            write_slots=host_to_device(write_slots, torch.long, device),
            read_slots=host_to_device(read_slots, torch.long, device),
            kv_len=kv_len,
            mask=mask[:, None],
        )
        return view, rotary

    def keep_path(self, seq: int, root: int, path: Sequence[int]) -> None:
        """Keep one root-to-node path of a tree written at positions [root, root + N) (``view``'s
        ``trees``): node ``path[j]``'s K/V move to position root + j (the caller then commits).
        Nodes come after their parents, so ``path[j] >= j``: all are read before any is written."""
        moves = [(root + node, root + j) for j, node in enumerate(path) if node != j]
        if not moves:
            return
        table = self.tables[seq]
        device = self.device
        sources = host_to_device([self._slot(table, p) for p, _ in moves], torch.long, device)
        dests = host_to_device([self._slot(table, p) for _, p in moves], torch.long, device)
        for tensors in self._storages():
            for storage in tensors:
                storage.index_copy_(0, dests, storage.index_select(0, sources))
