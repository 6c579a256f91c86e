"""The verify pass of a batch step: every row's last committed token and drafts (a chain, or a
token tree's nodes) in one target pass, each row's grammar masks and penalties applied, the rows
verified (``engine/batch_verify.py``), and what they emitted read back in one host read."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdecode.backends.base import BatchModel
from specdecode.backends.torch_batch import PagedBatchModel
from specdecode.core.logprobs import unpack
from specdecode.drafters.base import DraftProposal
from specdecode.engine.batch_proposals import constrain_proposals
from specdecode.engine.batch_request import BatchRequest
from specdecode.engine.batch_verify import logprob_rows, penalise_rows, tree_logprobs, verify_rows, verify_trees
from specdecode.engine.grammar import apply_row_masks
from specdecode.engine.scheduler import ScheduledSequence
from specdecode.engine.verify import PAD_TOKEN, greedy_tree_read


class VerifiedStep(NamedTuple):
    emitted: list[list[int]]  # each row's emitted tokens: its accepted drafts and one of the target's
    proposals: list[DraftProposal]  # as verified (a structured row's drafts cut: engine/grammar.py)
    paths: dict[int, list[int]]  # each tree row's accepted path (root first), by row index
    # (B, T_max, C): the target's final hidden states of every row's inputs, where a row's
    # trained heads read them (``BatchRequest.heads``); else None.
    hidden: torch.Tensor | None


def verify_pass(
    target: BatchModel,
    running: list[ScheduledSequence],
    proposals: list[DraftProposal],
) -> VerifiedStep:
    """One target pass over every row; each row's emitted tokens (accepted drafts + one), the
    proposals as verified (a structured row's deterministic drafts cut at the first token
    its grammar forbids: engine/grammar.py), each tree row's accepted path by row index, and
    the hidden states where a row's heads read them.

    Greedy chain rows are verified in one call, sampling chain rows in another (each with its
    own processor's probabilities and its own generator), tree rows one by one, each by its
    request's acceptance rule (``batch_verify.verify_trees``); one host read brings all rows
    back (a lossless sampled tree, and a tree row's logprobs, read more: ``verify_trees``,
    ``tree_logprobs``)."""
    requests: list[BatchRequest] = [seq.state for seq in running]
    proposals, masks = constrain_proposals([r.grammar for r in requests], [r.processor.greedy for r in requests],
                                           proposals)
    inputs, starts = [], []
    for seq, proposal in zip(running, proposals, strict=True):
        request: BatchRequest = seq.state
        length = len(request.tokens)
        # From the last committed token, or where a merged prompt's last chunk starts.
        start = seq.prefilled
        assert start <= length - 1, (start, length)
        inputs.append(torch.cat([request.committed[start:length], proposal.tokens[0]]))
        starts.append(start)
    # Logits for each row's last token and drafts only, not for a merged prompt's tail.
    logit_rows = [p.num_tokens + 1 for p in proposals] if any(seq.prefilling for seq in running) else None
    seq_ids = [seq.seq_id for seq in running]
    trees = [p.tree.parents if p.tree is not None else None for p in proposals]
    any_trees = any(parents is not None for parents in trees)  # only where the target supports_trees
    hidden = None
    if any(r.heads is not None for r in requests):  # heads run on torch only: no merged prompt here
        assert isinstance(target, PagedBatchModel) and logit_rows is None
        raw, hidden = target.forward_features(seq_ids, inputs, starts, trees=trees if any_trees else None)
    elif any_trees:
        raw = target.forward(seq_ids, inputs, starts, logit_rows=logit_rows, trees=trees)  # (B, T, V)
    else:
        raw = target.forward(seq_ids, inputs, starts, logit_rows=logit_rows)  # (B, T, V)
    assert raw is not None
    logits = apply_row_masks(raw, masks) if masks else raw
    logits = penalise_rows(logits, proposals, [r.processor.penalties for r in requests])
    processors, generators = [r.processor for r in requests], [r.generator for r in requests]
    emitted = verify_rows(logits, proposals, processors, generators)
    picks, tree_results = verify_trees(logits, proposals, processors, generators,
                                       [r.acceptance_rule for r in requests])
    packed = logprob_rows(raw, logits, emitted, proposals, processors)
    width = emitted.shape[1]
    if not packed and not picks:
        rows = emitted.tolist()  # the one host read of the step (and the drafts of structured rows)
    else:  # the logprobs and the trees' picks travel in the same read (as floats: exact below 2^24)
        parts = [emitted.flatten(), *(p.flatten() for p in packed.values()), *picks.values()]
        host = torch.cat([part.float() for part in parts]).tolist()
        rows = [[int(t) for t in host[b * width : (b + 1) * width]] for b in range(len(requests))]
        offset = len(requests) * width
        for b, part in packed.items():
            columns = part.shape[1]
            flat = host[offset : offset + part.numel()]
            offset += part.numel()
            requests[b].step_logprobs = unpack([flat[i * columns : (i + 1) * columns] for i in range(width)], width)
        for b, pick in picks.items():
            tree = proposals[b].tree
            assert tree is not None
            tree_results[b] = greedy_tree_read(tree, [int(v) for v in host[offset : offset + pick.numel()]])
            offset += pick.numel()
    paths = {}
    for b, result in tree_results.items():
        rows[b], paths[b] = list(result.tokens), result.path
        if requests[b].processor.logprobs is not None:
            requests[b].step_logprobs = tree_logprobs(raw[b], logits[b], result, requests[b].processor)
    return VerifiedStep([row[: row.index(PAD_TOKEN)] if PAD_TOKEN in row else row for row in rows], proposals, paths,
                        hidden)
