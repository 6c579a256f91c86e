"""What ``specdecode audit`` and ``bench --oracle`` read beside decoding: the target's logits in
the shapes a verify pass scores them (``engine/probe.py``), a chain drafter's distribution q,
and traces of every pass a decode makes (``engine/trace.py``). ``SpecDecoder`` has these methods
from ``DecoderProbes``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from specdecode.backends.openmp import releases_thread_team
from specdecode.config import TREE_METHODS, SamplingParams
from specdecode.core.sampling import LogitsProcessor, make_generator
from specdecode.drafters.base import Drafter, TreeDrafter
from specdecode.drafters.planner import DecoderResources
from specdecode.engine.batch_trace import tracing_one_request
from specdecode.engine.probe import continuation_logits, logits_in_passes, next_draft_probs
from specdecode.engine.single import SpecEngine
from specdecode.engine.trace import DRAFT, TARGET, PassTrace, TracingSequence
from specdecode.errors import InvalidRequestError

if TYPE_CHECKING:
    from specdecode.engine.one_request import OneRequestEngine


class DecoderProbes:
    """``SpecDecoder``'s probes of its models (the module docstring); but for ``trace_passes``
    they run on the single-request engine's sequences, and drop its prefix record after."""

    if TYPE_CHECKING:
        engine: SpecEngine
        resources: DecoderResources
        drafters: dict[str, Drafter | TreeDrafter]
        one_request: OneRequestEngine

    @contextlib.contextmanager
    def trace_passes(self) -> Iterator[PassTrace]:
        """Record every pass ``generate`` and ``stream`` make inside the block on the target's and
        the draft model's sequences (``engine/trace.py``): a trace to price with a cost table or
        replay on another device. On the batch engine holding one request (the default) its
        one-row batch models are traced (``engine/batch_trace.py``): the trace says what that
        engine runs, a torch prompt's prefill pass and the draft model's read-ahead included; on
        the single-request engine (``engine="single"``, a compiled decoder) its sequences are.
        Layer skip's passes run inside the target's model and are not recorded."""
        trace = PassTrace()
        target = self.engine.target
        draft = self.resources.draft_model
        draft_sequence = draft.model if draft is not None else None
        self.engine.target = TracingSequence(target, TARGET, trace)  # type: ignore[assignment]  # a SequenceModel
        if draft is not None:
            draft.model = TracingSequence(draft_sequence, DRAFT, trace)  # type: ignore[arg-type, assignment]
        try:
            with tracing_one_request(self.one_request, trace):
                yield trace
        finally:
            self.engine.target = target
            if draft is not None:
                draft.model = draft_sequence  # type: ignore[assignment]

    @releases_thread_team
    def target_logits_in_passes(self, tokens: Sequence[int], shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """The target's next-token logits after ``tokens``, one (V,) float32 row per ``(rows, row)``
        shape: computed as row ``row`` of a pass over ``rows`` rows (``engine/probe.py:
        logits_in_passes``). The audit reads a difference in every shape a verify pass may have
        scored it in."""
        try:
            return logits_in_passes(self.engine.target, list(tokens), shapes)
        finally:
            self.engine.forget_prefix()

    @releases_thread_team
    def target_logits(
        self, prompt_ids: Sequence[int], continuations: Sequence[Sequence[int]] = ((),),
        rows_per_pass: int | None = None,
    ) -> torch.Tensor:  # (len(continuations), V) float32
        """The target's next-token logits after ``prompt_ids + continuation``, one row per
        continuation, teacher-forced (the prompt prefilled once; each continuation in one pass,
        or in passes of ``rows_per_pass`` rows). What decoding should agree with: ``specdecode
        audit`` checks methods against it."""
        try:
            return continuation_logits(self.engine.target, list(prompt_ids), continuations, rows_per_pass)
        finally:
            self.engine.forget_prefix()  # the sequence now holds these tokens, not the last request's

    @releases_thread_team
    def draft_probs(self, token_ids: Sequence[int], method: str, params: SamplingParams) -> torch.Tensor | None:  # (V,)
        """The drafter of ``method`` (ngram, draft or layerskip: a chain drafter that keeps no
        state between requests) for the token after ``token_ids``, under ``params``' sampling: its
        distribution q, a one-hot for a deterministic drafter, or None where it proposes nothing."""
        drafter = self.drafters.get(method)
        if drafter is None or method in TREE_METHODS:
            raise InvalidRequestError(f"draft_probs: method {method!r} has no stateless chain drafter in this decoder "
                                      f"(have: {', '.join(m for m in self.drafters if m not in TREE_METHODS)}).")
        generator = make_generator(params.seed if params.seed is not None else 0, self.engine.target.device)
        try:
            return next_draft_probs(self.engine.target, drafter, list(token_ids), LogitsProcessor.from_params(params),
                                    generator)  # type: ignore[arg-type]  # a chain drafter here
        finally:
            self.engine.forget_prefix()
