"""The oracle ceiling (``specdecode bench --oracle``): how fast greedy decoding of a prompt could
have been with the same drafters and this machine's pass costs, had every step known the future.

With the target's greedy output ``y`` known (plain decoding's), what each drafter would propose
at every position ``i`` is known too, and so is how many of its tokens the target would accept:

- the draft model drafting greedily proposes, while it agrees with ``y``, exactly its
  teacher-forced predictions, so its accepted run at ``i`` is the run of positions from ``i``
  where its argmax after ``prompt + y[:j]`` is ``y[j]`` (one teacher-forced pass per turn);
- prompt lookup's continuation after ``prompt + y[:i]`` (``NgramDrafter``, up to ``k_max``);
- suffix decoding's draft after ``prompt + y[:i]`` over the request's own text and the
  conversation's earlier answers, for every depth up to ``AUTO_DEPTH`` (a shallower draft can
  take another match); on backends that verify trees the oracle may keep any path of the tree,
  so it proposes just the path the target takes.

A dynamic programme over positions then finds the cheapest schedule: each step either decodes
plainly (a one-row pass) or drafts ``k`` tokens from one source, costing a verify pass over
``k + 1`` rows plus ``k`` draft-model passes for the draft model (nothing for the lookups),
and moves past the accepted tokens and the target's own bonus token. The pass costs are the
decoder's measured table (``DecoderCosts``), the same one every method's trace is priced with
(``price_trace``), so ``plain / oracle`` is the ceiling and ``oracle / method`` each method's
share of it. The oracle is optimistic on purpose: it ignores the draft model's catch-up on
tokens it did not read (the prompt included) and its stopping rule, so no method's priced
trace is below it (tested). Prefill is left out of both: every method pays the same one.

The pass that emits ``y[0]`` is the prompt's: on llama.cpp the engine feeds the prompt's tail
in its first verify pass, with the first drafts; on torch the batch engine prefills the prompt
in a pass of its own, then feeds its last token with the first drafts. Either way ``y[0]``'s row
is counted as prefill on both sides, and the pass costs only the rows it verifies beside it:
``target(k + 1) - target(1)``, nothing for a plain first step. (The batch engine's draft model
never drafts ``y[0]``: its lookups may. The oracle lets every source draft it: optimistic.)

This module is the ceiling of one turn; ``bench/oracle_report.py`` applies it to a whole run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdecode.costs.k_policy import interpolate
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import AUTO_DEPTH, DEFAULT_TREE_SIZE, SuffixProposer
from specdecode.drafters.suffix_cache import DEFAULT_GROUP, SuffixCache
from specdecode.engine.trace import BEGIN, EXTEND, TARGET, PassEvent, PassTrace

if TYPE_CHECKING:
    from specdecode.api import SpecDecoder

PLAIN_SOURCE = "none"
SOURCES = ("ngram", "suffix", "draft")  # the drafters the oracle schedules, beside plain steps


@dataclass(frozen=True, slots=True)
class CostTable:
    """Seconds of the passes a schedule is made of, measured on one decoder."""

    verify: tuple[float, ...]  # index r - 1: a target pass over r rows (logits for every row)
    draft_pass: float = 0.0  # one draft-model pass over one new token
    draft_token: float = 0.0  # a token's share of a long draft-model pass (catch-up, prompt)

    def target(self, rows: int) -> float:
        """A target pass over ``rows`` rows, extrapolated along the last slope past the table."""
        if rows <= len(self.verify):
            return self.verify[rows - 1]
        return interpolate(dict(enumerate(self.verify, start=1)), rows)

    def draft(self, rows: int) -> float:
        """A draft-model pass over ``rows`` rows: a one-token pass, or the tokens' share of a long one."""
        return max(self.draft_pass, rows * self.draft_token)

    @classmethod
    def of(cls, decoder: SpecDecoder, max_rows: int) -> CostTable:
        """The decoder's measured costs (timed on first use and kept, as its policies read them)."""
        costs = decoder.costs
        draft = costs.draft_model() if decoder.resources.draft_model is not None else (0.0, 0.0)
        return cls(tuple(costs.verify(max_rows)), *draft)

    def to_json(self) -> dict[str, Any]:
        return {"verify_seconds": list(self.verify), "draft_pass_seconds": self.draft_pass,
                "draft_token_seconds": self.draft_token}


