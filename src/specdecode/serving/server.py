"""``specdecode serve``: an OpenAI-compatible HTTP server over one ``SpecDecoder``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``
as server-sent events), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus
text format).

Requests with methods ``none``, ``ngram`` and ``draft`` are decoded together by a
continuous-batching engine (``engine/batch.py``) stepping in one worker thread
(``serving/worker.py``): they join and leave the batch between steps, share each target pass,
and hold paged KV blocks only while they run. The other methods (``auto``, ``layerskip``,
``medusa``, ``eagle``) keep the single-sequence engine and run one at a time, first come
first served, beside the batch. A client that disconnects (streaming or not) cancels its
request, which frees its blocks before the next step.

Before a request reaches the application, ``serving/guard.py`` checks its Host, API key,
Content-Type and body size. Its body is then parsed and tokenized in a thread, so a large prompt
never stalls the event loop (``/health``, other streams). Bad input gets a 4xx with an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` (``serving/protocol.py``);
an unexpected failure inside one request gets a 500 with the same shape, and the server keeps
serving. A request past ``request_timeout`` seconds is stopped with a 504 (or a final error
event). On SIGTERM or SIGINT the server drains (``serving/shutdown.py``).

Extension fields a request may carry besides OpenAI's: ``top_k`` (int), ``method`` (one of
the loaded decoder's methods) and ``k`` (tokens drafted per step). Each response carries the
request's decoding metrics under ``specdecode``. Method ``suffix`` drafts from earlier
responses of the same tenant only, by default (``serving/suffix_share.py``).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoint signatures
# (``request: Request``, imported inside ``create_app``) at definition time.
import asyncio
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode.api import SpecDecoder
from specdecode.config import METHODS
from specdecode.engine.batch import BATCH_METHODS
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.stream import GenerationStream
from specdecode.errors import SpecDecodeError
from specdecode.serving.guard import GuardOptions, RequestGuard
from specdecode.serving.metrics import ServerMetrics
from specdecode.serving.protocol import APIError, ParsedRequest, parse_request
from specdecode.serving.suffix_share import DEFAULT_SUFFIX_SHARE, suffix_group
from specdecode.serving.worker import BatchWorker

__all__ = ["APIError", "ServerOptions", "create_app", "parse_request", "serve"]

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length"}
DEFAULT_DRAIN_TIMEOUT = 10.0
LOCK_POLL_SECONDS = 0.1  # how often a request queued for the single-sequence engine checks it was cancelled


@dataclass(slots=True, frozen=True)
class ServerOptions:
    guard: GuardOptions = field(default_factory=GuardOptions)
    request_timeout: float | None = None  # seconds from admission; None: no limit
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT  # seconds in-flight requests get to finish on shutdown
    suffix_share: str = DEFAULT_SUFFIX_SHARE  # whose earlier responses suffix decoding reads: tenant, global, none


class Generation:
    """One request decoding in a worker thread; text deltas arrive on an asyncio queue."""

    _DONE = object()

    def __init__(self, state: "ServerState", request: ParsedRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.state, self.request, self.loop = state, request, loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.stats: GenerationStats | None = None
        self.error: BaseException | None = None
        self.ended_by: APIError | None = None  # why the server ended it early (a timeout, a shutdown)
        self.timer: asyncio.TimerHandle | None = None
        self.batch_id = state.worker.new_request_id() if state.worker is not None and state.batched(request) else None
        self._finished = False
        self._lock = threading.Lock()  # orders stop() against the thread's end
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Generation":
        self.thread.start()
        return self

    def stop(self, reason: APIError | None = None) -> None:
        """End the generation early, from the event loop: the client left (no ``reason``) or the
        server ended it (``reason`` is what the client is told). The reader wakes at once; the
        request leaves the engine before its next step. A no-op once decoding has finished."""
        with self._lock:
            if self._finished or self.cancelled.is_set():
                return
            self.ended_by = reason
            self.cancelled.set()
        if self.batch_id is not None and self.state.worker is not None:
            self.state.worker.abort(self.batch_id)  # also when it is still queued and emits nothing
        self.queue.put_nowait(self._DONE)

    def _put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _run(self) -> None:
        metrics = self.state.metrics
        status = "error"
        try:
            if self.state.batched(self.request):
                status = self._decode()
                return
            with metrics.lock:
                metrics.waiting += 1
            try:
                while not self.state.engine_lock.acquire(timeout=LOCK_POLL_SECONDS):
                    if self.cancelled.is_set():
                        status = "cancelled"
                        return
            finally:
                with metrics.lock:
                    metrics.waiting -= 1
            try:
                with metrics.lock:
                    metrics.running += 1
                status = self._decode()
            finally:
                self.state.engine_lock.release()
                with metrics.lock:
                    metrics.running -= 1
                    metrics.kv_tokens = 0
        except BaseException as err:  # reported to the client; the server goes on
            self.error = err
        finally:
            with self._lock:
                self._finished = True
                if self.ended_by is not None:
                    status = "timeout" if self.ended_by.code == "request_timeout" else "shutdown"
                elif self.cancelled.is_set() and self.error is None:
                    status = "cancelled"
            if self.stats is not None:
                metrics.record(self.stats, status)
            else:
                metrics.count("rejected" if isinstance(self.error, SpecDecodeError) else status)
            self._put(self._DONE)

    def _decode(self) -> str:
        if self.cancelled.is_set():  # the client left while waiting
            return "cancelled"
        req, state = self.request, self.state
        batched = state.batched(req)
        stream: GenerationStream
        if batched:
            assert state.worker is not None and isinstance(req.prompt, list)
            chunks, stats = state.worker.submit(req.prompt, req.params, state.method_of(req), state.k_of(req),
                                                request_id=self.batch_id, suffix_group=req.suffix_group)
            stream = state.decoder.token_stream(chunks, stats, req.params)
        else:
            stream = state.decoder.stream(req.prompt, req.params, chat=req.chat, method=req.method, k=req.k,
                                          suffix_group=req.suffix_group)
        self.stats = stream.stats
        deltas = iter(stream)
        try:
            for delta in deltas:
                if not batched:
                    with self.state.metrics.lock:
                        self.state.metrics.kv_tokens = stream.stats.prompt_tokens + stream.stats.new_tokens
                if self.cancelled.is_set():
                    return "cancelled"
                self._put(delta)
        finally:
            deltas.close()  # ends the engine's loop (and its timing) if we left early
        return "cancelled" if self.cancelled.is_set() else "ok"

    async def deltas(self) -> AsyncIterator[str]:
        while True:
            item = await self.queue.get()
            if item is self._DONE:
                return
            yield item

    def failure(self) -> APIError | None:
        """What to tell the client when the generation did not finish normally, else None."""
        if self.ended_by is not None:
            return self.ended_by
        err = self.error
        if err is None:
            return None
        if isinstance(err, SpecDecodeError):
            return APIError(400, str(err))
        return APIError(500, f"The server failed on this request: {type(err).__name__}: {err}", kind="server_error")


@dataclass(slots=True)
class ServerState:
    decoder: SpecDecoder
    model_name: str
    aliases: tuple[str, ...]
    worker: BatchWorker | None = None
    options: ServerOptions = field(default_factory=ServerOptions)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine_lock: threading.Lock = field(default_factory=threading.Lock)
    started: int = field(default_factory=lambda: int(time.time()))
    inflight: set[Generation] = field(default_factory=set)  # touched on the event loop only
    draining: bool = False

    def method_of(self, request: ParsedRequest) -> str:
        return request.method or self.decoder.spec.method

    def batched(self, request: ParsedRequest) -> bool:
        """Whether the batch engine decodes this request (else the single-sequence engine)."""
        return self.worker is not None and self.method_of(request) in BATCH_METHODS

    def k_of(self, request: ParsedRequest) -> int | None:
        if self.method_of(request) == "none":
            return None
        return request.k if request.k is not None else self.decoder.spec.k

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.aliases)

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(m for m in METHODS if m in ("none", "auto", "suffix") or m in self.decoder.drafters)

    @property
    def context_length(self) -> int:
        """The most tokens (prompt and output) a request may hold, as ``SpecDecoder.check_request`` counts."""
        context = self.decoder.target.config.max_position_embeddings
        if self.decoder.draft is not None:
            context = min(context, self.decoder.draft.config.max_position_embeddings)
        return context

    def prepare(self, raw: bytes, chat: bool) -> ParsedRequest:
        """Parse, validate and tokenize a request body (CPU work: run it off the event loop).
        The returned request's prompt is token ids."""
        try:
            req = parse_request(_load_json(raw), chat, self.served_names, self.methods, k_max=self.decoder.spec.k_max)
            try:
                # Tokenize and check the length here, so that a streaming request too gets a 4xx
                # rather than an error event after a 200.
                prompt = req.prompt
                prompt_ids = prompt if prompt and isinstance(prompt[0], int) else self.decoder.encode(prompt, chat)
                vocab = self.decoder.target.config.vocab_size
                if any(not 0 <= t < vocab for t in prompt_ids):
                    raise APIError(400, f"Prompt token ids must lie in [0, {vocab}).", "prompt")
                room = self.context_length - len(prompt_ids)
                if not req.max_tokens_given and 0 < room < req.params.max_new_tokens:
                    # OpenAI's chat default is "up to the context": a default must not be a 400.
                    req.params = dataclasses.replace(req.params, max_new_tokens=room)
                self.decoder.check_request(prompt_ids, req.params)
                if self.batched(req):
                    assert self.worker is not None
                    self.worker.engine.check_request(len(prompt_ids), req.params, self.method_of(req), self.k_of(req))
            except SpecDecodeError as err:
                raise APIError(400, str(err), "messages" if chat else "prompt") from err
        except APIError:
            self.metrics.count("rejected")
            raise
        req.prompt, req.chat = prompt_ids, False
        return req

    def track(self, generation: Generation) -> None:
        self.inflight.add(generation)
        timeout = self.options.request_timeout
        if timeout is not None:
            reason = APIError(504, f"The request ran past this server's limit of {timeout:g} s (--request-timeout) and "
                                   "was stopped; ask for fewer tokens.", code="request_timeout", kind="server_error")
            generation.timer = generation.loop.call_later(timeout, generation.stop, reason)

    def untrack(self, generation: Generation) -> None:
        generation.stop()  # a no-op when it finished; cancels it when its client left
        if generation.timer is not None:
            generation.timer.cancel()
        self.inflight.discard(generation)

    async def drain(self, timeout: float, poll: float = 0.05) -> None:
        """Take no new requests (the guard answers 503), give those in flight ``timeout``
        seconds, then end the rest: a stream gets a final error event and ``[DONE]``."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.inflight and loop.time() < deadline:
            await asyncio.sleep(poll)
        reason = APIError(503, "The server is shutting down; the request was stopped before it finished. Retry it "
                               "on another instance.", code="server_shutting_down", kind="server_error")
        for generation in list(self.inflight):
            generation.stop(reason)
        # Their responses end at once (the readers are woken); let the last events go out.
        flush_deadline = loop.time() + 2.0
        while self.inflight and loop.time() < flush_deadline:
            await asyncio.sleep(poll)


def _load_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError as err:
        raise APIError(400, "The request body is nested too deeply to parse; send a flat OpenAI request.") from err
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity
        raise APIError(400, f"The request body is not valid JSON: {err}.") from err


def _refuse_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which JSON itself does not have.
    raise ValueError(f"{name} is not a JSON value")


def _usage(stats: GenerationStats | None) -> dict[str, int]:
    prompt = stats.prompt_tokens if stats else 0
    completion = stats.new_tokens if stats else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _spec_metrics(stats: GenerationStats | None) -> dict[str, Any]:
    if stats is None:
        return {}
    return {"method": stats.method, "tau": stats.tau, "acceptance_rate": stats.acceptance_rate,
            "tokens_per_second": stats.tokens_per_second, "target_forward_passes": stats.target_forward_passes}


def create_app(decoder: SpecDecoder, model_name: str, aliases: tuple[str, ...] = (),
               worker: BatchWorker | None = None, options: ServerOptions | None = None) -> Any:
    """The ASGI application serving ``decoder`` as ``model_name``: FastAPI behind the request
    guard. With ``worker`` (a ``BatchWorker`` over ``decoder.batch_engine()``) the batchable
    methods share target passes. ``app.state.specdecode`` is the ``ServerState``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    options = options or ServerOptions()
    state = ServerState(decoder, model_name, aliases, worker, options)
    state.metrics.worker = worker
    state.metrics.suffix_cache = decoder.suffix_cache
    app = FastAPI(title="specdecode", version="1")
    app.state.specdecode = state

    def error_response(err: APIError) -> Response:
        return Response(err.json(), status_code=err.status, media_type="application/json")

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> Response:
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        message = f"No route {request.url.path}." if err.status_code == 404 else str(err.detail)
        code = "not_found" if err.status_code == 404 else None
        return error_response(APIError(err.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception) -> Response:
        return error_response(APIError(500, f"The server failed on this request: {type(err).__name__}.",
                                       kind="server_error"))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "draining" if state.draining else "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": state.started, "owned_by": "specdecode"}
                for name in state.served_names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    class GenerationResponse(StreamingResponse):
        """Server-sent events that release their generation however the response ends (a
        client that leaves before the first event included)."""

        def __init__(self, generation: Generation, events: AsyncIterator[str]) -> None:
            super().__init__(events, media_type="text/event-stream")
            self.generation = generation

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                state.untrack(self.generation)

    async def respond(request: Request, chat: bool) -> Any:
        raw = await request.body()  # the guard has read it, within the size limit
        req = await asyncio.to_thread(state.prepare, raw, chat)
        req.suffix_group = suffix_group(options.suffix_share, request.headers.get("authorization"))
        generation = Generation(state, req, asyncio.get_running_loop())
        state.track(generation)
        generation.start()
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            return GenerationResponse(generation, _events(generation, request_id, created, state.model_name, chat))
        try:
            text = await _text_unless_disconnected(generation, request)
        finally:
            state.untrack(generation)  # cancels it when the client left (or this task was cancelled)
        if text is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        failure = generation.failure()
        if failure is not None:
            raise failure
        return _final_body(request_id, created, state.model_name, chat, text, generation.stats)

    @app.post("/v1/completions", openapi_extra=_request_body_schema(state, chat=False))
    async def completions(request: Request) -> Any:
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_request_body_schema(state, chat=True))
    async def chat_completions(request: Request) -> Any:
        return await respond(request, chat=True)

    return RequestGuard(app, options.guard, lambda: state.draining)


