"""The decoding loop: prefill -> (draft -> verify -> commit)* for one request.

The engine owns the target's sequence on its backend (``backends/base.py``: the KV cache
behind ``begin``/``extend``/``commit``) and the committed token buffer. Plain decoding is
the same loop with zero drafted tokens per step: the target scores the last committed token
alone and "verification" picks its next token, so both paths share every line that matters
for equality.

Invariant between steps: the committed sequence has length L; the target cache holds valid
K/V for positions [0, L - 1); the last committed token is fed by the next verify pass
together with the draft tokens, at positions L - 1 .. L - 1 + k.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from specdecode.backends.base import SequenceModel
from specdecode.backends.compiled import CompileLog
from specdecode.backends.openmp import release_thread_team
from specdecode.config import ACCEPTANCE_RULES, TREE_METHODS, SamplingParams
from specdecode.core.device import host_to_device
from specdecode.core.logprobs import TokenLogprob, pack, unpack
from specdecode.core.sampling import LogitsProcessor, make_generator
from specdecode.core.timing import COST_PROBE_ROWS, VERIFY_COST_REPEATS, Stopwatch
from specdecode.core.tree import TokenTree
from specdecode.costs.k_policy import interpolate
from specdecode.costs.store import VERIFY_TABLE, CostStore
from specdecode.drafters.base import Drafter, TreeDrafter
from specdecode.drafters.plan import RequestPlan
from specdecode.engine.batch_verify import tree_logprobs
from specdecode.engine.grammar import CompiledGrammar, GrammarState, apply_masks, first_forbidden
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.penalties import TokenPenalties, wants_penalties
from specdecode.engine.prefix import NO_MATCH, CachedPrefix, match_prefix
from specdecode.engine.stopping import cut_at_stop
from specdecode.engine.stream import StepTokens
from specdecode.engine.verify import (
    PAD_TOKEN,
    greedy_tree_verify,
    greedy_verify,
    rejection_tree_verify,
    rejection_verify,
    typical_tree_verify,
)
from specdecode.errors import InvalidRequestError


@dataclass(slots=True)
class StepResult:
    """One draft-and-verify step, as the decoding loop needs it."""

    tokens: list[int]  # the accepted + 1 emitted tokens (host)
    device_tokens: torch.Tensor  # (>= accepted + 1,) long: the same, on the device
    accepted: int
    proposed: int  # drafted tokens (a tree: its depth, the most it could have accepted)
    draft_seconds: float
    verify_seconds: float
    draft_passes: int = 0
    nodes: int = 0  # drafted tree nodes (tree methods)
    forced: bool = False  # the drafts were the grammar's forced tokens, not the drafter's
    logprobs: list[TokenLogprob] | None = None  # one per emitted token (SamplingParams.logprobs)


class SpecEngine:
    def __init__(
        self,
        target: SequenceModel,
        eos_token_ids: Sequence[int],
        *,
        sync_timing: bool = False,
        compile_log: CompileLog | None = None,
        prefix_cache: bool = True,
        cost_store: CostStore | None = None,
    ) -> None:
        self.target = target
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sync_timing = sync_timing
        # Compiled passes (backends/compiled.py) log their compile time here: a request reports
        # the share it paid for shapes compiled during it.
        self.compile_log = compile_log
        # Target pass seconds by row count, as timed (or as an earlier run stored: costs/store.py).
        self.cost_store = cost_store
        self._pass_seconds: dict[int, float] = cost_store.get(VERIFY_TABLE) if cost_store is not None else {}
        # What the target's cache holds after the last request, for the next one's prefix
        # (engine/prefix.py); None when disabled or nothing is known.
        self.prefix_cache = prefix_cache
        self._cached: CachedPrefix | None = None

    @property
    def device(self) -> torch.device:
        return self.target.device

    def verify_costs(self, max_rows: int, repeats: int = VERIFY_COST_REPEATS) -> list[float]:
        """Seconds of a target pass over 1..max_rows rows on this machine (best of ``repeats``).

        Measured on a scratch sequence at a short context, for the cost-aware draft length
        (``costs.k_policy.CostAwareK``), suffix decoding and the auto method. Row counts in
        ``COST_PROBE_ROWS`` (and ``max_rows``) are timed once per engine and kept, so tables of
        different sizes (k_max + 1 rows for lookups and the draft model, more for suffix
        decoding) share their timings; the rest are interpolated between them.
        """
        probes = sorted({r for r in COST_PROBE_ROWS if r <= max_rows} | {max_rows})
        missing = [r for r in probes if r not in self._pass_seconds]
        if missing:
            self._pass_seconds.update(self.target.pass_seconds(missing, repeats))
            if self.cost_store is not None:
                self.cost_store.put(VERIFY_TABLE, self._pass_seconds)
        measured = {r: self._pass_seconds[r] for r in probes}
        return [interpolate(measured, rows) for rows in range(1, max_rows + 1)]

    @torch.inference_mode()
    def decode(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        plan: RequestPlan,
        stats: GenerationStats,
        acceptance: str = "lossless",
        cache_salt: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> Iterator[list[int]]:
        """Yield the newly committed tokens after each step; fill ``stats`` as it goes.

        ``plan`` (``drafters/plan.py``) holds the drafter and the draft length: a chain step drafts
        up to ``plan.k`` tokens, or its schedule's choice for the step (never more); no drafter
        is plain autoregressive decoding. A drafter may propose fewer tokens than asked, even
        none: that step decodes plainly. A tree plan proposes a token tree each step instead
        (the torch backend only); ``acceptance="typical"`` verifies its trees with Medusa's lossy
        typical acceptance. Closing the iterator early (a stop string) still leaves ``stats``
        complete. With the prefix cache on, the prompt's longest prefix shared with the previous
        request of the same ``cache_salt`` is not prefilled again (``stats.cached_tokens``).
        ``grammar`` (``params.structured`` compiled, ``engine/grammar.py``) masks every row the
        target scores, so the output is the target's distribution under the grammar.
        """
        started = time.perf_counter()
        compiled_before = self.compile_log.seconds if self.compile_log is not None else 0.0
        device = self.device
        prompt_len = len(prompt_ids)
        max_new = params.max_new_tokens
        drafter = plan.drafter
        speculate = drafter is not None
        tree_mode = plan.tree
        if acceptance not in ACCEPTANCE_RULES:
            raise InvalidRequestError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, got {acceptance!r}.")
        if acceptance == "typical" and not tree_mode:
            raise InvalidRequestError("Typical acceptance applies to the tree methods (medusa, eagle) only.")
        if tree_mode and not self.target.supports_trees:
            raise InvalidRequestError("Token trees need tree attention, which only the torch backend has.")
        capacity = prompt_len + max_new + 1
        # Trained heads read the target's features of every prompt position, which a reused
        # prefix does not recompute: they prefill the whole prompt.
        reads_features = tree_mode and plan.method in TREE_METHODS
        # The prompt's tail goes into the first verify pass (logits for its verify rows only):
        # the first token then costs one pass, not a prefill and a pass. Not where something
        # reads the prompt's K/V or features before that pass (layer skip, tree heads), nor on a
        # backend that compiles each pass shape.
        merge = (not tree_mode and self.target.merges_prefill
                 and not (speculate and getattr(drafter, "reads_target_cache", False)))
        cached, self._cached = self._cached, None  # taken: a failure below leaves nothing reusable
        match = NO_MATCH
        if self.prefix_cache and not reads_features:
            match = match_prefix(cached, prompt_ids, cache_salt, self.target.epoch)
        # A tree pass writes all its nodes past the committed length before keeping one path.
        self.target.begin(capacity + (drafter.max_tree_nodes if tree_mode else 0), keep=match.keep)
        constraint = grammar.state() if grammar is not None else None
        penalties = (TokenPenalties(params, prompt_ids, self.target.vocab_size, device) if wants_penalties(params)
                     else None)
        processor = LogitsProcessor.from_params(params, constraint, penalties)
        generator = None if processor.greedy else make_generator(params.seed, device)
        committed = torch.empty((1, capacity), dtype=torch.long, device=device)
        committed[0, :prompt_len] = host_to_device(list(prompt_ids), torch.long, device)
        stats.prompt_tokens = prompt_len
        stats.cached_tokens = match.keep
        if params.logprobs is not None:
            stats.token_logprobs = []
        host_tokens = list(prompt_ids)  # committed, on the host: the next request's prefix record
        valid = match.keep  # positions whose K/V the target holds
        watches = (Stopwatch(device, self.sync_timing), Stopwatch(device, self.sync_timing))
        step = self._stepper(plan, committed, processor, generator, acceptance, watches, constraint)
        on_committed = getattr(drafter, "on_committed", None) if speculate else None
        try:
            # The first verify pass feeds the last prompt token (and, merged, the rest of the
            # uncached prompt before it) with the first drafts, so even the first new token can
            # be speculated. Unmerged, all but that token are prefilled here first.
            with Stopwatch(device, self.sync_timing) as prefill_watch:
                if speculate:
                    drafter.start(prompt_len, capacity, self.target, shared_prefix=match.shared)
                if on_committed is not None:
                    on_committed(list(prompt_ids))
                if prompt_len - 1 > match.keep and not merge:
                    out = self.target.extend(committed[:, match.keep : prompt_len - 1], match.keep,
                                             compute_logits=False)
                    stats.target_forward_passes += 1
                    if tree_mode:
                        drafter.observe(out.hidden, match.keep)
                    self.target.commit(prompt_len - 1)
                    valid = prompt_len - 1
            stats.prefill_seconds = prefill_watch.elapsed

            length = prompt_len
            while True:
                remaining = max_new - stats.new_tokens
                prompt_rows = length - 1 - valid  # prompt tokens this step's pass also feeds
                result = step(length, remaining, valid)
                stats.draft_seconds += result.draft_seconds
                if prompt_rows:  # the pass was mostly the prompt's: counted as prefill time
                    stats.prefill_seconds += result.verify_seconds
                else:
                    stats.verify_seconds += result.verify_seconds
                stats.draft_forward_passes += result.draft_passes
                stats.tree_nodes_proposed += result.nodes
                if result.forced:
                    stats.record_forced_step(result.proposed, result.accepted)
                else:
                    stats.record_step(result.proposed, result.accepted)

                new_tokens, stop_reason = cut_at_stop(result.tokens, remaining, self.eos_token_ids, params.ignore_eos)
                count = len(new_tokens)
                committed[0, length : length + count] = result.device_tokens[:count]
                # K/V of the previously last token and of the accepted drafts are now valid.
                valid = length + min(result.accepted, count - 1)
                self.target.commit(valid)
                host_tokens.extend(new_tokens)
                if result.logprobs is not None and stats.token_logprobs is not None:
                    stats.token_logprobs.extend(result.logprobs[:count])
                if penalties is not None:
                    penalties.advance(result.device_tokens[:count])
                if constraint is not None:
                    constraint.advance(new_tokens)
                    stats.mask_seconds = constraint.mask_seconds
                    if constraint.terminated and not stop_reason:  # the grammar ended (ignore_eos)
                        stop_reason = "stop"
                length += count
                stats.new_tokens += count
                if on_committed is not None:
                    on_committed(new_tokens)
                stats.stop_reason = stop_reason or "running"
                if not stats.first_token_seconds:
                    stats.first_token_seconds = time.perf_counter() - started
                yield StepTokens(new_tokens, min(result.accepted, count))
                if stop_reason:
                    break
        except GeneratorExit:
            # Closed between steps (a stop string, a client gone): the cache is as committed.
            self._remember(host_tokens, valid, cache_salt)
            raise
        else:
            self._remember(host_tokens, valid, cache_salt)
        finally:
            stats.total_seconds = time.perf_counter() - started
            if self.compile_log is not None:
                stats.compile_seconds = self.compile_log.seconds - compiled_before
            # This thread may not decode again for a while: its OpenMP helpers would slow every
            # other thread's passes (backends/openmp.py).
            release_thread_team()

    def _remember(self, tokens: list[int], valid: int, cache_salt: str | None) -> None:
        """Record what the target's cache holds after a request that ended cleanly (an error
        mid-pass leaves the record cleared: its cache may hold anything)."""
        if self.prefix_cache:
            self._cached = CachedPrefix(tuple(tokens), valid, cache_salt, self.target.epoch)

    def forget_prefix(self) -> None:
        """Drop the prefix record: the next request prefills its whole prompt."""
        self._cached = None

    def _stepper(
        self,
        plan: RequestPlan,
        committed: torch.Tensor,  # (1, capacity) long
        processor: LogitsProcessor,
        generator: torch.Generator | None,
        acceptance: str,
        watches: tuple[Stopwatch, Stopwatch],
        constraint: GrammarState | None,
    ) -> Callable[[int, int, int], StepResult]:
        """The step function for this request, chosen once: ``step(length, remaining, start)``
        drafts, verifies and returns what the step emitted (plain, a chain of drafts, or a token
        tree). Its pass feeds the committed tokens from ``start`` (valid K/V end there: the last
        one, or a chain's first step's uncached prompt tail) before the drafts."""
        drafter, schedule = plan.drafter, plan.schedule
        if drafter is None:
            return lambda length, remaining, start: self._chain_step(
                None, committed, length, 0, processor, generator, watches, constraint, remaining - 1, start
            )
        if plan.tree:
            tree_drafter = cast(TreeDrafter, drafter)
            return lambda length, remaining, start: self._tree_step(
                tree_drafter, committed, length, remaining - 1, processor, generator, acceptance, watches, constraint
            )

        def chain(length: int, remaining: int, start: int) -> StepResult:
            # This step's k: the schedule's choice, at most the plan's; never past max_new_tokens
            # (a step emits at most k + 1 tokens).
            k = min(schedule.next_k() if schedule is not None else plan.k, plan.k, remaining - 1)
            result = self._chain_step(drafter, committed, length, k, processor, generator, watches, constraint,
                                      remaining - 1, start)
            if result.forced:
                return result  # the drafter did not propose: nothing for it or its schedule to learn
            if result.proposed > 0:
                drafter.on_verified(result.accepted)
            if schedule is not None:
                # A pass that also fed the prompt's tail says nothing of what verifying costs.
                schedule.observe(result.proposed, result.accepted, result.draft_seconds, result.draft_passes,
                                 result.verify_seconds if start == length - 1 else None)
            return result

        return chain

    def _chain_step(
        self,
        drafter: Drafter | None,
        committed: torch.Tensor,  # (1, capacity) long
        length: int,
        k: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
        watches: tuple[Stopwatch, Stopwatch],
        constraint: GrammarState | None,
        forced_limit: int,
        start: int,
    ) -> StepResult:
        """Draft up to k tokens in a line, verify them in one target pass (under the grammar, the
        rows masked by its state after each draft: engine/grammar.py). Where the grammar forces
        what comes next, up to ``forced_limit`` of its tokens are the drafts instead (a step
        emits at most its drafts + 1 tokens: the caller passes what max_new_tokens leaves).
        The pass feeds the committed tokens from ``start`` (the last one, or a merged prompt
        tail's first) before the drafts; logits come for the last committed token and the drafts
        only."""
        draft_watch, verify_watch = watches
        device = self.device
        draft_seconds, draft_passes = 0.0, 0
        draft_tokens = torch.empty((1, 0), dtype=torch.long, device=device)
        draft_probs = None
        forced = constraint.forced_tokens(forced_limit) if constraint is not None else []
        if forced:
            draft_tokens = host_to_device([forced], torch.long, device)
            k = len(forced)
        elif k > 0:
            assert drafter is not None
            with draft_watch:
                processor.begin_draft()
                try:
                    proposal = drafter.propose(committed[:, :length], k, processor, generator)
                finally:
                    processor.end_draft()
            draft_seconds, draft_passes = draft_watch.elapsed, proposal.forward_passes
            draft_tokens, draft_probs = proposal.tokens, proposal.probs
            k = proposal.num_tokens
        allowed = None
        if constraint is not None:
            drafts = draft_tokens[0].tolist()  # the matcher runs on the host
            allowed = constraint.chain_masks(drafts)  # (k + 1, V)
            if draft_probs is None or processor.greedy:
                # A deterministic draft past its first forbidden token is rejected there for
                # sure, and its residual is p itself: verifying fewer rows changes nothing.
                legal = first_forbidden(allowed, drafts)
                draft_tokens, allowed, k = draft_tokens[:, :legal], allowed[: legal + 1], legal
                if draft_probs is not None:
                    draft_probs = draft_probs[:, :legal]
        with verify_watch:
            inputs = torch.cat([committed[:, start:length], draft_tokens], dim=1)
            rows = k + 1 if start < length - 1 else None  # a merged prompt tail: no logits of its own
            raw = logits = self.target.extend(inputs, start, logits_last=rows).logits  # (1, k + 1, V)
            if allowed is not None:
                logits = apply_masks(logits, allowed)
            if processor.penalties is not None:  # row i penalised with the drafts before it
                logits = processor.penalties.chain_rows(logits[0], draft_tokens[0])[None]
            probs = None
            if processor.greedy:
                result = greedy_verify(draft_tokens, logits)
            else:
                probs = processor.probs(logits)
                result = rejection_verify(draft_tokens, draft_probs, probs, generator)
            logprobs = None
            if processor.logprobs is None:
                emitted_row = result.tokens[0].tolist()  # the one host sync of the step
            else:  # the logprobs travel in the same read
                packed = pack(processor.logprob_rows(raw[0], logits[0], None if probs is None else probs[0]),
                              result.tokens[0], processor.logprobs).tolist()
                emitted_row = [int(row[0]) for row in packed]
        # Read the accepted count off the same row: a second tensor read would be a second sync.
        emitted_count = emitted_row.index(PAD_TOKEN) if PAD_TOKEN in emitted_row else len(emitted_row)
        if processor.logprobs is not None:
            logprobs = unpack(packed, emitted_count)
        return StepResult(
            tokens=emitted_row[:emitted_count], device_tokens=result.tokens[0], accepted=emitted_count - 1,
            proposed=k, draft_seconds=draft_seconds, verify_seconds=verify_watch.elapsed, draft_passes=draft_passes,
            forced=bool(forced), logprobs=logprobs,
        )

    def _tree_step(
        self,
        drafter: TreeDrafter,
        committed: torch.Tensor,  # (1, capacity) long
        length: int,
        max_depth: int,
        processor: LogitsProcessor,
        generator: torch.Generator | None,
        acceptance: str,
        watches: tuple[Stopwatch, Stopwatch],
        constraint: GrammarState | None = None,
    ) -> StepResult:
        """Draft a token tree, score every node in one target pass, keep the accepted path (under
        the grammar, node i's row masked by its state after the path to node i; where it forces
        what comes next, the tree is the chain of its forced tokens instead)."""
        draft_watch, verify_watch = watches
        device = self.device
        # Never draft past max_new_tokens: a path of depth d emits d + 1 tokens.
        forced = constraint.forced_tokens(max_depth) if constraint is not None else []
        with draft_watch:
            if forced:
                tree = TokenTree.chain(committed[0, length - 1 : length], host_to_device(forced, torch.long, device),
                                       None)
            else:
                tree = drafter.propose_tree(committed[:, :length], max_depth, processor, generator)
        start = length - 1  # the root's slot and position
        target = self.target
        with verify_watch:
            out = target.extend_tree(tree, start)  # the backend supports trees: checked in decode()
            assert out.logits is not None and out.hidden is not None
            raw = logits = out.logits[0]  # (N, V)
            if constraint is not None:
                logits = apply_masks(logits, constraint.masks(tree.parents, tree.tokens.tolist()))
            if processor.penalties is not None:  # node i penalised with the path to it
                logits = processor.penalties.tree_rows(logits, tree)
            probs = None if processor.greedy else processor.probs(logits)
            if probs is None:
                result = greedy_tree_verify(tree, logits)
            elif acceptance == "typical":
                result = typical_tree_verify(tree, probs, generator)
            else:
                result = rejection_tree_verify(tree, probs, generator)
            # The path's rows (a second host read: tree verification reads the path first).
            logprobs = tree_logprobs(raw, logits, result, processor) if processor.logprobs is not None else None
            target.keep_path(start, result.path)
            # Index with a device tensor: a Python list index is copied from pageable memory (a sync).
            drafter.observe(out.hidden[:, host_to_device(result.path, torch.long, device)], start)
        return StepResult(
            tokens=result.tokens, device_tokens=host_to_device(result.tokens, torch.long, device),
            accepted=len(result.path) - 1, proposed=tree.max_depth, nodes=0 if forced else tree.size - 1,
            draft_seconds=draft_watch.elapsed, verify_seconds=verify_watch.elapsed,
            draft_passes=0 if forced else drafter.last_forward_passes, forced=bool(forced), logprobs=logprobs,
        )
