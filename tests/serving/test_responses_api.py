"""``/v1/responses`` (serving/responses_api.py) through the official openai SDK and an
openai-agents ``Agent``: the greedy text equals chat completions' for the same conversation,
streamed (the Responses events in order, numbered) and not; a function call round trip; a
``previous_response_id`` continuation equals sending the whole conversation; ``store: false``,
another API key and a deleted response are 404s; ``text.format`` json_schema output validates;
``input_items`` lists a response's input (earlier turns' included) in OpenAI's pages, per key;
``include`` logprobs equal the chat route's, streamed and not; ``truncation: "auto"`` leaves out
the fewest oldest messages that make the prompt fit; ``conversation`` and other ``include``
values are 400s naming them; the store's bounds (serving/responses_store.py) on their own."""

import asyncio
import json
from urllib.parse import quote

import httpx
import jsonschema
import openai
import pytest
from server_helpers import MESSAGES, MODEL, TEXT_CALL_TEXT, chat_chunks, client, openai_error, schema_fuzz

from specdecode.serving.responses_store import ResponseStore, response_tenant

pytest.importorskip("xgrammar")

MAX_TOKENS = 12
ASK = "Weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "weather", "parameters": WEATHER, "strict": True}]
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["color", "ok"], "additionalProperties": False}


def chat_text(base: str, messages: list[dict], **extra) -> str:
    extra.setdefault("max_tokens", MAX_TOKENS)
    reply = client(base).chat.completions.create(model=MODEL, messages=messages, temperature=0, **extra)
    return reply.choices[0].message.content


def test_create_equals_chat_completions(served) -> None:
    base, _ = served
    reply = client(base).responses.create(model=MODEL, input=ASK, instructions="Be brief.",
                                          max_output_tokens=MAX_TOKENS, temperature=0)
    expected = chat_text(base, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    assert reply.status in ("completed", "incomplete") and reply.output_text == expected
    assert reply.output[0].type == "message" and reply.output[0].content[0].type == "output_text"
    assert reply.usage.output_tokens > 0 and reply.usage.input_tokens > 0
    # Items as input, with text parts, say the same.
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    again = client(base).responses.create(model=MODEL, input=items, instructions="Be brief.",
                                          max_output_tokens=MAX_TOKENS, temperature=0)
    assert again.output_text == expected


def test_stream_sends_the_responses_events_in_order(served) -> None:
    base, _ = served
    expected = chat_text(base, [{"role": "user", "content": ASK}])
    with client(base).responses.stream(model=MODEL, input=ASK, max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == expected == final.output_text
    assert final.usage.output_tokens > 0
    # The streamed response was stored like a whole one.
    assert client(base).responses.retrieve(final.id).output_text == expected


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_round_trip(served, stream: bool) -> None:
    """tool_choice required: one function_call item whose arguments validate; its output sent
    back with previous_response_id gives the same text as the whole conversation through chat."""
    base, _ = served
    api = client(base)
    if stream:
        with api.responses.stream(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=100,
                                  temperature=0) as events:
            kinds = [event.type for event in events]
            first = events.get_final_response()
        assert "response.function_call_arguments.done" in kinds
        assert kinds.count("response.function_call_arguments.delta") > 1  # the arguments as they decode
    else:
        first = api.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=100,
                                     temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    result = json.dumps({"temperature": 21})
    second = api.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=MAX_TOKENS,
                                  temperature=0, input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                                         "output": result}])
    chat_tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}}]
    history = [{"role": "user", "content": ASK},
               {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function",
                                                                     "function": {"name": "weather",
                                                                                  "arguments": calls[0].arguments}}]},
               {"role": "tool", "tool_call_id": calls[0].call_id, "content": result}]
    assert second.output_text == chat_text(base, history, tools=chat_tools)


