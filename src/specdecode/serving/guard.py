"""An ASGI middleware that turns away requests before the application reads them.

In order: a Host header the server does not answer to (DNS rebinding: a web page on another
site that resolves its own name to 127.0.0.1 must not reach a loopback server) gets a 400; a
request without the API key, when one is set, a 401 (on every route but ``/health``); while the server drains for
shutdown, a new ``/v1/`` POST gets a 503; a POST body that is not ``application/json`` a 415;
past the connection limit (``ConnectionLimit``: requests in flight, or connections open,
beyond ``--max-connections``), any route but ``/health`` a 503 with ``Retry-After``; a body
over ``max_body_bytes`` a 413, refused from its Content-Length before a byte of it is read, or
as soon as a chunked body passes the limit; and a body not all sent within ``body_timeout``
seconds of its headers a 408. Every refusal carries the OpenAI error body and closes the
connection. The body of an accepted POST is read here and replayed to the application, which
then never holds more than the limit.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from specdecode.serving.anthropic_errors import ANTHROPIC_PATHS, anthropic_error_json
from specdecode.serving.api_errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # TGI's default payload limit
# Seconds a client has to send a request's body once its headers are in. A 2 MiB body (the size
# limit) takes under a second on any real link; 30 s leaves room for a slow mobile one, while a
# client trickling a byte a second is cut off before it has held its connection long.
DEFAULT_BODY_TIMEOUT = 30.0
LOOPBACK_NAMES = ("localhost",)
UNGUARDED_PATHS = frozenset({"/health"})  # answered without the API key
# Answered past the connection limit too: a load balancer that cannot reach /health while the
# server is merely busy takes it out of rotation, which turns a busy server into a down one.
UNLIMITED_PATHS = frozenset({"/health"})
# Retry-After of the connection limit's 503: a request in flight usually ends, and frees its
# place, within about a second (a whole generation takes longer, but there are many in flight).
CONNECTION_RETRY_AFTER_SECONDS = 1


class RetryLater(APIError):
    """An APIError for a server too busy to take the request now: its response says, in a
    ``Retry-After`` header, after how many whole seconds a retry has a chance (OpenAI's client,
    and most HTTP clients, honour it)."""

    def __init__(self, status: int, message: str, code: str, retry_after: int, kind: str = "server_error") -> None:
        super().__init__(status, message, code=code, kind=kind)
        self.retry_after = max(1, int(retry_after))


def error_headers(error: APIError) -> list[tuple[bytes, bytes]]:
    """The headers an error response carries besides its body's: ``Retry-After`` for a
    ``RetryLater``, ``WWW-Authenticate`` for a 401."""
    headers = []
    if isinstance(error, RetryLater):
        headers.append((b"retry-after", str(error.retry_after).encode()))
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    return headers


@dataclass(slots=True)
class ConnectionLimit:
    """How many connections and requests the server holds, against ``--max-connections``.

    ``most`` is set by the HTTP layer that applies the limit (``serving/connections.py:
    uvicorn_config``), which also counts ``connections`` as they open and close; the guard
    counts ``requests`` in flight (all but ``/health``). Both change on the event loop only.
    None: no limit (the application run by another server, as in the tests or under Ray)."""

    most: int | None = None
    connections: int = 0
    requests: int = 0

    def exceeded(self) -> bool:
        """Whether the request just counted is past the limit: more requests in flight, or
        connections open, than ``most``."""
        return self.most is not None and (self.requests > self.most or self.connections > self.most)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is loopback."""
    host = host.strip("[]").rstrip(".").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The host of a Host header without its port: ``[::1]:8000`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def default_allowed_hosts(bound_host: str, extra: tuple[str, ...] = ()) -> tuple[str, ...] | None:
    """The Host names to answer to: bound to loopback, loopback names and the bound host (plus
    ``extra``); bound elsewhere, ``extra`` only, or no check at all (None) when it is empty.
    ``*`` in ``extra`` turns the check off."""
    if "*" in extra:
        return None
    if is_loopback(bound_host):
        return (host_name(bound_host), *extra)
    return extra or None


@dataclass(slots=True, frozen=True)
class GuardOptions:
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # None: any Host. Otherwise the names (no ports) answered to, loopback ones always included.
    allowed_hosts: tuple[str, ...] | None = ("127.0.0.1",)
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT  # seconds to send a body after its headers; None: no limit


class RequestGuard:
    def __init__(self, app: ASGIApp, options: GuardOptions, draining: Callable[[], bool],
                 overloaded: Callable[[], None] | None = None) -> None:
        """``draining``: whether the server is shutting down; ``overloaded``: called for each
        request refused past the connection limit (the server counts it in /metrics)."""
        self.app, self.options, self.draining, self.overloaded = app, options, draining, overloaded
        self.state = getattr(app, "state", None)  # the wrapped application's (app.state.specdecode)
        self.limit = ConnectionLimit()  # its ``most`` set where the server applies --max-connections
        self._key = options.api_key.encode() if options.api_key else None
        self._hosts = None if options.allowed_hosts is None else {host_name(h) for h in options.allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        counted = scope["path"] not in UNLIMITED_PATHS
        if counted:
            self.limit.requests += 1
        try:
            await self._guard(scope, receive, send)
        finally:
            if counted:
                self.limit.requests -= 1

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        # The limit last, so that a request the server would refuse anyway hears why.
        error = self._refusal(scope, headers) or self._over_limit(scope)
        if error is None and scope["method"] == "POST":
            body, error = await self._read_body_in_time(headers, receive)
            if body is None and error is None:
                return  # the client left while sending
            if error is None:
                receive = _replay(body, receive)
        if error is not None:
            await _send_error(send, error, anthropic=scope["path"] in ANTHROPIC_PATHS)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> APIError | None:
        if self._hosts is not None:
            host = host_name(headers.get("host", ""))
            if not (host in self._hosts or is_loopback(host)):
                return APIError(400, f"This server does not answer to the Host {host!r}; start it with "
                                     "--allowed-hosts to add that name.", code="invalid_host")
        api = scope["path"] == "/v1" or scope["path"].startswith("/v1/")
        # Every route but /health needs the key: /metrics tells request counts, acceptance and,
        # through the suffix-cache gauges, how many tenants there are and how often each sends;
        # /docs and /openapi.json describe the server. A load balancer's health probe has no key.
        if self._key is not None and scope["path"] not in UNGUARDED_PATHS:
            scheme, _, token = headers.get("authorization", "").partition(" ")
            bearer = token.strip() if scheme.lower() == "bearer" else ""
            # compare_digest: the time taken says nothing about how much of the key matched.
            # x-api-key: Anthropic's header, which its SDK sends instead of Authorization.
            if not any(hmac.compare_digest(given.encode(), self._key)
                       for given in (bearer, headers.get("x-api-key", "").strip()) if given):
                return APIError(401, "Missing or wrong API key: send the header 'Authorization: Bearer <key>' (or "
                                     "'x-api-key: <key>') with the key the server was started with.",
                                code="invalid_api_key")
        if scope["method"] != "POST":
            return None
        if api and self.draining():
            return APIError(503, "The server is shutting down and takes no new requests; retry on another instance.",
                            code="server_shutting_down", kind="server_error")
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            return APIError(415, f"The request body must be JSON sent with 'Content-Type: application/json', got "
                                 f"{media_type or 'no Content-Type'!r}.", code="unsupported_media_type")
        return None

    def _over_limit(self, scope: Scope) -> APIError | None:
        """The 503 for a request past --max-connections, else None; never for /health."""
        limit = self.limit
        if scope["path"] in UNLIMITED_PATHS or not limit.exceeded():
            return None
        if self.overloaded is not None:
            self.overloaded()
        return RetryLater(503, f"The server holds as many connections and requests as it takes at once ({limit.most}, "
                               "--max-connections); retry shortly or on another instance.",
                          code="too_many_connections", retry_after=CONNECTION_RETRY_AFTER_SECONDS)

    async def _read_body_in_time(self, headers: dict[str, str],
                                 receive: Receive) -> tuple[bytes | None, APIError | None]:
        """``_read_body``, ended with a 408 when the body has not all come ``body_timeout``
        seconds after its headers: uvicorn waits for a body as long as its client sends it, so a
        client sending a byte a second would hold its connection, and its place under the
        connection limit, for as long as it liked."""
        timeout = self.options.body_timeout
        try:
            return await asyncio.wait_for(self._read_body(headers, receive), timeout)
        except TimeoutError:
            return None, APIError(408, f"The request body did not arrive within {timeout:g} s of its headers "
                                       "(--body-timeout); send it whole, at once.", code="body_timeout")

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> tuple[bytes | None, APIError | None]:
        limit = self.options.max_body_bytes
        too_large = APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                                  "(--max-body-bytes); send a shorter prompt.", code="request_too_large")
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                return None, APIError(400, "The Content-Length header is not a number.")
            if int(declared) > limit:
                return None, too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None, too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields ``body`` once, then passes through (to hear of a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_error(send: Send, error: APIError, anthropic: bool = False) -> None:
    """``anthropic``: in the error shape of Anthropic's Messages API, for its routes."""
    body = (anthropic_error_json(error) if anthropic else error.json()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               # The body may be unread: close rather than parse what is left of it as a request.
               (b"connection", b"close"), *error_headers(error)]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
