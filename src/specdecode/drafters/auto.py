"""The auto method: each step, whichever way of guessing pays best by measured goodput.

Four sources compete every step: prompt lookup (n-gram, no model pass), suffix decoding (the
best chain of ``drafters/suffix.py``: the request's text and earlier responses, no model pass),
the draft model, and plain decoding (no draft). The lookups run first because they cost
microseconds; then the source with the highest expected tokens per second steps:

- plain decoding: one token per target pass over one row (measured once per engine, kept
  current from live steps);
- prompt lookup and suffix decoding: what each offered is scored against the tokens the target
  then emitted, on every step, whether it drafted or plain decoding stepped (a plain step still
  says whether the offer's first token was right), so learning what a lookup is worth costs no
  step. The scores are kept per source in two states, after an offer that agreed with what was
  emitted and after one that did not: inside a copy a lookup's next token is right 82-86% of the
  time on the bench's prompts, elsewhere 15-18%, and one pooled rate would price both wrong
  (``LookupAgreement``). A lookup drafts as many of its tokens as pay under
  ``k_policy.best_plan`` at its state's rate, and only where that beats plain decoding;
- the draft model: its goodput measured on its own recent steps, tokens emitted over seconds
  spent drafting and verifying, pooled with forgetting (``GoodputEstimate``, a window of ~30
  steps), from a hopeful prior so that it gets tried. Measured, not modelled: it stops early
  where it is unsure, which an i.i.d. model of E(a, k) misprices;
- catch-up: the draft model reads the sequence only when it drafts, so its first use in a
  request, or its first after a run of lookup or plain steps, first feeds every token it
  missed. That one-off cost (per token, measured once per decoder) is spread over the tokens
  the request may still produce (at most ``CATCH_UP_HORIZON``), so a long prompt with a short
  answer never pays a draft prefill it cannot earn back, and a request that never needs the
  draft model never runs it.

The draft model drafts up to ``draft_k`` tokens (its confidence cut-off ends drafts early);
prompt lookup at most ``k_max`` found tokens, suffix decoding at most its cost-aware chain
(``SuffixProposer`` with the verify costs: up to ``suffix_depth``, past ``k_max``, where its
match and calibrated path probabilities say a long copy is coming).

Priced as it runs (issue 50), so that a wrong price costs a bounded share and no source is off
for good (``costs/goodput.py``, ``costs/live.py``):

- the draft model's pass and catch-up costs are the decoder's live table (``LivePricing``):
  every draft step's passes correct it (the catch-up pass counted at its own row count) and it
  is written back to the stored table. A draft model its price says never pays (even at full
  acceptance) is tried now and then (``LivePricing.draft_reprobe``, from
  ``REPROBE_FIRST_AFTER`` steps, waiting longer after each try that confirms the price), so a
  table 30x too high is corrected by the try's own passes;
- a draft model used earlier in the request whose goodput fell below the other sources' drafts
  again (a ``Reprobe`` of its own: after ``DRAFT_RETRY_AFTER`` steps without it and no lookup
  match, doubling while its tries stay slower than plain), so a stale estimate can recover;
- a lookup's price is modelled (its agreement and the verify table); its measured goodput
  (``SourceCheck``: its steps' tokens over their seconds) below plain decoding's, measured on
  the request's plain steps, turns it off for the request until a try pays.

Choosing only changes what is proposed, never the acceptance rule: output stays lossless.

The drafter is also its own draft-length schedule (``k_policy.KSchedule``): choosing the source
and k is one decision, and it needs the step times that only the schedule hears about.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from specdecode.backends.base import SequenceModel
from specdecode.core.device import host_to_device
from specdecode.core.sampling import LogitsProcessor
from specdecode.costs.goodput import GoodputEstimate, Reprobe, SourceCheck, plain_goodput
from specdecode.costs.k_policy import (
    MAX_PROBE_AFTER,
    PROBE_AFTER,
    PROBE_K,
    AcceptanceEstimate,
    LiveVerifyCosts,
    best_plan,
    speculation_can_pay,
)
from specdecode.costs.live import LivePricing, draft_pricing
from specdecode.drafters.base import DraftProposal
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter

CATCH_UP_HORIZON = 64  # most future tokens a draft catch-up is spread over
CATCH_UP_FREE_TOKENS = 2  # a normal draft pass feeds the one or two newly committed tokens
PRIOR_GAIN = 1.25  # an untried draft model is assumed this much faster than plain decoding ...
PRIOR_STEPS = 2.0  # ... with the weight of this many plain steps' time
# Steps without the draft model (and no lookup match) before it drafts again. Not
# k_policy.PROBE_AFTER, which counts plain steps in a row before a schedule drafts a short
# probe (PROBE_K tokens, waiting longer after each probe that does not pay): this counts steps
# any other source took (lookup steps included) before the draft model, whose goodput estimate
# only its own steps update, drafts its full draft_k again; the wait doubles (up to
# MAX_PROBE_AFTER) while its tries stay slower than plain decoding.
DRAFT_RETRY_AFTER = 6


LOOKUP_SOURCES = ("ngram", "suffix")
# Weight an agreement score keeps per scored offer: a window of ~30 steps, as the draft model's
# goodput. Chosen with benchmarks/auto_policy_sim.py on the bench's default prompts (0.9 to
# 0.99 moved auto's share of the oracle ceiling by at most 0.01).
AGREEMENT_DECAY = 0.97
AFTER_MISS, AFTER_AGREEMENT = 0, 1


@dataclass(slots=True)
class LookupAgreement:
    """How often one lookup source's offered tokens were the tokens the target emitted next, per
    state (``AFTER_MISS``, ``AFTER_AGREEMENT``: whether its previous offer agreed), pooled with
    forgetting as a per-token acceptance rate (``AcceptanceEstimate``: a run of r right tokens of
    n checked is r successes and, when r < n, one failure)."""

    rates: dict[int, AcceptanceEstimate] = field(default_factory=lambda: {
        state: AcceptanceEstimate(decay=AGREEMENT_DECAY) for state in (AFTER_MISS, AFTER_AGREEMENT)})
    state: int = AFTER_MISS
    _offer: list[int] | None = None  # what the source offered this step, awaiting the emitted tokens
    _offer_state: int = AFTER_MISS

    @property
    def rate(self) -> float:
        """Per-token acceptance expected of an offer made now."""
        return self.rates[self.state].rate

    def offer(self, tokens: list[int]) -> None:
        self._offer, self._offer_state = tokens, self.state

    def score(self, emitted: list[int]) -> None:
        """The tokens committed after the offer (a plain step's one token, or a verified draft's
        accepted tokens and the target's own): as many of the offer as were emitted are checked."""
        offer, self._offer = self._offer, None
        checked = min(len(offer), len(emitted)) if offer else 0
        if checked == 0:
            self.state = AFTER_MISS
            return
        right = 0
        while right < checked and offer[right] == emitted[right]:
            right += 1
        self.rates[self._offer_state].observe(checked, right)
        self.state = AFTER_AGREEMENT if right == checked else AFTER_MISS


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
        suffix_depth: int | None = None,  # the most a suffix chain drafts (None: k_max)
        pricing: LivePricing | None = None,  # the decoder's live costs (None: the request's own, from the two above)
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
        if pricing is None or (draft is not None and pricing.draft is None):
            pricing = draft_pricing(draft_pass_seconds, draft_token_seconds)
        self.pricing = pricing
        self.live_costs = live_costs
        # Live steps scale the whole table, keeping its start-up shape (LiveVerifyCosts).
        self._live = LiveVerifyCosts(self.verify_seconds) if live_costs else None
        self.draft_goodput = self._prior()
        self.plain_goodput = plain_goodput(self.verify_seconds[0])  # measured on this request's plain steps
        # Per lookup source: how often its offers agreed with the emitted tokens, scored every step.
        self.agreement = {source: LookupAgreement() for source in LOOKUP_SOURCES}
        # Per lookup source: its measured goodput against plain decoding's, and when to try it once off.
        self.checks = {source: SourceCheck() for source in LOOKUP_SOURCES}
        self.lookup_retry = {source: Reprobe(PROBE_AFTER, MAX_PROBE_AFTER) for source in LOOKUP_SOURCES}
        self.draft_retry = Reprobe(DRAFT_RETRY_AFTER, MAX_PROBE_AFTER)  # a draft model that fell behind
        # Steps each source drafted (or decoded plainly): reported in GenerationStats.
        self.steps_by_source: Counter[str] = Counter()
        self.source = "none"  # of the last step
        self._catch_up = 0
        self._draft_used = False
        self._capacity = 0
        self._try = False  # this step tries a source that is off: priced out, fallen behind, or slower than plain

    @property
    def draft_pass_seconds(self) -> float:
        return self.pricing.draft_pass_seconds

    @property
    def draft_token_seconds(self) -> float:
        return self.pricing.draft_token_seconds

    @property
    def draft_can_pay(self) -> bool:
        """Whether the draft model's price now lets it beat plain decoding at full acceptance
        (``speculation_can_pay``); where not, it drafts only when tried (``plan``)."""
        return self.draft is not None and speculation_can_pay(self.verify_seconds, self.draft_pass_seconds, self.draft_k)

    def _prior(self) -> GoodputEstimate:
        plain = self.verify_seconds[0]
        return GoodputEstimate(prior_rate=PRIOR_GAIN / plain, prior_seconds=PRIOR_STEPS * plain)

    def _catch_up_seconds(self, missed: int) -> float:
        return max(0, missed - CATCH_UP_FREE_TOKENS) * self.draft_token_seconds

    # -- schedule side -------------------------------------------------------------------------
    def next_k(self) -> int:
        return self.k  # the real choice is made in propose, once the lookup has run

    def observe(self, proposed: int, accepted: int, draft_seconds: float, draft_passes: int,
                verify_seconds: float | None) -> None:
        if self._live is not None:
            self._live.observe(proposed + 1, verify_seconds)
            if self.pricing.verify is not None:
                self.pricing.verify.observe(proposed + 1, verify_seconds)
        source = self.source if proposed else "none"
        self.steps_by_source[source] += 1
        seconds = draft_seconds + (verify_seconds or 0.0)
        if source == "draft":
            self._observe_draft(accepted, draft_seconds, draft_passes, verify_seconds)
        elif verify_seconds is not None and source in self.checks:
            paid = self.checks[source].observe(accepted + 1, seconds, self.plain_goodput.rate)
            if paid is not None:
                self.lookup_retry[source].outcome(paid, seconds)
        elif verify_seconds is not None and source == "none":
            self.plain_goodput.observe(1, verify_seconds)
        for name, retry in self.lookup_retry.items():
            retry.step(seconds, ran=source == name)
        self.draft_retry.step(seconds, ran=source == "draft")
        self.pricing.draft_reprobe.step(seconds, ran=source == "draft")
        self._try = False

    def _observe_draft(self, accepted: int, draft_seconds: float, draft_passes: int, verify_seconds: float | None) -> None:
        """A draft-model step: its passes correct the draft model's price (the first pass read
        ``_catch_up`` tokens, the rest one each), its goodput the draft model's rate; a try says
        whether the price, or the rate, lets it back."""
        priced_out = not self.draft_can_pay
        if self.live_costs and self.pricing.draft is not None and draft_passes > 0:
            self.pricing.draft.observe([max(1, self._catch_up)] + [1] * (draft_passes - 1), draft_seconds)
        if verify_seconds is None:
            return
        seconds = draft_seconds + verify_seconds
        if priced_out and self._try:
            self.pricing.draft_reprobe.outcome(self.draft_can_pay, seconds)
        elif self._try:
            self.draft_retry.outcome((accepted + 1) / seconds >= self.plain_goodput.rate, seconds)
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

    def on_committed(self, tokens: list[int]) -> None:
        for agreement in self.agreement.values():
            agreement.score(tokens)
        self.ngram.on_committed(tokens)
        if self.suffix is not None:
            self.suffix.on_committed(tokens)
        if self.draft is not None:
            self.draft.on_committed(tokens)

    def plan(self, length: int, num_tokens: int, lookup_tokens: int, suffix_tokens: int = 0) -> tuple[str, int]:
        """(source, k) with the highest expected tokens per second for this step.

        ``length``: committed tokens; ``num_tokens``: the most the engine lets this step draft;
        ``lookup_tokens``, ``suffix_tokens``: how many tokens the n-gram lookup and the suffix
        chain offer (0: no match).
        """
        self._try = False
        best = ("none", 0, 1.0 / self.verify_seconds[0])
        for source, found in (("ngram", lookup_tokens), ("suffix", suffix_tokens)):
            trying = self.checks[source].off
            if found > 0 and (not trying or self.lookup_retry[source].due()):
                k, rate = best_plan(self.agreement[source].rate, self.verify_seconds, 0.0, found, k_min=1)
                if rate > best[2]:
                    best = (source, k, rate)
                    self._try = trying
        if self.draft is None:
            return best[0], best[1]
        lookups = lookup_tokens > 0 or suffix_tokens > 0
        k = min(self.draft_k, num_tokens)
        if not self.draft_can_pay:
            # Priced out: only a try (short, where no lookup offers anything) can correct the price.
            if not lookups and self.pricing.draft_reprobe.due():
                self._try = True
                return "draft", min(PROBE_K, k)
            return best[0], best[1]
        if self._draft_used and not lookups and self.draft_retry.due():
            self._try = True
            return "draft", k
        rate = self.draft_goodput.rate
        catch_up = self._catch_up_seconds(length - self.draft.cached_len)
        if catch_up > 0:
            horizon = max(1, min(self._capacity - 1 - length, CATCH_UP_HORIZON))
            rate = 1.0 / (1.0 / rate + catch_up / horizon)
        if rate > best[2]:
            self._try = False
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
        # Both lookups on the host (on_committed keeps their histories): only the chosen draft
        # goes to the device, and scoring the offers reads nothing back from it.
        lookup, _ = self.ngram.match(min(num_tokens, self.k_max))
        chain = self.suffix.proposer.propose(num_tokens, tree=False, mark=False) if self.suffix is not None else None
        self.agreement["ngram"].offer(lookup)
        self.agreement["suffix"].offer(list(chain.tokens) if chain else [])
        self.source, k = self.plan(length, num_tokens, len(lookup), len(chain) if chain else 0)
        if self.source == "ngram":
            return DraftProposal(tokens=host_to_device(lookup[:k], torch.long, committed.device)[None], probs=None)
        if self.source == "suffix":
            assert self.suffix is not None and chain is not None
            kept = self.suffix.proposer.keep(chain, k)
            return DraftProposal(tokens=host_to_device(kept.tokens, torch.long, committed.device)[None], probs=None)
        if self.source == "draft":
            assert self.draft is not None
            self._catch_up = length - self.draft.cached_len
            self._draft_used = True
            return self.draft.propose(committed, k, processor, generator)
        return DraftProposal(tokens=committed.new_empty((1, 0)), probs=None)

    def on_verified(self, num_accepted: int) -> None:
        if self.source == "draft":
            assert self.draft is not None
            self.draft.on_verified(num_accepted)
