"""Relaying D's answer once it started: the stream's idle deadline (pushed back by every
chunk), and what a client and an operator are told when D goes silent or breaks off after
the status line went out. Real proxy, fake instances over real HTTP and ZMQ (mutation
survivors of proxy/dispatch/relay.py)."""

from __future__ import annotations

import json
import logging

import pytest

from proxy.dispatch.relay import LEAD_MAX_BYTES as CAP
from tests.support.proxy_helpers import Fault, running_proxy, wait_until

STREAM = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5, "stream": True}


def events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


async def test_every_chunk_pushes_the_idle_deadline_back():
    """0.3 s between tokens, 1 s idle deadline: the whole 1.5 s stream is relayed."""
    async with running_proxy(first_token="decode", stream_idle_timeout=1.0) as px:
        p, d = await px.pd()
        d.fault = Fault(token_delay=0.3)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200
        (rec,) = d.completions()
        assert resp.content == px.relayed(rec) and resp.text.endswith("data: [DONE]\n\n")
        assert "error" not in resp.text


@pytest.mark.parametrize("expose", [False, True])
async def test_a_silent_stream_ends_with_a_timeout_event(expose, caplog):
    async with running_proxy(first_token="decode", stream_idle_timeout=0.3, expose_routing_headers=expose) as px:
        p, d = await px.pd()
        d.fault = Fault(stall_after=2)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.relay"):
            resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200
        got = events(resp.text)
        assert [json.loads(e)["choices"][0]["text"] for e in got[:2]] == [" t0", " t1"]
        where = f"decode instance {d.http_address}" if expose else "decode instance"
        assert json.loads(got[2]) == {"error": {"message": f"{where} sent nothing for 0.3s",
                                                "type": "timeout_error", "param": None,
                                                "code": "decode_timeout"}}  # fmt: skip
        assert got[3:] == ["[DONE]"]
        assert await px.metric("xpyd_upstream_errors_total", role="D", instance=d.http_address,
                               kind="stream_idle_timeout") == 1  # fmt: skip
        await wait_until(lambda: d.completions()[0].cancelled, what="D saw the abort")
    assert [r.getMessage() for r in caplog.records if r.name == "xpyd.proxy.relay"] == [
        f"decode stream idle instance={d.http_address} after=0.3s"
    ]


@pytest.mark.parametrize("expose", [False, True])
async def test_a_stream_broken_off_ends_with_a_midstream_event(expose, caplog):
    async with running_proxy(first_token="decode", expose_routing_headers=expose) as px:
        p, d = await px.pd()
        d.fault = Fault(fail_after=2)
        with caplog.at_level(logging.WARNING, logger="xpyd.proxy.relay"):
            resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200
        got = events(resp.text)
        err = json.loads(got[2])["error"]
        if expose:
            assert err["message"].startswith(f"decode instance {d.http_address} failed mid-stream: ")
            assert err["message"] != f"decode instance {d.http_address} failed mid-stream: connection dropped"
        else:
            assert err["message"] == "decode instance failed mid-stream: connection dropped"
        assert (err["code"], err["param"]) == ("decode_midstream", None) and got[3:] == ["[DONE]"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "xpyd.proxy.relay"]
    assert line.startswith(f"decode stream broke instance={d.http_address} error=")


