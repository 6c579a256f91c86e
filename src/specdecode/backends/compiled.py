"""Compiled decode passes: ``torch.compile`` on fixed shapes, CUDA graphs on a GPU (the gpt-fast way).

An eager pass pays Python and a kernel launch for every op of every layer. That overhead does
not shrink with the model: a 24-layer 0.5B draft pays nearly what a 28-layer 1.5B target does
on a GPU, and on a CPU the draft's non-matmul work keeps its pass above its share of the bytes.
Compiling a pass for one shape fuses the elementwise work (norms, RoPE, SiLU, residuals) into
a few kernels, and on CUDA replays the whole pass as one CUDA graph.

What is compiled (``CompiledSequence``): the passes the decode loop repeats, each for one shape,
lazily on first use or ahead of time by ``warm_up``: the draft model's one-row pass and its
two-row catch-up (logits of the last row), and the target's verify pass over each row count
up to ``max_rows`` (k + 1). Each is traced whole (``fullgraph=True``, ``dynamic=False``):

- the KV cache has a fixed capacity per request, rounded up (``compiled_capacity``) so most
  requests share one set of graphs;
- positions are a device tensor: keys and values are written by position (an index write)
  and the attention mask is built from them (``kv.static.fixed_view``), so rollback stays a
  commit;
- the attention width: a CUDA graph has one shape for the whole sequence, so there attention
  reads every slot of the cache (for the demo target 58 MB beside 3.1 GB of weights). On the
  CPU reading a 2048-slot cache under a mask made the 0.5B draft's pass 2-2.8 times as long
  (benchmarks/RESULTS.md), so there the width is the one symbolic dimension of the graph
  (``torch._dynamo.mark_dynamic``): one graph per row count serves every length, and
  attention reads what an eager pass reads;
- nothing in the region reads a tensor's value on the host.

Any other pass (a prefill, a long catch-up, more rows than ``max_rows``, token trees, skipped
layers) runs eagerly on the same cache, which both paths write by position.

Modes: on the CPU inductor's C++ kernels, with the packed oneDNN matmuls of ``models/layers.py``
called as they are (inductor's ``freezing`` would pack its own copy of every weight per graph:
measured, benchmarks/RESULTS.md); on CUDA ``mode="reduce-overhead"``, inductor's kernels
replayed as CUDA graphs, with the cache tensors marked static so that the graph writes them in
place. Compiled graphs are cached on disk by inductor (``configure_compile_cache``): a later
process skips code generation, though dynamo still traces each shape.
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.backends.torch_backend import TorchSequence
from specdecode.config import COMPILE_MODES, DRAFT_MODEL_METHODS, DecoderConfig
from specdecode.core.paths import cache_dir
from specdecode.core.timing import COST_PROBE_CONTEXT, best_seconds
from specdecode.errors import InvalidRequestError
from specdecode.kv.static import KVCache, fixed_view
from specdecode.models.llama import ModelOutput, Transformer

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that replay CUDA graphs
# Every compiled cache holds at least this many slots, so that requests of different lengths
# share one set of graphs (a longer request compiles its own set, at the next power of two).
# Under CUDA graphs attention reads every slot: for the demo target 2048 slots are 58 MB of
# bf16 keys and values per pass beside 3.1 GB of weights.
MIN_CAPACITY = 2048
CATCH_UP_COMPILED_ROWS = 2  # a draft pass feeds 1 token, or 2 to catch up after a fully accepted step
MIN_WIDTH = 2  # a symbolic width of 0 or 1 would be specialised (and recompiled); the mask hides the extra slot
CACHE_ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"
# A shape: (cache capacity, rows fed, logits of the last n rows or None for every row).
PassShape = tuple[int, int, int | None]


@dataclass(slots=True)
class CompileLog:
    """What one decoder compiled and how long it took (shared by its target and draft)."""

    seconds: float = 0.0
    passes: list[str] = field(default_factory=list)  # "target 3 rows", ... in compile order
    cache_hits: int = 0  # graphs inductor found in its on-disk cache
    cache_misses: int = 0  # graphs it generated code for

    def summary(self) -> str:
        cached = f"{self.cache_hits} of {self.cache_hits + self.cache_misses} from the on-disk cache"
        return f"compiled {len(self.passes)} passes in {self.seconds:.1f} s ({cached}, {os.environ.get(CACHE_ENV_VAR)})"


def resolve_compile_mode(compile: bool | str, device: torch.device) -> str | None:
    """The torch.compile mode for ``compile=`` on ``device``, or None for eager passes.

    True picks the device's mode: CUDA graphs on CUDA, inductor's default on the CPU."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return "reduce-overhead" if device.type == "cuda" else "default"
    if compile not in COMPILE_MODES:
        raise InvalidRequestError(f"compile must be True, False or one of {', '.join(COMPILE_MODES)}, got {compile!r}.")
    if compile in CUDA_GRAPH_MODES and device.type != "cuda":
        raise InvalidRequestError(f"compile={compile!r} replays CUDA graphs; on {device.type} use compile=True.")
    return compile