def test_previous_response_id_equals_the_whole_conversation(served) -> None:
    base, _ = served
    api = client(base)
    first = api.responses.create(model=MODEL, input=ASK, max_output_tokens=MAX_TOKENS, temperature=0)
    second = api.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=first.id,
                                  max_output_tokens=MAX_TOKENS, temperature=0)
    whole = [{"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And tomorrow?"}]
    assert second.output_text == chat_text(base, whole)
    assert second.previous_response_id == first.id
    # The items form of the same conversation (the assistant's output echoed back) agrees.
    items = [{"role": "user", "content": ASK}, *[item.model_dump() for item in first.output],
             {"role": "user", "content": "And tomorrow?"}]
    assert api.responses.create(model=MODEL, input=items, max_output_tokens=MAX_TOKENS,
                                temperature=0).output_text == second.output_text


def test_unstored_deleted_and_other_tenants_responses_are_404(served) -> None:
    base, _ = served
    owner, other = client(base, api_key="owner-key"), client(base, api_key="other-key")
    unstored = owner.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError, match="store: false"):
        owner.responses.create(model=MODEL, input="more", previous_response_id=unstored.id, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        owner.responses.retrieve(unstored.id)
    kept = owner.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0)
    assert owner.responses.retrieve(kept.id).output_text == kept.output_text
    for call in (lambda: other.responses.retrieve(kept.id), lambda: other.responses.delete(kept.id),
                 lambda: other.responses.create(model=MODEL, input="more", previous_response_id=kept.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    owner.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        owner.responses.retrieve(kept.id)


def test_text_format_json_schema_validates(served) -> None:
    base, _ = served
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    reply = client(base).responses.create(model=MODEL, input=MESSAGES[0]["content"], text=fmt, max_output_tokens=200,
                                          temperature=0)
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    assert reply.output_text == chat_text(base, MESSAGES, response_format=response_format, max_tokens=200)
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert reply.text.format.type == "json_schema"


def test_bad_requests_say_what_to_change(served) -> None:
    base, _ = served
    api = client(base)
    with pytest.raises(openai.BadRequestError, match="function tools only"):
        api.responses.create(model=MODEL, input=ASK, tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="text parts only"):
        api.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_image",
                                                                               "image_url": "x"}]}])


def test_input_items_lists_a_responses_input_in_pages(served) -> None:
    """The items in OpenAI's item shapes, each with an id (an echoed output item keeps its own);
    a continuation's list holds the earlier turn's input and output first; newest first unless
    asc; the SDK's pages (limit, after) add up to the whole list."""
    base, _ = served
    api = client(base, api_key="items-key")
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    first = api.responses.create(model=MODEL, input=items, max_output_tokens=4, temperature=0)
    second = api.responses.create(model=MODEL, input="And tomorrow?", previous_response_id=first.id,
                                  max_output_tokens=4, temperature=0)
    listed = list(api.responses.input_items.list(second.id, order="asc"))
    assert [(item.type, getattr(item, "role", None)) for item in listed] == [
        ("message", "developer"), ("message", "user"), ("message", "assistant"), ("message", "user")]
    assert listed[1].content[0].text == ASK and listed[3].content[0].text == "And tomorrow?"
    assert listed[2].id == first.output[0].id and listed[2].content[0].text == first.output_text
    ids = [item.id for item in listed]
    assert len(set(ids)) == len(ids) and all(ids)
    assert [item.id for item in api.responses.input_items.list(second.id)] == ids[::-1]  # desc by default
    assert [item.id for item in api.responses.input_items.list(second.id, order="asc", limit=3)] == ids  # 2 pages
    page = httpx.get(f"{base}/v1/responses/{second.id}/input_items", params={"order": "asc", "limit": 3,
                                                                             "after": ids[0]},
                     headers={"authorization": "Bearer items-key"}).json()
    assert page["object"] == "list" and [item["id"] for item in page["data"]] == ids[1:4]
    assert (page["first_id"], page["last_id"], page["has_more"]) == (ids[1], ids[3], False)
    # A function call round trip lists its call and its output.
    call = api.responses.create(model=MODEL, input=ASK, tools=TOOLS, tool_choice="required", max_output_tokens=100,
                                temperature=0)
    call_id = call.output[0].call_id
    answer = api.responses.create(model=MODEL, previous_response_id=call.id, max_output_tokens=4, temperature=0,
                                  input=[{"type": "function_call_output", "call_id": call_id, "output": "sunny"}])
    kinds = [(item.type, getattr(item, "call_id", None)) for item in api.responses.input_items.list(answer.id,
                                                                                                   order="asc")]
    assert kinds == [("message", None), ("function_call", call_id), ("function_call_output", call_id)]