async def _text_unless_disconnected(generation: Generation, request: Any) -> str | None:
    """The generation's whole text, or None when the client disconnects first."""

    async def text() -> str:
        return "".join([delta async for delta in generation.deltas()])

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collect, watch = asyncio.ensure_future(text()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (collect, watch):
            task.cancel()
    return collect.result() if collect.done() and not collect.cancelled() else None


def _request_body_schema(state: ServerState, chat: bool) -> dict[str, Any]:
    from specdecode.serving.openapi import request_body

    return {"requestBody": request_body(chat, state.served_names, state.methods, state.decoder.spec.k_max,
                                        state.decoder.target.config.vocab_size)}


def _finish(stats: GenerationStats | None) -> str | None:
    return FINISH_REASONS.get(stats.stop_reason, "stop") if stats is not None else None


def _final_body(request_id: str, created: int, model: str, chat: bool, text: str, stats: GenerationStats | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(stats), "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": _usage(stats), "specdecode": _spec_metrics(stats)}


def _chunk(request_id: str, created: int, model: str, chat: bool, delta: str | None, finish: str | None,
           first: bool = False) -> str:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        payload: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta:
            payload["content"] = delta
        choice["delta"] = payload
    else:
        choice["text"] = delta or ""
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    return _sse(body)


# Characters JSON leaves raw that Python's str.splitlines (and so httpx's iter_lines) reads as
# line breaks: escaped, so that an event is one line for every client.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


async def _events(generation: Generation, request_id: str, created: int, model: str, chat: bool) -> AsyncIterator[str]:
    """Server-sent events, ending in ``data: [DONE]`` whether the generation finished or failed
    (then the event before it is an OpenAI error body)."""
    make: Callable[..., str] = lambda delta, finish, first=False: _chunk(request_id, created, model, chat, delta, finish, first)
    if chat:
        yield make(None, None, first=True)
    async for delta in generation.deltas():
        yield make(delta, None)
    failure = generation.failure()
    if failure is not None:
        yield f"data: {failure.json()}\n\n"
    else:
        final = make(None, _finish(generation.stats))
        body = json.loads(final[len("data: "):])
        body["usage"], body["specdecode"] = _usage(generation.stats), _spec_metrics(generation.stats)
        yield _sse(body)
    yield "data: [DONE]\n\n"


def serve(decoder: SpecDecoder, model_name: str, host: str, port: int, aliases: tuple[str, ...] = (),
          log_level: str = "info", worker: BatchWorker | None = None, options: ServerOptions | None = None) -> None:
    """Run the server until SIGTERM or SIGINT, then drain (``serving/shutdown.py``)."""
    from specdecode.serving.shutdown import run_draining

    options = options or ServerOptions()
    app = create_app(decoder, model_name, aliases, worker, options)
    try:
        run_draining(app, app.state.specdecode, host, port, log_level, options.drain_timeout)
    finally:
        if worker is not None:
            worker.close()
