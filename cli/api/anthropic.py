"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over quill's
scheduler: a request is read into the chat request the OpenAI route makes, and the events go
out as Anthropic's content blocks and stream events."""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cli.api.server import ApiError

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}


def anthropic_error(error: ApiError) -> dict[str, Any]:
    """An error as Anthropic's API writes one."""
    kind = ERROR_TYPES.get(error.status)  # type: ignore[call-overload]
    if kind is None:
        kind = "api_error" if error.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


class AnthropicApi:
    """PLACEHOLDER: being written."""

    def parse(self, body, engine, limits):
        raise NotImplementedError

    def reply_format(self, body, served, model_name):
        raise NotImplementedError


def count_tokens(body, engine, limits):
    raise NotImplementedError
