"""Suffix decoding (``method="suffix"``): token trees from the request's own text and from earlier
responses, with no model pass (SuffixDecoding, arXiv 2411.04975).

Each request keeps a suffix tree over its prompt and output (``drafters/suffix_tree.py``) and
writes its response, token by token as it commits, into its group's tree of the decoder's
``SuffixCache`` (``drafters/suffix_cache.py``: earlier and concurrent responses of the same
group). Each step it finds the longest suffix of the sequence that occurred before in either
tree, grows a token tree below it (children ranked by how often they followed; a node's path
probability is the product of those frequencies along its path) and proposes the tree with the
higher score, the expected number of accepted tokens (the sum of path probabilities).

How much it proposes:

- at most ``SPEC_FACTOR`` x the match length deep (the paper's rule: a short match says little
  about what follows), at most ``depth`` (``k``) deep, at most ``tree_size`` nodes;
- probabilities calibrated by the measured acceptance: per match-length bucket, the drafted
  edges accepted over the edges the counts predicted (pooled with forgetting; a request starts
  from its group's earlier requests, ``suffix_cache.CalibrationMemory``), which scales every
  edge's count ratio, so a path's probability decays with its depth;
- with a fixed k: every node whose calibrated path probability is at least ``MIN_PROB``;
- cost-aware (``k="auto"``): the best-first prefix of nodes that maximises expected tokens
  (1 + the sum of calibrated probabilities) per second of a verify pass over that many rows,
  from the measured pass costs; none where nothing pays, so the step decodes plainly.

Two shapes over the same state: ``SuffixTreeDrafter`` proposes token trees (verified with tree
attention on the torch backend); ``SuffixDrafter`` proposes the best chain (the llama.cpp
backend, the batch engine's rows, and the auto method's suffix source). Proposals are
deterministic (no q): verification treats them as one-hot, so output stays lossless under
greedy decoding and sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdecode.backends.base import SequenceModel
from specdecode.core.device import host_to_device
from specdecode.core.sampling import LogitsProcessor
from specdecode.core.tree import NO_PARENT, TokenTree
from specdecode.costs.k_policy import interpolate
from specdecode.drafters.base import DraftProposal
from specdecode.drafters.suffix_cache import (
    DEFAULT_MAX_DEPTH,
    BucketCalibration,
    CalibrationMemory,
    ResponseHandle,
    SuffixCache,
    match_bucket,
)
from specdecode.drafters.suffix_tree import Draft, SuffixTree
from specdecode.errors import InvalidRequestError

MIN_PROB = 0.1  # with a fixed k: the least calibrated path probability a drafted node may have
COST_FLOOR_PROB = 0.02  # cost-aware: nodes below this are never worth a verify row
SPEC_FACTOR = 1.0  # draft at most this x the match length deep
DEFAULT_TREE_SIZE = 16  # drafted nodes per tree at most with a fixed k (--tree-size)
# With k "auto": drafts up to this deep (and as many nodes), beyond k_max. A model-free draft
# costs no pass per token, so its depth is bounded by the match (SPEC_FACTOR) and by what a
# verify row costs, not by a draft model's passes; a long match inside repeated text (an
# agent's earlier output) is accepted 20-30 tokens deep.
AUTO_DEPTH = 32


def auto_depth(k_max: int) -> int:
    """How deep a cost-aware suffix draft may go (``--k auto``, and auto's suffix source on
    either engine): past k_max, to ``AUTO_DEPTH``."""
    return max(k_max, AUTO_DEPTH)

CALIBRATION_PRIOR = 1.0  # pseudo-tokens behind the prior "counts are calibrated"
CALIBRATION_RANGE = (0.05, 2.0)  # counts are trusted at most this much less or more than measured
_REJECTED = -2  # no proposed child was the target's token


class SuffixProposer:
    """One request's suffix-decoding state: its own tree, its response in the shared cache, the
    calibration of its counts, and the proposal awaiting verification."""

    def __init__(
        self,
        cache: SuffixCache | None,
        group: str | None,
        *,
        depth: int,
        tree_size: int = DEFAULT_TREE_SIZE,
        verify_seconds: Sequence[float] | None = None,
        min_prob: float = MIN_PROB,
    ) -> None:
        if depth < 1 or tree_size < 1:
            raise InvalidRequestError(f"suffix decoding needs k >= 1 and tree_size >= 1, got {depth} and {tree_size}.")
        self.cache = cache if cache is not None and cache.enabled and group is not None else None
        # A group's calibration is kept even where its responses are not (a cache of 0 tokens).
        self.memory: CalibrationMemory | None = cache.calibration if cache is not None and group is not None else None
        self.group = group
        self.tree_depth = cache.max_depth if cache is not None else DEFAULT_MAX_DEPTH
        self.depth = min(depth, self.tree_depth - 1)
        self.tree_size = tree_size
        # index r - 1: a verify pass over r rows; None: the fixed-k rule, no costs
        self.verify_seconds = None if verify_seconds is None else list(verify_seconds)
        self.min_prob = min_prob
        self.history: list[int] = []
        self.last_match_len = 0
        self._prompt_len = 0
        self._local = SuffixTree(self.tree_depth)
        self._local_seq = self._local.add_sequence()
        self._handle: ResponseHandle | None = None
        self._pending: Draft | None = None
        self._calibration = BucketCalibration()

    def start(self, prompt_len: int) -> None:
        """A new request whose first ``prompt_len`` committed tokens are its prompt."""
        self._local = SuffixTree(self.tree_depth)
        self._local_seq = self._local.add_sequence()
        self.history, self._prompt_len, self._pending = [], prompt_len, None
        if self.memory is not None:
            self._calibration = self.memory.seed(self.group)  # type: ignore[arg-type]
        if self.cache is not None:
            self.cache.close(self._handle)
            self._handle = self.cache.open(self.group)  # type: ignore[arg-type]  # a cache means a group

    def extend(self, tokens: Sequence[int]) -> None:
        """Newly committed tokens (the prompt first): into the request's tree, the response part
        into the shared one too; a proposal they answer is scored for calibration."""
        if not tokens:
            return
        tokens = list(tokens)
        if self._pending is not None:
            self._calibrate(self._pending, tokens)
            self._pending = None
        before = len(self.history)
        self.history.extend(tokens)
        self._local.extend(self._local_seq, tokens)
        if self.cache is not None:
            self.cache.append(self._handle, tokens[max(0, self._prompt_len - before) :])

    # -- proposing -----------------------------------------------------------------------------
    def _gamma(self, match_len: int) -> float:
        b = match_bucket(match_len)
        low, high = CALIBRATION_RANGE
        cal = self._calibration
        return min(high, max(low, (cal.accepted[b] + CALIBRATION_PRIOR) / (cal.predicted[b] + CALIBRATION_PRIOR)))

    def _draft(self, depth: int, nodes: int, branching: int | None) -> Draft:
        """The better (higher-score) draft of the request's own tree and its group's tree."""
        limits = {"max_nodes": nodes, "max_depth": depth, "min_prob": 0.0, "branching": branching,
                  "max_match": max(self.tree_depth - depth, self.tree_depth // 2), "spec_factor": SPEC_FACTOR}
        local = self._local.draft(self.history, **limits)  # type: ignore[arg-type]
        if self.cache is None:
            return local
        shared = self.cache.draft(self.group, self.history, **limits)  # type: ignore[arg-type]
        return shared if shared.score > local.score else local

    def calibrated(self, draft: Draft) -> list[float]:
        """Each node's path probability with every edge's count ratio scaled by the measured
        calibration of its match-length bucket (so a chain of sure-looking edges that the target
        keeps leaving decays with depth)."""
        gamma = self._gamma(draft.match_len)
        out: list[float] = []
        for parent, prob in zip(draft.parents, draft.probs):
            above = 1.0 if parent < 0 else draft.probs[parent]
            out.append((1.0 if parent < 0 else out[parent]) * min(1.0, gamma * prob / above))
        return out

    def _choose(self, probs: list[float]) -> list[int]:
        """The nodes to propose, most probable first (a parent always before its children, since
        its probability is at least theirs): by the threshold, or by expected tokens per second."""
        order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
        costs = self.verify_seconds
        if costs is None:
            return [i for i in order if probs[i] >= self.min_prob]
        order = [i for i in order if probs[i] >= COST_FLOOR_PROB]
        best, best_rate, expected = 0, 1.0 / costs[0], 1.0
        for count in range(1, min(len(order), len(costs) - 1) + 1):
            expected += probs[order[count - 1]]
            rate = expected / costs[count]  # count nodes + the root: count + 1 rows
            if rate > best_rate:
                best, best_rate = count, rate
        return order[:best]

    def propose(self, num_tokens: int, tree: bool, mark: bool = True) -> Draft:
        """A draft of at most ``num_tokens`` tokens along any path: a tree (``tree``) or the
        best chain. ``mark=False`` only looks (the auto method prices it before choosing)."""
        depth = min(self.depth, num_tokens)
        if depth < 1 or not self.history:
            return Draft()
        raw = self._draft(depth, self.tree_size if tree else depth, None if tree else 1)
        self.last_match_len = raw.match_len
        kept = _subset(raw, self._choose(self.calibrated(raw)))
        if mark:
            self.mark_proposed(kept)
        return kept

    def raw_draft(self, depth: int, nodes: int, branching: int | None) -> Draft:
        """The draft below the current match, at most ``depth`` deep and ``nodes`` nodes
        (``branching`` 1: the best chain), before calibration and choice, nothing marked: what
        the bench's oracle scores (``bench/oracle.py``)."""
        depth = min(self.depth, depth)
        return self._draft(depth, nodes, branching) if depth >= 1 and self.history else Draft()

    def close(self) -> None:
        """The request is over: its response stays in the shared cache but takes no more tokens."""
        if self.cache is not None:
            self.cache.close(self._handle)
            self._handle = None

    def mark_proposed(self, draft: Draft) -> None:
        """``draft`` goes to verification: the next committed tokens score it."""
        self._pending = draft if len(draft) else None

    def keep(self, draft: Draft, count: int) -> Draft:
        """Propose the first ``count`` nodes of a draft made with ``mark=False``."""
        kept = _subset(draft, list(range(min(count, len(draft)))))
        self.mark_proposed(kept)
        return kept

    def _calibrate(self, draft: Draft, emitted: list[int]) -> None:
        """Score a verified draft edge by edge: at each node the target reached (the root first),
        the counts predicted the sum of its proposed children's ratios, and one of them was
        accepted or none (the token after the accepted ones is the target's own, never a
        proposed child)."""
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(draft.parents):
            children.setdefault(parent, []).append(node)
        node, accepted, predicted = NO_PARENT, 0.0, 0.0
        for token in emitted:
            below = children.get(node, [])
            if not below:
                break
            above = 1.0 if node == NO_PARENT else draft.probs[node]
            predicted += sum(draft.probs[c] for c in below) / above
            node = next((c for c in below if draft.tokens[c] == token), _REJECTED)
            if node == _REJECTED:
                break
            accepted += 1
        b = match_bucket(draft.match_len)
        self._calibration.record(b, accepted, predicted)
        if self.memory is not None:
            self.memory.record(self.group, b, accepted, predicted)  # type: ignore[arg-type]


