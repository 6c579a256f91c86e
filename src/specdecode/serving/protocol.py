"""The OpenAI request bodies the server accepts: validation into a ``ParsedRequest`` (a bad one
raises ``serving/api_errors.py: APIError``; text is checked by ``serving/unicode_check.py``).

Everything here runs before a request reaches an engine, so that a streaming request too gets
a 4xx instead of an error event after its 200. Fields the server does not implement
(``UNSUPPORTED``) are refused by name when they ask for something, and accepted when they
carry their default value, so that clients which always send ``best_of: 1`` or
``echo: false`` keep working.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specdecode.config import MAX_CHOICES, MAX_LOGPROBS, SamplingParams, StructuredOutput
from specdecode.errors import SpecDecodeError
from specdecode.serving.api_errors import APIError, client_message
from specdecode.serving.tools import ToolError, ToolRequest, parse_tools, tool_message
from specdecode.serving.unicode_check import check_unicode

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 512
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_REPETITION_PENALTY = 10.0  # beyond it every seen token is all but banned
MAX_SEED = 2**63 - 1  # torch seeds are 64-bit; vLLM limits seeds to int64 too
# Chat roles a request may use; `developer` is OpenAI's newer name for `system`.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


MAX_CACHE_SALT_CHARS = 256


@dataclass(slots=True)
class ParsedRequest:
    prompt: str | list[int] | list[dict[str, str]]
    chat: bool
    params: SamplingParams
    stream: bool
    method: str | None
    k: int | None
    # False: max_tokens is the default, which the server may lower to what the context leaves.
    max_tokens_given: bool = True
    # Whose earlier responses suffix decoding reads (serving/suffix_share.py); set from the headers.
    suffix_group: str | None = ""
    # The client's cache_salt (vLLM's field): a prefix is reused only by requests of one salt.
    cache_salt: str | None = None
    # The prefix cache's group: the tenant and the salt (serving/suffix_share.py: cache_group).
    cache_group: str | None = None
    # params.structured compiled for the decoder's tokenizer (ServerState.compile_grammar), or None, and
    # the field that asked for it (named in a 400 when it does not compile).
    grammar: Any = None
    structured_field: str = "response_format"
    # Chat only: the tools the model may call and how (serving/tools.py), or None.
    tools: ToolRequest | None = None
    # Samples of the prompt (OpenAI's n): choice i decodes with params.for_choice(i).
    n: int = 1


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    # `0 == False` in Python: compare types too, so `echo: 0` is not mistaken for `echo: false`.
    return any(type(value) is type(d) and value == d for d in defaults)


# Fields this server does not implement, with the values that ask for nothing (accepted and
# ignored). Any other value is refused by name rather than silently ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
}


def _check_unsupported(body: dict[str, Any]) -> None:
    for name, defaults in UNSUPPORTED.items():
        if name in body and not _is_default(body[name], defaults):
            raise APIError(400, f"'{name}' is not supported by this server (got {_short(body[name])}); "
                                "remove it or pass its default.", name, "unsupported_parameter")


# vLLM's extension field for the constraints OpenAI's response_format cannot express, with
# vLLM's key names (its `structured_outputs`), mapped onto StructuredOutput's fields.
STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                           "json_object": "json_object"}


def _structured(body: dict[str, Any]) -> StructuredOutput | None:
    """OpenAI's ``response_format`` (text, json_object, json_schema with ``strict``), or vLLM's
    ``structured_outputs`` extension ({"json" | "regex" | "choice" | "grammar": ...})."""
    response_format = body.get("response_format")
    extension = body.get("structured_outputs")
    given = response_format is not None and not (isinstance(response_format, dict) and response_format.get("type") == "text")
    if given and extension is not None:
        raise APIError(400, "Give response_format or structured_outputs, not both.", "structured_outputs")
    try:
        if extension is not None:
            if not isinstance(extension, dict):
                raise APIError(400, "'structured_outputs' must be an object such as {\"regex\": \"...\"}.",
                               "structured_outputs")
            unknown = sorted(set(extension) - set(STRUCTURED_OUTPUTS_KEYS) - {"disable_any_whitespace"})
            if unknown:
                raise APIError(400, f"structured_outputs has unknown keys {unknown}; it takes one of "
                                    f"{', '.join(STRUCTURED_OUTPUTS_KEYS)}.", "structured_outputs")
            fields = {STRUCTURED_OUTPUTS_KEYS[key]: value for key, value in extension.items()
                      if key in STRUCTURED_OUTPUTS_KEYS}
            if isinstance(fields.get("choice"), list):
                fields["choice"] = tuple(fields["choice"])
            disable = extension.get("disable_any_whitespace", False)
            if not isinstance(disable, bool):
                raise APIError(400, "structured_outputs.disable_any_whitespace must be true or false.",
                               "structured_outputs")
            return StructuredOutput(**fields, any_whitespace=not disable)
        if not given:
            return None
        if not isinstance(response_format, dict):
            raise APIError(400, "'response_format' must be an object with a 'type'.", "response_format")
        kind = response_format.get("type")
        if kind == "json_object":
            return StructuredOutput(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | str):
                raise APIError(400, "response_format json_schema needs {'name': ..., 'schema': {...}}.", "response_format")
            # OpenAI's default for strict is false: the schema is still enforced, but objects may
            # hold properties it does not list unless it says additionalProperties: false.
            return StructuredOutput(json_schema=spec.get("schema", {}), strict=spec.get("strict") is True)
        raise APIError(400, f"response_format type must be text, json_object or json_schema, got {_short(kind)}.",
                       "response_format")
    except SpecDecodeError as err:
        raise APIError(400, client_message(err), "response_format" if extension is None else "structured_outputs") \
            from err


def _short(value: Any) -> str:
    text = repr(value)  # repr escapes lone surrogates, so the message stays encodable
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(value: Any) -> int | None:
    """``value`` as an int if JSON Schema calls it an integer (``3`` or ``3.0``, not ``true``)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if kinds == (int,) and _integer(value) is not None:
        return _integer(value)
    # bool is an int subclass: refuse it where a number is wanted.
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise APIError(400, f"'{name}' must be {names}, got {type(value).__name__}.", name)
    return value


