"""The hostile grammars and tools of issue 49 through the server: each is a 400 naming the field
before any decoding (streamed requests too), and the server stays healthy and bounded.

Before: a grammar with no finite string grew the server by gigabytes a second (xgrammar's
jump-forward search, every step), so did a tool whose required parameter holds its own schema;
an empty language ended in a 500 "masking bug"; nested repetition counts took a core for minutes
after the client left. The whole module runs under a memory guard: a regression that lets such a
grammar decode fails fast, naming the test, instead of eating the machine.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from server_helpers import MODEL, PROMPT

pytest.importorskip("xgrammar")

from specdecode.core.device import resident_bytes  # noqa: E402

MEMORY_GUARD_BYTES = 2 * 1024**3  # growth of this process past which the run stops at once
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
SELF_TOOL = [{"type": "function", "function": {"name": "nest", "parameters": SELF_REQUIRED}}]
# Compiles in about a second for the tiny vocabulary: past a 0.25 s limit.
SLOW_SCHEMA = {"type": "object", "required": [f"q{i}" for i in range(900)],
               "properties": {f"q{i}": {"type": "string", "pattern": "[a-z]{1,%d}" % (i % 50 + 1)} for i in range(900)}}


@pytest.fixture(autouse=True, scope="module")
def memory_guard() -> Iterator[None]:
    """Stop the run (exit 3, with a message) if this process grows past the guard."""
    baseline, done = resident_bytes() or 0, threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            grown = (resident_bytes() or 0) - baseline
            if grown > MEMORY_GUARD_BYTES:
                sys.stderr.write(f"memory guard: {__name__} grew by {grown >> 20} MiB; stopping the run\n")
                sys.stderr.flush()
                os._exit(3)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    yield
    done.set()
    thread.join()


def post(base: str, body: dict, chat: bool = False) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, **body}
    if not chat:
        body.setdefault("prompt", PROMPT)
    return httpx.post(base + path, json=body, timeout=60)


HOSTILE = [
    ({"structured_outputs": {"grammar": 'root ::= "a" root'}}, "structured_outputs", "no finite string"),
    ({"structured_outputs": {"grammar": "root ::= x\nx ::= y\ny ::= x"}}, "structured_outputs", "no finite string"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b" x\nx ::= "c" x'}}, "structured_outputs",
     "rule 'x' can be entered but never ends"),
    ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "no finite string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SELF_REQUIRED}}},
     "response_format", "no finite string"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("body", "param", "words"), HOSTILE)
def test_a_grammar_in_which_a_way_cannot_end_is_a_400(served, body: dict, param: str, words: str,
                                                      stream: bool) -> None:
    base, _ = served
    reply = post(base, {**body, "stream": stream})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"] and "cannot be followed" in error["message"]
    assert httpx.get(base + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_whose_parameters_cannot_end_is_a_400(served, stream: bool) -> None:
    base, _ = served
    reply = post(base, {"messages": [{"role": "user", "content": "go"}], "tools": SELF_TOOL,
                        "tool_choice": "required", "stream": stream}, chat=True)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "tool_choice" and "no finite string" in error["message"]
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_a_slow_compile_is_a_400_at_the_limit_and_others_are_served(served) -> None:
    base, dec = served
    timeout = dec.grammars.timeout
    dec.grammars.timeout = 0.25
    try:
        started = time.monotonic()
        reply = post(base, {"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}}})
        assert time.monotonic() - started < 0.25 + 3.0
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "response_format" and "--grammar-timeout 0.25" in error["message"]
    finally:
        dec.grammars.timeout = timeout
    # A plain request and a small schema are served right after.
    assert post(base, {}).status_code == 200
    assert post(base, {"structured_outputs": {"choice": ["yes", "no"]}}).json()["choices"][0]["text"] in ("yes", "no")


def test_a_plain_request_is_not_held_by_compiles_in_flight(served) -> None:
    """Eight requests wait for slow compiles (each about a second, one at a time in the compile
    process): a plain 2-token completion meanwhile is prepared and served at once. Before, the
    waits held asyncio's default threads (6 on 2 cores), which prepare every request."""
    from concurrent.futures import ThreadPoolExecutor

    base, dec = served
    started = time.monotonic()
    assert post(base, {"max_tokens": 2}).status_code == 200
    idle = time.monotonic() - started
    with ThreadPoolExecutor(8) as pool:
        slow = [pool.submit(post, base, {"response_format": {"type": "json_schema", "json_schema": {
            "name": f"slow{i}", "schema": {**SLOW_SCHEMA, "title": f"variant {i}"}}}}) for i in range(8)]
        time.sleep(0.5)  # the compiles are under way
        started = time.monotonic()
        assert post(base, {"max_tokens": 2}).status_code == 200
        during = time.monotonic() - started
        statuses = [future.result().status_code for future in slow]
    assert all(status in (200, 400) for status in statuses), statuses
    assert during < idle + 1.0, (idle, during)
