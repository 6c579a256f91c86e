"""The OpenAI-compatible server: the official openai client, streaming, metrics, bad input, cancellation."""

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import MESSAGES, MODEL, PROMPT
from server_helpers import client as _client
from server_helpers import metric as _metric

from specdecode import SamplingParams
from specdecode.serving.server import APIError, parse_request


def test_completions_with_the_openai_client(served) -> None:
    base, dec = served
    expected = dec.generate(PROMPT, SamplingParams(max_new_tokens=12)).text
    client = _client(base)
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert result.choices[0].text == expected
    assert result.usage.completion_tokens > 0 and result.choices[0].finish_reason in ("stop", "length")
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_completions_with_the_openai_client(served) -> None:
    base, dec = served
    expected = dec.generate(MESSAGES, SamplingParams(max_new_tokens=10), chat=True).text
    client = _client(base)
    result = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    assert result.choices[0].message.content == expected and result.choices[0].message.role == "assistant"
    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == expected
    # A per-request method (an extension field) keeps greedy output.
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body={"method": "none"})
    assert plain.choices[0].message.content == expected


def test_models_health_and_metrics(served) -> None:
    base, _ = served
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    assert [m.id for m in _client(base).models.list()] == [MODEL]
    _client(base).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(base + "/metrics").text
    assert "# TYPE specdecode_requests_total counter" in text
    assert _metric(base, 'specdecode_requests_total{status="ok"}') >= 1
    assert _metric(base, "specdecode_generated_tokens_total") >= 4
    assert _metric(base, "specdecode_tau") >= 1.0
    assert _metric(base, "specdecode_requests_running") == 0 and _metric(base, "specdecode_kv_blocks_used") == 0
    assert _metric(base, "specdecode_kv_blocks_used") == 0 and _metric(base, "specdecode_kv_blocks_total") > 0


def test_concurrent_requests_share_the_batch_and_match_their_single_outputs(served) -> None:
    """Greedy requests of mixed methods and lengths sent at once, all in the batch, each get what
    they get alone; every KV block comes back."""
    base, dec = served
    cases = [("def quicksort(arr):", "draft", 14), ("The quick brown fox", "none", 9),
             ("1, 2, 3, 4, 5,", "ngram", 16), ("x", "draft", 5), ("import numpy as np", "auto", 8)]
    expected = [dec.generate(p, SamplingParams(max_new_tokens=n), method=m).text for p, m, n in cases]
    results: list[str | None] = [None] * len(cases)

    def ask(i: int) -> None:
        prompt, method, n = cases[i]
        out = _client(base).completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                               extra_body={"method": method})
        results[i] = out.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == expected
    assert _metric(base, "specdecode_kv_blocks_used") == 0 and _metric(base, "specdecode_batch_size") == 0


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
        ({"prompt": PROMPT}, 400, "model"),
        ({"model": MODEL, "prompt": PROMPT, "max_tokens": -3}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": PROMPT, "max_tokens": 10**9}, 400, "prompt"),
        ({"model": MODEL, "prompt": PROMPT, "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": PROMPT, "temperature": 5}, 400, "temperature"),
        ({"model": MODEL, "prompt": PROMPT, "temperature": True}, 400, "temperature"),
        ({"model": MODEL, "prompt": PROMPT, "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": PROMPT, "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": PROMPT, "stop": [1, 2]}, 400, "stop"),
        ({"model": MODEL, "prompt": PROMPT, "method": "magic"}, 400, "method"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "word " * 2000, "max_tokens": 4}, 400, "prompt"),
        ({"model": MODEL, "prompt": "word " * 2000, "max_tokens": 4, "stream": True}, 400, "prompt"),
    ],
)
def test_bad_input_gets_an_openai_style_4xx(served, body: dict, status: int, param: str) -> None:
    base, _ = served
    response = httpx.post(base + "/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_library_errors_name_what_a_client_sets(served) -> None:
    """A library error a request causes names the request's field (max_tokens, not the library's
    max_new_tokens) and the server's flags."""
    from specdecode.errors import InvalidRequestError
    from specdecode.serving.api_errors import client_message

    base, _ = served
    response = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 10**9})
    message = response.json()["error"]["message"]
    assert response.status_code == 400 and "max_tokens=1000000000" in message and "max_new_tokens" not in message
    worded = client_message(InvalidRequestError("lower max_new_tokens= or raise kv_cache_tokens=; n_ctx=8"))
    assert worded == "lower max_tokens or raise --kv-cache-tokens; n_ctx=8"
    assert "/v1/completions" in client_message(InvalidRequestError("no chat template; give the prompt without chat=True."))


