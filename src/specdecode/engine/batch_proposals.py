"""Which rows of the batch draft this step, how many tokens each may, and their proposals:
prompt lookup per row on the host, the draft model for all its rows together, the target with
layers skipped for all its rows together, EAGLE heads for all their rows together (one head
pass per tree level), Medusa heads per row (one pass each). A row that picks
its source every step (method auto, ``drafters/auto_row.py``) offers its options here and is
told its choice once the batch's k is known (``choose_sources``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.core.device import host_to_device
from specdecode.core.tree import TokenTree
from specdecode.costs.batch_k import BatchK, BatchRow, RowChoices, uses_model
from specdecode.drafters.base import DraftProposal
from specdecode.drafters.batch_draft import BatchDraftModel, DraftRow
from specdecode.drafters.batch_layer_skip import BatchLayerSkip
from specdecode.drafters.eagle import EagleDrafter, propose_together
from specdecode.engine.batch_request import BatchRequest
from specdecode.engine.grammar import GrammarState, first_forbidden
from specdecode.engine.scheduler import ScheduledSequence

# Below this many tried draft positions a row's estimate is too thin to stop drafting on (one
# rejected first token would read as 40% acceptance): the chooser treats it as unobserved.
MIN_OBSERVED_TRIALS = 3.0


def may_draft(seq: ScheduledSequence) -> bool:
    """Whether a row may draft this step. Even a request's first token may be speculated (its
    drafts ride in the pass that feeds its prompt's last token; on llama.cpp its prompt's last
    chunk too), but not by the draft model (``model_may_draft``)."""
    request: BatchRequest = seq.state
    return request.method != "none" and (request.sources is not None or not seq.uses_draft or model_may_draft(seq))


def model_may_draft(seq: ScheduledSequence) -> bool:
    """Whether the draft model may draft for this row this step: not for its first token,
    whose time would then pay for the draft model reading the whole prompt first (measured: a
    priced-out draft model's re-try on a turn's first step made it 1.96 s, 4x the others)."""
    return seq.uses_draft and seq.state.stats.new_tokens > 0


def max_draft(request: BatchRequest) -> int:
    # A step emits at most k + 1 tokens: never draft past max_new_tokens. A row with its own
    # schedule (a fixed or threshold k policy) drafts what it says this step.
    k = request.schedule.next_k() if request.schedule is not None else request.k
    return max(0, min(k, request.remaining - 1))


def drafts_with_model(seq: ScheduledSequence) -> bool:
    """Whether the draft model drafts for this row this step (a row that picks its source: if
    it picked the model)."""
    request: BatchRequest = seq.state
    return model_may_draft(seq) and (request.sources is None or request.sources.drafts_with_model)


def plan_row(seq: ScheduledSequence, drafter: BatchDraftModel | None, draft_confidence: float,
             skip_fraction: float = 0.0) -> BatchRow | RowChoices:
    """What the batch's draft-length chooser needs to know of one drafting row: its drafter,
    or the options of a row that picks its source (each lookup's offer, recorded to be scored,
    and the draft model where the row holds draft KV). ``skip_fraction``: what a layer-skip
    draft pass costs, as a fraction of a target pass (``BatchLayerSkip.pass_fraction``)."""
    request: BatchRequest = seq.state
    if request.ngram is not None:  # the lookups look at every committed token
        request.ngram.extend(request.tokens[len(request.ngram.history):])
    backlog = 0
    with_model = model_may_draft(seq)
    if with_model:
        assert drafter is not None
        backlog = drafter.backlog(seq.seq_id, len(request.tokens))
    row = BatchRow(request.acceptance.rate, max_draft(request), with_model, backlog,
                   observed=request.acceptance.trials >= MIN_OBSERVED_TRIALS, remaining=request.remaining,
                   stops_early=with_model and draft_confidence > 0,
                   self_pass_fraction=skip_fraction if request.skips_layers else 0.0,
                   fixed=request.schedule is not None)
    if request.sources is not None:
        return request.sources.choices(request.remaining, row if with_model else None)
    return row


def plan_rows(
    running: list[ScheduledSequence], drafter: BatchDraftModel | None, draft_confidence: float,
    skipper: BatchLayerSkip | None = None,
) -> tuple[list[ScheduledSequence], list[BatchRow | RowChoices], list[tuple[ScheduledSequence, Exception]]]:
    """The rows that may draft this step and their plans (``plan_row``), and the rows whose
    planning raised, with the error: a row's host lookups run here, outside the step's rerun
    (``BatchEngine._isolate_failures``), and what they raise is that row's alone."""
    drafting, plans, broken = [], [], []
    skip_fraction = skipper.pass_fraction if skipper is not None else 0.0
    for seq in running:
        if not may_draft(seq):
            continue
        try:
            plans.append(plan_row(seq, drafter, draft_confidence, skip_fraction))
        except Exception as err:  # noqa: BLE001 - any error of a row's own lookups is that row's
            broken.append((seq, err))
            continue
        drafting.append(seq)
    return drafting, plans, broken


