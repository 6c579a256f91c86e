"""``POST /v1/responses`` (OpenAI's Responses API), ``GET`` and ``DELETE /v1/responses/{id}``,
as a translation onto ``/v1/chat/completions``.

A Responses body becomes a chat body (``to_chat``): ``instructions`` a system message first;
the stored conversation of ``previous_response_id`` (``serving/responses_store.py``) then
``input`` (a string, or items: messages with text parts, ``function_call``,
``function_call_output``) as messages; function ``tools`` and ``tool_choice`` in the chat
shapes; ``text.format`` as ``response_format``; ``max_output_tokens`` as ``max_tokens``; the
sampling fields as they are. It then decodes like any chat request (speculation, prefix
caching, grammars, tenancy, limits, metrics and errors are that route's); only the reply is
reshaped, to a Response object (``response_body``) or, streamed, to the Responses event sequence
(``response_events``). As OpenAI does, ``instructions`` are not carried to the next response.

A response is stored unless the request says ``store: false``; one that was not stored, was
deleted, was evicted or belongs to another API key is a 404 to ``previous_response_id`` and to
``GET``/``DELETE``.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoint's signature
# (``request: Request``, imported inside ``add_responses_routes``) at definition time.
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from specdecode.serving.api_errors import APIError
from specdecode.serving.responses import sse
from specdecode.serving.responses_store import ResponseStore, response_tenant
from specdecode.serving.state import ServerState
from specdecode.serving.tools import NAME_PATTERN
from specdecode.serving.utility_routes import load_body

# Fields passed to the chat request as they are (ours and vLLM's extensions included).
SAMPLING_FIELDS = ("model", "temperature", "top_p", "top_k", "seed", "method", "k", "cache_salt", "parallel_tool_calls")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
SKIPPED_ITEMS = ("reasoning",)  # items a client may echo back that carry nothing for our models


_TEXT_PARTS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"enum": list(TEXT_PART_TYPES)}, "text": {"type": "string"}}}}]}
_ITEM = {"anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": list(ROLES)}, "content": _TEXT_PARTS}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
        "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": _TEXT_PARTS}},
]}
# The OpenAPI schema of the body (``/openapi.json``; the schema fuzz test generates from it).
REQUEST_SCHEMA: dict[str, Any] = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string"}, "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": _ITEM}]},
    "instructions": {"type": "string"}, "previous_response_id": {"type": "string"}, "store": {"type": "boolean"},
    "max_output_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0,
                                                                             "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "stream": {"type": "boolean"},
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"}, "name": {"type": "string", "pattern": NAME_PATTERN.pattern},
        "description": {"type": "string"}, "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {
        "type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                       "name": {"type": "string"}}}]},
    "text": {"type": "object", "properties": {"format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]}, "name": {"type": "string"},
        "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
}}


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of input_text parts.", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}.content[{j}] is {kind!r:.40}; this server takes text parts only "
                                "(input_text, output_text).", "input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive ``function_call`` items become one assistant
    message's ``tool_calls``, each ``function_call_output`` a ``tool`` message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise APIError(400, "'input' must be a string or a list of input items.", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
            if role is None:
                raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}.", "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(key, ""), str) for key in ("name", "call_id", "arguments")) \
                    or "name" not in item or "call_id" not in item:
                raise APIError(400, f"{where} (function_call) needs a string 'name', 'call_id' and 'arguments'.",
                               "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or output is None:
                raise APIError(400, f"{where} (function_call_output) needs a string 'call_id' and an 'output'.",
                               "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(output, where)})
        elif kind not in SKIPPED_ITEMS:
            raise APIError(400, f"{where} has type {kind!r:.40}; this server takes message, function_call and "
                                "function_call_output items.", "input")
    return messages


def chat_tools(tools: Any, choice: Any) -> dict[str, Any]:
    """Responses ``tools`` (``{type: function, name, parameters, strict}``) and ``tool_choice``
    in the chat shapes."""
    out: dict[str, Any] = {}
    if tools:
        if not isinstance(tools, list):
            raise APIError(400, "'tools' must be a list of function tools.", "tools")
        converted = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError(400, f"tools[{i}] is of type {kind!r:.40}; this server runs function tools only "
                                    "({\"type\": \"function\", \"name\": ..., \"parameters\": {...}}).", "tools")
            function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
            converted.append({"type": "function", "function": function})
        out["tools"] = converted
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                "\"name\": ...}.", "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and (tools or choice != "none"):
        out["tool_choice"] = choice
    return out


def response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                        "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}.", "text.format")


def to_chat(body: dict[str, Any], store: ResponseStore, tenant: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A Responses body as the chat body that decodes it, and the conversation it continues
    (earlier turns and this input, without the instructions)."""
    if body.get("background"):
        raise APIError(400, "This server does not run responses in the background; leave 'background' out.",
                       "background")
    if "input" not in body:
        raise APIError(400, "'input' is required: a string or a list of input items.", "input")
    conversation: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise APIError(400, "'previous_response_id' must be a string: the id of a stored response.",
                           "previous_response_id")
        stored = store.get(tenant, previous)
        if stored is None:
            raise APIError(404, f"No stored response {str(previous)!r:.80} for this API key: it was created with "
                                "store: false, deleted, or evicted from the bounded store (or never existed). Send "
                                "the whole conversation as 'input' instead.", "previous_response_id",
                           "response_not_found")
        conversation = [dict(message) for message in stored.conversation]
    conversation += input_messages(body["input"])
    if not conversation:
        raise APIError(400, "'input' holds no messages: give a string or at least one message item.", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError(400, "'instructions' must be a string.", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {key: body[key] for key in SAMPLING_FIELDS if body.get(key) is not None}
    chat["messages"] = system + conversation
    chat.update(chat_tools(body.get("tools"), body.get("tool_choice")))
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat, conversation


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


class ResponseShell:
    """The fields of a Response that come from its request, and the end of one response: its
    body, its conversation for the store."""

    def __init__(self, body: dict[str, Any], model: str, conversation: list[dict[str, Any]]) -> None:
        self.id, self.created_at, self.conversation = _new_id("resp_"), int(time.time()), conversation
        text = body.get("text") if isinstance(body.get("text"), dict) else {}
        self.fields = {
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "store": body.get("store", True) is not False,
            "text": {"format": text.get("format") or {"type": "text"}}, "metadata": body.get("metadata"),
            "truncation": "disabled", "error": None, "incomplete_details": None, "user": body.get("user"),
        }
        self.model = model

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             finish: str | None = None, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "model": self.model, "output": output, "usage": _usage(usage), **self.fields}
        if finish == "length":
            out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        if metrics is not None:
            out["specdecode"] = metrics
        return out

    def finished(self, text: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation with this response's output appended (what a next turn continues)."""
        message: dict[str, Any] = {"role": "assistant", "content": text or ""}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])} for c in calls]
        return [*self.conversation, message]


