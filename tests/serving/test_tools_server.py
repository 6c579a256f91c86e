"""Tool calls through the server with the official openai client (serving/tools.py): the tools go
into the chat template's tools section; ``tool_choice`` "required" or a named function makes the
output one valid call of the tool's schema (a grammar; the tiny random models would never write
one on their own), parsed back into ``tool_calls`` with finish_reason "tool_calls", streamed and
not, the same call under every method; a two-step loop sends the call and the tool's result
back through the template; the markup parser and the stream splitter on their own; bad tools
are 400s that say what to change."""

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import MODEL, client

from specdecode.serving.tools import ToolStream, split_tool_calls

pytest.importorskip("xgrammar")

# Small: the tiny byte-level tokenizer spends about a token per character of the tools section,
# and its context holds 512.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
DIGIT = {"enum": [1, 2, 3]}
ADD = {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def call_once(base: str, stream: bool, tool_choice, messages=ASK, **extra) -> tuple[str | None, list[dict], str]:
    """(content, [{"name", "arguments"}], finish_reason) of a greedy chat completion."""
    reply = client(base).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                                 max_tokens=100, temperature=0, stream=stream, extra_body=extra)
    if not stream:
        message = reply.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in message.tool_calls or []]
        return message.content, calls, reply.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in reply:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:  # pieces of one call share its index
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def test_required_gives_one_valid_call_streamed_or_not(served) -> None:
    base, _ = served
    whole = call_once(base, False, "required")
    streamed = call_once(base, True, "required")
    for content, calls, finish in (whole, streamed):
        assert finish == "tool_calls" and content is None and len(calls) == 1
        assert calls[0]["name"] in SCHEMAS and calls[0]["id"].startswith("call_")
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])
    strip = [{k: v for k, v in c.items() if k != "id"} for c in whole[1]]
    assert strip == [{k: v for k, v in c.items() if k != "id"} for c in streamed[1]]


def test_streamed_arguments_come_as_they_decode(served) -> None:
    """A call's first delta names it (id, type, name, empty arguments); its arguments follow in
    several deltas, one per decoding step, not whole at the end."""
    base, _ = served
    chunks = client(base).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                  max_tokens=100, temperature=0, stream=True,
                                                  extra_body={"method": "none"})
    pieces = [piece for chunk in chunks for piece in chunk.choices[0].delta.tool_calls or []]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name in SCHEMAS
    assert pieces[0].function.arguments == "" and all(piece.index == 0 and piece.id is None for piece in pieces[1:])
    assert len(pieces) > 3, [piece.function.arguments for piece in pieces]
    arguments = "".join(piece.function.arguments for piece in pieces)
    jsonschema.validate(json.loads(arguments), SCHEMAS[pieces[0].function.name])


@pytest.mark.parametrize("method", ["ngram", "draft", "suffix"])
def test_a_named_function_is_called_and_speculation_writes_the_same_call(served, method: str) -> None:
    base, _ = served
    choice = {"type": "function", "function": {"name": "add"}}
    _, plain, _ = call_once(base, False, choice, method="none")
    _, speculated, finish = call_once(base, False, choice, method=method)
    assert finish == "tool_calls" and [c["name"] for c in plain] == ["add"]
    assert [c["arguments"] for c in speculated] == [c["arguments"] for c in plain]
    jsonschema.validate(json.loads(plain[0]["arguments"]), SCHEMAS["add"])


def test_a_two_step_tool_loop(served) -> None:
    """The client runs the tool and sends the result back; the next turn's prompt holds the call
    (as the template writes it) and the result, and the model answers in text."""
    base, dec = served
    first = client(base).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                                 max_tokens=100, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    second = client(base).chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="auto",
                                                  max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.content
    # The template saw the call with its arguments as an object and the tool's result.
    template_messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    prompt_ids = dec.encode(template_messages, chat=True, tools=TOOLS)
    text = dec.tokenizer.decode(prompt_ids)
    assert "<tool_call>" in text and '"temperature": 21' in text and call.function.name in text
    assert second.usage.prompt_tokens == len(prompt_ids)


