"""``specdecode serve``: an OpenAI-compatible HTTP server over one ``SpecDecoder``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``
as server-sent events), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus
text format).

Requests with methods ``none``, ``ngram`` and ``draft`` are decoded together by a
continuous-batching engine (``engine/batch.py``) stepping in one worker thread
(``serving/worker.py``): they join and leave the batch between steps, share each target pass,
and hold paged KV blocks only while they run. The other methods (``auto``, ``layerskip``,
``medusa``, ``eagle``) keep the single-sequence engine and run one at a time, first come
first served, beside the batch. A streaming client that disconnects cancels its request
between two decoding steps, which frees its blocks.

Bad input (malformed JSON, unknown model, wrong types, max_tokens or temperature out of
range, a prompt over the context) gets a 4xx with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``; an unexpected failure inside one request
gets a 500 with the same shape, and the server keeps serving.

Extension fields a request may carry besides OpenAI's: ``top_k`` (int), ``method`` (one of
the loaded decoder's methods) and ``k`` (tokens drafted per step). Each response carries the
request's decoding metrics under ``specdecode``.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoint signatures
# (``request: Request``, imported inside ``create_app``) at definition time.
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from specdecode.api import SpecDecoder
from specdecode.config import METHODS, SamplingParams
from specdecode.engine.batch import BATCH_METHODS
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.stream import GenerationStream
from specdecode.errors import SpecDecodeError
from specdecode.serving.worker import BatchWorker

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 512
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "user", "assistant")
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length"}


class APIError(Exception):
    """An error to return as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(slots=True)
class ParsedRequest:
    prompt: str | list[int] | list[dict[str, str]]
    chat: bool
    params: SamplingParams
    stream: bool
    method: str | None
    k: int | None


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int subclass: refuse it where a number is wanted.
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise APIError(400, f"'{name}' must be {names}, got {type(value).__name__}.", name)
    return value


