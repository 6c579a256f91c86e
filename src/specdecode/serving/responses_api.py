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
``include: ["message.output_text.logprobs"]`` asks the chat route for its logprobs, which become
the ``output_text`` parts' (and the text deltas'); ``truncation: "auto"`` leaves the oldest
messages out until the prompt fits (``serving/responses_truncation.py``). The input's reading is
``serving/responses_input.py``.

A response is stored unless the request says ``store: false``, with its input items (the stored
ones of ``previous_response_id``, its output, then this input) for
``GET /v1/responses/{id}/input_items``; one that was not stored, was deleted, was evicted or
belongs to another API key is a 404 to ``previous_response_id`` and to ``GET``/``DELETE``.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoint's signature
# (``request: Request``, imported inside ``add_responses_routes``) at definition time.
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from specdecode.serving.api_errors import APIError
from specdecode.serving.responses import sse
from specdecode.serving.responses_input import (
    ITEMS_QUERY,
    REQUEST_SCHEMA,
    SAMPLING_FIELDS,
    TRUNCATIONS,
    chat_tools,
    input_items,
    input_messages,
    items_page,
    logprobs_wanted,
    new_id,
    response_format,
)
from specdecode.serving.responses_store import ResponseStore, StoredResponse, response_tenant
from specdecode.serving.responses_truncation import truncate
from specdecode.serving.state import ServerState
from specdecode.serving.utility_routes import load_body


@dataclass(slots=True)
class Turn:
    """A Responses request read: the chat body that decodes it, the conversation it continues
    (earlier turns and this input, without the instructions: what the store keeps) and its input
    items (the earlier ones too: what ``input_items`` lists)."""

    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    items: list[dict[str, Any]]


def to_chat(body: dict[str, Any], store: ResponseStore, tenant: str) -> Turn:
    """A Responses body as the chat body that decodes it, with what the response continues."""
    if body.get("background"):
        raise APIError(400, "This server does not run responses in the background; leave 'background' out.",
                       "background")
    if body.get("conversation") is not None:
        raise APIError(400, "'conversation' (OpenAI's Conversations API) is not served here; continue a conversation "
                            "with 'previous_response_id', or send it whole as 'input'.", "conversation")
    if "input" not in body:
        raise APIError(400, "'input' is required: a string or a list of input items.", "input")
    if body.get("truncation") is not None and body["truncation"] not in TRUNCATIONS:
        raise APIError(400, f"'truncation' must be 'disabled' (a prompt past the context is a 400) or 'auto' (the "
                            f"oldest input items left out until it fits), got {body['truncation']!r:.40}.", "truncation")
    top_logprobs = logprobs_wanted(body)
    conversation: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
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
        items = [*stored.input_items, *stored.body["output"]]
    conversation += input_messages(body["input"])
    if not conversation:
        raise APIError(400, "'input' holds no messages: give a string or at least one message item.", "input")
    items += input_items(body["input"], {item["id"] for item in items})
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
    if top_logprobs is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top_logprobs
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return Turn(chat, conversation, items)


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def message_item(item_id: str, text: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An output message item; ``logprobs``: its tokens' (the chat route's entries, whose shape
    is the Responses one: token, logprob, bytes, top_logprobs)."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    content = [part] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if status == "completed" else "", "status": status}


