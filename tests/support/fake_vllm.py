"""A fake vLLM instance: the test double for the other side of the proxy.

A real HTTP/1.1 server on loopback (asyncio + httptools, no framework, so it is cheap
enough to be the benchmark's backend too) that registers over real ZMQ with
xpyd_wire.discovery.encode, answers /v1/completions and /v1/chat/completions in vLLM's exact
shapes (stream and not), /v1/models and /health, records every request, and can be told
to fail: a status, a delay, a hang, a broken or stalled stream, a stream's error event.

In-process:  fake = FakeVLLM("P", proxy="127.0.0.1:5555"); await fake.start() ... await fake.stop()
Subprocess:  python -m tests.support.fake_vllm --role D --port 8200 --proxy 127.0.0.1:5555
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httptools
import pydantic
import zmq
import zmq.asyncio

from tests.support import fake_apis, fake_lora
from xpyd_wire.discovery import GenerationDefaults, Load, OutputLimits, Registration, encode
from xpyd_wire.kv_events import EventsEndpoint

# How vLLM's request models read a bool field (pydantic in lax mode: 1, "yes", "TRUE" are true).
_LAX_BOOL = pydantic.TypeAdapter(bool | None)


@dataclass
class Fault:
    """What to do wrong. Applies to the next `times` matching requests (None: all)."""

    status: int | None = None  # answer this HTTP status with error_body
    error_body: bytes | None = None  # default: vLLM's error JSON
    content_type: str = "application/json"
    delay: float = 0.0  # before the response headers
    gate: asyncio.Event | None = None  # before the delay: wait until the test sets it
    hang: bool = False  # never answer (until the client goes away)
    fail_after: int | None = None  # stream: drop the connection after N data events
    stall_after: int | None = None  # stream: send N events then nothing more
    token_delay: float | None = None  # stream: seconds between events
    # stream: vLLM's error event with this code (500: its failed KV load under
    # kv_load_failure_policy=fail) inside the 200, after `stream_error_after` token events
    # (chat: and after the role chunk, as vLLM does), then [DONE].
    stream_error: int | None = None
    stream_error_after: int = 0
    # stream: the body's end (its last chunk) waits for this event after [DONE], as when
    # vLLM writes it apart and a client that read [DONE] has closed in between.
    hold_end: asyncio.Event | None = None
    times: int | None = None
    paths: tuple[str, ...] = ()  # only these paths (empty: all)
    # Only requests whose X-Request-Id starts with this (DISAGGREGATED_ID: a P/D transfer,
    # as when D's KV load fails; "xpyd-local-": D alone). None: any request.
    id_prefix: str | None = None


# What a fake advertises unless told otherwise: what the connector advertises of a vLLM with
# --max-model-len FAKE_CONTEXT, a generation config that sets nothing and no reasoning parser.
FAKE_CONTEXT = 8192
ADVERTISED_LIMITS = OutputLimits(context=FAKE_CONTEXT)
ADVERTISED_GENERATION = GenerationDefaults()
# vLLM 0.32's system_fingerprint (a hash of the server's config; the fake's is fixed).
FINGERPRINT = "vllm-0.32.0-0f0f0f0f"

DISAGGREGATED_ID = "___prefill_addr_"  # how xpyd_wire.request_id.build() ids begin

# vLLM 0.32's (message, type) per code of a stream's error event (GenerationError: 500,
# RetryableRequestError: 503, a request error: 400).
_STREAM_ERRORS = {
    500: ("Internal server error", "InternalServerError"),
    503: ("Request failed; please retry", "ServiceUnavailableError"),
    400: ("This model's maximum context length is 2048 tokens.", "BadRequestError"),
}


def stream_error_event(code: int) -> bytes:
    """The SSE event vLLM's stream generators yield for an error, byte for byte: json.dumps
    of its ErrorResponse (message, type, param, code)."""
    message, kind = _STREAM_ERRORS.get(code, ("error", "InternalServerError"))
    error = {"message": message, "type": kind, "param": None, "code": code}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any
    received_at: float
    cancelled: bool = False  # the client went away before the answer was complete
    completed: bool = False
    status: int | None = None
    sent: bytearray = field(default_factory=bytearray)  # response body bytes, unframed
    fault_closed: bool = False  # we dropped the connection on purpose (fail_after)

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")


@dataclass
class _Request:
    method: str = ""
    url: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    keep_alive: bool = True


FIRST_TOKEN_ID = 900  # the fake's i-th generated token has id FIRST_TOKEN_ID + i


def prompt_token_ids(prompt: Any) -> list[int]:
    """The fake's tokenizer: a text prompt is one id per character; token ids are themselves."""
    if isinstance(prompt, str):
        return list(_text_ids(prompt))
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return list(prompt)
    return []


