"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API, as a
translation onto ``/v1/chat/completions``.

The request becomes a chat completion's body (``to_chat``): ``system`` (a string or text
blocks) the first message; each message's text blocks its content, an assistant's ``tool_use``
blocks its ``tool_calls`` and a user's ``tool_result`` blocks ``tool`` messages; ``tools``
(``name``, ``description``, ``input_schema``) functions; ``tool_choice`` auto, any (OpenAI's
``required``), tool (a named function) or none; ``stop_sequences`` ``stop``; ``output_config.format`` (a JSON schema) a strict
``response_format``; ``max_tokens``
(required, as Anthropic requires it), ``temperature``, ``top_p``, ``top_k`` and this server's
extensions (``method``, ``k``, ``seed``, ``cache_salt``) as they are. It then goes through the
chat route whole: speculation, prefix caching, the tool-call grammar of ``any`` and ``tool``,
tenancy, limits, metrics. Only the reply is reshaped.

The chat route is always asked to stream: its events are turned into Anthropic's
(``message_events``: message_start, content_block_start / _delta (text_delta,
input_json_delta) / _stop, message_delta with the stop reason and usage, message_stop), sent
as they are with ``stream: true`` and folded into one message without (``whole_message``). The
stream carries what a whole chat reply does not: the engine's stop reason, which tells
``stop_sequence`` from ``end_turn``. Errors take Anthropic's shape
(``serving/anthropic_errors.py``), the guard's refusals on these routes too.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' signatures
# (``request: Request``, imported inside ``add_messages_routes``) at definition time.
import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from specdecode.serving.anthropic_errors import anthropic_error_body, anthropic_error_json
from specdecode.serving.api_errors import APIError
from specdecode.serving.generation import unless_disconnected
from specdecode.serving.state import ServerState
from specdecode.serving.unicode_check import check_unicode
from specdecode.serving.utility_routes import check_text_chars, load_body, validated

# Fields passed to the chat route as they are (the last four are this server's extensions).
PASSED_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "method", "k", "seed", "cache_salt")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and {"type": "tool", "name": ...}
# The engine's stop reasons (GenerationStats.stop_reason) as Anthropic's; a grammar that ended
# ("stop") is the end of the turn.
STOP_REASONS = {"eos": "end_turn", "stop": "end_turn", "stop_string": "stop_sequence", "length": "max_tokens"}


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content or not all(isinstance(block, dict) for block in content):
        raise APIError(400, f"{param} must be a string or a non-empty list of content blocks.", param)
    return content