def response_body(reply: dict[str, Any], shell: ResponseShell) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A whole chat reply as a Response, and the conversation to store with it."""
    choice = reply["choices"][0]
    text, calls = choice["message"].get("content"), choice["message"].get("tool_calls") or []
    output = [message_item(_new_id("msg_"), text)] if text else []
    output += [call_item(_new_id("fc_"), call) for call in calls]
    body = shell.body("completed", output, reply.get("usage"), choice.get("finish_reason"), reply.get("specdecode"))
    return body, shell.finished(text, calls)


class _Events:
    """Responses events numbered in order (``sequence_number``)."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = sse({"type": kind, "sequence_number": self.number, **fields})
        self.number += 1
        return event


async def response_events(chunks: AsyncIterator[str], shell: ResponseShell,
                          done: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> AsyncIterator[str]:
    """A chat completion's event stream (one choice; usage in a last chunk of no choices) as the
    Responses event sequence; ``done`` gets the completed Response and its conversation."""
    event = _Events()
    yield event("response.created", response=shell.body("in_progress", []))
    yield event("response.in_progress", response=shell.body("in_progress", []))
    output: list[dict[str, Any]] = []
    message_id, text, calls = None, "", []
    item_start = 0  # where the open message item's text begins in ``text`` (content after a call is a new item)
    finish, usage, metrics = None, None, None
    open_call: tuple[str, int, dict[str, Any]] | None = None  # the call whose arguments are streaming

    def text_done() -> list[str]:
        index, item = len(output), message_item(message_id, text[item_start:])
        part = item["content"][0]
        output.append(item)
        return [event("response.output_text.done", item_id=message_id, output_index=index, content_index=0, text=part["text"],
                      logprobs=[]),
                event("response.content_part.done", item_id=message_id, output_index=index, content_index=0, part=part),
                event("response.output_item.done", output_index=index, item=item)]

    def close() -> list[str]:
        """Events that end the open item (a text, or a call), before another starts or at the end."""
        nonlocal open_call, message_id
        if open_call is not None:
            item_id, index, call = open_call
            item, open_call = call_item(item_id, call), None
            output.append(item)
            return [event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                          arguments=call["function"]["arguments"], name=call["function"]["name"]),
                    event("response.output_item.done", output_index=index, item=item)]
        if message_id is not None and not any(item["id"] == message_id for item in output):
            return text_done()
        return []

    async for raw in chunks:
        payload = raw[len("data: "):].strip()
        if payload == "[DONE]":
            continue
        chunk = json.loads(payload)
        if "error" in chunk:
            error = chunk["error"]
            yield event("error", code=error.get("code") or error.get("type"), message=error.get("message"),
                        param=error.get("param"))
            yield event("response.failed", response={**shell.body("failed", output), "error": {
                "code": "server_error", "message": error.get("message")}})
            return
        if chunk.get("usage") is not None:
            usage, metrics = chunk["usage"], chunk.get("specdecode")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if message_id is None or open_call is not None or any(item["id"] == message_id for item in output):
                    for done_event in close():
                        yield done_event
                    message_id, item_start = _new_id("msg_"), len(text)
                    yield event("response.output_item.added", output_index=len(output),
                                item=message_item(message_id, "", "in_progress"))
                    yield event("response.content_part.added", item_id=message_id, output_index=len(output),
                                content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []})
                text += delta["content"]
                yield event("response.output_text.delta", item_id=message_id, output_index=len(output),
                            content_index=0, delta=delta["content"], logprobs=[])
            for piece in delta.get("tool_calls") or []:  # a call's first piece has its id (ToolStream)
                if "id" in piece:
                    for done_event in close():
                        yield done_event
                    call = {"id": piece["id"], "type": "function",
                            "function": {"name": piece["function"]["name"], "arguments": ""}}
                    calls.append(call)
                    open_call = (_new_id("fc_"), len(output), call)
                    yield event("response.output_item.added", output_index=len(output),
                                item=call_item(open_call[0], call, "in_progress"))
                arguments = piece["function"].get("arguments") or ""
                if arguments and open_call is not None:
                    open_call[2]["function"]["arguments"] += arguments
                    yield event("response.function_call_arguments.delta", item_id=open_call[0],
                                output_index=open_call[1], delta=arguments)
            if choice.get("finish_reason") is not None:
                finish = choice["finish_reason"]
    for done_event in close():
        yield done_event
    body = shell.body("completed", output, usage, finish, metrics)
    done(body, shell.finished(text or None, calls))
    # response.completed also for a response cut by max_output_tokens (its status "incomplete"),
    # as vLLM sends: the SDK's stream helper and openai-agents wait for that event alone.
    yield event("response.completed", response=body)


