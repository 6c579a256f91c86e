"""How the server's HTTP connections are bounded: uvicorn's settings, a header timeout and
the connection limit.

uvicorn closes a keep-alive connection idle past ``timeout_keep_alive``, but it has no bound on
how long a client may take to send a request's headers: a client sending one header byte at a
time (slowloris) holds its connection for ever. ``HeaderTimeoutProtocol`` closes a connection
whose request headers have not all arrived ``header_timeout`` seconds after it opened, or after
its previous response ended. It wraps uvicorn's own protocol (httptools where installed, else
h11): both start a request's ``cycle`` when its headers are complete, which is what the timer
waits for.

The connection limit (``--max-connections``) is not uvicorn's ``limit_concurrency``, which
answers its own plain-text 503 to every request past it, ``/health`` included, so that a load
balancer takes a busy server for a dead one. Instead the protocol counts open connections into
the guard's ``ConnectionLimit`` (``serving/guard.py``), and the guard answers past the limit
with an OpenAI error body and ``Retry-After``, and answers ``/health``. The protocol itself only
closes, unread, a connection opened past a hard cap ``CONNECTION_HEADROOM`` above the limit:
the headroom is for health probes and for the 503s, and the cap bounds the sockets a flood of
connections can hold.
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from specdecode.serving.guard import ConnectionLimit, RequestGuard
from specdecode.serving.state import DEFAULT_HEADER_TIMEOUT, DEFAULT_KEEP_ALIVE_TIMEOUT, DEFAULT_MAX_CONNECTIONS

# uvicorn's graceful wait, after the drain (serving/shutdown.py): the ended responses only flush.
FLUSH_TIMEOUT_SECONDS = 3.0
# Connections past --max-connections still accepted (answered /health, or a 503 with an OpenAI
# body and Retry-After) before new ones are closed unread: a handful of load-balancer probes
# and clients being told to come back, not a second server's worth of sockets.
CONNECTION_HEADROOM = 16


class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    limit: ConnectionLimit | None = None  # the guard's, counted here; None: connections not counted

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        limit = self.limit
        if limit is not None:
            limit.connections += 1
            if limit.most is not None and limit.connections > limit.most + CONNECTION_HEADROOM:
                transport.close()  # past the hard cap: not even a 503 (connection_lost uncounts it)
                return
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # a request's headers are complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.limit is not None:
            self.limit.connections -= 1
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, log_level: str, keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
                   max_connections: int | None = DEFAULT_MAX_CONNECTIONS,
                   header_timeout: float = DEFAULT_HEADER_TIMEOUT) -> uvicorn.Config:
    """uvicorn's settings for the server: headers within ``header_timeout`` seconds, an idle
    keep-alive connection closed after ``keep_alive_timeout``, at most ``max_connections``
    connections and requests at once (None: no limit), and a short graceful wait after the
    drain. ``app`` is the server's ``RequestGuard``, which applies the limit (503 past it, but
    ``/health`` answered; the module docstring); any other application gets uvicorn's own
    limit."""
    attributes: dict[str, Any] = {"header_timeout": header_timeout}
    limit_concurrency = max_connections
    if isinstance(app, RequestGuard):
        app.limit.most = max_connections
        attributes["limit"] = app.limit
        limit_concurrency = None
    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), attributes)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_graceful_shutdown=int(FLUSH_TIMEOUT_SECONDS),
                          timeout_keep_alive=keep_alive_timeout,  # type: ignore[arg-type] # a float works
                          limit_concurrency=limit_concurrency)