@pytest.mark.parametrize("first_token", ["decode", "prefill"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"], ids=["completions", "chat"])
async def test_a_client_closing_once_it_read_done_got_a_complete_answer(first_token, path, caplog):
    """The openai SDK closes its connection once it read [DONE]; vLLM writes its body's end
    apart from [DONE], here only after the proxy saw the client close. The answer was
    complete: the client's response ends with [DONE], a 200 in the metrics, no disconnect
    counted or logged, and D's body is still read to its end (before: [DONE] went out as
    more to come while the relay awaited D's end, and the close read as the client leaving:
    499, xpyd_client_disconnects, 'client disconnected')."""
    import asyncio

    release = asyncio.Event()
    body = dict(STREAM) if path == "/v1/completions" else {
        "model": "fake-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5,
        "stream": True}  # fmt: skip
    async with running_proxy(first_token=first_token) as px:
        p, d = await px.pd()
        d.fault = Fault(hold_end=release)
        raw = json.dumps(body).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", px.server.port)
        writer.write(b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (path.encode(), len(raw)) + raw)  # fmt: skip
        got = b""
        with caplog.at_level(logging.INFO, logger="xpyd.proxy"):
            async with asyncio.timeout(30):  # generous: the deadline is not the subject
                while b"data: [DONE]\n\n" not in got:
                    piece = await reader.read(65536)
                    assert piece, got
                    got += piece
            writer.close()  # as the SDK does: [DONE] read, the connection closed
            await wait_until(lambda: not px.server.server_state.connections, timeout=30,
                             what="the proxy saw the client close")  # fmt: skip
            release.set()  # only now does D's body end
            await wait_until(lambda: d.completions()[-1].completed or d.completions()[-1].cancelled, timeout=30)
            await wait_until(lambda: px.state.metrics.requests.collect()[0].samples, timeout=30,
                             what="the request counted")  # fmt: skip
        assert got.startswith(b"HTTP/1.1 200 ")
        assert await px.metric("xpyd_client_disconnects_total") == 0
        assert await px.metric("xpyd_requests_total", route=path, status="200") == 1
        assert await px.metric("xpyd_requests_total", route=path, status="499") == 0
        assert d.completions()[-1].completed  # D's end was read: its connection goes back to the pool
    assert not [r for r in caplog.records if "client disconnected" in r.getMessage()]


# ---------------------------------------------------------------- the stream's lead, judged


def _sse(obj: object, end: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(obj).encode() + end


def _err(code: object, kind: str) -> bytes:
    return _sse({"error": {"message": "m", "type": kind, "param": None, "code": code}})


def _completion(**choice) -> bytes:
    return _sse({"choices": [{"index": 0, "text": "", "finish_reason": None, **choice}]})


_ROLE_CRLF = _sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}, b"\r\n\r\n"
)


@pytest.mark.parametrize(
    "buf,verdict",
    [
        # A code is an HTTP status only in [100, 600); outside it, the type decides.
        (_err(100, "InternalServerError"), True),  # a status below 500: D's verdict, relayed
        (_err(499, "InternalServerError"), True),
        (_err(500, "BadRequestError"), 500),
        (_err(599, "BadRequestError"), 599),
        (_err(600, "BadRequestError"), True),  # not a status: a client error type, relayed
        (_err(600, "InternalServerError"), 500),
        (_err(99, "InternalServerError"), 500),
        (_err(True, "BadRequestError"), True),  # a bool is no status
        # What a choice carries.
        (_sse({"choices": ["x"]}), True),  # not understood: relayed
        (_completion(token_ids=[901]), True),  # return_token_ids: a token, even without text
        (_completion(), False),  # a completion chunk with no text yet: nothing generated
        (_sse({"choices": [{"index": 0, "delta": "x", "finish_reason": None}]}), True),
        # A stream that starts with a bare CR line (an empty line in SSE), CRLF after.
        (b"\r" + _completion(text=" t0").replace(b"\n\n", b"\r\n\r\n"), True),
        (b"\r" + _completion().replace(b"\n\n", b"\r\n\r\n"), False),
        # An error event that ends past the cap is not read: relayed as without the hold.
        (_sse({"error": {"type": "InternalServerError", "code": 500}, "pad": "x" * CAP}), True),
        (
            b'data: {"error": {"type": "InternalServerError", "code": 500},\r\ndata: "pad": "'
            + b"x" * CAP
            + b'"}\r\n\r\n',
            True,
        ),  # the error event split over CRLF lines, ending past the cap
        # CRLF: the role chunk, then an event not complete yet.
        (_ROLE_CRLF + b'data: {"choices": []}\r\n', False),
        # An empty event first (a blank line): skipped, not an incomplete event.
        (b"\n\n" + _completion(text=" t0"), True),
        (b"\r\n\r\n" + _completion(text=" t0").replace(b"\n\n", b"\r\n\r\n"), True),
        # No event end in the first CAP bytes: relayed once CAP bytes are in hand.
        (b"data: " + b"x" * (CAP - 6), True),
        (b"data: " + b"x" * (CAP - 7), False),
        # Several data lines make one event, their data joined by LF; "data:" without a space (CRLF).
        (b'data: {"error":\ndata: {"message": "m", "type": "InternalServerError", "code": 500}}\n\n', 500),
        (b"data:" + _err(503, "ServiceUnavailableError")[6:].replace(b"\n\n", b"\r\n\r\n"), 503),  # no space
    ],
    ids=[
        "code-100",
        "code-499",
        "code-500",
        "code-599",
        "code-600-client-type",
        "code-600-server-type",
        "code-99",
        "code-bool",
        "choice-not-a-dict",
        "token-ids",
        "no-text",
        "delta-not-a-dict",
        "leading-cr-content",
        "leading-cr-nothing",
        "error-past-cap",
        "error-past-cap-crlf",
        "crlf-role-then-part",
        "empty-event-first",
        "empty-event-first-crlf",
        "cap-bytes-no-end",
        "below-cap-no-end",
        "two-data-lines",
        "data-colon-no-space",
    ],
)
def test_judge_lead_edges(buf, verdict):
    """Mutants of _server_error's status bounds, _carries' branches, judge_lead's CR search."""
    from proxy.dispatch.relay import StreamError, judge_lead

    got, _ = judge_lead(buf)
    if verdict is True or verdict is False:
        assert got is verdict
    else:
        assert isinstance(got, StreamError) and got.status == verdict
        assert json.loads(got.body)["error"]["message"] == "m"  # the event's JSON, its data lines joined


# ---------------------------------------------------------------- the stream's lead, read


class _Stream:
    """D's streamed answer as the upstream client hands it out (the other side of read_lead):
    each item put is one read's bytes, None the stream's end. at_eof() is True once the end
    was handed out, as the native client's is when the last chunk came apart from the data.
    `sleep_before` blocks the loop before a read returns (a read that completes after the
    lead's deadline, at the same loop turn as the timeout)."""

    def __init__(self) -> None:
        import asyncio

        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.ended = False
        self.cancelled_reads = 0
        self.closed = False
        self.sleep_before: dict[int, float] = {}
        self.reads = 0
        self.status = 200
        self.content_type = "text/event-stream"

    async def _gen(self):
        import asyncio
        import time

        while True:
            try:
                item = await self.queue.get()
            except asyncio.CancelledError:
                self.cancelled_reads += 1
                raise
            self.reads += 1
            time.sleep(self.sleep_before.get(self.reads, 0.0))
            if item is None:
                self.ended = True
                return
            yield item

    def chunks(self):
        return self._gen()

    def at_eof(self) -> bool:
        return self.ended

    async def read(self, limit=None) -> bytes:
        raise AssertionError("a stream is read by chunks")

    async def aclose(self) -> None:
        self.closed = True


_ROLE = _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
_PING = b": ping\n\n"
_T0 = _sse({"choices": [{"index": 0, "delta": {"content": " t0"}, "finish_reason": None}]})


def _answer(stream: _Stream):
    from proxy.dispatch.relay import Answer

    chunks = stream.chunks()
    return Answer(stream, _ROLE, True, chunks)  # the first read: the role chunk


async def test_read_lead_keeps_what_it_held_when_the_stream_ends():
    """Role chunk, a comment, the end: all of it is the answer's first bytes, no error
    (mutants: _next without its default, the end's break as a return)."""
    import asyncio

    from proxy.dispatch.relay import read_lead

    stream = _Stream()
    answer = _answer(stream)
    for item in (_PING, None):
        stream.queue.put_nowait(item)
    loop = asyncio.get_running_loop()
    assert await read_lead(answer, loop.time() + 30) is None
    assert answer.first == _ROLE + _PING and answer.pending is None


async def test_read_lead_keeps_what_it_held_when_a_read_ends_past_the_deadline():
    """The comment's read completes after the deadline (the loop was held): the next turn
    sees no time left and relays what it holds, the comment included (mutant: a return
    that drops it)."""
    import asyncio

    from proxy.dispatch.relay import read_lead

    stream = _Stream()
    answer = _answer(stream)
    stream.sleep_before[1] = 0.2  # the comment's read holds the loop past the deadline
    stream.queue.put_nowait(_PING)
    loop = asyncio.get_running_loop()
    assert await read_lead(answer, loop.time() + 0.1) is None
    assert answer.first == _ROLE + _PING
    stream.queue.put_nowait(_T0)  # the stream goes on as without the hold
    stream.queue.put_nowait(None)
    assert [c async for c in answer.chunks] == [_T0]


async def test_read_lead_at_its_deadline_relays_the_rest_from_the_read_under_way():
    """At the deadline the held bytes are the answer's first; the read under way is not
    cancelled (that would end D's stream): the chunks go on from its result, then the rest.
    Mutants: pending not kept, _after ending at a chunk instead of at the end, _after
    without the rest, the deadline's break as a return."""
    import asyncio

    from proxy.dispatch.relay import read_lead

    stream = _Stream()
    answer = _answer(stream)
    stream.queue.put_nowait(_PING)
    loop = asyncio.get_running_loop()
    # The comment is queued before the deadline's wait; then silence until the deadline.
    got = await read_lead(answer, loop.time() + 0.3)
    assert got is None and answer.first == _ROLE + _PING
    assert answer.pending is not None and not answer.pending.done() and stream.cancelled_reads == 0
    for item in (_T0, b"data: [DONE]\n\n", None):
        stream.queue.put_nowait(item)
    assert [c async for c in answer.chunks] == [_T0, b"data: [DONE]\n\n"]


async def test_closing_an_answer_cancels_the_read_under_way():
    """An answer closed after the lead's deadline (the client left) abandons D's read that
    was still waiting (mutant: the pending read not kept, left waiting forever)."""
    import asyncio

    from proxy.dispatch.relay import read_lead

    stream = _Stream()
    answer = _answer(stream)
    loop = asyncio.get_running_loop()
    assert await read_lead(answer, loop.time() + 0.1) is None and answer.first == _ROLE
    await answer.aclose()
    await asyncio.sleep(0)  # the cancellation is delivered at the read's next turn
    assert stream.closed and stream.cancelled_reads == 1


async def test_a_refused_continuation_ends_the_relayed_stream_with_ds_error_event():
    """First token from P: the 200 and P's token went out, D refuses the continuation (400):
    the relay ends the stream with D's error as an event of its own, then [DONE]
    (mutant: StreamFailed without its event, the stream ending as if complete)."""
    async with running_proxy() as px:
        _, d = await px.pd()
        d.fault = Fault(status=400)
        resp = await px.client.post("/v1/completions", json=STREAM)
        assert resp.status_code == 200
        got = events(resp.text)
        assert json.loads(got[0])["choices"][0]["text"] == " t0"
        assert json.loads(got[1]) == {
            "error": {"message": "fake D failure", "type": "BadRequestError", "param": None, "code": 400}
        }
        assert got[2:] == ["[DONE]"]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
async def test_the_client_gets_ds_content_type(stream):
    """The relayed answer is typed as D typed it (mutant: the content-type header misnamed)."""
    async with running_proxy(first_token="decode") as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json={**STREAM, "stream": stream})
        assert resp.status_code == 200
        want = "text/event-stream; charset=utf-8" if stream else "application/json"
        assert resp.headers.get_list("content-type") == [want]
        (rec,) = d.completions()
        assert resp.content == px.relayed(rec)
        if not stream:  # one write with its length, not a chunked body (mutant: the length misnamed)
            assert resp.headers.get_list("content-length") == [str(len(resp.content))]
            assert "transfer-encoding" not in resp.headers


