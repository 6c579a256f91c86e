"""Pass traces on the batch engine holding one request: its target's and draft model's passes,
recorded as ``engine/trace.py``'s events (what ``TracingSequence`` records on the single engine).

``tracing_batch_model`` wraps a ``BatchModel`` (``backends/base.py``) whose passes carry one row
(the one-seat engine's, ``engine/one_request.py``) and writes each call into a ``PassTrace``
before passing it on; the wrapped model does the work, so the decode is the one it would have
been. The batch engine's calls map onto the single engine's events:

- the sequence's admission -> BEGIN (capacity, keep). The pool admits it (``SequencePool.add``,
  the scheduler's, not the model's), so the wrapper sees it as the first call on a new sequence
  id: a pass from position ``keep`` or a commit to ``keep``, the positions its prefix cache
  served. Capacity is the positions the sequence came to use (the BEGIN grows with its passes),
  as a replay's static cache must hold them;
- a forward with logits "none" -> EXTEND (start, rows, 0): a prefill (torch prefills a prompt in
  a pass of its own; the draft model reads its backlog in a read-ahead pass); "last" -> logit
  rows 1; "all" -> every row, or ``logit_rows``' (a merged prompt tail and its verify rows);
- a forward with a token tree -> TREE (start, nodes, parents); ``keep_path`` -> KEEP; ``commit``
  -> COMMIT.

Layer skip's draft passes run through the engine's ``BatchLayerSkip`` over the unwrapped target
and are not recorded, as on the single engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from specdecode.backends.base import BatchModel, SequencePool
from specdecode.backends.torch_batch import PagedBatchModel
from specdecode.engine.trace import BEGIN, COMMIT, DRAFT, EXTEND, KEEP, ROLES, TARGET, TREE, PassEvent, PassTrace

if TYPE_CHECKING:
    from specdecode.engine.batch import BatchEngine
    from specdecode.engine.one_request import OneRequestEngine


class _Recorder:
    """The events of one role's batch model, one row a pass."""

    def __init__(self, role: str, trace: PassTrace) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.trace = trace
        self._admitted: set[int] = set()  # sequence ids seen: the first call on another is an admission
        self._begin_at = -1  # index of this role's last BEGIN in trace.events
        self._capacity = 0

    def _record(self, op: str, *args: int) -> None:
        self.trace.events.append(PassEvent(self.role, op, tuple(int(a) for a in args)))

    def _admit(self, seq: int, keep: int) -> None:
        if seq in self._admitted:
            return
        self._admitted.add(seq)
        self._begin_at, self._capacity = len(self.trace.events), keep
        self._record(BEGIN, keep, keep)

    def _reach(self, end: int) -> None:
        """The sequence wrote up to position ``end``: its BEGIN's capacity holds it."""
        if end <= self._capacity:
            return
        self._capacity = end
        keep = self.trace.events[self._begin_at].args[1]
        self.trace.events[self._begin_at] = PassEvent(self.role, BEGIN, (end, keep))

    def record_pass(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # one (T,) long tensor: the pass's only row
        starts: Sequence[int],
        logit_rows: int | None,  # rows with logits (None: every row)
        trees: Sequence[Sequence[int] | None] | None,
    ) -> None:
        if len(seqs) != 1:
            raise ValueError(f"a tracing batch model records passes of one row (the one-seat engine's), got {len(seqs)}")
        seq, start, rows = seqs[0], starts[0], inputs[0].shape[0]
        self._admit(seq, start)
        self._reach(start + rows)
        parents = trees[0] if trees is not None else None
        if parents is not None:
            if len(parents) != rows:
                raise ValueError(f"a tree row feeds its {len(parents)} nodes only, got {rows} tokens")
            self._record(TREE, start, rows, *parents[1:])
        else:
            self._record(EXTEND, start, rows, rows if logit_rows is None else min(logit_rows, rows))

    def record_commit(self, seq: int, length: int) -> None:
        self._admit(seq, length)  # a prompt served whole from the cache, or fed with the first verify rows
        self._record(COMMIT, length)

    def record_keep(self, seq: int, root: int, path: Sequence[int]) -> None:
        self._record(KEEP, root, *path)


def _logit_rows(logits: str, logit_rows: Sequence[int] | None) -> int | None:
    """Rows of the only row's tokens a forward computes logits for (None: all of them)."""
    if logits == "none":
        return 0
    if logits == "last":
        return 1
    return None if logit_rows is None else logit_rows[0]


class _Recording:
    """What both tracing wrappers do alike: commits and kept paths recorded and passed on; cost
    probes passed on unrecorded (a scratch sequence, not the request's)."""

    inner: Any  # the wrapped BatchModel
    recorder: _Recorder

    def commit(self, seq: int, length: int) -> None:
        self.recorder.record_commit(seq, length)
        self.inner.commit(seq, length)

    def keep_path(self, seq: int, root: int, path: Sequence[int]) -> None:
        self.recorder.record_keep(seq, root, path)
        self.inner.keep_path(seq, root, path)

    def pass_seconds(self, shapes: Sequence[tuple[int, int]], repeats: int) -> dict[tuple[int, int], float]:
        return self.inner.pass_seconds(shapes, repeats)