Respond = Callable[..., Awaitable[Any]]  # server.py's respond(request, chat, translate=...)


def add_responses_routes(app: Any, state: ServerState, respond: Respond, store: ResponseStore | None = None) -> None:
    """Register ``POST /v1/responses`` and ``GET``/``DELETE /v1/responses/{id}`` on ``app``."""
    from fastapi import Request
    from fastapi.responses import StreamingResponse

    store = store if store is not None else ResponseStore()
    app.state.response_store = store

    schema = {**REQUEST_SCHEMA, "properties": {**REQUEST_SCHEMA["properties"], "model": {
        "enum": list(state.served_names), "description": "optional: one of the names in GET /v1/models"}}}

    @app.post("/v1/responses", openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": schema}}}})
    async def create_response(request: Request) -> Any:
        tenant = response_tenant(request.headers.get("authorization"))
        held: dict[str, Any] = {}

        def translate(raw: bytes) -> bytes:
            try:
                body = load_body(raw, state)
                chat, conversation = to_chat(body, store, tenant)
            except APIError:
                state.metrics.count("rejected")  # as ServerState.prepare counts the chat route's
                raise
            held["body"], held["shell"] = body, ResponseShell(body, state.model_name, conversation)
            return json.dumps(chat).encode()

        def keep(body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
            if held["body"].get("store", True) is not False:
                store.put(tenant, body, conversation)

        reply = await respond(request, True, translate=translate)
        if isinstance(reply, dict):
            body, conversation = response_body(reply, held["shell"])
            keep(body, conversation)
            return body
        if isinstance(reply, StreamingResponse):
            reply.body_iterator = response_events(reply.body_iterator, held["shell"], keep)
        return reply

    def stored(request: Request, response_id: str) -> dict[str, Any]:
        found = store.get(response_tenant(request.headers.get("authorization")), response_id)
        if found is None:
            raise APIError(404, f"No stored response {response_id!r:.80} for this API key (created with store: false, "
                                "deleted, evicted, or never existed).", "response_id", "response_not_found")
        return found.body

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Any:
        return stored(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Any:
        if not store.delete(response_tenant(request.headers.get("authorization")), response_id):
            stored(request, response_id)  # the 404
        return {"id": response_id, "object": "response", "deleted": True}
