"""llama-cpp-python's high-level ``Llama`` as a benchmark peer, and the GGUF files it reads.

``llamacpp`` is plain greedy decoding through ``Llama.generate``; ``llamacpp-lookup`` is the
same with ``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=N)``, llama-cpp-python's
prompt lookup. Both read the same GGUF file as our llama.cpp backend, with the same threads
(the physical cores), the same context and the same KV cache type and flash-attention setting
(``dtype="fp32"``: f32 cache, flash attention off; otherwise f16 and on).

How the figures are measured without reaching into llama.cpp: ``Llama.generate`` calls
``self.eval(tokens)`` for each target pass (the prompt first, then ``[last token] + drafts``)
and yields one token per position the pass verified. We time ``eval`` through an instance
attribute, so prefill (the first pass) is timed apart from decoding, and count the tokens each
pass yields: a decode pass that carried m drafts and yielded y tokens accepted y - 1 of them,
which gives tau, acceptance and acceptance per position by our own rule
(``engine/metrics.GenerationStats``). After the last token we need, the generator is drained
up to its next pass (sampling from logits already computed, off the clock), so the last step
counts its whole verdict, as our engine's does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specdecode.bench.methods import LLAMACPP_PY_METHODS, TurnResult
from specdecode.config import DecoderConfig, SamplingParams
from specdecode.engine.metrics import GenerationStats
from specdecode.errors import InvalidRequestError

LOOKUP_MAX_NGRAM = 2  # LlamaPromptLookupDecoding's default n-gram size


@dataclass(frozen=True, slots=True)
class GGUFFiles:
    """The GGUF files the llama.cpp side of a run reads (draft: None without a draft model)."""

    target: Path
    draft: Path | None


def resolve_gguf_files(target: str, draft: str | None, methods: list[str], needs_draft: bool) -> GGUFFiles:
    """The GGUF files behind --target/--draft, or one error that names the methods and the fix."""
    from specdecode.models.loader import gguf_source

    asked = ", ".join(methods)
    target_path = gguf_source(target, show_progress=False)
    if target_path is None:
        raise InvalidRequestError(
            f"Methods {asked} run on llama.cpp, which reads GGUF files; target={target!r} is not one (a Hugging "
            "Face folder or hub id). Pass a .gguf file or a demo model name as target=, or leave those methods out."
        )
    if not needs_draft:
        return GGUFFiles(target_path, None)
    if draft is None:
        raise InvalidRequestError(f"Methods {asked} need a draft model on llama.cpp: pass a .gguf file as draft=.")
    draft_path = gguf_source(draft, show_progress=False)
    if draft_path is None:
        raise InvalidRequestError(
            f"Methods {asked} run on llama.cpp, which reads GGUF files; draft={draft!r} is not one. Pass a .gguf "
            "file or a demo model name as draft=, or leave those methods out."
        )
    return GGUFFiles(target_path, draft_path)


class _StepBoundary(Exception):
    """Raised by the timed eval once the turn has its tokens: the generator would start another pass."""


class _TimedEval:
    """Stands in for ``Llama.eval``: times every pass and records how many tokens it carried."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.closed = False  # set once the turn has its tokens
        self.seconds: list[float] = []
        self.sizes: list[int] = []  # tokens fed per pass: the prompt, then 1 + drafts

    def reset(self) -> None:
        self.closed = False
        self.seconds.clear()
        self.sizes.clear()

    def __call__(self, tokens: Any) -> None:
        if self.closed:
            raise _StepBoundary
        started = time.perf_counter()
        self.inner(tokens)
        self.seconds.append(time.perf_counter() - started)
        self.sizes.append(len(tokens))


