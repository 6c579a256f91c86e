"""The server against a hostile client (issue 19): sampling values that overflow, a request
that fails inside a batched step, large and malformed bodies, disconnects, unsupported
fields, the API key, Host and Content-Type checks, timeouts, and k."""

import json
import socket
import threading
import time

import httpx
import pytest
from server_helpers import MESSAGES, MODEL, PROMPT, client, metric, sse_data, wait_for

import specdecode.api
import specdecode.core.sampling
import specdecode.engine.batch
import specdecode.loading
import specdecode.models.loader
from specdecode import SamplingParams
from specdecode.serving.guard import GuardOptions, default_allowed_hosts
from specdecode.serving.server import ServerOptions

BROKEN_TEMPERATURE = 0.77  # requests at this temperature raise in sampling (injected)


def post(base: str, body: dict, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    return httpx.post(base + path, json=body, **({"timeout": 30} | kwargs))


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def slow_steps(monkeypatch, seconds: float) -> list[int]:
    """Make every batched verify pass take ``seconds`` longer; returns the batch sizes seen (of
    each step's drafting, then of its verify pass: a sampled draft also samples)."""
    real_verify, real_draft = specdecode.engine.batch.BatchEngine._verify, specdecode.engine.batch.BatchEngine._draft
    sizes: list[int] = []

    def slow(self, running, proposals):
        sizes.append(len(running))
        time.sleep(seconds)
        return real_verify(self, running, proposals)

    def draft(self, running, wanted, forced):
        sizes.append(len(running))
        return real_draft(self, running, wanted, forced)

    monkeypatch.setattr(specdecode.engine.batch.BatchEngine, "_verify", slow)
    monkeypatch.setattr(specdecode.engine.batch.BatchEngine, "_draft", draft)
    return sizes


# --- 1. one request must not fail the batch --------------------------------------------------
def test_tiny_temperature_and_top_p_decode_greedily_beside_other_requests(served) -> None:
    """temperature 1e-300 and top_p 5e-324 once gave NaN probabilities, and the batch they shared
    failed. Now they are greedy (the argmax is all either leaves), sent at once with a plain request."""
    base, dec = served
    expected = dec.generate(PROMPT, SamplingParams(max_new_tokens=10)).text
    bodies = [{"temperature": 0}, {"temperature": 1e-300}, {"temperature": 1.0, "top_p": 5e-324, "seed": 1},
              {"temperature": 1e-300, "stream": True}]
    results: list[str | None] = [None] * len(bodies)

    def ask(i: int) -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "method": "draft"} | bodies[i]
        if body.get("stream"):
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as response:
                events = sse_data(response.iter_lines())
            assert events[-1] == "[DONE]", events
            results[i] = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        else:
            response = post(base, body)
            assert response.status_code == 200, response.text
            results[i] = response.json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [expected] * len(bodies)


def test_a_request_whose_sampling_raises_fails_alone(served, monkeypatch) -> None:
    """One request's sampling raises (injected) in a step it shares with a greedy stream: it gets
    a 500 with an OpenAI body, the stream completes with its single-request output."""
    base, dec = served
    # Long enough to share steps with the failing request (its end tokens banned): the close
    # draft's rows accept ~5 tokens a step, the first step included.
    no_eos = {token: -100.0 for token in dec.eos_token_ids}
    expected = dec.generate(PROMPT, SamplingParams(max_new_tokens=120, logit_bias=no_eos), method="draft").text
    real_probs = specdecode.core.sampling.LogitsProcessor.probs
    failed_batches: list[int] = []
    sizes = slow_steps(monkeypatch, 0.02)

    def probs(self, logits):
        if self.temperature == BROKEN_TEMPERATURE:
            failed_batches.append(sizes[-1] if sizes else 0)
            raise RuntimeError("injected sampling failure")
        return real_probs(self, logits)

    monkeypatch.setattr(specdecode.core.sampling.LogitsProcessor, "probs", probs)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "method": "draft", "stream": True,
            "logit_bias": {str(token): bias for token, bias in no_eos.items()}}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        bad = post(base, {"model": MODEL, "prompt": "x", "max_tokens": 20, "temperature": BROKEN_TEMPERATURE})
        events = [first[len("data: "):]] + sse_data(lines)
    error = assert_openai_error(bad, 500)
    assert error["type"] == "server_error" and "injected" in error["message"]
    assert events[-1] == "[DONE]" and "error" not in json.loads(events[-2]), events[-2]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == expected
    assert max(failed_batches) >= 2, "the failing request never shared a step with the stream"