def test_input_items_errors_are_openai_errors(served) -> None:
    base, _ = served
    owner, other = client(base, api_key="owner-items"), client(base, api_key="other-items")
    kept = owner.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0)
    unstored = owner.responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0, store=False)
    for api, response_id in ((other, kept.id), (owner, unstored.id), (owner, "resp_never")):
        with pytest.raises(openai.NotFoundError, match="No stored response"):
            api.responses.input_items.list(response_id)
    url = f"{base}/v1/responses/{kept.id}/input_items"
    headers = {"authorization": "Bearer owner-items"}
    for params, param in (({"limit": 0}, "limit"), ({"limit": "many"}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_unknown"}, "after"), ({"include": "file_search_call.results"}, "include")):
        reply = httpx.get(url, params=params, headers=headers)
        assert reply.status_code == 400 and openai_error(reply.json()), reply.text
        assert reply.json()["error"]["param"] == param


def test_include_logprobs_equal_the_chat_routes(served) -> None:
    """include message.output_text.logprobs with top_logprobs: the output_text part's logprobs are
    the chat completion's for the same conversation; streamed, the deltas' and the done event's
    say the same; without include there are none."""
    base, _ = served
    api = client(base)
    include = ["message.output_text.logprobs"]
    reply = api.responses.create(model=MODEL, input=ASK, max_output_tokens=MAX_TOKENS, temperature=0,
                                 include=include, top_logprobs=2)
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], temperature=0,
                                       max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=2)
    expected = [(entry.token, entry.logprob, [(top.token, top.logprob) for top in entry.top_logprobs])
                for entry in chat.choices[0].logprobs.content]
    logprobs = reply.output[0].content[0].logprobs
    assert [(entry.token, entry.logprob, [(top.token, top.logprob) for top in entry.top_logprobs])
            for entry in logprobs] == expected
    assert len(expected) > 0 and all(len(tops) == 2 for _, _, tops in expected)
    with api.responses.stream(model=MODEL, input=ASK, max_output_tokens=MAX_TOKENS, temperature=0, include=include,
                              top_logprobs=2) as stream:
        events = list(stream)
    deltas = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    done = next(event for event in events if event.type == "response.output_text.done")
    assert [(entry.token, entry.logprob) for entry in done.logprobs] == [(token, lp) for token, lp, _ in expected]
    assert [(entry.token, entry.logprob) for entry in deltas] == [(token, lp) for token, lp, _ in expected][:len(deltas)]
    final = events[-1].response.output[0].content[0].logprobs
    assert [(entry.token, entry.logprob) for entry in final] == [(token, lp) for token, lp, _ in expected]
    plain = api.responses.create(model=MODEL, input=ASK, max_output_tokens=MAX_TOKENS, temperature=0, top_logprobs=2)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 2


