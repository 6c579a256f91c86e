"""The routes around generation that editors and scripts call: ``POST /tokenize`` and
``POST /detokenize`` (vLLM's request and response shapes), ``POST /apply-template`` and
``GET /props`` (llama-server's).

None of them decodes: each reads the decoder's tokenizer or chat template. They sit behind the
same request guard as the completions routes (API key, Host, JSON body within
``--max-body-bytes``), validate their bodies with ``protocol.parse_request`` (the served model
names, text that UTF-8 can encode, chat messages and tools), refuse text too long for the
context before tokenizing it (``check_text_chars``), and tokenize in a thread, off the event loop.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' signatures
# (``request: Request``, imported inside ``add_utility_routes``) at definition time.
import asyncio
from typing import Any

from specdecode import __version__
from specdecode.serving.api_errors import APIError
from specdecode.serving.protocol import ParsedRequest, parse_request
from specdecode.serving.state import NORMALIZATION_SLACK, ServerState, _load_json

# Fields of a body that parse_request reads as sampling settings and that these routes do not
# take; dropped before validation so that a stray value cannot make a tokenize request a 400.
_GENERATION_ONLY = ("max_tokens", "max_completion_tokens", "n", "stream", "response_format", "structured_outputs")


def load_body(raw: bytes, state: ServerState) -> dict[str, Any]:
    """A JSON object body, with ``model`` defaulting to the served name (vLLM and llama-server
    take these requests without one); a named model must be one this server serves (a 404)."""
    body = _load_json(raw)
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    body.setdefault("model", state.model_name)
    return body


def validated(body: dict[str, Any], state: ServerState, chat: bool) -> ParsedRequest:
    """``body`` checked as a (chat) completion request would be: model, text, messages, tools."""
    trimmed = {key: value for key, value in body.items() if key not in _GENERATION_ONLY}
    return parse_request(trimmed, chat, state.served_names, state.methods, k_max=state.decoder.config.k_max)


def check_text_chars(state: ServerState, chars: int, param: str) -> None:
    """Refuse (400) text that cannot fit in the context, from its length in characters alone
    (before tokenizing it: seconds of CPU for megabytes): no token of the model stands for more
    than ``state.longest_token_chars`` characters, as ``ServerState.prepare`` bounds a prompt."""
    longest = state.longest_token_chars
    if longest is None:
        return
    most = state.max_prompt_tokens()
    if chars > most * longest * NORMALIZATION_SLACK:
        raise APIError(400, f"The text has {chars} characters, more than {most} tokens can hold (no token of this "
                            f"model stands for more than {longest} characters); send a shorter text.", param,
                       "context_length_exceeded")


def _is_integer(value: Any) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be true or false, got {value!r:.40}.", name)
    return value


def render_chat(state: ServerState, req: ParsedRequest, add_generation_prompt: bool,
                continue_final_message: bool = False) -> str:
    """The chat template's text for a validated chat request (its messages and any tools), as
    ``engine/text.py: encode_prompt`` renders it for generation."""
    tokenizer = state.decoder.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise APIError(400, f"The model {state.model_name}'s tokenizer has no chat template; send 'prompt' instead "
                            "of 'messages'.", "messages")
    tools = req.tools.in_prompt if req.tools is not None else None
    if tools and "tools" not in template:
        raise APIError(400, f"The model {state.model_name}'s chat template has no tools section; send the request "
                            "without tools.", "tools")
    assert isinstance(req.prompt, list)  # chat: parse_request gave the messages
    return str(tokenizer.apply_chat_template(req.prompt, tools=tools or None, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message))


def tokenize(raw: bytes, state: ServerState) -> dict[str, Any]:
    """vLLM's ``/tokenize``: ``{prompt, add_special_tokens=true}`` or ``{messages,
    add_generation_prompt=true, continue_final_message=false, add_special_tokens=false, tools}``,
    either with ``return_token_strs``, to ``{count, max_model_len, tokens[, token_strs]}``."""
    body = load_body(raw, state)
    chat = "messages" in body
    req = validated(body, state, chat)
    tokenizer = state.decoder.tokenizer
    if chat:
        generation_prompt = _flag(body, "add_generation_prompt", True)
        continue_final = _flag(body, "continue_final_message", False)
        if generation_prompt and continue_final:
            raise APIError(400, "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
                           "continue_final_message")
        chars = sum(len(m["content"]) for m in req.prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
        check_text_chars(state, chars, "messages")
        text = render_chat(state, req, generation_prompt, continue_final)
        add_special = _flag(body, "add_special_tokens", False)
    else:
        if not isinstance(req.prompt, str):
            raise APIError(400, "'prompt' must be a string to tokenize (token ids are tokens already).", "prompt")
        check_text_chars(state, len(req.prompt), "prompt")
        text, add_special = req.prompt, _flag(body, "add_special_tokens", True)
    tokens = list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
    reply: dict[str, Any] = {"count": len(tokens), "max_model_len": state.context_length, "tokens": tokens}
    if _flag(body, "return_token_strs", False):
        reply["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return reply


def detokenize(raw: bytes, state: ServerState) -> dict[str, Any]:
    """vLLM's ``/detokenize``: ``{tokens: [ids]}`` to ``{prompt}``; an id outside the
    tokenizer's vocabulary is a 400."""
    body = load_body(raw, state)
    if body["model"] not in state.served_names:
        raise APIError(404, f"The model {body['model']!r:.40} does not exist; this server serves "
                            f"{', '.join(state.served_names)}.", "model", "model_not_found")
    given = body.get("tokens")
    # Integral floats (3.0) are integers to JSON Schema, as to the completions route's prompt ids.
    tokens = [int(t) for t in given if _is_integer(t)] if isinstance(given, list) else None
    if tokens is None or len(tokens) != len(given):
        raise APIError(400, "'tokens' must be a list of token ids (integers).", "tokens")
    vocab = len(state.decoder.tokenizer)
    outside = next((t for t in tokens if not 0 <= t < vocab), None)
    if outside is not None:
        raise APIError(400, f"Token id {outside} is outside this model's vocabulary [0, {vocab}).", "tokens")
    return {"prompt": str(state.decoder.tokenizer.decode(tokens))}


