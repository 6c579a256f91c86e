"""Verification of a whole batch's rows, each with its own draft count, sampling parameters
and generator: the greedy chain rows in one ``greedy_verify`` call, the sampling chain rows in
one ``rejection_verify`` call (pure: tensors in, tensors out, no host read); token-tree rows one
by one (``verify_trees``: a greedy tree's pick, and a typical-acceptance tree's, stays on the
device for the step's one host read; a lossless sampled tree reads the host as it walks down, as
on the single path)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.core.device import host_to_device
from specdecode.core.logprobs import TokenLogprob, pack, unpack
from specdecode.core.sampling import LogitsProcessor
from specdecode.drafters.base import DraftProposal
from specdecode.engine.penalties import TokenPenalties
from specdecode.engine.verify import (
    PAD_TOKEN,
    TreeVerifyResult,
    greedy_tree_pick,
    greedy_verify,
    rejection_tree_verify,
    rejection_verify,
    typical_tree_pick,
)
from specdecode.kv.paged import stack_padded


def verify_rows(
    logits: torch.Tensor,  # (B, T, V) float: row b's target rows for its last committed token and drafts
    proposals: Sequence[DraftProposal],
    processors: Sequence[LogitsProcessor],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """(B, k_max + 1) long: row b's accepted drafts, then its recovered or bonus token, then PAD
    (a tree row: PAD only; ``verify_trees`` verifies it)."""
    chains = [b for b, proposal in enumerate(proposals) if proposal.tree is None]
    greedy = [b for b in chains if processors[b].greedy]
    sampled = [b for b in chains if not processors[b].greedy]
    empty = torch.empty(0, dtype=torch.long, device=logits.device)
    results: dict[int, torch.Tensor] = {b: empty for b, proposal in enumerate(proposals) if proposal.tree is not None}
    for group in (greedy, sampled):
        if not group:
            continue
        counts = [proposals[b].num_tokens for b in group]
        width = max(counts)
        drafts = stack_padded([proposals[b].tokens[0] for b in group])[:, :width]  # (G, k)
        if group is greedy:
            # A whole-batch group reads the logits in place; a subset is gathered (a copy).
            rows = logits if len(group) == logits.shape[0] else logits[host_to_device(group, torch.long, logits.device)]
            result = greedy_verify(drafts, rows[:, : width + 1], counts)
        else:
            # Each row's own temperature / top-k / top-p, on its own rows only; rows past a row's
            # drafts stay zero (never read: its count bounds what it accepts).
            probs = logits.new_zeros((len(group), width + 1, logits.shape[-1]))  # (G, k + 1, V)
            for i, b in enumerate(group):
                probs[i, : counts[i] + 1] = processors[b].probs(logits[b : b + 1, : counts[i] + 1])[0]
            result = rejection_verify(drafts, _draft_probs([proposals[b] for b in group], width, probs.shape[-1]),
                                      probs, [generators[b] for b in group], counts)
        for i, b in enumerate(group):
            results[b] = result.tokens[i]
    return stack_padded([results[b] for b in range(len(proposals))], PAD_TOKEN)


def verify_trees(
    logits: torch.Tensor,  # (B, T, V) float: a tree row's first N rows are its nodes'
    proposals: Sequence[DraftProposal],
    processors: Sequence[LogitsProcessor],
    generators: Sequence[torch.Generator | None],
    rules: Sequence[str],
) -> tuple[dict[int, torch.Tensor], dict[int, TreeVerifyResult]]:
    """The token-tree rows: each greedy row's ``greedy_tree_pick`` and each sampling row's
    ``typical_tree_pick`` where its acceptance rule (``rules[b]``) is "typical" (device,
    (N + 2,) long, to be read with the step's other values and ``greedy_tree_read``), each other
    sampling row's result (``rejection_tree_verify``, lossless: it reads the host node by node).
    Greedy rows ignore the rule: Medusa's typical acceptance is for sampling (the single engine
    does the same)."""
    picks, results = {}, {}
    for b, proposal in enumerate(proposals):
        tree = proposal.tree
        if tree is None:
            continue
        rows = logits[b, : tree.size]  # (N, V)
        if processors[b].greedy:
            picks[b] = greedy_tree_pick(tree, rows)
        elif rules[b] == "typical":
            picks[b] = typical_tree_pick(tree, processors[b].probs(rows[None])[0], generators[b])
        else:
            results[b] = rejection_tree_verify(tree, processors[b].probs(rows[None])[0], generators[b])
    return picks, results


def tree_logprobs(
    raw: torch.Tensor,  # (>= N, V): a tree's model logits, node i's at row i
    processed: torch.Tensor,  # (>= N, V): after grammar masks, bias and penalties
    result: TreeVerifyResult,
    processor: LogitsProcessor,
) -> list[TokenLogprob]:
    """The logprobs of a tree's emitted tokens (emitted token j follows path node j): a second
    host read, once the path is known (both engines)."""
    assert processor.logprobs is not None
    path = host_to_device(result.path, torch.long, raw.device)
    probs = None
    if not processor.greedy and processor.logprobs_mode != "raw":
        probs = processor.probs(processed[path])
    rows = processor.logprob_rows(raw[path], processed[path], probs)
    tokens = host_to_device(result.tokens, torch.long, raw.device)
    return unpack(pack(rows, tokens, processor.logprobs).tolist(), len(result.tokens))


def penalise_rows(
    logits: torch.Tensor,  # (B, T, V) float
    proposals: Sequence[DraftProposal],
    penalties: Sequence[TokenPenalties | None],
) -> torch.Tensor:  # (B, T, V): row b's first drafts + 1 rows penalised with the drafts before each
    if all(p is None for p in penalties):
        return logits
    out = logits.float().clone()  # the backend's buffer stays as it was
    for b, (proposal, state) in enumerate(zip(proposals, penalties, strict=True)):
        if state is not None and proposal.tree is not None:  # node i penalised with the path to it
            out[b, : proposal.tree.size] = state.tree_rows(logits[b, : proposal.tree.size], proposal.tree)
        elif state is not None:
            n = proposal.num_tokens
            out[b, : n + 1] = state.chain_rows(logits[b, : n + 1], proposal.tokens[0, :n])
    return out


def logprob_rows(
    raw: torch.Tensor,  # (B, T, V): the model's logits
    processed: torch.Tensor,  # (B, T, V): after grammar masks, bias and penalties
    emitted: torch.Tensor,  # (B, k_max + 1) long: what verify_rows returned
    proposals: Sequence[DraftProposal],
    processors: Sequence[LogitsProcessor],
) -> dict[int, torch.Tensor]:  # b -> (k_max + 1, 2 + 2 n) float32 (core/logprobs.py's pack)
    """The packed logprobs of each chain row that asked for them (a tree row's come once its path
    is read: ``tree_logprobs``); rows past a row's drafts + 1 are padding (never unpacked: its
    emitted count bounds them)."""
    out = {}
    width = emitted.shape[1]
    for b, processor in enumerate(processors):
        if processor.logprobs is None or proposals[b].tree is not None:
            continue
        n = proposals[b].num_tokens + 1
        probs = None
        if not processor.greedy and processor.logprobs_mode != "raw":
            probs = processor.probs(processed[b, :n])
        logp = processor.logprob_rows(raw[b, :n], processed[b, :n], probs)
        if n < width:  # pad to the emitted width (any finite rows: never read)
            logp = torch.cat([logp, logp[-1:].expand(width - n, -1)])
        out[b] = pack(logp, emitted[b], processor.logprobs)
    return out


def _draft_probs(proposals: list[DraftProposal], width: int, vocab: int) -> torch.Tensor | None:
    """The rows' q stacked to (G, width, V): None when every row's drafter is deterministic;
    else a deterministic row's q is one-hot on its tokens (what rejection_verify assumes of None)."""
    if all(p.probs is None for p in proposals):
        return None
    q = torch.zeros((len(proposals), width, vocab), device=proposals[0].tokens.device)
    for i, proposal in enumerate(proposals):
        n = proposal.num_tokens
        if proposal.probs is None:
            q[i, :n].scatter_(1, proposal.tokens[0, :, None], 1.0)
        else:
            q[i, :n] = proposal.probs[0]
    return q