def _timed_lookup(num_pred_tokens: int) -> Any:
    """llama-cpp-python's prompt lookup, its calls timed (the draft share of the time split)."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class TimedLookup(LlamaPromptLookupDecoding):
        seconds = 0.0

        def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
            started = time.perf_counter()
            drafts = super().__call__(input_ids, **kwargs)
            self.seconds += time.perf_counter() - started
            return drafts

    return TimedLookup(max_ngram_size=LOOKUP_MAX_NGRAM, num_pred_tokens=num_pred_tokens)


class LlamaCppPyMethod:
    """``llamacpp`` or ``llamacpp-lookup``: greedy (or sampled) generation through ``llama_cpp.Llama``."""

    def __init__(
        self,
        name: str,
        gguf_path: Path,
        tokenizer: Any,
        eos_token_ids: list[int],
        *,
        exact: bool,
        context: int,
        lookup_tokens: int,
    ) -> None:
        if name not in LLAMACPP_PY_METHODS:
            raise InvalidRequestError(f"Unknown llama-cpp-python method {name!r}; choose one of: {', '.join(LLAMACPP_PY_METHODS)}.")
        import llama_cpp

        from specdecode.backends.llamacpp import physical_core_count
        from specdecode.backends.llamacpp_threads import attach_shared_threadpool

        self.name = name
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.context = context
        self.draft = _timed_lookup(lookup_tokens) if name == "llamacpp-lookup" else None
        threads = physical_core_count()  # as our llama.cpp backend: hyperthreads only slow ggml's kernels
        kv_type = llama_cpp.GGML_TYPE_F32 if exact else llama_cpp.GGML_TYPE_F16
        self.llama = llama_cpp.Llama(
            model_path=str(gguf_path), n_gpu_layers=0, n_ctx=context, n_threads=threads, n_threads_batch=threads,
            type_k=kv_type, type_v=kv_type, flash_attn=not exact, draft_model=self.draft, verbose=False,
        )
        # Our llama.cpp contexts in this process share one ggml thread pool; the peer joins it, so
        # neither side's idle threads poll against the other's passes (backends/llamacpp_threads.py).
        attach_shared_threadpool(llama_cpp, self.llama._ctx.ctx, threads)
        # generate() calls self.eval: an instance attribute shadows the method for this object only.
        self.passes = _TimedEval(self.llama.eval)
        self.llama.eval = self.passes

    def run_turn(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        if len(prompt_ids) + params.max_new_tokens > self.context:
            raise InvalidRequestError(
                f"This request needs {len(prompt_ids) + params.max_new_tokens} positions but the llama.cpp context "
                f"holds {self.context}; shorten the prompt or lower max_new_tokens."
            )
        llama, passes = self.llama, self.passes
        llama.reset()  # no prefix reuse across turns: every method pays the whole prompt's prefill
        passes.reset()
        if self.draft is not None:
            self.draft.seconds = 0.0
        if params.seed is not None:
            llama.set_seed(params.seed)
        sampling = {"temp": params.temperature, "top_k": params.top_k, "top_p": params.top_p} if params.temperature > 0 else {"temp": 0.0}
        tokens: list[int] = []
        yielded: list[int] = []  # tokens yielded after each pass
        draft_seconds = 0.0
        started = time.perf_counter()
        seconds = 0.0
        generator = llama.generate(prompt_ids, min_p=0.0, typical_p=1.0, repeat_penalty=1.0, reset=True, **sampling)
        try:
            for token in generator:
                yielded.extend([0] * (len(passes.sizes) - len(yielded)))
                yielded[-1] += 1
                if passes.closed:
                    continue  # draining the last pass's verdict, off the clock
                tokens.append(int(token))
                if len(tokens) == params.max_new_tokens or token in self.eos_token_ids:
                    seconds = time.perf_counter() - started
                    draft_seconds = self.draft.seconds if self.draft is not None else 0.0
                    passes.closed = True
        except _StepBoundary:
            pass
        finally:
            generator.close()
        if not passes.closed:  # the generator stopped by itself (it never does today)
            seconds = time.perf_counter() - started
        stats = GenerationStats()
        for size, emitted in zip(passes.sizes[1:], yielded[1:]):
            stats.record_step(size - 1, emitted - 1)  # a pass fed [last token] + drafts
        prefill = passes.seconds[0] if passes.seconds else 0.0
        return TurnResult(
            tokens=tokens,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),  # as specdecode's API decodes
            prompt_tokens=len(prompt_ids),
            seconds=seconds,
            prefill_seconds=prefill,
            draft_seconds=draft_seconds,
            verify_seconds=sum(passes.seconds[1:]),
            target_passes=len(passes.seconds),
            draft_passes=0,  # prompt lookup runs no model
            verify_steps=stats.verify_steps,
            emitted_by_steps=stats.emitted_by_steps,
            draft_tokens_proposed=stats.draft_tokens_proposed if self.draft is not None else None,
            draft_tokens_accepted=stats.draft_tokens_accepted if self.draft is not None else None,
            proposed_at_position=list(stats.proposed_at_position),
            accepted_at_position=list(stats.accepted_at_position),
        )


@dataclass(slots=True)
class LlamaCppSide:
    """What the llama.cpp methods of a run share: the GGUF files, our decoder on llama.cpp
    (None when only peers run), and the settings every llama.cpp method gets alike."""

    files: GGUFFiles
    decoder: Any  # specdecode.SpecDecoder on the llama.cpp backend, or None
    context: int  # positions per sequence, for ours and the peers alike
    exact: bool  # dtype fp32: f32 KV cache, flash attention off
    threads: int
    target_bytes: int  # weight bytes per forward pass, as the GGUF stores them
    draft_bytes: int

    def describe(self) -> dict[str, Any]:
        """The llama.cpp side as results.json records it."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            binding = version("llama-cpp-python")
        except PackageNotFoundError:
            binding = None
        draft = self.files.draft
        return {
            "llama_cpp_python": binding,
            "threads": self.threads,
            "context": self.context,
            "kv_cache": "f32, flash attention off" if self.exact else "f16, flash attention llama.cpp's choice",
            # The files by name, size and a hash of their ends, not by path: results are shared.
            "target": {"file": _file_record(Path(self.files.target)), "weight_bytes_per_forward": self.target_bytes},
            "draft": {"file": _file_record(Path(draft)), "weight_bytes_per_forward": self.draft_bytes} if draft else None,
        }


