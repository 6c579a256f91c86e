"""``specdecode serve``: an OpenAI-compatible HTTP server over one ``SpecDecoder``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``
as server-sent events), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus
text format); ``POST /infill`` (``serving/infill.py``: a translation onto a completion), and
``/tokenize``, ``/detokenize``, ``/apply-template``, ``GET /props`` (``serving/utility_routes.py``);
``POST /v1/responses`` and ``GET``/``DELETE /v1/responses/{id}`` (``serving/responses_api.py``).

Every request, whatever its method, is decoded by one continuous-batching engine
(``engine/batch.py``) stepping in one worker thread (``serving/worker.py``): requests join and
leave the batch between steps, share each target pass, and hold paged KV blocks only while they
run; there is no second engine and no lock. A client that disconnects (streaming or not)
cancels its request, which frees its blocks before the next step.

Before a request reaches the application, ``serving/guard.py`` checks its Host, API key,
Content-Type and body size. Its body is then parsed and tokenized in a thread, so a large prompt
never stalls the event loop (``/health``, other streams). Bad input gets a 4xx with an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` (``serving/api_errors.py``);
an unexpected failure inside one request gets a 500 with the same shape, and the server keeps
serving. A request past ``request_timeout`` seconds is stopped with a 504 (or a final error
event). On SIGTERM or SIGINT the server drains (``serving/shutdown.py``).

Backpressure (``ServerState.check_room``, ``limit_queue_time``): a request that finds
``max_waiting`` requests already waiting for the batch is refused at once with a 429, and one
that waits ``max_queue_time`` seconds without starting is ended with a 503, both with
``Retry-After``. A stream's 200 waits until its request has started decoding (or ended), so
that it too gets a plain error status rather than an error event after a 200: every response
is a whole completion or a refusal.

Extension fields a request may carry besides OpenAI's: ``top_k`` (int), ``method`` (one of
the loaded decoder's methods) and ``k`` (tokens drafted per step). Each response carries the
request's decoding metrics under ``specdecode``. Method ``suffix`` drafts from earlier
responses of the same tenant only, by default (``serving/suffix_share.py``).

This module is the application: its routes and how a response ends. A request's way through
it: ``serving/state.py`` (``ServerState.prepare``: parse, validate, tokenize; the requests in
flight), ``serving/generation.py`` (``Generation``: its tokens from the batch, read into text),
``serving/responses.py`` (the OpenAI bodies and server-sent events).
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoint signatures
# (``request: Request``, imported inside ``create_app``) at definition time.
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from specdecode.api import SpecDecoder
from specdecode.serving.anthropic_messages import add_messages_routes
from specdecode.serving.api_errors import APIError
from specdecode.serving.generation import Generation, unless_disconnected
from specdecode.serving.guard import RequestGuard, error_headers
from specdecode.serving.health import engine_problem
from specdecode.serving.infill import add_infill_route
from specdecode.serving.protocol import parse_request
from specdecode.serving.responses import choice_body, events, final_body, logprobs_body, usage_apart
from specdecode.serving.responses_api import add_responses_routes
from specdecode.serving.state import DEFAULT_DRAIN_TIMEOUT, ServerOptions, ServerState
from specdecode.serving.suffix_share import cache_group, suffix_group
from specdecode.serving.utility_routes import add_utility_routes
from specdecode.serving.worker import BatchWorker

__all__ = ["DEFAULT_DRAIN_TIMEOUT", "APIError", "ServerOptions", "create_app", "parse_request", "serve"]

def create_app(decoder: SpecDecoder, model_name: str, worker: BatchWorker, aliases: tuple[str, ...] = (),
               options: ServerOptions | None = None) -> Any:
    """The ASGI application serving ``decoder`` as ``model_name``: FastAPI behind the request
    guard; ``worker`` (a ``BatchWorker`` over ``decoder.batch_engine()``) decodes every request,
    all methods sharing its target passes. ``app.state.specdecode`` is the ``ServerState``."""
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
        headers = {name.decode(): value.decode() for name, value in error_headers(err)}  # Retry-After, ...
        return Response(err.json(), status_code=err.status, media_type="application/json", headers=headers)

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
    async def health() -> Any:
        problem = engine_problem(state.worker)
        if problem is not None:  # a 503, so that a load balancer or Ray stops sending it requests
            return Response(json.dumps({"status": "unhealthy", "reason": problem}), status_code=503,
                            media_type="application/json")
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
        """Server-sent events that release their generations however the response ends (a
        client that leaves before the first event included)."""

        def __init__(self, generations: list[Generation], events: AsyncIterator[str]) -> None:
            super().__init__(events, media_type="text/event-stream")
            self.generations = generations

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                for generation in self.generations:
                    state.untrack(generation)

    def release(generations: list[Generation]) -> None:
        for generation in generations:
            state.untrack(generation)

    async def respond(request: Request, chat: bool, translate: Callable[[bytes], bytes] | None = None) -> Any:
        """``translate``: another protocol's body to a completion's (``serving/infill.py``)."""
        state.arriving += 1  # until submitted: the batch worker's window waits for it
        try:
            raw = await request.body()  # the guard has read it, within the size limit
            if translate is not None:
                raw = await asyncio.to_thread(translate, raw)
            req = await asyncio.to_thread(state.prepare, raw, chat)
            usage_chunk = req.stream and await asyncio.to_thread(usage_apart, raw)  # a body's second parse
            if req.params.structured is not None:
                await asyncio.get_running_loop().run_in_executor(state.grammar_waits, state.compile_grammar, req)
            authorization = request.headers.get("authorization")
            req.suffix_group = suffix_group(options.suffix_share, authorization, req.cache_salt)
            req.cache_group = cache_group(options.suffix_share, authorization, req.cache_salt)
            # No await from here to the submits: the count of waiting requests it reads is the
            # one the submits add to, so a burst cannot all pass the check before any is counted.
            state.check_room()
            loop = asyncio.get_running_loop()
            # One generation per choice (n); choices after the first start from its prompt K/V.
            generations = [Generation(state, req, loop, choice) for choice in range(req.n)]
            for generation in generations:
                state.track(generation)
                generation.submit(fork_of=generations[0] if generation.choice else None)
                generation.start()
            state.limit_queue_time(generations)
        finally:
            state.arriving -= 1
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if req.stream:
            # The 200 waits for the request to start (or end): until then it can still be
            # refused with a status of its own (the queue-time limit's 503, a shutdown's).
            try:
                settled = await unless_disconnected(_all_settled(generations), request)
            except BaseException:
                release(generations)
                raise
            if settled is None:
                release(generations)
                return Response(status_code=499)  # the client left while its request waited
            failure = _failed_before_start(generations)
            if failure is not None:
                release(generations)
                raise failure
            return GenerationResponse(generations, events(generations, request_id, created, state.model_name, chat,
                                                          state.token_text, usage_chunk))
        try:
            texts = await unless_disconnected(_texts(generations), request)
        finally:
            release(generations)  # cancels them when the client left (or this task was cancelled)
        if texts is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        for generation in generations:
            failure = generation.failure()
            if failure is not None:
                raise failure
        choices = [choice_body(g.choice, chat, text, g.stats, req.tools, logprobs_body(g.logprobs, chat, state.token_text))
                   for g, text in zip(generations, texts, strict=True)]
        return final_body(request_id, created, state.model_name, chat, choices, [g.stats for g in generations])

    @app.post("/v1/completions", openapi_extra=_request_body_schema(state, chat=False))
    async def completions(request: Request) -> Any:
        return await respond(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_request_body_schema(state, chat=True))
    async def chat_completions(request: Request) -> Any:
        return await respond(request, chat=True)

    add_utility_routes(app, state)  # /tokenize, /detokenize, /apply-template, /props
    add_infill_route(app, state, respond)
    add_messages_routes(app, state, respond)  # /v1/messages, /v1/messages/count_tokens
    add_responses_routes(app, state, respond)  # /v1/responses, GET and DELETE /v1/responses/{id}
    return RequestGuard(app, options.guard, lambda: state.draining, lambda: state.metrics.count("overloaded"))


async def _texts(generations: list[Generation]) -> list[str]:
    """Each generation's whole text."""

    async def text(generation: Generation) -> str:
        return "".join([delta async for delta in generation.deltas()])

    return list(await asyncio.gather(*(text(g) for g in generations)))


