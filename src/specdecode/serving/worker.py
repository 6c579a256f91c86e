"""A ``BatchEngine`` stepping in a background thread, fed by any number of caller threads.

``submit`` queues a request and returns an iterator over its committed token chunks (and the
``GenerationStats`` the engine fills). The worker thread alone touches the engine: between two
steps it takes new requests and cancellations from its inbox, then runs one step for the whole
batch and hands each request its new tokens. Closing a request's iterator early (a stop string,
a client that went away) cancels the request, which frees its KV blocks before the next step
(the close returns once the request has left the engine, so that its stats are final); so does
``abort`` from any thread (a client that left before any token, a timeout), which also ends
the request's iterator. A step that fails because of one request fails that request only
(the engine reruns the step without it); a failure no single request causes fails every request
in flight and empties the pools. Either way the worker keeps serving new requests.

For the server's backpressure, any thread may read ``waiting`` (requests queued beyond the
batch's free seats) without touching the engine, and ``submit``'s ``on_start`` hears when a
request first leaves the engine's waiting queue for the batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from specdecode.backends.openmp import release_thread_team
from specdecode.config import SamplingParams
from specdecode.drafters.suffix_cache import DEFAULT_GROUP
from specdecode.engine.batch import BatchEngine, RequestOutput
from specdecode.engine.grammar import CompiledGrammar
from specdecode.engine.metrics import GenerationStats

IDLE_WAIT_SECONDS = 0.5  # how long an idle worker sleeps on its inbox before checking for shutdown
# When work arrives at an idle worker, wait up to this long for requests sent at the same moment,
# so they start in one batch instead of the first running a step alone (its prefill, and a draft
# step priced for a batch of one) while the others queue. With ``arriving`` (the server's count of
# requests it is still reading and tokenizing) the wait ends as soon as none is on its way, so a
# lone request does not pay it; without, the whole window is waited.
DEFAULT_BATCH_WINDOW_SECONDS = 0.05
ARRIVAL_POLL_SECONDS = 0.002  # how often the batch window checks whether requests are still on their way
RECENT_STEPS = 1024  # steps whose (start, end) times the worker keeps (``recent_steps``)
# How long a caller that closes its iterator early waits for the worker to take its request out
# of the engine (one step, normally): until then the worker's steps still write the request's stats.
ABORT_WAIT_SECONDS = 5.0


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str
    k: int | None
    stats: GenerationStats
    outbox: queue.Queue[RequestOutput | BaseException]
    suffix_group: str | None = DEFAULT_GROUP
    cache_salt: str | None = None
    grammar: CompiledGrammar | None = None
    fork_of: str | None = None
    arrived: float = 0.0  # perf_counter time of submit: the engine's clock for it starts here
    on_start: Callable[[], None] | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


class BatchWorker:
    def __init__(self, engine: BatchEngine, batch_window: float = DEFAULT_BATCH_WINDOW_SECONDS,
                 arriving: Callable[[], int] | None = None) -> None:
        self.engine = engine
        self.batch_window = batch_window
        # Requests on their way to ``submit`` (read, not yet tokenized), from any thread; None:
        # unknown, so the batch window is waited whole. The server sets it (ServerState).
        self.arriving = arriving
        self._inbox: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._outboxes: dict[str, queue.Queue[RequestOutput | BaseException]] = {}
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._stopped = threading.Event()
        # Steps that failed as a whole (no single request to blame), since the last good one:
        # a count that keeps growing says the engine itself is broken (serving/health.py).
        self.failed_steps_in_a_row = 0
        # (start, end) perf_counter times of the latest steps: how long a step of the running
        # batch takes, which bounds a new request's wait (docs/design.md#fair-scheduling).
        self.recent_steps: deque[tuple[float, float]] = deque(maxlen=RECENT_STEPS)
        self.max_batch = engine.scheduler.max_batch  # fixed configuration, read by any thread
        # What ``waiting`` reads, under ``_count_lock``: requests in the inbox not yet taken, and
        # the engine's waiting and running counts as of the worker's last look (it looks after
        # taking commands and after each step). Copies, so that no other thread reads the engine.
        self._count_lock = threading.Lock()
        self._in_inbox = 0
        self._engine_waiting = 0
        self._engine_running = 0
        # Requests not yet admitted to the batch, with what to call when they are (worker thread only).
        self._unstarted: dict[str, Callable[[], None]] = {}
        self._thread = threading.Thread(target=self._loop, name="specdecode-batch", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests queued for the batch beyond its free seats, from any thread: those submitted
        and not yet taken by the worker, plus those in the engine's waiting queue (preempted ones
        included), less the seats the batch has free (those start at the next step)."""
        with self._count_lock:
            queued = self._in_inbox + self._engine_waiting
            free = self.max_batch - self._engine_running
        return max(0, queued - max(0, free))

    def _recount(self) -> None:
        with self._count_lock:
            self._engine_waiting, self._engine_running = self.engine.num_waiting, self.engine.num_running

    def new_request_id(self) -> str:
        with self._id_lock:
            self._next_id += 1
            return f"batch-{self._next_id - 1}"

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, method: str, k: int | None = None,
        request_id: str | None = None, suffix_group: str | None = DEFAULT_GROUP, cache_salt: str | None = None,
        grammar: CompiledGrammar | None = None, fork_of: str | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> tuple[Iterator[list[int]], GenerationStats]:
        """Queue a request (validated now: InvalidRequestError is raised here, not later).
        ``request_id`` (from ``new_request_id``) lets the caller ``abort`` it later;
        ``suffix_group`` is whose earlier responses method suffix drafts from; ``cache_salt``
        whose cached prompt prefixes it reuses; ``grammar`` its compiled structured output;
        ``fork_of`` the id of a request submitted before it, from this thread, with the same
        prompt (another sample of it: ``BatchEngine.add_request``). ``on_start`` is called, on
        the worker's thread, when the request first leaves the engine's waiting queue for the
        batch, before its first tokens go out; not when it ends or fails before that."""
        self.engine.check_request(len(prompt_ids), params, method, k)
        request_id = request_id or self.new_request_id()
        stats = GenerationStats(method=method, prompt_tokens=len(prompt_ids))
        outbox: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        with self._count_lock:
            self._in_inbox += 1
        self._inbox.put(_Add(request_id, list(prompt_ids), params, method, k, stats, outbox, suffix_group, cache_salt,
                              grammar, fork_of, time.perf_counter(), on_start))
        return self._chunks(request_id, outbox), stats

    def _chunks(self, request_id: str, outbox: queue.Queue[RequestOutput | BaseException]) -> Iterator[list[int]]:
        finished = False
        try:
            while True:
                item = outbox.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise item.error
                if item.new_tokens:
                    yield item.new_tokens
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))
                self._await_end(outbox)

    def _await_end(self, outbox: queue.Queue[RequestOutput | BaseException]) -> None:
        """Wait until the request's last output (or an error) arrives: then the engine no longer
        holds it and nothing writes its stats, so a reason the caller sets after closing (a stop
        string) is the one that stays. At most ``ABORT_WAIT_SECONDS``."""
        if threading.current_thread() is self._thread:
            return  # an iterator collected on the worker's own thread: it cannot wait for itself
        deadline = time.perf_counter() + ABORT_WAIT_SECONDS
        while self.alive:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            try:
                item = outbox.get(timeout=min(left, IDLE_WAIT_SECONDS))
            except queue.Empty:
                continue
            if isinstance(item, BaseException) or item.finished or item.error is not None:
                return

    @property
    def alive(self) -> bool:
        """Whether the stepping thread still runs (False after ``close`` or if it died)."""
        return self._thread.is_alive()

    def abort(self, request_id: str) -> None:
        """Cancel a request from any thread: it leaves the batch before the next step, and its
        iterator ends (stats.stop_reason "cancelled"). A no-op for a finished request."""
        self._inbox.put(_Abort(request_id))

    def close(self) -> None:
        """Stop the worker after its current step (requests in flight are cancelled)."""
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout=60)

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._inbox.get(timeout=IDLE_WAIT_SECONDS) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Add):
                self._outboxes[command.request_id] = command.outbox
                try:
                    self.engine.add_request(
                        command.prompt_ids, command.params, command.method, command.k,
                        request_id=command.request_id, stats=command.stats, suffix_group=command.suffix_group,
                        cache_salt=command.cache_salt, grammar=command.grammar, fork_of=command.fork_of,
                        arrived=command.arrived,
                    )
                    if command.on_start is not None:
                        self._unstarted[command.request_id] = command.on_start
                except Exception as err:  # refused (e.g. no room): tell that caller only
                    self._outboxes.pop(command.request_id).put(err)
                finally:
                    with self._count_lock:  # out of the inbox, and into the engine's queue (or refused)
                        self._in_inbox -= 1
                        self._engine_waiting = self.engine.num_waiting
            elif isinstance(command, _Abort):
                self._unstarted.pop(command.request_id, None)
                output = self.engine.abort(command.request_id)
                outbox = self._outboxes.pop(command.request_id, None)
                if output is not None and outbox is not None:
                    outbox.put(output)  # wakes a reader still waiting (an abort from another thread)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                self._recount()
                return

    def _wait_for_arrivals(self) -> None:
        """The batch window: up to ``batch_window`` seconds, ended early once no request is on
        its way (where ``arriving`` says)."""
        arriving = self.arriving
        if arriving is None:
            self._stopped.wait(self.batch_window)
            return
        deadline = time.perf_counter() + self.batch_window
        while arriving() > 0 and not self._stopped.is_set():
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._stopped.wait(min(ARRIVAL_POLL_SECONDS, left))

    def _announce_starts(self, outputs: list[RequestOutput]) -> None:
        """Call ``on_start`` for the requests that left the engine's waiting queue in the step
        just run (admitted to the batch; or admitted and already finished), but not for one
        that failed in it. Before the step's outputs go out, so that a request is known to have
        started before its first tokens are."""
        if not self._unstarted:
            return
        failed = {output.request_id for output in outputs if output.error is not None}
        # The worker's own thread: the only one that reads the engine's queue.
        waiting = {seq.state.request_id for seq in self.engine.scheduler.waiting}
        for request_id in [r for r in self._unstarted if r not in waiting]:
            on_start = self._unstarted.pop(request_id)
            if request_id in failed:
                continue
            try:
                on_start()
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the batch for everyone
                continue

    def _loop(self) -> None:
        while not self._stopped.is_set():
            idle = not self.engine.has_unfinished
            self._take_commands(block=idle)
            if not self.engine.has_unfinished:
                continue
            if idle and self.batch_window > 0:
                self._wait_for_arrivals()
                self._take_commands(block=False)
            try:
                started = time.perf_counter()
                outputs = self.engine.step()
                self.recent_steps.append((started, time.perf_counter()))
                self.failed_steps_in_a_row = 0
            except Exception as err:  # one bad step must not take the server down
                self.failed_steps_in_a_row += 1
                outputs = self.engine.abort_all(err)
                self._unstarted.clear()  # they failed before starting: nothing to announce
            else:
                self._announce_starts(outputs)
            self._recount()
            for output in outputs:
                outbox = self._outboxes.get(output.request_id)
                if outbox is None:
                    continue
                if output.finished:
                    del self._outboxes[output.request_id]
                outbox.put(output)
            if not self.engine.has_unfinished:
                # Idle now: free this thread's OpenMP helpers, which would slow the passes of a
                # request decoding on another thread meanwhile (backends/openmp.py).
                release_thread_team()
        for request_id in list(self._outboxes):
            self.engine.abort(request_id)
            self._outboxes.pop(request_id).put(RuntimeError("The batch worker stopped."))
