"""Abuse tests kept in the suite (bounded, loopback only): schema fuzzing of the OpenAI routes,
32 concurrent streams with random disconnects, and a 300-request soak with the server's RSS.
The fuzz and the soak are marked ``slow`` (about a minute together on 2 cores): the default run
skips them and .ci/run runs them on their own (``python -m pytest -m slow tests/serving``)."""

import json
import random
import threading
import time

import httpx
import pytest
from server_helpers import MODEL, PROMPT, metric, schema_fuzz, sse_data, wait_for

import specdecode.engine.batch

FUZZ_EXAMPLES = 40  # per route and generation mode: 160 requests in all
FUZZ_MAX_TOKENS = 16  # valid requests are cut to this many tokens, so that the fuzz stays fast
REQUEST_SECONDS = 20  # a response slower than this is a hang
FUZZ_TEXT_CHARS = 64  # chat texts and tool schemas cut so that valid prompts fit the tiny model's context
FUZZ_MESSAGES = 4


def _shorten(body: object) -> object:
    """A generated body made cheap and, where it was valid, still valid: fewer tokens to decode,
    and the chat parts that reach the prompt cut (at most FUZZ_MESSAGES messages of two parts,
    texts and tool schemas of FUZZ_TEXT_CHARS, tools without the extra keys a chat template
    would render), so that a valid prompt fits the tiny model's 512 positions (random Unicode
    tokenizes at about a token a character); tool names made unique, which the schema cannot say."""
    if not isinstance(body, dict):
        return body
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > FUZZ_MAX_TOKENS:
            body[name] = FUZZ_MAX_TOKENS
    if isinstance(body.get("messages"), list) and body["messages"]:
        body["messages"] = body["messages"][:FUZZ_MESSAGES]
        for message in body["messages"]:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                message["content"] = content[:FUZZ_TEXT_CHARS]
            elif isinstance(content, list) and content:
                message["content"] = content[:2]
                for part in message["content"]:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part["text"] = part["text"][:FUZZ_TEXT_CHARS]
    if isinstance(body.get("tools"), list):
        names: set[object] = set()
        for i, tool in enumerate(body["tools"]):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict):
                continue
            function = {key: function[key] for key in ("name", "description", "parameters") if key in function}
            if isinstance(function.get("description"), str):
                function["description"] = function["description"][:FUZZ_TEXT_CHARS]
            if isinstance(function.get("parameters"), dict) and len(json.dumps(function["parameters"])) > FUZZ_TEXT_CHARS:
                function["parameters"] = {"type": "object"}
            if isinstance(function.get("name"), str) and function["name"] in names:  # each name once
                function["name"] = f"{function['name'][:60]}_{i}"
            names.add(function.get("name"))
            body["tools"][i] = {"type": tool.get("type"), "function": function}
    return body


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzz_gets_no_5xx_and_no_hang(served, path: str, mode: str) -> None:
    """Requests generated from the app's own OpenAPI schema: valid ones (positive) and ones that
    break it (negative: wrong types, missing fields, raw bytes). Every answer is a 200 or a 4xx
    with the OpenAI error body, and arrives within REQUEST_SECONDS."""
    base, _ = served

    def whole(body: object, response: httpx.Response) -> None:
        if response.status_code >= 400:
            return
        if response.headers["content-type"].startswith("text/event-stream"):
            events = sse_data(response.text.split("\n"))  # SSE lines end at \n only
            assert events[-1] == "[DONE]" and "error" not in json.loads(events[-2]), response.text
        else:
            assert response.json()["choices"], response.text

    statuses = schema_fuzz(base, path, mode, FUZZ_EXAMPLES, prepare=_shorten, check=whole, timeout=REQUEST_SECONDS)
    assert len(statuses) >= FUZZ_EXAMPLES // 2
    if mode == "positive":  # the schema is right: most valid requests decode
        assert statuses.count(200) >= len(statuses) // 2, statuses
    wait_for(lambda: metric(base, "specdecode_kv_blocks_used") == 0, "KV blocks leaked")
    print(f"fuzz {mode} {path}: {len(statuses)} requests, statuses {sorted(set(statuses))}")