def check_compilable(backend: str, quant: str, kv_dtype: str) -> None:
    """Raise for what the compiled passes do not cover (the message names the parameters)."""
    if backend != "torch":
        raise InvalidRequestError('compile= compiles the torch backend\'s passes; use backend="torch".')
    if quant != "none":
        raise InvalidRequestError(
            f"compile= covers unquantized weights only (got {quant}); drop target_quant=/draft_quant= or compile=."
        )
    if kv_dtype != "auto":
        raise InvalidRequestError("compile= covers the model-dtype KV cache only; drop kv_dtype='int8' or compile=.")


def configure_compile_cache() -> Path:
    """Keep inductor's on-disk cache under specdecode's cache root (not /tmp, which a reboot
    empties), unless the user chose a folder with TORCHINDUCTOR_CACHE_DIR; returns the folder."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Importing inductor writes its default into the environment: that is not a user's choice.
    chosen = os.environ.get(CACHE_ENV_VAR)
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ[CACHE_ENV_VAR] = str(cache_dir() / "inductor")
    return Path(os.environ[CACHE_ENV_VAR])


def compiled_capacity(capacity: int) -> int:
    """The capacity a compiled cache gets for a request of ``capacity`` positions: one slot
    more than asked, since a symbolic width must stay below the cache's size (a slice to the
    full size is a special case the graph would guard on)."""
    return max(MIN_CAPACITY, 1 << capacity.bit_length())


def decode_pass(
    model: Transformer,
    tokens: torch.Tensor,  # (1, T) long
    positions: torch.Tensor,  # (1, T) long
    cache: KVCache,
    logits_last: int | None,
    width: torch.Tensor | None,  # (W,) whose length is the attention width; None: the whole cache
) -> tuple[torch.Tensor, torch.Tensor]:  # logits (1, T_logits, V) float32, hidden (1, T, C)
    """The compiled region: one cached pass whose shapes depend on T, the cache and W only."""
    view = fixed_view(positions, cache.capacity if width is None else width.shape[0], model.config.sliding_window)
    out = model(tokens, positions, cache, view, logits_last=logits_last)
    return out.logits, out.hidden


def own_copy(function: Callable, name: str) -> Callable:
    """``function`` with a code object of its own. Dynamo keeps compiled graphs per code
    object, so a copy per shape means one graph per cache entry: no guard search across shapes
    on every call, and no shared recompile limit (8) for a target's 9 verify shapes."""
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)


