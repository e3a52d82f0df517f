"""Server-sent events of a streamed completion: decoding the events, their JSON chunks, and the errors
a server sends (in a stream or as an error response)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

DONE = "[DONE]"


class StreamError(RuntimeError):
    """The server sent an error inside a stream, or the stream was malformed."""


class SSEDecoder:
    """Incremental server-sent-events decoder: feed lines (without the newline), get each event's data."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Take one line; return the event's data when this (blank) line ends an event that had data."""
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):  # comment / keep-alive
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event's data (a stream that ends without a blank line), or None."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_sse_lines(lines: Iterable[str]) -> tuple[list[dict[str, Any]], bool]:
    """Decode a complete completion stream: its JSON chunks before ``[DONE]``, and whether ``[DONE]`` came.

    Raises StreamError for a chunk that is not JSON or that carries an ``error`` object.
    """
    decoder, chunks = SSEDecoder(), []
    for data in [*(decoder.feed(line) for line in lines), decoder.flush()]:
        if data is None:
            continue
        if data.strip() == DONE:
            return chunks, True
        chunks.append(decode_chunk(data))
    return chunks, False


def decode_chunk(data: str) -> dict[str, Any]:
    """Parse one event's JSON data; raise StreamError for bad JSON or an error payload."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamError(f"bad JSON in the stream: {data[:200]!r}") from e
    if not isinstance(chunk, dict):
        raise StreamError(f"unexpected stream event: {data[:200]!r}")
    if chunk.get("error"):
        raise StreamError(f"error in the stream: {_error_text(chunk)}")
    return chunk


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            msg = err.get("message") or json.dumps(err)
            kind = err.get("type")
            return f"{msg} ({kind})" if kind else str(msg)
        if err is not None:
            return str(err) if not isinstance(err, list) else json.dumps(err)
    return json.dumps(body)[:300]


def error_message(status: int, body: bytes | str) -> str:
    """``HTTP <status>: <message>`` from an error response (OpenAI ``{"error": {...}}``, FastAPI, or text)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        msg = _error_text(json.loads(text))
    except json.JSONDecodeError:
        msg = text.strip()[:300] or "(empty body)"
    return f"HTTP {status}: {msg}"
