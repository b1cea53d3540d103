"""What of a client's request may reach P and D: the headers vLLM reads (nothing else of the
client's goes upstream: cookies, forwarding chains, x-xpyd-* names stay here), and the
request's ``kv_transfer_params`` without the fields only the proxy may set (a client may not
steer its own KV plan: ``xpyd_skip_tokens``, ``xpyd_prefill_prompt_tokens``, and any other
``xpyd_*`` field but the ones a client may ask with, xpyd_wire.kv_transfer.CLIENT_PARAMS),
stripped once here so every path to P and D gets the same body."""

from __future__ import annotations

import json
from typing import Any

import orjson

from proxy.asgi import Headers
from xpyd_wire.kv_transfer import CLIENT_PARAMS, DEBUG_PARAM_PREFIX, PARAM_PREFIX

# The request headers vLLM 0.32's OpenAI server reads, besides the ones the proxy sets itself
# (content-type, x-request-id, and authorization by proxy/credentials.py's rules): trace context,
# a data-parallel rank, a session id, a priority, the load-metrics format of its answer.
FORWARDED = frozenset({b"traceparent", b"tracestate", b"x-data-parallel-rank", b"x-session-id",
                       b"x-vllm-priority", b"endpoint-load-metrics-format"})  # fmt: skip
PARAMS = "kv_transfer_params"


def forwarded(client_auth: bool) -> frozenset[bytes]:
    """The client headers that go upstream; Authorization only with --forward-client-auth."""
    return FORWARDED | {b"authorization"} if client_auth else FORWARDED


def upstream_headers(headers: Headers, allow: frozenset[bytes], base: dict[str, str]
                     ) -> tuple[dict[str, str], bytes | None]:  # fmt: skip
    """(`base` plus the client's headers in `allow`, the client's Content-Length)."""
    fwd = base.copy()
    length: bytes | None = None
    for k, v in headers:
        if k in allow:
            fwd[k.decode("latin-1")] = v.decode("latin-1")
        elif k == b"content-length":
            length = v
    return fwd, length


def _owned(params: dict, keep_debug: bool) -> list[str]:
    return [k for k in params if isinstance(k, str) and k.startswith(PARAM_PREFIX) and k not in CLIENT_PARAMS
            and not (keep_debug and k.startswith(DEBUG_PARAM_PREFIX))]  # fmt: skip


def strip_proxy_params(body: Any, keep_debug: bool = False) -> bool:
    """Drop the proxy's own fields from the client's kv_transfer_params, in place; whether
    any was there. `keep_debug` (--forward-debug-params, a test hook) keeps xpyd_debug_*."""
    params = body.get(PARAMS) if isinstance(body, dict) else None
    if not params or type(params) is not dict:
        return False
    owned = _owned(params, keep_debug)
    if not owned:
        return False
    body[PARAMS] = {k: v for k, v in params.items() if k not in owned}
    return True


def cleaned(raw: bytes, body: dict, keep_debug: bool = False) -> bytes:
    """The bytes D gets for a parsed body: `raw` itself, or the body written anew when it
    carried a field of the proxy's."""
    return orjson.dumps(body) if strip_proxy_params(body, keep_debug) else raw


def cleaned_unparsed(raw: bytes, keep_debug: bool = False) -> bytes:
    """The same for a body orjson did not read (vLLM's parser, the standard library's json,
    may: NaN, for one). Only a body that can name kv_transfer_params (spelled out, or with
    an escape) is read again; one nobody can read goes as it came."""
    if PARAMS.encode() not in raw and b"\\u" not in raw:
        return raw
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw
    return json.dumps(body).encode() if strip_proxy_params(body, keep_debug) else raw
