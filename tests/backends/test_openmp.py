"""A thread that stops decoding keeps no OpenMP helper threads (backends/openmp.py: libgomp
throttled every pass's barriers once teams of several threads held more threads than the
cores, ~30% slower passes on two cores). Speed is the benchmarks' business; what is tested is
the mechanism: the helper threads the passes started are gone after each API call, after a
request, and once the batch worker is idle. Threads are counted in /proc/self/task (Linux)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import llamacpp_decoder

pytest.importorskip("llama_cpp")

from specdecode import SamplingParams
from specdecode.backends.llamacpp import LlamaCppModel, physical_core_count
from specdecode.backends.openmp import release_thread_team
from specdecode.serving.worker import BatchWorker

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or physical_core_count() < 2,
    reason="needs Linux's task list and two cores (a one-thread pass starts no helper)",
)

PROMPT = [509, 5, 300, 200, 45, 67, 88, 12]


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_task_count(expected: int, timeout: float = 5.0) -> int:
    """The task count once it equals ``expected`` (helpers exit asynchronously), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (count := task_count()) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def in_thread(fn: Callable[[], object]) -> None:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # re-raised in the test's thread
            errors.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    if errors:
        raise errors[0]


def test_releasing_frees_the_helpers_a_pass_started(tiny_ggufs: dict[str, Path]) -> None:
    counts: dict[str, int] = {}

    def run() -> None:
        with LlamaCppModel(tiny_ggufs["target"], n_ctx=64, n_threads=2, kv_type="f32", flash_attn=False) as model:
            counts["before"] = task_count()
            model.forward(0, PROMPT, 0, logits="last")
            counts["after pass"] = task_count()
            release_thread_team()
            counts["released"] = settled_task_count(counts["before"])

    in_thread(run)
    assert counts["after pass"] > counts["before"], "a two-thread pass starts an OpenMP helper"
    assert counts["released"] == counts["before"]


def test_requests_and_api_calls_leave_no_helpers(tiny_ggufs: dict[str, Path]) -> None:
    decoder = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    params = SamplingParams(max_new_tokens=6)
    counts: dict[str, int] = {}

    def run() -> None:
        counts["before"] = task_count()
        decoder.generate(PROMPT, params)  # the single-sequence engine
        counts["generate"] = settled_task_count(counts["before"])
        decoder.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0.8, seed=1))  # sampled
        counts["sampled"] = settled_task_count(counts["before"])
        engine = decoder.batch_engine(max_batch=2, kv_cache_tokens=1024)  # times passes
        counts["batch_engine"] = settled_task_count(counts["before"])
        decoder.generate_batch([PROMPT, PROMPT[:5]], params, engine=engine)
        counts["generate_batch"] = settled_task_count(counts["before"])

    in_thread(run)
    assert counts == {name: counts["before"] for name in counts}


def test_an_idle_batch_worker_keeps_no_helpers(tiny_ggufs: dict[str, Path]) -> None:
    decoder = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    engine = decoder.batch_engine(max_batch=2, kv_cache_tokens=1024, cost_aware=False)
    before = task_count()
    worker = BatchWorker(engine, batch_window=0)
    try:
        chunks, _ = worker.submit(PROMPT, SamplingParams(max_new_tokens=6), "draft", 3)
        assert sum(len(chunk) for chunk in chunks) == 6
        assert settled_task_count(before + 1) == before + 1  # the worker's own thread only
    finally:
        worker.close()
