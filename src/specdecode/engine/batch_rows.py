"""What a batch row of each method drafts with: the one place the batch engine reads a method's
name (the methods it takes, ``BATCH_METHODS``; the rest of the engine reads the row's drafters).

- ``none``: nothing; every step is plain.
- ``ngram``, ``suffix``: a host drafter (prompt lookup; suffix decoding's token trees where the
  target scores trees, torch, else its best chain), no model pass.
- ``draft``: the draft model, in the batch's model passes; the row holds draft KV blocks.
- ``auto``: both lookups and, where the engine has a draft model that can pay, the draft model
  (``drafters/auto_row.py``); it picks its source and draft length every step.
- ``layerskip``: the target with layers skipped, for all its rows in the batch's passes
  (``drafters/batch_layer_skip.py``), in the target's own pool.
- ``medusa``, ``eagle``: a drafter of the row's own over the engine's trained heads, fed the
  target's features of the row's committed positions; token trees (the engine's target scores
  trees: torch, where heads run).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from specdecode.config import MAX_K_MAX, check_acceptance, check_k_policy
from specdecode.core import registry
from specdecode.costs.batch_k import PassCosts
from specdecode.costs.k_policy import FixedK, KSchedule, ThresholdK
from specdecode.drafters.auto_row import AutoRow
from specdecode.drafters.base import HeadsDrafter, TreeDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix import SuffixDrafter, SuffixProposer, SuffixTreeDrafter, auto_depth
from specdecode.drafters.suffix_cache import SuffixCache
from specdecode.errors import InvalidRequestError

BATCH_METHODS = registry.BATCH_METHODS  # the registry entries whose rows the batch engine takes


@dataclass(slots=True, frozen=True)
class RowDrafters:
    """One request's drafters in the batch engine."""

    host: NgramDrafter | SuffixDrafter | SuffixTreeDrafter | AutoRow | None  # proposes on the host, from committed tokens
    sources: AutoRow | None  # the same object where the row picks its source every step
    uses_draft: bool  # the draft model may draft for it: it holds draft KV blocks
    tree_nodes: int = 0  # the most nodes its token trees draft, root excluded (0: it drafts chains)
    heads: TreeDrafter | None = None  # its own Medusa or EAGLE drafter, fed the target's features
    skips_layers: bool = False  # the target drafts for it with layers skipped
    # Its own draft length, every step, where the request's k policy is fixed or threshold
    # (``row_schedule``); None: the batch's cost-aware choice (``costs/batch_k.py``).
    schedule: KSchedule | None = None


def check_method(method: str, has_draft: bool, skips_layers: bool, heads: Mapping[str, HeadsDrafter],
                 acceptance: str = "lossless") -> None:
    """Raise InvalidRequestError where an engine with a draft model (``has_draft``), layers to
    skip and ``heads`` cannot decode rows of ``method`` by the ``acceptance`` rule (typical:
    the tree methods only)."""
    if method not in BATCH_METHODS:
        raise InvalidRequestError(f"The batch engine decodes methods {', '.join(BATCH_METHODS)}; got {method!r}.")
    if method == registry.DRAFT.name and not has_draft:
        raise InvalidRequestError("This engine was built without a draft model; use method 'none' or 'ngram'.")
    if method == registry.LAYERSKIP.name and not skips_layers:
        raise InvalidRequestError("This engine was built without layers to skip (skip_layers=); method 'layerskip' "
                                  "needs them.")
    if registry.BY_NAME[method].needs_heads and method not in heads:
        raise InvalidRequestError(f"This engine was built without {method} heads; method {method!r} needs them (heads=).")
    check_acceptance(acceptance, method)


def uses_draft(method: str, model_can_pay: bool) -> bool:
    """Whether a row of ``method`` holds draft KV blocks, where the engine has a draft model whose
    speculation ``model_can_pay`` at all (``k_policy.speculation_can_pay``)."""
    return method == "draft" or (method == "auto" and model_can_pay)


