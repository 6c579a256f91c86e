"""Anthropic's Messages API (serving/anthropic_messages.py) through the real anthropic SDK on the
tiny models: greedy text identical to the same conversation through chat completions, whole and
streamed (with Anthropic's event sequence and ``event:`` lines); a tool_use round trip whose
forced call validates against the tool's input_schema; count_tokens equal to the request's
prompt tokens; the stop reasons; errors in Anthropic's shape; the key from ``x-api-key``; and
speculation on, with the chat route's method."""

import json
import time

import anthropic
import httpx
import jsonschema
import pytest
from server_helpers import MODEL, TEXT_CALL_TEXT, chat_chunks, client, metric, schema_fuzz, wait_for

import specdecode.engine.batch
from specdecode.serving.anthropic_messages import to_chat
from specdecode.serving.api_errors import APIError
from specdecode.serving.guard import GuardOptions
from specdecode.serving.server import ServerOptions

SYSTEM = "Answer briefly."
# Sampling fields the SDK has no parameters for (Anthropic's API takes them; the SDK sends them as extra_body).
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "Write a quicksort"}]
DIGIT = {"enum": [1, 2, 3]}
ADD = {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a", "b"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"name": "weather", "input_schema": WEATHER}, {"name": "add", "description": "Adds", "input_schema": ADD}]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}


def messages_client(base: str, **keys) -> anthropic.Anthropic:
    keys = keys or {"api_key": "unused"}
    return anthropic.Anthropic(base_url=base, max_retries=0, timeout=60, **keys)


def chat_reply(base: str, **body):
    return client(base).chat.completions.create(model=MODEL, temperature=0, **body)


def test_create_and_stream_give_the_chat_routes_greedy_text(served) -> None:
    base, _ = served
    chat = chat_reply(base, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=24)
    raw = messages_client(base).messages.with_raw_response.create(model=MODEL, system=SYSTEM, messages=ASK,
                                                                  max_tokens=24, extra_body=GREEDY)
    message = raw.parse()
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.role == "assistant" and message.id.startswith("msg_") and message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == chat.usage.completion_tokens == 24
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # Speculation stays on: the same method as the chat route's, not plain decoding.
    spec = raw.http_response.json()["specdecode"]
    assert spec["method"] == chat.model_extra["specdecode"]["method"] != "none"
    assert spec["target_forward_passes"] < 24  # drafts were accepted: fewer passes than tokens

    with messages_client(base).messages.stream(model=MODEL, system=[{"type": "text", "text": SYSTEM}],
                                               messages=ASK, max_tokens=24, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == chat.choices[0].message.content
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24


def test_the_stream_is_anthropics_event_sequence(served) -> None:
    base, _ = served
    body = {"model": MODEL, "messages": ASK, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/messages", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        text = response.read().decode()
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    datas = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert all(lines[0].startswith("event: ") and lines[1].startswith("data: ") for lines in events)
    assert [data["type"] for data in datas] == names  # each event's name is its data's type
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert all(data["delta"]["type"] == "text_delta" for data in datas[2:-3])
    assert datas[-2]["delta"]["stop_reason"] == "max_tokens" and datas[-2]["usage"]["output_tokens"] == 6


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_use_round_trip(served, choice: dict, stream: bool) -> None:
    """tool_choice any or a named tool makes the reply one tool_use block whose input follows the
    tool's input_schema (the chat route's grammar); its result sent back as a tool_result block
    gets a text answer, and count_tokens counts that turn's prompt exactly."""
    pytest.importorskip("xgrammar")
    base, _ = served
    sdk = messages_client(base)
    ask = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 100,
           "extra_body": GREEDY}
    if stream:
        with sdk.messages.stream(**ask) as events:
            kinds = [event.type for event in events]
            first = events.get_final_message()
        assert kinds.count("input_json") > 1  # the input as it decodes, in several input_json_delta
    else:
        first = sdk.messages.create(**ask)
    assert first.stop_reason == "tool_use" and [block.type for block in first.content] == ["tool_use"]
    call = first.content[0]
    assert call.id.startswith("toolu_") and (call.name == "add" or choice["type"] == "any")
    jsonschema.validate(call.input, SCHEMAS[call.name])
    history = [*ASK, {"role": "assistant", "content": [block.model_dump() for block in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "3"}]}]
    second = sdk.messages.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.content
    counted = sdk.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    # The same prompt as the chat route's, the call and its result included.
    chat_history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    chat = chat_reply(base, messages=chat_history, max_tokens=8,
                      tools=[{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}
                              | ({"description": t["description"]} if "description" in t else {})} for t in TOOLS])
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_count_tokens_is_the_prompt_of_the_same_request(served) -> None:
    base, dec = served
    sdk = messages_client(base)
    counted = sdk.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == len(dec.encode([{"role": "system", "content": SYSTEM}, *ASK], chat=True))
    message = sdk.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=2, extra_body=GREEDY)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_stop_sequences_and_max_tokens_stop_reasons(served) -> None:
    base, _ = served
    sdk = messages_client(base)
    whole = sdk.messages.create(model=MODEL, messages=ASK, max_tokens=30, extra_body=GREEDY)
    text = whole.content[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip())
    cut = sdk.messages.create(model=MODEL, messages=ASK, max_tokens=30, stop_sequences=[stop],
                              extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.find(stop)]
    # Several stop sequences: the one that matched is named (the first in the text, whatever its place in the list).
    later = next(text[i:i + 2] for i in range(text.find(stop) + 2, len(text) - 2) if text[i:i + 2].strip()
                 and text[i:i + 2] not in text[:text.find(stop) + 1])
    for stops in ([later, stop], [stop, later]):
        for stream in (False, True):
            if stream:
                with sdk.messages.stream(model=MODEL, messages=ASK, max_tokens=30, stop_sequences=stops,
                                         extra_body=GREEDY) as events:
                    several = events.get_final_message()
            else:
                several = sdk.messages.create(model=MODEL, messages=ASK, max_tokens=30, stop_sequences=stops,
                                              extra_body=GREEDY)
            assert several.stop_reason == "stop_sequence" and several.stop_sequence == stop
            assert several.content[0].text == text[:text.find(stop)]
    short = sdk.messages.create(model=MODEL, messages=ASK, max_tokens=3, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3 and text.startswith(short.content[0].text)


def test_errors_come_in_anthropics_shape(served) -> None:
    base, _ = served
    missing = httpx.post(base + "/v1/messages", json={"model": MODEL, "messages": ASK}, timeout=60)
    assert missing.status_code == 400
    assert missing.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": missing.json()[
        "error"]["message"]}} and "max_tokens" in missing.json()["error"]["message"]
    sdk = messages_client(base)
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(model=MODEL, messages=[{"role": "system", "content": "x"}], max_tokens=4)
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "'system'" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        sdk.messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):  # the chat route's checks, in this shape
        sdk.messages.create(model=MODEL, messages=ASK, max_tokens=4, tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError):
        sdk.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [{"type": "image"}]}])