def test_unserved_include_values_and_conversation_are_400s(served) -> None:
    base, _ = served
    api = client(base)
    with pytest.raises(openai.BadRequestError, match="file_search_call.results") as caught:
        api.responses.create(model=MODEL, input=ASK, include=["file_search_call.results"])
    assert caught.value.body["param"] == "include"
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        api.responses.create(model=MODEL, input=ASK, include=["message.output_text.logprobs"], top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="'conversation'") as caught:
        api.responses.create(model=MODEL, input=ASK, conversation="conv_123")
    assert caught.value.body["param"] == "conversation"
    with pytest.raises(openai.BadRequestError, match="truncation"):
        api.responses.create(model=MODEL, input=ASK, extra_body={"truncation": "middle"})
    # null is the default, as OpenAI takes it.
    plain = httpx.post(f"{base}/v1/responses", json={"model": MODEL, "input": ASK, "max_output_tokens": 4,
                                                     "truncation": None, "include": None}, timeout=60)
    assert plain.status_code == 200 and plain.json()["truncation"] == "disabled", plain.text
    # Encrypted reasoning, which Codex-style clients always ask for, is served (vacuously).
    reply = api.responses.create(model=MODEL, input=ASK, max_output_tokens=4, include=["reasoning.encrypted_content"])
    assert reply.output_text


TURNS = 24  # alternating user and assistant messages: more than the tiny model's 512 positions
TURN_TEXT = "Tell me about the weather in Paris and Lyon today, and tomorrow. "


@pytest.mark.parametrize("stream", [False, True])
def test_truncation_auto_leaves_out_the_fewest_oldest_messages(served, stream: bool) -> None:
    """A conversation past the context: with truncation disabled a 400 that names the way out;
    with auto the answer is the chat completion's of the instructions and the newest messages,
    and one message more would not have fitted."""
    base, _ = served
    api = client(base)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{i}: {TURN_TEXT * 2}"}
             for i in range(TURNS + 1)]
    ask = {"model": MODEL, "input": turns, "instructions": "Be brief.", "max_output_tokens": MAX_TOKENS,
           "temperature": 0}
    with pytest.raises(openai.BadRequestError, match="truncation") as caught:
        api.responses.create(**ask)
    assert caught.value.body["param"] == "input" and "max_tokens" not in caught.value.body["message"].replace(
        "max_output_tokens", "")
    if stream:
        with api.responses.stream(**ask, truncation="auto") as events:
            reply = events.get_final_response()
    else:
        reply = api.responses.create(**ask, truncation="auto")
    dropped = reply.model_extra["specdecode"]["truncated_messages"]
    assert 0 < dropped < len(turns) and reply.truncation == "auto"
    system = [{"role": "system", "content": "Be brief."}]
    assert reply.output_text == chat_text(base, system + turns[dropped:])
    with pytest.raises(openai.BadRequestError):
        chat_text(base, system + turns[dropped - 1:])
    # input_items still lists the whole input: truncation shapes the prompt, not the record.
    assert len(list(api.responses.input_items.list(reply.id, limit=100))) == len(turns)


def test_truncation_auto_keeps_a_calls_output_with_its_call(served) -> None:
    """Turns of a question, a function_call and its output, past the context: the kept messages
    never start at a tool's output, and the answer is the chat completion's of them."""
    base, _ = served
    items, messages = [], []
    for i in range(TURNS // 3 + 1):
        call_id, output = f"call_{i}", f"{i}: {TURN_TEXT * 2}"
        items += [{"role": "user", "content": f"{i}: {TURN_TEXT}"},
                  {"type": "function_call", "call_id": call_id, "name": "weather", "arguments": '{"city": "Lyon"}'},
                  {"type": "function_call_output", "call_id": call_id, "output": output}]
        messages += [{"role": "user", "content": f"{i}: {TURN_TEXT}"},
                     {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": {
                         "name": "weather", "arguments": '{"city": "Lyon"}'}}]},
                     {"role": "tool", "tool_call_id": call_id, "content": output}]
    reply = client(base).responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none",
                                          max_output_tokens=MAX_TOKENS, temperature=0, truncation="auto")
    dropped = reply.model_extra["specdecode"]["truncated_messages"]
    assert 0 < dropped < len(messages) and messages[dropped]["role"] != "tool"
    chat_tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER, "strict": True}}]
    assert reply.output_text == chat_text(base, messages[dropped:], tools=chat_tools, tool_choice="none")