def _message_content(content: Any, index: int) -> str:
    """A chat message's content: a string, or a list of text parts (joined by newlines, as vLLM
    joins them)."""
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise APIError(400, f"{param} must be a string or a non-empty list of {{'type': 'text', 'text': ...}} parts.",
                       "messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}[{j}] must be a {{'type': 'text', 'text': ...}} part; this server reads text "
                                f"only (got type {_short(kind)}).", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects.", "messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise APIError(400, f"messages[{i}] must be a {{role, content}} object.", "messages")
        role = message.get("role")
        if role == "function":
            raise APIError(400, f"messages[{i}]: role 'function' (OpenAI's deprecated function calling) is not "
                                "supported; send tools and role 'tool' messages.", "messages", "unsupported_parameter")
        if role == "tool" or role == "assistant" and message.get("tool_calls"):
            content = message.get("content")
            # An assistant's calls often come with content null; a tool may return "".
            text = None if content is None else _message_content(content, i)
            try:
                parsed.append(tool_message(message, i, text))
            except ToolError as err:
                raise APIError(400, str(err), err.param) from err
            # Arguments sent as a JSON string were decoded just now, escapes included.
            check_unicode(parsed[-1], f"messages[{i}]", "messages")
            continue
        if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or an object is unhashable
            raise APIError(400, f"messages[{i}] needs a role in {', '.join(CHAT_ROLES)}, got {_short(role)}.",
                           "messages")
        parsed.append({"role": CHAT_ROLES[role], "content": _message_content(message.get("content"), i)})
    return parsed


def _prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt:
        token_ids = [_integer(t) for t in prompt]
        if all(t is not None for t in token_ids):
            return token_ids  # type: ignore[return-value]  # no None left
    raise APIError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt per request).", "prompt")


