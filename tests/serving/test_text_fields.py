"""Every text field of a request goes through one check (``protocol.check_unicode``) before
anything reads it: a lone surrogate (JSON's ``"\\ud800"``) anywhere in the body, dict keys
included, and in JSON the server decodes out of a string (a tool call's ``arguments``), is a
400 in OpenAI's shape naming the field's path, the character's index and the top-level field,
streamed or not; before the check, one in a tool's description reached the chat template and
was a 500. The server serves the next request. A surrogate pair (an emoji written as two
escapes) and control characters are text like any other: the tokenizer and the template take
them, so they are not refused."""

import json
import sys
from collections.abc import Callable

import httpx
import pytest
from server_helpers import MODEL

from specdecode.serving.api_errors import APIError
from specdecode.serving.unicode_check import check_unicode

BAD = "a\ud800b"  # a lone surrogate at character 1
WELL_FORMED = "ab"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "description": "a city"}}}
TOOL = {"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": WEATHER}}
ASK = {"role": "user", "content": "Weather in Paris?"}


def tool(**function: object) -> list[dict]:
    return [{"type": "function", "function": {**TOOL["function"], **function}}]


def properties(**props: object) -> dict:
    return {"type": "object", "properties": props}


def assistant_call(name: str = "weather", arguments: object = '{"city": "Paris"}') -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]}


# (endpoint, the body's fields given a text to put in the field under test, where the message
# points, param): with "ab" for the text each is a request the server answers.
CASES = [
    pytest.param("chat", lambda t: {"tools": tool(description=t)}, "'tools[0].function.description'", "tools",
                 id="tool-description"),
    pytest.param("chat", lambda t: {"tools": tool(parameters=properties(city={"type": "string", "description": t}))},
                 "'tools[0].function.parameters.properties.city.description'", "tools", id="tool-parameter-description"),
    pytest.param("chat", lambda t: {"tools": tool(parameters=properties(**{t: {"type": "string"}}))},
                 "A key in 'tools[0].function.parameters.properties' (\"a\\ud800b\")", "tools", id="tool-parameter-key"),
    pytest.param("chat", lambda t: {"tools": tool(parameters=properties(city={"enum": ["x", t]}))},
                 "'tools[0].function.parameters.properties.city.enum[1]'", "tools", id="tool-parameter-enum"),
    pytest.param("chat", lambda t: {"tools": tool(name=t)}, "'tools[0].function.name'", "tools", id="tool-name"),
    pytest.param("chat", lambda t: {"tools": tool(name=t), "tool_choice": {"type": "function", "function": {"name": t}}},
                 "'tools[0].function.name'", "tools", id="tool-name-and-tool-choice"),
    pytest.param("chat", lambda t: {"tools": [TOOL], "tool_choice": {"type": "function",
                                                                     "function": {"name": "weather", t: 1}}},
                 "A key in 'tool_choice.function'", "tool_choice", id="tool-choice-key"),
    # The arguments string holds the surrogate itself...
    pytest.param("chat", lambda t: {"messages": [ASK, assistant_call(arguments='{"city": "' + t + '"}')],
                                    "tools": [TOOL]},
                 "'messages[1].tool_calls[0].function.arguments' holds invalid Unicode (a lone surrogate at "
                 "character 11)", "messages", id="tool-call-arguments"),
    # ... or an escape of it, which only decoding the arguments (tools.tool_message) turns into one.
    pytest.param("chat", lambda t: {"messages": [ASK, assistant_call(arguments=json.dumps({"city": t}))],
                                    "tools": [TOOL]},
                 "'messages[1].tool_calls[0].function.arguments.city'", "messages", id="tool-call-arguments-escaped"),
    pytest.param("chat", lambda t: {"messages": [ASK, assistant_call(arguments={"city": t})], "tools": [TOOL]},
                 "'messages[1].tool_calls[0].function.arguments.city'", "messages", id="tool-call-arguments-object"),
    pytest.param("chat", lambda t: {"messages": [ASK, assistant_call(name=t)], "tools": [TOOL]},
                 "'messages[1].tool_calls[0].function.name'", "messages", id="tool-call-name"),
    pytest.param("chat", lambda t: {"messages": [{**ASK, "name": t}]}, "'messages[0].name'", "messages",
                 id="message-name"),
    pytest.param("chat", lambda t: {"messages": [{"role": "user", "content": t}]}, "'messages[0].content'",
                 "messages", id="content"),
    pytest.param("chat", lambda t: {"messages": [{"role": "user", "content": [{"type": "text", "text": t}]}]},
                 "'messages[0].content[0].text'", "messages", id="content-part"),
    pytest.param("chat", lambda t: {"messages": [ASK, assistant_call(),
                                                 {"role": "tool", "tool_call_id": "call_1", "content": t}],
                                    "tools": [TOOL]}, "'messages[2].content'", "messages", id="tool-result"),
    pytest.param("chat", lambda t: {"stop": ["ok", t]}, "'stop[1]'", "stop", id="stop-list"),
    pytest.param("chat", lambda t: {"response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": properties(city={"type": "string", "description": t})}}},
        "'response_format.json_schema.schema.properties.city.description'", "response_format",
        id="response-format-schema"),
    # A field the server does not read is checked too: it may read it one day.
    pytest.param("chat", lambda t: {"user": t}, "'user'", "user", id="unread-field"),
    pytest.param("chat", lambda t: {t: 1}, "A key in the request body (\"a\\ud800b\")", "a\\ud800b",
                 id="top-level-key"),
    pytest.param("completions", lambda t: {"prompt": t}, "'prompt'", "prompt", id="prompt"),
    pytest.param("completions", lambda t: {"prompt": [t]}, "'prompt[0]'", "prompt", id="prompt-list"),
    pytest.param("completions", lambda t: {"prompt": "x", "stop": t}, "'stop'", "stop", id="stop"),
]


