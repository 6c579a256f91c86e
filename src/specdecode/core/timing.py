"""Timing forward passes on this machine: the one timing loop every cost table starts from.

The draft-length policies (``k_policy.py``, ``batch_k.py``), the auto method and the Medusa
tree size price a step by measured pass costs, not by a model of the hardware: the same pass
over 1 or 6 rows costs nearly the same on a bandwidth-bound device and six times more on a
compute-bound one. Each timing runs on a scratch cache after ``COST_PROBE_CONTEXT`` cached
positions, so attention reads something, as in decoding.

A timing taken while other work loads the cores is wrong by any factor (issue 50: a draft pass
stored at 2.70 s that takes 22.6 ms on the same machine when it is quiet), and a stored table
outlives the load that skewed it. So each timing also says whether it *settled*: whether its
repeats agreed (``Timing``); one that does not is re-timed a bounded number of times, and if it
never settles the cost store keeps it out of the stored table (``costs/store.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

VERIFY_COST_REPEATS = 2
# Row counts a single-sequence verify cost table times (the rest interpolated): dense where a
# pass's cost steps as the kernels change with the row count (ggml's CPU kernels change at a
# few row counts, so a line from 4 to 17 rows would price 6-8 rows well below their cost).
COST_PROBE_ROWS = (1, 2, 4, 6, 8, 12, 16, 24)
COST_PROBE_CONTEXT = 64  # cache slots before the timed rows, so attention has something to read


# The statistic that says a timing ran on a busy machine: the median of its repeats over their
# minimum. On a quiet machine the repeats of one pass agree within ~10-20% (a thread waking late);
# when other work competes for the cores, each repeat's time depends on when the scheduler lets it
# run (llama.cpp's threads spin-wait for each other, so one descheduled thread stalls the pass),
# and the repeats disagree by integer factors. Over 1.5x, the median repeat lost a third of its
# time to something else.
BUSY_SPREAD = 1.5
# Spread below this many seconds is no evidence of load: timer and scheduler jitter (a page
# fault, a wake-up) adds tens to hundreds of microseconds whatever the pass, a large ratio on a
# sub-millisecond pass, and mispricing such a pass costs less than timing it again.
NOISE_FLOOR_SECONDS = 1e-3
# Rounds of repeats after the first when the spread says busy: bounds the cost of timing on a
# machine that stays busy at three times a quiet machine's.
BUSY_RETIMES = 2


class Timing(float):
    """Seconds of a timed pass (the best repeat) that also says whether its repeats agreed.

    A float, so that every backend's ``pass_seconds`` passes it on unchanged; the cost store
    reads ``settled`` to keep unsettled timings out of the stored table. Arithmetic on it gives
    a plain float (an interpolated cost is no measurement).
    """

    settled: bool
    spread: float  # median repeat over the best, in the last round timed

    def __new__(cls, seconds: float, settled: bool = True, spread: float = 1.0) -> Timing:
        timing = super().__new__(cls, seconds)
        timing.settled = settled
        timing.spread = spread
        return timing


def is_settled(seconds: float) -> bool:
    """Whether a timed figure may be stored as this machine's cost: a plain float (given, or
    read from the store) counts as settled."""
    return getattr(seconds, "settled", True)


def busy_spread(samples: Sequence[float]) -> float:
    """The median of ``samples`` over their minimum (1.0 when they agree), or 1.0 where their
    difference is under ``NOISE_FLOOR_SECONDS``, which no load is needed to explain."""
    best, median = min(samples), statistics.median(samples)
    if median - best < NOISE_FLOOR_SECONDS or best <= 0.0:
        return 1.0
    return median / best


def best_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> Timing:
    """Seconds of the least disturbed of ``repeats`` synchronised calls of ``run``, after one
    warm-up call (the first call per shape pays for kernel selection).

    Where the repeats disagree by more than ``BUSY_SPREAD`` (the machine was busy), up to
    ``BUSY_RETIMES`` more rounds are timed; the result is the best repeat of all rounds, settled
    if any round's repeats agreed.
    """

    def timed() -> float:
        with Stopwatch(device, True) as watch:
            run()
        return watch.elapsed

    timed()  # warm-up
    best = float("inf")
    spread = 1.0
    for _ in range(1 + BUSY_RETIMES):
        samples = [timed() for _ in range(repeats)]
        best = min(best, *samples)
        spread = busy_spread(samples)
        if spread <= BUSY_SPREAD:
            return Timing(best, settled=True, spread=spread)
    return Timing(best, settled=False, spread=spread)


class Stopwatch:
    """Wall time of a code region.

    On an asynchronous device (CUDA) the time of queued kernels lands in whichever region
    next waits for them, unless ``sync`` is set: then the region synchronises on entry and
    exit (precise split, two extra syncs per region). On the CPU every op is synchronous.
    """

    def __init__(self, device: torch.device, sync: bool = False) -> None:
        self.sync = sync and device.type == "cuda"
        self._start = 0.0
        self.elapsed = 0.0

    def __enter__(self) -> Stopwatch:
        if self.sync:
            torch.cuda.synchronize()
        self._start = time.perf_counter()
        self.elapsed = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self.elapsed = time.perf_counter() - self._start
