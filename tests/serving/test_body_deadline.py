"""The body deadline (issue 49 item 1): a request body sent slowly gets a 408 in OpenAI's shape
once --body-timeout has passed since its headers, and its connection is closed; a body that
arrives in time, in pieces, is served; the server keeps serving throughout."""

import json
import socket
import time

import httpx
from server_helpers import MODEL, PROMPT, metric

from specdecode.serving.guard import GuardOptions
from specdecode.serving.server import ServerOptions

BODY_TIMEOUT = 0.6
SLACK_SECONDS = 1.5  # the 408 must come within the deadline plus this (a loaded 2-core machine)
BYTE_EVERY = 0.1  # the slow client's pace: far slower than any real link


def body_bytes(max_tokens: int = 2) -> bytes:
    return json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}).encode()


def headers(length: int | None) -> bytes:
    framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
            .encode())


def read_response(sock: socket.socket, reply: bytes) -> tuple[bytes, bytes, bytes] | None:
    """(status line and headers, body, bytes after the body) once ``reply`` holds a whole response."""
    head, sep, rest = reply.partition(b"\r\n\r\n")
    if not sep:
        return None
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    return (head, rest[:length], rest[length:]) if len(rest) >= length else None


def trickle(port: int, payload: bytes, chunked: bool = False) -> tuple[bytes, bytes, float, bool]:
    """Send the headers at once and ``payload`` a byte every BYTE_EVERY seconds, until the
    server answers. The response's head and body, the seconds from the headers to the answer,
    and whether the server then closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=BYTE_EVERY) as sock:
        sock.sendall(headers(None if chunked else len(payload)))
        started = time.perf_counter()
        reply, sent, writable = b"", 0, True
        while (response := read_response(sock, reply)) is None:
            assert time.perf_counter() - started < BODY_TIMEOUT + SLACK_SECONDS, f"no answer in time: {reply!r}"
            if writable and sent < len(payload):
                byte = payload[sent:sent + 1]
                try:
                    sock.sendall(b"1\r\n" + byte + b"\r\n" if chunked else byte)
                    sent += 1
                except OSError:  # the server answered and closed while the reply was on its way: read it
                    writable = False
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            assert chunk, f"closed without an answer: {reply!r}"
            reply += chunk
        seconds = time.perf_counter() - started
        head, body, after = response
        assert sent < len(payload), "the whole body went out: the test did not send slowly enough"
        sock.settimeout(2)
        try:
            closed = after == b"" and sock.recv(4096) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
    return head, body, seconds, closed


def test_a_body_sent_a_byte_at_a_time_gets_a_408_and_its_connection_closed(start_server) -> None:
    options = ServerOptions(guard=GuardOptions(body_timeout=BODY_TIMEOUT))
    with start_server(options) as (base, _):
        port = int(base.rsplit(":", 1)[1])
        for chunked in (False, True):
            head, body, seconds, closed = trickle(port, body_bytes(), chunked)
            assert head.startswith(b"HTTP/1.1 408"), head
            error = json.loads(body)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == "body_timeout"
            assert "--body-timeout" in error["message"]
            assert b"connection: close" in head.lower()
            assert closed, "the connection stayed open after the 408"
            assert BODY_TIMEOUT <= seconds < BODY_TIMEOUT + SLACK_SECONDS, f"408 after {seconds:.2f} s"
        # The server still serves, and the slow requests reached no engine.
        reply = httpx.post(base + "/v1/completions", content=body_bytes(), headers={"content-type": "application/json"},
                           timeout=30)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0
        assert metric(base, 'specdecode_requests_total{status="ok"}') == 1


def test_a_body_that_arrives_in_pieces_within_the_deadline_is_served(start_server) -> None:
    """Slow but in time: three pieces over about half the deadline decode as one request."""
    options = ServerOptions(guard=GuardOptions(body_timeout=BODY_TIMEOUT * 2))
    with start_server(options) as (base, _):

        def pieces():
            payload = body_bytes()
            third = len(payload) // 3
            for start in range(0, len(payload), third):
                yield payload[start:start + third]
                time.sleep(BODY_TIMEOUT / 4)

        reply = httpx.post(base + "/v1/completions", content=pieces(), headers={"content-type": "application/json"},
                           timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"]


def test_body_timeout_flag() -> None:
    import argparse

    from specdecode.cli.serve import add_serve_parser, server_spec

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert server_spec(parser.parse_args(["serve"])).options.guard.body_timeout == 30.0
    assert server_spec(parser.parse_args(["serve", "--body-timeout", "2.5"])).options.guard.body_timeout == 2.5
    assert server_spec(parser.parse_args(["serve", "--body-timeout", "0"])).options.guard.body_timeout is None
