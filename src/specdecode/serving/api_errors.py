"""The error a client of the server gets back: ``APIError``, an OpenAI-style JSON body, and a
library error's message with its parameters named as the client sets them (a request field, a
server flag)."""

from __future__ import annotations

import json
from typing import Any

from specdecode.errors import SpecDecodeError, reword_params

# Library parameters (``errors.reword_params``) as a client of this server sets them: a request
# field, or a flag the server was started with.
REQUEST_FIELDS = {"max_new_tokens": "max_tokens", "method": "method", "k": "k", "temperature": "temperature",
                  "top_k": "top_k", "top_p": "top_p", "seed": "seed"}
SERVER_FLAGS = {"kv_cache_tokens": "--kv-cache-tokens", "backend": "--backend", "kv_dtype": "--kv-dtype",
                "k_max": "--k-max", "heads": "--heads", "draft": "--draft", "grammar_timeout": "--grammar-timeout"}


def _as_client_words(name: str, value: str) -> str | None:
    if name in REQUEST_FIELDS:
        return f"{REQUEST_FIELDS[name]}={value}" if value else REQUEST_FIELDS[name]
    if name in SERVER_FLAGS:
        return f"{SERVER_FLAGS[name]} {value}".rstrip()
    if name == "chat":  # chat=True is the chat endpoint
        return "the chat endpoint: POST it to /v1/completions"
    return None


def client_message(err: SpecDecodeError) -> str:
    """A library error's message with its parameters named as a client of this server sets them."""
    return reword_params(str(err), _as_client_words)


class APIError(Exception):
    """An error to return as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def json(self) -> str:
        # ASCII escapes: a message may quote client text, which may hold a lone surrogate that
        # UTF-8 cannot encode.
        return json.dumps(self.body(), ensure_ascii=True)
