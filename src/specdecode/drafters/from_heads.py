"""The tree drafter for trained heads: Medusa's static tree, sized from the heads' held-apart
accuracies against this machine's verify costs, or EAGLE's dynamic tree."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.drafters.base import TreeDrafter
from specdecode.drafters.eagle import DEFAULT_TREE_SIZE as EAGLE_TREE_SIZE
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.medusa import MedusaDrafter, build_static_tree, cost_aware_tree_size
from specdecode.errors import InvalidRequestError
from specdecode.models.heads import DraftHeads, EagleHead, MedusaHeads


def tree_drafter(
    heads: DraftHeads,
    tree_size: int | None,
    verify_costs: Callable[[int], list[float]],  # rows -> seconds of a target pass over 1..rows rows
    embed_tokens: torch.nn.Module,  # the target's token embedding, which EAGLE's head reads
) -> TreeDrafter:
    """The Medusa (static tree from the heads' measured accuracies) or EAGLE drafter."""
    if isinstance(heads, MedusaHeads):
        tree = heads.config.tree
        if tree_size is None and heads.config.rank_accuracy:
            # As many nodes as pay on this machine: measured verify costs against the
            # heads' held-apart accuracies.
            costs = verify_costs(max(len(tree), 1) + 1)
            tree_size = cost_aware_tree_size(heads.config.rank_accuracy, costs)
        if tree_size is not None:
            tree = build_static_tree(heads.config.rank_accuracy, tree_size)
        if not tree:
            raise InvalidRequestError("These Medusa heads carry no tree; pass tree_size= to build one.")
        return MedusaDrafter(heads, tree)
    assert isinstance(heads, EagleHead)
    return EagleDrafter(heads, embed_tokens, tree_size or EAGLE_TREE_SIZE)
