"""The middleware Ray Serve's proxy runs for us (serving/ray_proxy.py), driven as an ASGI app with
inner apps that stand for what the proxy's own app does when a replica dies: return before a
response starts, or stop in the middle of a body. Needs no Ray."""

import asyncio
import json
from typing import Any

from specdecode.serving.ray_proxy import ReplicaFailureErrors, proxy_middlewares

SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


def call(inner: Any) -> list[dict]:
    """The messages the middleware sends for one GET, with ``inner`` as the proxy's app."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(ReplicaFailureErrors(inner)(scope, receive, send))
    return sent


def body_of(sent: list[dict]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_a_request_with_no_response_gets_an_openai_503() -> None:
    async def died_before_answering(scope, receive, send) -> None:
        return  # as Ray's proxy does on ActorDiedError: nothing sent

    sent = call(died_before_answering)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 503
    error = json.loads(body_of(sent))["error"]
    assert error["code"] == "replica_unavailable" and error["type"] == "server_error"
    assert "Retry the request" in error["message"]
    assert sent[-1]["more_body"] is False


def test_a_cut_stream_ends_with_an_error_event_and_done() -> None:
    async def died_mid_stream(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await send({"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True})

    sent = call(died_mid_stream)
    events = [line for line in body_of(sent).decode().split("\n\n") if line]
    assert events[0] == 'data: {"choices": []}'
    assert json.loads(events[1][len("data: "):])["error"]["code"] == "replica_unavailable"
    assert events[2] == "data: [DONE]" and sent[-1]["more_body"] is False


def test_complete_responses_and_cut_json_bodies_pass_through_untouched() -> None:
    async def complete(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def cut_json(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": b'{"choi', "more_body": True})

    assert body_of(call(complete)) == b"data: [DONE]\n\n" and len(call(complete)) == 2
    # Half a JSON body cannot be mended: left for the proxy to close the connection.
    assert body_of(call(cut_json)) == b'{"choi' and len(call(cut_json)) == 2


def test_ray_gets_a_list_of_starlette_middlewares() -> None:
    from starlette.middleware import Middleware

    middlewares = proxy_middlewares()
    assert len(middlewares) == 1 and isinstance(middlewares[0], Middleware)
    assert middlewares[0].cls is ReplicaFailureErrors