# --- 2. large bodies ----------------------------------------------------------------------
def test_a_body_over_the_limit_is_refused_before_it_is_read(served) -> None:
    """A Content-Length over 2 MiB gets a 413 at once, though not one byte of the body is sent."""
    base, _ = served
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)  # times out (the test fails) if the server waits for the body
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_refused(served) -> None:
    base, _ = served

    def chunks():  # no Content-Length: the guard counts as it reads
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    response = httpx.post(base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)
    assert client(base).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0).choices


def test_a_large_prompt_is_tokenized_off_the_event_loop(start_server) -> None:
    """A 1 MB prompt takes about a second to tokenize; /health answers quickly meanwhile. (With
    the bound by characters off, as for a tokenizer whose vocabulary cannot be read: it refuses
    such a prompt before tokenizing, see the test below.)"""
    with start_server() as (base, state):
        state.longest_token_chars = None
        large_prompt_stalls_nothing(base)


def large_prompt_stalls_nothing(base: str) -> None:
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 22_000, "max_tokens": 1}
    result: dict[str, object] = {}

    def big() -> None:
        started = time.perf_counter()
        result["response"] = post(base, body)
        result["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=big)
    thread.start()
    latencies = []
    while thread.is_alive():
        started = time.perf_counter()
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.02)
    thread.join()
    assert_openai_error(result["response"], 400, "prompt")  # longer than the context
    assert result["seconds"] > 0.6, "the prompt tokenized too fast to show a stall"
    assert max(latencies) < result["seconds"] / 3, f"/health stalled {max(latencies):.2f} s of {result['seconds']:.2f} s"


# --- 3. a non-streaming client that leaves --------------------------------------------------
def long_sampled_body(dec) -> dict:
    """A sampled request that runs its 400 tokens whatever it draws (its end tokens banned)."""
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "seed": 0,
            "logit_bias": {str(token): -100 for token in dec.eos_token_ids}}


def test_a_non_streaming_client_that_leaves_cancels_its_request(served, monkeypatch) -> None:
    base, dec = served
    slow_steps(monkeypatch, 0.05)
    cancelled = metric(base, 'specdecode_requests_total{status="cancelled"}')
    ok = metric(base, 'specdecode_requests_total{status="ok"}')
    body = long_sampled_body(dec)
    with pytest.raises(httpx.ReadTimeout):
        post(base, body, timeout=0.5)  # hangs up after half a second (about 10 steps)
    wait_for(lambda: metric(base, 'specdecode_requests_total{status="cancelled"}') == cancelled + 1,
             "the request was not cancelled")
    wait_for(lambda: metric(base, "specdecode_kv_blocks_used") == 0, "the cancelled request kept its KV blocks")
    assert metric(base, 'specdecode_requests_total{status="ok"}') == ok


# --- 4. client errors, not plain-text 500s ----------------------------------------------------
@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_json_is_a_400(served, depth: int) -> None:
    base, _ = served
    raw = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    response = httpx.post(base + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


@pytest.mark.parametrize(
    ("path", "raw", "status", "param"),
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b"}', 400, "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "stream": true}', 400, "prompt"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop": ["\\udfff"]}', 400, "stop"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', 400,
         "messages"),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": ["user"], "content": "x"}]}', 400,
         "messages"),  # an unhashable role: a 500 before
        ("/v1/completions", '{"model": "ti\\ud800ny", "prompt": "x"}', 404, "model"),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, None),
        ("/v1/completions", '{"model": "tiny", "prompt": "x", "top_p": Infinity}', 400, None),
    ],
)
def test_invalid_unicode_and_non_json_numbers_are_4xx(served, path: str, raw: str, status: int, param: str) -> None:
    base, _ = served
    response = httpx.post(base + path, content=raw.encode(), headers={"content-type": "application/json"})
    assert_openai_error(response, status, param)


def test_unknown_methods_on_routes_get_an_openai_body(served) -> None:
    base, _ = served
    assert_openai_error(httpx.get(base + "/v1/completions"), 405)