def choose_sources(drafting: list[ScheduledSequence], plans: list[BatchRow | RowChoices], k: int,
                   chooser: BatchK, batch_size: int) -> dict[int, int]:
    """Each drafting row's draft length at the batch's ``k`` (chosen for ``batch_size`` rows) by
    seq_id; a row that picks its source is told what it drafts (``BatchK.pick``)."""
    wanted = {}
    for seq, plan in zip(drafting, plans, strict=True):
        request: BatchRequest = seq.state
        if isinstance(plan, RowChoices):
            assert request.sources is not None
            pick = chooser.pick(plan, k, batch_size) if k > 0 else None
            request.sources.choose(pick.index if pick is not None else None)
            wanted[seq.seq_id] = pick.k if pick is not None else 0
        else:  # a row of a fixed or threshold k policy drafts its own cap, whatever k is
            wanted[seq.seq_id] = plan.cap if plan.fixed else min(k, max_draft(request))
    return wanted


def reads_backlog(drafting: list[ScheduledSequence], wanted: dict[int, int], drafter: BatchDraftModel | None) -> bool:
    """Whether a row the draft model drafts for this step reads its backlog first (a step that
    says little about one draft pass)."""
    return drafter is not None and any(
        wanted[seq.seq_id] > 0 and drafts_with_model(seq) and drafter.backlog(seq.seq_id, len(seq.state.tokens)) > 0
        for seq in drafting)


# One-token passes a try of a priced-out draft model times (``time_draft_model``): the quicker
# of two, as the stored tables keep the best of their repeats.
TRY_PASSES = 2


def time_draft_model(drafting: list[ScheduledSequence], plans: list[BatchRow | RowChoices],
                     running: list[ScheduledSequence], drafter: BatchDraftModel | None,
                     chooser: BatchK) -> list[tuple[ScheduledSequence, Exception]]:
    """Where the chooser asks (``BatchK.model_try``), time the priced-out draft model's passes
    on the first running row that may draft with it, for the chooser to re-price it; call after
    the step's KV slots are reserved. Returns that row with the error where its passes raised:
    the row's alone, as an error of its drafts is (the try is dropped)."""
    if not chooser.model_try or drafter is None:
        return []
    for seq, plan in zip(drafting, plans, strict=True):
        if seq in running and uses_model(plan) and model_may_draft(seq):
            request: BatchRequest = seq.state
            try:
                seconds = drafter.time_passes(seq.seq_id, request.committed[:len(request.tokens)], TRY_PASSES)
            except Exception as err:  # noqa: BLE001 - a pass over one row's sequence fails that row
                chooser.model_try = False
                return [(seq, err)]
            chooser.observe_try(seconds)
            request.stats.draft_forward_passes += len(seconds)  # the row's own: its time paid for them
            request.stats.draft_seconds += sum(seconds)
            return []
    return []


