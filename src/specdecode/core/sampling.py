"""Logits to probabilities and tokens.

The same ``LogitsProcessor`` is applied to the target's and the draft's logits: rejection
sampling is lossless only if p and q are the distributions the two models would actually
sample from, after temperature, top-k, top-p and min-p. Penalties and logit bias
(engine/penalties.py) come before them, per row: the target's rows in the engines, a draft
model's rows in ``draw`` as its draft walks. Under a grammar the target's rows are masked
before they get here (engine/grammar.py); a drafter's rows are masked in ``draw`` by the
request's grammar as the draft walks it, so the draft proposes only tokens the grammar allows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.core.categorical import argmax_last, sample_categorical
from specdecode.core.logprobs import log_distribution
from specdecode.core.tree import TokenTree


# The engine (grammar, penalties) and config sit above this package: what the processor reads of
# them is named here by what it calls.
class SamplingSettings(Protocol):
    """What ``from_params`` reads of a request's sampling parameters (config.SamplingParams)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    logprobs: int | None
    logprobs_mode: str


class DraftWalk(Protocol):
    """Per-request state a draft walks token by token and then forgets (``draw``)."""

    def begin_draft(self) -> None: ...

    def push_draft(self, token: torch.Tensor) -> None: ...  # (1,) long

    def end_draft(self) -> None: ...


class DraftGrammar(DraftWalk, Protocol):
    """A request's grammar (engine/grammar.py's ``GrammarState``) as a draft walks it."""

    def mask_draft(self, logits: torch.Tensor) -> torch.Tensor: ...  # (1, V) -> (1, V)


