"""The auto method: each step, whichever way of guessing pays best by measured goodput.

Three sources compete every step: prompt lookup (n-gram, no model pass), the draft model, and
plain decoding (no draft). The lookup runs first because it costs microseconds; then each
source's expected tokens per second, E(a, k) / cost(k) (``schedule.expected_tokens``), is
estimated and the best one drafts:

- acceptance a per source, pooled over recent steps with forgetting (``AcceptanceEstimate``):
  one for the draft model, and one per match length n for prompt lookup (a 3-token match is
  accepted far more often than a 1-token one);
- cost: the target's verify pass over k + 1 rows (measured once per engine, kept current from
  live steps), plus k draft passes for the draft model (measured once per decoder, then live);
- catch-up: the draft model reads the sequence only when it drafts, so its first use in a
  request, or its first after a run of lookup or plain steps, first feeds every token it
  missed. That one-off cost is spread over the tokens the request may still produce (at most
  ``CATCH_UP_HORIZON``), so a long prompt with a short answer never pays a draft prefill it
  cannot earn back (where the draft method loses: RAG, QA), and a request that never needs
  the draft model never runs it at all.

After ``PROBE_AFTER`` plain steps in a row the draft model, if it was used before in the
request, drafts ``PROBE_K`` tokens again, so its stale estimate can recover. Choosing only
changes what is proposed, never the acceptance rule: output stays lossless.

The drafter is also its own draft-length schedule (``schedule.KSchedule``): choosing the source
and k is one decision, and it needs the verify times that only the schedule hears about.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..sampling import LogitsProcessor
from ..schedule import PROBE_AFTER, PROBE_K, AcceptanceEstimate, best_plan, blend
from .base import DraftProposal
from .draft_model import DraftModelDrafter
from .ngram import NgramDrafter

CATCH_UP_HORIZON = 64  # most future tokens a draft catch-up is spread over
CATCH_UP_FREE_TOKENS = 2  # a normal draft pass feeds the one or two newly committed tokens
SOURCES = ("ngram", "draft", "none")


@dataclass(slots=True, frozen=True)
class DraftCosts:
    """The draft model's measured costs on this machine (``engine.time_passes``)."""

    pass_seconds: float  # one pass over one token
    token_seconds: float  # per token of a long catch-up pass


class AutoDrafter:
    def __init__(
        self,
        ngram: NgramDrafter,
        draft: DraftModelDrafter | None,
        verify_seconds: list[float],  # index r - 1: a target pass over r rows; >= k_max + 1 entries
        k_max: int,
        draft_costs: DraftCosts | None = None,
        live_costs: bool = True,  # update costs from steps; False where timings are asynchronous
    ) -> None:
        if draft is not None and draft_costs is None:
            raise ValueError("A draft model needs its measured costs (DraftCosts).")
        self.ngram = ngram
        self.draft = draft
        self.verify_seconds = list(verify_seconds)
        self.k_max = k_max
        self.live_costs = live_costs
        self.draft_pass_seconds = draft_costs.pass_seconds if draft_costs else 0.0
        self.draft_token_seconds = draft_costs.token_seconds if draft_costs else 0.0
        self.draft_acceptance = AcceptanceEstimate()
        self.ngram_acceptance: dict[int, AcceptanceEstimate] = {}
        # Steps each source drafted (or decoded plainly): reported in GenerationStats.
        self.steps_by_source: Counter[str] = Counter()
        self.source = "none"  # of the last step
        self._match_size = 0
        self._catch_up = 0
        self._draft_used = False
        self._plain_streak = 0
        self._capacity = 0

    # -- schedule side -------------------------------------------------------------------------
    def next_k(self) -> int:
        return self.k_max  # the real choice is made in propose, once the lookup has run

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int, verify_seconds: float) -> None:
        if self.live_costs and proposed + 1 <= len(self.verify_seconds):
            self.verify_seconds[proposed] = blend(self.verify_seconds[proposed], verify_seconds)
        self._plain_streak = self._plain_streak + 1 if proposed == 0 else 0
        self.steps_by_source[self.source if proposed else "none"] += 1
        if proposed == 0:
            return
        if self.source == "ngram":
            self._ngram_estimate(self._match_size).observe(proposed, accepted)
        elif self.source == "draft":
            self.draft_acceptance.observe(proposed, accepted)
            # A pass that also caught up on many missed tokens says nothing about a normal one.
            if self.live_costs and draft_passes > 0 and self._catch_up <= CATCH_UP_FREE_TOKENS:
                self.draft_pass_seconds = blend(self.draft_pass_seconds, draft_seconds / draft_passes)

    def _ngram_estimate(self, match_size: int) -> AcceptanceEstimate:
        return self.ngram_acceptance.setdefault(match_size, AcceptanceEstimate())

    # -- drafter side --------------------------------------------------------------------------
    def start(self, prompt_len: int, capacity: int) -> None:
        self.ngram.start(prompt_len, capacity)
        if self.draft is not None:
            self.draft.start(prompt_len, capacity)  # allocation only: it reads the prompt when first used
        self._capacity = capacity

    def plan(self, length: int, num_tokens: int, lookup_tokens: int, match_size: int) -> tuple[str, int]:
        """(source, k) with the highest expected tokens per second for this step.

        ``length``: committed tokens; ``num_tokens``: the most the engine lets this step draft;
        ``lookup_tokens``: tokens the n-gram lookup found (0: no match) for a match of
        ``match_size``.
        """
        best = ("none", 0, 1.0 / self.verify_seconds[0])
        if lookup_tokens > 0:
            k, rate = best_plan(self._ngram_estimate(match_size).rate, self.verify_seconds, 0.0, lookup_tokens, k_min=1)
            if rate > best[2]:
                best = ("ngram", k, rate)
        if self.draft is not None:
            if self._draft_used and self._plain_streak >= PROBE_AFTER:
                return "draft", min(PROBE_K, num_tokens)
            k, rate = best_plan(self.draft_acceptance.rate, self.verify_seconds, self.draft_pass_seconds, num_tokens, k_min=1)
            missed = length - self.draft.cached_len
            catch_up_seconds = max(0, missed - CATCH_UP_FREE_TOKENS) * self.draft_token_seconds
            if catch_up_seconds > 0 and rate > 0:
                horizon = max(1, min(self._capacity - 1 - length, CATCH_UP_HORIZON))
                rate = 1.0 / (1.0 / rate + catch_up_seconds / horizon)
            if rate > best[2]:
                best = ("draft", k, rate)
        return best[0], best[1]

    def propose(
        self,
        committed: torch.Tensor,  # (1, L) long
        num_tokens: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        length = committed.shape[1]
        lookup = self.ngram.propose(committed, num_tokens, processor, generator)
        self._match_size = self.ngram.last_match_size
        self.source, k = self.plan(length, num_tokens, lookup.num_tokens, self._match_size)
        if self.source == "ngram":
            return DraftProposal(tokens=lookup.tokens[:, :k], probs=None)
        if self.source == "draft":
            assert self.draft is not None
            self._catch_up = length - self.draft.cached_len
            self._draft_used = True
            return self.draft.propose(committed, k, processor, generator)
        return DraftProposal(tokens=lookup.tokens[:, :0], probs=None)

    def on_verified(self, num_accepted: int) -> None:
        if self.source == "draft":
            assert self.draft is not None
            self.draft.on_verified(num_accepted)