# ---------------------------------------------------------------- the relay itself, against a scripted D


class _Script:
    """D's answer as the upstream client hands it out: `first` was read already, `rest` comes
    piece by piece, then the body is complete ("eof": at_eof() is True once the last piece
    is handed out, as the native client's is when the last chunk came with the data) or the
    connection breaks ("break")."""

    def __init__(self, rest: list[bytes], end: str, streaming: bool = True) -> None:
        self.rest = rest
        self.end = end
        self.given = 0
        self.status = 200
        self.content_type = "text/event-stream" if streaming else "application/json"

    async def _gen(self):
        from proxy.upstream.base import UpstreamError

        for piece in self.rest:
            self.given += 1
            yield piece
        if self.end == "break":
            raise UpstreamError("disconnect", "instance closed the connection")
        if self.end == "hang":  # the body's end never comes
            import asyncio

            await asyncio.Event().wait()
        self.ended = True

    def chunks(self):
        return self._gen()

    def at_eof(self) -> bool:  # "late-eof": the end comes after the last piece, apart from it
        return self.end == "eof" and self.given == len(self.rest) or self.ended

    ended = False

    async def read(self, limit=None) -> bytes:
        raise AssertionError("read by chunks")

    async def aclose(self) -> None:
        pass


async def _relay(
    first: bytes, script: _Script, streaming: bool = True, rewrite=None, **relay_kw
) -> tuple[list[tuple], object]:
    """Relay `first` + the script to a recording ASGI send whose client leaves the moment the
    last message is sent. Returns (type, body, more_body, started, done) per message sent
    and the flight."""
    from proxy.asgi import Flight
    from proxy.dispatch.relay import Answer, Relay
    from proxy.metrics import Metrics
    from proxy.registry import Registry
    from xpyd_wire.discovery import Registration

    registry = Registry(heartbeat_timeout=10)
    d = registry.upsert(Registration("D", "127.0.0.1:1", "127.0.0.1:2"), now=0)
    flight = Flight(None)
    sent: list[tuple] = []

    async def send(message: dict) -> None:
        more = message.get("more_body", False) if message["type"] == "http.response.body" else None  # ASGI default
        sent.append((message["type"], message.get("body"), more, flight.started, flight.done))
        if message["type"] == "http.response.body" and not more:
            flight.client_left()  # the client had all of it and closed: not a disconnect

    answer = Answer(script, first, streaming, script.chunks() if streaming else None, rewrite)
    await Relay(Metrics(registry), relay_kw.pop("idle_timeout", 5.0), **relay_kw)(answer, d, send, flight)
    return sent, flight


