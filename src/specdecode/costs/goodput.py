"""Measured goodput, and when to try again a source that is off: the rules that keep a source
that loses from costing more than a few percent against plain decoding (issue 50).

A source (the draft model, prompt lookup, suffix decoding) is priced before it runs, from cost
tables and acceptance estimates. Two things can make that price wrong, and each has its check:

- the price is too low: the source runs and loses. ``SourceCheck`` measures its goodput (tokens
  emitted over the seconds of its own steps, drafting and catch-up included) against plain
  decoding's, measured the same way, and turns the source off for the request when it falls
  below;
- the price is too high, or the source lost only for a while: a source that is off never runs,
  so nothing corrects it. ``Reprobe`` says when to try it again: after a wait that doubles each
  time a try confirms the verdict, and only while the failed tries have cost at most
  ``REPROBE_SHARE`` of the decoding time seen. So no single bad measurement turns a source off
  for good, and one that really loses costs a bounded share.

Choosing a source changes only what is proposed, never the acceptance rule: output stays
lossless whichever steps draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Goodput comes in runs (easy and hard stretches of text) that recent steps predict poorly; a
# window of ~30 steps judges a source over the request, so a few bad steps do not switch off
# a source that pays overall.
GOODPUT_DECAY = 0.97
# Steps of a source, after the request's first (whose draft read the prompt: a cost already
# paid, which says nothing of the steps to come), before its measured goodput may turn it off:
# one step's acceptance is luck.
MIN_JUDGED_STEPS = 8
# The most of the decoding time seen that failed tries of a source that is off may cost: what
# a source that really loses can cost a run, after its first try.
REPROBE_SHARE = 0.03
# Steps before a source priced out by its cost table is first tried, doubling after each try
# that confirms the price (up to REPROBE_MAX_AFTER). On the single engine a try drafts, so the
# first reads every token the draft model missed (about 3 target passes of the demo pair on 2
# cores, at 32 tokens after a short prompt): a few percent of a 128-token answer, and a table
# 30x too high is corrected by then. The batch engine's tries time two one-token passes only.
REPROBE_FIRST_AFTER = 32
REPROBE_MAX_AFTER = 512


@dataclass(slots=True)
class GoodputEstimate:
    """Tokens per second of one way of stepping, pooled over its recent steps with forgetting.

    Starts as ``prior_seconds`` of decoding at ``prior_rate``, so a source that has not run yet
    has a rate to compare (a hopeful prior gets it tried); the prior fades like any old step.
    """

    prior_rate: float
    prior_seconds: float
    tokens: float = 0.0
    seconds: float = 0.0
    decay: float = GOODPUT_DECAY

    def __post_init__(self) -> None:
        self.tokens += self.prior_rate * self.prior_seconds
        self.seconds += self.prior_seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.seconds = self.seconds * self.decay + seconds


def plain_goodput(plain_pass_seconds: float) -> GoodputEstimate:
    """Plain decoding's goodput, starting from its priced pass (a plain step emits one token)
    with the weight of two steps, then measured on the plain steps that run."""
    return GoodputEstimate(prior_rate=1.0 / plain_pass_seconds, prior_seconds=2 * plain_pass_seconds)


@dataclass(slots=True)
class Reprobe:
    """When to try again a source that is off (the module docstring).

    The owner calls ``step`` after every step and ``outcome`` after each try; ``due`` says
    whether the next step may try. A try is due once ``after`` steps have passed without the
    source and the failed tries so far cost at most ``share`` of the seconds seen. The wait
    doubles (up to ``max_after``) after each try that confirms the verdict, and starts over at
    ``first_after`` after one that pays.
    """

    first_after: int = REPROBE_FIRST_AFTER
    max_after: int = REPROBE_MAX_AFTER
    share: float = REPROBE_SHARE
    after: int = 0  # the wait now (0: first_after)
    waited: int = 0  # steps since the source last ran
    seconds: float = 0.0  # of every step seen
    spent: float = 0.0  # seconds of the tries that did not pay
    tries: int = 0

    def __post_init__(self) -> None:
        self.after = self.after or self.first_after

    def due(self) -> bool:
        return self.waited >= self.after and self.spent <= self.share * self.seconds

    def step(self, seconds: float | None, ran: bool) -> None:
        """A step took ``seconds`` (None: not timed); ``ran``: the source stepped."""
        self.seconds += seconds or 0.0
        self.waited = 0 if ran else self.waited + 1

    def outcome(self, paid: bool, seconds: float) -> None:
        """A try that took ``seconds`` ``paid`` (the source is back) or confirmed the verdict."""
        self.tries += 1
        self.waited = 0  # the try ran the source: the next wait starts now
        if paid:
            self.after = self.first_after
            return
        self.after = min(2 * self.after, self.max_after)
        self.spent += seconds


@dataclass(slots=True)
class SourceCheck:
    """Whether one source still beats plain decoding by measured goodput, for one request.

    ``observe`` hears each of the source's steps (tokens emitted, seconds of drafting, catch-up
    included, and verifying) with plain decoding's rate now. After ``MIN_JUDGED_STEPS`` such
    steps, a goodput below plain's turns the source ``off``; a try while it is off
    (``Reprobe``, the owner's) is judged on its own step, and one at least as fast as plain
    turns it back on with a fresh window.
    """

    goodput: GoodputEstimate = field(default_factory=lambda: GoodputEstimate(0.0, 0.0))
    steps: int = 0  # judged steps in the current window
    off: bool = False

    def observe(self, tokens: int, seconds: float, plain_rate: float) -> bool | None:
        """A step of the source; returns, for a try while it was off, whether it paid (None:
        no try)."""
        if seconds <= 0:
            return None
        if self.off:
            paid = tokens / seconds >= plain_rate
            if paid:
                self.off, self.steps = False, 1
                self.goodput = GoodputEstimate(0.0, 0.0)
                self.goodput.observe(tokens, seconds)
            return paid
        self.goodput.observe(tokens, seconds)
        self.steps += 1
        if self.steps >= MIN_JUDGED_STEPS and self.goodput.rate < plain_rate:
            self.off = True
        return None
