"""Backpressure and the connection limit (issue 49 items 2 and 3): one request, or one burst,
cannot take the server down.

A burst past --max-waiting gets whole completions for the requests admitted and a 429 with
Retry-After, at once, for the rest, streams included: none is lost or half-sent. A request that
waits past --max-queue-time without starting gets a 503 with Retry-After, a stream too (its 200
waits until it starts). Past --max-connections, requests get OpenAI's 503 with Retry-After while
/health is answered, and connections past a hard cap above it are closed unread.
"""

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import httpx
import pytest
from server_helpers import MODEL, PROMPT, metric, running_limited_server, running_server, sse_data, wait_for

import specdecode.engine.batch
from specdecode import SchedulerConfig, SpecDecoder
from specdecode.serving.connections import CONNECTION_HEADROOM
from specdecode.serving.server import ServerOptions, create_app
from specdecode.serving.state import MIN_MAX_WAITING, WAITING_PER_BATCH_SEAT
from specdecode.serving.worker import BatchWorker

STEP_SECONDS = 0.05  # every batched verify pass, slowed: a request of LONG_TOKENS outlasts the burst
LONG_TOKENS = 30  # method none: one token a step, so 1.5 s a request
REFUSAL_SECONDS = 1.5  # a refusal comes within this (about 1 s asked; slack for a loaded 2-core machine)
OVERLOADED = 'specdecode_requests_total{status="overloaded"}'
QUEUE_TIMEOUTS = 'specdecode_requests_total{status="queue_timeout"}'


@pytest.fixture
def slow_server(tiny_decoder: SpecDecoder, monkeypatch) -> Callable[..., AbstractContextManager[tuple[str, object]]]:
    """``with slow_server(options, max_batch) as (base, state):`` a server whose batched steps
    each take STEP_SECONDS more, without time slices (a running request keeps its seat, so a
    queued one waits for it to end)."""
    real = specdecode.engine.batch.BatchEngine._verify

    def slow(self, running, proposals):
        time.sleep(STEP_SECONDS)
        return real(self, running, proposals)

    monkeypatch.setattr(specdecode.engine.batch.BatchEngine, "_verify", slow)

    @contextmanager
    def start(options: ServerOptions, max_batch: int = 1) -> Iterator[tuple[str, object]]:
        engine = tiny_decoder.batch_engine(max_batch=max_batch, kv_cache_tokens=1024, cost_aware=False,
                                           scheduling=SchedulerConfig(time_slice=0))
        worker = BatchWorker(engine)
        app = create_app(tiny_decoder, MODEL, worker=worker, options=options)
        try:
            with running_server(app) as base:
                yield base, app.state.specdecode
        finally:
            worker.close()

    return start


def long_body(dec: SpecDecoder, method: str = "none", **extra) -> dict:
    """A request that decodes exactly LONG_TOKENS tokens (end of sequence banned)."""
    ban_eos = {str(token): -100 for token in dec.eos_token_ids}
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "method": method,
            "logit_bias": ban_eos} | extra


def assert_refusal(status: int, headers: httpx.Headers, body: str, expected: int, code: str) -> None:
    assert status == expected, body
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert int(headers["retry-after"]) >= 1


class Outcome:
    """What one client got: a whole completion, a refusal, or something else (a failure)."""

    def __init__(self) -> None:
        self.status = 0
        self.headers = httpx.Headers()
        self.body = ""
        self.events: list[str] = []
        self.seconds = 0.0


def send(base: str, body: dict) -> Outcome:
    outcome = Outcome()
    started = time.perf_counter()
    if body.get("stream"):
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
            outcome.status, outcome.headers = response.status_code, response.headers
            if response.status_code == 200:
                outcome.events = sse_data(response.iter_lines())
            else:
                outcome.body = response.read().decode()
    else:
        response = httpx.post(base + "/v1/completions", json=body, timeout=60)
        outcome.status, outcome.headers, outcome.body = response.status_code, response.headers, response.text
    outcome.seconds = time.perf_counter() - started
    return outcome


def assert_whole(outcome: Outcome) -> None:
    """A complete completion of LONG_TOKENS tokens: no error, nothing cut."""
    assert outcome.status == 200, outcome.body
    if outcome.events:
        assert outcome.events[-1] == "[DONE]", outcome.events[-3:]
        chunks = [json.loads(event) for event in outcome.events[:-1]]
        assert not any("error" in chunk for chunk in chunks), chunks[-1]
        assert chunks[-1]["usage"]["completion_tokens"] == LONG_TOKENS
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        reply = json.loads(outcome.body)
        assert reply["usage"]["completion_tokens"] == LONG_TOKENS and reply["choices"][0]["finish_reason"] == "length"


