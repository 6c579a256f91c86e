"""A static KV cache, written by position.

Each layer has a preallocated key and value tensor of shape (B, H_kv, S_max, D). A forward
pass writes the keys/values of its tokens at their positions; attention then reads the first
``kv_len`` slots. Because writes go by position, rolling back rejected draft tokens is just
lowering a sequence's length: the stale slots are never visible to a query (causality only
lets a query at position p see keys at positions <= p, all of which were rewritten on the
current path) and the next step overwrites them.

The cache keeps per-sequence lengths on the host: they decide positions and the attention
width, and keeping them off the device avoids a device-to-host sync per layer.

``Int8KVCache`` stores keys and values as int8 with one scale per (token, head): half the
bytes of a bf16 cache. Writes quantize, reads dequantize the visible slots; rollback is the
same length bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdecode.config import KV_DTYPES, ModelConfig
from specdecode.core.device import host_to_device
from specdecode.core.tree import TokenTree
from specdecode.errors import InvalidRequestError

INT8_MAX = 127


@dataclass(slots=True)
class KVView:
    """What one forward pass may read from the cache.

    kv_len: keys/values in slots [0, kv_len) are read.
    mask:   (B, 1, T, kv_len) bool, True where a query may attend; None means every one of the
            kv_len slots is visible to every query (a single-token step of a single sequence).
    """

    kv_len: int
    mask: torch.Tensor | None


class KVCache:
    """Per-layer key/value storage for a batch of sequences with their own lengths."""

    kv_dtype = "auto"  # storage kind (``KV_DTYPES``); reads always return ``dtype``

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        # Number of valid (committed) tokens per sequence; host-side on purpose.
        self.lengths: list[int] = [0] * batch_size

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def fits(self, batch_size: int, capacity: int, dtype: torch.dtype, device: torch.device) -> bool:
        """True when this cache can be reused for a request of that size."""
        return (
            self.batch_size == batch_size
            and self.capacity >= capacity
            and self.dtype == dtype
            and self.device == torch.device(device)
        )

    def reset(self) -> None:
        """Forget every sequence (no zeroing needed: slots are rewritten before being read)."""
        self.lengths = [0] * self.batch_size

    def rollback(self, seq: int, length: int) -> None:
        """Keep the first ``length`` tokens of sequence ``seq`` and drop the rest."""
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot roll sequence {seq} back to {length} from {self.lengths[seq]}")
        self.lengths[seq] = length

    def commit(self, seq: int, length: int) -> None:
        """Declare the first ``length`` slots of sequence ``seq`` valid after a forward wrote them."""
        if length > self.capacity:
            raise ValueError(f"length {length} exceeds the cache capacity {self.capacity}")
        self.lengths[seq] = length

    def write(
        self,
        layer: int,
        positions: torch.Tensor,  # (B, T) long: slot of each new token
        keys: torch.Tensor,  # (B, H_kv, T, D)
        values: torch.Tensor,  # (B, H_kv, T, D)
        contiguous_start: int | None = None,
    ) -> None:
        """Store new keys/values at their positions.

        ``contiguous_start`` is a host-side hint that every sequence writes slots
        [start, start + T): then a slice copy suffices, otherwise an index_put scatters them.
        """
        self._store(self.keys[layer], positions, keys, contiguous_start)
        self._store(self.values[layer], positions, values, contiguous_start)

    @staticmethod
    def _store(
        storage: torch.Tensor,  # (B, H_kv, S_max, D') one layer's keys, values or their scales
        positions: torch.Tensor,  # (B, T) long
        new: torch.Tensor,  # (B, H_kv, T, D')
        contiguous_start: int | None,
    ) -> None:
        if contiguous_start is not None:
            storage[:, :, contiguous_start : contiguous_start + new.shape[2]].copy_(new)
            return
        batch_index = torch.arange(positions.shape[0], device=positions.device)[:, None]
        # Advanced indices on dims 0 and 2 put the (B, T) index dims first: (B, T, H_kv, D').
        storage[batch_index, :, positions] = new.transpose(1, 2)

    def _storages(self) -> list[list[torch.Tensor]]:
        """Every per-layer tensor list indexed by slot (keys, values and any scales)."""
        return [self.keys, self.values]

    def keep_path(self, seq: int, start: int, nodes: Sequence[int]) -> None:
        """Keep one root-to-node path of a token tree scored at slots [start, start + N).

        A tree verify pass writes node j at slot start + j; the accepted path ``nodes``
        (root first, so nodes[0] == 0) must end up at slots start, start + 1, ... as a
        sequence. One index copy per stored tensor moves them; the other nodes' slots are
        simply left behind to be overwritten, as rejected chain drafts are. The caller
        commits the new length.
        """
        if list(nodes) == list(range(len(nodes))):
            return  # already in place (a chain, or the first branch all along)
        device = self.keys[0].device
        source = host_to_device([start + node for node in nodes], torch.long, device)
        for tensors in self._storages():
            for storage in tensors:
                storage[seq, :, start : start + len(nodes)] = storage[seq, :, source]

    def read(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots [0, kv_len): two (B, H_kv, kv_len, D) views."""
        return self.keys[layer][:, :, :kv_len], self.values[layer][:, :, :kv_len]