def load_llamacpp_side(
    decoder: DecoderConfig,  # the run's shared decoder settings (BenchConfig.decoder)
    labels: dict[str, Any],  # method name -> bench.methods.MethodLabel, the llama.cpp ones only
    *,
    context: int | None,
    show_progress: bool,
) -> LlamaCppSide:
    """Resolve the GGUF files and load our decoder on llama.cpp if any of our methods asks for it.

    ``context`` None (no torch model in the run): our decoder loads whatever the methods are (its
    tokenizer encodes every method's prompts) and the context is its target's, which is our
    backend's default capped at what the GGUF file was trained for."""
    import torch

    from specdecode.api import SpecDecoder
    from specdecode.backends.llamacpp import physical_core_count
    from specdecode.backends.select import LLAMACPP, llamacpp_installed
    from specdecode.bench.methods import LLAMACPP_BIN_METHODS, LLAMACPP_PEERS, uses_draft_model
    from specdecode.bench.roofline import gguf_weight_bytes_per_forward
    from specdecode.core.device import resolve_dtype
    from specdecode.models import demo

    needs_binding = [name for name, label in labels.items() if label.base not in LLAMACPP_BIN_METHODS]
    if needs_binding and not llamacpp_installed():
        raise InvalidRequestError(
            f"Methods {', '.join(needs_binding)} need llama-cpp-python: pip install 'specdecode[llamacpp]' "
            "(it compiles llama.cpp), or leave those methods out."
        )
    target = decoder.target or demo.DEFAULT_TARGET
    draft = decoder.draft or (demo.DEFAULT_DRAFT if demo.is_demo_model_name(target) else None)
    ours = {name: label for name, label in labels.items() if label.base not in LLAMACPP_PEERS}
    ours_draft = any(uses_draft_model(label.base) for label in ours.values())
    files = resolve_gguf_files(target, draft, list(labels), any(uses_draft_model(label.base) for label in labels.values()))
    spec_decoder = None
    if ours or context is None:
        # The shared settings on llama.cpp's CPU passes; the KV-cache storage and compilation are
        # the torch side's (llama.cpp's cache type follows dtype).
        config = replace(
            decoder, target=str(files.target), draft=str(files.draft) if ours_draft else None,
            method="draft" if ours_draft else "none", backend=LLAMACPP, device="cpu", kv_dtype="auto", compile=False,
        )
        spec_decoder = SpecDecoder.from_config(config, show_progress)
        if context is None:
            context = spec_decoder.target.config.max_position_embeddings
    assert context is not None
    return LlamaCppSide(
        files=files, decoder=spec_decoder, context=context,
        exact=resolve_dtype(decoder.dtype, torch.device("cpu")) == torch.float32, threads=physical_core_count(),
        target_bytes=gguf_weight_bytes_per_forward(files.target),
        draft_bytes=gguf_weight_bytes_per_forward(files.draft) if files.draft else 0,
    )


def _file_record(path: Path) -> dict[str, Any]:
    """A model file as results record it: name, size and the hash of its first and last MiB."""
    from specdecode.costs.store import file_identity

    identity = file_identity(path)
    return {key: identity[key] for key in ("name", "size", "sha256_ends")}
