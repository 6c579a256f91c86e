"""Issue 51's client rows on the demo pair, through the real SDKs unchanged: starts
`specdecode serve` (method auto, llama.cpp's demo GGUFs by default) and runs each row, printing
a pass/fail table. A correctness check, not a timing (the seconds are only there to show where
the time went).

    nice -n 10 python benchmarks/sdk_rows.py                 # starts its own server on --port
    python benchmarks/sdk_rows.py --url http://127.0.0.1:8000 # against one already running

Rows: openai ``responses.create`` and ``responses.stream``; an openai-agents ``Agent`` with a
function tool on the SDK's default model (the Responses API), whole and streamed; anthropic
``messages.create``, ``messages.stream``, a ``tool_use`` round trip (whole and streamed) and
``count_tokens``; ``/tokenize``, ``/detokenize``, ``/infill``, ``/apply-template``, ``/props``;
openai chat completions with tools, ``tool_choice`` required and named, streamed and not.
Each row asserts what a client relies on (a row that raises, or whose check fails, fails).
Exits 1 when a row fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import httpx

ASK = "What's the weather like in Paris right now? Use the tool."
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_RESULT = json.dumps({"temperature": 14, "unit": "celsius", "sky": "cloudy"})
MAX_TOKENS = 48
START_TIMEOUT_SECONDS = 600


class Rows:
    """Runs each row, keeps (client, call, ok, seconds, note)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, bool, float, str]] = []

    def run(self, client: str, call: str, row: Callable[[], str]) -> None:
        start = time.perf_counter()
        try:
            note, ok = row(), True
        except Exception as err:  # a failed row is reported, the others still run
            note, ok = f"{type(err).__name__}: {err}"[:300], False
            traceback.print_exc(file=sys.stderr)
        seconds = time.perf_counter() - start
        self.rows.append((client, call, ok, seconds, note))
        print(f"{'pass' if ok else 'FAIL'} {client} {call} ({seconds:.1f} s): {note}", file=sys.stderr, flush=True)

    def table(self) -> str:
        lines = ["| client | call | result | s | what came back |", "|---|---|---|---|---|"]
        for client, call, ok, seconds, note in self.rows:
            lines.append(f"| {client} | {call} | {'pass' if ok else 'FAIL'} | {seconds:.1f} | "
                         f"{note.replace('|', '/').replace(chr(10), ' ')} |")
        return "\n".join(lines)


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def is_city_call(arguments: str | dict[str, Any]) -> str:
    """The arguments as a JSON object with a string city (the schema's one required field)."""
    data = json.loads(arguments) if isinstance(arguments, str) else arguments
    check(isinstance(data, dict) and isinstance(data.get("city"), str), f"arguments {arguments!r} lack a city")
    return data["city"]