class Int8KVCache(KVCache):
    """A KV cache stored as int8 with a per-(token, head) scale; reads return ``dtype``.

    Symmetric absmax rounding per head vector: the error of each key/value element is at most
    half a step, max|vector| / 254. Attention then runs on the dequantized slots as usual.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__(num_layers, batch_size, num_kv_heads, head_dim, capacity, torch.int8, device)
        scale_shape = (batch_size, num_kv_heads, capacity, 1)
        self.key_scales = [torch.ones(scale_shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.value_scales = [torch.ones(scale_shape, dtype=torch.float32, device=device) for _ in range(num_layers)]
        self.compute_dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    def _storages(self) -> list[list[torch.Tensor]]:
        return [self.keys, self.values, self.key_scales, self.value_scales]

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: (B, H, T, D) or any (..., D)
        """int8 values (B, H, T, D) and fp32 scales (B, H, T, 1): one scale per last-dim vector,
        so the paged pool quantizes its (slots, H_kv, D) rows with it alike."""
        x32 = x.float()
        scale = x32.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
        return torch.round(x32 / scale).to(torch.int8), scale

    def write(
        self,
        layer: int,
        positions: torch.Tensor,  # (B, T) long
        keys: torch.Tensor,  # (B, H_kv, T, D)
        values: torch.Tensor,  # (B, H_kv, T, D)
        contiguous_start: int | None = None,
    ) -> None:
        for store, scales, x in ((self.keys, self.key_scales, keys), (self.values, self.value_scales, values)):
            q, scale = self.quantize(x)
            self._store(store[layer], positions, q, contiguous_start)
            self._store(scales[layer], positions, scale, contiguous_start)

    def read(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of slots [0, kv_len): two (B, H_kv, kv_len, D) tensors."""
        keys = dequantize(self.keys[layer][:, :, :kv_len], self.key_scales[layer][:, :, :kv_len], self.compute_dtype)
        values = dequantize(
            self.values[layer][:, :, :kv_len], self.value_scales[layer][:, :, :kv_len], self.compute_dtype
        )
        return keys, values


def dequantize(
    stored: torch.Tensor,  # (..., D) int8, as ``Int8KVCache.quantize`` made it
    scales: torch.Tensor,  # (..., 1) fp32, its scales
    dtype: torch.dtype,
) -> torch.Tensor:  # (..., D) dtype
    """``Int8KVCache.quantize`` undone in ``dtype``; the paged pool (``kv/paged.py``) reads through
    it too, so both caches return the very same values for the same written K/V."""
    return stored.to(dtype) * scales.to(dtype)


def check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise InvalidRequestError(f"kv_dtype={kv_dtype!r} is not one of: {', '.join(KV_DTYPES)}.")
    return kv_dtype