def cache_counts() -> tuple[int, int]:
    """Inductor's on-disk graph cache (hits, misses) in this process so far."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


class CompiledSequence(TorchSequence):
    """``TorchSequence`` whose repeated passes run compiled (see the module docstring)."""

    # A prompt's tail fed with the first drafts is a pass shape of its own, compiled per prompt
    # length: prefill apart instead (a pass of its own, eager, as before).
    merges_prefill = False

    def __init__(self, model: Transformer, mode: str, max_rows: int, log: CompileLog, role: str = "model") -> None:
        super().__init__(model)
        self.mode = mode
        self.max_rows = max_rows  # passes over more rows run eagerly
        self.log = log
        self.role = role
        self.cuda_graphs = mode in CUDA_GRAPH_MODES
        # Only the length of this host tensor is read (sliced per pass): the symbolic width.
        self._width = torch.empty(0, dtype=torch.uint8)
        self._compiled: dict[PassShape, Callable] = {}
        self._warm: set[PassShape] = set()
        configure_compile_cache()

    def begin(self, capacity: int, keep: int = 0) -> None:
        previous = self.cache
        super().begin(compiled_capacity(capacity), keep)
        assert self.cache is not None
        if self._width.shape[0] < self.cache.capacity:
            self._width = torch.empty(self.cache.capacity, dtype=torch.uint8)
        if self.cuda_graphs and self.cache is not previous:
            # A CUDA graph bakes in the addresses it writes: the cache must stay where it is.
            for tensors in self.cache._storages():
                for tensor in tensors:
                    torch._dynamo.mark_static_address(tensor)

    def compiles(self, rows: int, compute_logits: bool = True) -> bool:
        """Whether a pass over ``rows`` rows runs compiled (a prefill without logits does not)."""
        return compute_logits and rows <= self.max_rows

    def extend(
        self,
        tokens: torch.Tensor,  # (1, T) long
        start: int,
        *,
        logits_last: int | None = None,
        compute_logits: bool = True,
    ) -> ModelOutput:
        assert self.cache is not None, "begin() a sequence first"
        if not self.compiles(tokens.shape[1], compute_logits):
            return super().extend(tokens, start, logits_last=logits_last, compute_logits=compute_logits)
        return self._run(self.cache, tokens, start, logits_last)

    def _run(self, cache: KVCache, tokens: torch.Tensor, start: int, logits_last: int | None) -> ModelOutput:
        rows = tokens.shape[1]
        if logits_last is not None and logits_last >= rows:
            logits_last = None  # the same pass: one graph
        shape = (cache.capacity, rows, logits_last)
        function = self._compiled.get(shape)
        if function is None:
            name = f"{self.role}_pass_{cache.capacity}_{rows}_{logits_last or 'all'}"
            function = torch.compile(own_copy(decode_pass, name), fullgraph=True, dynamic=False, mode=self.mode)
            self._compiled[shape] = function
        # Fresh, contiguous inputs: a slice of the committed buffer has a stride that differs
        # between requests, and a guard on it would recompile.
        tokens = tokens.clone(memory_format=torch.contiguous_format)
        positions = torch.arange(start, start + rows, device=tokens.device)[None]
        width = None
        if self.cuda_graphs:
            # Each call starts a new replay; outputs are copied out below before the next one.
            torch.compiler.cudagraph_mark_step_begin()
        else:
            width = self._width[: max(start + rows, MIN_WIDTH)]
            torch._dynamo.mark_dynamic(width, 0, min=MIN_WIDTH, max=cache.capacity - 1)
        if shape in self._warm:
            logits, hidden = function(self.model, tokens, positions, cache, logits_last, width)
        else:
            logits, hidden = self._first_call(function, shape, tokens, positions, cache, logits_last, width)
        if self.cuda_graphs:
            logits, hidden = logits.clone(), hidden.clone()
        return ModelOutput(logits=logits, hidden=hidden)

    def _first_call(
        self,
        function: Callable,
        shape: PassShape,
        tokens: torch.Tensor,  # (1, T) long
        positions: torch.Tensor,  # (1, T) long
        cache: KVCache,
        logits_last: int | None,
        width: torch.Tensor | None,  # (W,) see decode_pass
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The call that compiles ``shape``, timed into the log."""
        hits, misses = cache_counts()
        started = time.perf_counter()
        out = function(self.model, tokens, positions, cache, logits_last, width)
        if self.cuda_graphs:
            # reduce-overhead runs a shape eagerly once, then records its graph on the next
            # call: record it now, as part of compiling.
            for _ in range(2):
                torch.compiler.cudagraph_mark_step_begin()
                out = function(self.model, tokens, positions, cache, logits_last, width)
            out = tuple(t.clone() for t in out)
        self.log.seconds += time.perf_counter() - started
        new_hits, new_misses = cache_counts()
        self.log.cache_hits += new_hits - hits
        self.log.cache_misses += new_misses - misses
        _, rows, last = shape
        self.log.passes.append(f"{self.role} {rows} rows" + (f" (logits of the last {last})" if last else ""))
        self._warm.add(shape)
        return out

    @torch.inference_mode()
    def warm_up(self, shapes: Sequence[tuple[int, int | None]], show_progress: bool = False) -> None:
        """Compile the passes of ``shapes`` ((rows, logits_last) pairs) now, on this sequence's
        cache (a new one holds ``MIN_CAPACITY`` slots, what most requests get), so that decoding
        does not stop to compile them."""
        if self.cache is None:
            self.begin(1)
        assert self.cache is not None
        self.epoch += 1  # writes over whatever the cache held
        tokens = torch.zeros((1, max(rows for rows, _ in shapes)), dtype=torch.long, device=self.device)
        for rows, logits_last in shapes:
            if show_progress:
                print(f"specdecode: compiling the {self.role}'s {rows}-row pass", file=sys.stderr, flush=True)
            self._run(self.cache, tokens[:, :rows], 0, logits_last)
        self.commit(0)

    def pass_seconds(self, row_counts: Sequence[int], repeats: int, logits_last: int | None = None) -> dict[int, float]:
        """Seconds of the passes decoding will run: compiled ones timed compiled (compiling
        them first if need be), on this sequence's own cache so that CUDA graphs keep their
        addresses; the rest eagerly."""
        compiled = [rows for rows in row_counts if self.compiles(rows)]
        self.epoch += 1  # may time on this sequence's own cache
        measured = super().pass_seconds([r for r in row_counts if r not in compiled], repeats, logits_last) if (
            len(compiled) < len(row_counts)) else {}
        if not compiled:
            return measured
        if self.cache is None or self.cache.capacity <= COST_PROBE_CONTEXT + max(compiled):
            self.begin(COST_PROBE_CONTEXT + max(compiled))
        cache = self.cache
        assert cache is not None
        tokens = torch.zeros((1, max(compiled)), dtype=torch.long, device=self.device)
        with torch.inference_mode():
            for rows in compiled:
                fed = tokens[:, :rows]
                measured[rows] = best_seconds(
                    lambda fed=fed: self._run(cache, fed, COST_PROBE_CONTEXT, logits_last), self.device, repeats
                )
        return dict(sorted(measured.items()))