def test_malformed_json_and_unknown_routes_and_the_server_keeps_serving(served) -> None:
    base, _ = served
    response = httpx.post(base + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    bad_chat = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "messages"
    assert httpx.get(base + "/v2/nothing").status_code == 404
    with pytest.raises(openai.NotFoundError):
        _client(base).completions.create(model="other", prompt=PROMPT, max_tokens=2)
    ok = _client(base).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens > 0


def test_a_disconnected_stream_is_cancelled(served, monkeypatch) -> None:
    base, dec = served
    real_token_stream = dec.token_stream

    class Slow:  # 50 ms per delta, so the client leaves mid-generation
        def __init__(self, stream) -> None:
            self.stream, self.stats = stream, stream.stats

        @property
        def token_count(self) -> int:
            return self.stream.token_count

        def __iter__(self):
            for delta in self.stream:
                time.sleep(0.05)
                yield delta

    def slow_token_stream(*args, **kwargs):  # every request's text, from the batch's tokens
        return Slow(real_token_stream(*args, **kwargs))

    monkeypatch.setattr(dec, "token_stream", slow_token_stream)
    cancelled = _metric(base, 'specdecode_requests_total{status="cancelled"}')
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "seed": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # one event, then hang up
    deadline = time.time() + 10
    while _metric(base, 'specdecode_requests_total{status="cancelled"}') == cancelled:
        assert time.time() < deadline, "the request was not cancelled"
        time.sleep(0.05)
    assert _metric(base, "specdecode_requests_running") == 0 and _metric(base, "specdecode_kv_blocks_used") == 0
    deadline = time.time() + 10
    while _metric(base, "specdecode_kv_blocks_used") != 0:  # the worker frees them before its next step
        assert time.time() < deadline, "the cancelled request kept its KV blocks"
        time.sleep(0.05)
    monkeypatch.undo()
    assert _client(base).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0).usage.completion_tokens > 0


def test_parse_request_defaults_and_errors() -> None:
    req = parse_request({"model": "m", "prompt": "hi"}, chat=False, served_names=("m",), methods=("none",))
    assert req.params.max_new_tokens == 16 and req.params.temperature == 1.0 and not req.stream
    chat = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
                          "stop": "\n"}, chat=True, served_names=("m",), methods=("none",))
    assert chat.params.max_new_tokens == 5 and chat.params.stop == ("\n",)
    with pytest.raises(APIError) as err:
        parse_request([1, 2], chat=False, served_names=("m",), methods=())
    assert err.value.status == 400
    body = json.loads(json.dumps(err.value.body()))
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_load_test_script_runs_against_the_server(served) -> None:
    import asyncio
    import importlib.util

    base, _ = served
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py"
    spec = importlib.util.spec_from_file_location("load_test", path)
    load_test = importlib.util.module_from_spec(spec)
    import sys

    sys.modules["load_test"] = load_test  # dataclasses look their module up there
    spec.loader.exec_module(load_test)
    row = asyncio.run(load_test.run_level(base, MODEL, "draft", concurrency=3, requests=4, max_tokens=6))
    assert row["completed"] == 4 and not row["errors"] and row["completion_tokens"] > 0
    assert row["ttft_seconds"]["p50"] is not None


def test_logprobs_and_penalties_with_the_openai_client(served) -> None:
    """Chat logprobs (top_logprobs) and completions logprobs, streamed and not, equal the library's
    for the same request; penalties and logit_bias reach the engine (the output is the library's
    penalised output)."""
    base, dec = served
    client = _client(base)
    params = SamplingParams(max_new_tokens=8, logprobs=3)
    expected = dec.generate(MESSAGES, params, chat=True)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert "".join(c.token for c in content) == expected.text
    streamed = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=3, stream=True))
    streamed_content = [c for chunk in streamed if chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed_content] == pytest.approx([c.logprob for c in content], abs=1e-4)

    plain = dec.generate(PROMPT, SamplingParams(max_new_tokens=6, logprobs=2))
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)
    assert logprobs.text_offset[0] == 0 and "".join(logprobs.tokens) == completion.choices[0].text
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
        assert token in top and len(top) <= 3  # the top two and the chosen token (OpenAI's legacy shape)

    penalised = SamplingParams(max_new_tokens=10, frequency_penalty=1.0, presence_penalty=0.5, logit_bias={17: 2.0},
                               repetition_penalty=1.2, min_p=0.05)
    want = dec.generate(PROMPT, penalised).text
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, frequency_penalty=1.0,
                                    presence_penalty=0.5, logit_bias={"17": 2.0},
                                    extra_body={"repetition_penalty": 1.2, "min_p": 0.05})
    assert got.choices[0].text == want
