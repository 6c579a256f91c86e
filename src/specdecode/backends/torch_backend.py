"""The torch backend: our ``Transformer`` and a static KV cache written by position.

Rollback is free: ``commit`` lowers the cache's length and the stale slots are overwritten
before any query reads them. The model and the cache stay reachable (``model``, ``cache``)
for what only this backend can do: token trees scored with tree attention (the engine's tree
step), the layer-skip drafter drafting in the target's own cache, hidden states for heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.core.timing import COST_PROBE_CONTEXT, VERIFY_COST_REPEATS, best_seconds
from specdecode.core.tree import TokenTree
from specdecode.kv.static import KVCache, reusable_cache, tree_view
from specdecode.models.llama import ModelOutput, Transformer


class TorchSequence:
    backend = "torch"
    supports_trees = True  # extend_tree and keep_path: token trees with tree attention
    merges_prefill = True

    def __init__(self, model: Transformer, kv_dtype: str = "auto") -> None:
        self.model = model
        self.kv_dtype = kv_dtype  # "int8" stores the cache quantized (kv.static.Int8KVCache)
        self.cache: KVCache | None = None
        self.epoch = 0  # sequences begun and scratch passes run (backends/base.py)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def begin(self, capacity: int, keep: int = 0) -> None:
        cfg = self.model.config
        self.cache = reusable_cache(self.cache, cfg, capacity, self.model.dtype, self.model.device, self.kv_dtype, keep)
        self.epoch += 1

    def extend(
        self,
        tokens: torch.Tensor,  # (1, T) long
        start: int,
        *,
        logits_last: int | None = None,
        compute_logits: bool = True,
    ) -> ModelOutput:
        assert self.cache is not None, "begin() a sequence first"
        return self.model.extend(self.cache, tokens, start, logits_last=logits_last, compute_logits=compute_logits)

    def extend_tree(self, tree: TokenTree, start: int) -> ModelOutput:
        """Score every node of ``tree`` (its root at position ``start``, the last committed token)
        in one pass with tree attention; node j's K/V go to slot start + j."""
        assert self.cache is not None, "begin() a sequence first"
        positions = tree.positions(start, self.device)
        view = tree_view(tree, start, self.device, self.model.config.sliding_window)
        return self.model(tree.tokens[None], positions, self.cache, view, contiguous_start=start)

    def keep_path(self, start: int, path: Sequence[int]) -> None:
        """Keep one root-to-node path of the tree scored at ``start`` as the sequence (the caller commits)."""
        assert self.cache is not None, "begin() a sequence first"
        self.cache.keep_path(0, start, path)

    def commit(self, length: int) -> None:
        assert self.cache is not None, "begin() a sequence first"
        self.cache.commit(0, length)

    def pass_seconds(self, row_counts: Sequence[int], repeats: int, logits_last: int | None = None) -> dict[int, float]:
        self.epoch += 1  # timed on a scratch cache; counted all the same, as the protocol says
        return time_passes(self.model, row_counts, self.kv_dtype, repeats, logits_last=logits_last)


@torch.inference_mode()
def time_passes(
    model: Transformer,
    row_counts: Sequence[int],
    kv_dtype: str = "auto",
    repeats: int = VERIFY_COST_REPEATS,
    logits_last: int | None = None,
    layers: Sequence[int] | None = None,
) -> dict[int, float]:
    """Seconds of one forward pass of ``model`` over each row count (best of ``repeats``).

    Runs on a scratch cache of the kind decoding uses (int8 KV included). ``logits_last=1``
    times a catch-up pass (logits for the last row only); ``layers`` a pass through those
    layers only (layer skip).
    """
    cfg = model.config
    max_rows = max(row_counts)
    scratch = reusable_cache(None, cfg, COST_PROBE_CONTEXT + max_rows, model.dtype, model.device, kv_dtype)
    tokens = torch.zeros((1, max_rows), dtype=torch.long, device=model.device)
    measured: dict[int, float] = {}
    for rows in row_counts:
        measured[rows] = best_seconds(
            lambda: model.extend(scratch, tokens[:, :rows], COST_PROBE_CONTEXT, logits_last=logits_last, layers=layers),
            model.device, repeats,
        )
    return measured
