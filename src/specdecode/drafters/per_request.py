"""What one request decodes with: its drafter, its draft-length schedule and the engine's k.

The decoder's stateless drafters (prompt lookup, the draft model, layer skip, Medusa/EAGLE heads)
serve every request as they are. Suffix decoding and the auto method keep per-request state, so
each request gets a fresh one over the decoder's shared parts: its cache of earlier responses,
its lookup memory and its measured pass costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdecode.backends.select import TORCH
from specdecode.config import TREE_METHODS, SpecConfig
from specdecode.costs.k_policy import KSchedule
from specdecode.drafters.auto import AutoDrafter
from specdecode.drafters.base import Drafter, TreeDrafter
from specdecode.drafters.suffix import AUTO_DEPTH, SuffixDrafter, SuffixProposer, suffix_drafter

if TYPE_CHECKING:
    from specdecode.api import SpecDecoder


@dataclass(slots=True)
class RequestPlan:
    drafter: Drafter | TreeDrafter | None  # None: plain decoding
    schedule: KSchedule | None  # None: the drafter's own choice, or a fixed k
    most_k: int  # the engine's k: the most a step drafts (a tree's shape sets its own; 1 says "speculate")
    auto: AutoDrafter | None = None  # method auto: its per-source step counts go into the stats


def suffix_depth(spec: SpecConfig, policy: str, k: int) -> int:
    """How deep suffix decoding may draft: k, or with k "auto" past k_max (``AUTO_DEPTH``): a
    model-free draft pays no pass per token, so its match and the verify costs bound it."""
    return max(spec.k_max, AUTO_DEPTH) if policy == "cost" else k


def plan_request(decoder: SpecDecoder, method: str, draft_k: int, policy: str, suffix_group: str | None) -> RequestPlan:
    """The drafter and schedule for a request of ``method`` with draft length ``draft_k`` (or its
    first guess) under ``policy`` ("fixed", "cost", "threshold"); the method is known to be loaded."""
    spec = decoder.spec
    if method == "auto":
        auto = fresh_auto(decoder, draft_k, suffix_group)
        return RequestPlan(auto, auto, auto.most_k, auto)
    if method == "suffix":  # chooses its own draft per step
        depth = suffix_depth(spec, policy, draft_k)
        drafter = suffix_drafter(decoder.suffix_cache, suffix_group, tree=decoder.backend == TORCH, depth=depth,
                                 tree_size=spec.tree_size,
                                 verify_seconds=decoder.engine.verify_costs(depth + 1) if policy == "cost" else None)
        return RequestPlan(drafter, None, depth)
    drafter = decoder.drafters.get(method)
    if drafter is None:  # method none
        return RequestPlan(None, None, 0)
    if method in TREE_METHODS:
        return RequestPlan(drafter, None, 1)
    schedule = decoder.costs.schedule(policy, draft_k, spec.k_max, drafter is decoder.draft_drafter,
                                      model_free=drafter is decoder.ngram_drafter)
    return RequestPlan(drafter, schedule, spec.k_max if schedule is not None else draft_k)


def fresh_auto(decoder: SpecDecoder, draft_k: int, suffix_group: str | None) -> AutoDrafter:
    """A per-request auto drafter over the decoder's lookup, suffix trees (up to ``AUTO_DEPTH``
    deep, as ``--method suffix --k auto``) and draft model."""
    k_max = decoder.spec.k_max
    depth = suffix_depth(decoder.spec, "cost", draft_k)
    draft = decoder.draft_drafter
    pass_seconds, token_seconds = decoder.costs.draft_model() if draft is not None else (0.0, 0.0)
    verify_seconds = decoder.engine.verify_costs(depth + 1)
    return AutoDrafter(
        decoder.ngram_drafter,
        draft,
        verify_seconds,
        k_max,
        draft_k=draft_k,
        draft_pass_seconds=pass_seconds,
        draft_token_seconds=token_seconds,
        live_costs=decoder.costs.live,
        suffix=SuffixDrafter(SuffixProposer(decoder.suffix_cache, suffix_group, depth=depth, verify_seconds=verify_seconds)),
        memory=decoder.lookup_memory,
        suffix_depth=depth,
    )
