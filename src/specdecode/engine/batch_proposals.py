"""Which rows of the batch draft this step, how many tokens each may, and their proposals:
prompt lookup per row on the host, the draft model for all its rows together."""

from __future__ import annotations

import torch

from specdecode.backends.device import host_to_device
from specdecode.costs.batch_k import BatchRow
from specdecode.drafters.base import DraftProposal
from specdecode.drafters.batch_draft import BatchDraftModel, DraftRow
from specdecode.engine.batch_request import BatchRequest
from specdecode.engine.scheduler import ScheduledSequence

# Below this many tried draft positions a row's estimate is too thin to stop drafting on (one
# rejected first token would read as 40% acceptance): the chooser treats it as unobserved.
MIN_OBSERVED_TRIALS = 3.0


def may_draft(request: BatchRequest) -> bool:
    # A request's first token comes from a plain step: its time to first token never pays
    # for a draft model reading the prompt, nor for a draft step priced on a guessed
    # acceptance while requests sent with it are still arriving.
    return request.method != "none" and request.stats.new_tokens > 0


def max_draft(request: BatchRequest) -> int:
    # A step emits at most k + 1 tokens: never draft past max_new_tokens.
    return max(0, min(request.k, request.remaining - 1))


def plan_row(seq: ScheduledSequence, drafter: BatchDraftModel | None, draft_confidence: float) -> BatchRow:
    """What the batch's draft-length chooser needs to know of one drafting row."""
    request: BatchRequest = seq.state
    backlog = 0
    if request.method == "draft":
        assert drafter is not None
        backlog = drafter.backlog(seq.seq_id, len(request.tokens))
    return BatchRow(request.acceptance.rate, max_draft(request), request.method == "draft", backlog,
                    observed=request.acceptance.trials >= MIN_OBSERVED_TRIALS, remaining=request.remaining,
                    stops_early=request.method == "draft" and draft_confidence > 0)


def forced_drafts(running: list[ScheduledSequence]) -> dict[int, list[int]]:
    """The tokens each structured row's grammar forces next (engine/grammar.py), by seq_id: a
    row with some drafts them this step, whatever its method and k (before the KV reservation,
    which must cover them)."""
    forced = {}
    for seq in running:
        request: BatchRequest = seq.state
        if request.grammar is not None:
            tokens = request.grammar.forced_tokens(request.remaining - 1)  # a step emits drafts + 1
            if tokens:
                forced[seq.seq_id] = tokens
    return forced


def propose(
    running: list[ScheduledSequence],
    wanted: dict[int, int],
    drafter: BatchDraftModel | None,
    draft_confidence: float,
    device: torch.device,
    forced: dict[int, list[int]],
) -> tuple[list[DraftProposal], int, int]:
    """Each row's proposal of up to ``wanted[seq_id]`` tokens (possibly empty), the draft
    model's passes and its rows per pass. A structured row whose grammar forces what comes next
    drafts those tokens instead (``forced`` by seq_id, from ``forced_drafts``)."""
    empty = torch.empty((1, 0), dtype=torch.long, device=device)
    proposals = [DraftProposal(tokens=empty, probs=None) for _ in running]
    model_rows, model_index = [], []
    for index, seq in enumerate(running):
        request: BatchRequest = seq.state
        if seq.seq_id in forced:
            proposals[index] = DraftProposal(tokens=host_to_device([forced[seq.seq_id]], torch.long, device),
                                             probs=None, forced=True)
            continue
        k = wanted[seq.seq_id]
        if k == 0:
            continue
        if request.ngram is not None:
            request.ngram.extend(request.tokens[len(request.ngram.history):])
            match, _ = request.ngram.match(k)
            if match:
                proposals[index] = DraftProposal(tokens=host_to_device([match], torch.long, device), probs=None)
        elif request.method == "draft":
            length = len(request.tokens)
            model_rows.append(DraftRow(seq.seq_id, request.committed[:length], k, request.processor, request.generator,
                                       draft_confidence))
            model_index.append(index)
    passes = 0
    if model_rows:
        assert drafter is not None
        drafted, passes = drafter.propose(model_rows)
        for index, proposal in zip(model_index, drafted, strict=True):
            proposals[index] = proposal
    return proposals, passes, len(model_rows)
