"""Helpers for the server tests: a uvicorn server in a thread on a free loopback port, /metrics
reads, server-sent events."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import uvicorn

MODEL = "tiny"
PROMPT = "def quicksort(arr):"
MESSAGES = [{"role": "user", "content": "Write a quicksort"}]
START_TIMEOUT_SECONDS = 20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(app: Any) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + START_TIMEOUT_SECONDS
    while not server.started:
        assert time.time() < deadline, "the server did not start"
        assert thread.is_alive(), "the server thread died"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def client(base: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=60)


def metric(base: str, name: str, headers: dict[str, str] | None = None) -> float:
    text = httpx.get(base + "/metrics", headers=headers).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.05)


def sse_data(lines: Iterator[str]) -> list[str]:
    """The payloads of a server-sent event stream's ``data:`` lines."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


@contextmanager
def running_limited_server(app: Any, **connections: Any) -> Iterator[tuple[str, uvicorn.Server]]:
    """Serve ``app`` as ``specdecode serve`` does, with its connection settings
    (``serving/connections.py: uvicorn_config``; ``connections`` are its keyword arguments:
    ``max_connections``, ``header_timeout``, ...); yields its base URL and the uvicorn server."""
    from specdecode.serving.connections import uvicorn_config

    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning", **connections))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "the server did not start", START_TIMEOUT_SECONDS)
    assert thread.is_alive(), "the server thread died"
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
