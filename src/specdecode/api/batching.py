"""Many prompts at once: ``SpecDecoder.batch_engine`` builds a continuous-batching engine over the
decoder's models, and ``generate_batch`` runs prompts (n samples each) through one
(``engine/batch_run.py``). ``SpecDecoder`` has these methods from ``BatchGeneration``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specdecode.backends.batch_select import batch_model
from specdecode.backends.compiled import CATCH_UP_COMPILED_ROWS, CompileLog
from specdecode.backends.compiled_batch import BatchGraphs, CompiledPagedBatchModel, warm_up_batch
from specdecode.backends.openmp import releases_thread_team
from specdecode.config import MAX_CHOICES, DecoderConfig, SamplingParams, SchedulerConfig
from specdecode.core import registry
from specdecode.costs.decoder_costs import DecoderCosts, batch_pass_costs
from specdecode.drafters.base import Drafter, HeadsDrafter, TreeDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.suffix import auto_depth
from specdecode.drafters.suffix_cache import DEFAULT_GROUP, SuffixCache
from specdecode.engine.batch import DEFAULT_KV_CACHE_TOKENS, DEFAULT_MAX_BATCH, BatchEngine
from specdecode.engine.batch_run import run_samples
from specdecode.engine.grammar import GrammarCompiler
from specdecode.engine.single import SpecEngine
from specdecode.engine.stream import GenerationResult
from specdecode.engine.text import Messages
from specdecode.errors import InvalidRequestError
from specdecode.kv.paged import DEFAULT_BLOCK_SIZE
from specdecode.models.heads import DraftHeads
from specdecode.models.loader import LoadedModel


class BatchGeneration:
    """``SpecDecoder``'s batch methods (the module docstring)."""

    if TYPE_CHECKING:
        target: LoadedModel
        draft: LoadedModel | None
        config: DecoderConfig
        kv_dtype: str
        batch_graphs: BatchGraphs | None
        compile_log: CompileLog
        engine: SpecEngine
        tokenizer: Any
        grammars: GrammarCompiler
        heads: dict[str, DraftHeads]
        drafters: dict[str, Drafter | TreeDrafter]
        eos_token_ids: list[int]

        @property
        def suffix_cache(self) -> SuffixCache: ...

        @property
        def costs(self) -> DecoderCosts: ...

        def encode(self, prompt: str | Messages, chat: bool = False,
                   tools: list[dict[str, Any]] | None = None) -> list[int]: ...

        def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None: ...

    @releases_thread_team
    def batch_engine(
        self,
        *,
        max_batch: int = DEFAULT_MAX_BATCH,
        kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        policy: str = "async",
        cost_aware: bool = True,
        scheduling: SchedulerConfig | None = None,
        k_max: int | None = None,
    ) -> BatchEngine:
        """A continuous-batching engine over this decoder's models (every method:
        ``engine/batch_rows.py``; layerskip, medusa and eagle where this decoder has their layers
        or heads), with KV pools of ``kv_cache_tokens`` slots per model: paged on torch (int8
        with ``kv_dtype="int8"``); on llama.cpp a context per model with ``max_batch`` sequences
        of ``kv_cache_tokens // max_batch`` positions each (and ``scheduling.spare_slots`` more).

        ``scheduling`` (``SchedulerConfig``): how requests share the batch, chunked prefill and
        time slices, so that a full batch of long generations does not make a new request wait
        for them to finish (docs/design.md#fair-scheduling).

        ``cost_aware`` times the target (and draft) on a few pass shapes first (about 25 seconds
        for the demo pair and a batch of 16 on a 2-core CPU; the target's one-sequence passes are
        kept in its cost store, so a later engine on this machine times only the batched shapes)
        so that the batch's draft length follows measured costs and falls to plain decoding where
        speculation stops paying; without it every speculative request drafts its own k each step.

        ``k_max`` (None: the decoder's ``config.k_max``): the most a request's k may be, and the
        range of the batch's choice; the pass costs are timed for its verify widths.
        """
        scheduling = scheduling or SchedulerConfig()
        k_max = self.config.k_max if k_max is None else k_max
        # kv_dtype="int8": both paged pools store int8 K/V with per-(slot, head) scales (kv/paged.py).
        # compile=: chain passes of up to a chain's longest (auto's suffix chains) run compiled, the
        # draft model's one- and two-row passes too (backends/compiled_batch.py).
        compiled = {role: None if self.batch_graphs is None else (self.batch_graphs, rows, role)
                    for role, rows in (("target", max(k_max, auto_depth(k_max)) + 1),
                                       ("draft", CATCH_UP_COMPILED_ROWS))}
        target = batch_model(self.target, max_batch, kv_cache_tokens, block_size, scheduling.spare_slots,
                             kv_dtype=self.kv_dtype, compiled=compiled["target"])
        draft = (None if self.draft is None
                 else batch_model(self.draft, max_batch, kv_cache_tokens, block_size, scheduling.spare_slots,
                                  kv_dtype=self.kv_dtype, compiled=compiled["draft"]))
        verify_costs = draft_costs = None
        if cost_aware:
            verify_costs, draft_costs = batch_pass_costs(target, draft, max_batch, k_max, live=self.costs.live,
                                                         longest_draft=auto_depth(k_max), store=self.engine.cost_store)
        return BatchEngine(
            target, draft, self.eos_token_ids,
            max_batch=max_batch, kv_cache_tokens=kv_cache_tokens, block_size=block_size, policy=policy,
            k_max=k_max, verify_costs=verify_costs, draft_costs=draft_costs,
            ngram_max=self.config.ngram_max, ngram_min=self.config.ngram_min, draft_confidence=self.config.draft_confidence,
            sync_timing=self.engine.sync_timing, suffix_cache=self.suffix_cache, prefix_cache=self.config.prefix_cache,
            scheduling=scheduling, heads=self._head_drafters(), skip_layers=self.config.skip_layers,
            k_policy=self.config.k_policy,
        )

    def warm_up_engine(self, engine: BatchEngine, verify_rows: int | None = None, show_progress: bool = False) -> float:
        """With ``compile=``, compile now (on CUDA, record) the passes ``engine`` will run: the
        target's verify passes of up to ``verify_rows`` rows (None: the engine's k_max + 1) and
        the draft model's, for one sequence and for more (on CUDA every power of two of the
        batch). Returns the seconds it took (0 without ``compile=``)."""
        target = engine.target
        draft = None if engine.drafter is None else engine.drafter.model
        if not isinstance(target, CompiledPagedBatchModel):
            return 0.0
        assert draft is None or isinstance(draft, CompiledPagedBatchModel)
        most = engine.scheduler.max_batch
        batches = [1 << i for i in range(most.bit_length())] if target.pad_shapes else [1, 2][:most]
        before = self.compile_log.seconds
        warm_up_batch(target, draft, engine.k_max + 1 if verify_rows is None else verify_rows, batches, show_progress)
        return self.compile_log.seconds - before

    def _head_drafters(self) -> dict[str, HeadsDrafter]:
        """The Medusa and EAGLE drafters by method, of which the batch engine gives each row a fresh one."""
        heads: dict[str, HeadsDrafter] = {}
        for kind in self.heads:
            drafter = self.drafters[kind]
            assert isinstance(drafter, MedusaDrafter | EagleDrafter)
            heads[kind] = drafter
        return heads

    @releases_thread_team
    def generate_batch(
        self,
        prompts: Sequence[str | Messages | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
        method: str | None = None,
        k: int | None = None,
        engine: BatchEngine | None = None,
        suffix_group: str | None = DEFAULT_GROUP,
        cache_salt: str | None = None,
        n: int = 1,
        k_policy: str | None = None,
    ) -> list[GenerationResult]:
        """Generate for many prompts at once with the batch engine (methods none, ngram, draft,
        suffix, auto: suffix and auto draft from this decoder's earlier responses, and each other's).

        ``params`` is one ``SamplingParams`` for all prompts or one per prompt. ``engine`` reuses
        a ``batch_engine()`` (its cost timing is paid once); without one, a cost-aware engine is
        built for this call, without time slices (a request keeps its seat until it ends). Stop
        strings end a request as in ``generate``. Greedy results equal
        ``generate``'s for each prompt alone (tested in fp32).

        ``n``: samples per prompt (1..``MAX_CHOICES``), as transformers' ``num_return_sequences``:
        the result holds ``len(prompts) * n`` entries, prompt-major (entry ``p * n + i`` is sample
        ``i`` of prompt ``p``). The samples of a prompt share its prompt's K/V (computed once) and
        decode in one batch; sample ``i`` is seeded with ``seed + i`` (``SamplingParams.for_choice``),
        so sample 0 equals the request with n = 1 and each can be reproduced alone.

        ``k`` and ``k_policy`` as in ``generate``: a ``k`` alone is a fixed draft length for
        the chain methods (draft, ngram, layerskip), and with neither the decoder's apply
        (``DecoderConfig``; its default in a batch is ``cost``: the batch's own choice, up to k).
        """
        params_list = [params or SamplingParams()] * len(prompts) if not isinstance(params, Sequence) else list(params)
        if len(params_list) != len(prompts):
            raise InvalidRequestError(f"Got {len(params_list)} SamplingParams for {len(prompts)} prompts.")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise InvalidRequestError(f"n (samples per prompt) must be in 1..{MAX_CHOICES}, got {n!r}.")
        method = method or (self.config.method if self.config.method in registry.BATCH_METHODS
                            else registry.DRAFT.name if self.draft else registry.NONE.name)
        if k is None and k_policy is None:  # the decoder's (None: the engine's own, cost)
            k, k_policy = (None if method == registry.NONE.name else self.config.draft_k), self.config.k_policy
        else:
            k, k_policy = self.config.call_k(k, k_policy)
        # Offline, first-token latency does not matter: the engine built for the call keeps each
        # seat until its request ends (no time slices), which is the cheapest order.
        engine = engine or self.batch_engine(max_batch=max(1, min(len(prompts) * n, DEFAULT_MAX_BATCH)),
                                             scheduling=SchedulerConfig(time_slice=0))
        prompt_ids = [list(p) if isinstance(p, list) and p and isinstance(p[0], int) else self.encode(p, chat) for p in prompts]
        for ids, request_params in zip(prompt_ids, params_list, strict=True):
            self.check_request(ids, request_params)
        # One entry per sample, prompt-major; each prompt's grammar compiled once (a compiled
        # grammar makes a fresh matcher per request).
        grammars = [self.grammars.compile(p.structured) if p.structured is not None else None for p in params_list]
        samples = [(ids, request_params.for_choice(i), grammar)
                   for ids, request_params, grammar in zip(prompt_ids, params_list, grammars, strict=True)
                   for i in range(n)]
        return run_samples(engine, self.tokenizer, samples, n, method, k, suffix_group, cache_salt, k_policy)