@functools.lru_cache(maxsize=64)
def _text_ids(text: str) -> tuple[int, ...]:
    """Remembered: a benchmark sends one prompt again and again, and tokenizing a 4k-character one
    in Python twice a request (ids and usage) took 2 x ~0.36 ms of the cores the proxy measured
    beside it shares (scripts/bench_proxy.py, issue 49); a vLLM tokenizes in its own process."""
    return tuple(ord(c) % 800 for c in text)


def prompt_tokens(chat: bool, body: dict) -> int:
    """The prompt's length in the fake's usage, as vLLM counts it (a batch, which the fake
    does not tokenize: 5)."""
    ids = chat_prompt_token_ids(body.get("messages")) if chat else prompt_token_ids(body.get("prompt"))
    return len(ids) or 5


def chat_prompt_token_ids(messages: Any) -> list[int]:
    """The fake's chat template: each message as "<role>: content\n", tokenized as text."""
    text = "".join(f"<{m.get('role')}>: {m.get('content')}\n" for m in messages or () if isinstance(m, dict))
    return prompt_token_ids(text)


def generated_before(body: dict) -> int:
    """How many of this fake's own tokens the prompt ends with (ids >= FIRST_TOKEN_ID: a
    continuation of an earlier answer, as the proxy's first-token mode sends D): the answer
    goes on from there, as a model would, instead of starting again at t0."""
    ids = body.get("prompt")
    if not (isinstance(ids, list) and ids and type(ids[0]) is int):
        return 0
    k = 0
    for t in reversed(ids):
        if not isinstance(t, int) or t < FIRST_TOKEN_ID:
            break
        k += 1
    return k


def _refusal(chat: bool, body: dict) -> dict | None:
    """vLLM 0.32's 400 for a few requests it refuses (its messages; a fake checks only these)."""
    if chat and not isinstance(body.get("messages"), list):
        return {"message": "1 validation error: body.messages Field required", "type": "Bad Request",
                "param": "body.messages", "code": 400}
    if not chat and not body.get("prompt"):
        return {"message": "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                "type": "BadRequestError", "param": "prompt", "code": 400}
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value < (0 if body.get("echo") is True else 1):  # echo scores a prompt
            return {"message": f"max_tokens must be at least 1, got {value}. (parameter=max_tokens, value={value})",
                    "type": "BadRequestError", "param": "max_tokens", "code": 400}
    return None


# Routes the fake answers beyond completions and chat (tests/support/fake_apis.py), by method.
_OTHER_POST = frozenset({"/v1/responses", "/v1/messages", "/inference/v1/generate", "/tokenize", "/detokenize",
                         "/v1/messages/count_tokens", "/v1/embeddings"})  # fmt: skip


def _serves(method: str, path: str) -> bool:
    if method == "GET":
        return path == "/version" or (path.startswith("/v1/responses/") and path.count("/") == 3)
    if method == "POST" and path.startswith("/v1/responses/") and path.endswith("/cancel"):
        return path.count("/") == 4
    return method == "POST" and path in _OTHER_POST


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Conn(asyncio.Protocol):
    def __init__(self, fake: FakeVLLM) -> None:
        self.fake = fake
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.req: _Request | None = None
        self.queue: list[_Request] = []
        self.task: asyncio.Task | None = None
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.fake._conns.add(self)
        self.fake.accepted += 1

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.fake._conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.req = _Request()

    def on_url(self, url: bytes) -> None:
        self.req.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.req.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.req.body.append(body)

    def on_message_complete(self) -> None:
        req = self.req
        req.method = self.parser.get_method().decode()
        req.keep_alive = self.parser.should_keep_alive()
        self.queue.append(req)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._serve_queue())

    async def _serve_queue(self) -> None:
        while self.queue and not self.closed:
            req = self.queue.pop(0)
            await self.fake._handle(self, req)
            if not req.keep_alive and not self.closed:
                self.transport.close()
                return

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)