def test_events_are_single_lines_for_line_splitting_clients() -> None:
    """Generated text may hold U+2028 or U+0085, which str.splitlines and httpx's iter_lines
    (not SSE itself) read as line breaks; the schema fuzz test found events split by them."""
    from specdecode.serving.responses import sse

    event = sse({"text": "a\u2028b\x85c\u2029d é"})
    assert len(event.rstrip("\n").splitlines()) == 1 and json.loads(event[len("data: "):])["text"] == "a\u2028b\x85c\u2029d é"


# --- 5, 6, 10. fields -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"seed": 2**64}, "seed"), ({"seed": 2**63}, "seed"), ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"),
        ({"seed": "7"}, "seed"), ({"seed": True}, "seed"),
        ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": "2"}, "logprobs"),
        ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix"),
        ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"), ({"tool_choice": "auto"}, "tool_choice"),
        ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": "2"}, "n"),
        ({"method": "draft", "k": 0}, "k"), ({"method": "draft", "k": 99}, "k"), ({"method": "auto", "k": 2**40}, "k"),
        ({"method": "none", "k": -5}, "k"),
    ],
)
def test_bad_or_unsupported_fields_are_refused_by_name(served, extra: dict, param: str) -> None:
    base, _ = served
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": stream} | extra
        assert_openai_error(post(base, body), 400, param)


def test_largest_seed_and_harmless_defaults_are_accepted(served) -> None:
    base, dec = served
    expected = dec.generate(PROMPT, SamplingParams(max_new_tokens=6)).text
    harmless = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "user": "someone", "logprobs": None,
                "echo": False, "best_of": 1, "logit_bias": {}, "response_format": {"type": "text"}, "tools": [],
                "suffix": None, "seed": 2**63 - 1}
    response = post(base, {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0} | harmless)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected
    chat = post(base, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "logprobs": False, "top_logprobs": 0},
                "/v1/chat/completions")
    assert chat.status_code == 200, chat.text


def test_chat_text_parts_and_the_developer_role(served) -> None:
    base, dec = served
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]
    expected = dec.generate(system, SamplingParams(max_new_tokens=8), chat=True).text
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    response = post(base, {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == expected
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]
    error = assert_openai_error(post(base, {"model": MODEL, "messages": image}, "/v1/chat/completions"), 400, "messages")
    assert "image_url" in error["message"]
    function = MESSAGES + [{"role": "function", "content": "42", "name": "f"}]  # role tool: test_tools_server.py
    error = assert_openai_error(post(base, {"model": MODEL, "messages": function}, "/v1/chat/completions"), 400,
                                "messages")
    assert "'function'" in error["message"]


def test_model_names_are_never_resolved_at_request_time(served, monkeypatch, tiny_qwen2_dir) -> None:
    """A model name that is a real model folder or a hub id is looked up among the served names
    only: nothing is loaded."""
    base, _ = served
    loads: list[str] = []

    def no_loading(*args, **kwargs):
        loads.append(repr(args))
        raise AssertionError("a model was loaded at request time")

    import transformers

    monkeypatch.setattr(specdecode.models.loader, "load_model", no_loading)
    monkeypatch.setattr(specdecode.loading, "load_model", no_loading)
    monkeypatch.setattr(specdecode.api.SpecDecoder, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_loading)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    for name in (str(tiny_qwen2_dir), "Qwen/Qwen2.5-0.5B", "../../etc/passwd", "demo"):
        assert_openai_error(post(base, {"model": name, "prompt": PROMPT, "max_tokens": 2}), 404, "model")
    assert not loads


# --- 7. API key, Content-Type, Host -----------------------------------------------------------
def test_api_key_is_required_on_every_route_but_health(start_server) -> None:
    with start_server(ServerOptions(guard=GuardOptions(api_key="s3cret"))) as (base, _):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"},
                        {"authorization": "Bearer s3cret-and-more"}):
            for path in ("/v1/models", "/metrics", "/openapi.json", "/docs", "/v1", "/nowhere"):
                error = assert_openai_error(httpx.get(base + path, headers=headers), 401)
                assert error["code"] == "invalid_api_key"
            assert_openai_error(post(base, {"model": MODEL, "prompt": PROMPT}, headers=headers), 401)
        assert httpx.get(base + "/health").status_code == 200
        key = {"authorization": "Bearer s3cret"}
        assert "specdecode_requests_total" in httpx.get(base + "/metrics", headers=key).text
        assert httpx.get(base + "/openapi.json", headers=key).json()["info"]["title"] == "specdecode"
        assert [m.id for m in client(base, api_key="s3cret").models.list()] == [MODEL]
        reply = client(base, api_key="s3cret").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert reply.usage.completion_tokens > 0