def compiled_rows(role: str, config: DecoderConfig) -> int:
    """The most rows a compiled pass of ``role`` ("target" or "draft") takes under ``config``: the
    draft model's passes feed one token, or two when catching up; the target's verify k + 1 (a
    per-call k above these runs its passes eagerly)."""
    return CATCH_UP_COMPILED_ROWS if role == "draft" else max(config.draft_k, config.k_max) + 1


def warm_up_rows(config: DecoderConfig) -> int:
    """The most rows a verify pass of ``config``'s method and k takes: k + 1, k_max + 1 under an
    adaptive k or auto, 1 for plain decoding (what either engine's warm-up compiles up to)."""
    adaptive = config.policy != "fixed" or config.method == "auto"
    return 1 if config.method == "none" else (config.k_max if adaptive else config.draft_k) + 1


def warm_up_passes(
    target: CompiledSequence, draft: CompiledSequence | None, config: DecoderConfig, show_progress: bool, all_shapes: bool
) -> None:
    """Compile now the passes ``config``'s method and k will run, or with ``all_shapes`` every
    pass any chain method can run compiled (k up to max(k, k_max))."""
    verify_rows = target.max_rows if all_shapes else warm_up_rows(config)
    target.warm_up([(rows, None) for rows in range(1, verify_rows + 1)], show_progress)
    if draft is not None and (all_shapes or config.method in DRAFT_MODEL_METHODS):
        draft.warm_up([(1, None), (2, 1)], show_progress)