def post(base: str, endpoint: str, fields: dict, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "stream": stream,
            **({"messages": [ASK]} if endpoint == "chat" else {"prompt": "x"}), **fields}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    # json.dumps writes a lone surrogate as its \\ud800 escape, as a client's JSON encoder does.
    raw = json.dumps(body, ensure_ascii=True).encode()
    return httpx.post(base + path, content=raw, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize(("endpoint", "fields", "where", "param"), CASES)
def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it(served, endpoint: str, fields: Callable[[str], dict],
                                                                where: str, param: str) -> None:
    base, _ = served
    for stream in (False, True):
        reply = post(base, endpoint, fields(BAD), stream)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert error["message"].startswith(where) and "at character " in error["message"], error
        if "at character" not in where:
            assert "at character 1)" in error["message"], error
    # The same request with well-formed text is served: the surrogate alone made it a 400, and
    # the server still serves after it.
    reply = post(base, endpoint, fields(WELL_FORMED))
    assert reply.status_code == 200, reply.text


def test_a_surrogate_pair_and_control_characters_are_text(served) -> None:
    """An emoji written as a surrogate pair decodes to one character; NUL, other C0 controls and
    DEL pass the tokenizer and the chat template (with tools), so they are not refused."""
    base, dec = served
    odd = "\ud83d\ude00 \x00\x01\x1b\x7f"  # json.loads of the pair's escapes gives the one character
    assert json.loads('"\\ud83d\\ude00"') == "\U0001F600"
    fields = {"messages": [{"role": "user", "content": odd}, assistant_call(arguments={"city": odd}),
                           {"role": "tool", "tool_call_id": "call_1", "content": odd}],
              "tools": tool(description=odd, parameters=properties(city={"type": "string", "description": odd})),
              "stop": [odd]}
    wire = json.loads(json.dumps(fields))
    wire["messages"][0]["content"] = "\U0001F600 \x00\x01\x1b\x7f"
    reply = post(base, "chat", wire)
    assert reply.status_code == 200, reply.text
    prompt_ids = dec.encode([{"role": "user", "content": "\U0001F600 \x00\x01\x1b\x7f"}], chat=True)
    assert "\U0001F600 \x00\x01\x1b\x7f" in dec.tokenizer.decode(prompt_ids)  # the text reaches the model whole
    completion = post(base, "completions", {"prompt": "\x00x\x1b"})
    assert completion.status_code == 200, completion.text


def test_the_first_bad_string_in_the_body_is_named() -> None:
    with pytest.raises(APIError) as raised:
        check_unicode({"a": ["ok", {"b": BAD}], "c": BAD})
    assert raised.value.message.startswith("'a[1].b'") and raised.value.param == "a"


def test_keys_that_are_not_names_are_quoted_in_the_path() -> None:
    with pytest.raises(APIError) as raised:
        check_unicode({"tools": [{"my key": {"0x": BAD}}]})
    assert raised.value.message.startswith("'tools[0][\"my key\"][\"0x\"]'") and raised.value.param == "tools"


def test_decoded_json_is_named_under_its_root_and_param() -> None:
    with pytest.raises(APIError) as raised:
        check_unicode({"arguments": {"city": BAD}}, "messages[3]", "messages")
    assert raised.value.message.startswith("'messages[3].arguments.city'") and raised.value.param == "messages"


def test_a_body_nested_past_the_recursion_limit_is_walked() -> None:
    """The walk keeps its own stack: a body as deep as the JSON parser allows raises no RecursionError."""
    depth = sys.getrecursionlimit() * 2
    body: object = [BAD]
    for _ in range(depth):
        body = [body]
    with pytest.raises(APIError) as raised:
        check_unicode({"prompt": body})
    assert raised.value.message.startswith("'prompt" + "[0]" * (depth + 1) + "'")
    check_unicode({"prompt": [[["fine"]]] * 3})  # well-formed text passes