def test_an_agents_sdk_agent_runs_to_a_final_output(served) -> None:
    """openai-agents on its default model (the Responses API) with a function tool."""
    agents = pytest.importorskip("agents")
    base, _ = served
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=base + "/v1", api_key="agent-key", max_retries=0),
                                     use_for_tracing=False)
    agents.set_default_openai_api("responses")

    @agents.function_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    # The tiny model never ends a text answer by itself (the SDK rightly fails a response cut
    # by max_output_tokens), so the agent must call its tool, and its output is the final one.
    settings = agents.ModelSettings(temperature=0, max_tokens=100, tool_choice="required")
    agent = agents.Agent(name="helper", instructions="Be brief.", model=MODEL, tools=[weather],
                         model_settings=settings, tool_use_behavior="stop_on_first_tool")

    async def both() -> tuple[str, str]:  # one event loop: the client's connections belong to it
        whole = await agents.Runner.run(agent, ASK, max_turns=3)
        run = agents.Runner.run_streamed(agent, ASK, max_turns=3)
        async for _ in run.stream_events():
            pass
        return whole.final_output, run.final_output

    assert asyncio.run(both()) == ("sunny", "sunny")


def test_the_store_is_bounded_per_tenant_in_count_and_bytes() -> None:
    store = ResponseStore(max_per_tenant=2, max_tenant_bytes=400, max_total_bytes=700)
    a, b = response_tenant("Bearer a"), response_tenant("Bearer b")
    assert a != b and response_tenant(None) != a
    for i in range(3):
        assert store.put(a, {"id": f"r{i}"}, [])
    assert store.get(a, "r0") is None and store.get(a, "r1") is not None and store.get(b, "r1") is None
    assert not store.put(a, {"id": "big", "text": "x" * 500}, [])  # over a tenant's whole budget: not kept
    store.put(a, {"id": "r3"}, [])  # r1 was read after r2: r2 goes
    assert store.get(a, "r2") is None and store.get(a, "r1") is not None
    for i in range(3):
        store.put(b, {"id": f"b{i}", "text": "y" * 150}, [])
    assert store.get(b, "b0") is None and store.total_bytes <= 700 and store.tenant_bytes(b) <= 400
    assert store.delete(a, "r1") and not store.delete(a, "r1")


FUZZ_EXAMPLES = 30  # per generation mode
FUZZ_MAX_TOKENS = 16
FUZZ_TEXT_CHARS = 64  # texts cut so that a valid prompt fits the tiny model's 512 positions
FUZZ_REQUEST_SECONDS = 20  # a slower answer is a hang


def _shorten(body: object) -> object:
    """A generated body made cheap and, where it was valid, still valid: few tokens to decode, a
    few short input items and instructions, tools without large schemas; no previous response
    (a random id is a plain 404)."""
    if not isinstance(body, dict):
        return body
    body.pop("previous_response_id", None)
    if body.get("max_output_tokens") is None or isinstance(body["max_output_tokens"], int) \
            and body["max_output_tokens"] > FUZZ_MAX_TOKENS:
        body["max_output_tokens"] = FUZZ_MAX_TOKENS
    for name in ("input", "instructions"):
        if isinstance(body.get(name), str):
            body[name] = body[name][:FUZZ_TEXT_CHARS]
    if isinstance(body.get("input"), list):
        body["input"] = body["input"][:4]
        for item in body["input"]:
            for key in ("content", "output", "arguments"):
                value = item.get(key) if isinstance(item, dict) else None
                if isinstance(value, str):
                    item[key] = value[:FUZZ_TEXT_CHARS]
                elif isinstance(value, list):
                    item[key] = [{**part, "text": part["text"][:FUZZ_TEXT_CHARS]} if isinstance(part, dict)
                                 and isinstance(part.get("text"), str) else part for part in value[:2]]
    if isinstance(body.get("tools"), list):
        body["tools"] = [{**tool, "parameters": {"type": "object"}, "description": ""} if isinstance(tool, dict) else tool
                         for tool in body["tools"][:2]]
    return body


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzz_gets_no_5xx(served, mode: str) -> None:
    """Bodies generated from /openapi.json's schema of /v1/responses, valid and not: each answer
    is a 200 (streams end in response.completed) or a 4xx with the OpenAI error body."""
    base, _ = served

    def finished(body: object, response: httpx.Response) -> None:
        if response.status_code >= 400:
            return
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [json.loads(line[len("data: "):]) for line in response.text.split("\n") if line.startswith("data: ")]
            assert events[-1]["type"] == "response.completed", response.text
        else:
            assert response.json()["object"] == "response", response.text

    statuses = schema_fuzz(base, "/v1/responses", mode, FUZZ_EXAMPLES, prepare=_shorten, check=finished,
                           timeout=FUZZ_REQUEST_SECONDS)
    if mode == "positive":
        assert statuses.count(200) >= len(statuses) // 3, statuses
    print(f"fuzz {mode} /v1/responses: {len(statuses)} requests, statuses {sorted(set(statuses))}")


