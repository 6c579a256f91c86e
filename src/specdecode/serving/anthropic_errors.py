"""Errors in the shape of Anthropic's Messages API, for the routes that serve it
(``serving/anthropic_messages.py``) and for the request guard's refusals on those routes:
``{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}``, the shape the
anthropic SDK reads into its ``BadRequestError``, ``AuthenticationError`` and the rest.

A leaf module (it imports only ``APIError``), so that ``serving/guard.py`` can use it.
"""

from __future__ import annotations

import json
from typing import Any

from specdecode.serving.api_errors import APIError

ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors"); any other status is an
# invalid request below 500 and an api_error from 500 on.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error"}


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def anthropic_error_json(error: APIError) -> str:
    return json.dumps(anthropic_error_body(error), ensure_ascii=True)  # as APIError.json: no lone surrogate