def test_a_burst_past_max_waiting_is_served_whole_or_refused_at_once(slow_server, tiny_decoder) -> None:
    """Two seats, two may wait: of a burst of 8 (streams and not) sent while the first decode,
    exactly 4 complete whole and 4 get a 429 with Retry-After within about a second."""
    seats, waiting, burst = 2, 2, 8
    with slow_server(ServerOptions(max_waiting=waiting, max_queue_time=None), max_batch=seats) as (base, state):
        outcomes: list[Outcome | None] = [None] * burst

        def ask(i: int) -> None:
            outcomes[i] = send(base, long_body(tiny_decoder, stream=i % 2 == 1))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(burst)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert all(outcome is not None for outcome in outcomes), "a client got no answer"
        served = [o for o in outcomes if o.status == 200]
        refused = [o for o in outcomes if o.status != 200]
        for outcome in served:
            assert_whole(outcome)
        for outcome in refused:
            assert_refusal(outcome.status, outcome.headers, outcome.body, 429, "server_overloaded")
            assert outcome.seconds < REFUSAL_SECONDS, f"a refusal took {outcome.seconds:.2f} s"
        assert len(served) == seats + waiting and len(refused) == burst - seats - waiting
        assert metric(base, OVERLOADED) == len(refused)
        assert metric(base, 'specdecode_requests_total{status="ok"}') == len(served)
        wait_for(lambda: metric(base, "specdecode_kv_blocks_used") == 0, "a request kept its KV blocks")
        assert state.worker.waiting == 0 and not state.inflight
        # Room again: the next request is served.
        assert send(base, long_body(tiny_decoder, max_tokens=2)).status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_queued_past_max_queue_time_gets_a_503(slow_server, tiny_decoder, stream: bool) -> None:
    """One seat, taken by a 1.5 s request: a second request waits and is ended with a 503 and
    Retry-After after --max-queue-time (0.5 s); a stream gets that 503 as its status, not an
    error event after a 200. The first request completes whole."""
    queue_time = 0.5
    with slow_server(ServerOptions(max_queue_time=queue_time), max_batch=1) as (base, state):
        first: list[Outcome] = []
        runner = threading.Thread(target=lambda: first.append(send(base, long_body(tiny_decoder))))
        runner.start()
        wait_for(lambda: metric(base, "specdecode_requests_running") == 1, "the first request did not start")
        late = send(base, long_body(tiny_decoder, stream=stream))
        assert_refusal(late.status, late.headers, late.body, 503, "queue_timeout")
        assert queue_time <= late.seconds < queue_time + REFUSAL_SECONDS, f"503 after {late.seconds:.2f} s"
        runner.join(timeout=60)
        assert_whole(first[0])
        wait_for(lambda: metric(base, QUEUE_TIMEOUTS) == 1, "the queue timeout was not counted")
        wait_for(lambda: metric(base, "specdecode_kv_blocks_used") == 0, "the ended request kept its KV blocks")
        assert not state.inflight


def test_a_stream_that_starts_in_time_is_served_whole(slow_server, tiny_decoder) -> None:
    """The stream's 200 waits for its start: queued behind a 1.5 s request with a 10 s limit, it
    starts once the first ends and streams whole."""
    with slow_server(ServerOptions(max_queue_time=10.0), max_batch=1) as (base, _):
        first: list[Outcome] = []
        runner = threading.Thread(target=lambda: first.append(send(base, long_body(tiny_decoder))))
        runner.start()
        wait_for(lambda: metric(base, "specdecode_requests_running") == 1, "the first request did not start")
        second = send(base, long_body(tiny_decoder, stream=True))
        runner.join(timeout=60)
        assert_whole(first[0])
        assert_whole(second)


def test_health_is_answered_while_the_request_limit_is_full(tiny_decoder) -> None:
    """--max-connections 2, both taken by requests whose bodies have not come: /health answers
    200, other routes a 503 in OpenAI's shape with Retry-After (counted as overloaded). Past the
    hard cap (the limit plus CONNECTION_HEADROOM connections) a new connection is closed unread.
    Once the clients leave, requests are served again."""
    worker = BatchWorker(tiny_decoder.batch_engine(max_batch=2, kv_cache_tokens=512, cost_aware=False))
    app = create_app(tiny_decoder, MODEL, worker)
    with running_limited_server(app, max_connections=2) as (base, server):
        port = int(base.rsplit(":", 1)[1])
        slow = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        extra: list[socket.socket] = []
        try:
            for sock in slow:  # headers whole, body never sent: a request in flight in the guard
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 100\r\n\r\n")
            wait_for(lambda: app.limit.requests == 2, "the slow requests did not arrive")
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as http:
                for _ in range(3):
                    assert http.get(base + "/health").status_code == 200
                    refused = http.get(base + "/v1/models")
                    assert_refusal(refused.status_code, refused.headers, refused.text, 503, "too_many_connections")
            # Idle connections up to the hard cap are accepted; the one past it is closed at once.
            extra = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(CONNECTION_HEADROOM)]
            wait_for(lambda: len(server.server_state.connections) >= 2 + CONNECTION_HEADROOM, "connections not accepted")
            with socket.create_connection(("127.0.0.1", port), timeout=5) as past:
                past.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                try:
                    assert past.recv(4096) == b"", "a connection past the hard cap was answered"
                except ConnectionResetError:
                    pass
        finally:
            for sock in slow + extra:
                sock.close()
        wait_for(lambda: app.limit.requests == 0 and app.limit.connections == 0, "the limit's counts stayed up")
        assert metric(base, OVERLOADED) == 3  # /metrics too was refused while the limit was full
        assert httpx.get(base + "/v1/models").status_code == 200
        reply = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert reply.status_code == 200, reply.text


def test_backpressure_flags_and_defaults(start_server) -> None:
    import argparse

    from specdecode.cli.serve import add_serve_parser, server_spec

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    options = server_spec(parser.parse_args(["serve"])).options
    assert options.max_waiting is None and options.max_queue_time == 30.0 and options.max_connections == 512
    options = server_spec(parser.parse_args(["serve", "--max-waiting", "5", "--max-queue-time", "0"])).options
    assert options.max_waiting == 5 and options.max_queue_time is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-waiting", "0"])
    with start_server(max_batch=4) as (_, state):  # sized from the batch, with a floor
        assert state.max_waiting == max(MIN_MAX_WAITING, WAITING_PER_BATCH_SEAT * 4)
    with start_server(ServerOptions(max_waiting=3), max_batch=4) as (_, state):
        assert state.max_waiting == 3