def test_none_leaves_the_tools_out_and_auto_returns_text_when_no_call_is_written(served) -> None:
    base, dec = served
    for choice in ("none", "auto"):
        content, calls, finish = call_once(base, False, choice)
        assert calls == [] and finish in ("stop", "length") and content
    reply = client(base).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                                 max_tokens=4, temperature=0)
    assert reply.usage.prompt_tokens == len(dec.encode(ASK, chat=True))  # no tools section


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "letters, digits"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "'type': 'function'"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "given twice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'none', 'auto', 'required'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "Drop one"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(a"}}}}}], "tool_choice": "required"}, "tool_choice", "compiled"),
    ({"messages": [{"role": "function", "name": "f", "content": "1"}]}, "messages", "role 'function'"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "add", "arguments": "{not json"}}]}]}, "messages", "not JSON"),
])
def test_bad_tools_are_400s_that_say_what_to_change(served, body: dict, param: str, words: str) -> None:
    base, _ = served
    request = {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
    for stream in (False, True):
        reply = httpx.post(base + "/v1/chat/completions", json={**request, "stream": stream}, timeout=60)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and words in error["message"], error


def test_tools_on_the_completions_endpoint_are_refused(served) -> None:
    base, _ = served
    with pytest.raises(openai.BadRequestError, match="chat completions"):
        client(base).completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"tools": TOOLS})


NAMES = ("weather", "add")


def test_the_markup_parser_reads_calls_and_leaves_the_rest() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = split_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]
    assert len({c["id"] for c in calls}) == 2
    # Not JSON, or a function nobody offered: text, not a call.
    for bad in ('<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>',
                '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'):
        assert split_tool_calls(bad, NAMES) == (bad, [])
    assert split_tool_calls("", NAMES) == (None, [])


def _split(text: str, size: int) -> tuple[str, str, list[dict], int]:
    """(content sent, content held to the end, calls merged from their pieces, call deltas) of
    ``text`` streamed ``size`` characters at a time through a ToolStream."""
    splitter, sent, pieces = ToolStream(NAMES), "", []
    for i in range(0, len(text), size):
        content, deltas = splitter.feed(text[i:i + size])
        sent, pieces = sent + content, pieces + deltas
    held, last = splitter.finish()
    calls: dict[int, dict] = {}
    for piece in pieces + last:  # a call's first piece has its id and name, the others add arguments
        call = calls.setdefault(piece["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] += piece.get("id", "")
        call["name"] += piece["function"].get("name", "")
        call["arguments"] += piece["function"].get("arguments", "")
    return sent, held, [calls[i] for i in sorted(calls)], len(pieces)


def test_the_stream_splitter_sends_content_at_once_and_arguments_as_they_come() -> None:
    text = ('Sure: a<b <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "}\\"{"}}\n</tool_call>\n'
            '<tool_call>\n{"name":"weather","arguments":{"city":"Oslo"}}\n</tool_call>')
    _, whole = split_tool_calls(text, NAMES)
    expected = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in whole]
    assert expected == [{"name": "add", "arguments": '{"a": 1, "b": "}\\"{"}'},
                        {"name": "weather", "arguments": '{"city":"Oslo"}'}]  # as written: a stream's pieces add up to it
    for size in (1, 2, 3, 5, 7, len(text)):  # every way a stream may cut the markup
        sent, held, calls, pieces = _split(text, size)
        assert sent + held == "Sure: a<b " and [{k: c[k] for k in ("name", "arguments")} for c in calls] == expected
        assert all(c["id"].startswith("call_") for c in calls)
        if size == 1:  # the arguments came a piece at a time, before the end of their block
            assert pieces == 2 + len(expected[0]["arguments"]) + len(expected[1]["arguments"])
    sent, held, calls, _ = _split("a <tool", 7)
    assert sent == "a " and calls == []
    sent, held, calls, _ = _split("a <toolbox>", 7)
    assert sent + held == "a <toolbox>" and calls == []  # held only while it may be markup


def test_a_block_in_another_layout_is_parsed_at_the_end() -> None:
    """Keys in another order, a name nobody offered, a block that is not JSON: held to the end
    and read as a whole reply reads them."""
    for text in ('<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>',
                 '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "add" "arguments"}\n</tool_call>'):
        content, whole = split_tool_calls(text, NAMES)
        for size in (1, 4, len(text)):
            sent, held, calls, _ = _split(text, size)
            assert (sent + held or None) == content
            assert [c["arguments"] for c in calls] == [c["function"]["arguments"] for c in whole]


def test_a_streamed_call_cut_short_stays_a_call() -> None:
    """Sent as it decodes, a call cut by max_tokens cannot be taken back: its arguments stop
    where the text did (OpenAI's stream does the same)."""
    sent, held, calls, _ = _split('<tool_call>\n{"name": "add", "arguments": {"a": 1, ', 3)
    assert sent + held == "" and calls[0]["name"] == "add" and calls[0]["arguments"] == '{"a": 1, '
