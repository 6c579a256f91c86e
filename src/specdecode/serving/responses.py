"""The OpenAI response bodies: a whole completion, and the server-sent events of a stream."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from specdecode.engine.metrics import GenerationStats
from specdecode.serving.tools import ToolRequest, ToolStream, split_tool_calls

if TYPE_CHECKING:
    from specdecode.serving.generation import Generation

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length"}


def _usage(stats: GenerationStats | None) -> dict[str, Any]:
    prompt = stats.prompt_tokens if stats else 0
    completion = stats.new_tokens if stats else 0
    # OpenAI's field for prompt tokens served from the prefix cache.
    details = {"cached_tokens": stats.cached_tokens if stats else 0}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": details}


def _spec_metrics(stats: GenerationStats | None) -> dict[str, Any]:
    if stats is None:
        return {}
    return {"method": stats.method, "tau": stats.tau, "acceptance_rate": stats.acceptance_rate,
            "tokens_per_second": stats.tokens_per_second, "target_forward_passes": stats.target_forward_passes}


def _finish(stats: GenerationStats | None) -> str | None:
    return FINISH_REASONS.get(stats.stop_reason, "stop") if stats is not None else None


def _finish_with(stats: GenerationStats | None, calls: list[dict[str, Any]]) -> str | None:
    # OpenAI's reason when the model called tools; a call cut by max_tokens is not parsed.
    return "tool_calls" if calls and stats is not None and stats.stop_reason != "length" else _finish(stats)


def final_body(request_id: str, created: int, model: str, chat: bool, text: str, stats: GenerationStats | None,
               tools: ToolRequest | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": _finish(stats), "logprobs": None}
    if chat and tools is not None and tools.parses_calls:
        content, calls = split_tool_calls(text, tools.names)
        choice["message"] = {"role": "assistant", "content": content}
        if calls:
            choice["message"]["tool_calls"] = calls
        choice["finish_reason"] = _finish_with(stats, calls)
    elif chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": _usage(stats), "specdecode": _spec_metrics(stats)}


def _chunk(request_id: str, created: int, model: str, chat: bool, delta: str | None, finish: str | None,
           first: bool = False, calls: list[dict[str, Any]] | None = None) -> str:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if chat:
        payload: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta:
            payload["content"] = delta
        if calls:
            payload["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        choice["delta"] = payload
    else:
        choice["text"] = delta or ""
    body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice]}
    return sse(body)


# Characters JSON leaves raw that Python's str.splitlines (and so httpx's iter_lines) reads as
# line breaks: escaped, so that an event is one line for every client.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n"


async def events(generation: Generation, request_id: str, created: int, model: str, chat: bool) -> AsyncIterator[str]:
    """Server-sent events, ending in ``data: [DONE]`` whether the generation finished or failed
    (then the event before it is an OpenAI error body)."""
    def make(delta: str | None, finish: str | None, first: bool = False) -> str:
        return _chunk(request_id, created, model, chat, delta, finish, first)

    tools = generation.request.tools
    splitter = ToolStream(tools.names) if chat and tools is not None and tools.parses_calls else None
    if chat:
        yield make(None, None, first=True)
    async for delta in generation.deltas():
        if splitter is not None:
            delta = splitter.feed(delta)
            if not delta:
                continue
        yield make(delta, None)
    failure = generation.failure()
    if failure is not None:
        yield f"data: {failure.json()}\n\n"
    else:
        finish = _finish(generation.stats)
        if splitter is not None:
            held, calls = splitter.finish()
            if held or calls:  # the held-back text, and the calls as one delta each (their index tells them apart)
                yield _chunk(request_id, created, model, chat, held, None, calls=calls)
            finish = _finish_with(generation.stats, calls)
        final = make(None, finish)
        body = json.loads(final[len("data: "):])
        body["usage"], body["specdecode"] = _usage(generation.stats), _spec_metrics(generation.stats)
        yield sse(body)
    yield "data: [DONE]\n\n"
