"""Fair scheduling under load through the server (issue 32 item 1's bound; slow, run by .ci/run).

Six long streamed generations share a four-seat batch; once the running ones have decoded more
than a time slice, a short request arrives. Its time to first token from its submission to the
batch worker (``first_token_seconds``: HTTP parsing and tokenizing before it are not the
scheduler's) must be at most two of the longest steps the batch ran meanwhile plus its own
prefill: the step running when it arrived, then the step that prefills and decodes it. Step times come from the worker's own record
(``BatchWorker.recent_steps``). With time slices off the same request waits for a long
generation to end, far past the bound: the check has teeth. Torch and llama.cpp tiny models.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import decoder, llamacpp_decoder
from server_helpers import MODEL, running_server, wait_for

from specdecode import SchedulerConfig
from specdecode.serving.server import create_app
from specdecode.serving.worker import BatchWorker

SEATS = 4
LONGS = 6
LONG_TOKENS = 240
SLICE = 16


class Stream(threading.Thread):
    """One streamed completion; records when each chunk arrived and the final metrics."""

    def __init__(self, base: str, prompt: str, max_tokens: int, eos: list[int]) -> None:
        super().__init__(daemon=True)
        self.body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                     "stream_options": {"include_usage": True}, "method": "none",
                     "logit_bias": {str(t): -100 for t in eos}}  # long generations: never stop early
        self.base = base
        self.sent = 0.0
        self.chunks: list[float] = []
        self.metrics: dict = {}
        self.tokens = 0

    def run(self) -> None:
        self.sent = time.perf_counter()
        with httpx.stream("POST", self.base + "/v1/completions", json=self.body, timeout=300) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    self.metrics, self.tokens = chunk["specdecode"], chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0].get("text"):
                    self.chunks.append(time.perf_counter())


def short_request_under_load(dec, scheduling: SchedulerConfig) -> tuple[Stream, float]:
    """The short request's stream and the longest batch step while it waited for its first token."""
    engine = dec.batch_engine(max_batch=SEATS, kv_cache_tokens=SEATS * 512, cost_aware=False, scheduling=scheduling)
    worker = BatchWorker(engine)
    try:
        with running_server(create_app(dec, MODEL, worker=worker)) as base:
            eos = sorted(dec.eos_token_ids)
            longs = [Stream(base, f"Long story number {i}:", LONG_TOKENS, eos) for i in range(LONGS)]
            for stream in longs:
                stream.start()
            wait_for(lambda: sum(len(s.chunks) >= SLICE + 8 for s in longs) >= SEATS, "the batch did not fill", 120)
            short = Stream(base, "Hi", 4, [])
            short.start()
            short.join(timeout=300)
            for stream in longs:
                stream.join(timeout=300)
            assert short.chunks and all(s.tokens == LONG_TOKENS for s in longs)
            first = short.chunks[0]
            longest = max(end - start for start, end in worker.recent_steps if end > short.sent and start < first)
            return short, longest
    finally:
        worker.close()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "llama.cpp"])
def test_a_short_request_waits_at_most_two_steps_behind_a_full_batch(backend: str, tiny_qwen2_dir: Path,
                                                                     tiny_ggufs: dict[str, Path]) -> None:
    if backend == "torch":
        dec = decoder(tiny_qwen2_dir, None, "none")
    else:
        pytest.importorskip("llama_cpp")
        dec = llamacpp_decoder(tiny_ggufs["target"], None)
    short, longest = short_request_under_load(dec, SchedulerConfig(time_slice=SLICE))
    waited = short.metrics["first_token_seconds"]
    bound = 2 * longest + short.metrics["prefill_seconds"]
    assert 0 < waited <= bound, f"first token after {waited:.4f} s; bound {bound:.4f} s (longest step {longest:.4f} s)"
    if backend == "torch":  # the same arrival without time slices waits for a long generation to end
        unfair, unfair_longest = short_request_under_load(dec, SchedulerConfig(time_slice=0))
        assert unfair.metrics["first_token_seconds"] > 2 * unfair_longest + unfair.metrics["prefill_seconds"]
