"""The per-request planner: which drafter a request decodes with, and its draft length.

``PLANNERS`` maps each method to the function that plans it (by its registry entry's planner
kind, ``core/registry.py``), over ``DecoderResources``: the
decoder's config, its stateless drafters (prompt lookup, the draft model, layer skip,
Medusa/EAGLE heads; shared by every request as they are), and the shared parts that per-request
drafters are built over (suffix decoding's cache of earlier responses, auto's lookup memory,
the measured pass costs). Suffix decoding and auto keep per-request state, so each request
gets a fresh drafter. The method is chosen once, by name; nothing is guessed back from a
drafter object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from specdecode.backends.select import TORCH
from specdecode.config import DecoderConfig
from specdecode.core import registry
from specdecode.costs.decoder_costs import DecoderCosts
from specdecode.drafters.auto import AutoDrafter
from specdecode.drafters.base import Drafter, TreeDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.plan import PLAIN, RequestPlan
from specdecode.drafters.suffix import SuffixDrafter, SuffixProposer, auto_depth, suffix_drafter
from specdecode.drafters.suffix_cache import SuffixCache


@dataclass(slots=True, frozen=True)
class DecoderResources:
    """What plans are made from: one decoder's config, drafters, caches and costs."""

    config: DecoderConfig  # as loading resolved it
    backend: str  # "torch" or "llama.cpp"
    drafters: Mapping[str, Drafter | TreeDrafter]  # the stateless drafters by method
    suffix_cache: SuffixCache
    costs: DecoderCosts

    @property
    def draft_model(self) -> DraftModelDrafter | None:
        drafter = self.drafters.get(registry.DRAFT.name)
        assert drafter is None or isinstance(drafter, DraftModelDrafter)
        return drafter


@dataclass(slots=True, frozen=True)
class PlanRequest:
    """One request's choices: its method, draft length ``k`` (the fixed length, or a policy's
    first guess), k policy and suffix group."""

    method: str
    k: int
    policy: str  # "fixed", "cost" or "threshold"
    suffix_group: str | None


def suffix_depth(config: DecoderConfig, policy: str, k: int) -> int:
    """How deep suffix decoding may draft: k, or with k "auto" past k_max (``AUTO_DEPTH``): a
    model-free draft pays no pass per token, so its match and the verify costs bound it."""
    return auto_depth(config.k_max) if policy == "cost" else k


def plan_plain(resources: DecoderResources, request: PlanRequest) -> RequestPlan:
    return PLAIN


def plan_chain(resources: DecoderResources, request: PlanRequest) -> RequestPlan:
    """A stateless chain drafter (the draft model, prompt lookup, layer skip) under the request's policy."""
    drafter = resources.drafters[request.method]
    k_max = resources.config.k_max
    method = registry.BY_NAME[request.method]
    with_draft_model = method.uses_draft_model
    schedule = resources.costs.schedule(request.policy, request.k, k_max, with_draft_model=with_draft_model,
                                        model_free=method.model_free)
    note = resources.costs.draft_model_note(k_max) if with_draft_model and request.policy == "cost" else None
    return RequestPlan(request.method, drafter, k_max if schedule is not None else request.k, schedule, note=note)


def plan_tree(resources: DecoderResources, request: PlanRequest) -> RequestPlan:
    return RequestPlan(request.method, resources.drafters[request.method], tree=True)


def plan_suffix(resources: DecoderResources, request: PlanRequest) -> RequestPlan:
    """A fresh suffix drafter over the decoder's earlier responses: token trees on torch, its
    best chain on llama.cpp; it chooses its own draft per step."""
    depth = suffix_depth(resources.config, request.policy, request.k)
    tree = resources.backend == TORCH
    verify_seconds = resources.costs.verify(depth + 1) if request.policy == "cost" else None
    drafter = suffix_drafter(resources.suffix_cache, request.suffix_group, tree=tree, depth=depth,
                             tree_size=resources.config.tree_size, verify_seconds=verify_seconds)
    return RequestPlan(request.method, drafter, 0 if tree else depth, tree=tree)


def plan_auto(resources: DecoderResources, request: PlanRequest) -> RequestPlan:
    """A fresh auto drafter over the decoder's lookup, suffix trees (up to ``AUTO_DEPTH`` deep,
    as ``--method suffix --k auto``) and draft model; it is its own schedule."""
    config, costs = resources.config, resources.costs
    depth = suffix_depth(config, "cost", request.k)
    draft = resources.draft_model
    pass_seconds, token_seconds = costs.draft_model() if draft is not None else (0.0, 0.0)
    verify_seconds = costs.verify(depth + 1)
    auto = AutoDrafter(
        resources.drafters[registry.NGRAM.name],
        draft,
        verify_seconds,
        config.k_max,
        draft_k=request.k,
        draft_pass_seconds=pass_seconds,
        draft_token_seconds=token_seconds,
        live_costs=costs.live,
        pricing=costs.live_pricing(depth + 1),  # the decoder's live tables: what it learns is kept and written back
        suffix=SuffixDrafter(SuffixProposer(resources.suffix_cache, request.suffix_group, depth=depth,
                                            verify_seconds=verify_seconds)),
        suffix_depth=depth,
    )
    return RequestPlan(request.method, auto, auto.k, auto, steps_by_source=auto.steps_by_source)


PlanFunction = Callable[[DecoderResources, PlanRequest], RequestPlan]
PLAN_FUNCTIONS: dict[str, PlanFunction] = {
    registry.PLAN_PLAIN: plan_plain,
    registry.PLAN_CHAIN: plan_chain,
    registry.PLAN_TREE: plan_tree,
    registry.PLAN_SUFFIX: plan_suffix,
    registry.PLAN_SOURCES: plan_auto,
}
PLANNERS: dict[str, PlanFunction] = {method.name: PLAN_FUNCTIONS[method.planner] for method in registry.REGISTRY}


def plan_request(resources: DecoderResources, request: PlanRequest) -> RequestPlan:
    """The plan for ``request``, whose method is known to be loaded (``SpecDecoder.stream`` checks)."""
    return PLANNERS[request.method](resources, request)