@dataclass(slots=True)
class Proposals:
    """For each decode position ``i`` of a turn (``y[i]`` the next token) and each source, the
    tokens the target would accept from a draft of ``k`` tokens: ``accepted[source][i][k - 1]``."""

    length: int  # len(y)
    accepted: dict[str, list[list[int]]] = field(default_factory=dict)

    def options(self, i: int) -> list[tuple[str, int, int]]:
        """(source, k, accepted) for every draft the sources could make at position i."""
        out = []
        for source, per_position in self.accepted.items():
            for k, accepted in enumerate(per_position[i], start=1):
                out.append((source, k, accepted))
        return out


def _run(predicted: Sequence[int], y: Sequence[int], i: int) -> int:
    """How many of ``predicted`` (a draft at position i) equal ``y[i:]`` before the first miss."""
    n = 0
    while n < len(predicted) and i + n < len(y) and predicted[n] == y[i + n]:
        n += 1
    return n


def _capped(runs: Sequence[int], depth: int) -> list[int]:
    """Accepted tokens for a draft of k = 1..depth tokens, given the accepted run of a draft of
    each depth d (``runs[d - 1]``; a draft of k tokens is the first k of one of depth d >= k)."""
    out = []
    for k in range(1, depth + 1):
        out.append(max(min(k, run) for run in runs[k - 1 :]))
    return out


@torch.inference_mode()
def draft_model_runs(decoder: SpecDecoder, prompt: Sequence[int], y: Sequence[int]) -> list[int]:
    """Per position i, the draft model's accepted run at i: its teacher-forced greedy predictions
    after ``prompt + y[:j]`` (one pass over the whole turn) compared with ``y[j]`` from j = i on."""
    from specdecode.drafters.draft_model import to_target_vocab

    drafter = decoder.resources.draft_model
    if drafter is None or not y:
        return [0] * len(y)
    sequence = drafter.model
    sequence.begin(len(prompt) + len(y) + 1)  # a new epoch: the drafter re-reads its next request
    if len(prompt) > 1:  # the prompt without logits, then its last token and y with every row's
        head = torch.tensor([list(prompt[:-1])], dtype=torch.long, device=sequence.device)
        sequence.extend(head, 0, compute_logits=False)
    tail = torch.tensor([[prompt[-1], *y[:-1]]], dtype=torch.long, device=sequence.device)
    out = sequence.extend(tail, len(prompt) - 1)
    assert out.logits is not None
    # Row j predicts y[j]: the draft's greedy token after prompt + y[:j].
    predicted = to_target_vocab(out.logits[0], decoder.target.config.vocab_size).argmax(-1).tolist()
    matches = [int(p == t) for p, t in zip(predicted, y)]
    runs = [0] * (len(y) + 1)
    for j in range(len(y) - 1, -1, -1):
        runs[j] = runs[j + 1] + 1 if matches[j] else 0
    return runs[: len(y)]


def turn_proposals(
    decoder: SpecDecoder, prompt: Sequence[int], y: Sequence[int], suffix_cache: SuffixCache,
    suffix_trees: bool, suffix_depth: int = AUTO_DEPTH,
) -> Proposals:
    """What every source would propose at every decode position of one turn whose greedy output
    is ``y`` (position 0, the token prefill emits, included for indexing). ``suffix_cache``
    holds the conversation's earlier answers; this turn's answer is added to it."""
    config = decoder.config
    k_max = config.k_max
    proposals = Proposals(len(y))
    ngram = NgramDrafter(config.ngram_max, config.ngram_min)
    ngram.start(len(prompt), len(prompt) + len(y) + 1)
    ngram.extend(list(prompt))
    suffix = SuffixProposer(suffix_cache, DEFAULT_GROUP, depth=suffix_depth)
    suffix.start(len(prompt))
    suffix.extend(prompt)
    depth = suffix.depth  # bounded by the trees' depth
    # As many nodes as any suffix method's tree may hold (a best-first tree with more nodes
    # holds every smaller one's), so every path a method could propose is among the oracle's.
    tree_nodes = max(config.tree_size or DEFAULT_TREE_SIZE, depth)
    ngram_acc, suffix_acc = [], []
    for i in range(len(y)):
        continuation, _ = ngram.match(k_max)
        ngram_acc.append(_capped([_run(continuation[:d], y, i) for d in range(1, k_max + 1)], k_max))
        runs = []
        for d in range(1, depth + 1):
            draft = suffix.raw_draft(d, tree_nodes if suffix_trees else d, None if suffix_trees else 1)
            runs.append(_deepest_path(draft.tokens, draft.parents, y, i))
        suffix_acc.append(_capped(runs, depth))
        ngram.extend([y[i]])
        suffix.extend([y[i]])
    suffix.close()
    proposals.accepted["ngram"] = ngram_acc
    proposals.accepted["suffix"] = suffix_acc
    if decoder.resources.draft_model is not None:
        runs = draft_model_runs(decoder, prompt, y)
        proposals.accepted["draft"] = [[min(k, runs[i]) for k in range(1, k_max + 1)] for i in range(len(y))]
    return proposals