def _text(block: dict[str, Any], param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{param} is a text block without a string 'text'.", param)
    return block["text"]


def _texts(content: Any, param: str) -> str:
    """Text blocks (or a string) as one string, joined by newlines as the chat route joins parts."""
    blocks = _blocks(content, param)
    for j, block in enumerate(blocks):
        if block.get("type") != "text":
            raise APIError(400, f"{param}[{j}] must be a text block; this server reads text only (got type "
                                f"{block.get('type')!r:.40}).", param)
    return "\n".join(_text(block, f"{param}[{j}]") for j, block in enumerate(blocks))


def _message(message: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool results become ``tool`` messages
    (before its text: Anthropic puts them first), an assistant's tool_use blocks its tool_calls."""
    param = f"messages[{i}]"
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise APIError(400, f"{param}.role must be 'user' or 'assistant' (a system prompt goes in the top-level "
                            f"'system' field), got {role!r:.40}.", "messages")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(message.get("content"), f"{param}.content")):
        kind, where = block.get("type"), f"{param}.content[{j}]"
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise APIError(400, f"{where} (tool_use) needs a string 'name' and an object 'input'.", "messages")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            content = block.get("content", "")
            result = "" if content in ("", []) else _texts(content, f"{where}.content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        else:
            allowed = "text and tool_use" if role == "assistant" else "text and tool_result"
            raise APIError(400, f"{where}: a {role} message may hold {allowed} blocks on this server, got type "
                                f"{kind!r:.40}.", "messages")
    text = "\n".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, "tool_calls": calls} if calls
                else {"role": "assistant", "content": text}]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` in OpenAI's shape (checked further by ``tools.parse_tools``)."""
    out: dict[str, Any] = {}
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list):
            raise APIError(400, "'tools' must be a list of {name, description, input_schema} objects.", "tools")
        functions = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "input_schema" not in tool:
                raise APIError(400, f"tools[{i}] must be a client tool {{name, description, input_schema}}; this "
                                    "server runs no server tools (web search, code execution, ...).", "tools")
            function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if "description" in tool:
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        out["tools"] = functions
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool" and isinstance(choice.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        elif kind in TOOL_CHOICES:
            out["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise APIError(400, "'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} "
                                "or {\"type\": \"tool\", \"name\": ...}.", "tool_choice")
    return out


def _output_format(body: dict[str, Any]) -> dict[str, Any]:
    """``output_config.format`` (Anthropic's structured outputs, a JSON schema) as a strict
    ``response_format``; ``effort`` is a hint with nothing to steer here, and is ignored."""
    config = body.get("output_config")
    form = config.get("format") if isinstance(config, dict) else config
    if form is None:
        return {}
    if not isinstance(form, dict) or form.get("type") != "json_schema" or not isinstance(form.get("schema"), dict):
        raise APIError(400, "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}.",
                       "output_config")
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": form["schema"],
                                                                       "strict": True}}}


def to_chat(body: dict[str, Any], need_max_tokens: bool = True) -> dict[str, Any]:
    """An Anthropic Messages body as the chat completion body that decodes it (``stream`` left
    out: the caller sets it)."""
    check_unicode(body)
    if need_max_tokens and body.get("max_tokens") is None:
        raise APIError(400, "'max_tokens' is required: the most tokens to generate.", "max_tokens")
    if not isinstance(body.get("stream", False), bool):
        raise APIError(400, "'stream' must be true or false.", "stream")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        raise APIError(400, "Extended thinking is not supported by this server; leave 'thinking' out.", "thinking")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects.", "messages")
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None and system != "":
        chat.append({"role": "system", "content": _texts(system, "system")})
    for i, message in enumerate(messages):
        chat.extend(_message(message, i))
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise APIError(400, "'stop_sequences' must be a list of non-empty strings.", "stop_sequences")
    out = {name: body[name] for name in PASSED_FIELDS if name in body}
    out.update(messages=chat, **_tools(body), **_output_format(body))
    if stops:
        out["stop"] = stops
    return out


def _sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _payloads(event: str) -> list[dict[str, Any]]:
    """The JSON bodies of one chat-completions event (an error comes as its body and [DONE])."""
    return [json.loads(line[len("data: "):]) for line in event.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


async def message_events(events: AsyncIterator[str], generation: Any,
                         model: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A chat completion's event stream (one choice, usage on its last chunk) as Anthropic's
    events, ``(name, data)``; a failure ends them with an ``error`` event."""
    prompt_tokens = len(generation.request.prompt)  # token ids: ServerState.prepare tokenized it
    message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
    yield "message_start", {"type": "message_start", "message": message}
    index, open_kind, called, last = -1, None, False, None  # open_kind: the open block's type, or None
    async for event in events:
        for chunk in _payloads(event):
            if "error" in chunk:
                failure = generation.failure() or APIError(500, chunk["error"].get("message", ""), kind="server_error")
                yield "error", anthropic_error_body(failure)
                return
            last = chunk
            delta = chunk["choices"][0]["delta"]
            if delta.get("content"):
                if open_kind != "text":
                    if open_kind is not None:
                        yield "content_block_stop", {"type": "content_block_stop", "index": index}
                    index, open_kind = index + 1, "text"
                    yield "content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": {"type": "text", "text": ""}}
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "text_delta", "text": delta["content"]}}
            for piece in delta.get("tool_calls") or []:  # a call's first piece has its id (ToolStream)
                if "id" in piece:
                    if open_kind is not None:
                        yield "content_block_stop", {"type": "content_block_stop", "index": index}
                    index, open_kind, called = index + 1, "tool_use", True
                    block = {"type": "tool_use", "id": "toolu_" + piece["id"].removeprefix("call_"),
                             "name": piece["function"]["name"], "input": {}}
                    yield "content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": block}
                if piece["function"].get("arguments") and open_kind == "tool_use":
                    yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": piece["function"]["arguments"]}}
    if open_kind is not None:
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    stats = generation.stats
    reason = STOP_REASONS.get(stats.stop_reason if stats is not None else "", "end_turn")
    if called and reason != "max_tokens":
        reason = "tool_use"
    stop_sequence = stats.stop_string if reason == "stop_sequence" and stats is not None else None
    usage = (last or {}).get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                            "usage": {"input_tokens": usage.get("prompt_tokens", prompt_tokens) - cached,
                                      "output_tokens": usage.get("completion_tokens", 0),
                                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0},
                            "specdecode": (last or {}).get("specdecode", {})}
    yield "message_stop", {"type": "message_stop"}


async def whole_message(events: AsyncIterator[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Anthropic's events folded into the message a request without ``stream`` gets."""
    message: dict[str, Any] = {}
    arguments: dict[int, str] = {}
    async for name, data in events:
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
            message["content"][data["index"]]["text"] += data["delta"]["text"]
        elif name == "content_block_delta":
            arguments[data["index"]] = arguments.get(data["index"], "") + data["delta"]["partial_json"]
        elif name == "message_delta":
            message.update(data["delta"], specdecode=data["specdecode"])
            message["usage"].update(data["usage"])
        elif name == "error":
            raise _Failed(data)
    for index, text in arguments.items():
        message["content"][index]["input"] = _input(text)
    return message


def _input(arguments: str) -> Any:
    """A tool_use block's input from its streamed JSON; ``{}`` where the call was cut short (by
    max_tokens: its stop_reason says so) and its JSON is incomplete."""
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}


class _Failed(Exception):
    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body["error"]["message"])
        self.body = body


def count_tokens(raw: bytes, state: ServerState) -> dict[str, int]:
    """``/v1/messages/count_tokens``: the prompt tokens the same request to /v1/messages has."""
    body = load_body(raw, state)
    req = validated(to_chat(body, need_max_tokens=False), state, chat=True)
    chars = sum(len(m["content"]) for m in req.prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    check_text_chars(state, chars, "messages")
    tools = req.tools.in_prompt if req.tools is not None else None
    return {"input_tokens": len(state.decoder.encode(req.prompt, True, tools))}


Respond = Callable[..., Awaitable[Any]]  # server.py's respond(request, chat, translate=...)


def add_messages_routes(app: Any, state: ServerState, respond: Respond) -> None:
    """Register ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` on ``app``."""
    from fastapi import Request
    from fastapi.responses import Response, StreamingResponse

    from specdecode.serving.guard import error_headers
    from specdecode.serving.openapi import messages_body

    def refusal(error: APIError) -> Response:
        headers = {name.decode(): value.decode() for name, value in error_headers(error)}
        return Response(anthropic_error_json(error), status_code=error.status, media_type="application/json",
                        headers=headers)

    def with_bearer(request: Request) -> Request:
        """The request with its ``x-api-key`` as ``Authorization: Bearer`` where it has none, so
        that tenancy (``serving/suffix_share.py``) reads the same key from either header."""
        key = request.headers.get("x-api-key")
        if key is None or "authorization" in request.headers:
            return request
        scope = dict(request.scope, headers=[*request.scope["headers"], (b"authorization", f"Bearer {key}".encode())])
        return Request(scope, request.receive)

    @app.post("/v1/messages", openapi_extra={"requestBody": messages_body(state.served_names, count=False)})
    async def messages(request: Request) -> Any:
        asked: dict[str, Any] = {}

        def translate(raw: bytes) -> bytes:
            try:
                body = load_body(raw, state)
                chat = to_chat(body)
            except APIError:
                state.metrics.count("rejected")  # as ServerState.prepare counts the chat route's
                raise
            asked.update(stream=body.get("stream") is True)
            return json.dumps(dict(chat, stream=True)).encode()

        request = with_bearer(request)
        try:
            reply = await respond(request, True, translate=translate)
        except APIError as error:
            return refusal(error)
        if not isinstance(reply, StreamingResponse):
            return reply  # the client left while its request waited (499)
        generation = reply.generations[0]
        events = message_events(reply.body_iterator, generation, state.model_name)
        if asked["stream"]:
            reply.body_iterator = (_sse(name, data) async for name, data in events)
            return reply
        try:
            message = await unless_disconnected(whole_message(events), request)
        except _Failed as failed:
            error = generation.failure() or APIError(500, str(failed), kind="server_error")
            return refusal(error)
        finally:
            for g in reply.generations:
                state.untrack(g)  # cancels it when the client left
        return Response(status_code=499) if message is None else message

    @app.post("/v1/messages/count_tokens", openapi_extra={"requestBody": messages_body(state.served_names, count=True)})
    async def messages_count_tokens(request: Request) -> Any:
        try:
            return await asyncio.to_thread(count_tokens, await request.body(), state)
        except APIError as error:
            return refusal(error)
