"""JSON Schemas of the request bodies, for the OpenAPI document at ``/openapi.json``.

The endpoints read their bodies themselves (``serving/protocol.py`` validates them, with
OpenAI's error bodies), so FastAPI cannot derive these; they document what ``parse_request``
accepts, and the schema fuzz test (tests/serving/test_abuse.py) generates requests from them.
Fields the server refuses unless they carry their default (``protocol.UNSUPPORTED``) are left
out.
"""

from __future__ import annotations

from typing import Any

from specdecode.config import MAX_CHOICES
from specdecode.serving.protocol import MAX_CACHE_SALT_CHARS, MAX_SEED, MAX_STOP_STRINGS, MAX_TEMPERATURE
from specdecode.serving.tools import MAX_TOOLS, NAME_PATTERN

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _TEXT_PART}]},
        "name": {"type": "string"},
    },
}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN.pattern}, "description": {"type": "string"},
        "parameters": {"type": "object"}}},
}}
_COMMON: dict[str, Any] = {
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE,
                    "description": "below 1e-5: greedy"},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "description": "extension; 0: off"},
    "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS}]},
    "stream": {"type": "boolean"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES,
          "description": "choices, each a sample of the prompt (choice i seeded with seed + i); the prompt is computed once"},
    "user": {"type": "string"},
    "method": {"type": "string", "description": "extension: a decoding method the server loaded"},
    "k": {"type": "integer", "minimum": 1, "description": "extension: tokens drafted per step, at most the server's k_max"},
    "response_format": {
        "anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": "boolean"}}}}},
        ],
        "description": "OpenAI's structured outputs: any JSON object, or JSON following a schema (strict honoured)",
    },
    "structured_outputs": {
        "type": "object", "minProperties": 1, "maxProperties": 1,
        "properties": {"json": {"type": "object"}, "regex": {"type": "string", "minLength": 1},
                       "choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                       "grammar": {"type": "string", "minLength": 1}},
        "description": "vLLM's extension: one of a JSON schema, a regex, a list of choices or an EBNF (GBNF) grammar",
    },
    "cache_salt": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                   "description": "vLLM's field: a cached prompt prefix is reused only by requests of the same salt "
                                  "(and tenant)"},
}


def request_body(chat: bool, served_names: tuple[str, ...], methods: tuple[str, ...], k_max: int,
                 vocab_size: int) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` object of /v1/chat/completions (``chat``) or /v1/completions,
    for a server with these model names, methods, k_max and vocabulary."""
    properties = dict(_COMMON)
    properties["model"] = {"enum": list(served_names), "description": "one of the names in GET /v1/models"}
    properties["method"] = dict(properties["method"], enum=list(methods))
    properties["k"] = dict(properties["k"], maximum=k_max)
    if chat:
        properties["messages"] = {"type": "array", "minItems": 1, "items": _MESSAGE}
        properties["max_completion_tokens"] = {"type": "integer", "minimum": 1}
        properties["tools"] = {"type": "array", "maxItems": MAX_TOOLS, "items": _TOOL,
                               "description": "functions the model may call, shown to it by its chat template"}
        properties["tool_choice"] = {"anyOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"},
                "function": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "pattern": NAME_PATTERN.pattern}}}}},
        ], "description": "required or a named function: the output is one valid call (a grammar)"}
        required = ["model", "messages"]
    else:
        properties["prompt"] = {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}},
        ]}
        required = ["model", "prompt"]
    # The rules between fields that a schema can state (parse_request enforces them all):
    # response_format and structured_outputs exclude each other; tool_choice "required" or a
    # named function needs tools. Others (a named function among the tools, tool names unique,
    # a grammar that compiles, a prompt that fits the context) are checked only by the server.
    rules: list[dict[str, Any]] = [{"not": {"required": ["response_format", "structured_outputs"]}}]
    if chat:
        rules.append({"anyOf": [{"not": {"required": ["tool_choice"]}},
                                {"properties": {"tool_choice": {"enum": ["none", "auto"]}}},
                                {"required": ["tools"], "properties": {"tools": {"minItems": 1}}}]})
    schema = {"type": "object", "required": required, "properties": properties, "allOf": rules}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_MODEL_OPTIONAL = "optional: one of the names in GET /v1/models"
_SAMPLING = {name: _COMMON[name] for name in ("temperature", "top_p", "top_k", "seed", "stop", "stream")}
_UTILITY_BODIES: dict[str, tuple[dict[str, Any], list[str]]] = {
    # vLLM's /tokenize takes a prompt or chat messages; the schema states the prompt form.
    "/tokenize": ({"prompt": {"type": "string", "minLength": 1}, "add_special_tokens": {"type": "boolean"},
                   "return_token_strs": {"type": "boolean"}}, ["prompt"]),
    "/detokenize": ({"tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}, ["tokens"]),  # < vocab
    "/apply-template": ({"messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                         "add_generation_prompt": {"type": "boolean"}}, ["messages"]),
    "/infill": ({"input_prefix": {"type": "string"}, "input_suffix": {"type": "string"}, "prompt": {"type": "string"},
                 "input_extra": {"type": "array", "items": {"type": "object", "properties": {
                     "filename": {"type": "string"}, "text": {"type": "string"}}}},
                 "n_predict": {"type": "integer", "description": "llama-server's max_tokens; -1: the default"},
                 "max_tokens": _COMMON["max_tokens"], **_SAMPLING}, []),
}


def utility_body(path: str, served_names: tuple[str, ...], vocab_size: int) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of /tokenize, /detokenize, /apply-template or /infill
    (``serving/utility_routes.py``, ``serving/infill.py``), for a tokenizer of ``vocab_size`` ids."""
    properties, required = _UTILITY_BODIES[path]
    if path == "/detokenize":
        properties = {"tokens": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}}
    model = {"enum": list(served_names), "description": _MODEL_OPTIONAL}
    schema = {"type": "object", "required": required, "properties": {"model": model, **properties}}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


_BLOCKS = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["type"],
           "properties": {"type": {"enum": ["text", "tool_use", "tool_result"]}}}}]}
_MESSAGES_FIELDS: dict[str, Any] = {
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                 "properties": {"role": {"enum": ["user", "assistant"]}, "content": _BLOCKS}}},
    "system": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
    "tools": {"type": "array", "maxItems": MAX_TOOLS, "items": {"type": "object", "required": ["name", "input_schema"],
              "properties": {"name": {"type": "string", "pattern": NAME_PATTERN.pattern},
                             "description": {"type": "string"}, "input_schema": {"type": "object"}}}},
    "tool_choice": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"}}},
}


def messages_body(served_names: tuple[str, ...], count: bool) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of Anthropic's ``/v1/messages`` or (``count``)
    ``/v1/messages/count_tokens`` (``serving/anthropic_messages.py``)."""
    properties = {"model": {"enum": list(served_names), "description": _MODEL_OPTIONAL}, **_MESSAGES_FIELDS}
    required = ["messages"]
    if not count:
        properties |= {"max_tokens": _COMMON["max_tokens"], "stop_sequences": {
            "type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string", "minLength": 1}},
            **{name: _COMMON[name] for name in ("temperature", "top_p", "top_k", "stream", "method", "k")}}
        required.append("max_tokens")
    schema = {"type": "object", "required": required, "properties": properties}
    return {"required": True, "content": {"application/json": {"schema": schema}}}