_MIDSTREAM = b'"code": "decode_midstream"}}'


async def test_relay_of_a_whole_answer_marks_its_flight():
    """started before the status line, done before the one body write (mutants: either flag
    left unset, so that routes would send a second status line on an error, or the client's
    closing after the answer would read as a disconnect)."""
    body = b'{"id": "cmpl-1", "choices": []}'
    sent, flight = await _relay(body, _Script([], "eof", streaming=False), streaming=False)
    assert sent == [("http.response.start", None, None, True, False), ("http.response.body", body, False, True, True)]
    assert not flight.disconnected


async def test_relay_of_a_stream_ending_with_its_last_piece_marks_its_flight():
    sent, flight = await _relay(_T0, _Script([_T0, b"data: [DONE]\n\n"], "eof"))
    assert sent == [
        ("http.response.start", None, None, True, False),
        ("http.response.body", _T0, True, True, False),
        ("http.response.body", _T0, True, True, False),
        ("http.response.body", b"data: [DONE]\n\n", False, True, True),
    ]
    assert not flight.disconnected


@pytest.mark.parametrize("first", [b"data", b"da", b'data: {"choices": [{"te'], ids=["4-bytes", "2-bytes", "longer"])
async def test_relay_ends_an_event_broken_off_in_its_first_bytes_before_the_error(first):
    """D broke off inside the event its first bytes began: the error event starts after a
    blank line, not glued to the broken one (mutants: the first bytes' tail not kept)."""
    sent, flight = await _relay(first, _Script([], "break"))
    (kind, body, more, _, done) = sent[-1]
    assert (kind, more, done) == ("http.response.body", False, True)
    assert body.startswith(b"\n\ndata: {") and _MIDSTREAM in body and body.endswith(b"\n\ndata: [DONE]\n\n")
    assert not flight.disconnected


