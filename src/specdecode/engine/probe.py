"""Reads of the models outside decoding: the target's next-token logits after given tokens
(teacher-forced), and a drafter's distribution for the next token. The audit checks decoding
against these (``SpecDecoder.target_logits`` and ``draft_probs`` call them); decoding never does.

Both use the single-request engine's target sequence, so they overwrite what it holds: callers
drop the prefix cache's record afterwards (``SpecDecoder`` does)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdecode.errors import InvalidRequestError

if TYPE_CHECKING:
    from specdecode.backends.base import SequenceModel
    from specdecode.core.sampling import LogitsProcessor
    from specdecode.drafters.base import Drafter


@torch.inference_mode()
def continuation_logits(
    seq: SequenceModel, prompt_ids: Sequence[int], continuations: Sequence[Sequence[int]],
    rows_per_pass: int | None = None,
) -> torch.Tensor:  # (len(continuations), V) float32
    """Row i: the target's logits for the token after ``prompt_ids + continuations[i]``. The
    prompt is prefilled once; each continuation is then one pass from the prompt's last token
    (the backend overwrites the slots past the commit), so N rows cost one prefill and N short
    passes, not N prefills. ``rows_per_pass`` splits each continuation's pass into passes of at
    most that many rows (1: as plain decoding computes them), for kernels whose rounding depends
    on the rows in a pass."""
    if not prompt_ids:
        raise InvalidRequestError("target_logits needs at least one prompt token.")
    if not continuations:
        raise InvalidRequestError("target_logits needs at least one continuation (() for the prompt alone).")
    prompt_len = len(prompt_ids)
    seq.begin(prompt_len + max(len(c) for c in continuations) + 1)
    device = seq.device
    if prompt_len > 1:
        seq.extend(torch.tensor([list(prompt_ids[:-1])], device=device), 0, compute_logits=False)
    seq.commit(prompt_len - 1)
    if rows_per_pass is not None and rows_per_pass < 1:
        raise InvalidRequestError(f"rows_per_pass must be at least 1, got {rows_per_pass}.")
    rows = []
    for continuation in continuations:
        tokens = torch.tensor([[prompt_ids[-1], *continuation]], device=device)  # (1, 1 + len)
        step = rows_per_pass or tokens.shape[1]
        for start in range(0, tokens.shape[1], step):
            out = seq.extend(tokens[:, start : start + step], prompt_len - 1 + start, logits_last=1)
            if start + step < tokens.shape[1]:
                seq.commit(prompt_len + start + step - 1)  # K/V of this pass stay for the next
        rows.append(out.logits[0, -1].float())
        seq.commit(prompt_len - 1)  # the next continuation starts after the prompt again
    return torch.stack(rows)


@torch.inference_mode()
def logits_in_passes(
    seq: SequenceModel, tokens: Sequence[int], shapes: Sequence[tuple[int, int]],
) -> list[torch.Tensor]:  # one (V,) float32 per shape
    """The target's logits for the token after ``tokens``, once per ``(rows, row)`` shape: as row
    ``row`` of one pass over ``rows`` rows, the way a verify pass computes them (padded with
    zeros past the end: later rows cannot change an earlier row's result, only the pass's shape
    can). With a cached prompt, the first verify pass scores the prompt's last token as its row
    0 beside the drafts. The tokens before the earliest pass are prefilled once."""
    starts = []
    for rows, row in shapes:
        if not 0 <= row < rows:
            raise InvalidRequestError(f"row must be in [0, rows), got row={row}, rows={rows}.")
        if len(tokens) - 1 - row < 0:
            raise InvalidRequestError(f"row {row} of a pass needs at least {row + 1} tokens before the read.")
        starts.append(len(tokens) - 1 - row)  # the pass's first position
    if not shapes:
        return []
    base = min(starts)
    seq.begin(len(tokens) + max(rows for rows, _ in shapes))
    device = seq.device
    if base > 0:
        seq.extend(torch.tensor([list(tokens[:base])], device=device), 0, compute_logits=False)
    out = []
    for (rows, row), start in zip(shapes, starts):
        seq.commit(base)
        if start > base:  # the few tokens between the shared prefill and this pass
            seq.extend(torch.tensor([list(tokens[base:start])], device=device), base, compute_logits=False)
        window = list(tokens[start:]) + [0] * (rows - row - 1)
        out.append(seq.extend(torch.tensor([window], device=device), start).logits[0, row].float())
    return out


@torch.inference_mode()
def next_draft_probs(
    seq: SequenceModel, drafter: Drafter, context: Sequence[int], processor: LogitsProcessor,
    generator: torch.Generator,
) -> torch.Tensor | None:  # (V,) float32
    """The drafter's distribution for its first proposed token after ``context``, set up exactly
    as the engine sets it up before a step (a layer-skip drafter drafts in the target's cache):
    a one-hot for a deterministic drafter, None where it proposes nothing (that step would
    decode plainly)."""
    capacity = len(context) + 2
    seq.begin(capacity)
    drafter.start(len(context), capacity, seq)
    if hasattr(drafter, "on_committed"):
        drafter.on_committed(list(context))
    if len(context) > 1:
        seq.extend(torch.tensor([list(context[:-1])], device=seq.device), 0, compute_logits=False)
    seq.commit(len(context) - 1)
    proposal = drafter.propose(torch.tensor([list(context)], device=seq.device), 1, processor, generator)
    if proposal.num_tokens == 0:
        return None
    if proposal.probs is None:
        return torch.zeros(seq.vocab_size, device=seq.device).index_fill_(0, proposal.tokens[0, :1], 1.0)
    return proposal.probs[0, 0].float()
