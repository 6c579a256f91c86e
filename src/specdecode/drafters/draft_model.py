"""An independent small model of the same tokenizer family drafts autoregressively.

The drafter keeps its own sequence on its backend (``backends/base.py``): a torch model with
its own KV cache, or a llama.cpp context. After a step in which the target accepted n of k drafted
tokens, the draft cache holds valid entries for the old committed sequence plus
min(n, k - 1) drafted tokens (the last drafted token was sampled but never fed back); the
next ``propose`` first feeds the committed tokens it has not seen (one or two), then drafts.
A new request keeps the part of the previous request's cache its prompt shares
(``shared_prefix``), so a chat's next turn catches up on the new message only. The engine's
``shared_prefix`` counts against the target's previous request, which may not have used this
drafter (an ngram or plain request in between leaves this cache on an older one): the drafter
keeps its own record of the tokens its cache follows (``on_committed``, host lists) and drops
what the new prompt does not share with that record.
"""

from __future__ import annotations

import torch

from specdecode.backends.base import SequenceModel
from specdecode.core.prefix import common_prefix_length
from specdecode.core.sampling import LogitsProcessor, draw
from specdecode.drafters.base import DraftProposal


class DraftModelDrafter:
    def __init__(self, model: SequenceModel, target_vocab_size: int, confidence_threshold: float = 0.0) -> None:
        self.model = model  # the draft model's sequence (its cache lives there)
        self.target_vocab_size = target_vocab_size
        # Stop drafting early once the draft's probability for the token it just proposed falls
        # below this (0 disables): a token the draft itself doubts is likely rejected, and the
        # forward passes after it are wasted. Deciding from draft-side information only keeps
        # verification lossless. Each check reads one scalar on the host (a device sync on GPUs).
        self.confidence_threshold = confidence_threshold
        self._cached_len = 0  # committed tokens whose K/V sit in the draft cache
        self._epoch = -1  # the draft sequence's epoch after our own begin (backends/base.py)
        self._proposed_base = 0  # committed length when the last proposal was made
        self._proposed_count = 0
        # Host tokens of the request the cache follows (prompt, then committed output), and
        # whether this request's prompt has yet to be checked against the previous record.
        self._tokens: list[int] = []
        self._previous: list[int] = []
        self._unchecked = False

    @property
    def cached_len(self) -> int:
        """Committed tokens the draft has read (the auto method prices catching up on the rest)."""
        return self._cached_len

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        # Keep what the previous request left of the shared prefix, unless someone else used the
        # sequence since (timing passes); the first proposal feeds at least the last prompt token.
        keep = min(self._cached_len, shared_prefix, prompt_len - 1) if self.model.epoch == self._epoch else 0
        self.model.begin(capacity, keep=keep)
        self._epoch = self.model.epoch
        self._cached_len = keep
        self._previous, self._tokens, self._unchecked = self._tokens, [], True

    def on_committed(self, tokens: list[int]) -> None:
        """The request's prompt (first call after ``start``), then each step's committed tokens."""
        if self._unchecked:
            self._unchecked = False
            self._keep_at_most(common_prefix_length(self._previous, tokens))
        self._tokens.extend(tokens)

    def _keep_at_most(self, length: int) -> None:
        if self._cached_len > length:
            self.model.commit(length)
            self._cached_len = length

    def _forward(self, tokens: torch.Tensor, start: int) -> torch.Tensor:  # (1, T) -> (1, V_target)
        out = self.model.extend(tokens, start, logits_last=1)
        self.model.commit(start + tokens.shape[1])
        return to_target_vocab(out.logits[:, -1], self.target_vocab_size)

    def propose(
        self,
        committed: torch.Tensor,  # (1, L) long
        num_tokens: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        if self._unchecked:  # a caller that never showed the prompt: keep nothing unverified
            self._unchecked = False
            self._keep_at_most(0)
        committed_len = committed.shape[1]
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        # Catch up on committed tokens the draft has not seen, then draft one token per pass.
        logits = self._forward(committed[:, self._cached_len :], self._cached_len)
        forward_passes = 1
        for step in range(num_tokens):
            next_token, q = draw(logits, processor, generator)
            if q is not None:
                probs.append(q)
            tokens.append(next_token)
            if step + 1 == num_tokens or doubts(logits, q, next_token, self.confidence_threshold):
                break
            logits = self._forward(next_token[:, None], committed_len + step)
            forward_passes += 1
        self._proposed_base = committed_len
        self._proposed_count = len(tokens)
        return DraftProposal(
            tokens=torch.stack(tokens, dim=1),
            probs=torch.stack(probs, dim=1) if probs else None,
            forward_passes=forward_passes,
        )

    def on_verified(self, num_accepted: int) -> None:
        # Drafted tokens 1..k-1 were fed; of those, the accepted ones stay valid.
        valid = self._proposed_base + min(num_accepted, self._proposed_count - 1)
        self.model.commit(valid)
        self._cached_len = valid


def to_target_vocab(logits: torch.Tensor, target_vocab_size: int) -> torch.Tensor:  # (..., V_draft) -> (..., V_target)
    """Vocabularies may differ by padding rows: cut the draft's extra rows, or give the
    target's extra rows -inf so the draft never proposes them. q stays the distribution the
    proposed tokens were drawn from, so verification stays lossless."""
    extra = target_vocab_size - logits.shape[-1]
    if extra < 0:
        return logits[..., :target_vocab_size]
    if extra > 0:
        return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
    return logits


def doubts(
    logits: torch.Tensor,  # (1, V)
    q: torch.Tensor | None,  # (1, V) sampling distribution, None when greedy
    token: torch.Tensor,  # (1,)
    threshold: float,
) -> bool:
    """Whether a drafter's own probability for the token it just proposed is below ``threshold``
    (0 disables the check). Reads one scalar on the host (a device sync on GPUs)."""
    if threshold <= 0:
        return False
    return draft_confidence(logits, q, token).item() < threshold


def draft_confidence(
    logits: torch.Tensor,  # (1, V)
    q: torch.Tensor | None,  # (1, V) sampling distribution, None when greedy
    token: torch.Tensor,  # (1,)
) -> torch.Tensor:
    """(1,) the drafter's own probability for the token it proposed (greedy: the argmax's)."""
    if q is None:
        return torch.softmax(logits.float(), dim=-1).amax(dim=-1)
    return q[0, token[0]].reshape(1)