def _subset(draft: Draft, nodes: list[int]) -> Draft:
    """The draft's ``nodes`` (each one's parent among them or before it), in that order."""
    if nodes == list(range(len(draft))):
        return draft
    index = {node: i for i, node in enumerate(nodes)}
    return Draft([draft.tokens[n] for n in nodes], [index.get(draft.parents[n], -1) for n in nodes],
                 [draft.probs[n] for n in nodes], draft.match_len, draft.sequences)


class SuffixDrafter:
    """The best chain of suffix decoding, behind the ``Drafter`` interface (and the batch engine's
    host-drafter calls ``extend``/``history``/``match``, as ``NgramDrafter``'s)."""

    def __init__(self, proposer: SuffixProposer) -> None:
        self.proposer = proposer

    @property
    def history(self) -> list[int]:
        return self.proposer.history

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        self.proposer.start(prompt_len)

    def extend(self, tokens: Sequence[int]) -> None:
        self.proposer.extend(tokens)

    def on_committed(self, tokens: list[int]) -> None:
        self.proposer.extend(tokens)

    def match(self, num_tokens: int) -> tuple[list[int], int]:
        """(chain, match length) for a batch row; empty when nothing pays."""
        draft = self.proposer.propose(num_tokens, tree=False)
        return draft.tokens, draft.match_len

    def propose(
        self,
        committed: torch.Tensor,  # (1, L) long
        num_tokens: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        if committed.shape[0] != 1:
            raise InvalidRequestError("The suffix drafter handles one sequence at a time.")
        if len(self.history) < committed.shape[1]:  # a caller that does not call on_committed
            self.extend(committed[0, len(self.history) :].tolist())
        chain = self.proposer.propose(num_tokens, tree=False).tokens
        return DraftProposal(tokens=host_to_device(chain, torch.long, committed.device).reshape(1, len(chain)), probs=None)

    def on_verified(self, num_accepted: int) -> None:
        pass  # calibrated from the committed tokens themselves (``SuffixProposer.extend``)


class SuffixTreeDrafter:
    """Suffix decoding's token trees behind the ``TreeDrafter`` interface (torch backend), and a
    batch row's tree drafter (the batch engine's host-drafter calls ``extend``/``history``)."""

    last_forward_passes = 0  # no model pass

    def __init__(self, proposer: SuffixProposer) -> None:
        self.proposer = proposer
        self.max_tree_nodes = proposer.tree_size + 1

    @property
    def history(self) -> list[int]:
        return self.proposer.history

    def extend(self, tokens: Sequence[int]) -> None:
        self.proposer.extend(tokens)

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        self.proposer.start(prompt_len)

    def on_committed(self, tokens: list[int]) -> None:
        self.proposer.extend(tokens)

    def observe(self, features: torch.Tensor, start: int) -> None:  # features: (1, T, C)
        pass  # counts, not features, rank the continuations

    def propose_tree(
        self,
        committed: torch.Tensor,  # (1, L) long
        max_depth: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> TokenTree:
        length = committed.shape[1]
        draft = self.proposer.propose(max_depth, tree=True)
        # Node 0 is the last committed token; draft node i becomes node i + 1.
        parents = [NO_PARENT] + [parent + 1 for parent in draft.parents]
        tokens = torch.cat([committed[0, length - 1 : length], host_to_device(draft.tokens, torch.long, committed.device)])
        return TokenTree(parents=parents, tokens=tokens, sampled=[False] * len(parents))


def suffix_drafter(
    cache: SuffixCache | None,
    group: str | None,
    *,
    tree: bool,
    depth: int,
    tree_size: int | None = None,
    verify_seconds: Sequence[float] | None = None,
) -> SuffixDrafter | SuffixTreeDrafter:
    """A fresh per-request suffix drafter: token trees (``tree``) or the best chain.
    ``verify_seconds`` (index r - 1: a verify pass over r rows) is extended along its last slope
    to as many rows as a draft may take, rather than timed again. Cost-aware trees default to
    ``depth`` nodes, so that one sure chain can fill the depth."""
    tree_size = tree_size or (max(DEFAULT_TREE_SIZE, depth) if verify_seconds is not None else DEFAULT_TREE_SIZE)
    if verify_seconds is not None:
        measured = dict(enumerate(verify_seconds, start=1))
        verify_seconds = [interpolate(measured, rows) for rows in range(1, (tree_size if tree else depth) + 2)]
    proposer = SuffixProposer(cache, group, depth=depth, tree_size=tree_size, verify_seconds=verify_seconds)
    return SuffixTreeDrafter(proposer) if tree else SuffixDrafter(proposer)