def reusable_cache(
    cache: KVCache | None,
    cfg: ModelConfig,
    capacity: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_dtype: str = "auto",
    keep: int = 0,
) -> KVCache:
    """``cache`` for a batch-1 request of ``capacity`` tokens: the same one if it fits, else a new
    one; either way its first ``keep`` slots (a cached prefix, valid in ``cache``) stay valid and
    the rest is dropped. A new cache copies the kept slots over: one copy of the prefix's K/V,
    far cheaper than recomputing it."""
    cache_class = Int8KVCache if kv_dtype == "int8" else KVCache
    if keep:
        assert cache is not None and keep <= cache.lengths[0], "keep only what the cache holds"
    if cache is not None and cache.kv_dtype == kv_dtype and cache.fits(1, capacity, dtype, device):
        cache.reset()
        cache.commit(0, keep)
        return cache
    fresh = cache_class(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, capacity, dtype, device)
    if keep:
        assert cache is not None
        for old_tensors, new_tensors in zip(cache._storages(), fresh._storages(), strict=True):
            for old, new in zip(old_tensors, new_tensors, strict=True):
                new[:, :, :keep].copy_(old[:, :, :keep])
        fresh.commit(0, keep)
    return fresh


def causal_view(
    positions: torch.Tensor,  # (B, T) long, on the model's device
    host_positions: list[list[int]],
    sliding_window: int | None = None,
) -> KVView:
    """Attention for tokens at ``positions`` over a cache laid out by position.

    A query at position p sees the keys at positions <= p (and > p - window when the model
    uses a sliding window). ``host_positions`` is the same data on the host, so the width is
    known without a device sync.
    """
    kv_len = max(max(row) for row in host_positions) + 1
    single_query = len(host_positions) == 1 and len(host_positions[0]) == 1
    if single_query and (sliding_window is None or kv_len <= sliding_window):
        return KVView(kv_len=kv_len, mask=None)
    key_pos = torch.arange(kv_len, device=positions.device)
    query_pos = positions[:, :, None]  # (B, T, 1)
    mask = key_pos[None, None, :] <= query_pos
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > query_pos - sliding_window
    return KVView(kv_len=kv_len, mask=mask[:, None])  # (B, 1, T, kv_len)


def fixed_view(
    positions: torch.Tensor,  # (B, T) long, on the model's device
    width: int,
    sliding_window: int | None = None,
) -> KVView:
    """Attention over the first ``width`` slots, masked by position on the device.

    ``causal_view`` builds its mask from host positions and skips it for a single query; a
    compiled pass may not branch on its inputs, so the mask always comes from ``positions``
    and hides every slot past each query (stale or never written). ``width`` may exceed the
    furthest position (a CUDA graph reads the whole cache: one shape for the whole sequence)
    or be symbolic (a CPU graph compiled once for every width). What a query sees is what it
    sees with ``causal_view``.
    """
    key_pos = torch.arange(width, device=positions.device)
    query_pos = positions[:, :, None]  # (B, T, 1)
    mask = key_pos[None, None, :] <= query_pos
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > query_pos - sliding_window
    return KVView(kv_len=width, mask=mask[:, None])  # (B, 1, T, width)


def tree_view(tree: TokenTree, start: int, device: torch.device | str, sliding_window: int | None = None) -> KVView:
    """Attention of one verify pass that writes the tree's nodes into slots [start, start + N).

    Every node sees the committed slots [0, start) and, among the tree's slots, itself and its
    ancestors. With a sliding window a node at position p also sees only keys at positions
    > p - window, where committed slot s has position s and tree slot start + j has position
    start + depth(j) (slots and positions differ inside the tree).
    """
    size = tree.size
    committed = torch.ones((size, start), dtype=torch.bool, device=device)
    mask = torch.cat([committed, tree.ancestor_mask(device)], dim=1)  # (N, start + N)
    if sliding_window is not None:
        query_pos = tree.positions(start, device)[0]  # (N,)
        key_pos = torch.cat([torch.arange(start, device=device), query_pos])  # (start + N,)
        mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    return KVView(kv_len=start + size, mask=mask[None, None])  # (1, 1, N, start + N)
