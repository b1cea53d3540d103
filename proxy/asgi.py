"""Raw ASGI plumbing for the hot routes: body reading, error answers, disconnect watching.

The completion routes are raw ASGI callables rather than FastAPI endpoints: raw ASGI needs
no Request/StreamingResponse objects nor the task group StreamingResponse starts per
request, measured at ~30% less proxy CPU per request (see app.fast_path()).

What bodies may cost (Bodies): one budget for the bytes every request body holds, from its
first byte to the end of its request (read, parsed, queued for an instance, relayed), counted
at about twice its size (its bytes and what parsing makes of them) and, past SCAN_FROM bytes,
40 bytes more per JSON value and 100 per array or object; a body past it is refused with 503.
And what one body may cost the event loop: a body large enough to hold more JSON values (or
arrays and objects) than the bounds is counted before it is parsed (commas and brackets, at
memchr speed, then without its strings if that count is over) and refused with 413: parsing
is one call that holds the interpreter (orjson: no thread would help), so its cost is bounded
by what it is given.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.errors import ProxyError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_CT = b"application/json"


class ClientGone(Exception):
    """The client disconnected before its request was read."""


@dataclass(slots=True, eq=False)  # hashable: D keeps the ones it relays (Instance.relaying)
class Flight:
    """Per-request response state, shared with the disconnect watcher."""

    task: asyncio.Task | None
    # Response headers to add: timings, the path, chosen instances (when exposed).
    extra: Headers = field(default_factory=list)
    started: bool = False  # response headers sent: errors can only go in-band now
    # Set before the last send: from then on uvicorn's receive() returns http.disconnect
    # because the response is complete, which must not read as the client leaving.
    done: bool = False
    disconnected: bool = False

    def client_left(self) -> None:
        """The client's connection closed: cancel its request, unless its answer is all sent."""
        if not self.done:
            self.disconnected = True
            if self.task is not None:
                self.task.cancel()


def ms(seconds: float) -> bytes:
    return b"%.2f" % (seconds * 1000.0)


# A JSON string, escapes and all (unrolled: linear in its length).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
VALUE_BYTES, CONTAINER_BYTES = 40, 100  # what a parsed value (an int and its slot), an array or object cost


def json_shape(raw: bytes) -> tuple[int, int]:
    """(values, arrays and objects) of a JSON text, counted from its bytes: at least as many as
    it holds (commas and brackets inside strings count too)."""
    return raw.count(b",") + 1, raw.count(b"[") + raw.count(b"{")


class Bodies:
    """The budget of bytes the proxy's request bodies hold, and the bounds of one body's
    structure (see the module docstring). One per server; the event loop's alone."""

    __slots__ = ("limit", "held", "max_values", "max_containers", "scan_from")

    def __init__(self, limit: int, max_values: int, max_containers: int) -> None:
        self.limit = limit
        self.held = 0
        self.max_values = max_values
        self.max_containers = max_containers
        # A smaller body cannot break either bound: every value or bracket takes two bytes.
        self.scan_from = 2 * min(max_values, max_containers)

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            raise ProxyError(503, f"the proxy holds its maximum of {self.limit} bytes of request bodies "
                             "(--max-held-body-bytes); retry later", "too_many_request_bytes",
                             headers={"retry-after": "1"})  # fmt: skip
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n

    def cost(self, raw: bytes) -> int:
        """What parsing `raw` makes beyond its bytes (0 under scan_from); ProxyError 413 when
        it holds more values or arrays and objects than the bounds."""
        if len(raw) <= self.scan_from:
            return 0
        values, containers = json_shape(raw)
        if values > self.max_values or containers > self.max_containers:
            values, containers = json_shape(_STRING.sub(b'""', raw))  # strings' commas do not count
            if values > self.max_values:
                raise ProxyError(413, f"request body holds {values} JSON values, over the proxy's limit of "
                                 f"{self.max_values} (--max-body-values)", "request_too_large")
            if containers > self.max_containers:
                raise ProxyError(413, f"request body holds {containers} JSON arrays and objects, over the proxy's "
                                 f"limit of {self.max_containers} (--max-body-containers)", "request_too_large")
        return VALUE_BYTES * values + CONTAINER_BYTES * containers


def _give(bodies: Bodies, n: int, _task: Any) -> None:
    bodies.give(n)


async def read_body(receive: Receive, length: bytes | None, limit: int, bodies: Bodies | None = None) -> bytes:
    """The whole request body, refused with 413 beyond `limit` bytes; with `bodies`, within
    its budget (503 past it) and bounds (413), and counted in it until the request's task ends."""
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise ProxyError(400, "invalid Content-Length", "invalid_body") from None
        if declared > limit:
            raise ProxyError(413, f"request body exceeds {limit} bytes", "request_too_large")
    parts: list[bytes] = []
    total = 0
    held = 0
    try:
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise ClientGone()
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                raise ProxyError(413, f"request body exceeds {limit} bytes", "request_too_large")
            if bodies is not None:
                bodies.take(2 * len(chunk))  # its bytes, and about as much parsed
                held += 2 * len(chunk)
            if not message.get("more_body", False):
                if parts:
                    parts.append(chunk)
                    chunk = b"".join(parts)
                break
            parts.append(chunk)
        if bodies is not None:
            extra = bodies.cost(chunk)
            if extra:
                bodies.take(extra)
                held += extra
            task = asyncio.current_task()
            if task is not None and held:  # held while the request lasts (queued, relayed...)
                task.add_done_callback(functools.partial(_give, bodies, held))
                held = 0
        return chunk
    finally:
        if held:  # refused, the client gone, or no task to hold it for
            bodies.give(held)  # type: ignore[union-attr]


async def send_error(send: Send, err: ProxyError, extra: Headers) -> None:
    payload = err.raw if err.raw is not None else err.body()
    hdrs = [(b"content-type", JSON_CT), (b"content-length", b"%d" % len(payload))]
    hdrs.extend(extra)
    for k, v in err.headers.items():
        hdrs.append((k.encode("latin-1"), v.encode("latin-1")))
    await send({"type": "http.response.start", "status": err.status, "headers": hdrs})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


async def watch_disconnect(receive: Receive, flight: Flight) -> None:
    """Cancel the request's task when the client leaves.

    After the body, uvicorn's receive() returns only when the client disconnects or the
    response is complete; only the former must cancel the request."""
    try:
        message = await receive()
    except Exception:
        return
    if message.get("type") == "http.disconnect":
        flight.client_left()