def test_the_key_comes_from_x_api_key_or_bearer(start_server) -> None:
    with start_server(ServerOptions(guard=GuardOptions(api_key="s3cret"))) as (base, _):
        for keys in ({"api_key": "s3cret"}, {"auth_token": "s3cret"}):
            reply = messages_client(base, **keys).messages.create(model=MODEL, messages=ASK, max_tokens=2)
            assert reply.usage.output_tokens == 2
        with pytest.raises(anthropic.AuthenticationError) as refused:
            messages_client(base, api_key="wrong").messages.create(model=MODEL, messages=ASK, max_tokens=2)
        assert refused.value.status_code == 401 and refused.value.body["type"] == "error"
        assert refused.value.body["error"]["type"] == "authentication_error"
        # The other routes take either header too, and keep OpenAI's error shape.
        assert httpx.get(base + "/v1/models", headers={"x-api-key": "s3cret"}).status_code == 200
        wrong = httpx.get(base + "/v1/models", headers={"x-api-key": "s3cret-and-more"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def test_the_translation_onto_a_chat_body() -> None:
    body = {"model": MODEL, "max_tokens": 5, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "stop_sequences": ["\n\n"], "top_k": 3, "metadata": {"user_id": "u"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "calling"},
                                                           {"type": "tool_use", "id": "toolu_1", "name": "add",
                                                            "input": {"a": 1, "b": 2}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                       "content": [{"type": "text", "text": "3"}]},
                                                      {"type": "text", "text": "thanks"}]}],
            "tools": TOOLS, "tool_choice": {"type": "tool", "name": "add"}}
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "a\nb"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3"}, {"role": "user", "content": "thanks"}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "add"}} and chat["stop"] == ["\n\n"]
    assert chat["tools"][1] == {"type": "function", "function": {"name": "add", "parameters": ADD,
                                                                 "description": "Adds"}}
    assert chat["top_k"] == 3 and "metadata" not in chat and "stream" not in chat
    assert to_chat(dict(body, tool_choice={"type": "any"}))["tool_choice"] == "required"
    for bad, param in (({"max_tokens": None}, "max_tokens"), ({"tools": [{"type": "web_search_20250305"}]}, "tools"),
                       ({"thinking": {"type": "enabled", "budget_tokens": 9}}, "thinking"),
                       ({"stop_sequences": "x"}, "stop_sequences"), ({"stream": "yes"}, "stream"), ({"tool_choice": {"type": "sometimes"}},
                                                                     "tool_choice")):
        with pytest.raises(APIError) as refused:
            to_chat(dict(body, **bad))
        assert refused.value.status == 400 and refused.value.param == param


