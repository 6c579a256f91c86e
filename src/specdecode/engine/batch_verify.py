"""Verification of a whole batch's rows, each with its own draft count, sampling parameters
and generator: the greedy rows in one ``greedy_verify`` call, the sampling rows in one
``rejection_verify`` call (pure: tensors in, tensors out, no host read)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.backends.device import host_to_device
from specdecode.drafters.base import DraftProposal
from specdecode.engine.sampling import LogitsProcessor
from specdecode.engine.verify import PAD_TOKEN, greedy_verify, rejection_verify
from specdecode.kv.paged import stack_padded


def verify_rows(
    logits: torch.Tensor,  # (B, T, V) float: row b's target rows for its last committed token and drafts
    proposals: Sequence[DraftProposal],
    processors: Sequence[LogitsProcessor],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """(B, k_max + 1) long: row b's accepted drafts, then its recovered or bonus token, then PAD."""
    greedy = [b for b, processor in enumerate(processors) if processor.greedy]
    sampled = [b for b, processor in enumerate(processors) if not processor.greedy]
    results: dict[int, torch.Tensor] = {}
    for group in (greedy, sampled):
        if not group:
            continue
        counts = [proposals[b].num_tokens for b in group]
        width = max(counts)
        drafts = stack_padded([proposals[b].tokens[0] for b in group])[:, :width]  # (G, k)
        if group is greedy:
            index = host_to_device(group, torch.long, logits.device)
            result = greedy_verify(drafts, logits[index, : width + 1], counts)
        else:
            # Each row's own temperature / top-k / top-p, on its own rows only.
            probs = torch.cat([_padded(processors[b].probs(logits[b : b + 1, : counts[i] + 1]), width + 1)
                               for i, b in enumerate(group)])  # (G, k + 1, V)
            result = rejection_verify(drafts, _draft_probs([proposals[b] for b in group], width, probs.shape[-1]),
                                      probs, [generators[b] for b in group], counts)
        for i, b in enumerate(group):
            results[b] = result.tokens[i]
    return stack_padded([results[b] for b in range(len(proposals))], PAD_TOKEN)


def _padded(rows: torch.Tensor, width: int) -> torch.Tensor:  # (1, T, V) -> (1, width, V), zero rows after T
    return torch.nn.functional.pad(rows, (0, 0, 0, width - rows.shape[1]))


def _draft_probs(proposals: list[DraftProposal], width: int, vocab: int) -> torch.Tensor | None:
    """The rows' q stacked to (G, width, V): None when every row's drafter is deterministic;
    else a deterministic row's q is one-hot on its tokens (what rejection_verify assumes of None)."""
    if all(p.probs is None for p in proposals):
        return None
    rows = []
    for proposal in proposals:
        q = proposal.probs
        if q is None:
            q = torch.zeros((1, proposal.num_tokens, vocab), device=proposal.tokens.device).scatter(2, proposal.tokens[..., None], 1.0)
        rows.append(_padded(q.float(), width))
    return torch.cat(rows)