class ResponseShell:
    """The fields of a Response that come from its request, and the end of one response: its
    body, its conversation for the store."""

    def __init__(self, body: dict[str, Any], model: str, conversation: list[dict[str, Any]],
                 truncated: int | None = None) -> None:
        self.id, self.created_at, self.conversation = new_id("resp_"), int(time.time()), conversation
        self.truncated = truncated  # with truncation "auto": the messages it left out of the prompt
        text = body.get("text") if isinstance(body.get("text"), dict) else {}
        self.fields = {
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "store": body.get("store", True) is not False,
            "text": {"format": text.get("format") or {"type": "text"}}, "metadata": body.get("metadata"),
            "truncation": body.get("truncation") or "disabled", "top_logprobs": body.get("top_logprobs"),
            "error": None, "incomplete_details": None, "user": body.get("user"),
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
        if self.truncated is not None:
            out["specdecode"] = {**(metrics or {}), "truncated_messages": self.truncated}
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
    logprobs = (choice.get("logprobs") or {}).get("content")
    output = [message_item(new_id("msg_"), text, logprobs=logprobs)] if text else []
    output += [call_item(new_id("fc_"), call) for call in calls]
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
    Responses event sequence; ``done`` gets the completed Response and its conversation. Logprobs
    (asked for with ``include``) go on the text delta of the chunk that brought them; those of a
    chunk with no text (the last one's, of tokens whose text was cut) join the message's own
    list, on ``output_text.done`` and its item."""
    event = _Events()
    yield event("response.created", response=shell.body("in_progress", []))
    yield event("response.in_progress", response=shell.body("in_progress", []))
    output: list[dict[str, Any]] = []
    message_id, text, calls = None, "", []
    item_start = 0  # where the open message item's text begins in ``text`` (content after a call is a new item)
    finish, usage, metrics = None, None, None
    open_call: tuple[str, int, dict[str, Any]] | None = None  # the call whose arguments are streaming
    item_logprobs: list[dict[str, Any]] = []  # the open message's
    pending: list[dict[str, Any]] = []  # logprobs come since the last text delta

    def text_done() -> list[str]:
        item_logprobs.extend(pending)
        pending.clear()
        index, item = len(output), message_item(message_id, text[item_start:], logprobs=list(item_logprobs))
        part = item["content"][0]
        output.append(item)
        return [event("response.output_text.done", item_id=message_id, output_index=index, content_index=0, text=part["text"],
                      logprobs=part["logprobs"]),
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
            pending.extend((choice.get("logprobs") or {}).get("content") or [])
            if delta.get("content"):
                if message_id is None or open_call is not None or any(item["id"] == message_id for item in output):
                    for done_event in close():
                        yield done_event
                    message_id, item_start = new_id("msg_"), len(text)
                    item_logprobs.clear()
                    yield event("response.output_item.added", output_index=len(output),
                                item=message_item(message_id, "", "in_progress"))
                    yield event("response.content_part.added", item_id=message_id, output_index=len(output),
                                content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                       "logprobs": []})
                text += delta["content"]
                yield event("response.output_text.delta", item_id=message_id, output_index=len(output),
                            content_index=0, delta=delta["content"], logprobs=list(pending))
                item_logprobs.extend(pending)
                pending.clear()
            for piece in delta.get("tool_calls") or []:  # a call's first piece has its id (ToolStream)
                if "id" in piece:
                    for done_event in close():
                        yield done_event
                    call = {"id": piece["id"], "type": "function",
                            "function": {"name": piece["function"]["name"], "arguments": ""}}
                    calls.append(call)
                    open_call = (new_id("fc_"), len(output), call)
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


# Words of the chat route's refusals of a prompt too long to decode (engine and api messages).
LENGTH_WORDS = ("context", "KV slots")

Respond = Callable[..., Awaitable[Any]]  # server.py's respond(request, chat, translate=...)


def add_responses_routes(app: Any, state: ServerState, respond: Respond, store: ResponseStore | None = None) -> None:
    """Register ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}`` and
    ``GET /v1/responses/{id}/input_items`` on ``app``."""
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
                turn = to_chat(body, store, tenant)
                truncated = truncate(state, turn.chat) if body.get("truncation") == "auto" else None
            except APIError:
                state.metrics.count("rejected")  # as ServerState.prepare counts the chat route's
                raise
            held["body"], held["items"] = body, turn.items
            held["shell"] = ResponseShell(body, state.model_name, turn.conversation, truncated)
            return json.dumps(turn.chat).encode()

        def keep(body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
            if held["body"].get("store", True) is not False:
                store.put(tenant, body, conversation, held["items"])

        try:
            reply = await respond(request, True, translate=translate)
        except APIError as err:
            raise _in_responses_words(err, held.get("body")) from None
        if isinstance(reply, dict):
            body, conversation = response_body(reply, held["shell"])
            keep(body, conversation)
            return body
        if isinstance(reply, StreamingResponse):
            reply.body_iterator = response_events(reply.body_iterator, held["shell"], keep)
        return reply

    def stored(request: Request, response_id: str) -> StoredResponse:
        found = store.get(response_tenant(request.headers.get("authorization")), response_id)
        if found is None:
            raise APIError(404, f"No stored response {response_id!r:.80} for this API key (created with store: false, "
                                "deleted, evicted, or never existed).", "response_id", "response_not_found")
        return found

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Any:
        return stored(request, response_id).body

    @app.get("/v1/responses/{response_id}/input_items", openapi_extra={"parameters": ITEMS_QUERY})
    async def list_input_items(request: Request, response_id: str) -> Any:
        items = stored(request, response_id).input_items
        query = request.query_params
        include = query.getlist("include") + query.getlist("include[]")  # either way a client spells a list
        return items_page(items, query.get("order"), query.get("limit"), query.get("after"), include)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Any:
        if not store.delete(response_tenant(request.headers.get("authorization")), response_id):
            stored(request, response_id)  # the 404
        return {"id": response_id, "object": "response", "deleted": True}


def _in_responses_words(err: APIError, body: dict[str, Any] | None) -> APIError:
    """The chat route's refusal of its ``messages`` in the Responses fields (``input``,
    ``max_output_tokens``); for a prompt past the context (or the KV pool) with the way out that
    ``truncation`` gives. Other errors as they are."""
    if err.status != 400 or err.param != "messages" or body is None:
        return err
    message = err.message.replace("max_tokens", "max_output_tokens")
    too_long = err.code == "context_length_exceeded" or any(word in message for word in LENGTH_WORDS)
    if too_long and body.get("truncation") != "auto":
        message += " Or send truncation: \"auto\" to leave the oldest input items out until it fits."
    return APIError(400, message, "input", "context_length_exceeded" if too_long else err.code)