def slots_needed(seq: ScheduledSequence, wanted: dict[int, int], forced: dict[int, list[int]]) -> tuple[int, int]:
    """The KV slots a running sequence needs this step in the target's and the draft's pools:
    its committed tokens and its drafts (a tree's nodes, however deep, lie past its root); a
    sequence still prefilling (not in ``wanted``), room for its whole prompt's coming chunks."""
    request: BatchRequest = seq.state
    if seq.seq_id not in wanted:
        return len(request.tokens), 0
    drafts = wanted[seq.seq_id]
    if drafts and request.tree_nodes and seq.seq_id not in forced:
        drafts = max(drafts, request.tree_nodes)
    return len(request.tokens) + drafts, len(request.tokens) + drafts - 1


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
    skipper: BatchLayerSkip | None = None,
) -> tuple[list[DraftProposal], int, int]:
    """Each row's proposal of up to ``wanted[seq_id]`` tokens (possibly empty), the draft
    model's passes and its rows per pass. A structured row whose grammar forces what comes next
    drafts those tokens instead (``forced`` by seq_id, from ``forced_drafts``). ``skipper``
    drafts for layer-skip rows (their proposals count their passes: ``forward_passes``)."""
    empty = torch.empty((1, 0), dtype=torch.long, device=device)
    proposals = [DraftProposal(tokens=empty, probs=None) for _ in running]
    model_rows, model_index = [], []
    skip_rows, skip_index = [], []
    eagle_rows: list[tuple[EagleDrafter, torch.Tensor, int]] = []
    eagle_index = []
    for index, seq in enumerate(running):
        request: BatchRequest = seq.state
        if seq.seq_id in forced:
            proposals[index] = DraftProposal(tokens=host_to_device([forced[seq.seq_id]], torch.long, device),
                                             probs=None, forced=True)
            continue
        k = wanted[seq.seq_id]
        if k == 0:
            continue
        length = len(request.tokens)
        if drafts_with_model(seq):
            model_rows.append(DraftRow(seq.seq_id, request.committed[:length], k, request.processor, request.generator,
                                       draft_confidence))
            model_index.append(index)
        elif request.skips_layers:
            skip_rows.append(DraftRow(seq.seq_id, request.committed[:length], k, request.processor, request.generator,
                                      draft_confidence))
            skip_index.append(index)
        elif isinstance(request.heads, EagleDrafter):  # drafted with the step's other EAGLE rows, below
            eagle_rows.append((request.heads, request.committed[:length], k))
            eagle_index.append(index)
        elif request.heads is not None:  # a tree at most k deep from the features it was shown
            proposals[index] = tree_proposal(request.heads.propose_tree(
                request.committed[None, :length], k, request.processor, request.generator), request.heads.last_forward_passes)
        elif request.tree_nodes:  # a token tree at most k deep (its root: the last committed token)
            tree = request.ngram.propose_tree(request.committed[None, :length], k, request.processor,  # type: ignore[union-attr]
                                              request.generator)
            if tree.size > 1:
                proposals[index] = DraftProposal(tokens=tree.tokens[None, 1:], probs=None, tree=tree)
        elif request.ngram is not None:  # plan_row extended it with this step's committed tokens
            match, _ = request.ngram.match(k)
            if match:
                proposals[index] = DraftProposal(tokens=host_to_device([match], torch.long, device), probs=None)
    passes = 0
    if model_rows:
        assert drafter is not None
        drafted, passes = drafter.propose(model_rows)
        for index, proposal in zip(model_index, drafted, strict=True):
            proposals[index] = proposal
    if skip_rows:
        assert skipper is not None
        for index, proposal in zip(skip_index, skipper.propose(skip_rows)[0], strict=True):
            proposals[index] = proposal
    # Trees at most k deep from the features each row was shown; a batch of EAGLE rows costs
    # one row's head passes (drafters/batch_eagle.py).
    for index, (drafter, _, _), tree in zip(eagle_index, eagle_rows, propose_together(eagle_rows), strict=True):
        proposals[index] = tree_proposal(tree, drafter.last_forward_passes)
    return proposals, passes, len(model_rows)


def tree_proposal(tree: TokenTree, forward_passes: int) -> DraftProposal:
    """A heads row's proposal of ``tree`` (its nodes after the root); none where it is the root
    alone (the row decodes plainly)."""
    empty = tree.tokens[None, :0]  # (1, 0): no drafts
    if tree.size == 1:
        return DraftProposal(tokens=empty, probs=None)
    return DraftProposal(tokens=tree.tokens[None, 1:], probs=None, forward_passes=forward_passes, tree=tree)


def constrain_proposals(
    grammars: Sequence[GrammarState | None],
    greedy: Sequence[bool],
    proposals: Sequence[DraftProposal],
) -> tuple[list[DraftProposal], dict[int, torch.Tensor]]:
    """A batch's proposals as its structured rows verify them, and each such row's masks
    (row b: (k_b + 1, V) bool, host). As in the single path, a deterministic draft (or any draft
    under greedy) is cut at its first forbidden token; a tree's node i is masked by the state
    after the path to it (a forbidden node is then never accepted)."""
    out, masks = list(proposals), {}
    for b, (state, proposal) in enumerate(zip(grammars, proposals, strict=True)):
        if state is None:
            continue
        if proposal.tree is not None:
            masks[b] = state.masks(proposal.tree.parents, proposal.tree.tokens.tolist())
            continue
        drafts = proposal.tokens[0].tolist()
        allowed = state.chain_masks(drafts)
        if proposal.probs is None or greedy[b]:
            legal = first_forbidden(allowed, drafts)
            if legal < len(drafts):
                probs = None if proposal.probs is None else proposal.probs[:, :legal]
                out[b] = DraftProposal(proposal.tokens[:, :legal], probs, proposal.forward_passes, proposal.forced)
                allowed = allowed[: legal + 1]
        masks[b] = allowed
    return out, masks
