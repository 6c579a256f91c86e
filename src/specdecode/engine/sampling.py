"""Logits to probabilities and tokens.

The same ``LogitsProcessor`` is applied to the target's and the draft's logits: rejection
sampling is lossless only if p and q are the distributions the two models would actually
sample from, after temperature, top-k and top-p. Under a grammar the target's rows are masked
before they get here (engine/grammar.py); a drafter's rows are masked in ``draw`` by the
request's grammar as the draft walks it, so the draft proposes only tokens the grammar allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdecode.config import SamplingParams

if TYPE_CHECKING:
    from specdecode.engine.grammar import GrammarState


@dataclass(slots=True, frozen=True)
class LogitsProcessor:
    temperature: float
    top_k: int
    top_p: float
    # The request's grammar (structured outputs), walked by drafts in ``draw``; None: no grammar.
    grammar: GrammarState | None = None

    @classmethod
    def from_params(cls, params: SamplingParams, grammar: GrammarState | None = None) -> LogitsProcessor:
        return cls(params.temperature, params.top_k, params.top_p, grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # (..., V) -> (..., V) float32
        """Sampling distribution: temperature, then top-k, then top-p (nucleus), as HF orders them."""
        if self.greedy:
            raise ValueError("greedy decoding has no sampling distribution; use argmax")
        scaled = logits.float() / self.temperature
        vocab = scaled.shape[-1]
        if 0 < self.top_k < vocab:
            kth = torch.topk(scaled, self.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # Drop a token when the tokens ranked above it already hold top_p of the mass;
            # the most likely token always survives.
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            drop_sorted = mass_before >= self.top_p
            # A top_p below float32's smallest value rounds to 0 and would drop every token.
            drop_sorted[..., 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
        return scaled.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs (N, V) -> (N,) long."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def draw(
    logits: torch.Tensor,  # (N, V)
    processor: LogitsProcessor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's next token (N,) and the distribution q (N, V) it was drawn from; greedy: the
    argmax and None (a deterministic draft). Under a grammar (N == 1) the row is masked by the
    draft's place in it and the token moves that place on (``GrammarState.begin_draft``)."""
    grammar = processor.grammar
    if grammar is not None:
        logits = grammar.mask_draft(logits)
    if processor.greedy:
        token, q = logits.argmax(dim=-1), None
    else:
        q = processor.probs(logits)
        token = sample(q, generator)
    if grammar is not None:
        grammar.push_draft(token)
    return token, q


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