async def test_relay_sends_no_blank_line_before_an_error_after_a_complete_event():
    """The event's last LF came as a piece of its own: the stream is on a boundary, the
    error event follows directly (mutant: a short piece taken for the stream's whole tail)."""
    sent, _ = await _relay(_T0[:-1], _Script([b"\n"], "break"))
    assert [m[1] for m in sent[1:3]] == [_T0[:-1], b"\n"]
    body = sent[-1][1]
    assert body.startswith(b"data: {") and _MIDSTREAM in body and body.endswith(b"\n\ndata: [DONE]\n\n")


def _midstream_event(message: str) -> bytes:
    error = {"message": message, "type": "upstream_error", "param": None, "code": "decode_midstream"}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


@pytest.mark.parametrize("expose", [None, False, True], ids=["default", "hidden", "exposed"])
async def test_relay_tells_a_break_to_the_client_and_the_log(expose, caplog):
    """The client's error event (a 502 upstream_error; D named and the upstream's text only
    when exposed, which Relay is not by default) and the operator's log line with the error."""
    kw = {} if expose is None else {"expose": expose}
    with caplog.at_level(logging.WARNING, logger="xpyd.proxy.relay"):
        sent, _ = await _relay(_T0, _Script([], "break"), **kw)
    message = (
        "decode instance 127.0.0.1:1 failed mid-stream: instance closed the connection"
        if expose
        else "decode instance failed mid-stream: connection dropped"
    )
    assert sent[-1][1] == _midstream_event(message) + b"data: [DONE]\n\n"
    assert [r.getMessage() for r in caplog.records if r.name == "xpyd.proxy.relay"] == [
        "decode stream broke instance=127.0.0.1:1 error=instance closed the connection"
    ]