class FakeVLLM:
    def __init__(
        self,
        role: str,
        proxy: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        zmq_address: str | None = None,
        model: str = "fake-model",
        heartbeat_interval: float = 0.2,
        secret: str | None = None,
        load: Load | None = None,
        token_delay: float = 0.0,
        record: bool = True,
        register: bool = True,
        api_key: str | None = None,
        kv_events: EventsEndpoint | None = None,
        output_limits: OutputLimits | None = ADVERTISED_LIMITS,
        generation: GenerationDefaults | None = ADVERTISED_GENERATION,
    ) -> None:
        self.role = role
        self.output_limits = output_limits  # None: not advertised (a connector that cannot tell)
        self.generation = generation
        # Advertised in the registration like the connector advertises vLLM's publisher.
        self.kv_events = kv_events
        self.proxy = proxy
        self.host = host
        self.port = port
        self._zmq_address = zmq_address
        self.model = model
        self.heartbeat_interval = heartbeat_interval
        self.secret = secret
        self.load = load
        self.token_delay = token_delay
        self.record = record
        self.register_enabled = register
        # Like vLLM's --api-key: every /v1/ route wants "Authorization: Bearer KEY" (401 else).
        self.api_key = api_key
        self.fault: Fault | None = None
        self.chat_reasoning: str | None = None  # a chat answer's reasoning_content (a reasoning parser's)
        # The text of a whole (non-streamed) answer, instead of " t0 t1 ...": "" is what vLLM
        # answers for a one-token answer whose token is part of a character (it holds it back).
        self.first_text: str | None = None
        self.role_name = "assistant"  # a chat answer's role (vLLM's --response-role)
        # vLLM's --enable-prompt-tokens-details: the (cached, created) prompt-cache figures it reports
        # in usage.prompt_tokens_details (chat alone reports created); None: off, null there.
        self.prompt_details: tuple[int, int] | None = None
        # Status /health and /v1/models answer with (tests flip these: unhealthy, no models).
        self.health_status = 200
        self.models_status = 200
        # Responses the fake stored (Responses API, store on), by id: their whole answers.
        self.stored: dict[str, bytes] = {}
        # LoRA adapters loaded (name -> path; tests/support/fake_lora.py serves the routes,
        # as vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING; lora_routes False: 404, as without).
        self.adapters: dict[str, str] = {}
        self.lora_routes = True
        self.models_delay = 0.0  # seconds /v1/models takes to answer
        self.requests: list[Recorded] = []
        self.served = 0
        self.accepted = 0  # TCP connections accepted
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._hb_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def http_address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def zmq_address(self) -> str:
        # The connector's KV address in real life; any distinct host:port here.
        return self._zmq_address or f"{self.host}:{(self.port + 10000) % 65536 or 1}"

    @zmq_address.setter
    def zmq_address(self, value: str) -> None:
        self._zmq_address = value

    async def start(self) -> FakeVLLM:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Conn(self), self.host, self.port, backlog=1024, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        if self.proxy and self.register_enabled:
            self.start_heartbeats()
        return self

    def start_heartbeats(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(f"tcp://{self.proxy}")
        if self._hb_task is None or self._hb_task.done():
            self._hb_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    def stop_heartbeats(self) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
            self._hb_task = None

    async def stop(self, leave: bool = False) -> None:
        self.stop_heartbeats()
        if leave:
            await self.send_registration(leave=True)
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = self._ctx = None
        if self._server is not None:
            self._server.close()
            for conn in list(self._conns):
                conn.transport.close()
            await self._server.wait_closed()
            self._server = None

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self.send_registration()
            except zmq.ZMQError:
                pass
            await asyncio.sleep(self.heartbeat_interval)

    def registration(self, leave: bool = False) -> Registration:
        return Registration(
            role=self.role,
            http_address=self.http_address,
            zmq_address=self.zmq_address,
            load=self.load,
            leave=leave,
            kv_events=self.kv_events,
            output_limits=self.output_limits,
            generation=self.generation,
        )

    async def send_registration(self, leave: bool = False) -> None:
        await self.send_raw(encode(self.registration(leave), self.secret))

    async def send_raw(self, payload: bytes | list[bytes]) -> None:
        """Send any bytes to the proxy's discovery socket (for malformed-message tests)."""
        if self._sock is None:
            self.start_heartbeats() if self.register_enabled else None
        if self._sock is None:  # registration disabled: a socket just for this
            self._ctx = zmq.asyncio.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(f"tcp://{self.proxy}")
        frames = payload if isinstance(payload, list) else [payload]
        await self._sock.send_multipart(frames)

    # ------------------------------------------------------------------ queries for tests

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    def completions(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.startswith("/v1/") and r.method == "POST"]

    # ------------------------------------------------------------------ HTTP handling

    def _take_fault(self, path: str, request_id: str) -> Fault | None:
        fault = self.fault
        if fault is None or (fault.paths and path not in fault.paths):
            return None
        # A transfer's id may carry the proxy's early mark (D asked before P answered) in front.
        if fault.id_prefix is not None and not request_id.removeprefix("xpyd-early").startswith(fault.id_prefix):
            return None
        if fault.times is not None:
            if fault.times <= 0:
                return None
            fault.times -= 1
        return fault

    async def _handle(self, conn: _Conn, req: _Request) -> None:
        path = req.url.decode().split("?", 1)[0]
        body = b"".join(req.body)
        parsed: Any = None
        if body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
        rec = Recorded(req.method, path, req.headers, body, parsed, time.monotonic())
        if self.record:
            self.requests.append(rec)
        try:
            await self._respond(conn, req, path, parsed, rec)
        except asyncio.CancelledError:
            rec.cancelled = True
            return
        if rec.fault_closed:
            return
        if conn.closed:
            rec.cancelled = True
        else:
            rec.completed = True
        self.served += 1

    def _head(self, status: int, content_type: str, length: int | None, keep_alive: bool) -> bytes:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error",
                  503: "Service Unavailable"}
        lines = [
            b"HTTP/1.1 %d %s" % (status, reason.get(status, "Status").encode()),
            b"server: fake-vllm",
        ]
        if content_type:  # vLLM's plain-text answers (LoRA's success) carry none
            lines.append(b"content-type: " + content_type.encode())
        if length is None:
            lines.append(b"transfer-encoding: chunked")
        else:
            lines.append(b"content-length: %d" % length)
        if not keep_alive:
            lines.append(b"connection: close")
        return b"\r\n".join(lines) + b"\r\n\r\n"

    def _send_json(
        self,
        conn: _Conn,
        req: _Request,
        rec: Recorded,
        status: int,
        payload: bytes,
        content_type: str = "application/json",
    ) -> None:
        rec.status = status
        if self.record:
            rec.sent += payload
        conn.write(self._head(status, content_type, len(payload), req.keep_alive) + payload)

    async def _respond(
        self, conn: _Conn, req: _Request, path: str, body: Any, rec: Recorded
    ) -> None:
        if req.method == "GET" and path == "/health":
            return self._send_json(conn, req, rec, self.health_status, b"")
        if self.api_key is not None and path.startswith("/v1/"):
            if req.headers.get("authorization") != "Bearer " + self.api_key:
                return self._send_json(conn, req, rec, 401, b'{"error":"Unauthorized"}')
        if req.method == "GET" and path == "/v1/models" and self.models_status != 200:
            return self._send_json(conn, req, rec, self.models_status, b'{"detail":"nope"}')
        if req.method == "GET" and path == "/v1/models":
            await asyncio.sleep(self.models_delay)
            data = {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "vllm",
                        "root": self.model,
                        "parent": None,
                        "max_model_len": 2048,
                    }
                ] + [fake_lora.adapter_card(name, where, self.model) for name, where in self.adapters.items()],
            }
            return self._send_json(conn, req, rec, 200, json.dumps(data).encode())
        if req.method == "POST" and path in (fake_lora.LOAD, fake_lora.UNLOAD) and self.lora_routes:
            fault = self._take_fault(path, "")
            if fault is not None and (fault.delay or fault.hang):
                await asyncio.sleep(3600 if fault.hang else fault.delay)
            if fault is not None and fault.status is not None:
                return self._send_json(conn, req, rec, fault.status, fault.error_body or b'{"detail":"fake"}')
            status, payload, ctype = fake_lora.answer(self.adapters, self.model, path,
                                                      req.headers.get("content-type", ""), body)
            return self._send_json(conn, req, rec, status, payload, ctype)
        completion = req.method == "POST" and path in ("/v1/completions", "/v1/chat/completions")
        if not completion and not _serves(req.method, path):
            return self._send_json(conn, req, rec, 404, b'{"detail":"Not Found"}')
        fault = self._take_fault(path, req.headers.get("x-request-id", ""))
        if fault is not None:
            if fault.gate is not None:
                await fault.gate.wait()
            if fault.delay:
                await asyncio.sleep(fault.delay)
            if fault.hang:
                await asyncio.sleep(3600)
            if fault.status is not None:
                payload = fault.error_body
                if payload is None:
                    payload = json.dumps(
                        {
                            "error": {
                                "message": f"fake {self.role} failure",
                                "type": "BadRequestError",
                                "param": None,
                                "code": fault.status,
                            }
                        }
                    ).encode()
                # "{request_id}" in a given body: quote the X-Request-Id (vLLM's messages may).
                payload = payload.replace(b"{request_id}", req.headers.get("x-request-id", "").encode())
                return self._send_json(conn, req, rec, fault.status, payload, fault.content_type)
        if not completion:
            return await self._other_route(conn, req, rec, path, body, fault)
        if not isinstance(body, dict):  # vLLM's request model refuses it (pydantic's 400)
            error = {"message": "1 validation error: body is not a JSON object", "type": "Bad Request",
                     "param": "body", "code": 400}
            return self._send_json(conn, req, rec, 400, json.dumps({"error": error}).encode())
        if body.get("model") is not None and body.get("model") not in (self.model, *self.adapters):
            error = {"message": f"The model `{body.get('model')}` does not exist. Valid aliases: {self.model}.",
                     "type": "NotFoundError", "param": "model", "code": 404}
            return self._send_json(conn, req, rec, 404, json.dumps({"error": error}).encode())
        chat = path == "/v1/chat/completions"
        if (refusal := _refusal(chat, body)) is not None:
            return self._send_json(conn, req, rec, 400, json.dumps({"error": refusal}).encode())
        n_tokens = body.get("max_completion_tokens") if chat else None
        n_tokens = n_tokens or body.get("max_tokens") or 16
        n_tokens = max(1, min(int(n_tokens), 4096))
        rid = req.headers.get("x-request-id") or uuid.uuid4().hex
        if body.get("stream"):
            rec.status = 200
            await self._stream(conn, req, rec, chat, rid, n_tokens, body, fault)
        else:
            self._send_json(conn, req, rec, 200, self._full(chat, rid, n_tokens, body))

    async def _other_route(self, conn: _Conn, req: _Request, rec: Recorded, path: str, body: Any,
                           fault: Fault | None) -> None:  # fmt: skip
        """The routes beyond completions and chat (tests/support/fake_apis.py)."""
        if req.method == "GET" and path == "/version":
            return self._send_json(conn, req, rec, 200, b'{"version":"0.32.0"}')
        if path.startswith("/v1/responses/"):
            answer = fake_apis.stored_response(req.method, path, self.stored)
            return self._send_json(conn, req, rec, answer.status, answer.body)
        if not isinstance(body, dict):
            error = {"message": "1 validation error: body is not a JSON object", "type": "Bad Request",
                     "param": "body", "code": 400}
            return self._send_json(conn, req, rec, 400, json.dumps({"error": error}).encode())
        if body.get("model") is not None and body.get("model") != self.model:
            error = {"message": f"The model `{body.get('model')}` does not exist.",
                     "type": "NotFoundError", "param": "model", "code": 404}
            return self._send_json(conn, req, rec, 404, json.dumps({"error": error}).encode())
        rid = req.headers.get("x-request-id", "")
        limit = body.get("max_output_tokens") if path == "/v1/responses" else body.get("max_tokens")
        n = max(1, min(int(limit), 4096)) if isinstance(limit, int) and limit > 0 else 16
        answer = {
            "/v1/responses": lambda: fake_apis.responses(body, self.model, n, self.stored, self.role == "D"),
            "/v1/messages": lambda: fake_apis.messages(body, self.model, n, rid),
            "/inference/v1/generate": lambda: fake_apis.generate(body, self.model, rid),
            "/tokenize": lambda: fake_apis.tokenize(body),
            "/detokenize": lambda: fake_apis.detokenize(body),
            "/v1/messages/count_tokens": lambda: fake_apis.count_tokens(body),
            "/v1/embeddings": lambda: fake_apis.embeddings(body, self.model),
        }[path]()
        if not answer.streaming:
            return self._send_json(conn, req, rec, answer.status, answer.body)
        events = answer.events
        if fault is not None and fault.stream_error is not None:
            # vLLM 0.32 after a failed KV load: Anthropic's error event after the message's
            # two opening events; a Responses stream breaks off after its lead (vLLM cannot
            # turn the error into one of its event types), as fail_after does.
            after = fault.stream_error_after
            if path == "/v1/messages":
                events = events[: 2 + after] + [fake_apis.MESSAGES_ERROR_EVENT]
            elif path == "/v1/responses":
                fault = dataclasses.replace(fault, fail_after=4 + after)
            else:  # generate: as completions
                events = events[:after] + [stream_error_event(fault.stream_error), b"data: [DONE]\n\n"]
        rec.status = 200
        await self._write_events(conn, req, rec, events, fault)

    def _full(self, chat: bool, rid: str, n: int, body: dict) -> bytes:
        """A whole answer, field for field as vLLM 0.32 writes it (checked against the real
        server by tests/e2e/test_e2e_fidelity.py)."""
        start = generated_before(body)
        text = "".join(f" t{start + i}" for i in range(n)) if self.first_text is None else self.first_text
        prompt = prompt_tokens(chat, body)
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n,
                 "prompt_tokens_details": None, "completion_tokens_details": None}
        if self.prompt_details is not None:  # as vLLM 0.32 writes them whole
            cached, created = self.prompt_details
            usage["prompt_tokens_details"] = {"cached_tokens": cached, "created_cache_tokens": created if chat else None,
                                              "multimodal_tokens": None}
        ids = body.get("return_token_ids") is True
        token_ids = [FIRST_TOKEN_ID + start + i for i in range(n)] if ids else None
        created = int(time.time())
        if chat:
            data = {
                "id": f"chatcmpl-{rid}-{os.urandom(4).hex()}", "object": "chat.completion", "created": created,
                "model": self.model,
                "choices": [{"index": 0,
                             "message": {"role": self.role_name, "content": text, "refusal": None, "annotations": None,
                                         "audio": None, "function_call": None, "reasoning": self.chat_reasoning},
                             "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": token_ids,
                             "routed_experts": None}],
                "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": usage, "prompt_logprobs": None,
                # As vLLM: the rendered prompt's ids.
                "prompt_token_ids": chat_prompt_token_ids(body.get("messages")) if ids else None,
                "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
            }
        else:
            data = {
                "id": f"cmpl-{rid}-0-{os.urandom(4).hex()}", "object": "text_completion", "created": created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                             "token_ids": token_ids, "prompt_logprobs": None,
                             "prompt_token_ids": prompt_token_ids(body.get("prompt")) if ids else None,
                             "routed_experts": None}],
                "service_tier": None, "system_fingerprint": FINGERPRINT, "usage": usage, "kv_transfer_params": None,
                "ec_transfer_params": None, "metrics": None,
            }
        # As vLLM's JSONResponse (Starlette's) writes it: compact, not ASCII-escaped.
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()

    def stream_events(self, chat: bool, rid: str, n: int, body: dict) -> list[bytes]:
        """The SSE events vLLM 0.32 sends for this request, field for field, [DONE] included:
        its system_fingerprint on the last event before [DONE]."""
        created = int(time.time())
        model = json.dumps(self.model)
        suffix = os.urandom(4).hex()
        opts = body.get("stream_options")
        usage = isinstance(opts, dict) and bool(_LAX_BOOL.validate_python(opts.get("include_usage")))
        fingerprint = "" if usage else ',"system_fingerprint":"%s"' % FINGERPRINT
        if chat:
            ident = json.dumps(f"chatcmpl-{rid}-{suffix}")
            head = '{"id":%s,"object":"chat.completion.chunk","created":%d,"model":%s,"choices":[' % (
                ident, created, model)
            events = [head + '{"index":0,"delta":{"role":%s,"content":""},"logprobs":null,"finish_reason":null}],'
                      '"prompt_token_ids":null,"prompt_text":null}' % json.dumps(self.role_name)]
            mid = '{"index":0,"delta":{"content":" t%d"},"logprobs":null,"finish_reason":null,"token_ids":null}]}'
            last = ('{"index":0,"delta":{"content":" t%d"},"logprobs":null,"finish_reason":"length",'
                    '"stop_reason":null,"token_ids":null}]' + fingerprint + "}")
        else:
            ident = json.dumps(f"cmpl-{rid}-0-{suffix}")
            head = '{"id":%s,"object":"text_completion","created":%d,"model":%s,"choices":[' % (ident, created, model)
            events = []
            mid = ('{"index":0,"text":" t%d","logprobs":null,"finish_reason":null,"stop_reason":null,'
                   '"prompt_token_ids":null,"token_ids":null}]}')
            last = ('{"index":0,"text":" t%d","logprobs":null,"finish_reason":"length","stop_reason":null,'
                    '"prompt_token_ids":null,"token_ids":null}]' + fingerprint + "}")
        start = generated_before(body)
        for i in range(n):
            events.append(head + ((last if i == n - 1 else mid) % (start + i)))
        if usage:
            prompt = prompt_tokens(chat, body)
            details = ""
            if self.prompt_details is not None:  # as a stream's last usage: null members left out
                details = ',"prompt_tokens_details":{"cached_tokens":%d%s}' % (
                    self.prompt_details[0], ',"created_cache_tokens":%d' % self.prompt_details[1] if chat else "")
            events.append(head + '],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d%s},'
                          '"system_fingerprint":"%s"}' % (prompt, prompt + n, n, details, FINGERPRINT))
        out = [b"data: " + e.encode() + b"\n\n" for e in events]
        out.append(b"data: [DONE]\n\n")
        return out

    async def _stream(
        self,
        conn: _Conn,
        req: _Request,
        rec: Recorded,
        chat: bool,
        rid: str,
        n: int,
        body: dict,
        fault: Fault | None,
    ) -> None:
        events = self.stream_events(chat, rid, n, body)
        if fault is not None and fault.stream_error is not None:
            lead = 1 if chat else 0  # chat's role chunk comes first
            events = events[: lead + min(fault.stream_error_after, n)] + [
                stream_error_event(fault.stream_error), b"data: [DONE]\n\n"]  # fmt: skip
        await self._write_events(conn, req, rec, events, fault)

    async def _write_events(self, conn: _Conn, req: _Request, rec: Recorded, events: list[bytes],
                            fault: Fault | None) -> None:  # fmt: skip
        conn.write(self._head(200, "text/event-stream; charset=utf-8", None, req.keep_alive))
        delay = self.token_delay
        if fault is not None and fault.token_delay is not None:
            delay = fault.token_delay
        for i, event in enumerate(events):
            if fault is not None:
                if fault.fail_after is not None and i >= fault.fail_after:
                    rec.fault_closed = True
                    conn.transport.close()  # mid-stream failure: no terminating chunk
                    return
                if fault.stall_after is not None and i >= fault.stall_after:
                    await asyncio.sleep(3600)
            if conn.closed:
                raise asyncio.CancelledError()
            if self.record:
                rec.sent += event
            conn.write(_chunk(event))
            if delay:
                await asyncio.sleep(delay)
        if fault is not None and fault.hold_end is not None:
            await fault.hold_end.wait()
            if conn.closed:
                raise asyncio.CancelledError()
        conn.write(b"0\r\n\r\n")


# ---------------------------------------------------------------------- subprocess mode


async def _main(args: argparse.Namespace) -> None:
    fake = FakeVLLM(
        args.role,
        proxy=args.proxy,
        host=args.host,
        port=args.port,
        zmq_address=args.zmq_address,
        model=args.model,
        heartbeat_interval=args.heartbeat_interval,
        secret=args.secret,
        token_delay=args.token_delay,
        record=False,
        api_key=args.api_key,
    )
    await fake.start()
    print(f"READY {fake.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fake.stop(leave=bool(args.proxy))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("P", "D"), required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--proxy", default=None, help="proxy discovery address host:port")
    parser.add_argument("--zmq-address", default=None)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--api-key", default=None, help="like vLLM's: required on /v1/ routes")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args(argv)
    if args.uvloop:
        import uvloop

        uvloop.run(_main(args))
    else:
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()
