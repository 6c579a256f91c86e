"""Repetition, frequency and presence penalties and logit bias, exact under speculation.

A penalty makes a token's logit depend on the tokens before it, so under speculation each row
of a verify pass is penalised with what precedes *that* row: the committed tokens plus the
drafts before it. Row i of a chain (drafts d_1..d_k) sees the committed counts plus d_1..d_i;
node i of a token tree sees the committed counts plus the tokens on the path root..i. Each row
is then exactly the row plain decoding with the same penalties would sample from at that
position, so greedy output equals plain greedy output and rejection sampling stays exact.

A draft model's rows are penalised the same way as its draft walks (``begin_draft``,
``push_draft``, ``end_draft``, like the grammar's walk): not needed for exactness (rejection
sampling is exact for any q, as long as q is what the draft sampled from), but a draft that
repeats what the target is penalised for would be rejected there.

Semantics (vLLM's and OpenAI's): ``presence_penalty`` and ``frequency_penalty`` count the
generated tokens only (logit -= frequency * count + presence * (count > 0));
``repetition_penalty`` (CTRL, HF's and llama.cpp's) covers prompt and generated tokens (a
positive logit is divided by it, a negative one multiplied); ``logit_bias`` is added to the
logits first. All state lives on the device: no host read is added to a step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.config import SamplingParams
from specdecode.core.device import host_to_device
from specdecode.core.tree import TokenTree


def wants_penalties(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias)


class TokenPenalties:
    """One request's penalty state: its generated tokens' counts and the tokens it has seen."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int,
                 device: torch.device) -> None:
        self.presence = float(params.presence_penalty)
        self.frequency = float(params.frequency_penalty)
        self.repetition = float(params.repetition_penalty)
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # generated tokens
        # Tokens of the prompt, for the repetition penalty (the generated ones are counts > 0).
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if self.repetition != 1.0 and prompt_ids:
            ids = host_to_device([t for t in prompt_ids if 0 <= t < vocab_size], torch.long, device)
            self.in_prompt[ids] = True
        self.bias: torch.Tensor | None = None  # (V,) float32
        if params.logit_bias:
            bias = torch.zeros(vocab_size, dtype=torch.float32)
            for token, value in params.logit_bias.items():
                if token < vocab_size:  # an id past the model's vocabulary has no logit to bias
                    bias[token] = value
            self.bias = bias.to(device)
        self._walk: list[torch.Tensor] = []  # (1,) long each: a draft walk's tokens so far

    def advance(self, tokens: torch.Tensor) -> None:  # (n,) long, on the device
        """Count committed tokens."""
        if tokens.numel():
            self.counts.index_add_(0, tokens, torch.ones(tokens.shape[0], device=self.counts.device))

    def _apply(
        self,
        logits: torch.Tensor,  # (T, V')
        counts: torch.Tensor,  # (T, V) float: generated tokens before each row
    ) -> torch.Tensor:  # (T, V') float32
        width = min(logits.shape[-1], self.vocab_size)
        out = logits.float().clone()
        head, counts = out[:, :width], counts[:, :width]
        if self.bias is not None:
            head += self.bias[:width]
        if self.repetition != 1.0:
            seen = (counts > 0) | self.in_prompt[:width]
            penalised = torch.where(head > 0, head / self.repetition, head * self.repetition)
            head.copy_(torch.where(seen, penalised, head))
        if self.frequency:
            head -= self.frequency * counts
        if self.presence:
            head -= self.presence * (counts > 0).float()
        return out

    def chain_rows(
        self,
        logits: torch.Tensor,  # (k + 1, V): rows after the committed tokens and after each draft
        drafts: torch.Tensor,  # (k,) long: the drafts, row i follows drafts[:i]
    ) -> torch.Tensor:  # (k + 1, V) float32
        rows = logits.shape[0]
        added = torch.zeros((rows, self.vocab_size), device=self.counts.device)
        if rows > 1:
            added[1:].scatter_(1, drafts[: rows - 1, None].clamp(0, self.vocab_size - 1), 1.0)
        return self._apply(logits, self.counts + added.cumsum(0))

    def tree_rows(
        self,
        logits: torch.Tensor,  # (N, V): node i's row follows the path root..i
        tree: TokenTree,
    ) -> torch.Tensor:  # (N, V) float32
        device = self.counts.device
        # The root is the last committed token (already counted): its one-hot row stays zero.
        onehot = torch.zeros((tree.size, self.vocab_size), device=device)
        onehot[1:].scatter_(1, tree.tokens[1:, None].clamp(0, self.vocab_size - 1), 1.0)
        on_path = tree.ancestor_mask(device).float()  # (N, N): [i, j] = j on the path root..i
        return self._apply(logits, self.counts + on_path @ onehot)

    # A draft model's walk (sampling.draw): its rows penalised by the committed tokens plus its
    # own drafts so far.
    def begin_draft(self) -> None:
        self._walk = []

    def draft_row(self, logits: torch.Tensor) -> torch.Tensor:  # (1, V') -> (1, V') float32
        counts = self.counts
        if self._walk:
            counts = counts.index_add(0, torch.cat(self._walk).clamp(0, self.vocab_size - 1),
                                      torch.ones(len(self._walk), device=counts.device))
        return self._apply(logits, counts[None])

    def push_draft(self, token: torch.Tensor) -> None:  # (1,) long
        self._walk.append(token.reshape(1))

    def end_draft(self) -> None:
        self._walk = []