def openai_rows(rows: Rows, base: str, model: str) -> None:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600)

    def responses_create() -> str:
        reply = client.responses.create(model=model, input="Name one sorting algorithm.", instructions="Be brief.",
                                        max_output_tokens=MAX_TOKENS, temperature=0)
        check(reply.status in ("completed", "incomplete") and reply.output_text.strip() != "", "no output_text")
        again = client.responses.create(model=model, previous_response_id=reply.id, input="Its complexity?",
                                        max_output_tokens=MAX_TOKENS, temperature=0)
        check(again.output_text.strip() != "", "no output_text on the previous_response_id turn")
        return f"{reply.status}, {reply.output_text[:40]!r}; next turn {again.output_text[:30]!r}"

    def responses_stream() -> str:
        with client.responses.stream(model=model, input="Name one sorting algorithm.", max_output_tokens=MAX_TOKENS,
                                     temperature=0) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        check(kinds[0] == "response.created" and kinds[-1] == "response.completed", f"events {kinds[:2]}..{kinds[-1:]}")
        check(final.output_text.strip() != "", "no output_text")
        return f"{len(kinds)} events, {kinds.count('response.output_text.delta')} text deltas, {final.status}"

    def responses_tool() -> str:
        tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.",
                  "parameters": WEATHER_SCHEMA}]
        with client.responses.stream(model=model, input=ASK, tools=tools, tool_choice="required",
                                     max_output_tokens=100, temperature=0) as stream:
            deltas = sum(event.type == "response.function_call_arguments.delta" for event in stream)
            first = stream.get_final_response()
        call = next(item for item in first.output if item.type == "function_call")
        city = is_city_call(call.arguments)
        answer = client.responses.create(model=model, previous_response_id=first.id, tools=tools, temperature=0,
                                         max_output_tokens=MAX_TOKENS, input=[{"type": "function_call_output",
                                                                               "call_id": call.call_id,
                                                                               "output": WEATHER_RESULT}])
        check(answer.output_text.strip() != "", "no answer after the function_call_output")
        return f"call {city!r} ({deltas} argument deltas), then {answer.output_text[:40]!r}"

    def chat(choice: str | dict[str, Any], stream: bool) -> Callable[[], str]:
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                                   "parameters": WEATHER_SCHEMA}}]

        def row() -> str:
            args = dict(model=model, messages=[{"role": "user", "content": ASK}], tools=tools, tool_choice=choice,
                        max_tokens=100, temperature=0)
            if not stream:
                reply = client.chat.completions.create(**args)
                choice0 = reply.choices[0]
                check(choice0.finish_reason == "tool_calls", f"finish_reason {choice0.finish_reason}")
                call = choice0.message.tool_calls[0]
                return f"tool_calls, {call.function.name}({is_city_call(call.function.arguments)!r})"
            pieces: dict[int, list[str]] = {}
            finish, deltas = None, 0
            for chunk in client.chat.completions.create(stream=True, **args):
                for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    deltas += 1
                    pieces.setdefault(part.index, []).append(part.function.arguments or "")
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            check(finish == "tool_calls" and 0 in pieces, f"finish_reason {finish}, calls {list(pieces)}")
            return f"tool_calls, city {is_city_call(''.join(pieces[0]))!r} ({deltas} deltas)"

        return row

    rows.run("openai", "responses.create (+ previous_response_id)", responses_create)
    rows.run("openai", "responses.stream", responses_stream)
    rows.run("openai", "responses.stream, function call + output", responses_tool)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for label, choice in (("required", "required"), ("named", named)):
        for stream in (False, True):
            rows.run("openai", f"chat tools, tool_choice {label}{', streamed' if stream else ''}", chat(choice, stream))


def agents_rows(rows: Rows, base: str, model: str) -> None:
    import agents
    import openai

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return WEATHER_RESULT

    def agent_row(stream: bool, choice: str | None) -> Callable[[], str]:
        def row() -> str:
            calls.clear()
            # A client per row, made in the row's own event loop (its connections belong to it).
            async def run() -> str:
                agents.set_default_openai_client(openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                                                    max_retries=0, timeout=600), use_for_tracing=False)
                settings = agents.ModelSettings(temperature=0, max_tokens=100, tool_choice=choice)
                agent = agents.Agent(name="helper", instructions="Be brief.", model=model, tools=[get_weather],
                                     model_settings=settings)
                if not stream:
                    return str((await agents.Runner.run(agent, ASK, max_turns=4)).final_output)
                result = agents.Runner.run_streamed(agent, ASK, max_turns=4)
                async for _ in result.stream_events():
                    pass
                return str(result.final_output)

            output = asyncio.run(run())
            check(output.strip() != "", "no final output")
            if choice == "required":
                check(calls != [], "the tool was not called")
            return f"tool called with {calls!r}; final {output[:40]!r}"

        return row

    agents.set_tracing_disabled(True)
    agents.set_default_openai_api("responses")  # the SDK's default; said so that the row cannot drift
    rows.run("openai-agents", "Agent + function tool (tool_choice auto)", agent_row(False, None))
    rows.run("openai-agents", "Agent + function tool, tool_choice required", agent_row(False, "required"))
    rows.run("openai-agents", "Agent + function tool, required, run_streamed", agent_row(True, "required"))


