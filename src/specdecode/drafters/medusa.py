"""Medusa: K heads on the target's last feature propose a static sparse token tree.

After a verify pass the last accepted node's feature f_p is known; the target's own head on it
produced the bonus token t_{p+1}, which becomes the tree's root. Head i's logits on f_p guess
token p + 1 + i, so head i fills depth i of the tree. The tree's shape is fixed: a set of
paths of top-k ranks, e.g. (0,), (1,), (0, 0) means "head 1's best and second-best token,
and head 2's best token under head 1's best". It is chosen once from the heads' measured
top-k accuracies (``build_static_tree``) so that the expected accepted length is the largest
for the number of nodes. Drafting is one small matmul per head plus one read of the reduced
LM head for all heads together, and no host sync.

Every child is a deterministic top-k pick, so under sampling tree verification accepts a
child with probability p(child) and removes it from the residual: lossless.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from specdecode.backends.base import SequenceModel
from specdecode.core.sampling import LogitsProcessor
from specdecode.core.tree import NO_PARENT, TokenTree
from specdecode.errors import InvalidRequestError
from specdecode.models.heads import MedusaHeads

DEFAULT_TREE_SIZE = 12  # drafted nodes (root excluded)


def _best_paths(accuracy: Sequence[Sequence[float]], tree_size: int) -> list[tuple[float, tuple[int, ...]]]:
    """Up to ``tree_size`` (probability, path) pairs, best first (see ``build_static_tree``)."""
    if tree_size < 1:
        raise InvalidRequestError(f"tree_size={tree_size} is out of range: use at least 1.")
    depth, ranks = len(accuracy), len(accuracy[0]) if accuracy else 0
    if depth == 0 or ranks == 0:
        raise InvalidRequestError("building a Medusa tree needs per-head top-k accuracies.")
    chosen: list[tuple[float, tuple[int, ...]]] = []
    heap: list[tuple[float, tuple[int, ...]]] = [(-accuracy[0][r], (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    while heap and len(chosen) < tree_size:
        neg_prob, path = heapq.heappop(heap)
        chosen.append((-neg_prob, path))
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(heap, (neg_prob * accuracy[len(path)][r], (*path, r)))
    return chosen


def build_static_tree(accuracy: Sequence[Sequence[float]], tree_size: int) -> tuple[tuple[int, ...], ...]:
    """The ``tree_size`` paths with the largest expected acceptance.

    accuracy[i][r]: how often head i + 1's rank-r token is the right one (held-apart data).
    Treating heads as independent, a path (r_1, ..., r_d) is accepted with probability
    prod_i accuracy[i][r_i], and the expected accepted length of a tree is the sum of its
    nodes' probabilities. A path's probability never exceeds its prefix's, so taking paths
    best-first from a heap that only offers extensions of chosen paths keeps the tree closed.
    """
    paths = [path for _, path in _best_paths(accuracy, tree_size)]
    return tuple(sorted(paths, key=lambda path: (len(path), path)))


def cost_aware_tree_size(accuracy: Sequence[Sequence[float]], verify_costs: Sequence[float]) -> int:
    """The tree size with the most expected tokens per second of verification.

    verify_costs[j]: seconds of a target pass over j + 1 rows (``SpecEngine.verify_costs``).
    A tree of n nodes costs a pass over n + 1 rows and emits 1 + (the sum of its paths'
    probabilities) tokens in expectation. On a CPU, where each extra row costs, this picks a
    few nodes; on a GPU, where rows up to dozens cost about the same, a large tree. Drafting
    (one small matmul per head) is left out of the cost.
    """
    gains = [prob for prob, _ in _best_paths(accuracy, len(verify_costs) - 1)]
    best_size, best_rate, expected = 1, 0.0, 1.0
    for size, gain in enumerate(gains, start=1):
        expected += gain
        rate = expected / verify_costs[size]
        if rate > best_rate:
            best_size, best_rate = size, rate
    return best_size


class MedusaDrafter:
    def __init__(self, heads: MedusaHeads, tree_paths: Sequence[Sequence[int]]) -> None:
        paths = sorted((tuple(p) for p in tree_paths), key=lambda path: (len(path), path))
        if not paths:
            raise InvalidRequestError("A Medusa tree needs at least one path.")
        index = {path: node for node, path in enumerate(paths, start=1)}
        parents = [NO_PARENT]
        for path in paths:
            if len(path) > heads.config.num_heads:
                raise InvalidRequestError(f"Tree path {path} is deeper than the {heads.config.num_heads} Medusa heads.")
            parent = index.get(path[:-1], 0) if len(path) > 1 else 0
            if len(path) > 1 and path[:-1] not in index:
                raise InvalidRequestError(f"Tree path {path} has no parent path {path[:-1]} in the tree.")
            parents.append(parent)
        self.heads = heads
        self.paths = paths
        self.parents = parents
        self.max_tree_nodes = len(parents)
        self.max_rank = max(path[-1] for path in paths) + 1
        device = heads.draft_vocab.device
        # Node i's token is row (depth - 1, rank) of the heads' (K, max_rank) top-k table.
        self._head_index = torch.tensor([len(p) - 1 for p in paths], dtype=torch.long, device=device)
        self._rank_index = torch.tensor([p[-1] for p in paths], dtype=torch.long, device=device)
        self._sampled = [False] * len(parents)
        depths = [len(p) for p in paths]
        # Tree size (root included) when cut at depth d, for d = 0 .. deepest.
        self._size_by_depth = [1 + sum(1 for x in depths if x <= d) for d in range(max(depths) + 1)]
        self.last_forward_passes = 0
        self._feature: torch.Tensor | None = None  # (1, C) the last committed position's feature

    def fresh(self) -> MedusaDrafter:
        """A drafter of its own for another sequence (the batch engine's rows), sharing the heads."""
        return MedusaDrafter(self.heads, self.paths)

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        self._feature = None  # the prefill's features arrive through observe() next

    def observe(self, features: torch.Tensor, start: int) -> None:  # features: (1, T, C)
        self._feature = features[:, -1]

    def propose_tree(
        self,
        committed: torch.Tensor,  # (1, L) long
        max_depth: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> TokenTree:
        root = committed[0, -1:]
        # Nodes are sorted by depth: the first ``size`` are the tree cut at max_depth.
        size = self._size_by_depth[min(max(max_depth, 0), len(self._size_by_depth) - 1)]
        if self._feature is None or size == 1:  # a one-token prompt (nothing read yet) or no room
            self.last_forward_passes = 0
            return TokenTree([NO_PARENT], root, [False])
        logits = self.heads(self._feature)[0]  # (K, Vd)
        top = logits.topk(self.max_rank, dim=-1).indices  # (K, R) draft rows
        drafted = self.heads.to_target_vocab(top[self._head_index[: size - 1], self._rank_index[: size - 1]])
        self.last_forward_passes = 1
        return TokenTree(self.parents[:size], torch.cat([root, drafted]), self._sampled[:size])
