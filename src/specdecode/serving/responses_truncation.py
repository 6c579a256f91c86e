"""``truncation: "auto"`` for ``/v1/responses``: the oldest messages of a conversation left out
until its prompt fits, as OpenAI drops the oldest input items of a response past the context.

"Fits" is what ``ServerState.prepare`` will check of the request: the prompt's tokens (the chat
template with the tools) within the context and the KV pool, and with ``max_output_tokens`` given,
the prompt plus that many new tokens too. System messages (``instructions``, and ``system`` or
``developer`` items) always stay. A conversation is cut only in front of a message that is not a
tool's output, so no function_call_output is kept without the call it answers. The cut is the
least one that fits, found by bisection over where the kept messages start (each try tokenizes
the prompt once); a conversation whose last turn alone does not fit is left whole, so that the
request's own 400 says why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specdecode.errors import SpecDecodeError
from specdecode.serving.protocol import ParsedRequest, parse_request
from specdecode.serving.state import NORMALIZATION_SLACK, ServerState


def _kept(messages: list[dict[str, Any]], start: int) -> list[dict[str, Any]]:
    """The messages from ``start`` on, after every system message before it."""
    return [message for message in messages[:start] if message["role"] == "system"] + messages[start:]


def _fits(state: ServerState, req: ParsedRequest, messages: list[dict[str, Any]]) -> bool:
    longest = state.longest_token_chars
    if longest is not None:  # too many characters for any tokenization to fit: no need to tokenize
        chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        if chars > state.max_prompt_tokens() * longest * NORMALIZATION_SLACK:
            return False
    tools = req.tools.in_prompt if req.tools is not None else None
    prompt_ids = state.decoder.encode(messages, True, tools)
    if len(prompt_ids) > state.max_prompt_tokens():
        return False
    params, room = req.params, state.context_length - len(prompt_ids)
    if not req.max_tokens_given and 0 < room < params.max_new_tokens:  # as prepare lowers the default
        params = dataclasses.replace(params, max_new_tokens=room)
    try:
        state.decoder.check_request(prompt_ids, params)
        state.worker.engine.check_request(len(prompt_ids), params, state.method_of(req), state.k_of(req))
    except SpecDecodeError:
        return False
    return True


def truncate(state: ServerState, chat: dict[str, Any]) -> int:
    """Leave the oldest non-system messages out of the chat body ``chat`` until it fits; returns
    how many were left out (0 where it fitted whole, or where nothing short of its last turn's
    own 400 would). Run it off the event loop: it tokenizes."""
    req = parse_request(chat, True, state.served_names, state.methods, k_max=state.decoder.config.k_max)
    assert isinstance(req.prompt, list)  # a chat request's messages, one per message of ``chat``
    parsed: list[dict[str, Any]] = req.prompt  # type: ignore[assignment]
    starts = [i for i, message in enumerate(parsed) if message["role"] not in ("system", "tool")]
    if not starts or _fits(state, req, parsed) or not _fits(state, req, _kept(parsed, starts[-1])):
        return 0
    low, high = 0, len(starts) - 1  # starts[high] fits; the least start that fits is in [low, high]
    while low < high:
        middle = (low + high) // 2
        if _fits(state, req, _kept(parsed, starts[middle])):
            high = middle
        else:
            low = middle + 1
    start = starts[high]
    messages = chat["messages"]
    chat["messages"] = _kept(messages, start)
    return len(messages) - len(chat["messages"])
