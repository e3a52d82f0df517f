"""OpenAI-style API errors: ``APIError(...).body()`` is ``{"error": {"message", "type", "param", "code"}}``,
with helpers for the usual ones and a readable 400 from a pydantic validation error.

Messages never carry internal details (engine addresses, file paths, exception text): those go to the
router's log."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


class APIError(Exception):
    """An error answered to the client as ``status`` with the OpenAI error body."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",  # the OpenAI field name
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return (f"APIError({self.status}, {self.message!r}, type={self.type!r}, code={self.code!r}, "
                f"param={self.param!r})")


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(message, 400, "invalid_request_error", code, param)


def not_found_model(name: str) -> APIError:
    return APIError(
        f"The model `{name}` does not exist.", 404, "invalid_request_error", "model_not_found", "model"
    )


def context_length_exceeded(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int | None = None, param: str | None = None
) -> APIError:
    """400 ``context_length_exceeded``; ``max_tokens=None`` when the prompt alone does not fit."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if max_tokens is None:
        message = (
            f"{head}your prompt is {num_prompt_tokens} tokens long, which leaves no room for the completion. "
            "Please reduce the length of the prompt."
        )
    else:
        message = (
            f"{head}you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt or the completion."
        )
    return APIError(message, 400, "invalid_request_error", "context_length_exceeded", param)


def unauthorized(message: str = "Incorrect API key provided.") -> APIError:
    return APIError(message, 401, "authentication_error", "invalid_api_key")


NO_ENGINE = "No engine instance is available to serve this request; try again later"
ENGINE_LOST = "The engine instance serving this request became unavailable; try again"
ENGINE_ABORTED = "The engine stopped this request before it finished (it is shutting down or restarting); try again"


def unavailable(message: str = NO_ENGINE) -> APIError:
    return APIError(message, 503, "service_unavailable_error", "engine_unavailable")


def too_many_connections(limit: int) -> APIError:
    """503 for a connection past ``--max-connections`` (answered as it opens, then closed)."""
    return APIError(f"This server has reached its limit of {limit} open connections; try again later", 503,
                    "service_unavailable_error", "too_many_connections")


def request_too_large(limit: int) -> APIError:
    return APIError(f"The request body is larger than this server's limit of {limit} bytes", 413,
                    "invalid_request_error", "request_too_large")


def request_timeout(seconds: float) -> APIError:
    return APIError(f"The request body did not arrive within {seconds:g} seconds", 408,
                    "invalid_request_error", "request_timeout")


def client_closed() -> APIError:
    """499 (nginx's "client closed request"): counted in the metrics, never seen by the client."""
    return APIError("client disconnected", 499, "invalid_request_error", "client_closed_request")


def internal_error(error_id: str) -> APIError:
    return APIError(f"Internal server error (id {error_id}; the server's log has the details)", 500,
                    "internal_server_error", "internal_error")


def prompt_too_many_chars(max_model_len: int, num_chars: int, max_token_chars: int, param: str) -> APIError:
    """400 ``context_length_exceeded`` for a text that cannot fit, told by its length before tokenizing."""
    return APIError(
        f"This model's maximum context length is {max_model_len} tokens. However, your {param} is {num_chars} "
        f"characters long and no token covers more than {max_token_chars}, so it cannot fit. "
        "Please reduce the length of the prompt.",
        400, "invalid_request_error", "context_length_exceeded", param,
    )


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error answer (the OpenAPI document's schema for 4xx and 5xx)."""

    error: ErrorInfo


def _loc_part_is_type_tag(part: str) -> bool:
    """pydantic puts union members' names (``str``, ``list[int]``, ``ContentPart``) into error locations."""
    return (
        not part.isidentifier()
        or part in {"str", "int", "float", "bool", "list", "dict", "none"}
        or (part[:1].isupper())
    )


def _format_loc(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _clean_loc(loc: Sequence[int | str]) -> list[int | str]:
    parts = list(loc)
    if parts and parts[0] == "body":  # FastAPI prefixes the body's errors with "body"
        parts = parts[1:]
    return [p for p in parts if not (isinstance(p, str) and _loc_part_is_type_tag(p))]


def validation_error(exc: ValidationError | Sequence[dict[str, Any]]) -> APIError:
    """A 400 naming each bad field and what is wrong with it, e.g. ``temperature: Input should be a
    valid number (got 'hot')``. ``param`` is the first bad field's location (``messages[0].content``).

    Accepts a pydantic ``ValidationError`` or FastAPI's ``RequestValidationError.errors()`` list.
    """
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else list(exc)
    entries: list[tuple[list[int | str], bool, dict[str, Any]]] = []  # (clean loc, had a union tag, error)
    for err in errors:
        raw = list(err.get("loc", ()))
        loc = _clean_loc(raw)
        tagged = len(loc) < len(raw) - (1 if raw[:1] == ["body"] else 0)
        entries.append((loc, tagged, err))
    parts: list[str] = []
    param: str | None = None
    for loc, tagged, err in entries:
        if err.get("type") == "json_invalid":
            parts.append(f"Invalid JSON in the request body: {err.get('msg', '')}")
            continue
        # A union member that did not match at all, while another member matched the container and
        # failed deeper inside (a list with one bad item): only the deeper error is useful.
        if tagged and any(len(other) > len(loc) and other[: len(loc)] == loc for other, _, _ in entries):
            continue
        where = _format_loc(loc)
        if param is None and where:
            param = where
        msg = str(err.get("msg", "invalid value"))
        if err.get("type") != "missing" and "input" in err:
            shown = repr(err["input"])
            if len(shown) <= 40 and not isinstance(err["input"], dict):
                msg += f" (got {shown})"
        line = f"{where}: {msg}" if where else f"Request body: {msg}"
        if line not in parts:
            parts.append(line)
    if not parts:
        parts.append("Invalid request")
    shown_parts = parts[:5] + ([f"... and {len(parts) - 5} more"] if len(parts) > 5 else [])
    return APIError("; ".join(shown_parts), 400, "invalid_request_error", "invalid_value", param)


