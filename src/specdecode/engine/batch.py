"""Batched speculative decoding: many requests share each draft and verify pass.

Each step: the scheduler admits waiting requests (prefilled together in one padded target pass), the batch's draft
length k is chosen from live acceptance and measured costs (``costs.batch_k.BatchK``; k = 0 decodes the whole batch
plainly), every running sequence reserves its KV slots, the drafters propose (prompt lookup per row on the host; the
draft model for all its rows in one pass per drafted token), the target scores every row's last committed token and
drafts in ONE padded pass, and the rows are verified together (greedy rows in one call, sampling rows in another, each
with its request's sampling parameters, generator and acceptance rule). One host read per step brings every row's
emitted tokens back. The models are ``BatchModel``s (``backends/base.py``): our ``Transformer`` over paged pools, or
llama.cpp contexts whose sequence ids are the batch's slots.

Rows accept different numbers of tokens. Policy ``async`` (the default) lets each keep all it accepted; each
sequence's length, positions and cache are its own. Policy ``sync`` makes the batch wait for its slowest member: every
row that drafted keeps only as many accepted tokens as the row that accepted fewest (plus the token after them). A kept
prefix of a lossless sample is still a lossless sample, so both policies leave every request's output distribution the
target's (but a tree row's that opted into Medusa's lossy typical acceptance); ``sync`` only emits less per step.

Invariant per sequence between steps (as in ``engine/single.py``): L committed tokens, target KV valid for positions
[0, L - 1); the next verify pass feeds the last committed token with the drafts. Every method batches
(``engine/batch_rows.py``: what each row drafts with). Suffix, medusa and eagle rows draft token trees where the target
scores trees (torch: in the same padded pass, with their own attention masks, ``kv/paged.py``; heads read the target's
features, which the prefill and verify passes hand them); layerskip rows draft with the target's own layers in its
pool; an ``auto`` row picks its source and draft length every step, priced as the batch pass it rides in
(``drafters/auto_row.py``, ``costs/batch_k.py``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence

import torch

from specdecode.backends.base import BatchModel, SequencePool
from specdecode.backends.torch_batch import PagedBatchModel, as_batch_model
from specdecode.config import DEFAULT_K_MAX, DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, SamplingParams, SchedulerConfig
from specdecode.core.timing import Stopwatch
from specdecode.costs.batch_k import BatchK, PassCosts, model_can_pay
from specdecode.costs.k_policy import AcceptanceEstimate
from specdecode.drafters.base import DraftProposal, HeadsDrafter
from specdecode.drafters.batch_draft import BatchDraftModel
from specdecode.drafters.batch_layer_skip import BatchLayerSkip
from specdecode.drafters.suffix_cache import DEFAULT_GROUP, SuffixCache
from specdecode.engine.batch_pass import VerifiedStep, verify_pass
from specdecode.engine.batch_prefill import prefill_isolated
from specdecode.engine.batch_proposals import (
    choose_sources,
    drafts_with_model,
    forced_drafts,
    plan_rows,
    propose,
    reads_backlog,
    slots_needed,
    time_draft_model,
)
from specdecode.engine.batch_request import BatchRequest, RequestOutput, generator_states, restore_generators
from specdecode.engine.batch_rows import BATCH_METHODS, check_method, row_drafters, uses_draft
from specdecode.engine.grammar import CompiledGrammar
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.scheduler import ScheduledSequence, Scheduler
from specdecode.engine.stopping import cut_at_stop
from specdecode.errors import InvalidRequestError
from specdecode.kv.paged import DEFAULT_BLOCK_SIZE
from specdecode.models.llama import Transformer

BATCH_POLICIES = ("async", "sync")
DEFAULT_BATCH_POLICY = "async"
DEFAULT_MAX_BATCH = 8
POOLED_ACCEPTANCE_DECAY = 0.98  # the engine-wide estimate forgets over ~50 steps
POOLED_PRIOR_TRIALS = 6.0  # how many of its trials a new request's estimate inherits, at most
DEFAULT_KV_CACHE_TOKENS = 16384  # per model; the demo target's bf16 KV: 28 KiB a token, 0.45 GiB


class BatchEngine:
    """Continuous-batching speculative decoder over a backend's batch models (not thread-safe: one
    thread calls ``add``, ``abort`` and ``step``)."""

    def __init__(
        self,
        target: Transformer | BatchModel,
        draft: Transformer | BatchModel | None,
        eos_token_ids: Sequence[int],
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        policy: str = "async",
        k_max: int = DEFAULT_K_MAX,
        verify_costs: PassCosts | None = None,
        draft_costs: PassCosts | None = None,
        ngram_max: int = DEFAULT_NGRAM_MAX,
        ngram_min: int = DEFAULT_NGRAM_MIN,
        draft_confidence: float = 0.0,
        sync_timing: bool = False,
        suffix_cache: SuffixCache | None = None,
        prefix_cache: bool = True,
        scheduling: SchedulerConfig | None = None,
        heads: Mapping[str, HeadsDrafter] | None = None,
        skip_layers: Sequence[int] | None = None,
        k_policy: str | None = None,
    ) -> None:
        """``heads``: Medusa and EAGLE drafters by method (each row gets a ``fresh`` one);
        ``skip_layers``: the layers layerskip rows' drafts skip. Both need a torch target.
        ``k_policy``: requests' k policy where they name none (None: cost, the batch's choice)."""
        if policy not in BATCH_POLICIES:
            raise InvalidRequestError(f"policy must be one of {', '.join(BATCH_POLICIES)}, got {policy!r}.")
        self.k_policy = k_policy or "cost"  # checked with each request's (batch_rows.row_schedule)
        if kv_cache_tokens < block_size:
            raise InvalidRequestError(f"kv_cache_tokens must be at least one block ({block_size}), got {kv_cache_tokens}.")
        self.eos_token_ids, self.policy, self.k_max = frozenset(eos_token_ids), policy, k_max
        self.target = as_batch_model(target, kv_cache_tokens, block_size)
        self.drafter: BatchDraftModel | None = (
            None if draft is None else BatchDraftModel(as_batch_model(draft, kv_cache_tokens, block_size), self.target.vocab_size))
        # Prefix caching (kv/paged.py, backends/llamacpp_batch.py): a new request starts after its longest cached prefix.
        self.target_cache.prefix_cache = prefix_cache
        if self.drafter is not None:
            self.drafter.cache.prefix_cache = prefix_cache
        # Fair sharing of the batch (engine/scheduler.py): chunked prefill, time slices.
        self.scheduling = scheduling or SchedulerConfig()
        self.scheduler = Scheduler(self.target_cache, self.drafter.cache if self.drafter else None, max_batch, k_max + 1,
                                   time_slice=self.scheduling.time_slice)
        self._prefilling: list[ScheduledSequence] = []  # admitted, their prefill not finished yet
        self.chooser = BatchK(k_max, verify_costs, draft_costs)
        self.ngram_sizes = (ngram_max, ngram_min)
        self.draft_confidence = draft_confidence  # the draft model's per-row cut-off (batch_draft.DraftRow)
        self.sync_timing = sync_timing
        self.trees = self.target.supports_trees  # torch: suffix rows draft token trees
        if (heads or skip_layers) and not isinstance(self.target, PagedBatchModel):
            raise InvalidRequestError("Medusa and EAGLE heads and layer skip need the torch backend (backend=\"torch\").")
        self.heads: dict[str, HeadsDrafter] = dict(heads or {})
        self.skipper = (BatchLayerSkip(self.target, skip_layers)
                        if skip_layers and isinstance(self.target, PagedBatchModel) else None)
        self.suffix_cache = suffix_cache if suffix_cache is not None else SuffixCache()  # earlier responses, by group
        self._ids = itertools.count()
        # Acceptance pooled over every request of a method: a new request starts from it (the
        # model pair and the workload decide acceptance more than any one request does).
        self._pooled_acceptance = {method: AcceptanceEstimate(decay=POOLED_ACCEPTANCE_DECAY) for method in BATCH_METHODS}
        self._requests: dict[str, ScheduledSequence] = {}

    @property
    def model_can_pay(self) -> bool:
        """Whether a new auto row may draft with the draft model (holding draft KV): unless it
        loses even at full acceptance by the live costs and no re-try of that price is due."""
        chooser = self.chooser
        return self.drafter is not None and (model_can_pay(chooser.verify, chooser.draft, self.k_max) or chooser.reprobe.due())

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def target_cache(self) -> SequencePool:
        return self.target.pool

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        method: str = "none",
        k: int | None = None,
        request_id: str | None = None,
        stats: GenerationStats | None = None,
        suffix_group: str | None = DEFAULT_GROUP,
        cache_salt: str | None = None,
        grammar: CompiledGrammar | None = None,
        fork_of: str | None = None,
        arrived: float | None = None,
        k_policy: str | None = None,
        acceptance: str = "lossless",
    ) -> str:
        """Queue a request; it joins the batch at a coming step. Returns its id. ``stats`` (a
        fresh ``GenerationStats``) is filled as it decodes; one is made when not given. Method
        suffix drafts from (and adds to) ``suffix_group``'s earlier responses (None: its own text
        only). The request reuses the K/V of cached prefixes of requests with its ``cache_salt``.
        ``grammar`` (``params.structured`` compiled, ``engine/grammar.py``) masks its rows.

        ``fork_of``: the id of a request added before this one with the same prompt and
        ``cache_salt`` (another sample of it, parallel sampling): this one starts from that
        request's prompt K/V, target and draft, once it has been prefilled, instead of computing
        its own (``Scheduler.admit``). Ignored when that request has already finished.

        ``arrived``: the ``time.perf_counter()`` time the request arrived (default: now), from
        which its ``first_token_seconds`` and ``total_seconds`` count: a worker thread passes
        the time it was submitted, so the wait for the step running then counts too.

        ``k_policy`` (None: the engine's): ``cost`` drafts what the batch's choice says, up to
        k; ``fixed`` and ``threshold`` give a chain row (draft, ngram, layerskip) its own k.
        ``acceptance="typical"`` verifies a medusa or eagle row's sampled trees by Medusa's LOSSY rule."""
        k = self.check_request(len(prompt_ids), params, method, k, acceptance)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"A request with id {request_id!r} is already running.")
        source = self._requests.get(fork_of) if fork_of is not None else None
        if source is not None and (source.tokens[: source.state.stats.prompt_tokens] != list(prompt_ids)
                                   or source.cache_group != cache_salt):
            raise InvalidRequestError(f"Request {request_id!r} can fork only a request with its prompt and cache_salt; "
                                      f"{fork_of!r} has another.")
        drafters = row_drafters(method, k, self.k_max, suffix_group, self.suffix_cache, self.ngram_sizes,
                                self.model_can_pay, self.trees, self.heads, self.chooser.verify,
                                k_policy or self.k_policy)
        request = BatchRequest.start(request_id, prompt_ids, params, method, k, drafters, grammar,
                                     self.target.vocab_size, self.device, stats or GenerationStats(),
                                     time.perf_counter() if arrived is None else arrived, acceptance)
        request.acceptance = self._pooled_acceptance[method].prior(POOLED_PRIOR_TRIALS)
        prompt_len = len(prompt_ids)
        seq = ScheduledSequence(next(self._ids), prompt_len, prompt_len + params.max_new_tokens,
                                uses_draft=drafters.uses_draft, state=request,
                                tokens=request.tokens, cache_group=cache_salt, fork_of=source)
        self.scheduler.add(seq)
        self._requests[request_id] = seq
        return request_id

    def check_request(self, prompt_len: int, params: SamplingParams, method: str, k: int | None,
                      acceptance: str = "lossless") -> int:
        """Raise InvalidRequestError for a request this engine cannot take; the k cap it would use.
        Reads only fixed configuration, so any thread may call it before submitting."""
        check_method(method, self.drafter is not None, self.skipper is not None, self.heads, acceptance)
        if prompt_len < 1:
            raise InvalidRequestError("The prompt is empty.")
        k = self.k_max if k is None else k
        if method != "none" and not 1 <= k <= self.k_max:
            raise InvalidRequestError(f"k must be in 1..{self.k_max} (the engine's k_max), got {k}.")
        self.scheduler.check_fits(prompt_len + params.max_new_tokens, uses_draft=uses_draft(method, self.model_can_pay))
        return k

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (between steps): its blocks go back to the pools at once."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        request: BatchRequest = seq.state
        request.stats.stop_reason = "cancelled"
        self._finish(seq)
        return RequestOutput(request_id, [], True, request.stats)

    def abort_all(self, error: BaseException) -> list[RequestOutput]:
        """Fail every request (after an error inside a step), leaving the pools empty."""
        outputs = []
        for request_id in list(self._requests):
            output = self.abort(request_id)
            if output is not None:
                output.stats.stop_reason, output.error = "error", error
                outputs.append(output)
        return outputs

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def _finish(self, seq: ScheduledSequence) -> None:
        request: BatchRequest = seq.state
        request.stats.total_seconds = time.perf_counter() - request.started
        self.scheduler.finish(seq)
        self._prefilling = [other for other in self._prefilling if other != seq]
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)
        self._requests.pop(request.request_id, None)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit, draft, verify and commit once for the whole batch; what each request got.

        A request whose own rows make a step raise (its sampling, its prompt) fails alone: the
        step is rerun without it, and the others get exactly what they would have got (see
        ``_isolate_failures``). An error no single request causes is raised to the caller."""
        failed: list[RequestOutput] = []
        preempted: list[ScheduledSequence] = []
        self._prefilling += [seq for seq in self.scheduler.admit(preempted) if seq not in self._prefilling]
        for seq in preempted:
            if self.drafter is not None:
                self.drafter.forget(seq.seq_id)
        self._prefilling = [seq for seq in self._prefilling if seq in self.scheduler.running]  # not preempted, not ended
        if self._prefilling:
            broken = prefill_isolated(self.target, self.drafter, self._prefilling, self.scheduling.prefill_chunk,
                                      self._prefilling)
            failed += [self._fail(seq, err) for seq, err in broken]
        drafting, plans, broken = plan_rows(self._decoding(), self.drafter, self.draft_confidence, self.skipper)
        failed += [self._fail(seq, err) for seq, err in broken]
        running = self._decoding()
        if not running:
            return failed
        k = self.chooser.choose(plans, len(running))
        wanted = {seq.seq_id: 0 for seq in running}
        wanted.update(choose_sources(drafting, plans, k, self.chooser, len(running)))
        read_ahead = reads_backlog(drafting, wanted, self.drafter)
        forced = forced_drafts(running)
        wanted.update({seq_id: len(tokens) for seq_id, tokens in forced.items()})
        for seq in self.scheduler.reserve(lambda seq: slots_needed(seq, wanted, forced)):
            if self.drafter is not None:
                self.drafter.forget(seq.seq_id)
        broken = time_draft_model(drafting, plans, self._decoding(), self.drafter, self.chooser)  # a priced-out draft's try
        failed += [self._fail(seq, err) for seq, err in broken]
        running = self._decoding()
        if not running:
            return failed
        generators = generator_states(running)
        draft_watch, verify_watch = Stopwatch(self.device, self.sync_timing), Stopwatch(self.device, self.sync_timing)
        try:
            with draft_watch:
                proposals, draft_passes, draft_rows = self._draft(running, wanted, forced)
            with verify_watch:
                emitted, proposals, paths, hidden = self._verify(running, proposals)
        except Exception as err:  # noqa: BLE001 - raised again below unless one request is to blame
            failed += self._isolate_failures(running, wanted, forced, generators, err)
            running = list(self.scheduler.running)
            if not running:
                return failed
            restore_generators(generators)
            with draft_watch:
                proposals, draft_passes, draft_rows = self._draft(running, wanted, forced)
            with verify_watch:
                emitted, proposals, paths, hidden = self._verify(running, proposals)
        # A pass that also fed a prompt's tail (``_prefill``) is no verify pass to learn from.
        merged = any(seq.prefilling for seq in running)
        self.chooser.observe(
            widths=[1 + p.num_tokens for p in proposals], drafted=sum(p.num_tokens for p in proposals),
            verify_seconds=None if merged else verify_watch.elapsed, draft_rows=draft_rows,
            # A step that read a backlog first says little about one draft pass: not learnt from.
            draft_passes=0 if read_ahead else draft_passes, draft_seconds=draft_watch.elapsed,
        )
        self.scheduler.record_step(running)
        return failed + self._commit(running, proposals, emitted, paths, hidden, draft_watch.elapsed,
                                     verify_watch.elapsed, draft_passes)

    def _decoding(self) -> list[ScheduledSequence]:
        """The running sequences that decode this step: those whose prompt is prefilled."""
        return [seq for seq in self.scheduler.running if seq not in self._prefilling]

    # -- failures of one request ---------------------------------------------------------------
    # Drafting and verifying change nothing a rerun would not redo: caches are written by
    # position, the draft model's lengths move only after the commit, an EAGLE head's catch-up
    # is idempotent, and the generators are restored from a snapshot. So a failed step can be
    # rerun row by row to find the request to blame, then once more without it.
    def _isolate_failures(
        self, running: list[ScheduledSequence], wanted: dict[int, int], forced: dict[int, list[int]],
        generators: list[tuple[torch.Generator, torch.Tensor]], error: Exception,
    ) -> list[RequestOutput]:
        """Rerun the step's draft and verify for each row alone; fail the rows that raise alone.
        Re-raises the step's error when none does, or every row does (a failure of the batch or
        of the models, not of a request)."""
        blamed = []
        for seq in running:
            restore_generators(generators)
            try:
                proposals, _, _ = self._draft([seq], wanted, forced)
                self._verify([seq], proposals)
            except Exception as err:  # noqa: BLE001 - any error a request causes is that request's
                blamed.append((seq, err))
        if not blamed or len(blamed) == len(running):
            raise error
        return [self._fail(seq, err) for seq, err in blamed]

    def _fail(self, seq: ScheduledSequence, error: BaseException) -> RequestOutput:
        seq.state.stats.stop_reason = "error"
        self._finish(seq)
        return RequestOutput(seq.state.request_id, [], True, seq.state.stats, error=error)

    def _draft(self, running: list[ScheduledSequence], wanted: dict[int, int],
               forced: dict[int, list[int]]) -> tuple[list[DraftProposal], int, int]:
        # Drafts walk their rows' grammars (engine/grammar.py) and penalty counts
        # (engine/penalties.py), which end back where they were.
        processors = [seq.state.processor for seq in running]
        for processor in processors:
            processor.begin_draft()
        try:
            return propose(running, wanted, self.drafter, self.draft_confidence, self.device, forced, self.skipper)
        finally:
            for processor in processors:
                processor.end_draft()

    def _commit(
        self,
        running: list[ScheduledSequence],
        proposals: list[DraftProposal],
        emitted: list[list[int]],
        paths: dict[int, list[int]],
        hidden: torch.Tensor | None,  # (B, T_max, C) where rows' heads read features, else None
        draft_seconds: float,
        verify_seconds: float,
        draft_passes: int,
    ) -> list[RequestOutput]:
        accepted = [len(row) - 1 for row in emitted]
        if self.policy == "sync":
            drafted = [a for a, p in zip(accepted, proposals, strict=True) if p.num_tokens > 0]
            if drafted:
                slowest = min(drafted)
                accepted = [min(a, slowest) for a in accepted]
                emitted = [row[: a + 1] for row, a in zip(emitted, accepted, strict=True)]
        outputs = []
        for index, (seq, proposal, row, accepted_len) in enumerate(zip(running, proposals, emitted, accepted, strict=True)):
            request: BatchRequest = seq.state
            stats = request.stats
            with_model = drafts_with_model(seq)
            request.record_step(proposal, accepted_len, draft_seconds, verify_seconds,
                                draft_passes if with_model else proposal.forward_passes, prefilling=seq.prefilling)
            # A row's acceptance is its drafter's; a row that picks its source keeps its lookups'
            # scores apart (drafters/auto_row.py), so only its draft model's count here.
            if proposal.num_tokens > 0 and not proposal.forced and (request.sources is None or with_model):
                request.acceptance.observe(proposal.depth, accepted_len)
                if request.acceptance_rule != "typical":  # a lossy rule's rate is no prior for lossless rows
                    self._pooled_acceptance[request.method].observe(proposal.depth, accepted_len)
            new_tokens, stop_reason = cut_at_stop(row, request.remaining, self.eos_token_ids, request.params.ignore_eos)
            count = len(new_tokens)
            length = len(request.tokens)
            if request.append(new_tokens) and not stop_reason:  # the grammar ended (ignore_eos)
                stop_reason = "stop"
            seq.num_tokens = len(request.tokens)
            seq.prefilled = length + min(accepted_len, count - 1)
            if index in paths:  # the accepted path's K/V down to the positions after the root
                self.target.keep_path(seq.seq_id, length - 1, paths[index])
            if request.heads is not None and hidden is not None:
                request.observe_features(hidden[index], paths.get(index), accepted_len, length - 1)
            self.target.commit(seq.seq_id, seq.prefilled)
            if with_model and proposal.num_tokens > 0 and not proposal.forced:
                assert self.drafter is not None
                self.drafter.on_verified(seq.seq_id, accepted_len)
            if stats.new_tokens == 0 and count:  # from its arrival, waiting in the queue included
                stats.first_token_seconds = time.perf_counter() - request.started
            stats.new_tokens += count
            stats.stop_reason = stop_reason or "running"
            if stop_reason:
                self._finish(seq)
            outputs.append(RequestOutput(request.request_id, new_tokens, bool(stop_reason), stats, drafted=min(accepted_len, count)))
        return outputs

    def _verify(self, running: list[ScheduledSequence], proposals: list[DraftProposal]) -> VerifiedStep:
        """The step's verify pass (``engine/batch_pass.py``); tests wrap it to slow or break a step."""
        return verify_pass(self.target, running, proposals)

    def run(self) -> dict[str, list[int]]:
        """Step until every queued request is done; each request's new tokens by id."""
        generated: dict[str, list[int]] = {}
        while self.has_unfinished:
            for output in self.step():
                generated.setdefault(output.request_id, []).extend(output.new_tokens)
        return generated

