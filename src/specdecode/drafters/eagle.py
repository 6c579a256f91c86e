"""EAGLE: a one-layer head drafts at the feature level and grows a dynamic token tree (EAGLE-2).

The head reads pairs (f_p, t_{p+1}): the target's feature at p and the token after it, and
predicts f_{p+1}, whose logits guess t_{p+2} (``models.heads.EagleHead``). It keeps its own
one-layer KV cache over the committed pairs, slot p for pair p (rotated as position p + 1).

Each step, with L committed tokens:
1. **Catch up.** Feed the pairs the head has not read, up to p = L - 2 (the features arrive
   through ``observe``: the prompt's after prefill, the accepted path's after each verify
   pass). The last output is the predicted f_{L-1}; its logits give the root's children.
2. **Expand** (EAGLE-2). Score every drafted node by its cumulative log-probability under
   the head. Per depth, the ``top_k`` best new nodes become the frontier: their pairs
   (parent's predicted feature, own token) run through the head in one batch with tree
   attention (a row sees the committed pairs and its own ancestors' pairs), and each gets its
   ``top_k`` children. Expansion rows go to cache slots past the committed pairs, where the
   next step's catch-up overwrites them, so rollback costs nothing.
3. **Select.** The ``tree_size`` best-scoring nodes of all depths form the tree (a parent
   always scores at least as high as its child; ties are closed over ancestors).

All bookkeeping stays on the device until the one host read of step 3. The algorithm lives in
``drafters/batch_eagle.py``, written for many sequences at once: the batch engine drafts all
its EAGLE rows together (``propose_together``), one head pass per level for the whole step;
this drafter alone is the batch of one. Children are
deterministic top-k picks: under sampling, tree verification stays lossless (accept with
p(child), remove it from the residual).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specdecode.backends.base import SequenceModel
from specdecode.config import MAX_TREE_SIZE
from specdecode.core.sampling import LogitsProcessor
from specdecode.core.tree import TokenTree
from specdecode.drafters.batch_eagle import BatchEagle, EagleRow, HeadState
from specdecode.errors import InvalidRequestError
from specdecode.models.heads import EagleHead

# Drafted nodes (root excluded). On this project's 2-core CPU a target pass over 5 rows costs
# ~1.3x one over a single row and 13 rows ~2x, and 4 nodes measured fastest on HumanEval
# prompts (README, "Token trees"); on a GPU, where rows up to dozens cost about the same,
# pass a larger --tree-size (16-60).
DEFAULT_TREE_SIZE = 4
DEFAULT_DEPTH = 5
DEFAULT_TOP_K = 4


class EagleDrafter:
    def __init__(
        self,
        head: EagleHead,
        embed_tokens: nn.Embedding,  # the target's embedding (shared, not copied)
        tree_size: int = DEFAULT_TREE_SIZE,
        depth: int = DEFAULT_DEPTH,
        top_k: int = DEFAULT_TOP_K,
    ) -> None:
        if not 1 <= tree_size <= MAX_TREE_SIZE:
            raise InvalidRequestError(f"tree_size={tree_size} is out of range: use 1..{MAX_TREE_SIZE}.")
        if depth < 1 or top_k < 1:
            raise InvalidRequestError(f"EAGLE needs depth >= 1 and top_k >= 1, got {depth} and {top_k}.")
        self.head = head
        self.embed_tokens = embed_tokens
        self.tree_size, self.depth, self.top_k = tree_size, depth, top_k
        # Ancestors of a tie-broken selection can add at most depth - 1 nodes.
        self.max_tree_nodes = tree_size + depth
        self.last_forward_passes = 0
        # The head and the tree's shape (equal for every fresh copy: their rows draft together)
        # and what the head keeps of this drafter's sequence.
        self.batch = BatchEagle(head, embed_tokens, tree_size, depth, top_k)
        self.state = HeadState()

    def start(self, prompt_len: int, capacity: int, target: SequenceModel | None = None, shared_prefix: int = 0) -> None:
        # Past the committed pairs: a step's expansion rows, top_k per level.
        self.state.start(self.head, capacity, self.depth * self.top_k)

    def fresh(self) -> EagleDrafter:
        """A drafter of its own for another sequence (the batch engine's rows), sharing the head
        and the embedding; its cache and features are its own."""
        return EagleDrafter(self.head, self.embed_tokens, self.tree_size, self.depth, self.top_k)

    def observe(self, features: torch.Tensor, start: int) -> None:  # features: (1, T, C)
        self.state.observe(features, start)

    def propose_tree(
        self,
        committed: torch.Tensor,  # (1, L) long
        max_depth: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
    ) -> TokenTree:
        # Top-k picks, not draws: the processor and generator are not read.
        return propose_together([(self, committed[0], max_depth)])[0]


def propose_together(rows: Sequence[tuple[EagleDrafter, torch.Tensor, int]]) -> list[TokenTree]:
    """A tree for each (drafter, committed (L,) long, max_depth) row: the rows whose drafters
    share a head and a tree shape draft together, one head pass per tree level for all of them
    (``BatchEagle.propose``). Each drafter's ``last_forward_passes`` is the passes its tree took."""
    groups: dict[BatchEagle, list[int]] = {}
    for index, (drafter, _, _) in enumerate(rows):
        groups.setdefault(drafter.batch, []).append(index)
    trees: list[TokenTree | None] = [None] * len(rows)
    for batch, members in groups.items():
        drafted, passes = batch.propose([EagleRow(rows[i][0].state, rows[i][1], rows[i][2]) for i in members])
        for index, tree in zip(members, drafted, strict=True):
            trees[index] = tree
            rows[index][0].last_forward_passes = passes if tree.size > 1 else 0
    return [tree for tree in trees if tree is not None]