def _seed(body: dict[str, Any]) -> int | None:
    seed = _typed(body, "seed", (int,), None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise APIError(400, f"'seed' must be in [0, 2**63 - 1], got {_short(seed)}.", "seed")
    return seed


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_STRINGS:
        return tuple(stop)
    raise APIError(400, f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings.", "stop")


def _number(body: dict[str, Any], name: str, default: float, valid: Callable[[float], bool], allowed: str) -> float:
    value = float(_typed(body, name, (int, float), default))
    if not math.isfinite(value) or not valid(value):
        raise APIError(400, f"'{name}' must be in {allowed}, got {value}.", name)
    return value


def _penalties(body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's presence/frequency penalties and logit_bias, vLLM's repetition_penalty and min_p."""
    out: dict[str, Any] = {
        "presence_penalty": _number(body, "presence_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "[-2, 2]"),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, lambda v: -2.0 <= v <= 2.0, "[-2, 2]"),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, lambda v: 0.0 < v <= MAX_REPETITION_PENALTY,
                                      f"(0, {MAX_REPETITION_PENALTY:g}]"),
        "min_p": _number(body, "min_p", 0.0, lambda v: 0.0 <= v <= 1.0, "[0, 1]"),
    }
    bias = body.get("logit_bias")
    if bias is None:
        return out
    if not isinstance(bias, dict):
        raise APIError(400, "'logit_bias' must be an object mapping token ids (as strings) to numbers in [-100, 100].",
                       "logit_bias")
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token is None:
            raise APIError(400, f"'logit_bias' keys must be token ids, got {_short(key)}.", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise APIError(400, f"'logit_bias' values must be numbers in [-100, 100], got {_short(value)} for {key}.",
                           "logit_bias")
        parsed[token] = float(value)
    out["logit_bias"] = parsed
    return out


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top logprobs to report per token (0: the chosen token's only), or None: chat's
    ``logprobs: true`` + ``top_logprobs: 0..20``; completions' ``logprobs: 0..20``."""
    if chat:
        wanted = _typed(body, "logprobs", (bool,), False)
        top = _typed(body, "top_logprobs", (int,), None)
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(400, f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}.", "top_logprobs")
        if top and not wanted:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        return (top or 0) if wanted else None
    count = _typed(body, "logprobs", (int,), None)
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise APIError(400, f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {count}.", "logprobs")
    return count


def parse_request(body: Any, chat: bool, served_names: tuple[str, ...], methods: tuple[str, ...],
                  k_max: int | None = None) -> ParsedRequest:
    """Validate an OpenAI (chat) completion request body; raise APIError on bad input.
    ``k_max``: the largest ``k`` a request may ask for (None: no bound here)."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    model = _typed(body, "model", (str,), None)
    if model is None:
        raise APIError(400, "'model' is required.", "model")
    # Only the names this server was started with: a request's model is never loaded or
    # resolved as a path or a hub id.
    if model not in served_names:
        raise APIError(404, f"The model {_short(model)} does not exist; this server serves {', '.join(served_names)}.",
                       "model", "model_not_found")
    # Every text field, before any is read: what reaches a tokenizer or a template is encodable.
    # After the model: a name this server does not serve is a 404 whatever its characters.
    check_unicode(body)
    _check_unsupported(body)
    prompt: str | list[int] | list[dict[str, Any]] = _messages(body) if chat else _prompt(body)
    tools = None
    if chat:
        try:
            tools = parse_tools(body)
        except ToolError as err:
            raise APIError(400, str(err), err.param) from err
    elif body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise APIError(400, "Tools are a chat completions feature: send them to /v1/chat/completions.",
                       "tools" if body.get("tools") else "tool_choice")
    max_tokens_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    default_max = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    max_tokens = _typed(body, max_tokens_name, (int,), default_max)
    max_tokens_given = body.get(max_tokens_name) is not None
    if max_tokens < 1:
        raise APIError(400, f"'{max_tokens_name}' must be at least 1, got {max_tokens}.", max_tokens_name)
    temperature = _number(body, "temperature", 1.0, lambda t: 0.0 <= t <= MAX_TEMPERATURE, f"[0, {MAX_TEMPERATURE}]")
    # Any top_p in (0, 1] is safe: the most likely token always survives the nucleus filter.
    top_p = _number(body, "top_p", 1.0, lambda p: 0.0 < p <= 1.0, "(0, 1]")
    top_k = _typed(body, "top_k", (int,), 0)
    stream = _typed(body, "stream", (bool,), False)
    n = _typed(body, "n", (int,), 1)
    if not 1 <= n <= MAX_CHOICES:
        raise APIError(400, f"'n' (choices to generate) must be in 1..{MAX_CHOICES}, got {_short(n)}.", "n")
    method = _typed(body, "method", (str,), None)
    if method is not None and method not in methods:
        raise APIError(400, f"'method' must be one of {', '.join(methods)}, got {_short(method)}.", "method")
    k = _typed(body, "k", (int,), None)
    if k is not None and (k < 1 or k_max is not None and k > k_max):
        raise APIError(400, f"'k' (tokens drafted per step) must be in 1..{k_max if k_max is not None else 'inf'}, "
                            f"got {_short(k)}.", "k")
    cache_salt = _typed(body, "cache_salt", (str,), None)
    if cache_salt is not None and not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise APIError(400, f"'cache_salt' must be a string of 1..{MAX_CACHE_SALT_CHARS} characters.", "cache_salt")
    structured_field = "structured_outputs" if "structured_outputs" in body else "response_format"
    try:
        structured = _structured(body)
        try:
            calls = tools.constraint() if tools is not None else None
        except SpecDecodeError as err:
            raise APIError(400, f"A tool's parameters: {client_message(err)}", "tool_choice") from err
        if calls is not None:
            if structured is not None:
                raise APIError(400, f"tool_choice {tools.choice!r} constrains the output to a tool call; it cannot "
                                    f"also follow {structured_field}. Drop one of them.", "tool_choice")
            structured, structured_field = calls, "tool_choice"
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=max_tokens,
                                seed=_seed(body), stop=_stops(body), structured=structured,
                                logprobs=_logprobs(body, chat), **_penalties(body))
    except SpecDecodeError as err:
        raise APIError(400, client_message(err)) from err
    return ParsedRequest(prompt, chat, params, stream, method, k, max_tokens_given, cache_salt=cache_salt,
                         structured_field=structured_field, tools=tools, n=n)
