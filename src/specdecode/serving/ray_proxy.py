"""Clear errors for requests whose Ray Serve replica dies under them.

Ray Serve's HTTP proxy forwards each request to a replica and relays its response. When the
replica's process dies mid-request, the proxy on its own answers a request that had no response
yet with a bare ``500 Internal Server Error`` in plain text, and cuts a stream that had started
(the client sees an incomplete chunked body). This middleware, which runs inside the proxy, turns
those into what ``specdecode serve`` itself sends when it cannot finish a request:

- no response yet: a 503 with the OpenAI error body (code ``replica_unavailable``), which the
  ``openai`` client raises as an ``APIStatusError`` (and, with its default retries, retries; Ray
  routes the retry to a live replica);
- a server-sent event stream cut short: a final error event, then ``data: [DONE]``, as for any
  stream that fails after its 200.

A response that completed passes through untouched, and a response cut short that is not an
event stream (a JSON body half sent) is left for the proxy to close.

Ray's proxy loads it from the environment variable ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
(``PROXY_CALLBACK``), read when a proxy starts: ``specdecode serve --ray`` sets it for the Serve
instance it starts; on a cluster started with ``ray start``, export it before ``ray start``
(docs/scaling.md).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from specdecode.serving.api_errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "specdecode.serving.ray_proxy:proxy_middlewares"

logger = logging.getLogger(__name__)

REPLICA_LOST = ("The Ray Serve replica serving this request stopped before it answered (its process may have died; "
                "Ray Serve restarts it). Retry the request.")
STREAM_CUT = ("The Ray Serve replica serving this stream stopped before the stream ended (its process may have died; "
              "Ray Serve restarts it). Retry the request.")


def replica_lost_error(started: bool) -> APIError:
    return APIError(503, STREAM_CUT if started else REPLICA_LOST, code="replica_unavailable", kind="server_error")


class ReplicaFailureErrors:
    """ASGI middleware for Ray Serve's proxy (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = completed = event_stream = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, completed, event_stream
            if message["type"] == "http.response.start":
                started = True
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
                event_stream = headers.get("content-type", "").startswith("text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            await send(message)

        failure: BaseException | None = None
        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:  # the proxy failed; answer as below, then let the server log it
            failure = err
        if not completed and (event_stream or not started):
            try:
                await _finish(send, replica_lost_error(started), started)
            except Exception:  # the client has gone: nothing left to tell
                logger.debug("could not send the replica-lost error", exc_info=True)
        if failure is not None:
            raise failure


async def _finish(send: Send, error: APIError, started: bool) -> None:
    if started:  # an event stream: the error event and [DONE], as specdecode serve ends a failed stream
        body = f"data: {error.json()}\n\ndata: [DONE]\n\n".encode()
    else:
        body = error.json().encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list[Any]:
    """The callback Ray's proxy calls (``PROXY_CALLBACK``): the Starlette middlewares to add."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaFailureErrors)]