ITEMS_FUZZ_EXAMPLES = 40  # per generation mode; each a GET, no decoding


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_input_items_query_fuzz_gets_no_5xx(served, mode: str) -> None:
    """Queries generated from /openapi.json's parameters of GET /v1/responses/{id}/input_items
    (schema_fuzz POSTs bodies; this route has a query), on a stored response's id half the time:
    each answer a 200 list or a 4xx with the OpenAI error body."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    base, _ = served
    kept = client(base).responses.create(model=MODEL, input=ASK, max_output_tokens=4, temperature=0)
    operation = schemathesis.openapi.from_url(base + "/openapi.json")["/v1/responses/{response_id}/input_items"]["GET"]
    statuses = []

    @given(operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)), st.booleans())
    @settings(max_examples=ITEMS_FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def send(case, stored: bool) -> None:
        response_id = kept.id if stored else str((case.path_parameters or {}).get("response_id", ""))
        reply = httpx.get(f"{base}/v1/responses/{quote(response_id, safe='')}/input_items", params=case.query,
                          headers={"authorization": "Bearer unused"}, timeout=FUZZ_REQUEST_SECONDS)
        assert reply.status_code < 500, (case.query, reply.text)
        if reply.status_code >= 400:
            assert openai_error(reply.json()), reply.text
        else:
            assert reply.json()["object"] == "list", reply.text
        statuses.append(reply.status_code)

    send()
    if mode == "positive":
        assert 200 in statuses, statuses
    print(f"fuzz {mode} input_items: {len(statuses)} requests, statuses {sorted(set(statuses))}")


def test_the_events_of_text_a_streamed_call_and_text_again() -> None:
    """Chat chunks (text, a call in pieces, text after it) as Responses events: each text its own
    message item holding its own text, the call an item between them whose argument deltas add
    up to its arguments."""
    from specdecode.serving.responses_api import ResponseShell, response_events

    chunks = chat_chunks(TEXT_CALL_TEXT, {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12})
    kept = []

    async def collect() -> list[dict]:
        shell = ResponseShell({"input": ASK}, MODEL, [])
        return [json.loads(event[len("data: "):]) async for event in
                response_events(chunks, shell, lambda body, conversation: kept.append(body))]

    events = asyncio.run(collect())
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "message"]
    assert [item["content"][0]["text"] for item in (output[0], output[2])] == ["Let me look.", "Done."]
    assert output[1]["arguments"] == '{"city":"Oslo"}' and output[1]["call_id"] == "call_1"
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        '{"city":"Oslo"}'
    assert [e["text"] for e in events if e["type"] == "response.output_text.done"] == ["Let me look.", "Done."]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert kept == [events[-1]["response"]] and events[-1]["type"] == "response.completed"