def test_api_key_from_the_environment(monkeypatch) -> None:
    import argparse

    from specdecode.cli.serve import add_serve_parser

    monkeypatch.setenv("SPECDECODE_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(["serve"])
    assert args.api_key == "from-env" and args.max_body_bytes == 2 * 1024 * 1024 and args.drain_timeout == 10.0
    assert args.request_timeout is None
    assert args.keep_alive_timeout == 5.0 and args.max_connections == 512 and args.header_timeout == 10.0
    assert parser.parse_args(["serve", "--api-key", "flag"]).api_key == "flag"


def test_idle_and_slow_connections_are_closed_and_their_number_bounded(tiny_decoder) -> None:
    """The server's uvicorn settings (serving/connections.py: uvicorn_config): a keep-alive
    connection idle past --keep-alive-timeout is closed; one that sends its headers a byte at a
    time (slowloris) is closed after --header-timeout, also on a kept-alive connection after a
    first request; past --max-connections a request gets a 503 in OpenAI's shape with Retry-After,
    but /health is still answered (uvicorn's own limit answered it a plain-text 503 too); below it,
    requests are served."""
    import uvicorn
    from server_helpers import free_port

    from specdecode.serving.connections import uvicorn_config
    from specdecode.serving.server import create_app
    from specdecode.serving.worker import BatchWorker

    port = free_port()
    app = create_app(tiny_decoder, MODEL, BatchWorker(tiny_decoder.batch_engine(max_batch=2, kv_cache_tokens=512,
                                                                                 cost_aware=False)))
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning", keep_alive_timeout=0.3,
                                           max_connections=3, header_timeout=0.6))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, "the server did not start")
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

    def health(sock: socket.socket) -> None:
        sock.sendall(request)
        response = b""
        while not response.endswith(b"}"):  # the head and the JSON body, in however many reads
            chunk = sock.recv(4096)
            assert chunk, response
            response += chunk
        assert response.startswith(b"HTTP/1.1 200")

    def closed_by_server(sock: socket.socket) -> bool:
        try:
            return sock.recv(4096) == b""
        except TimeoutError:  # still open (the socket's 5 s timeout)
            return False
        except OSError:  # reset
            return True

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            health(sock)
            started = time.perf_counter()
            assert closed_by_server(sock)  # after the keep-alive timeout
            assert time.perf_counter() - started < 3
        for kept_alive in (False, True):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                if kept_alive:  # a whole request first, then the next one slowly
                    health(sock)
                started = time.perf_counter()
                closed = False
                for byte in request[:-4]:  # never the blank line that ends the headers
                    try:
                        sock.sendall(bytes([byte]))
                    except OSError:
                        closed = True
                        break
                    time.sleep(0.05)
                    if time.perf_counter() - started > 3:
                        break
                closed = closed or closed_by_server(sock)
                assert closed and time.perf_counter() - started < 3, "a slow sender kept its connection"
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3)]
        try:
            wait_for(lambda: len(server.server_state.connections) >= 3, "the idle connections were not accepted")
            refused = httpx.get(f"http://127.0.0.1:{port}/v1/models")
            error = assert_openai_error(refused, 503)
            assert error["code"] == "too_many_connections" and int(refused.headers["retry-after"]) >= 1
            assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        finally:
            for sock in idle:
                sock.close()
        wait_for(lambda: len(server.server_state.connections) == 0, "the idle connections stayed")
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_post_bodies_must_be_json(served) -> None:
    base, _ = served
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        response = httpx.post(base + "/v1/completions", content=b'{"model": "tiny", "prompt": "x"}', headers=headers)
        assert_openai_error(response, 415)
    ok = httpx.post(base + "/v1/completions", content=json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}),
                    headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_only_loopback_host_headers_by_default(served, start_server) -> None:
    base, _ = served
    for host in ("evil.example", "evil.example:80", "127.0.0.1.evil.example", "10.0.0.1"):
        error = assert_openai_error(httpx.get(base + "/v1/models", headers={"host": host}), 400)
        assert error["code"] == "invalid_host"
    for host in ("localhost", "localhost:1234", "127.0.0.1", "[::1]:8000"):
        assert httpx.get(base + "/v1/models", headers={"host": host}).status_code == 200, host
    options = ServerOptions(guard=GuardOptions(allowed_hosts=default_allowed_hosts("127.0.0.1", ("my.box",))))
    with start_server(options) as (other, _):
        assert httpx.get(other + "/v1/models", headers={"host": "my.box:8000"}).status_code == 200
        assert httpx.get(other + "/v1/models", headers={"host": "evil.example"}).status_code == 400