def test_32_concurrent_streams_with_random_disconnects_leak_nothing(start_server, tiny_decoder, monkeypatch) -> None:
    """32 streams of mixed methods and lengths at once (a batch of 8, the rest queued), half of
    them hung up at a random point: afterwards every KV block is free, nothing runs or waits, and
    a greedy answer is what it was before."""
    rng = random.Random(0)
    greedy = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with start_server(max_batch=8) as (base, state):
        engine = state.worker.engine
        pools = [engine.target_cache, engine.drafter.cache]
        free_before = [pool.free_blocks for pool in pools]
        before = httpx.post(base + "/v1/completions", json=greedy, timeout=30).json()["choices"][0]["text"]
        real_verify = specdecode.engine.batch.BatchEngine._verify

        def slow(self, running, proposals):  # a few ms a step, so that hang-ups land mid-stream
            time.sleep(0.005)
            return real_verify(self, running, proposals)

        monkeypatch.setattr(specdecode.engine.batch.BatchEngine, "_verify", slow)
        plans = [(rng.choice(["none", "ngram", "draft", "auto"]), rng.randint(4, 48),
                  rng.randint(0, 6) if rng.random() < 0.5 else None, rng.choice([0.0, 0.8])) for _ in range(32)]
        outcomes: list[str] = []

        def stream(method: str, max_tokens: int, leave_after: int | None, temperature: float) -> None:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": temperature,
                    "seed": 1, "method": method, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                assert response.status_code == 200
                events = []
                for line in response.iter_lines():
                    if leave_after is not None and len(events) >= leave_after:
                        outcomes.append("left")
                        return  # closes the connection mid-stream
                    if line.startswith("data: "):
                        events.append(line)
                assert events[-1] == "data: [DONE]"
                outcomes.append("done")

        threads = [threading.Thread(target=stream, args=plan) for plan in plans]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert len(outcomes) == 32 and "left" in outcomes and "done" in outcomes
        monkeypatch.undo()
        wait_for(lambda: not engine.has_unfinished and metric(base, "specdecode_requests_running") == 0,
                 "requests were left running", timeout=20)
        wait_for(lambda: [pool.free_blocks for pool in pools] == free_before, "KV blocks leaked", timeout=20)
        assert engine.num_running == 0 and engine.num_waiting == 0 and not state.inflight
        after = httpx.post(base + "/v1/completions", json=greedy, timeout=30).json()["choices"][0]["text"]
        assert after == before


