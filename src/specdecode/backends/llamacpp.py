"""A GGUF model run by llama.cpp (through llama-cpp-python's ctypes binding of the C API).

``LlamaCppModel`` owns one llama.cpp model and one context. Sequences are llama.cpp sequence
ids ``0 .. n_seq_max - 1``; llama.cpp's memory (its KV cache) holds their keys and values.

Invariant: the cache of sequence ``s`` holds positions ``0 .. cached_length(s) - 1`` and
nothing else. ``forward(s, tokens, start)`` first drops positions ``>= start``, then appends
the tokens at ``start .. start + T - 1``; so re-feeding after a rejected draft is safe, and
``truncate`` is the whole of rollback. ``start`` may not exceed ``cached_length(s)``: llama.cpp
rejects a batch whose first position for a sequence is not the cached length (no holes).
If a pass fails, every sequence it touched is cut back to its ``start``, so the invariant
holds after an exception too.

Logits come out of llama.cpp's buffer with exactly one copy (into the returned tensor).
``llama_cpp`` is imported on first use, so this module imports without the binding
(``backends/llamacpp_binding.py``: the import, llama.cpp's log, our errors; the batch fed to
``llama_decode`` and the context's parameters are ``backends/llamacpp_decode.py``'s).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Self

import numpy as np
import torch

from specdecode.backends.llamacpp_binding import (
    DECODE_OK,
    BackendUnavailableError,
    ContextOverflowError,
    LlamaCppDecodeError,
    LogSink,
    decode_error,
    import_llama_cpp,
    physical_core_count,
)
from specdecode.backends.llamacpp_decode import TokenBatch, context_params, copy_logits
from specdecode.backends.llamacpp_repack import (
    EXTRA_BUFTS_ENV,
    RepackChoice,
    extra_buffers_without,
    llama_cpp_version,
    repack_choice,
    use_extra_buffer_types,
)
from specdecode.backends.llamacpp_threads import attach_shared_threadpool
from specdecode.backends.mapped_pages import drop_resident_pages
from specdecode.backends.openmp import forget_loaded_libraries
from specdecode.errors import InvalidRequestError, ModelLoadError, SpecDecodeError

# Re-exported: the binding's errors, the default thread count and the repack choice
# (llamacpp_repack.py) are part of this module's API.
__all__ = ["EXTRA_BUFTS_ENV", "BackendUnavailableError", "ContextOverflowError", "LlamaCppDecodeError", "LlamaCppModel",
           "RepackChoice", "llama_cpp_version", "physical_core_count", "use_extra_buffer_types"]

LOGITS_MODES = ("all", "last", "none")  # or an int n >= 1: the last n tokens' rows
KV_TYPES = ("f16", "f32")  # llama.cpp's default is f16; f32 makes logits match fp32 torch closely


def output_rows(mode: str | int, count: int) -> int:
    """How many of a request's ``count`` tokens get a logit row (its last ones) in ``mode``."""
    if isinstance(mode, int):
        return min(mode, count)
    return {"all": count, "last": 1, "none": 0}[mode]


class _Weights:
    """A loaded llama_model and how many contexts use it; freed with the last."""

    def __init__(self, model: Any) -> None:
        self.model, self.users, self._lock = model, 1, threading.Lock()

    def share(self) -> _Weights:
        with self._lock:
            if self.users == 0:
                raise InvalidRequestError("this llama.cpp model is closed; its weights cannot be shared")
            self.users += 1
        return self

    def release(self, llama_cpp: ModuleType) -> None:
        with self._lock:
            self.users -= 1
            last = self.users == 0
        if last:
            llama_cpp.llama_model_free(self.model)


