"""One forward pass's window into a paged KV pool (``kv/paged.py``).

``PagedKVCache.view`` builds it on the host from the batch's block tables; the model then uses it
as both its cache and its view: ``write`` scatters each new token's K/V to its slot, ``read``
gathers each row's visible slots into a contiguous (B, H_kv, kv_len, D) tensor. An int8 pool
is quantized on the write and dequantized on the read with ``kv/static.py``'s functions, so
it returns exactly what ``Int8KVCache`` returns for the same K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.kv.static import Int8KVCache, KVView, dequantize


class SlotStorage(Protocol):
    """What a view writes and reads: ``PagedKVCache``'s per-layer tensors indexed by slot (a
    protocol, so that this module need not import the pool that imports it)."""

    keys: list[torch.Tensor]  # per layer (slots, H_kv, D): the model dtype, or int8
    values: list[torch.Tensor]
    key_scales: list[torch.Tensor]  # per layer (slots, H_kv, 1) fp32; empty unless int8
    value_scales: list[torch.Tensor]
    kv_dtype: str

    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(slots=True)
class PagedView(KVView):
    """One pass's window into a ``PagedKVCache``; the model uses it as its cache and view.

    write_slots: (B, T) long, the slot each new token's K/V goes to (padding: the null block).
    read_slots:  (B, kv_len) long, row b's visible slots in position order (padding: null).
    mask:        (B, 1, T, kv_len) bool, inherited from ``KVView``.
    """

    cache: SlotStorage | None = None  # the PagedKVCache
    write_slots: torch.Tensor | None = None
    read_slots: torch.Tensor | None = None

    def write(
        self,
        layer: int,
        positions: torch.Tensor,  # (B, T) long; the slots were resolved when the view was built
        keys: torch.Tensor,  # (B, H_kv, T, D)
        values: torch.Tensor,  # (B, H_kv, T, D)
        contiguous_start: int | None = None,
    ) -> None:
        cache = self.cache
        assert cache is not None and self.write_slots is not None
        slots = self.write_slots.reshape(-1)
        heads, dim = keys.shape[1], keys.shape[3]
        pairs = ((cache.keys, cache.key_scales, keys), (cache.values, cache.value_scales, values))
        for storage, scales, new in pairs:
            rows = new.transpose(1, 2).reshape(-1, heads, dim)  # (B * T, H_kv, D), in write_slots order
            if cache.kv_dtype == "int8":
                rows, scale = Int8KVCache.quantize(rows)  # (B * T, H_kv, D) int8, (B * T, H_kv, 1)
                scales[layer].index_copy_(0, slots, scale)
            storage[layer].index_copy_(0, slots, rows)

    def read(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row b's visible keys and values: two (B, H_kv, kv_len, D) tensors."""
        cache = self.cache
        assert cache is not None and self.read_slots is not None
        keys = cache.keys[layer][self.read_slots]  # (B, kv_len, H_kv, D)
        values = cache.values[layer][self.read_slots]
        if cache.kv_dtype == "int8":  # gather the int8 slots first: a quarter of an fp32 copy
            keys = dequantize(keys, cache.key_scales[layer][self.read_slots], cache.dtype)
            values = dequantize(values, cache.value_scales[layer][self.read_slots], cache.dtype)
        return keys.transpose(1, 2), values.transpose(1, 2)
