"""Method auto through the server: its requests decode in the batch engine (several in one batch
at once), not one at a time on the single-sequence engine, and greedy text equals the library's."""

import threading

import pytest
from server_helpers import MODEL, PROMPT, client
from server_helpers import metric as read_metric

from specdecode import SamplingParams
from specdecode.engine.batch import BatchEngine

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "1, 2, 3, 1, 2, 3, 1, 2, 3,", PROMPT]


def record_auto_rows(engine: BatchEngine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap the engine's step: the number of auto requests decoding at each step."""
    real_step = engine.step
    seen: list[int] = []

    def step():
        seen.append(sum(seq.state.method == "auto" for seq in engine.scheduler.running))
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    return seen


def test_auto_requests_are_batched_and_equal_the_librarys_greedy_text(start_server, tiny_decoder,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    expected = [tiny_decoder.generate(p, SamplingParams(max_new_tokens=24), method="auto").text for p in PROMPTS]
    with start_server() as (base, state):
        seen = record_auto_rows(state.worker.engine, monkeypatch)
        results: list[str | None] = [None] * len(PROMPTS)
        methods: list[str | None] = [None] * len(PROMPTS)
        start = threading.Barrier(len(PROMPTS))

        def ask(i: int) -> None:
            start.wait()
            reply = client(base).completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                                    extra_body={"method": "auto"})
            results[i], methods[i] = reply.choices[0].text, reply.model_extra["specdecode"]["method"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert results == expected and methods == ["auto"] * len(PROMPTS)
        # n = 2: the choices are submitted together, so they share the batch for certain.
        reply = client(base).completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, n=2,
                                                extra_body={"method": "auto"})
        assert [c.text for c in reply.choices] == [tiny_decoder.generate(
            PROMPT, SamplingParams(max_new_tokens=16), method="auto").text] * 2
        assert max(seen, default=0) >= 2, "auto requests never shared a batch step"
        assert read_metric(base, "specdecode_kv_blocks_used") == 0 and read_metric(base, "specdecode_batch_size") == 0
