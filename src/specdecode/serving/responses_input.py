"""What a ``/v1/responses`` request sends, read (``serving/responses_api.py`` is the route):
``input`` as chat messages (``input_messages``) and as the input items that
``GET /v1/responses/{id}/input_items`` lists (``input_items``, ``items_page``); function
``tools``, ``tool_choice`` and ``text.format`` in the chat shapes; which ``include`` values are
served (``logprobs_wanted``); the body's OpenAPI schema.
"""

from __future__ import annotations

import uuid
from typing import Any

from specdecode.config import MAX_LOGPROBS
from specdecode.serving.api_errors import APIError
from specdecode.serving.tools import NAME_PATTERN

# Fields passed to the chat request as they are (ours and vLLM's extensions included).
SAMPLING_FIELDS = ("model", "temperature", "top_p", "top_k", "seed", "method", "k", "cache_salt", "parallel_tool_calls")
TEXT_PART_TYPES = ("input_text", "output_text", "text")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
SKIPPED_ITEMS = ("reasoning",)  # items a client may echo back that carry nothing for our models
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# ``include`` values served: logprobs, and encrypted reasoning, which is vacuous here (our models
# produce no reasoning items) but which Codex-style clients send on every request.
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")
TRUNCATIONS = ("disabled", "auto")
ITEM_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}
MAX_PAGE_ITEMS = 100  # OpenAI's bound on a list's ``limit``
DEFAULT_PAGE_ITEMS = 20


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
    "include": {"type": "array", "items": {"enum": list(INCLUDES)}},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    "truncation": {"enum": list(TRUNCATIONS)},
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


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def logprobs_wanted(body: dict[str, Any]) -> int | None:
    """How many top logprobs per token the request asks for with ``include:
    ["message.output_text.logprobs"]`` and ``top_logprobs`` (0: the chosen token's only), or None
    when it asks for no logprobs; a 400 naming any ``include`` value not served."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(value, str) for value in include):
        raise APIError(400, f"'include' must be a list of strings, such as [\"{LOGPROBS_INCLUDE}\"].", "include")
    for value in include:
        if value not in INCLUDES:
            raise APIError(400, f"'include' asks for {value!r:.60}, which this server does not produce (it runs "
                                f"function tools only, on text); it serves {LOGPROBS_INCLUDE!r} (with "
                                "'top_logprobs') and 'reasoning.encrypted_content' (its models make no reasoning "
                                "items: nothing to add).", "include")
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS):
        raise APIError(400, f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {top!r:.40}.",
                       "top_logprobs")
    return (top or 0) if LOGPROBS_INCLUDE in include else None


def _content_texts(content: Any) -> list[str]:
    """A content already read by ``input_messages``: a string, or text parts."""
    return [content] if isinstance(content, str) else [part["text"] for part in content]


def input_items(items: Any, taken: set[str]) -> list[dict[str, Any]]:
    """``input`` (already read by ``input_messages``) as the items ``input_items`` lists, each in
    OpenAI's item shape with an id: the one the client gave it where no earlier item has it (an
    output item echoed back keeps its id), else a new one; ``taken``, the ids used, grows.
    Reasoning items, which carry nothing here, are left out."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind in SKIPPED_ITEMS:
            continue
        given = item.get("id")
        item_id = given if isinstance(given, str) and given and given not in taken else new_id(ITEM_ID_PREFIXES[kind])
        taken.add(item_id)
        if kind == "message":
            assistant = item["role"] == "assistant"
            parts = [{"type": "output_text", "text": text, "annotations": []} if assistant else
                     {"type": "input_text", "text": text} for text in _content_texts(item["content"])]
            out.append({"id": item_id, "type": "message", "role": item["role"], "status": "completed",
                        "content": parts})
        elif kind == "function_call":
            out.append({"id": item_id, "type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item.get("arguments") or "{}", "status": "completed"})
        else:
            out.append({"id": item_id, "type": "function_call_output", "call_id": item["call_id"],
                        "output": "".join(_content_texts(item["output"])), "status": "completed"})
    return out


def items_page(items: list[dict[str, Any]], order: str | None, limit: str | None, after: str | None,
               include: list[str]) -> dict[str, Any]:
    """One page of a response's input items in OpenAI's list shape, from the query's ``order``
    (``desc``, newest first, unless ``asc``), ``limit`` (1 to 100, 20 unless given) and ``after``
    (the id of the item before the page)."""
    logprobs_wanted({"include": include})  # the same values as a request's, the same 400s
    order = order or "desc"
    if order not in ("asc", "desc"):
        raise APIError(400, f"'order' must be 'asc' or 'desc', got {order!r:.40}.", "order")
    try:
        count = DEFAULT_PAGE_ITEMS if limit is None else int(limit)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_PAGE_ITEMS:
        raise APIError(400, f"'limit' must be an integer from 1 to {MAX_PAGE_ITEMS}, got {limit!r:.40}.", "limit")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        start = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if start is None:
            raise APIError(400, f"'after' is {after!r:.80}, the id of no input item of this response; give the "
                                "last_id of the page before.", "after")
        ordered = ordered[start + 1:]
    page = ordered[:count]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > count}


# The query of ``GET /v1/responses/{id}/input_items`` in ``/openapi.json``.
ITEMS_QUERY: list[dict[str, Any]] = [
    {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"], "default": "desc"}},
    {"name": "limit", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_ITEMS, "default": DEFAULT_PAGE_ITEMS}},
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    {"name": "include", "in": "query", "required": False, "schema": {"type": "array", "items": {"enum": list(INCLUDES)}}},
]