class LlamaCppModel:
    """One GGUF model and one llama.cpp context on the CPU, with ``n_seq_max`` sequences.

    n_ctx:       positions each sequence may hold (the context is sized n_ctx * n_seq_max, so
                 sequences never compete for room).
    n_batch:     tokens per llama_decode call (also the micro-batch); longer inputs are split.
    kv_unified:  True (the default, llama-server's with automatic slots): one KV buffer whose
                 cells any sequence may take, so a ``forward_batch`` of rows of any lengths on
                 any sequence ids is one micro-batch (llama.cpp's ``split_simple``), one read of
                 the weights. False: one KV stream per sequence, and llama.cpp's ``split_equal``
                 cuts a multi-sequence batch into micro-batches of equal tokens per sequence on
                 consecutive sequence ids: rows of 5, 3, 1, 1 tokens took 3 micro-batches and 8
                 prompts of 41-58 tokens 8 (benchmarks/llamacpp_batch_passes.py). Unified, a
                 row's attention masks the other sequences' cells (flash attention skips them).
    n_ubatch:    tokens per micro-batch (default n_batch: one compute graph per llama_decode).
    n_threads:   threads for every pass; default: the physical cores this process may use.
    kv_type:     "f16" (llama.cpp's default, half the memory) or "f32".
    flash_attn:  None lets llama.cpp decide (it enables it on CPU); its CPU kernel works in f16,
                 so False plus kv_type "f32" is what gives logits within ~1e-5 of fp32 torch.
    verbose:     print llama.cpp's log (process-wide: llama.cpp has one logger).
    lazy:        create the context (its KV buffer: n_ctx * n_seq_max cells) at first use, not
                 now: a server decodes in its batch engine's contexts, and the single-request
                 engine's would hold hundreds of MiB it never uses (224 MiB for the demo target).
    """

    def __init__(
        self,
        gguf_path: str | Path,
        *,
        n_ctx: int = 4096,
        n_seq_max: int = 1,
        n_threads: int | None = None,
        n_batch: int = 512,
        kv_type: str = "f16",
        flash_attn: bool | None = None,
        kv_unified: bool = True,
        n_ubatch: int | None = None,
        verbose: bool = False,
        weights_of: LlamaCppModel | None = None,
        lazy: bool = False,
    ) -> None:
        self._llama = None  # set first: close() (and __del__) must work on a half-built object
        self._model = None
        self._weights: _Weights | None = None
        self._ctx = None
        self._batch: TokenBatch | None = None
        self._closed = False
        for name, value in (("n_ctx", n_ctx), ("n_seq_max", n_seq_max), ("n_batch", n_batch)):
            if value < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {value}")
        if kv_type not in KV_TYPES:
            raise InvalidRequestError(f"kv_type must be one of {KV_TYPES}, got {kv_type!r}")
        llama_cpp = import_llama_cpp()
        self._llama = llama_cpp
        LogSink.echo = verbose
        self.path = Path(gguf_path)
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_batch = n_batch
        self.n_ubatch = n_batch if n_ubatch is None else min(n_ubatch, n_batch)
        self.kv_unified = kv_unified
        self.n_threads = n_threads if n_threads is not None else physical_core_count()
        self.kv_type, self.flash_attn, self.verbose = kv_type, flash_attn, verbose
        # Bumped by every LlamaCppSequence that begins or times a sequence of this context: held
        # here, not in the wrapper, since two wrappers over one model share llama.cpp's memory.
        self.sequence_epoch = 0

        # Contexts on one file share its llama_model (``weights_of``): a second load would map the
        # file again and repack its weights again (597 MiB of the demo target on an AVX2 CPU).
        if weights_of is not None and weights_of._weights is not None:
            self._weights = weights_of._weights.share()
            self.repack: RepackChoice = weights_of.repack
        else:
            self._weights = _Weights(self._load_model(llama_cpp))
        self._model = self._weights.model
        self.vocab_size: int = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model))
        if not lazy:
            self._open()

    def _open(self) -> None:
        """Create the context, its memory handle and its token batch."""
        llama_cpp = self._llama
        assert llama_cpp is not None
        self._ctx = self._new_context(llama_cpp, self.kv_type, self.flash_attn)
        # One thread pool for all our contexts (a target and its draft): see llamacpp_threads.py.
        self.shared_threads = attach_shared_threadpool(llama_cpp, self._ctx, self.n_threads)
        forget_loaded_libraries()  # ggml may have brought its libgomp (backends/openmp.py)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = TokenBatch(llama_cpp, self.n_batch)

    # ---------------------------------------------------------------------------- setup

    def _load_model(self, llama_cpp: ModuleType) -> Any:
        if not self.path.is_file():
            raise ModelLoadError(f"no GGUF file at {self.path}: check the path")
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0  # this backend runs on the CPU; the torch backend owns GPUs
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP  # 0.3.36's spelling of use_mmap=True
        # Repacked weights, with or without AMX, or none: the machine's choice (llamacpp_repack.py).
        self.repack = repack_choice(self.path)
        params.use_extra_bufts = self.repack.extra_buffers
        LogSink.take_recent()
        with extra_buffers_without(llama_cpp, self.repack.left_out):
            model = llama_cpp.llama_model_load_from_file(os.fsencode(self.path), params)
        if not model:
            detail = LogSink.take_recent() or "no detail from llama.cpp"
            raise ModelLoadError(f"llama.cpp could not load {self.path} ({detail}); is it a complete GGUF file of an "
                                 "architecture this llama-cpp-python version supports?")
        if self.repack.extra_buffers:  # the repacked tensors' originals are never read again
            drop_resident_pages(self.path)
        return model

    def _new_context(self, llama_cpp: ModuleType, kv_type: str, flash_attn: bool | None) -> Any:
        params = context_params(llama_cpp, self.n_ctx * self.n_seq_max, self.n_seq_max, self.n_batch, self.n_ubatch,
                                self.kv_unified, self.n_threads, kv_type, flash_attn)
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not ctx:
            detail = LogSink.take_recent() or "no detail from llama.cpp"
            self.close()
            raise ModelLoadError(
                f"llama.cpp could not create a context for {self.path} with n_ctx={self.n_ctx} x "
                f"n_seq_max={self.n_seq_max} ({detail}); try a smaller n_ctx or n_seq_max"
            )
        # llama.cpp may round the context up, never down; our checks use what was asked for.
        assert llama_cpp.llama_n_ctx_seq(ctx) >= self.n_ctx
        return ctx

    def with_sequences(self, n_seq_max: int, n_ctx: int) -> LlamaCppModel:
        """Another context on the same GGUF file and settings, with ``n_seq_max`` sequences of
        ``n_ctx`` positions each (a batch engine's), on this one's loaded weights: the model is
        freed when the last context on it closes."""
        return LlamaCppModel(self.path, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=self.n_threads, n_batch=self.n_batch,
                             kv_type=self.kv_type, flash_attn=self.flash_attn, kv_unified=self.kv_unified,
                             n_ubatch=self.n_ubatch, verbose=self.verbose, weights_of=self)

    def describe(self) -> dict[str, Any]:
        """The model's shape and special tokens as llama.cpp read them from the GGUF metadata."""
        llama, model = self._llama, self._model
        vocab = llama.llama_model_get_vocab(model)
        buffer = ctypes.create_string_buffer(256)
        length = llama.llama_model_meta_val_str(model, b"general.architecture", buffer, len(buffer))
        eos = {llama.llama_vocab_eos(vocab), llama.llama_vocab_eot(vocab)} - {-1}  # -1: the vocabulary has none
        return {
            "architecture": buffer.value.decode() if length > 0 else "unknown",
            "n_layer": llama.llama_model_n_layer(model),
            "n_embd": llama.llama_model_n_embd(model),
            "n_head": llama.llama_model_n_head(model),
            "n_head_kv": llama.llama_model_n_head_kv(model),
            "n_ctx_train": llama.llama_model_n_ctx_train(model),
            "eos_token_ids": sorted(eos),
            "weight_bytes": llama.llama_model_size(model),
        }

    # ---------------------------------------------------------------------------- cache

    def cached_length(self, seq: int) -> int:
        """Positions the cache holds for ``seq`` (0 for an empty sequence)."""
        self._check_seq(seq)
        return self._llama.llama_memory_seq_pos_max(self._memory, seq) + 1

    def truncate(self, seq: int, length: int) -> None:
        """Keep positions < length of ``seq`` (rollback of rejected tokens)."""
        self._check_seq(seq)
        if length < 0:
            raise InvalidRequestError(f"length must be >= 0, got {length}")
        if not self._llama.llama_memory_seq_rm(self._memory, seq, length, -1):
            raise LlamaCppDecodeError(
                f"llama.cpp cannot cut sequence {seq} back to {length} positions (its memory, e.g. a "
                "recurrent state, cannot be partially removed); clear the sequence and re-feed it"
            )

    def copy_sequence(self, source: int, dest: int, length: int) -> None:
        """Make ``dest`` hold ``source``'s first ``length`` positions (``dest``'s own are dropped).

        Unified KV: ``dest`` joins ``source`` on the cells of those positions (no data moves;
        a cell is freed when no sequence holds it, and either sequence's later writes take new
        cells). One stream per sequence (``kv_unified=False``): llama.cpp copies between streams
        only whole (a partial range aborts the process), at the start of the next
        ``llama_decode``, so the whole stream is copied and ``dest`` cut back to ``length``."""
        self._check_seq(source)
        self._check_seq(dest)
        if source == dest:
            raise InvalidRequestError("copy_sequence needs two different sequences")
        self._llama.llama_memory_seq_rm(self._memory, dest, -1, -1)
        if self.kv_unified:
            if length > 0:
                self._llama.llama_memory_seq_cp(self._memory, source, dest, 0, length)
            return
        self._llama.llama_memory_seq_cp(self._memory, source, dest, -1, -1)
        self.truncate(dest, length)

    def save_sequence(self, seq: int) -> ctypes.Array:
        """A copy of ``seq``'s K/V (and positions) in host memory, for ``restore_sequence``:
        ``llama_state_seq_get_data``; about 30 ms per 1,000 positions of the demo target here."""
        self._check_seq(seq)
        size = self._llama.llama_state_seq_get_size(self._ctx, seq)
        data = (ctypes.c_uint8 * size)()
        if self._llama.llama_state_seq_get_data(self._ctx, data, size, seq) != size:
            raise LlamaCppDecodeError(f"llama.cpp could not save sequence {seq}'s state")
        return data

    def restore_sequence(self, seq: int, data: ctypes.Array) -> None:
        """Make ``seq`` hold what ``save_sequence`` copied (from this or another sequence)."""
        self._check_seq(seq)
        self.clear(seq)
        if self._llama.llama_state_seq_set_data(self._ctx, data, len(data), seq) == 0:
            raise LlamaCppDecodeError(f"llama.cpp could not restore a saved state into sequence {seq}")

    def clear(self, seq: int | None = None) -> None:
        """Drop one sequence, or all of them (None)."""
        if seq is None:
            self._check_seq(0)
            self._llama.llama_memory_clear(self._memory, False)  # metadata only: cells are rewritten before use
            return
        self._check_seq(seq)
        self._llama.llama_memory_seq_rm(self._memory, seq, -1, -1)  # a whole sequence never fails

    # ---------------------------------------------------------------------------- passes

    def forward(self, seq: int, tokens: Sequence[int], start: int, logits: str | int = "all") -> torch.Tensor | None:
        """Feed ``tokens`` at positions start .. start + T - 1 of sequence ``seq``.

        Cached positions >= start are dropped first. Returns float32 logits: (T, V) for "all",
        (1, V) for the last token with "last", (n, V) for the last n tokens with an int n (a
        prompt's tail fed with the first drafts: only their rows go through the output layer),
        None for "none" (a prefill: no logits computed).
        """
        return self.forward_batch([(seq, tokens, start, logits)])[0]

    def forward_batch(
        self,
        requests: Sequence[tuple[int, Sequence[int], int, str | int]],
        out: Sequence[np.ndarray | None] | None = None,
    ) -> list[torch.Tensor | None]:
        """Several (seq, tokens, start, logits) requests, on distinct sequences, in one llama_decode.

        Same semantics per request as ``forward``; results in request order. Only when the
        requests hold more than n_batch tokens together is the work split over several calls.
        ``out`` (optional, one per request): float32 arrays of the result's shape that llama.cpp's
        rows are copied into, e.g. views of one padded batch array, so that array needs no
        second copy.
        """
        self._validate(requests)
        for seq, _, start, _ in requests:
            self.truncate(seq, start)
        # Tokens of all requests, request after request; flat_out marks the ones that get a logit row.
        flat_tokens: list[int] = []
        flat_pos: list[int] = []
        flat_seq: list[int] = []
        flat_out: list[bool] = []
        results: list[np.ndarray | None] = []
        for seq, tokens, start, mode in requests:
            count = len(tokens)
            flat_tokens.extend(tokens)
            flat_pos.extend(range(start, start + count))
            flat_seq.extend([seq] * count)
            rows = output_rows(mode, count)
            flat_out.extend([False] * (count - rows) + [True] * rows)
            given = None if out is None else out[len(results)]
            if given is not None and given.shape != (rows, self.vocab_size):
                raise InvalidRequestError(f"out[{len(results)}] has shape {given.shape}, the result needs {(rows, self.vocab_size)}")
            results.append(given if given is not None else np.empty((rows, self.vocab_size), dtype=np.float32) if rows else None)
        # row_owner[i] = (request, row in its result) of the i-th logit row llama.cpp writes.
        row_owner = [(r, row) for r, res in enumerate(results) if res is not None for row in range(len(res))]

        next_output = 0
        try:
            for begin in range(0, len(flat_tokens), self.n_batch):
                chunk = slice(begin, min(begin + self.n_batch, len(flat_tokens)))
                n_outputs = self._decode(flat_tokens[chunk], flat_pos[chunk], flat_seq[chunk], flat_out[chunk])
                if n_outputs:
                    self._copy_logits(results, row_owner[next_output : next_output + n_outputs])
                    next_output += n_outputs
        except BaseException:
            for seq, _, start, _ in requests:  # keep the invariant: nothing past start survives a failed pass
                self._llama.llama_memory_seq_rm(self._memory, seq, start, -1)
            raise
        return [None if res is None else torch.from_numpy(res) for res in results]

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], outputs: list[bool]) -> int:
        assert self._batch is not None
        self._batch.fill(tokens, positions, seqs, outputs)
        rc = self._llama.llama_decode(self._ctx, self._batch.batch)
        if rc != DECODE_OK:
            raise decode_error(rc, len(tokens))
        return sum(outputs)

    def _copy_logits(self, results: list[np.ndarray | None], owners: list[tuple[int, int]]) -> None:
        buffer = np.ctypeslib.as_array(self._llama.llama_get_logits(self._ctx), shape=(len(owners), self.vocab_size))
        copy_logits(buffer, results, owners)

    def _validate(self, requests: Sequence[tuple[int, Sequence[int], int, str | int]]) -> None:
        if not requests:
            raise InvalidRequestError("forward_batch needs at least one (seq, tokens, start, logits) request")
        seen: set[int] = set()
        for seq, tokens, start, mode in requests:
            self._check_seq(seq)
            if seq in seen:
                raise InvalidRequestError(f"sequence {seq} appears twice in one batch; merge its tokens into one")
            seen.add(seq)
            if not (mode in LOGITS_MODES or (isinstance(mode, int) and not isinstance(mode, bool) and mode >= 1)):
                raise InvalidRequestError(f"logits must be one of {LOGITS_MODES} or a row count >= 1, got {mode!r}")
            if len(tokens) == 0:
                raise InvalidRequestError(f"no tokens to feed to sequence {seq}")
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
            cached = self.cached_length(seq)
            if not 0 <= start <= cached:
                raise InvalidRequestError(
                    f"start {start} is not within sequence {seq}'s {cached} cached positions: llama.cpp "
                    "needs each sequence fed without holes, so feed the tokens before it first"
                )
            if start + len(tokens) > self.n_ctx:
                raise ContextOverflowError(
                    f"sequence {seq} would reach position {start + len(tokens) - 1}, past the context of "
                    f"{self.n_ctx} positions; create the model with a larger n_ctx or shorten the input"
                )

    def _check_seq(self, seq: int) -> None:
        if self._closed:  # the memory and batch pointers are freed: using them would crash
            raise SpecDecodeError("this LlamaCppModel is closed; create a new one")
        if self._ctx is None:  # lazy: first use
            self._open()
        if not 0 <= seq < self.n_seq_max:
            raise InvalidRequestError(f"sequence id {seq} is outside 0..{self.n_seq_max - 1}; raise n_seq_max")

    # ---------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Free the context, the batch and the model; safe to call twice."""
        llama_cpp = self._llama
        if llama_cpp is None:
            return
        self._closed = True
        if self._batch is not None:
            self._batch.free()
            self._batch = None
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._weights is not None:
            self._weights.release(llama_cpp)
            self._weights = None
        self._model = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the binding may be half torn down
            self.close()