async def _all_settled(generations: list[Generation]) -> bool:
    """Once every generation has started decoding or ended."""
    await asyncio.gather(*(g.settled.wait() for g in generations))
    return True


def _failed_before_start(generations: list[Generation]) -> APIError | None:
    """The error of a choice that ended before it started decoding (the queue-time limit, a
    shutdown, a refusal by the engine), to answer as the response's status; else None."""
    for generation in generations:
        failure = generation.failure()
        if failure is not None and not generation.has_started:
            return failure
    return None


def _request_body_schema(state: ServerState, chat: bool) -> dict[str, Any]:
    from specdecode.serving.openapi import request_body

    return {"requestBody": request_body(chat, state.served_names, state.methods, state.decoder.config.k_max,
                                        state.decoder.target.config.vocab_size)}


def serve(decoder: SpecDecoder, model_name: str, host: str, port: int, worker: BatchWorker,
          aliases: tuple[str, ...] = (), log_level: str = "info", options: ServerOptions | None = None) -> None:
    """Run the server until SIGTERM or SIGINT, then drain (``serving/shutdown.py``)."""
    from specdecode.serving.shutdown import run_draining

    options = options or ServerOptions()
    app = create_app(decoder, model_name, worker, aliases, options)
    try:
        run_draining(app, app.state.specdecode, host, port, log_level)
    finally:
        worker.close()
