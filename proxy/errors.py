"""OpenAI-style error JSON: every failure the proxy answers has this shape, never HTML."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any


class ConfigError(ValueError):
    """A configuration value that is missing, of the wrong type or out of range (raised by
    proxy/config.py and proxy/membership/static.py; here so that static need not import config)."""


# HTTP status -> OpenAI error "type".
_TYPES = MappingProxyType(
    {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
        422: "invalid_request_error",
        429: "rate_limit_error",
        502: "upstream_error",
        503: "service_unavailable",
        504: "timeout_error",
    }
)


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_dict(
    message: str, status: int, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_body(
    message: str, status: int, code: str | int | None = None, param: str | None = None
) -> bytes:
    return json.dumps(error_dict(message, status, code, param)).encode()


class ProxyError(Exception):
    """Raised inside the request path; turned into an OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | int | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        # A ready-made OpenAI error body (relayed from an instance), sent instead of body().
        self.raw = raw

    def body(self) -> bytes:
        return error_body(self.message, self.status, self.code, self.param)


def is_openai_error(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("error"), dict)
        and isinstance(data["error"].get("message"), str)
    )


def upstream_error_body(status: int, body: bytes, phase: str, instance: str | None) -> bytes:
    """Relay an instance's error: as is when it is OpenAI error JSON, else wrapped in one
    (naming the instance only when `instance` is given: see instance_text)."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None
    if is_openai_error(data):
        return body
    if isinstance(data, dict) and data.get("object") == "error" and "message" in data:
        # vLLM's older flat ErrorResponse: lift it into {"error": {...}}.
        return json.dumps(
            {
                "error": {
                    "message": str(data.get("message")),
                    "type": data.get("type") or error_type(status),
                    "param": data.get("param"),
                    "code": data.get("code", status),
                }
            }
        ).encode()
    if isinstance(data, dict) and isinstance(data.get("detail"), (str, list)):
        text = json.dumps(data["detail"]) if isinstance(data["detail"], list) else data["detail"]
    else:
        text = body[:1000].decode("utf-8", "replace").strip()
    message = f"{instance_text(phase, instance, instance is not None)} answered HTTP {status}"
    if text:
        message += f": {text}"
    return error_body(message, status, code=f"{phase}_error")


def sse_error_event(message: str, status: int, code: str) -> bytes:
    """A mid-stream failure: one SSE data event carrying OpenAI error JSON."""
    return b"data: " + error_body(message, status, code) + b"\n\n"


def sse_event_of(error: ProxyError) -> bytes:
    """``error`` as one SSE data event, for a failure after the response's status went out:
    the instance's own error JSON when it is relayed (re-written on one line, as an event
    needs), else ours."""
    if error.raw is not None:
        try:
            return b"data: " + json.dumps(json.loads(error.raw), separators=(",", ":")).encode() + b"\n\n"
        except ValueError:
            pass
    return b"data: " + error.body() + b"\n\n"


# Client-visible words for UpstreamError kinds: the errors' own text names addresses.
_KIND_TEXT = MappingProxyType(
    {
        "connect": "connection refused or unreachable",
        "connect_timeout": "connect timed out",
        "disconnect": "connection dropped",
        "protocol": "invalid HTTP response",
    }
)


def instance_text(role: str, address: str | None, expose: bool) -> str:
    """"decode instance 10.0.0.7:8200" with --expose-routing-headers, else "decode instance":
    clients are not told the topology (logs and metrics still are)."""
    return f"{role} instance {address}" if expose and address else f"{role} instance"


def upstream_text(kind: str, message: str, expose: bool) -> str:
    """An upstream failure as the client reads it: the full text only when exposing."""
    return message if expose else _KIND_TEXT.get(kind, kind.replace("_", " "))