class TracingBatchModel(_Recording):
    """A ``BatchModel`` that records its one-row calls into ``trace`` as ``role`` and passes
    them on (any backend's; llama.cpp's). Everything else is the wrapped model's."""

    def __init__(self, inner: BatchModel, role: str, trace: PassTrace) -> None:
        self.inner = inner
        self.recorder = _Recorder(role, trace)

    def __getattr__(self, name: str) -> Any:  # backend, and a backend's own attributes
        return getattr(self.inner, name)

    @property
    def pool(self) -> SequencePool:
        return self.inner.pool

    @property
    def merges_prefill(self) -> bool:
        return self.inner.merges_prefill

    @property
    def supports_trees(self) -> bool:
        return self.inner.supports_trees

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def forward(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        starts: Sequence[int],
        logits: str = "all",
        logit_rows: Sequence[int] | None = None,
        **options: Any,  # trees, where the backend scores them
    ) -> torch.Tensor | None:
        self.recorder.record_pass(seqs, inputs, starts, _logit_rows(logits, logit_rows), options.get("trees"))
        return self.inner.forward(seqs, inputs, starts, logits, logit_rows, **options)


class TracingPagedBatchModel(_Recording, PagedBatchModel):
    """``TracingBatchModel`` for torch's ``PagedBatchModel``: still one (the engine hands trained
    heads' features only to a paged model, ``forward_features``), over the same model and pool."""

    def __init__(self, inner: PagedBatchModel, role: str, trace: PassTrace) -> None:
        super().__init__(inner.model, inner.pool)
        self.inner = inner
        self.recorder = _Recorder(role, trace)

    @property  # type: ignore[override]  # the wrapped model's, where a test set its own
    def merges_prefill(self) -> bool:
        return self.inner.merges_prefill

    def forward(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        starts: Sequence[int],
        logits: str = "all",
        logit_rows: Sequence[int] | None = None,
        trees: Sequence[Sequence[int] | None] | None = None,
        layers: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        if layers is None:  # a pass of some layers is layer skip's draft: not recorded, as on the single engine
            self.recorder.record_pass(seqs, inputs, starts, _logit_rows(logits, logit_rows), trees)
        return self.inner.forward(seqs, inputs, starts, logits, logit_rows, trees, layers)

    def forward_features(
        self,
        seqs: Sequence[int],
        inputs: Sequence[torch.Tensor],  # B tensors, (T_b,) long each
        starts: Sequence[int],
        logits: bool = True,
        trees: Sequence[Sequence[int] | None] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        self.recorder.record_pass(seqs, inputs, starts, None if logits else 0, trees)
        return self.inner.forward_features(seqs, inputs, starts, logits, trees)



def tracing_batch_model(inner: BatchModel, role: str, trace: PassTrace) -> BatchModel:
    """``inner`` with its one-row calls recorded into ``trace`` as ``role``."""
    if isinstance(inner, PagedBatchModel):
        return TracingPagedBatchModel(inner, role, trace)
    return TracingBatchModel(inner, role, trace)  # type: ignore[return-value]  # a BatchModel by its properties


def _untraced(model: BatchModel) -> BatchModel:
    return model.inner if isinstance(model, (TracingBatchModel, TracingPagedBatchModel)) else model


def trace_engine(engine: BatchEngine, trace: PassTrace) -> None:
    """Record ``engine``'s target and draft model passes into ``trace`` until ``untrace_engine``."""
    untrace_engine(engine)
    engine.target = tracing_batch_model(engine.target, TARGET, trace)
    if engine.drafter is not None:
        engine.drafter.model = tracing_batch_model(engine.drafter.model, DRAFT, trace)


def untrace_engine(engine: BatchEngine) -> None:
    """``engine``'s own models back in place."""
    engine.target = _untraced(engine.target)
    if engine.drafter is not None:
        engine.drafter.model = _untraced(engine.drafter.model)


@contextlib.contextmanager
def tracing_one_request(one_request: OneRequestEngine, trace: PassTrace) -> Iterator[None]:
    """Inside the block, whatever engine ``one_request`` decodes on records into ``trace``: the
    one it keeps now, and any it builds in its place (a larger pool or k_max, or after a step's
    error: ``OneRequestEngine.on_build``). Out of it, every one of them has its own models back."""
    traced: list[BatchEngine] = []

    def traced_engine(engine: BatchEngine) -> None:
        trace_engine(engine, trace)
        traced.append(engine)

    if one_request.engine is not None:
        traced_engine(one_request.engine)
    try:
        with one_request.on_build(traced_engine):
            yield
    finally:
        for engine in traced:  # one dropped for a larger one may still be held by a caller
            untrace_engine(engine)
