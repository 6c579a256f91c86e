"""The batch worker's window: when work reaches an idle worker it waits for requests the server
is still reading and tokenizing (``arriving``), and only for them, so that requests sent at the
same moment start in one batch and a lone request does not wait at all. The windows here are
seconds long, far beyond a tiny model's step, so the assertions cannot be timing accidents."""

from __future__ import annotations

import time

import httpx
from helpers import PROMPTS
from server_helpers import MODEL

from specdecode import SamplingParams, SpecDecoder
from specdecode.serving.server import create_app
from specdecode.serving.worker import BatchWorker

LONG_WINDOW = 10.0  # seconds: a test that waited it would be caught by the bounds below


def worker_for(decoder: SpecDecoder, arriving, window: float = LONG_WINDOW) -> BatchWorker:
    engine = decoder.batch_engine(max_batch=4, kv_cache_tokens=1024, cost_aware=False)
    return BatchWorker(engine, batch_window=window, arriving=arriving)


def test_a_lone_request_does_not_wait_for_the_window(tiny_decoder: SpecDecoder) -> None:
    worker = worker_for(tiny_decoder, arriving=lambda: 0)
    try:
        started = time.perf_counter()
        chunks, _ = worker.submit(tiny_decoder.encode(PROMPTS[0]), SamplingParams(max_new_tokens=4), "none")
        assert sum(len(c) for c in chunks) == 4
        assert time.perf_counter() - started < LONG_WINDOW / 4
    finally:
        worker.close()


def test_requests_on_their_way_are_waited_for_and_start_in_one_step(tiny_decoder: SpecDecoder) -> None:
    on_the_way = [1]
    worker = worker_for(tiny_decoder, arriving=lambda: on_the_way[0])
    try:
        params = SamplingParams(max_new_tokens=4)
        first, _ = worker.submit(tiny_decoder.encode(PROMPTS[0]), params, "none")
        time.sleep(0.3)  # the second request is still "being tokenized"
        assert not worker.recent_steps, "the worker waits while a request is on its way"
        second_submitted = time.perf_counter()
        second, _ = worker.submit(tiny_decoder.encode(PROMPTS[1]), params, "none")
        on_the_way[0] = 0
        assert sum(len(c) for c in first) == 4 and sum(len(c) for c in second) == 4
        first_step_started = worker.recent_steps[0][0]
        assert first_step_started >= second_submitted
        assert first_step_started - second_submitted < LONG_WINDOW / 4
    finally:
        worker.close()


def test_the_window_bounds_the_wait_for_a_request_that_never_comes(tiny_decoder: SpecDecoder) -> None:
    worker = worker_for(tiny_decoder, arriving=lambda: 1, window=0.3)
    try:
        started = time.perf_counter()
        chunks, _ = worker.submit(tiny_decoder.encode(PROMPTS[0]), SamplingParams(max_new_tokens=4), "none")
        assert sum(len(c) for c in chunks) == 4
        assert 0.3 <= worker.recent_steps[0][0] - started < 5.0
    finally:
        worker.close()


def test_the_server_counts_requests_until_they_are_submitted(tiny_decoder: SpecDecoder) -> None:
    worker = worker_for(tiny_decoder, arriving=None)
    try:
        app = create_app(tiny_decoder, MODEL, worker=worker)
        state = app.state.specdecode
        assert worker.arriving is not None and worker.arriving() == 0
        state.arriving += 1
        assert worker.arriving() == 1  # the worker reads the server's live count
        state.arriving -= 1
    finally:
        worker.close()


def test_a_server_request_finds_nobody_arriving_once_submitted(start_server) -> None:
    with start_server() as (base, state):
        seen: list[int] = []
        original = state.worker.submit

        def submit(*args, **kwargs):
            seen.append(state.arriving)  # the request itself is still counted while it submits
            return original(*args, **kwargs)

        state.worker.submit = submit
        response = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0],
                                                              "max_tokens": 3, "method": "none"}, timeout=60)
        assert response.status_code == 200, response.text
        assert seen == [1] and state.arriving == 0