async def test_relay_ends_a_stream_whose_end_came_apart_from_its_last_piece():
    """A stream without [DONE] (not vLLM's): the last piece was sent as one with more to come;
    the end, seen after it, is an empty last write (mutants: a body that is not bytes, or
    bytes added)."""
    sent, flight = await _relay(_T0, _Script([_T0], "late-eof"))
    assert [m[1:3] for m in sent[1:]] == [(_T0, True), (_T0, True), (b"", False)]
    assert sent[-1][4] and not flight.disconnected


_DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "first,rest,writes",
    [
        (_T0, [_DONE], [(_T0, True), (_DONE, False)]),  # vLLM's: [DONE] a piece of its own
        (_T0, [_T0 + _DONE], [(_T0, True), (_T0 + _DONE, False)]),
        (_T0, [b"data: [DO", b"NE]\n\n"], [(_T0, True), (b"data: [DO", True), (b"NE]\n\n", False)]),
        (_T0, [b"\n" + _DONE], [(_T0, True), (b"\n" + _DONE, False)]),  # its end split from the event before
        (_T0 + _DONE, [], [(_T0 + _DONE, False)]),  # all of it in D's first bytes
        (_DONE, [], [(_DONE, False)]),  # nothing but [DONE]
        (_T0.replace(b"\n\n", b"\r\n\r\n"), [_DONE], [(_T0.replace(b"\n\n", b"\r\n\r\n"), True), (_DONE, False)]),
    ],
    ids=["own-piece", "with-the-last-event", "split", "boundary-split", "in-first", "only-done", "crlf"],
)
async def test_relay_ends_the_response_with_ds_done_before_ds_body_ends(first, rest, writes):
    """D's [DONE] is the response's last write although D's body end comes after it (vLLM
    writes it apart; a client that read [DONE] may close at once), and D's body is then read
    to its end, for its connection to be reused (mutants: [DONE] sent as more to come, the
    end not drained, [DONE] found only whole in one piece)."""
    script = _Script(rest, "late-eof")
    sent, flight = await _relay(first, script)
    assert [m[1:3] for m in sent[1:]] == writes
    assert sent[-1][4] and not flight.disconnected and script.ended


@pytest.mark.parametrize("rest", [[_T0[:-1], _DONE], [b'data: {"x": 1}\n', _DONE]], ids=["one-lf", "data-line"])
async def test_relay_takes_done_inside_an_event_for_data(rest):
    """`data: [DONE]` after a single LF is another data line of the same event, not the
    stream's end: sent as more to come, the end is D's (mutant: the boundary not checked)."""
    sent, flight = await _relay(_T0, _Script(rest, "late-eof"))
    assert [m[1:3] for m in sent[1:]] == [(_T0, True), (rest[0], True), (_DONE, True), (b"", False)]


async def test_relay_after_done_gives_up_on_a_body_end_that_never_comes(monkeypatch):
    """A D that sends [DONE] but never its body's end holds the relay DRAIN_S at most: the
    client's answer is complete, closing the answer then closes D's connection (mutant: the
    drain unbounded)."""
    import asyncio

    from proxy.dispatch import relay

    monkeypatch.setattr(relay, "DRAIN_S", 0.05)
    async with asyncio.timeout(30):  # generous: only the drain's bound can end the relay
        sent, flight = await _relay(_T0, _Script([_DONE], "hang"))
    assert [m[1:3] for m in sent[1:]] == [(_T0, True), (_DONE, False)] and not flight.disconnected