# Issue 49's hostile grammars, tools and text, merged into generated bodies (each took the server
# down, or a core for minutes, before): a grammar with no finite string, an empty language, nested
# repetition counts, a schema and a required tool whose parameters contain themselves, lone
# surrogates where text reaches the template.
SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
HOSTILE_PATCHES = [
    {"structured_outputs": {"grammar": 'root ::= "a" root'}},
    {"structured_outputs": {"grammar": "root ::= x\nx ::= y\ny ::= x"}},
    {"structured_outputs": {"regex": "[^\\s\\S]"}},
    {"structured_outputs": {"regex": "((a{0,99}){0,99}){0,99}"}},
    {"structured_outputs": {"regex": ".{0,1000}z1"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SELF_REQUIRED}}},
    {"tools": [{"type": "function", "function": {"name": "nest", "parameters": SELF_REQUIRED}}],
     "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
    {"stop": ["\ud800"]},
]
HOSTILE_EXAMPLES = 36  # per route: each patch about four times over different generated bodies
HOSTILE_RSS_GROWTH_BOUND = 500 * 2**20  # issue 49's bound over idle


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_schema_fuzz_with_hostile_grammars_and_tools(served, path: str) -> None:
    """Valid generated bodies with one hostile patch each: every answer is a 200 or a 4xx with the
    OpenAI error body within REQUEST_SECONDS, /health stays ok, and the server's resident memory
    grows by less than HOSTILE_RSS_GROWTH_BOUND."""
    base, _ = served
    rss_before = metric(base, "specdecode_process_resident_memory_bytes")

    def alone(body: object) -> object:
        body = _shorten(body)
        if isinstance(body, dict):
            for name in ("response_format", "structured_outputs", "tools", "tool_choice"):
                body.pop(name, None)  # the patch's constraint alone (two would be a plain 400)
        return body

    def healthy(body: object, response: httpx.Response) -> None:
        assert httpx.get(base + "/health").json()["status"] == "ok"

    statuses = schema_fuzz(base, path, "positive", HOSTILE_EXAMPLES, prepare=alone, check=healthy,
                           patches=HOSTILE_PATCHES, timeout=REQUEST_SECONDS)
    growth = metric(base, "specdecode_process_resident_memory_bytes") - rss_before
    print(f"hostile fuzz {path}: {len(statuses)} requests, statuses {sorted(set(statuses))}, "
          f"RSS growth {growth / 2**20:+.1f} MiB")
    assert len(statuses) >= HOSTILE_EXAMPLES // 2
    assert growth < HOSTILE_RSS_GROWTH_BOUND


SOAK_REQUESTS = 300
SOAK_WARMUP = 40
SOAK_RSS_GROWTH_BOUND = 150 * 2**20  # generous: a leak of a few KiB per request stays below it


@pytest.mark.slow
def test_soak_300_requests_with_bounded_rss(start_server) -> None:
    """300 mixed requests from 4 clients; the server's resident memory (from /metrics) grows by
    less than SOAK_RSS_GROWTH_BOUND after a warm-up, and nothing is left running."""
    rng = random.Random(1)

    def body(i: int) -> tuple[str, dict]:
        chat = i % 3 == 0
        base_body = {"model": MODEL, "max_tokens": rng.randint(1, 8), "temperature": rng.choice([0.0, 0.7]),
                     "seed": i, "stream": i % 2 == 0, "method": rng.choice(["none", "ngram", "draft", "auto"])}
        if chat:
            return "/v1/chat/completions", base_body | {"messages": [{"role": "user", "content": f"Count to {i}"}]}
        return "/v1/completions", base_body | {"prompt": f"{PROMPT} # {i}"}

    with start_server(max_batch=4) as (base, state):
        def run(indices: range) -> list[int]:
            statuses = []
            with httpx.Client(base_url=base, timeout=60) as http:
                for i in indices:
                    path, payload = body(i)
                    statuses.append(http.post(path, json=payload).status_code)
            return statuses

        assert set(run(range(SOAK_WARMUP))) == {200}
        rss_before = metric(base, "specdecode_process_resident_memory_bytes")
        statuses: list[int] = []
        started = time.perf_counter()
        threads = [threading.Thread(target=lambda k=k: statuses.extend(run(range(SOAK_WARMUP + k, SOAK_WARMUP + SOAK_REQUESTS, 4))))
                   for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        seconds = time.perf_counter() - started
        rss_after = metric(base, "specdecode_process_resident_memory_bytes")
        growth = rss_after - rss_before
        print(f"soak: {SOAK_REQUESTS} requests in {seconds:.1f} s; RSS {rss_before / 2**20:.1f} -> "
              f"{rss_after / 2**20:.1f} MiB (growth {growth / 2**20:+.1f} MiB)")
        assert statuses == [200] * SOAK_REQUESTS or sorted(set(statuses)) == [200], statuses
        assert len(statuses) == SOAK_REQUESTS
        assert growth < SOAK_RSS_GROWTH_BOUND
        assert metric(base, "specdecode_kv_blocks_used") == 0 and not state.inflight