def test_the_routes_are_in_the_openapi_document(served) -> None:
    base, _ = served
    paths = httpx.get(base + "/openapi.json").json()["paths"]
    schema = paths["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["messages", "max_tokens"] and "tool_choice" in schema["properties"]
    counted = paths["/v1/messages/count_tokens"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "max_tokens" not in counted["properties"]


def test_a_client_that_leaves_a_whole_message_cancels_it(served, monkeypatch) -> None:
    """Without stream the reply is folded from the chat route's stream: a client that hangs up
    still cancels its request and frees its KV blocks, as on the chat route."""
    base, _ = served
    verify = specdecode.engine.batch.BatchEngine._verify
    monkeypatch.setattr(specdecode.engine.batch.BatchEngine, "_verify",
                        lambda self, *args: (time.sleep(0.05), verify(self, *args))[1])  # ~10 steps in 0.5 s
    cancelled = metric(base, 'specdecode_requests_total{status="cancelled"}')
    body = {"model": MODEL, "messages": ASK, "max_tokens": 400, "temperature": 0}  # greedy: past 30 tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/messages", json=body, timeout=0.5)
    wait_for(lambda: metric(base, 'specdecode_requests_total{status="cancelled"}') == cancelled + 1,
             "the request was not cancelled")
    wait_for(lambda: metric(base, "specdecode_kv_blocks_used") == 0, "the cancelled request kept its KV blocks")


FUZZ_EXAMPLES = 30
FUZZ_TEXT_CHARS = 64  # texts cut so that a valid prompt fits the tiny model's context


def _shorten(body: object) -> object:
    """A generated body made cheap: at most 16 new tokens, four messages, short texts and schemas."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 16)
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:4]
        for message in body["messages"]:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                message["content"] = message["content"][:FUZZ_TEXT_CHARS]
    if isinstance(body.get("system"), str):
        body["system"] = body["system"][:FUZZ_TEXT_CHARS]
    for tool in body.get("tools") or [] if isinstance(body.get("tools"), list) else []:
        if isinstance(tool, dict):
            tool.update(input_schema={"type": "object"}, description=str(tool.get("description", ""))[:FUZZ_TEXT_CHARS])
    return body


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schema_fuzz_gets_no_5xx_and_anthropic_errors(served, path: str, mode: str) -> None:
    """Bodies generated from the routes' own OpenAPI schemas: every answer is a 200 or a 4xx in
    Anthropic's error shape."""
    base, _ = served

    def anthropic_error(body: object) -> bool:
        return isinstance(body, dict) and body.get("type") == "error" and set(body.get("error") or {}) == {
            "type", "message"}

    statuses = schema_fuzz(base, path, mode, FUZZ_EXAMPLES, prepare=_shorten, is_error=anthropic_error)
    print(f"fuzz {mode} {path}: {len(statuses)} requests, statuses {sorted(set(statuses))}")


def test_the_events_of_text_a_streamed_call_and_text_again() -> None:
    """Chat chunks (text, a call in pieces, text after it) as Anthropic's blocks: text, tool_use,
    text, each opened and closed once; the input_json_delta pieces fold into the tool_use input."""
    import asyncio
    from types import SimpleNamespace

    from specdecode.engine.metrics import GenerationStats
    from specdecode.serving.anthropic_messages import message_events, whole_message

    generation = SimpleNamespace(request=SimpleNamespace(prompt=[1, 2, 3]), failure=lambda: None,
                                 stats=GenerationStats(stop_reason="eos"))

    async def run() -> tuple[list[tuple[str, dict]], dict]:
        events = [event async for event in message_events(chat_chunks(TEXT_CALL_TEXT), generation, MODEL)]

        async def replay():
            for event in events:
                yield event

        return events, await whole_message(replay())

    events, message = asyncio.run(run())
    names = [name for name, _ in events]
    assert names.count("content_block_start") == names.count("content_block_stop") == 3
    assert [block["type"] for block in message["content"]] == ["text", "tool_use", "text"]
    assert [message["content"][i]["text"] for i in (0, 2)] == ["Let me look.", "Done."]
    assert message["content"][1]["input"] == {"city": "Oslo"} and message["content"][1]["id"] == "toolu_1"
    assert sum(data.get("delta", {}).get("type") == "input_json_delta" for _, data in events) == 2
    assert message["stop_reason"] == "tool_use"
