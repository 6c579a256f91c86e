"""Timing forward passes on this machine: the one timing loop every cost table starts from.

The draft-length policies (``k_policy.py``, ``batch_k.py``), the auto method and the Medusa
tree size price a step by measured pass costs, not by a model of the hardware: the same pass
over 1 or 6 rows costs nearly the same on a bandwidth-bound device and six times more on a
compute-bound one. Each timing runs on a scratch cache after ``COST_PROBE_CONTEXT`` cached
positions, so attention reads something, as in decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specdecode.engine.metrics import Stopwatch
from specdecode.kv.static import reusable_cache
from specdecode.models.llama import Transformer

VERIFY_COST_REPEATS = 2
# Row counts a single-sequence verify cost table times (the rest interpolated): dense where a
# pass's cost steps as the kernels change with the row count (ggml's CPU kernels change at a
# few row counts, so a line from 4 to 17 rows would price 6-8 rows well below their cost).
COST_PROBE_ROWS = (1, 2, 4, 6, 8, 12, 16, 24)
COST_PROBE_CONTEXT = 64  # cache slots before the timed rows, so attention has something to read


def best_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Seconds of the least disturbed of ``repeats`` synchronised calls of ``run``, after one
    warm-up call (the first call per shape pays for kernel selection)."""
    samples = []
    for _ in range(repeats + 1):
        with Stopwatch(device, True) as watch:
            run()
        samples.append(watch.elapsed)
    return min(samples[1:])


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
    measured = {}
    for rows in row_counts:
        measured[rows] = best_seconds(
            lambda: model.extend(scratch, tokens[:, :rows], COST_PROBE_CONTEXT, logits_last=logits_last, layers=layers),
            model.device, repeats,
        )
    return measured
