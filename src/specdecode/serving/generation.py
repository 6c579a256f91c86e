"""One request decoding in the batch, its text deltas handed to the event loop.

Every request is submitted to the ``BatchWorker``, whose batch engine decodes every method; a
thread of its own reads its tokens into text. It has *started* once the batch admits it:
``settled`` is set then, or when it ends first, so that a stream can wait to send its 200 until
its request decodes, and the server's queue-time limit ends only requests that have not
started. However it ends (finished, cancelled, stopped by the server, failed), it counts once in
the server's metrics and wakes its reader.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from specdecode.core.logprobs import TokenLogprob
from specdecode.engine.metrics import GenerationStats
from specdecode.errors import SpecDecodeError
from specdecode.serving.protocol import APIError, ParsedRequest, client_message

if TYPE_CHECKING:
    from specdecode.serving.state import ServerState

# The /metrics outcome of a request the server ended early, by its reason's code (others: "shutdown").
ENDED_BY_STATUS = {"request_timeout": "timeout", "queue_timeout": "queue_timeout"}


T = TypeVar("T")


class Generation:
    """One request decoding in a worker thread; text deltas arrive on an asyncio queue."""

    _DONE = object()

    def __init__(self, state: ServerState, request: ParsedRequest, loop: asyncio.AbstractEventLoop,
                 choice: int = 0) -> None:
        self.state, self.request, self.loop = state, request, loop
        # Choice i of n decodes with seed + i (SamplingParams.for_choice).
        self.choice, self.params = choice, request.params.for_choice(choice)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.stats: GenerationStats | None = None
        self.error: BaseException | None = None
        self.ended_by: APIError | None = None  # why the server ended it early (a timeout, a shutdown)
        self.token_count = 0  # new tokens the request kept (stop strings applied), once it has ended
        self.timer: asyncio.TimerHandle | None = None
        self.queue_timer: asyncio.TimerHandle | None = None  # the queue-time limit (ServerState.limit_queue_time)
        # Set on the event loop once the request has started decoding (``has_started``) or ended.
        self.settled = asyncio.Event()
        self.has_started = False
        self._started_at: float | None = None  # perf_counter time it started, from its own thread or the worker's
        self.batch_id = state.worker.new_request_id()
        self._finished = False
        self._lock = threading.Lock()  # orders stop() against the thread's end
        self._submitted: tuple[Iterator[list[int]], GenerationStats] | None = None
        self._submit_error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def submit(self, fork_of: Generation | None = None) -> None:
        """Queue the request in the batch worker, from the event loop, before ``start``: the
        choices of one request are submitted in order, so that choice 0 is in the engine when
        the others ask to start from its prompt K/V (``fork_of``). A refusal is raised in the
        thread, as the request's own error."""
        req, state = self.request, self.state
        assert isinstance(req.prompt, list)
        source = fork_of.batch_id if fork_of is not None else None
        try:
            self._submitted = state.worker.submit(req.prompt, self.params, state.method_of(req), state.k_of(req),
                                                  request_id=self.batch_id, suffix_group=req.suffix_group,
                                                  cache_salt=req.cache_group, grammar=req.grammar, fork_of=source,
                                                  on_start=self._mark_started)
        except BaseException as err:  # raised in the thread, as an error of the request's own
            self._submit_error = err

    def start(self) -> Generation:
        """Start reading its tokens in a thread, from the event loop (after ``submit``)."""
        self.thread.start()
        return self

    def _mark_started(self) -> None:
        """It has started decoding (from its own thread, or the batch worker's)."""
        if self._started_at is None:
            self._started_at = time.perf_counter()
        self._call(self._on_started)

    def _on_started(self) -> None:
        self.has_started = True
        self.settled.set()

    def _call(self, callback: Any, *args: Any) -> None:
        """Run ``callback`` on the event loop, from any thread."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop has closed (the server exited): nobody reads it
            self.cancelled.set()

    def stop(self, reason: APIError | None = None) -> None:
        """End the generation early, from the event loop: the client left (no ``reason``) or the
        server ended it (``reason`` is what the client is told). The reader wakes at once; the
        request leaves the engine before its next step. A no-op once decoding has finished."""
        with self._lock:
            if self._finished or self.cancelled.is_set():
                return
            self.ended_by = reason
            self.cancelled.set()
        self.state.worker.abort(self.batch_id)  # also when it is still queued and emits nothing
        self._ended()

    def _ended(self) -> None:
        self.queue.put_nowait(self._DONE)
        self.settled.set()

    def _put(self, item: Any) -> None:
        self._call(self.queue.put_nowait, item)

    def _run(self) -> None:
        metrics = self.state.metrics
        status = "error"
        try:
            status = self._decode()
        except BaseException as err:  # reported to the client; the server goes on
            self.error = err
        finally:
            with self._lock:
                self._finished = True
                if self.ended_by is not None:
                    status = ENDED_BY_STATUS.get(self.ended_by.code or "", "shutdown")
                elif self.cancelled.is_set() and self.error is None:
                    status = "cancelled"
            if self.stats is not None:
                metrics.record(self.stats, status)
            else:
                metrics.count("rejected" if isinstance(self.error, SpecDecodeError) else status)
            if status == "ok" and self._started_at is not None:
                metrics.observe_seat(time.perf_counter() - self._started_at)
            self._call(self._ended)

    def _decode(self) -> str:
        if self.cancelled.is_set():  # the client left while waiting
            return "cancelled"
        if self._submit_error is not None:
            raise self._submit_error
        assert self._submitted is not None, "a generation is submitted before it starts"
        chunks, stats = self._submitted
        stream = self.state.decoder.token_stream(chunks, stats, self.params)
        self.stats = stream.stats
        deltas = iter(stream)
        try:
            for delta in deltas:
                if self.cancelled.is_set():
                    return "cancelled"
                self._put((delta, stream.token_count))
        finally:
            deltas.close()  # ends the engine's loop (and its timing) if we left early
            self.token_count = stream.token_count
        return "cancelled" if self.cancelled.is_set() else "ok"

    async def deltas(self) -> AsyncIterator[str]:
        async for text, _ in self.chunks():
            yield text

    async def chunks(self) -> AsyncIterator[tuple[str, int]]:
        """Text deltas, each with the number of new tokens taken by then (for their logprobs)."""
        while True:
            item = await self.queue.get()
            if item is self._DONE:
                return
            yield item

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """The new tokens' logprobs (the request asked for them), cut where the text was cut."""
        recorded = self.stats.token_logprobs if self.stats is not None else None
        return None if recorded is None else recorded[: self.token_count]

    def failure(self) -> APIError | None:
        """What to tell the client when the generation did not finish normally, else None."""
        if self.ended_by is not None:
            return self.ended_by
        err = self.error
        if err is None:
            return None
        if isinstance(err, SpecDecodeError):
            return APIError(400, client_message(err))
        return APIError(500, f"The server failed on this request: {type(err).__name__}: {err}", kind="server_error")


async def unless_disconnected(work: Coroutine[Any, Any, T], request: Any) -> T | None:
    """``work``'s result, or None when the client disconnects first (``work`` is cancelled): a
    route waiting for a generation stops waiting for a client that left."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collect = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, watch):
            task.cancel()
    return collect.result() if collect.done() and not collect.cancelled() else None