def _deepest_path(tokens: Sequence[int], parents: Sequence[int], y: Sequence[int], i: int) -> int:
    """Depth of the deepest path of a draft tree (node j: ``tokens[j]`` below ``parents[j]``, -1
    the root) whose tokens are ``y[i], y[i + 1], ...``: what verification would accept."""
    depth_of: dict[int, int] = {}
    best = 0
    for j, (token, parent) in enumerate(zip(tokens, parents)):
        above = 0 if parent < 0 else depth_of.get(parent, -1)
        if above < 0 or i + above >= len(y) or token != y[i + above]:
            continue
        depth_of[j] = above + 1
        best = max(best, above + 1)
    return best


@dataclass(frozen=True, slots=True)
class OracleStep:
    position: int
    source: str  # PLAIN_SOURCE or one of SOURCES
    k: int
    accepted: int


def best_schedule(proposals: Proposals, costs: CostTable, start: int = 0) -> tuple[float, list[OracleStep]]:
    """The cheapest schedule from position ``start`` to the end, by dynamic programming over
    positions: (seconds, steps). The step at position 0 rides on the prompt's pass, which
    emits ``y[0]`` for free: it costs only its verify rows past the first (module docstring)."""
    n = proposals.length
    best = [0.0] * (n + 1)
    choice: list[OracleStep | None] = [None] * (n + 1)
    for i in range(n - 1, start - 1, -1):
        free_row = costs.target(1) if i == 0 else 0.0  # y[0]'s row is the prompt's pass's
        best[i] = costs.target(1) - free_row + best[i + 1]
        choice[i] = OracleStep(i, PLAIN_SOURCE, 0, 0)
        for source, k, accepted in proposals.options(i):
            seconds = costs.target(k + 1) - free_row + (k * costs.draft(1) if source == "draft" else 0.0)
            seconds += best[min(n, i + accepted + 1)]
            if seconds < best[i] - 1e-15:
                best[i], choice[i] = seconds, OracleStep(i, source, k, accepted)
    steps, i = [], start
    while i < n:
        step = choice[i]
        assert step is not None
        steps.append(step)
        i = min(n, i + step.accepted + 1)
    return (best[start] if start < n else 0.0), steps


def _priced_passes(trace: PassTrace) -> Iterator[tuple[PassEvent, int, bool]]:
    """The passes a trace is priced by, as (event, rows priced, whether it emitted ``y[0]``):
    every model pass but the target's prefill (its extends after a ``begin`` before the first
    that asks for logits). That first one emits ``y[0]``: it is priced by the rows it computed
    logits for (the last prompt token and the first drafts), whatever prompt tail it also fed."""
    in_prefill = False
    for event in trace.events:
        if event.role == TARGET and event.op == BEGIN:
            in_prefill = True
        elif event.role == TARGET and event.is_pass and in_prefill:
            if event.op == EXTEND and event.args[2] == 0:
                continue  # a prompt chunk without logits
            # The prompt's last chunk (or its last token) with the first drafts, or a first tree.
            in_prefill = False
            yield event, event.args[2] if event.op == EXTEND else event.rows, True
        elif event.is_pass:
            yield event, event.rows, False


def price_trace(trace: PassTrace, costs: CostTable) -> float:
    """Seconds a traced decode costs by the table: every target pass after prefill at its row
    count, every draft-model pass at its own; the pass that emitted ``y[0]`` at its verify rows
    past the first (``y[0]``'s row is the prompt's, as in ``best_schedule``). What the oracle's
    schedule is compared with."""
    seconds = 0.0
    for event, rows, first in _priced_passes(trace):
        if event.role != TARGET:
            seconds += costs.draft(rows)
        else:
            seconds += costs.target(rows) - (costs.target(1) if first else 0.0)
    return seconds


def max_trace_rows(traces: Sequence[PassTrace]) -> int:
    """The most rows any target pass after prefill took (for the cost table's length)."""
    return max([1] + [rows for trace in traces for e, rows, _ in _priced_passes(trace) if e.role == TARGET])
