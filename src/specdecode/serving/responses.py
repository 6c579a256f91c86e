"""The OpenAI response bodies: a whole completion, and the server-sent events of a stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from specdecode.core.logprobs import TokenLogprob
from specdecode.engine.metrics import GenerationStats
from specdecode.serving.tools import ToolRequest, ToolStream, split_tool_calls

if TYPE_CHECKING:
    from specdecode.serving.generation import Generation

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "length": "length"}


def _usage(all_stats: Sequence[GenerationStats | None]) -> dict[str, Any]:
    """OpenAI's usage of a request: its prompt once, the completion tokens of every choice."""
    first = all_stats[0] if all_stats else None
    prompt = first.prompt_tokens if first else 0
    completion = sum(stats.new_tokens for stats in all_stats if stats is not None)
    # OpenAI's field for prompt tokens served from the prefix cache (choice 0's: the others
    # start from its prompt K/V).
    details = {"cached_tokens": first.cached_tokens if first else 0}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": details}


def _choice_metrics(stats: GenerationStats | None) -> dict[str, Any]:
    if stats is None:
        return {}
    return {"method": stats.method, "tau": stats.tau, "acceptance_rate": stats.acceptance_rate,
            "tokens_per_second": stats.tokens_per_second, "target_forward_passes": stats.target_forward_passes,
            "prefill_seconds": stats.prefill_seconds, "first_token_seconds": stats.first_token_seconds}


def _spec_metrics(all_stats: Sequence[GenerationStats | None]) -> dict[str, Any]:
    """The ``specdecode`` field: one choice's decoding metrics, or with n > 1 each choice's."""
    if len(all_stats) == 1:
        return _choice_metrics(all_stats[0])
    return {"choices": [_choice_metrics(stats) for stats in all_stats]}


def _finish(stats: GenerationStats | None) -> str | None:
    return FINISH_REASONS.get(stats.stop_reason, "stop") if stats is not None else None


def _finish_with(stats: GenerationStats | None, called: bool) -> str | None:
    # OpenAI's reason when the model called tools; a call cut by max_tokens is not parsed.
    return "tool_calls" if called and stats is not None and stats.stop_reason != "length" else _finish(stats)


TokenText = Callable[[int], str]  # a token id's text (the tokenizer's decode of it alone)


