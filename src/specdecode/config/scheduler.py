"""How the continuous-batching engine shares its batch between requests: ``SchedulerConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import InvalidRequestError

# The batch engine's sharing of seats and steps between requests (engine/scheduler.py).
DEFAULT_PREFILL_CHUNK = 512  # llama-server's default micro-batch; ~4 s of the demo target on 2 CPU cores
DEFAULT_TIME_SLICE = 16  # decode steps
DEFAULT_SPARE_SLOTS = 2


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """How the continuous-batching engine shares the batch between requests, so that a request's
    first token never waits for other requests to finish (docs/design.md#fair-scheduling).

    ``prefill_chunk``: the most prompt tokens prefilled in one step, over every request being
      prefilled (shortest remaining first); a longer prompt is prefilled over several steps
      while the batch keeps decoding. 0: whole prompts in one pass.
    ``time_slice``: decode steps a request keeps its batch seat once admitted. When the batch is
      full and a waiting request has taken part in at least ``time_slice`` fewer steps than a
      running one that has run ``time_slice`` steps since it was admitted, that one is preempted
      (its K/V stay cached) and the waiting one takes its seat. 0: never preempt for fairness.
    ``spare_slots``: llama.cpp only: sequence slots beyond ``max_batch`` per context, each of
      the same size, where a preempted request's K/V stay until it returns (and a finished
      one's, for the prefix cache). Without one, fairness cannot preempt on llama.cpp (a
      preempted request would have to recompute its whole context). Paged torch pools keep a
      preempted request's blocks on their LRU list instead.
    """

    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    time_slice: int = DEFAULT_TIME_SLICE
    spare_slots: int = DEFAULT_SPARE_SLOTS

    def __post_init__(self) -> None:
        for name in ("prefill_chunk", "time_slice", "spare_slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidRequestError(f"{name} must be an integer >= 0, got {value!r}.")
