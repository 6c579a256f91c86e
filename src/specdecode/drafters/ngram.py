"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
sequence's last n tokens (n from ``ngram_max`` down to ``ngram_min``), in the prompt or in the
text generated so far.

It costs no model pass, so it pays wherever output copies its context (code edits, summaries,
quoted passages). When nothing matches it proposes nothing and the engine decodes that step
plainly. The draft is deterministic (``probs`` is None): verification treats it as a one-hot
q, which keeps sampling lossless.

The drafter keeps a host-side copy of the committed tokens and, for every n, a map from each
n-gram to the latest position where it was followed by another token, updated incrementally:
a step costs O(new tokens x n-gram sizes), not a scan of the history. The engine hands it the
committed tokens on the host (``on_committed``), so it never reads the device sequence (a
second sync per step on GPUs); a caller that does not is served from the device tensor.
"""

from __future__ import annotations

import torch

from specdecode.backends.base import SequenceModel
from specdecode.config import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, check_ngram_sizes
from specdecode.core.device import host_to_device
from specdecode.core.sampling import LogitsProcessor
from specdecode.drafters.base import DraftProposal
from specdecode.errors import InvalidRequestError


class NgramDrafter:
    def __init__(self, ngram_max: int = DEFAULT_NGRAM_MAX, ngram_min: int = DEFAULT_NGRAM_MIN) -> None:
        check_ngram_sizes(ngram_max, ngram_min)
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.history: list[int] = []
        # continuation_start[n][ngram] = index just after the latest occurrence of ``ngram``
        # that has at least one token after it.
        self._continuation_start: dict[int, dict[tuple[int, ...], int]] = {}

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        self.history = []
        self._continuation_start = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}

    def extend(self, tokens: list[int]) -> None:
        """Append newly committed tokens (host ints) to the history and the n-gram maps."""
        for token in tokens:
            end = len(self.history)  # index of the token being appended
            for n, table in self._continuation_start.items():
                if end >= n:
                    table[tuple(self.history[end - n : end])] = end
            self.history.append(token)

    def on_committed(self, tokens: list[int]) -> None:
        self.extend(tokens)

    def match(self, num_tokens: int) -> tuple[list[int], int]:
        """(continuation, n) of the longest, then most recent, match of the history's tail;
        ([], 0) when nothing matches."""
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(self.history) <= n:
                continue
            start = self._continuation_start[n].get(tuple(self.history[-n:]))
            if start is not None:
                return self.history[start : start + num_tokens], n
        return [], 0

    def lookup(self, num_tokens: int) -> list[int]:
        return self.match(num_tokens)[0]

    def propose(
        self,
        committed: torch.Tensor,  # (1, L) long
        num_tokens: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        if committed.shape[0] != 1:
            raise InvalidRequestError("The n-gram drafter handles one sequence at a time.")
        if len(self.history) < committed.shape[1]:  # a caller that does not call on_committed
            self.extend(committed[0, len(self.history) :].tolist())
        proposal, _ = self.match(num_tokens)
        tokens = host_to_device(proposal, torch.long, committed.device).reshape(1, len(proposal))
        return DraftProposal(tokens=tokens, probs=None)

    def on_verified(self, num_accepted: int) -> None:
        # Nothing to roll back: the history only ever holds committed tokens.
        pass