def anthropic_rows(rows: Rows, base: str, model: str) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=600)
    greedy = {"temperature": 0}  # the SDK has no sampling parameters: they go as extra_body
    tool = {"name": "get_weather", "description": "Current weather in a city.", "input_schema": WEATHER_SCHEMA}
    ask = [{"role": "user", "content": ASK}]

    def create() -> str:
        reply = client.messages.create(model=model, max_tokens=MAX_TOKENS, system="Be brief.", extra_body=greedy,
                                       messages=[{"role": "user", "content": "Name one sorting algorithm."}])
        check(reply.content and reply.content[0].type == "text" and reply.content[0].text.strip() != "", "no text")
        check(reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens > 0, "stop or usage")
        return f"{reply.stop_reason}, {reply.content[0].text[:40]!r}"

    def stream() -> str:
        with client.messages.stream(model=model, max_tokens=MAX_TOKENS, extra_body=greedy,
                                    messages=[{"role": "user", "content": "Name one sorting algorithm."}]) as events:
            texts = list(events.text_stream)
            final = events.get_final_message()
        check("".join(texts) == final.content[0].text != "", "text deltas differ from the final message")
        return f"{len(texts)} text deltas, {final.stop_reason}"

    def tool_round(streamed: bool) -> Callable[[], str]:
        def row() -> str:
            args = dict(model=model, max_tokens=100, tools=[tool], tool_choice={"type": "any"}, extra_body=greedy,
                        messages=ask)
            if streamed:
                with client.messages.stream(**args) as events:
                    kinds = [event.type for event in events]
                    first = events.get_final_message()
            else:
                first, kinds = client.messages.create(**args), []
            check(first.stop_reason == "tool_use", f"stop_reason {first.stop_reason}")
            use = next(block for block in first.content if block.type == "tool_use")
            city = is_city_call(use.input)
            answer = client.messages.create(model=model, max_tokens=MAX_TOKENS, tools=[tool], extra_body=greedy,
                                            messages=[*ask, {"role": "assistant", "content": first.content},
                                                      {"role": "user", "content": [{"type": "tool_result",
                                                                                    "tool_use_id": use.id,
                                                                                    "content": WEATHER_RESULT}]}])
            check(any(block.type == "text" and block.text.strip() for block in answer.content), "no answer")
            text = next(block.text for block in answer.content if block.type == "text")
            deltas = f" ({sum(k == 'input_json' for k in kinds)} input_json events)" if streamed else ""
            return f"tool_use {city!r}{deltas}, then {answer.stop_reason} {text[:40]!r}"

        return row

    def count() -> str:
        counted = client.messages.count_tokens(model=model, messages=ask, tools=[tool]).input_tokens
        reply = client.messages.create(model=model, max_tokens=1, tools=[tool], messages=ask, extra_body=greedy)
        prompt = reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
        check(counted == prompt, f"count_tokens {counted} != the request's prompt {prompt}")
        return f"{counted} tokens, the same request's prompt"

    def stop_sequences() -> str:
        reply = client.messages.create(model=model, max_tokens=MAX_TOKENS, extra_body=greedy,
                                       stop_sequences=["\n", "sort"],
                                       messages=[{"role": "user", "content": "Name one sorting algorithm."}])
        check(reply.stop_reason == "stop_sequence" and reply.stop_sequence in ("\n", "sort"),
              f"stop_reason {reply.stop_reason}, stop_sequence {reply.stop_sequence!r}")
        return f"stop_sequence {reply.stop_sequence!r} after {reply.content[0].text if reply.content else ''!r}"

    rows.run("anthropic", "messages.create", create)
    rows.run("anthropic", "messages.stream", stream)
    rows.run("anthropic", "tool_use round trip", tool_round(False))
    rows.run("anthropic", "tool_use round trip, streamed", tool_round(True))
    rows.run("anthropic", "messages.count_tokens", count)
    rows.run("anthropic", "stop_sequences, two given", stop_sequences)