async def test_relay_after_done_ignores_a_break_of_ds_body():
    """D breaks off after its [DONE]: the client had all of it, no error event follows and
    no mid-stream failure is counted (mutant: the drain's failure not caught)."""
    sent, flight = await _relay(_T0, _Script([_DONE], "break"))
    assert [m[1:3] for m in sent[1:]] == [(_T0, True), (_DONE, False)] and not flight.disconnected


async def test_relay_sends_what_the_rewrite_held_back_at_a_clean_end():
    """A stream that ends with what could start the internal id: the rewrite held it back
    and the clean end sends it as D sent it (mutants: the held bytes dropped)."""
    from proxy.dispatch.rewrite import IdRewrite

    internal = "___prefill_addr_127.0.0.1:2___decode_addr_127.0.0.1:3_" + "0123456789abcdef" * 2
    rewrite = IdRewrite(internal, "ab" * 16)
    sent, _ = await _relay(_T0, _Script([b": tail ___pre"], "late-eof"), rewrite=rewrite)
    assert [m[1:3] for m in sent[1:]] == [(_T0, True), (b": tail ", True), (b"___pre", False)]


def _usage_event(cached: int) -> bytes:
    return (b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":9,"total_tokens":12,"completion_tokens":3,'
            b'"prompt_tokens_details":{"cached_tokens":%d}}}\n\n' % cached)


async def test_late_details_lets_events_go_until_ds_figures_then_waits_for_ps():
    """A stream relayed before P's answer: token events go at once, the usage event (split
    across two chunks) waits for P and gets P's figures; after it nothing is held."""
    import asyncio

    from proxy.dispatch.rewrite import LateDetails

    prefill: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    late = LateDetails(prefill, None)
    token = b'data: {"choices":[{"text":"a"}]}\n\n'
    assert late.feed(token) == token and not late.holding
    usage = _usage_event(17)
    assert late.feed(token + usage[:30]) == token and not late.holding  # an event's start: held, not judged
    assert late.feed(usage[30:] + token) == b"" and late.holding  # D's figures: they and what follows wait
    assert late.feed(b"data: [DONE]\n\n") == b"" and late.holding
    settling = asyncio.ensure_future(late.settle())
    await asyncio.sleep(0)
    assert not settling.done()  # P has not answered
    prefill.set_result(b'{"usage":{"prompt_tokens_details":{"cached_tokens":3}}}')
    assert await settling == _usage_event(3) + token + b"data: [DONE]\n\n"
    assert not late.holding and late.feed(usage) == _usage_event(3) and late.flush() == b""


@pytest.mark.parametrize("p_answer", [None, b'{"usage":{"prompt_tokens_details":null}}'])
async def test_late_details_keeps_ds_figures_when_p_failed_or_reported_none(p_answer):
    """P failed after D's stream began, or reports no details: D's usage goes as it is."""
    import asyncio

    from proxy.dispatch.rewrite import LateDetails

    prefill: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    late = LateDetails(prefill, None)
    assert late.feed(_usage_event(17)) == b"" and late.holding
    if p_answer is None:
        prefill.set_exception(TimeoutError())
    else:
        prefill.set_result(p_answer)
    assert await late.settle() == _usage_event(17)


async def test_a_usage_event_waiting_for_p_is_not_timed_by_ds_idle_deadline():
    """D's usage came before P's answer and P answers after D's idle deadline would have
    passed: the stream still ends whole with P's figures, no timeout event (P's call has
    its own deadline; mutant: the wait for P left under D's idle one)."""
    import asyncio

    from proxy.dispatch.rewrite import LateDetails

    loop = asyncio.get_running_loop()
    prefill: asyncio.Future[bytes] = loop.create_future()
    loop.call_later(0.5, prefill.set_result, b'{"usage":{"prompt_tokens_details":{"cached_tokens":3}}}')
    token = b'data: {"choices":[{"text":"a"}]}\n\n'
    sent, flight = await _relay(token, _Script([_usage_event(17), _DONE], "eof"), rewrite=LateDetails(prefill, None),
                                idle_timeout=0.2)
    body = b"".join(m[1] for m in sent[1:])
    assert body == token + _usage_event(3) + _DONE and flight.done
