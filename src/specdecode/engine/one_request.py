"""One request at a time on the batch engine: ``generate`` and ``stream`` (``engine="auto"``, the default).

A batch of one, as nano-vllm's ``generate`` is a loop over ``step``: the request joins a batch
engine with one seat, and the engine steps until it ends, each step's new tokens handed on as
they come. The engine is built on first use and kept, so that its prefix cache carries a chat's
turns and its pass costs are timed once (the one-sequence passes come from the target's cost
store: ``costs/decoder_costs.batch_pass_costs``); ``forget_prefix`` drops only its pools' cached
prefixes. A request that needs more KV slots than the engine's pool holds gets a larger engine
in its place (the old one, its pool and its cached prefixes dropped first), and so does one
whose draft length the engine's ``k_max`` does not hold (``k_max_for``). Issue 45: the step
towards one engine that owns the decode loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from specdecode.backends.openmp import release_thread_team
from specdecode.config import SamplingParams
from specdecode.core import registry
from specdecode.costs.k_policy import FixedK
from specdecode.engine.batch import BatchEngine
from specdecode.engine.batch_rows import row_schedule
from specdecode.engine.grammar import CompiledGrammar
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.stream import StepTokens
from specdecode.errors import InvalidRequestError

# The smallest pool the engine is built with, in tokens (a pool of 4096 holds most chats' turns
# without a rebuild: 112 MiB of the demo target's KV); larger requests round up to a power of 2.
MIN_POOL_TOKENS = 4096
# KV slots a step may take past a request's last token: drafts (a chain of up to 32 with auto's
# suffix source) or a token tree (up to MAX_TREE_SIZE nodes); a fixed k deeper takes k + 1.
STEP_SLOTS = 288

# Builds a batch engine of one seat whose pool holds this many tokens (the first argument) and
# whose requests draft at most this many tokens a step (the second, its k_max).
EngineFactory = Callable[[int, int], BatchEngine]


def pool_tokens(needed: int) -> int:
    """The pool size for a request that needs ``needed`` slots: a power of two, at least MIN_POOL_TOKENS."""
    tokens = MIN_POOL_TOKENS
    while tokens < needed:
        tokens *= 2
    return tokens


class OneRequestEngine:
    """A batch engine of one seat, kept between requests (the module docstring)."""

    def __init__(self, build: EngineFactory, k_max: int) -> None:
        """``k_max``: the decoder's, the engine's for every request but a fixed k past it."""
        self._build = build
        self.k_max = k_max
        self._engine: BatchEngine | None = None
        self._pool_tokens = 0
        # One request decodes at a time: a second stream (another thread's, or one opened before
        # the first ended) would step the same engine and pools. It is refused, not queued: a
        # stream open in the same thread could never end while this one waits for it.
        self._busy = threading.Lock()
        self._build_hooks: list[Callable[[BatchEngine], None]] = []  # ``on_build``

    @property
    def engine(self) -> BatchEngine | None:
        """The engine now kept (None before the first request and after a step's error)."""
        return self._engine

    def k_max_for(self, method: str, k: int | None, k_policy: str | None) -> tuple[int, bool]:
        """(the engine ``k_max`` a request decodes under, whether a larger one would do).

        A row whose schedule is its own fixed k (``batch_rows.row_schedule``: the chain and tree
        methods under ``fixed``) drafts that k every step and reads nothing else of ``k_max``
        (the batch's choice passes it by: ``batch_proposals.choose_sources``), so any engine
        whose ``k_max`` holds its k will do: ``max(k, k_max)``. Plain rows read none of it.
        Every other row (a policy's, auto's) is bounded by ``k_max`` itself, in the batch's
        choice of k and in its own schedule, and must get the decoder's to decode as it would
        on an engine built for it alone."""
        if method == registry.NONE.name:
            return self.k_max, True
        if (k is not None and k_policy == "fixed"
                and isinstance(row_schedule(method, k_policy, k, self.k_max), FixedK)):
            return max(k, self.k_max), True
        return self.k_max, False

    def engine_for(self, needed: int, k_max: int | None = None, larger_k_max: bool = False) -> BatchEngine:
        """The kept engine, or a new one where it does not fit: one whose pool holds ``needed``
        slots, with ``k_max`` (None: the decoder's), or any larger where ``larger_k_max``."""
        k_max = self.k_max if k_max is None else k_max
        engine = self._engine
        if (engine is None or needed > self._pool_tokens
                or engine.k_max < k_max or (engine.k_max > k_max and not larger_k_max)):
            self._engine = engine = None  # its pools go before the new ones are allocated
            # Never smaller than the last pool: a request between two large ones would otherwise
            # shrink it and the next rebuild it again.
            tokens = pool_tokens(max(needed, self._pool_tokens))
            self._engine, self._pool_tokens = self._build(tokens, k_max), tokens
            for hook in self._build_hooks:
                hook(self._engine)
        return self._engine

    @contextmanager
    def on_build(self, hook: Callable[[BatchEngine], None]) -> Iterator[None]:
        """Inside the block, ``hook`` sees every engine built here (a larger pool or k_max, or
        one after a step's error) before it decodes (``engine/batch_trace.tracing_one_request``)."""
        self._build_hooks.append(hook)
        try:
            yield
        finally:
            self._build_hooks.remove(hook)

    def forget_prefix(self) -> None:
        """Drop the prefixes the engine's pools cache (the target's and the draft model's): the
        next request prefills its whole prompt, on the same engine (its pass costs and pools
        kept, which rebuilding it would read, time and allocate again). Refused while a request
        decodes: its pools would change under the step (as a second stream is refused)."""
        if not self._busy.acquire(blocking=False):
            raise InvalidRequestError("forget_prefix cannot run while a request decodes: finish or close its stream "
                                      "first.")
        try:
            if self._engine is not None:
                self._engine.target_cache.drop_cached_prefixes()
                if self._engine.drafter is not None:
                    self._engine.drafter.cache.drop_cached_prefixes()
        finally:
            self._busy.release()

    def decode(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        method: str,
        k: int | None,
        k_policy: str | None,
        stats: GenerationStats,
        suffix_group: str | None,
        cache_salt: str | None,
        grammar: CompiledGrammar | None,
        acceptance: str = "lossless",
    ) -> Iterator[list[int]]:
        """Yield the tokens each step commits, ``stats`` filled as the engine goes. Closing the
        iterator early (a stop string, a client gone) aborts the request between steps.
        ``acceptance``: the request's acceptance rule (``BatchEngine.add_request``)."""
        if not self._busy.acquire(blocking=False):
            raise InvalidRequestError("This decoder is already decoding a request: generate and stream take one at a "
                                      "time (finish or close the other stream first); for many at once use "
                                      "generate_batch, or a BatchWorker over batch_engine() as the server does.")
        engine: BatchEngine | None = None
        request_id: str | None = None
        finished = False
        try:
            k_max, larger_k_max = self.k_max_for(method, k, k_policy)
            # A policy's k is only its first guess: capped, as the engine's k_max caps its rows.
            k = None if k is None else min(k, k_max)
            needed = len(prompt_ids) + params.max_new_tokens + max(STEP_SLOTS, k_max + 1)
            engine = self.engine_for(needed, k_max, larger_k_max)
            request_id = engine.add_request(prompt_ids, params, method, k, stats=stats, suffix_group=suffix_group,
                                            cache_salt=cache_salt, grammar=grammar, k_policy=k_policy,
                                            acceptance=acceptance)
            while not finished:
                try:
                    outputs = engine.step()
                except Exception:
                    # An error no single request causes: the engine's state is unknown.
                    self._engine, finished = None, True
                    raise
                for output in outputs:
                    if output.request_id != request_id:  # none but this one: the engine has one seat
                        continue
                    finished = output.finished
                    if output.error is not None:
                        raise output.error
                    if output.new_tokens:
                        yield StepTokens(output.new_tokens, output.drafted)
        finally:
            if request_id is not None and not finished and self._engine is engine:
                engine.abort(request_id)
            # This thread stops decoding: its OpenMP team goes (backends/openmp.py), as after a
            # single-engine request, so that another thread's passes keep full speed.
            release_thread_team()
            self._busy.release()
