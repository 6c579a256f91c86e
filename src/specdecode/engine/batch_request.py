"""What the batch engine keeps per request, what a step hands back for it, and the sampling
generator snapshots a failed step is rerun from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdecode.config import SamplingParams
from specdecode.costs.k_policy import AcceptanceEstimate
from specdecode.drafters.auto_row import AutoRow
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine.grammar import GrammarState
from specdecode.engine.logprobs import TokenLogprob
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.sampling import LogitsProcessor
from specdecode.engine.scheduler import ScheduledSequence


@dataclass(slots=True)
class RequestOutput:
    """What one step did for one request."""

    request_id: str
    new_tokens: list[int]
    finished: bool
    stats: GenerationStats
    error: BaseException | None = None


@dataclass(slots=True, eq=False)
class BatchRequest:
    """One request's state inside the batch engine (the scheduler's ``ScheduledSequence.state``)."""

    request_id: str
    params: SamplingParams
    method: str
    k: int  # the most tokens this request lets a step draft
    processor: LogitsProcessor
    generator: torch.Generator | None
    tokens: list[int]  # committed, host
    committed: torch.Tensor  # (capacity,) long, device: the same tokens
    stats: GenerationStats
    started: float
    # The acceptance of its drafter's drafts (a row that picks its source: the draft model's;
    # its lookups keep their own scores, drafters/auto_row.py).
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    ngram: NgramDrafter | SuffixDrafter | AutoRow | None = None  # a host-side drafter: lookups (engine/batch_rows.py)
    sources: AutoRow | None = None  # the same object as ``ngram`` where the row picks its source every step
    grammar: GrammarState | None = None  # structured output: the matcher over committed tokens
    # The last verify pass's logprobs of this row's emitted tokens (SamplingParams.logprobs),
    # kept by the commit that follows it.
    step_logprobs: list[TokenLogprob] | None = None

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.stats.new_tokens


def generator_states(running: list[ScheduledSequence]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """Each sampling row's generator and its state (a few KiB on the host), to rerun a step from."""
    requests: list[BatchRequest] = [seq.state for seq in running]
    return [(r.generator, r.generator.get_state()) for r in requests if r.generator is not None]


def restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in states:
        generator.set_state(state)