def test_default_allowed_hosts() -> None:
    assert default_allowed_hosts("127.0.0.1") == ("127.0.0.1",)
    assert default_allowed_hosts("localhost", ("a.b",)) == ("localhost", "a.b")
    assert default_allowed_hosts("0.0.0.0") is None  # bound elsewhere: no check unless asked
    assert default_allowed_hosts("0.0.0.0", ("a.b",)) == ("a.b",)
    assert default_allowed_hosts("127.0.0.1", ("*",)) is None


# --- 9. request timeout -----------------------------------------------------------------------
def test_a_request_past_the_timeout_is_stopped(start_server, tiny_decoder, monkeypatch) -> None:
    with start_server(ServerOptions(request_timeout=0.4)) as (base, _):
        slow_steps(monkeypatch, 0.05)
        body = long_sampled_body(tiny_decoder)
        started = time.perf_counter()
        error = assert_openai_error(post(base, body), 504)
        assert error["code"] == "request_timeout" and time.perf_counter() - started < 3
        with httpx.stream("POST", base + "/v1/completions", json=body | {"stream": True}, timeout=30) as response:
            assert response.status_code == 200
            events = sse_data(response.iter_lines())
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
        # Counted by the decoding thread as it winds down, just after the response has ended.
        wait_for(lambda: metric(base, 'specdecode_requests_total{status="timeout"}') == 2, "timeouts not counted")
        wait_for(lambda: metric(base, "specdecode_kv_blocks_used") == 0, "a stopped request kept its KV blocks")
        monkeypatch.undo()
        assert post(base, {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}).status_code == 200


def test_the_default_model_id_is_a_name_not_a_path(tiny_qwen2_dir, tiny_ggufs, monkeypatch) -> None:
    from specdecode.serving.spec import served_model_name

    assert served_model_name(str(tiny_qwen2_dir)) == tiny_qwen2_dir.name
    assert served_model_name(str(tiny_qwen2_dir) + "/") == tiny_qwen2_dir.name
    assert served_model_name(str(tiny_ggufs["target"])) == "target.gguf"
    assert served_model_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # a hub id, not on disk
    monkeypatch.chdir(tiny_qwen2_dir.parent)
    assert served_model_name(tiny_qwen2_dir.name) == tiny_qwen2_dir.name


def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(start_server, monkeypatch) -> None:
    """Past max_prompt_tokens x the longest token's characters (x the normalization slack) a
    prompt cannot fit whatever it says: a 400 naming it, the tokenizer never called. Below that
    bound the prompt is tokenized and refused by its token count as before."""
    from specdecode.serving.state import NORMALIZATION_SLACK

    with start_server() as (base, state):
        bound = state.max_prompt_tokens() * state.longest_token_chars * NORMALIZATION_SLACK
        real_encode, encoded = state.decoder.encode, []

        def encode(*args, **kwargs):
            encoded.append(1)
            return real_encode(*args, **kwargs)

        monkeypatch.setattr(state.decoder, "encode", encode)
        for path, body in (("/v1/completions", {"prompt": "ab" * (bound // 2 + 1)}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (bound + 1)}]})):
            for stream in (False, True):
                started = time.perf_counter()
                response = post(base, {"model": MODEL, "max_tokens": 2, "stream": stream} | body, path)
                error = assert_openai_error(response, 400, "prompt" if "prompt" in body else "messages")
                assert error["code"] == "context_length_exceeded"
                print(f"{path}: refused {bound + 1} characters in {time.perf_counter() - started:.3f} s")
        assert not encoded
        # Within the bound: tokenized, then refused by its token count.
        assert_openai_error(post(base, {"model": MODEL, "max_tokens": 2, "prompt": "word " * 2000}), 400, "prompt")
        assert encoded
