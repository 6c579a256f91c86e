"""What a batch row of each method drafts with: the one place the batch engine reads a method's
name (the methods it takes, ``BATCH_METHODS``; the rest of the engine reads the row's drafters).

- ``none``: nothing; every step is plain.
- ``ngram``, ``suffix``: a host drafter (prompt lookup; suffix decoding's token trees where the
  target scores trees, torch, else its best chain), no model pass.
- ``draft``: the draft model, in the batch's model passes; the row holds draft KV blocks.
- ``auto``: both lookups and, where the engine has a draft model that can pay, the draft model
  (``drafters/auto_row.py``); it picks its source and draft length every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.drafters import registry
from specdecode.drafters.auto_row import AutoRow
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixProposer, SuffixTreeDrafter
from specdecode.drafters.suffix_cache import SuffixCache

BATCH_METHODS = registry.BATCH_METHODS  # the registry entries whose rows the batch engine takes


@dataclass(slots=True, frozen=True)
class RowDrafters:
    """One request's drafters in the batch engine."""

    host: NgramDrafter | SuffixDrafter | SuffixTreeDrafter | AutoRow | None  # proposes on the host, from committed tokens
    sources: AutoRow | None  # the same object where the row picks its source every step
    uses_draft: bool  # the draft model may draft for it: it holds draft KV blocks
    tree_nodes: int = 0  # the most nodes its token trees draft (0: it drafts chains)


def uses_draft(method: str, model_can_pay: bool) -> bool:
    """Whether a row of ``method`` holds draft KV blocks, where the engine has a draft model whose
    speculation ``model_can_pay`` at all (``k_policy.speculation_can_pay``)."""
    return method == "draft" or (method == "auto" and model_can_pay)


def row_drafters(
    method: str,
    k: int,
    k_max: int,
    suffix_group: str | None,
    suffix_cache: SuffixCache,
    ngram_sizes: tuple[int, int],
    model_can_pay: bool,
    trees: bool,
) -> RowDrafters:
    """The drafters of a row of ``method`` (one of ``BATCH_METHODS``, checked by the engine) with
    draft length cap ``k``: a lookup drafts up to ``k``, or in auto up to ``k_max`` (the draft
    model's cap stays the request's ``k``, as on the single path). ``trees``: the target scores
    token trees (``BatchModel.supports_trees``); a suffix row then drafts trees ``k`` deep."""
    if method == "ngram":
        return RowDrafters(NgramDrafter(*ngram_sizes), None, False)
    if method == "suffix":
        proposer = SuffixProposer(suffix_cache, suffix_group, depth=max(k, 1))
        if trees:
            return RowDrafters(SuffixTreeDrafter(proposer), None, False, tree_nodes=proposer.tree_size)
        return RowDrafters(SuffixDrafter(proposer), None, False)
    if method == "auto":
        suffix = SuffixDrafter(SuffixProposer(suffix_cache, suffix_group, depth=k_max))
        row = AutoRow(NgramDrafter(*ngram_sizes), suffix, lookup_cap=k_max)
        return RowDrafters(row, row, uses_draft(method, model_can_pay))
    return RowDrafters(None, None, uses_draft(method, model_can_pay))