class DraftPenalties(DraftWalk, Protocol):
    """A request's penalties and logit bias (engine/penalties.py's ``TokenPenalties``): a draft
    walks them, and the engines penalise their verify rows through the processor."""

    def draft_row(self, logits: torch.Tensor) -> torch.Tensor: ...  # (1, V') -> (1, V') float32

    def advance(self, tokens: torch.Tensor) -> None: ...  # (n,) long, on the device

    def chain_rows(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor: ...  # (k + 1, V)

    def tree_rows(self, logits: torch.Tensor, tree: TokenTree) -> torch.Tensor: ...  # (N, V)


@dataclass(slots=True, frozen=True)
class LogitsProcessor:
    temperature: float
    top_k: int
    top_p: float
    # The request's grammar (structured outputs), walked by drafts in ``draw``; None: no grammar.
    grammar: DraftGrammar | None = None
    min_p: float = 0.0
    # The request's penalties and logit bias, walked by drafts in ``draw``; None: none.
    penalties: DraftPenalties | None = None
    # Report each token's log-probability and the ``logprobs`` most likely (core/logprobs.py).
    logprobs: int | None = None
    logprobs_mode: str = "raw"

    @classmethod
    def from_params(cls, params: SamplingSettings, grammar: DraftGrammar | None = None,
                    penalties: DraftPenalties | None = None) -> LogitsProcessor:
        return cls(params.temperature, params.top_k, params.top_p, grammar, params.min_p, penalties,
                   params.logprobs, params.logprobs_mode)

    def logprob_rows(
        self,
        raw: torch.Tensor,  # (T, V): the model's logits
        processed: torch.Tensor,  # (T, V): after grammar, bias and penalties
        probs: torch.Tensor | None,  # (T, V): the sampled-from distribution (None: greedy)
    ) -> torch.Tensor:  # (T, V) float32 log-probabilities in this request's mode
        if self.logprobs_mode == "raw":
            return log_distribution(raw)
        return log_distribution(processed, probs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def begin_draft(self) -> None:
        """A draft walk starts at the committed tokens (its grammar place, its penalty counts)."""
        if self.grammar is not None:
            self.grammar.begin_draft()
        if self.penalties is not None:
            self.penalties.begin_draft()

    def end_draft(self) -> None:
        """Back to the committed tokens, whatever the walk did."""
        if self.grammar is not None:
            self.grammar.end_draft()
        if self.penalties is not None:
            self.penalties.end_draft()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:  # (..., V) -> (..., V) float32
        """Sampling distribution: temperature, then top-k, top-p (nucleus) and min-p, as HF
        orders them (penalties and bias are already in ``logits``)."""
        if self.greedy:
            raise ValueError("greedy decoding has no sampling distribution; use argmax")
        scaled = logits.float() / self.temperature
        vocab = scaled.shape[-1]
        if 0 < self.top_k < vocab:
            top, order = torch.topk(scaled, self.top_k, dim=-1)  # (..., K), most likely first
            kth = top[..., -1:]
            # On the CPU a small top-k is worked out on its K tokens alone, unless a token
            # outside them ties with the k-th (HF keeps ties): the full-row masks and softmaxes
            # cost ~2 ms a 151,936-token row on two cores. (A GPU keeps the dense path: the
            # tie check would read the device.)
            if (scaled.device.type == "cpu" and self.top_k <= NUCLEUS_FIRST_CANDIDATES
                    and not bool(((scaled >= kth).sum(-1) > self.top_k).any())):
                return torch.zeros_like(scaled).scatter(-1, order, self._filter(top, sorted_=True))
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        return self._filter(scaled, sorted_=False)

    def _filter(self, scaled: torch.Tensor, sorted_: bool) -> torch.Tensor:  # (..., N) -> (..., N) float32
        """Top-p and min-p over the candidates ``scaled`` (a whole row with -inf where top-k
        dropped tokens, or the top-k alone, most likely first when ``sorted_``), then softmax."""
        if self.top_p < 1.0:
            keep = nucleus_of_sorted(scaled.softmax(-1), self.top_p) if sorted_ else nucleus(scaled, self.top_p)
            scaled = scaled.masked_fill(~keep, float("-inf"))
        probs = scaled.softmax(-1)
        if self.min_p > 0.0:
            # Relative to the most likely token, which always survives; renormalised after.
            keep = probs >= self.min_p * probs.amax(dim=-1, keepdim=True)
            probs = probs * keep
            probs = probs / probs.sum(-1, keepdim=True)
        return probs


# On the CPU the nucleus is looked for among the most likely NUCLEUS_FIRST_CANDIDATES tokens
# first, the whole row only when they hold less than top_p of the mass: a full sort of a
# 151,936-token row costs 13 ms on two cores, a top-512 0.5 ms.
NUCLEUS_FIRST_CANDIDATES = 512


def nucleus(
    scaled: torch.Tensor,  # (..., V) float32 logits (temperature applied, -inf where masked)
    top_p: float,
) -> torch.Tensor:  # (..., V) bool: kept
    """Top-p: a token is kept unless the tokens ranked above it already hold top_p of the mass
    (HF's rule); the most likely token always survives. Tokens outside the k most likely are
    dropped once those k hold top_p (the mass above any of them is at least theirs), so only
    the top k need sorting. On a GPU the whole row is sorted at once (fast there; checking
    whether k suffices would read the device)."""
    probs = scaled.softmax(-1)
    vocab = probs.shape[-1]
    enough = False
    if probs.device.type == "cpu" and vocab > NUCLEUS_FIRST_CANDIDATES:
        top, order = torch.topk(probs, NUCLEUS_FIRST_CANDIDATES, dim=-1)  # most likely first
        enough = bool((top.sum(-1) >= top_p).all())  # a host read, free on the CPU
    if not enough:  # a GPU, or a flat row: sort it whole
        top, order = torch.sort(probs, dim=-1, descending=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, nucleus_of_sorted(top, top_p))


def nucleus_of_sorted(
    probs: torch.Tensor,  # (..., N) float: probabilities, most likely first
    top_p: float,
) -> torch.Tensor:  # (..., N) bool: kept
    keep = probs.cumsum(-1) - probs < top_p
    # A top_p below float32's smallest value rounds to 0 and would drop every token.
    keep[..., 0] = True
    return keep


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs (N, V) -> (N,) long (core/categorical.py: torch.multinomial's
    distribution at a fifteenth of its cost over a 150k vocabulary)."""
    return sample_categorical(probs, generator)


def draw(
    logits: torch.Tensor,  # (N, V)
    processor: LogitsProcessor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A drafter's next token (N,) and the distribution q (N, V) it was drawn from; greedy: the
    argmax and None (a deterministic draft). Under a grammar (N == 1) the row is masked by the
    draft's place in it and the token moves that place on (``DraftGrammar.begin_draft``); with
    penalties the row is penalised by the committed tokens and the walk's drafts so far."""
    grammar, penalties = processor.grammar, processor.penalties
    if penalties is not None:
        logits = penalties.draft_row(logits)
    if grammar is not None:
        logits = grammar.mask_draft(logits)
    if processor.greedy:
        token, q = argmax_last(logits), None
    else:
        q = processor.probs(logits)
        token = sample(q, generator)
    if grammar is not None:
        grammar.push_draft(token)
    if penalties is not None:
        penalties.push_draft(token)
    return token, q


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
