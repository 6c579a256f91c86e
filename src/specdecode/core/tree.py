"""Token trees: candidate continuations of one sequence, verified in one target pass.

Nodes are numbered in an order where every parent precedes its children. A verify pass feeds
all N nodes at once: node i goes into cache slot ``start + i`` (so the nodes of one pass are
written contiguously) but is rotated as position ``start + depth(i)`` (what it would be in a
plain sequence), and attends to the committed prefix plus its own ancestors only. Keeping an
accepted path afterwards means copying its slots down to ``start, start + 1, ...``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.core.device import host_to_device
from specdecode.core.tree_mask import ancestor_rows, tree_depths

ROOT = 0
NO_PARENT = -1


@dataclass(slots=True)
class TokenTree:
    """Candidate continuations of one sequence. Node 0 is the root: the last committed token
    (fed again by the verify pass); every other node is a drafted token whose parent precedes it.

    sampled[i] (i >= 1) says whether node i's token was drawn from ``draft_probs[parents[i]]``
    (True) or chosen deterministically, e.g. a top-k pick (False); sampled[0] is False.
    """

    parents: list[int]  # host; parents[0] == -1 and 0 <= parents[i] < i for i >= 1
    tokens: torch.Tensor  # (N,) long, on the model's device; tokens[0] is the root token
    sampled: list[bool]  # host, len N
    draft_probs: torch.Tensor | None = None  # (N, V) float: row j = q that node j's sampled children came from

    def __post_init__(self) -> None:
        size = len(self.parents)
        if size == 0 or self.parents[ROOT] != NO_PARENT:
            raise ValueError(f"a token tree needs a root with parent {NO_PARENT} at node 0, got parents {self.parents}")
        for node, parent in enumerate(self.parents[1:], start=1):
            if not 0 <= parent < node:
                raise ValueError(f"node {node} has parent {parent}; a parent must precede its child (0 <= parent < {node})")
        if self.tokens.dim() != 1 or self.tokens.shape[0] != size or self.tokens.dtype != torch.long:
            shape = tuple(self.tokens.shape)
            raise ValueError(f"tokens must be a ({size},) long tensor (one per node), got {shape} {self.tokens.dtype}")
        if len(self.sampled) != size:
            raise ValueError(f"sampled has {len(self.sampled)} entries for {size} nodes")
        if self.sampled[ROOT]:
            raise ValueError("the root is the last committed token, not a draft: sampled[0] must be False")
        if self.draft_probs is None:
            if any(self.sampled):
                raise ValueError("sampled nodes need draft_probs (the q their tokens were drawn from)")
        elif self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != size:
            raise ValueError(f"draft_probs must be ({size}, V), got {tuple(self.draft_probs.shape)}")

    @classmethod
    def chain(
        cls,
        root_token: torch.Tensor,  # (1,) long
        drafts: torch.Tensor,  # (k,) long
        probs: torch.Tensor | None,  # (k, V) float: drafts[i] was sampled from probs[i]; None: deterministic
    ) -> TokenTree:
        """A linear tree root -> drafts[0] -> ... -> drafts[k - 1]."""
        k = drafts.shape[0]
        draft_probs = None
        if probs is not None:
            # Node i + 1 was drawn from the row of its parent, node i; the last node has no children.
            draft_probs = torch.cat([probs, probs.new_zeros((1, probs.shape[1]))])
        return cls(
            parents=[NO_PARENT, *range(k)],
            tokens=torch.cat([root_token, drafts]),
            sampled=[False] + [probs is not None] * k,
            draft_probs=draft_probs,
        )

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> list[int]:
        return tree_depths(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def children(self) -> list[list[int]]:
        """children()[j]: the children of node j, in node order."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for node in range(1, self.size):
            kids[self.parents[node]].append(node)
        return kids

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root down to ``node``, root first."""
        path = [node]
        while self.parents[path[-1]] != NO_PARENT:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def positions(self, start: int, device: torch.device | str) -> torch.Tensor:
        """(1, N) long: RoPE positions start + depth, where ``start`` is the root's position."""
        return host_to_device([[start + depth for depth in self.depths]], torch.long, device)

    def ancestor_mask(self, device: torch.device | str) -> torch.Tensor:
        """(N, N) bool: [i, j] True when j == i or j is an ancestor of i."""
        return host_to_device(ancestor_rows(self.parents), torch.bool, device)