def _token_entry(token: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


def logprobs_body(entries: Sequence[TokenLogprob] | None, chat: bool, token_text: TokenText,
                  offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice: chat's ``{"content": [...]}`` (each token with its
    ``top_logprobs`` list), or completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs``
    (a dict of the top tokens and the chosen one, as OpenAI's legacy API gives) / ``text_offset``
    (from ``offset``, the characters before these tokens)."""
    if entries is None:
        return None
    if chat:
        content = [_token_entry(e.token, e.logprob, token_text)
                   | {"top_logprobs": [_token_entry(t, v, token_text) for t, v in e.top]} for e in entries]
        return {"content": content, "refusal": None}
    tokens, offsets = [], []
    for entry in entries:
        tokens.append(token_text(entry.token))
        offsets.append(offset)
        offset += len(tokens[-1])
    tops = [{token_text(t): v for t, v in entry.top} | {token_text(entry.token): entry.logprob} for entry in entries]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def choice_body(index: int, chat: bool, text: str, stats: GenerationStats | None, tools: ToolRequest | None = None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a whole (not streamed) completion."""
    choice: dict[str, Any] = {"index": index, "finish_reason": _finish(stats), "logprobs": logprobs}
    if chat and tools is not None and tools.parses_calls:
        content, calls = split_tool_calls(text, tools.names)
        choice["message"] = {"role": "assistant", "content": content}
        if calls:
            choice["message"]["tool_calls"] = calls
        choice["finish_reason"] = _finish_with(stats, bool(calls))
    elif chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return choice


def final_body(request_id: str, created: int, model: str, chat: bool, choices: list[dict[str, Any]],
               all_stats: Sequence[GenerationStats | None]) -> dict[str, Any]:
    """A whole completion: its choices (``choice_body``), usage and decoding metrics."""
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": _usage(all_stats), "specdecode": _spec_metrics(all_stats)}


def _chunk(request_id: str, created: int, model: str, chat: bool, delta: str | None, finish: str | None,
           first: bool = False, calls: list[dict[str, Any]] | None = None,
           logprobs: dict[str, Any] | None = None, index: int = 0) -> str:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": logprobs}
    if chat:
        payload: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta:
            payload["content"] = delta
        if calls:
            payload["tool_calls"] = calls  # each with its index (ToolStream)
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


def usage_apart(raw: bytes) -> bool:
    """Whether a request body asks for OpenAI's ``stream_options: {"include_usage": true}``
    (read again only when the words are in it: ``parse_request`` has no field for it)."""
    if b"include_usage" not in raw:
        return False
    try:
        options = json.loads(raw).get("stream_options")
    except (ValueError, AttributeError):
        return False
    return isinstance(options, dict) and options.get("include_usage") is True


def _usage_chunk(generations: Sequence[Generation], request_id: str, created: int, model: str, chat: bool) -> str:
    """OpenAI's last chunk with ``include_usage``: no choices, the request's usage (and metrics)."""
    all_stats = [g.stats for g in generations]
    return sse({"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": model, "choices": [], "usage": _usage(all_stats),
                "specdecode": _spec_metrics(all_stats)})


async def events(generations: Sequence[Generation], request_id: str, created: int, model: str, chat: bool,
                 token_text: TokenText | None = None, usage_chunk: bool = False) -> AsyncIterator[str]:
    """Server-sent events, ending in ``data: [DONE]`` whether the generation finished or failed
    (then the event before it is an OpenAI error body). With logprobs asked for, each event
    carries those of the tokens taken since the one before (``token_text`` names them).

    The ``usage`` and the ``specdecode`` metrics come in a last chunk with no choices (OpenAI's
    shape) with ``usage_chunk`` (the request's ``include_usage``) or several choices (n > 1);
    otherwise on the one choice's last chunk. Several choices' chunks interleave as their tokens
    come, each with its ``index``; the first choice to fail ends the stream with its error."""
    if len(generations) == 1:
        generation = generations[0]
        async for event in _choice_events(generation, request_id, created, model, chat, token_text,
                                          usage=not usage_chunk):
            yield event
        if generation.failure() is None:
            if usage_chunk:
                yield _usage_chunk(generations, request_id, created, model, chat)
            yield "data: [DONE]\n\n"
        return
    merged: asyncio.Queue[str | None] = asyncio.Queue()

    async def pump(generation: Generation) -> None:
        try:
            async for event in _choice_events(generation, request_id, created, model, chat, token_text, usage=False):
                await merged.put(event)
        finally:
            await merged.put(None)

    tasks = [asyncio.ensure_future(pump(generation)) for generation in generations]
    try:
        running = len(tasks)
        while running:
            event = await merged.get()
            if event is None:
                running -= 1
                continue
            yield event
            if event.startswith('data: {"error"'):
                return  # [DONE] came with it
        yield _usage_chunk(generations, request_id, created, model, chat)
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


async def _choice_events(generation: Generation, request_id: str, created: int, model: str, chat: bool,
                         token_text: TokenText | None, usage: bool) -> AsyncIterator[str]:
    """One choice's events; on failure its error event and ``[DONE]``. ``usage``: its last
    chunk carries the usage and metrics (a request of one choice)."""
    index = generation.choice
    sent_tokens, sent_chars = 0, 0

    def new_logprobs(upto: int | None) -> dict[str, Any] | None:
        nonlocal sent_tokens, sent_chars
        stats = generation.stats
        if token_text is None or stats is None or stats.token_logprobs is None:
            return None
        entries = stats.token_logprobs[sent_tokens:upto]
        sent_tokens += len(entries)
        body = logprobs_body(entries, chat, token_text, sent_chars)
        sent_chars += sum(len(token_text(e.token)) for e in entries)
        return body

    def make(delta: str | None, finish: str | None, first: bool = False, upto: int | None = 0) -> str:
        logprobs = new_logprobs(upto) if upto != 0 else None
        return _chunk(request_id, created, model, chat, delta, finish, first, logprobs=logprobs, index=index)

    tools = generation.request.tools
    splitter = ToolStream(tools.names) if chat and tools is not None and tools.parses_calls else None
    if chat:
        yield make(None, None, first=True)
    async for delta, taken in generation.chunks():
        if splitter is not None:
            delta, calls = splitter.feed(delta)
            if calls:
                yield _chunk(request_id, created, model, chat, delta, None, calls=calls, index=index)
                continue
            if not delta:
                continue
        yield make(delta, None, upto=taken)
    failure = generation.failure()
    if failure is not None:
        yield f"data: {failure.json()}\n\ndata: [DONE]\n\n"
        return
    finish = _finish(generation.stats)
    if splitter is not None:
        held, calls = splitter.finish()
        if held or calls:  # the held-back text, and calls parsed at the end, whole (their index tells them apart)
            yield _chunk(request_id, created, model, chat, held, None, calls=calls, index=index)
        finish = _finish_with(generation.stats, splitter.called)
    final = make(None, finish, upto=generation.token_count)
    if not usage:
        yield final
        return
    body = json.loads(final[len("data: "):])
    body["usage"], body["specdecode"] = _usage([generation.stats]), _spec_metrics([generation.stats])
    yield sse(body)