def row_schedule(method: str, k_policy: str, k: int, k_max: int) -> KSchedule | None:
    """A row's own draft-length schedule under ``k_policy`` (config.K_POLICY_CHOICES), as the
    single path's ``DecoderCosts.schedule``: ``fixed`` drafts its k every step, ``threshold``
    moves it with the row's acceptance; ``cost`` (None) leaves it to the batch's choice. The
    methods with a stateless chain drafter (the draft model, prompt lookup, layer skip) take
    either; suffix decoding and the head methods' trees only ``fixed`` (a tree or a lookup k
    deep every step, as on the single path); auto (and plain decoding) chooses its own."""
    planner = registry.BY_NAME[method].planner
    # Only the policy is checked: an engine's k_max passes MAX_K_MAX where it was built for a
    # fixed k past it (engine/one_request.py), which a policy's row never decodes under.
    if check_k_policy(k_policy, min(k_max, MAX_K_MAX)) == "cost" or planner in (registry.PLAN_SOURCES, registry.PLAN_PLAIN):
        return None
    if planner != registry.PLAN_CHAIN:
        return FixedK(k) if k_policy == "fixed" else None
    return FixedK(k) if k_policy == "fixed" else ThresholdK(k=min(k, k_max), k_max=k_max)


def row_drafters(
    method: str,
    k: int,
    k_max: int,
    suffix_group: str | None,
    suffix_cache: SuffixCache,
    ngram_sizes: tuple[int, int],
    model_can_pay: bool,
    trees: bool,
    heads: Mapping[str, HeadsDrafter],
    verify_costs: PassCosts | None = None,
    k_policy: str = "cost",
) -> RowDrafters:
    """The drafters of a row of ``method`` (one of ``BATCH_METHODS``, checked by the engine) with
    draft length cap ``k``: a lookup drafts up to ``k``, or in auto up to ``k_max`` (the draft
    model's cap stays the request's ``k``, as on the single path). ``trees``: the target scores
    token trees (``BatchModel.supports_trees``); a suffix row then drafts trees ``k`` deep.
    ``heads``: the engine's Medusa and EAGLE drafters by method, of which a row gets a fresh one.
    ``verify_costs``: the target's pass costs as now priced (None: not timed), at which an auto
    row's suffix chain chooses its length, as on the single path (``drafters/planner.plan_auto``).
    ``k_policy``: how a chain row's draft length is chosen (``row_schedule``)."""
    schedule = row_schedule(method, k_policy, k, k_max)
    if method == "ngram":
        return RowDrafters(NgramDrafter(*ngram_sizes), None, False, schedule=schedule)
    if method == "suffix":
        proposer = SuffixProposer(suffix_cache, suffix_group, depth=max(k, 1))
        if trees:
            return RowDrafters(SuffixTreeDrafter(proposer), None, False, tree_nodes=proposer.tree_size,
                               schedule=schedule)
        if k_policy == "cost":
            # k "auto": a chain as deep as the match and the target's pass costs make pay, past
            # k_max (the single path's suffix_depth): an auto row whose one source is the suffix
            # tree, priced as the batch pass it rides in.
            row = _auto_row(k_max, suffix_group, suffix_cache, ngram_sizes, verify_costs, ngram_cap=0)
            return RowDrafters(row, row, False)
        return RowDrafters(SuffixDrafter(proposer), None, False, schedule=schedule)
    if method == "auto":
        row = _auto_row(k_max, suffix_group, suffix_cache, ngram_sizes, verify_costs, ngram_cap=k_max)
        return RowDrafters(row, row, uses_draft(method, model_can_pay))
    if method == registry.LAYERSKIP.name:
        return RowDrafters(None, None, False, skips_layers=True, schedule=schedule)
    if method in heads:
        drafter = heads[method].fresh()
        return RowDrafters(None, None, False, tree_nodes=drafter.max_tree_nodes - 1, heads=drafter,
                           schedule=schedule)
    return RowDrafters(None, None, uses_draft(method, model_can_pay), schedule=schedule)



def _auto_row(k_max: int, suffix_group: str | None, suffix_cache: SuffixCache, ngram_sizes: tuple[int, int],
              verify_costs: PassCosts | None, ngram_cap: int) -> AutoRow:
    """A row that picks its lookup every step (``drafters/auto_row.py``): prompt lookup up to
    ``ngram_cap`` tokens (0: none), the suffix chain up to ``suffix.auto_depth``, cut by the
    target's pass costs (None: not timed)."""
    depth = auto_depth(k_max)
    verify_seconds = (None if verify_costs is None
                      else [verify_costs.seconds(1, rows) for rows in range(1, depth + 2)])
    suffix = SuffixDrafter(SuffixProposer(suffix_cache, suffix_group, depth=depth, verify_seconds=verify_seconds))
    return AutoRow(NgramDrafter(*ngram_sizes), suffix, ngram_cap=ngram_cap)
