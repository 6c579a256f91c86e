"""Compiled passes for the batch engine: ``PagedBatchModel`` whose chain passes run through ``torch.compile``.

The batch engine (``engine/batch.py``) feeds the target a (B, T) pass each step: B rows, each its
last committed token and its drafts, padded to the longest; the draft model a (B, 1) or (B, 2)
pass. Eager, each pass pays Python and a kernel launch for every op of every layer, which on a
GPU costs more than a small batch's matmuls; compiled, the elementwise work fuses and on CUDA
the whole pass replays as one CUDA graph (vLLM captures its decode passes the same way).

Few graphs, many shapes: B, T and the attention width W are symbolic dimensions of one graph
(``torch._dynamo.mark_dynamic``), so a handful of graphs serve every batch: one per (B is 1,
T is 1, logits or not), since dynamo specialises a dimension of size 1. What a graph's shape
would otherwise bake in comes in as tensors: each row's positions, the pool slot each new token
is written to and the slots it reads (``PagedKVCache.slot_rows``); the causal mask (and the
sliding window's) is built inside the graph from positions, so nothing in the region reads a
device value on the host.

Under CUDA graphs (``mode="reduce-overhead"``) each concrete shape is one recording, so B, T and
W are padded up to powers of two (W to at least ``MIN_CUDA_WIDTH``; padding rows and tokens
write and read only the null block): the recordings stay few (a few dozen for a batch of 16 and
a context of 4096), and the pool's tensors are marked as static addresses so that a graph
writes the K/V in place. Attention then reads up to twice the visible slots under the mask. On the CPU nothing is padded beyond
W's minimum of 2: a padding row would cost its share of every matmul there.

What stays eager, on the same pool: token trees (a per-row ancestor mask), skipped layers
(layer skip's drafts), passes over more than ``max_rows`` rows (a prefill's chunks) and an
int8 pool (refused with ``compile=``, as for the single-request path). Outputs equal eager
passes' in fp32 (tested); in bf16 fused kernels may round differently, as any two kernels can.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import torch

from specdecode.backends.compiled import CUDA_GRAPH_MODES, CompileLog, cache_counts, configure_compile_cache, own_copy
from specdecode.backends.torch_batch import PagedBatchModel
from specdecode.core.device import host_to_device
from specdecode.core.timing import COST_PROBE_CONTEXT, best_seconds
from specdecode.kv.paged import DEFAULT_BLOCK_SIZE, NULL_BLOCK, PagedKVCache, blocks_for, stack_padded
from specdecode.kv.paged_view import PagedView
from specdecode.models.llama import ModelOutput, Transformer

MIN_DYNAMIC = 2  # dynamo specialises sizes 0 and 1: a symbolic dimension starts at 2
MIN_CUDA_WIDTH = 256  # under CUDA graphs the attention width is a power of two, at least this
# A graph: (batch of one, one row, logits computed). Its other sizes are symbolic.
GraphKey = tuple[bool, bool, bool]


def paged_pass(
    model: Transformer,
    tokens: torch.Tensor,  # (B, T) long
    positions: torch.Tensor,  # (B, T) long: where each token is stored and rotated
    write_slots: torch.Tensor,  # (B, T) long: the pool slot each token's K/V goes to
    read_slots: torch.Tensor,  # (B, W) long: each row's visible slots in position order, then null
    pool: PagedKVCache,
    compute_logits: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:  # logits (B, T, V) float32 or None, hidden (B, T, C)
    """The compiled region: a chain pass over the paged pool, its mask built from positions."""
    width = read_slots.shape[1]
    key_positions = torch.arange(width, device=tokens.device)[None, None, :]  # slot j of a row holds position j
    mask = key_positions <= positions[:, :, None]  # (B, T, W)
    window = model.config.sliding_window
    if window is not None:
        mask = mask & (key_positions > positions[:, :, None] - window)
    view = PagedView(kv_len=width, mask=mask[:, None], cache=pool, write_slots=write_slots, read_slots=read_slots)
    out = model(tokens, positions, view, view, compute_logits=compute_logits)
    return out.logits, out.hidden


def _power_of_two(size: int) -> int:
    return 1 << (size - 1).bit_length()


class BatchGraphs:
    """One decoder's compiled batch passes, by role and graph key: every batch engine it builds
    (a larger one-seat engine, the server's) runs the same graphs, which serve any pool size."""

    def __init__(self, mode: str, log: CompileLog) -> None:
        self.mode = mode
        self.log = log
        self.cuda_graphs = mode in CUDA_GRAPH_MODES
        self.functions: dict[tuple[str, GraphKey], Callable] = {}
        configure_compile_cache()

    def function(self, role: str, key: GraphKey) -> Callable:
        function = self.functions.get((role, key))
        if function is None:
            batch_one, row_one, logits = key
            name = f"{role}_paged_pass_{'b1' if batch_one else 'bn'}_{'t1' if row_one else 'tn'}_{int(logits)}"
            function = torch.compile(own_copy(paged_pass, name), fullgraph=True, dynamic=False, mode=self.mode)
            self.functions[(role, key)] = function
        return function


class CompiledPagedBatchModel(PagedBatchModel):
    """``PagedBatchModel`` whose chain passes of up to ``max_rows`` rows run compiled (module docstring)."""

    def __init__(self, model: Transformer, pool: PagedKVCache, graphs: BatchGraphs, max_rows: int,
                 role: str = "model") -> None:
        super().__init__(model, pool)
        self.graphs = graphs
        self.max_rows = max_rows
        self.log = graphs.log
        self.role = role
        self.cuda_graphs = graphs.cuda_graphs
        # Shapes padded to powers of two: what CUDA graphs need (settable, so the CPU tests it too).
        self.pad_shapes = self.cuda_graphs
        self._shapes_seen: set[tuple[int, int, int, bool]] = set()  # (B, T, W, logits) run so far
        for tensors in pool._storages():
            for tensor in tensors:
                if self.cuda_graphs:  # a CUDA graph bakes in the addresses it writes: the pool stays put
                    torch._dynamo.mark_static_address(tensor)
                else:  # one graph serves every pool size (a larger one-seat engine's too)
                    torch._dynamo.mark_dynamic(tensor, 0)

    @classmethod
    def over_pool(cls, model: Transformer, kv_cache_tokens: int, block_size: int, graphs: BatchGraphs,
                  max_rows: int, role: str) -> CompiledPagedBatchModel:
        """``model`` over a fresh model-dtype pool of ``kv_cache_tokens`` slots (plus the null block)."""
        pool = PagedKVCache(model.config, kv_cache_tokens // block_size + 1, model.dtype, model.device, block_size)
        return cls(model, pool, graphs, max_rows, role)

    def compiles(self, rows: int, trees: Sequence[Sequence[int] | None] | None, layers: Sequence[int] | None) -> bool:
        return rows <= self.max_rows and layers is None and not any(t is not None for t in trees or ())

    def _run(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        starts: Sequence[int],
        trees: Sequence[Sequence[int] | None] | None,
        layers: Sequence[int] | None,
        compute_logits: bool,
    ) -> ModelOutput:
        rows = max(x.shape[0] for x in inputs)
        if not self.compiles(rows, trees, layers):
            return super()._run(seqs, inputs, starts, trees, layers, compute_logits)
        host_positions = [list(range(start, start + x.shape[0])) for x, start in zip(inputs, starts, strict=True)]
        batch, padded_rows = len(seqs), rows
        padded, width = batch, MIN_DYNAMIC
        if self.pad_shapes:  # few CUDA graph recordings: B, T and W to powers of two
            padded, padded_rows = _power_of_two(batch), _power_of_two(rows)
            longest = max(row[-1] for row in host_positions) + 1
            width = max(MIN_CUDA_WIDTH, _power_of_two(longest))
        positions, write_slots, read_slots = self.pool.slot_rows(seqs, host_positions, width)
        # Padding rows sit at position 0 and padding tokens repeat a row's last position; both
        # write the null slot, and a padding row reads it alone.
        null_slot = NULL_BLOCK * self.pool.block_size
        positions += [[0] * rows for _ in range(padded - batch)]
        write_slots += [[null_slot] * rows for _ in range(padded - batch)]
        read_slots += [[null_slot] * len(read_slots[0]) for _ in range(padded - batch)]
        for position_row, write_row in zip(positions, write_slots, strict=True):
            position_row += [position_row[-1]] * (padded_rows - rows)
            write_row += [null_slot] * (padded_rows - rows)
        device = self.device
        tokens = torch.nn.functional.pad(stack_padded(list(inputs)), (0, padded_rows - rows, 0, padded - batch))
        # One transfer for positions and write slots, one for the read slots.
        pos_write = host_to_device([positions, write_slots], torch.long, device)  # (2, B, T)
        reads = host_to_device(read_slots, torch.long, device)  # (B, W)
        logits, hidden = self._call(tokens, pos_write[0], pos_write[1], reads, compute_logits)
        if (padded, padded_rows) != (batch, rows):
            logits = None if logits is None else logits[:batch, :rows]
            hidden = hidden[:batch, :rows]
        return ModelOutput(logits=logits, hidden=hidden)

    def _call(
        self,
        tokens: torch.Tensor,  # (B, T) long
        positions: torch.Tensor,  # (B, T) long
        write_slots: torch.Tensor,  # (B, T) long
        read_slots: torch.Tensor,  # (B, W) long
        compute_logits: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        batch, rows = tokens.shape
        function = self.graphs.function(self.role, (batch == 1, rows == 1, compute_logits))
        for tensor in (tokens, positions, write_slots):
            if batch > 1:
                torch._dynamo.mark_dynamic(tensor, 0)
            if rows > 1:
                torch._dynamo.mark_dynamic(tensor, 1)
        if batch > 1:
            torch._dynamo.mark_dynamic(read_slots, 0)
        torch._dynamo.mark_dynamic(read_slots, 1)
        shape = (batch, rows, read_slots.shape[1], compute_logits)
        first = shape not in self._shapes_seen
        hits, misses = cache_counts()
        started = time.perf_counter()
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()  # each call is a new replay
        logits, hidden = function(self.model, tokens, positions, write_slots, read_slots, self.pool, compute_logits)
        if self.cuda_graphs and first:
            # reduce-overhead runs a new shape eagerly once and records its graph on the next
            # call: record it now, counted as compiling. The pass writes the same K/V again.
            for _ in range(2):
                torch.compiler.cudagraph_mark_step_begin()
                logits, hidden = function(self.model, tokens, positions, write_slots, read_slots, self.pool,
                                          compute_logits)
        if first:
            self._shapes_seen.add(shape)
            new_hits, new_misses = cache_counts()
            if new_hits + new_misses > hits + misses or self.cuda_graphs:
                self.log.seconds += time.perf_counter() - started
                self.log.cache_hits += new_hits - hits
                self.log.cache_misses += new_misses - misses
                self.log.passes.append(f"{self.role} batch {batch} x {rows} rows" + ("" if compute_logits else
                                                                                     " (no logits)"))
        if self.cuda_graphs:  # a replay's outputs live in the graph's memory: copy them out
            logits = None if logits is None else logits.clone()
            hidden = hidden.clone()
        return logits, hidden

    @torch.inference_mode()
    def warm_up(self, batches: Sequence[int], rows: Sequence[int], logits: Sequence[bool] = (True, False),
                show_progress: bool = False) -> None:
        """Compile (and on CUDA record) the passes of every (batch, rows, logits) combination now,
        on sequences borrowed from this pool, so that decoding does not stop for them. Under CUDA
        graphs each attention width the pool can hold is recorded too (``MIN_CUDA_WIDTH`` and its
        doublings): a context of any length then finds its graph."""
        for batch in batches:
            for count in rows:
                if show_progress:
                    print(f"specdecode: compiling the {self.role}'s {batch} x {count}-row pass", file=sys.stderr,
                          flush=True)
                for context in self._warm_contexts(batch, count):
                    for compute_logits in logits:
                        self._on_scratch(batch, count, lambda run, c=compute_logits: run(c), context)

    def _warm_contexts(self, batch: int, count: int) -> list[int]:
        """The positions before the fed rows that cover each width a pass may read: one on the CPU."""
        if not self.cuda_graphs:
            return [COST_PROBE_CONTEXT]
        fits = self.pool.free_blocks // batch * self.pool.block_size
        widths = [MIN_CUDA_WIDTH << i for i in range(16) if MIN_CUDA_WIDTH << i <= fits]
        return [width - count for width in widths] or [COST_PROBE_CONTEXT]

    def _on_scratch(self, batch: int, count: int, use: Callable[[Callable[[bool], object]], object],
                    context: int = COST_PROBE_CONTEXT) -> object:
        """``use(run)`` where ``run(logits)`` feeds ``count`` tokens to ``batch`` scratch sequences of
        this pool after ``context`` positions (attention reads something, as decoding does)."""
        seqs = [-1 - b for b in range(batch)]  # the engine's ids are >= 0
        for seq in seqs:
            self.pool.add(seq)
            self.pool.reserve(seq, context + count)
        try:
            inputs = [torch.zeros(count, dtype=torch.long, device=self.device)] * batch
            starts = [context] * batch
            return use(lambda compute_logits: self._run(seqs, inputs, starts, None, None, compute_logits))
        finally:
            for seq in seqs:
                self.pool.free(seq)

    @torch.inference_mode()
    def pass_seconds(self, shapes: Sequence[tuple[int, int]], repeats: int) -> dict[tuple[int, int], float]:
        """Each (B, T) pass timed as decoding runs it: compiled (compiling it first) on this pool
        where it has room, so that CUDA graphs keep their addresses; eager timing otherwise."""
        needed = max(b for b, _ in shapes) * blocks_for(COST_PROBE_CONTEXT + max(t for _, t in shapes),
                                                        self.pool.block_size)
        if self.pool.free_blocks < needed or self.pool.tables:
            return super().pass_seconds(shapes, repeats)
        measured = {}
        for batch, width in shapes:
            if not self.compiles(width, None, None):
                measured.update(super().pass_seconds([(batch, width)], repeats))
                continue
            measured[(batch, width)] = self._on_scratch(
                batch, width, lambda run: best_seconds(lambda: run(True), self.device, repeats))
        return measured


def compiled_batch_model(model: Transformer, kv_cache_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE, *,
                         graphs: BatchGraphs, max_rows: int, role: str) -> CompiledPagedBatchModel:
    """The batch engine's compiled model (``backends/batch_select.batch_model`` with ``compile=``)."""
    return CompiledPagedBatchModel.over_pool(model, kv_cache_tokens, block_size, graphs, max_rows, role)


def warm_up_batch(target: CompiledPagedBatchModel, draft: CompiledPagedBatchModel | None, verify_rows: int,
                  batches: Sequence[int] = (1,), show_progress: bool = False) -> None:
    """Compile now what a batch engine of these ``batches`` will run: the target's verify passes
    of up to ``verify_rows`` rows (with logits) and its short prefills (without), the draft
    model's one- and two-row passes (without: its logits come after the graph). On the CPU one graph per (batch of one, one row) serves every
    other size, so rows 1 and 2 compile them all; under CUDA graphs each power of two of rows is
    recorded (at the shortest attention width: a longer context records its own on first use)."""
    rows = [1, 2] if not target.pad_shapes else [1 << i for i in range((max(verify_rows, 2) - 1).bit_length() + 1)]
    target.warm_up(batches, rows, (True, False), show_progress)
    if draft is not None:
        draft.warm_up(batches, [1, 2], (False,), show_progress)