def utility_rows(rows: Rows, base: str, model: str) -> None:
    http = httpx.Client(base_url=base, timeout=600)

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = http.post(path, json=body)
        check(reply.status_code == 200, f"{reply.status_code} {reply.text[:200]}")
        return reply.json()

    def tokenize() -> str:
        out = post("/tokenize", {"prompt": "def quicksort(arr):", "return_token_strs": True})
        check(out["count"] == len(out["tokens"]) > 0 and len(out["token_strs"]) == out["count"], str(out))
        chat = post("/tokenize", {"model": model, "messages": [{"role": "user", "content": "Hi"}]})
        check(chat["count"] > out["count"], "the chat form adds the template's tokens")
        return f"{out['count']} tokens, chat form {chat['count']}, max_model_len {out['max_model_len']}"

    def detokenize() -> str:
        tokens = post("/tokenize", {"prompt": "def quicksort(arr):"})["tokens"]
        text = post("/detokenize", {"tokens": tokens})["prompt"]
        check(text == "def quicksort(arr):", repr(text))
        return f"round trip {text!r}"

    def infill() -> str:
        out = post("/infill", {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
                               "n_predict": 8, "temperature": 0})
        check(isinstance(out["content"], str) and out["content"] != "" and out["tokens_predicted"] > 0, str(out))
        with http.stream("POST", "/infill", json={"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n",
                                                  "n_predict": 8, "temperature": 0, "stream": True}) as reply:
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: ")]
        check(events and events[-1]["stop"] is True, "the stream ends with stop: true")
        return f"{out['content']!r}, stop_type {out['stop_type']}; streamed {len(events)} events"

    def apply_template() -> str:
        out = post("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]})
        check("Hi" in out["prompt"] and out["prompt"].rstrip().endswith("assistant"), repr(out["prompt"][-60:]))
        return f"{len(out['prompt'])} characters, ends {out['prompt'][-22:]!r}"

    def props() -> str:
        reply = http.get("/props")
        check(reply.status_code == 200, f"{reply.status_code}")
        out = reply.json()
        check(out["model_path"] == model and out["default_generation_settings"]["n_ctx"] > 0, str(out)[:200])
        return f"n_ctx {out['default_generation_settings']['n_ctx']}, total_slots {out['total_slots']}"

    rows.run("http", "/tokenize", tokenize)
    rows.run("http", "/detokenize", detokenize)
    rows.run("http", "/infill, whole and streamed", infill)
    rows.run("http", "/apply-template", apply_template)
    rows.run("http", "/props", props)


def start_server(port: int, extra: list[str]) -> subprocess.Popen[bytes]:
    command = ["specdecode", "serve", "--method", "auto", "--port", str(port), *extra]
    print("$", " ".join(command), file=sys.stderr, flush=True)
    server = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr)
    deadline = time.time() + START_TIMEOUT_SECONDS
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.terminate()
    raise SystemExit("the server did not answer /health in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server already running (else one is started)")
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("--serve-args", default="", help="more `specdecode serve` arguments, one string")
    args = parser.parse_args()
    server = None if args.url else start_server(args.port, args.serve_args.split())
    base = args.url or f"http://127.0.0.1:{args.port}"
    try:
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        rows = Rows()
        openai_rows(rows, base, model)
        agents_rows(rows, base, model)
        anthropic_rows(rows, base, model)
        utility_rows(rows, base, model)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    print(f"model {model}")
    print(rows.table())
    failed = sum(not ok for _, _, ok, _, _ in rows.rows)
    print(f"{len(rows.rows) - failed} of {len(rows.rows)} rows pass")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
