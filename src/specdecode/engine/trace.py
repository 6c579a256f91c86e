"""Pass traces: every call a request makes on its models' sequences, to price or replay it.

A decode's cost is its passes: how many rows each target and draft pass scored, at which
positions, and what each commit kept. ``TracingSequence`` wraps a ``SequenceModel``
(``backends/base.py``) and writes each ``begin``/``extend``/``commit`` (and a tree's
``extend_tree``/``keep_path``) into a ``PassTrace`` before passing the call on; the wrapped
sequence does the work, so the decode is the one it would have been. ``SpecDecoder.trace_passes``
puts the wrappers in place for a block of requests.

A trace holds shapes only, no tokens and no timings: replayed on another device with random
weights of the same shapes (``bench/replay.py``), it makes exactly the passes the traced run
made there, the recorded acceptance forced by the recorded commits; priced with a table of
measured pass costs (``bench/oracle.py``) it says what the same schedule costs on this machine.
Cost probes (``pass_seconds``) are not traced: a scratch sequence, not the request's.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from specdecode.backends.base import PassOutput, SequenceModel
    from specdecode.core.tree import TokenTree

TRACE_SCHEMA = 1
TARGET, DRAFT = "target", "draft"
ROLES = (TARGET, DRAFT)
# Operations, with what their integer arguments are:
BEGIN = "begin"  # (capacity, keep)
EXTEND = "extend"  # (start, rows, logit_rows): logit_rows 0 is a pass without logits (a prefill)
COMMIT = "commit"  # (length,)
# (start, nodes, parent of node 1, ..., parent of node N - 1): a token tree scored in one pass,
# logits for every node (its shape, so that a replay scores the same tree-attention mask)
TREE = "tree"
KEEP = "keep"  # (start, node, node, ...): the accepted path (root first) of the tree scored at start
OPS = (BEGIN, EXTEND, COMMIT, TREE, KEEP)


@dataclass(frozen=True, slots=True)
class PassEvent:
    role: str  # TARGET or DRAFT
    op: str  # one of OPS
    args: tuple[int, ...]  # the op's integers, as OPS lists them

    def to_json(self) -> list[Any]:
        return [self.role, self.op, *self.args]

    @classmethod
    def from_json(cls, item: Sequence[Any]) -> PassEvent:
        role, op, *args = item
        if role not in ROLES or op not in OPS:
            raise ValueError(f"not a pass event: {item!r}")
        return cls(str(role), str(op), tuple(int(a) for a in args))

    @property
    def is_pass(self) -> bool:
        """Whether the event ran the model (a pass), not only moved the cache's valid length."""
        return self.op in (EXTEND, TREE)

    @property
    def rows(self) -> int:
        """Rows a pass scored (0 for the cache operations)."""
        if self.op == EXTEND:
            return self.args[1]
        return self.args[1] if self.op == TREE else 0


@dataclass(slots=True)
class PassTrace:
    """One request's (or a block of requests') events in order, and what it was."""

    events: list[PassEvent] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # method, prompt id, tokens: for people, not replay

    def passes(self, role: str | None = None) -> Iterator[PassEvent]:
        return (e for e in self.events if e.is_pass and (role is None or e.role == role))

    def pass_shapes(self) -> Counter[tuple[str, str, int, int]]:
        """(role, op, rows, logit rows) -> how many passes of that shape: what a replay must match."""
        return Counter((e.role, e.op, e.rows, e.args[2] if e.op == EXTEND else e.rows) for e in self.passes())

    def to_json(self) -> dict[str, Any]:
        return {"schema": TRACE_SCHEMA, "meta": self.meta, "events": [e.to_json() for e in self.events]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PassTrace:
        if data.get("schema") != TRACE_SCHEMA:
            raise ValueError(f"pass trace schema {data.get('schema')!r}; this version reads {TRACE_SCHEMA}")
        return cls([PassEvent.from_json(item) for item in data["events"]], dict(data.get("meta", {})))


def save_traces(traces: Sequence[PassTrace], path: Path, header: dict[str, Any] | None = None) -> None:
    """Write traces as one JSON file: a header (the models' shapes, the machine) and the traces."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"schema": TRACE_SCHEMA, "header": header or {}, "traces": [t.to_json() for t in traces]}
    path.write_text(json.dumps(payload, separators=(",", ":")) + "\n")


def load_traces(path: Path) -> tuple[dict[str, Any], list[PassTrace]]:
    """(header, traces) of a file ``save_traces`` wrote."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != TRACE_SCHEMA:
        raise ValueError(f"{path}: pass trace schema {data.get('schema')!r}; this version reads {TRACE_SCHEMA}")
    return dict(data.get("header", {})), [PassTrace.from_json(t) for t in data["traces"]]


class TracingSequence:
    """A ``SequenceModel`` that records its calls into ``trace`` as ``role`` and passes them on.

    Everything else (``epoch``, ``device``, ``pass_seconds``, ...) is the wrapped sequence's, so
    the engine and the drafters see the same sequence they would without the trace.
    """

    def __init__(self, inner: SequenceModel, role: str, trace: PassTrace) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.inner = inner
        self.role = role
        self.trace = trace

    def __getattr__(self, name: str) -> Any:  # backend, supports_trees, epoch, device, vocab_size, pass_seconds
        return getattr(self.inner, name)

    def _record(self, op: str, *args: int) -> None:
        self.trace.events.append(PassEvent(self.role, op, tuple(int(a) for a in args)))

    def begin(self, capacity: int, keep: int = 0) -> None:
        self._record(BEGIN, capacity, keep)
        self.inner.begin(capacity, keep=keep)

    def extend(
        self,
        tokens: torch.Tensor,  # (1, T) long
        start: int,
        *,
        logits_last: int | None = None,
        compute_logits: bool = True,
    ) -> PassOutput:
        rows = tokens.shape[1]
        logit_rows = 0 if not compute_logits else (rows if logits_last is None else min(logits_last, rows))
        self._record(EXTEND, start, rows, logit_rows)
        return self.inner.extend(tokens, start, logits_last=logits_last, compute_logits=compute_logits)

    def commit(self, length: int) -> None:
        self._record(COMMIT, length)
        self.inner.commit(length)

    def extend_tree(self, tree: TokenTree, start: int) -> PassOutput:
        self._record(TREE, start, tree.size, *tree.parents[1:])
        return self.inner.extend_tree(tree, start)

    def keep_path(self, start: int, path: Sequence[int]) -> None:
        self._record(KEEP, start, *path)
        self.inner.keep_path(start, path)