def apply_template(raw: bytes, state: ServerState) -> dict[str, Any]:
    """llama-server's ``/apply-template``: a chat request's ``messages`` (and ``tools``) to
    ``{prompt}``, the text the chat template makes of them (with the generation prompt unless
    ``add_generation_prompt: false``)."""
    body = load_body(raw, state)
    req = validated(body, state, chat=True)
    chars = sum(len(m["content"]) for m in req.prompt if isinstance(m, dict) and isinstance(m.get("content"), str))
    check_text_chars(state, chars, "messages")
    return {"prompt": render_chat(state, req, _flag(body, "add_generation_prompt", True))}


def props(state: ServerState) -> dict[str, Any]:
    """llama-server's ``GET /props``: the context, the batch's seats, the served model's name
    (never a path on disk), its chat template and special tokens."""
    tokenizer = state.decoder.tokenizer
    params = {"n_predict": -1, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "stream": False,
              "method": state.decoder.config.method, "k": state.decoder.config.draft_k}
    return {
        "default_generation_settings": {"n_ctx": state.context_length, "model": state.model_name, "params": params},
        "total_slots": state.worker.max_batch,
        "model_path": state.model_name,
        "chat_template": getattr(tokenizer, "chat_template", None) or "",
        "bos_token": getattr(tokenizer, "bos_token", None) or "",
        "eos_token": getattr(tokenizer, "eos_token", None) or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": f"specdecode {__version__}",
        "specdecode": {"methods": list(state.methods)},
    }


def add_utility_routes(app: Any, state: ServerState) -> None:
    """Register ``/tokenize``, ``/detokenize``, ``/apply-template`` and ``/props`` on ``app``."""
    from fastapi import Request

    from specdecode.serving.openapi import utility_body

    def post(path: str, handler: Any) -> None:
        async def endpoint(request: Request) -> dict[str, Any]:
            raw = await request.body()  # the guard has read it, within the size limit
            return await asyncio.to_thread(handler, raw, state)

        app.post(path, openapi_extra={"requestBody": utility_body(path, state.served_names, len(state.decoder.tokenizer))})(endpoint)

    post("/tokenize", tokenize)
    post("/detokenize", detokenize)
    post("/apply-template", apply_template)

    @app.get("/props")
    async def get_props() -> dict[str, Any]:
        return props(state)