def parse_request(body: Any, chat: bool, served_names: tuple[str, ...], methods: tuple[str, ...]) -> ParsedRequest:
    """Validate an OpenAI (chat) completion request body; raise APIError on bad input."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    model = _typed(body, "model", (str,), None)
    if model is None:
        raise APIError(400, "'model' is required.", "model")
    if model not in served_names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves {', '.join(served_names)}.",
                       "model", "model_not_found")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects.", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES or not isinstance(message.get("content"), str):
                raise APIError(400, f"messages[{i}] needs a role in {', '.join(CHAT_ROLES)} and string content.", "messages")
        prompt: Any = [{"role": m["role"], "content": m["content"]} for m in messages]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        token_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not token_ids:
            raise APIError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request).", "prompt")
    if _typed(body, "n", (int,), 1) != 1:
        raise APIError(400, "Only n = 1 is supported.", "n")
    max_tokens_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    default_max = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _typed(body, max_tokens_name, (int,), default_max)
    if max_tokens < 1:
        raise APIError(400, f"'{max_tokens_name}' must be at least 1, got {max_tokens}.", max_tokens_name)
    temperature = float(_typed(body, "temperature", (int, float), 1.0))
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise APIError(400, f"'temperature' must be in [0, {MAX_TEMPERATURE}], got {temperature}.", "temperature")
    top_p = float(_typed(body, "top_p", (int, float), 1.0))
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}.", "top_p")
    top_k = _typed(body, "top_k", (int,), 0)
    seed = _typed(body, "seed", (int,), None)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        stops = tuple(stop)
    else:
        raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings.", "stop")
    stream = _typed(body, "stream", (bool,), False)
    method = _typed(body, "method", (str,), None)
    if method is not None and method not in methods:
        raise APIError(400, f"'method' must be one of {', '.join(methods)}, got {method!r}.", "method")
    k = _typed(body, "k", (int,), None)
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_tokens,
                                seed=seed, stop=stops)
    except SpecDecodeError as err:
        raise APIError(400, str(err)) from err
    return ParsedRequest(prompt, chat, params, stream, method, k)


@dataclass(slots=True)
class ServerMetrics:
    """Counters for /metrics; updated under ``lock`` from worker threads."""

    requests: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0, "cancelled": 0, "rejected": 0})
    prompt_tokens: int = 0
    generated_tokens: int = 0
    verify_steps: int = 0
    emitted_by_steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    running: int = 0  # single-sequence requests decoding (the batch's are counted by the worker)
    waiting: int = 0
    kv_tokens: int = 0  # tokens in the running single-sequence request's target KV cache
    worker: BatchWorker | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, stats: GenerationStats, status: str) -> None:
        with self.lock:
            self.requests[status] += 1
            self.prompt_tokens += stats.prompt_tokens
            self.generated_tokens += stats.new_tokens
            self.verify_steps += stats.verify_steps
            self.emitted_by_steps += stats.emitted_by_steps
            self.draft_tokens_proposed += stats.draft_tokens_proposed
            self.draft_tokens_accepted += stats.draft_tokens_accepted

    def prometheus(self) -> str:
        with self.lock:
            tau = self.emitted_by_steps / self.verify_steps if self.verify_steps else 0.0
            engine = self.worker.engine if self.worker is not None else None
            batch, queued = (engine.num_running, engine.num_waiting) if engine is not None else (0, 0)
            pool = engine.target_cache if engine is not None else None
            acceptance = self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0
            lines = ["# HELP specdecode_requests_total Finished requests by outcome.",
                     "# TYPE specdecode_requests_total counter"]
            lines += [f'specdecode_requests_total{{status="{k}"}} {v}' for k, v in sorted(self.requests.items())]
            rows = [
                ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", self.prompt_tokens),
                ("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("verify_steps_total", "counter", "Target verify passes.", self.verify_steps),
                ("draft_tokens_proposed_total", "counter", "Draft tokens proposed.", self.draft_tokens_proposed),
                ("draft_tokens_accepted_total", "counter", "Draft tokens accepted.", self.draft_tokens_accepted),
                ("tau", "gauge", "Mean tokens per verify pass, bonus token counted, since start.", tau),
                ("acceptance_rate", "gauge", "Accepted over proposed draft tokens, since start.", acceptance),
                ("requests_running", "gauge", "Requests decoding now.", self.running + batch),
                ("requests_waiting", "gauge", "Requests queued for the batch or the single-sequence engine.", self.waiting + queued),
                ("batch_size", "gauge", "Sequences in the batch engine's current step.", batch),
                ("kv_blocks_used", "gauge", "Target KV blocks held by batched requests.", pool.used_blocks if pool else 0),
                ("kv_blocks_total", "gauge", "Target KV blocks in the batch engine's pool.", pool.usable_blocks if pool else 0),
                ("preemptions_total", "counter", "Batched requests preempted for KV blocks (recomputed later).",
                 engine.scheduler.preemptions if engine is not None else 0),
                ("kv_cache_tokens", "gauge", "Tokens in the single-sequence engine's target KV cache.", self.kv_tokens),
            ]
            for name, kind, help_text, value in rows:
                lines += [f"# HELP specdecode_{name} {help_text}", f"# TYPE specdecode_{name} {kind}", f"specdecode_{name} {value}"]
        return "\n".join(lines) + "\n"


class Generation:
    """One request decoding in a worker thread; text deltas arrive on an asyncio queue."""

    _DONE = object()

    def __init__(self, state: "ServerState", request: ParsedRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.state, self.request, self.loop = state, request, loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.stats: GenerationStats | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Generation":
        self.thread.start()
        return self

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
            with self.state.engine_lock:
                with metrics.lock:
                    metrics.waiting -= 1
                    metrics.running += 1
                try:
                    status = self._decode()
                finally:
                    with metrics.lock:
                        metrics.running -= 1
                        metrics.kv_tokens = 0
        except BaseException as err:  # reported to the client; the server goes on
            self.error = err
        finally:
            if self.stats is not None:
                metrics.record(self.stats, status)
            else:
                with metrics.lock:
                    metrics.requests["rejected" if isinstance(self.error, SpecDecodeError) else "error"] += 1
            self._put(self._DONE)

    def _decode(self) -> str:
        if self.cancelled.is_set():  # the client left while waiting
            return "cancelled"
        req, state = self.request, self.state
        batched = state.batched(req)
        stream: GenerationStream
        if batched:
            assert state.worker is not None and isinstance(req.prompt, list)
            chunks, stats = state.worker.submit(req.prompt, req.params, state.method_of(req), state.k_of(req))
            stream = state.decoder.token_stream(chunks, stats, req.params)
        else:
            stream = state.decoder.stream(req.prompt, req.params, chat=req.chat, method=req.method, k=req.k)
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
        return "ok"

    async def deltas(self) -> AsyncIterator[str]:
        while True:
            item = await self.queue.get()
            if item is self._DONE:
                return
            yield item


@dataclass(slots=True)
class ServerState:
    decoder: SpecDecoder
    model_name: str
    aliases: tuple[str, ...]
    worker: BatchWorker | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine_lock: threading.Lock = field(default_factory=threading.Lock)
    started: int = field(default_factory=lambda: int(time.time()))

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
        return tuple(m for m in METHODS if m == "none" or m == "auto" or m in self.decoder.drafters)


def _raise_for(generation: Generation) -> None:
    err = generation.error
    if err is None:
        return
    if isinstance(err, SpecDecodeError):
        raise APIError(400, str(err))
    raise APIError(500, f"The server failed on this request: {type(err).__name__}: {err}", kind="server_error")


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
               worker: BatchWorker | None = None) -> Any:
    """The FastAPI application serving ``decoder`` as ``model_name``; with ``worker`` (a
    ``BatchWorker`` over ``decoder.batch_engine()``) the batchable methods share target passes."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    state = ServerState(decoder, model_name, aliases, worker)
    state.metrics.worker = worker
    app = FastAPI(title="specdecode", version="1")
    app.state.specdecode = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(404)
    async def not_found(request: Request, _: Exception) -> JSONResponse:
        return JSONResponse(APIError(404, f"No route {request.url.path}.", code="not_found").body(), status_code=404)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": state.started, "owned_by": "specdecode"}
                for name in state.served_names]
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(state.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            with state.metrics.lock:
                state.metrics.requests["rejected"] += 1
            raise APIError(400, f"The request body is not valid JSON: {err}.") from err

    def parsed(body: Any, chat: bool) -> ParsedRequest:
        try:
            return parse_request(body, chat, state.served_names, state.methods)
        except APIError:
            with state.metrics.lock:
                state.metrics.requests["rejected"] += 1
            raise

    async def respond(request: Request, chat: bool) -> Any:
        req = parsed(await body_of(request), chat)
        try:
            # Tokenize and check the length here, so that a streaming request too gets a 4xx
            # rather than an error event after a 200.
            prompt_ids = req.prompt if req.prompt and isinstance(req.prompt[0], int) else decoder.encode(req.prompt, req.chat)
            vocab = decoder.target.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt_ids):
                raise APIError(400, f"Prompt token ids must lie in [0, {vocab}).", "prompt")
            decoder.check_request(prompt_ids, req.params)
            if state.batched(req):
                assert worker is not None
                worker.engine.check_request(len(prompt_ids), req.params, state.method_of(req), state.k_of(req))
        except (SpecDecodeError, APIError) as err:
            with state.metrics.lock:
                state.metrics.requests["rejected"] += 1
            if isinstance(err, APIError):
                raise
            raise APIError(400, str(err), "messages" if chat else "prompt") from err
        req.prompt, req.chat = prompt_ids, False
        generation = Generation(state, req, asyncio.get_running_loop()).start()
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not req.stream:
            try:
                text = "".join([delta async for delta in generation.deltas()])
            except asyncio.CancelledError:
                generation.cancelled.set()
                raise
            _raise_for(generation)
            return _final_body(request_id, created, state.model_name, chat, text, generation.stats)
        return StreamingResponse(_events(generation, request_id, created, state.model_name, chat),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await respond(request, chat=True)

    return app


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
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _events(generation: Generation, request_id: str, created: int, model: str, chat: bool) -> AsyncIterator[str]:
    """Server-sent events; a client that goes away cancels the generation."""
    make: Callable[..., str] = lambda delta, finish, first=False: _chunk(request_id, created, model, chat, delta, finish, first)  # noqa: E731
    try:
        if chat:
            yield make(None, None, first=True)
        async for delta in generation.deltas():
            yield make(delta, None)
        if generation.error is not None:
            try:
                _raise_for(generation)
            except APIError as err:
                yield f"data: {json.dumps(err.body())}\n\n"
                return
        final = make(None, _finish(generation.stats))
        body = json.loads(final[len("data: "):])
        body["usage"], body["specdecode"] = _usage(generation.stats), _spec_metrics(generation.stats)
        yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        generation.cancelled.set()  # no-op when finished; stops decoding when the client left


def serve(decoder: SpecDecoder, model_name: str, host: str, port: int, aliases: tuple[str, ...] = (),
          log_level: str = "info", worker: BatchWorker | None = None) -> None:
    import uvicorn

    try:
        uvicorn.run(create_app(decoder, model_name, aliases, worker), host=host, port=port, log_level=log_level)
    finally:
        if worker is not None:
            worker.close()
