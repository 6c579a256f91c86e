"""The auto method: each step, whichever way of guessing pays best by measured goodput.

Four sources compete every step: prompt lookup (n-gram, no model pass), suffix decoding (the
best chain of ``drafters/suffix.py``: the request's text and earlier responses, no model pass),
the draft model, and plain decoding (no draft). The lookups run first because they cost
microseconds; then the source with the highest expected tokens per second steps:

- plain decoding: one token per target pass over one row (measured once per engine, kept
  current from live steps);
- prompt lookup, suffix decoding and the draft model: their goodput measured on their own recent steps,
  tokens emitted over seconds spent drafting and verifying, pooled with forgetting
  (``GoodputEstimate``, a window of ~30 steps: the choice is per request more than per
  step). Prompt lookup keeps one estimate per match length n (a 3-token match is accepted far
  more often than a 1-token one), suffix decoding one per match-length bucket (1, 2-3, 4-7,
  8-15, 16+). Each starts from a hopeful prior, so it gets tried (a
  lookup, which costs only extra verified rows, more hopefully than the draft model), and its
  own measurements take over. Measured, not modelled: acceptance comes in
  runs and the draft model stops early where it is unsure, which an i.i.d. model of
  E(a, k) misprices;
- lookup memory: what each (source, match size) earned in this decoder's earlier requests
  (``LookupMemory``, faded at every new request) caps that hopeful prior, so a match size that
  lost recently is not re-learnt by two or three losing steps in every request: short answers paid
  that most (17-step translations on llama.cpp, where an extra verify row costs 0.7 of a pass,
  lost ~20% to it). One that paid starts from the hopeful prior as before; one that lost is
  tried again once its old evidence has faded (``MEMORY_DECAY``);
- catch-up: the draft model reads the sequence only when it drafts, so its first use in a
  request, or its first after a run of lookup or plain steps, first feeds every token it
  missed. That one-off cost (per token, measured once per decoder) is spread over the tokens
  the request may still produce (at most ``CATCH_UP_HORIZON``), so a long prompt with a short
  answer never pays a draft prefill it cannot earn back, and a request that never needs the
  draft model never runs it.

The draft model drafts up to ``draft_k`` tokens (its confidence cut-off ends drafts early);
prompt lookup proposes as many found tokens (up to ``k_max``) as pay under
``k_policy.best_plan`` with its per-match acceptance; suffix decoding its cost-aware chain
(``SuffixProposer`` with the verify costs: up to ``suffix_depth``, past ``k_max``, where its
match and calibrated path probabilities say a long copy is coming). After ``DRAFT_RETRY_AFTER`` steps without
the draft model and no lookup match, a
draft model used earlier in the request drafts again, so a stale estimate can recover.
Choosing only changes what is proposed, never the acceptance rule: output stays lossless.

The drafter is also its own draft-length schedule (``k_policy.KSchedule``): choosing the source
and k is one decision, and it needs the step times that only the schedule hears about.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from specdecode.backends.base import SequenceModel
from specdecode.backends.device import host_to_device
from specdecode.costs.k_policy import (
    AcceptanceEstimate,
    GoodputEstimate,
    best_plan,
    speculation_can_pay,
    update_verify_cost,
)
from specdecode.drafters.base import DraftProposal
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.drafters.suffix_cache import match_bucket
from specdecode.engine.sampling import LogitsProcessor

CATCH_UP_HORIZON = 64  # most future tokens a draft catch-up is spread over
CATCH_UP_FREE_TOKENS = 2  # a normal draft pass feeds the one or two newly committed tokens
PRIOR_GAIN = 1.25  # an untried draft model is assumed this much faster than plain decoding ...
PRIOR_STEPS = 2.0  # ... with the weight of this many plain steps' time
# An untried lookup match length is assumed to pay this much: trying one costs only a few
# extra verified rows, and a source that is never tried is never measured.
LOOKUP_PRIOR_GAIN = 2.0
# Steps without the draft model (and no lookup match) before it drafts again. Not
# k_policy.PROBE_AFTER, which counts plain steps in a row before a schedule drafts a short
# probe (PROBE_K tokens, waiting longer after each probe that does not pay): this counts steps
# any other source took (lookup steps included) before the draft model, whose goodput estimate
# only its own steps update, drafts its full draft_k again.
DRAFT_RETRY_AFTER = 6


# Weight kept by what earlier requests measured, per request that starts: old evidence fades
# over a few requests, so a match size that lost is tried again (its rate drifts back to the
# hopeful prior: after losing in one request, about four requests later where extra verify
# rows are dear) and the memory follows a change of workload.
MEMORY_DECAY = 0.8
MEMORY_PRIOR_STEPS = 1.0  # plain steps' weight of the hopeful prior inside the memory

LookupKey = tuple[str, int]  # (source "ngram" or "suffix", match size or bucket)
# The lookup memory keeps requests with prompts of at least this many tokens apart from shorter
# ones: a long prompt (a document to summarise or answer from) gives lookups text to copy, and
# what they earned on short questions says little about it. Measured on llama.cpp: after the
# bench's short-prompt categories had taught the memory that lookups lose, auto decoded
# summarization prompts plainly where the oracle copied (70% of its ceiling; 77% with no
# short prompts before them).
LONG_PROMPT_TOKENS = 512
MemoryKey = tuple[str, int, int]  # a LookupKey and 1 for a long prompt, else 0


@dataclass(slots=True)
class LookupMemory:
    """Tokens emitted and seconds spent by lookup steps in a decoder's earlier requests, per
    (source, match size): shared by the per-request auto drafters of one decoder (one at a time)."""

    tokens: dict[MemoryKey, float] = field(default_factory=dict)
    seconds: dict[MemoryKey, float] = field(default_factory=dict)

    def start_request(self) -> None:
        for key in list(self.tokens):  # a copy: another thread's request may add a key meanwhile
            self.tokens[key] *= MEMORY_DECAY
            self.seconds[key] *= MEMORY_DECAY

    def observe(self, key: MemoryKey, tokens: int, seconds: float) -> None:
        self.tokens[key] = self.tokens.get(key, 0.0) + tokens
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def prior_gain(self, key: MemoryKey, hopeful_gain: float, plain_seconds: float) -> float:
        """The hopeful prior (a gain over plain decoding) pooled with what this key earned before,
        never above the hopeful gain: memory only holds back a key that lost, it never makes a
        new request less willing to measure a key that paid."""
        tokens = hopeful_gain * MEMORY_PRIOR_STEPS + self.tokens.get(key, 0.0)
        seconds = MEMORY_PRIOR_STEPS * plain_seconds + self.seconds.get(key, 0.0)
        return min(hopeful_gain, tokens / seconds * plain_seconds)


class AutoDrafter:
    def __init__(
        self,
        ngram: NgramDrafter,
        draft: DraftModelDrafter | None,
        verify_seconds: list[float],  # index r - 1: a target pass over r rows; >= max(k_max, suffix_depth) + 1 entries
        k_max: int,
        draft_k: int = 5,
        draft_pass_seconds: float = 0.0,  # one draft-model pass over one token
        draft_token_seconds: float = 0.0,  # the draft model's cost per token of a long catch-up pass
        live_costs: bool = True,  # update verify costs from steps; False where timings are asynchronous
        suffix: SuffixDrafter | None = None,
        memory: LookupMemory | None = None,  # the decoder's, across requests; None: this request only
        suffix_depth: int | None = None,  # the most a suffix chain drafts (None: k_max)
    ) -> None:
        self.ngram = ngram
        self.suffix = suffix
        self.draft = draft
        self.verify_seconds = list(verify_seconds)
        self.k_max = k_max
        # The most one step drafts: suffix chains may go past k_max (``suffix_depth``).
        self.k = max(k_max, suffix_depth or 0) if suffix is not None else k_max
        if len(self.verify_seconds) < self.k + 1:
            raise ValueError(f"verify_seconds has {len(self.verify_seconds)} row counts; drafting {self.k} needs {self.k + 1}.")
        self.draft_k = min(draft_k, k_max)
        self.draft_token_seconds = draft_token_seconds
        # A draft model that loses to plain decoding even at full acceptance is never tried.
        self.draft_can_pay = draft is not None and speculation_can_pay(self.verify_seconds, draft_pass_seconds, self.draft_k)
        self.live_costs = live_costs
        self.draft_goodput = self._prior()
        # Per lookup source ("ngram", "suffix") and match size: goodput and acceptance.
        self.lookup_goodput: dict[tuple[str, int], GoodputEstimate] = {}
        self.lookup_acceptance: dict[tuple[str, int], AcceptanceEstimate] = {}
        self.memory = memory if memory is not None else LookupMemory()
        # Steps each source drafted (or decoded plainly): reported in GenerationStats.
        self.steps_by_source: Counter[str] = Counter()
        self.source = "none"  # of the last step
        self._match_size = 0  # of the last step's lookup (n, or the suffix match's bucket)
        self._long_prompt = 0  # 1 when this request's prompt has LONG_PROMPT_TOKENS or more
        self._catch_up = 0
        self._draft_used = False
        self._since_draft = 0
        self._capacity = 0

    def _prior(self, gain: float = PRIOR_GAIN) -> GoodputEstimate:
        plain = self.verify_seconds[0]
        return GoodputEstimate(prior_rate=gain / plain, prior_seconds=PRIOR_STEPS * plain)

    def _memory_key(self, source: str, match_size: int) -> MemoryKey:
        return (source, match_size, self._long_prompt)

    def _lookup_estimates(self, source: str, match_size: int) -> tuple[GoodputEstimate, AcceptanceEstimate]:
        key = (source, match_size)
        if key not in self.lookup_goodput:
            self.lookup_goodput[key] = self._prior(self.memory.prior_gain(self._memory_key(source, match_size),
                                                                          LOOKUP_PRIOR_GAIN, self.verify_seconds[0]))
            self.lookup_acceptance[key] = AcceptanceEstimate()
        return self.lookup_goodput[key], self.lookup_acceptance[key]

    def _catch_up_seconds(self, missed: int) -> float:
        return max(0, missed - CATCH_UP_FREE_TOKENS) * self.draft_token_seconds

    # -- schedule side -------------------------------------------------------------------------
    def next_k(self) -> int:
        return self.k  # the real choice is made in propose, once the lookup has run

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int, verify_seconds: float) -> None:
        if self.live_costs:
            update_verify_cost(self.verify_seconds, proposed, verify_seconds)
        source = self.source if proposed else "none"
        self.steps_by_source[source] += 1
        self._since_draft = 0 if source == "draft" else self._since_draft + 1
        if source in ("ngram", "suffix"):
            goodput, acceptance = self._lookup_estimates(source, self._match_size)
            goodput.observe(accepted + 1, draft_seconds + verify_seconds)
            acceptance.observe(proposed, accepted)
            self.memory.observe(self._memory_key(source, self._match_size), accepted + 1, draft_seconds + verify_seconds)
        elif source == "draft":
            # A catch-up is a one-off cost, priced separately: keep it out of the step's rate.
            drafting = max(0.0, draft_seconds - self._catch_up_seconds(self._catch_up))
            self.draft_goodput.observe(accepted + 1, drafting + verify_seconds)

    # -- drafter side --------------------------------------------------------------------------
    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        self.ngram.start(prompt_len, capacity, target)
        if self.suffix is not None:
            self.suffix.start(prompt_len, capacity, target)
        if self.draft is not None:
            self.draft.start(prompt_len, capacity, target, shared_prefix)  # allocation only: it reads the prompt when first used
        self._capacity = capacity
        self.memory.start_request()
        self._long_prompt = int(prompt_len >= LONG_PROMPT_TOKENS)

    def on_committed(self, tokens: list[int]) -> None:
        self.ngram.on_committed(tokens)
        if self.suffix is not None:
            self.suffix.on_committed(tokens)
        if self.draft is not None:
            self.draft.on_committed(tokens)

    def plan(
        self, length: int, num_tokens: int, lookup_tokens: int, match_size: int, suffix_tokens: int = 0,
        suffix_bucket: int = 0,
    ) -> tuple[str, int]:
        """(source, k) with the highest expected tokens per second for this step.

        ``length``: committed tokens; ``num_tokens``: the most the engine lets this step draft;
        ``lookup_tokens``: tokens the n-gram lookup found (0: no match) for a match of
        ``match_size``; ``suffix_tokens``: the suffix chain's length (0: none) for a match in
        ``suffix_bucket``.
        """
        best = ("none", 0, 1.0 / self.verify_seconds[0])
        for source, found, size in (("ngram", lookup_tokens, match_size), ("suffix", suffix_tokens, suffix_bucket)):
            if found > 0:
                goodput, acceptance = self._lookup_estimates(source, size)
                # A suffix chain already holds what pays by its own calibrated path probabilities
                # (it decays along the chain, where one acceptance rate for every depth cannot
                # tell a 30-token copy from a guess); a lookup's length is priced here.
                k = found if source == "suffix" else best_plan(acceptance.rate, self.verify_seconds, 0.0, found, k_min=1)[0]
                if goodput.rate > best[2]:
                    best = (source, k, goodput.rate)
        if self.draft is not None and self.draft_can_pay:
            k = min(self.draft_k, num_tokens)
            if self._draft_used and self._since_draft >= DRAFT_RETRY_AFTER and lookup_tokens == 0 and suffix_tokens == 0:
                return "draft", k
            rate = self.draft_goodput.rate
            catch_up = self._catch_up_seconds(length - self.draft.cached_len)
            if catch_up > 0:
                horizon = max(1, min(self._capacity - 1 - length, CATCH_UP_HORIZON))
                rate = 1.0 / (1.0 / rate + catch_up / horizon)
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
        lookup = self.ngram.propose(committed, min(num_tokens, self.k_max), processor, generator)
        chain = self.suffix.proposer.propose(num_tokens, tree=False, mark=False) if self.suffix is not None else None
        suffix_tokens, suffix_bucket = (len(chain), match_bucket(chain.match_len)) if chain else (0, 0)
        self.source, k = self.plan(length, num_tokens, lookup.num_tokens, self.ngram.last_match_size, suffix_tokens,
                                   suffix_bucket)
        self._match_size = suffix_bucket if self.source == "suffix" else self.ngram.last_match_size
        if self.source == "ngram":
            return DraftProposal(tokens=lookup.tokens[:, :k], probs=None)
        if self.source == "suffix":
            assert self.suffix is not None and chain is not None
            kept = self.suffix.proposer.keep(chain, k)
            return DraftProposal(tokens=host_to_device(kept.tokens, torch.long, committed.device)[None], probs=None)
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
