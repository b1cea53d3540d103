"""The proxy's client-facing surface (issue 10): no topology in responses by default (no
instance addresses in headers, errors or /instances; vLLM's echo of the internal request id
rewritten to a neutral one), /metrics behind the API key on request, explicit upstream
credentials, and mid-stream error events on a fresh SSE event boundary."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from proxy.dispatch.relay import at_event_boundary
from proxy.dispatch.rewrite import IdRewrite
from tests.support.proxy_helpers import REQUEST_ID_RE, Fault, free_port, running_proxy, wait_until
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_FIRST_TOKEN, XPYD_PATH, XPYD_PREFILL_INSTANCE, XPYD_PREFILL_MS

COMPLETION = {"model": "fake-model", "prompt": "Hello", "max_tokens": 4}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
HEX16 = re.compile(r"[0-9a-f]{16}")  # vLLM 0.32's own ids (random_uuid)
INTERNAL = "___prefill_addr_127.0.0.1:21001___decode_addr_[::1]:21002_" + "ab" * 16
NEUTRAL = "ef" * 8


def leaks(text: str, *fakes) -> list[str]:
    """Whatever in `text` names the topology: instance addresses, the internal id format."""
    found = [a for f in fakes for a in (f.http_address, f.zmq_address) if a in text]
    return found + [w for w in ("prefill_addr", "decode_addr", "xpyd-local-") if w in text]


def error_events(text: str) -> list[dict]:
    out = []
    for event in re.split(r"\r\n\r\n|\n\n|\r\r", text):
        for line in event.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                out.append(json.loads(line[6:])["error"])
    return out


# ---------------------------------------------------------------- the rewrite itself


def test_rewrite_whole_body_and_every_split_of_the_id():
    neutral = NEUTRAL
    event = b'data: {"id":"cmpl-' + INTERNAL.encode() + b'","choices":[]}\n\n'
    want = event.replace(INTERNAL.encode(), neutral.encode())
    assert IdRewrite(INTERNAL, NEUTRAL).whole(event * 3) == want * 3
    stream = event * 3 + b"data: [DONE]\n\n"
    expected = stream.replace(INTERNAL.encode(), neutral.encode())
    # Two chunks, split at every byte: the id is rebuilt whatever the split.
    for cut in range(len(stream) + 1):
        rw = IdRewrite(INTERNAL, NEUTRAL)
        out = rw.feed(stream[:cut]) + rw.feed(stream[cut:]) + rw.flush()
        assert out == expected, cut
    # Random chunkings, down to one byte per chunk.
    rng = random.Random(10)
    for _ in range(200):
        rw, out, i = IdRewrite(INTERNAL, NEUTRAL), [], 0
        while i < len(stream):
            n = rng.randint(1, 40)
            out.append(rw.feed(stream[i : i + n]))
            i += n
        assert b"".join(out) + rw.flush() == expected


def test_rewrite_holds_back_only_a_proper_prefix_of_the_id():
    rw = IdRewrite(INTERNAL, NEUTRAL)
    # The fast path: a chunk that ends an event holds nothing back.
    assert rw.feed(b"data: x\n\n") == b"data: x\n\n"
    # Underscores that cannot start the id are not held; "___pre" can.
    assert rw.feed(b"data: a_b_c") == b"data: a_b_c"
    assert rw.feed(b'{"id":"cmpl-___pre') == b'{"id":"cmpl-'
    # ... and was text after all: it comes out with the next chunk, unchanged.
    assert rw.feed(b'tty"}\n\n') == b'___pretty"}\n\n'
    # A held start of the id is never sent on a broken stream, sent as is at a clean end.
    assert rw.feed(b"cmpl-___prefill_addr_127") == b"cmpl-"
    rw.drop()
    assert rw.flush() == b""
    assert rw.feed(b"x___") == b"x" and rw.flush() == b"___"
    # The local path's id likewise.
    local = IdRewrite("xpyd-local-" + "ab" * 16, "cd" * 8)
    assert local.feed(b"cmpl-xpyd-lo") == b"cmpl-"
    assert local.feed(b"cal-" + b"ab" * 16 + b"-0\n\n") == b"cd" * 8 + b"-0\n\n"
    with pytest.raises(ValueError):
        IdRewrite("ab-" + "cd" * 16 + "-ab", NEUTRAL)  # "ab" both starts and ends it: a held tail could overlap one


@pytest.mark.parametrize("client", ["client-id-1", '"quoted" \\ and \n', "___prefill_addr_x", "xpyd-local-", "ab" * 16,
                                    "caf\u00e9 \U0001f600", ""])
def test_rewrite_to_the_clients_own_id_whatever_it_holds(client):
    """The client's own request id replaces the internal one as vLLM writes it in JSON (escaped),
    even where it holds what starts the internal id, across every split of the stream."""
    shown = json.dumps(client, ensure_ascii=False)[1:-1].encode()
    for internal in (INTERNAL, "xpyd-local-" + "ab" * 16):
        event = b'data: {"id":"cmpl-' + internal.encode() + b'","choices":[]}\n\n'
        stream = event * 2 + b"data: [DONE]\n\n"
        expected = stream.replace(internal.encode(), shown)
        assert json.loads(expected.split(b"\n\n")[0][6:])["id"] == "cmpl-" + client
        assert IdRewrite(internal, client).whole(stream) == expected
        for cut in range(len(stream) + 1):
            for cut2 in (cut, min(len(stream), cut + 7)):
                rw = IdRewrite(internal, client)
                out = rw.feed(stream[:cut]) + rw.feed(stream[cut:cut2]) + rw.feed(stream[cut2:]) + rw.flush()
                assert out == expected, (cut, cut2)


def test_event_boundary():
    for tail in (b"", b"x\n\n", b"\r\n\r\n", b"x\r\r", b"x\n\r\n", b"x\r\n\n"):
        assert at_event_boundary(tail), tail
    for tail in (b"data: {", b"x\n", b"x\r\n", b"x\r", b"\n\r"):
        assert not at_event_boundary(tail), tail


# ---------------------------------------------------------------- no topology by default


@pytest.mark.parametrize("path, body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_neutral_ids_and_no_addresses_by_default(path, body):
    async with running_proxy() as px:
        p, d = await px.pd()
        variants = [
            {**body},
            {**body, "stream": True, "stream_options": {"include_usage": True}},
            {**body, "n": 2},
            {**body, "n": 2, "stream": True},
        ]
        if path == "/v1/completions":
            variants += [{**body, "prompt": ["a", "b"]}, {**body, "prompt": ["a", "b"], "stream": True}]
        for req in variants:
            resp = await px.client.post(path, json=req)
            assert resp.status_code == 200, resp.text
            rec = d.completions()[-1]
            internal = re.fullmatch(REQUEST_ID_RE, rec.request_id)
            assert internal and p.completions()[-1].request_id == rec.request_id
            neutral = px.neutral(rec.request_id)
            assert HEX16.fullmatch(neutral) and "x-request-id" not in resp.headers  # vLLM's default: none
            # It names no transfer: the uuid P's and D's connectors key the KV by is nowhere.
            assert neutral != internal["uuid"] and internal["uuid"] not in resp.text + str(resp.headers)
            if XPYD_FIRST_TOKEN not in resp.headers:  # else P's token, then D's (test_proxy_first_token.py)
                assert resp.content == px.relayed(rec) != bytes(rec.sent)
            assert not leaks(resp.text + str(resp.headers), p, d), (req, resp.headers)
            prefix = "chatcmpl-" if "messages" in body else "cmpl-"
            ids = {json.loads(line[6:])["id"] for line in resp.text.splitlines()
                   if line.startswith("data: {")} if req.get("stream") else {resp.json()["id"]}  # fmt: skip
            assert ids and all(i.startswith(prefix + neutral) for i in ids), ids
            # Timings stay (they name no instance).
            assert float(resp.headers[XPYD_PREFILL_MS]) >= 0


async def test_local_path_id_is_neutral_too():
    async with running_proxy(local_prefill_threshold=1000) as px:
        p, d = await px.pd()
        for stream in (False, True):
            resp = await px.client.post("/v1/completions", json={**COMPLETION, "stream": stream})
            assert resp.status_code == 200 and resp.headers[XPYD_PATH] == "local_short"
            rec = d.completions()[-1]
            assert rec.request_id.startswith("xpyd-local-") and "x-request-id" not in resp.headers
            assert px.neutral(rec.request_id).encode() in resp.content
            assert resp.content == px.relayed(rec) and not leaks(resp.text, p, d)
        assert not p.completions()


async def test_expose_routing_headers_keeps_todays_view():
    async with running_proxy(first_token="decode", expose_routing_headers=True) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json={**COMPLETION, "stream": True})
        rec = d.completions()[-1]
        assert resp.content == bytes(rec.sent)  # byte for byte, the internal id in it
        assert resp.headers[XPYD_PREFILL_INSTANCE] == p.http_address
        assert resp.headers[XPYD_DECODE_INSTANCE] == d.http_address
        listed = {(i["role"], i["http_address"], i["zmq_address"])
                  for i in (await px.client.get("/instances")).json()}  # fmt: skip
        assert listed == {("P", p.http_address, p.zmq_address), ("D", d.http_address, d.zmq_address)}


async def test_errors_name_no_instance_by_default():
    async with running_proxy(decode_retries=0, prefill_retries=0, stream_idle_timeout=0.3,
                             fallback_to_decode=False) as px:  # fmt: skip
        p, d = await px.pd()
        everyone = [p, d]

        def check(resp, status):
            assert resp.status_code == status, resp.text
            assert not leaks(resp.text + str(resp.headers), *everyone), resp.text
            assert XPYD_PREFILL_INSTANCE not in resp.headers
            assert XPYD_DECODE_INSTANCE not in resp.headers
            return resp

        # An instance's own error quoting the request id (vLLM's messages may): the neutral id
        # instead. (P's 400 goes to D for the client's own verdict: D refuses it too.)
        bad = json.dumps({"error": {"message": "request {request_id} is bad", "type": "BadRequestError",
                                    "param": None, "code": 400}}).encode()
        p.fault = Fault(status=400, times=1, error_body=bad)
        d.fault = Fault(status=400, times=1, error_body=bad)
        resp = check(await px.client.post("/v1/completions", json=COMPLETION), 400)
        assert resp.json()["error"]["message"] == f"request {px.neutral(d.completions()[-1].request_id)} is bad"
        # A non-JSON error page is wrapped without the instance's address.
        # (times=2: D alone, the local rescue, fails too, so D's error is relayed.)
        d.fault = Fault(status=500, times=2, error_body=b"<h1>{request_id} broke</h1>",
                        content_type="text/html")  # fmt: skip
        resp = check(await px.client.post("/v1/completions", json=COMPLETION), 500)
        assert resp.json()["error"]["message"].startswith("decode instance answered HTTP 500")
        # D breaks mid-stream, D goes quiet mid-stream: SSE error events, no address.
        d.fault = Fault(fail_after=2, times=1)
        resp = check(await px.client.post("/v1/completions", json={**COMPLETION, "stream": True}), 200)
        assert [e["code"] for e in error_events(resp.text)] == ["decode_midstream"]
        d.fault = Fault(stall_after=2, times=1)
        resp = check(await px.client.post("/v1/completions", json={**COMPLETION, "stream": True}), 200)
        assert [e["code"] for e in error_events(resp.text)] == ["decode_timeout"]
        # An unreachable D, then an unreachable P: the connection errors name the address.
        await d.stop()
        resp = check(await px.client.post("/v1/completions", json=COMPLETION), 502)
        assert resp.json()["error"]["message"] == (
            "decode instance failed before answering: connection refused or unreachable")
    async with running_proxy(prefill_retries=0, fallback_to_decode=False) as px:
        d = await px.fake("D")
        gone = await px.fake("P")  # answered on joining, then went away
        dead = gone.http_address
        await gone.stop()
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 502 and dead not in resp.text and not leaks(resp.text, d), resp.text
        # ... but the log and the metrics still say which one.
        assert await px.metric("xpyd_upstream_errors_total", role="P", instance=dead, kind="connect") == 1


async def test_instances_summary_without_addresses():
    async with running_proxy(api_key="k") as px:
        p, d = await px.pd()
        p2 = await px.fake("P")
        auth = {"authorization": "Bearer k"}
        assert (await px.client.get("/instances")).status_code == 401
        first = (await px.client.get("/instances", headers=auth)).json()
        assert not leaks(json.dumps(first), p, d, p2)
        assert sorted(i["role"] for i in first) == ["D", "P", "P"]
        for inst in first:
            assert set(inst) >= {"label", "role", "models", "healthy", "in_flight", "load"}
            assert re.fullmatch(r"[0-9a-f]{12}", inst["label"])
            assert "http_address" not in inst and "zmq_address" not in inst
        assert len({i["label"] for i in first}) == 3  # one per instance...
        await px.client.post("/v1/completions", json=COMPLETION, headers=auth)
        again = (await px.client.get("/instances", headers=auth)).json()
        assert [i["label"] for i in again] == [i["label"] for i in first]  # ... and stable
        assert sum(i["served"] for i in again) == 2


async def test_metrics_behind_the_api_key_on_request():
    async with running_proxy(api_key="k") as px:
        assert (await px.client.get("/metrics")).status_code == 200  # default: open
    async with running_proxy(api_key="k", metrics_require_api_key=True) as px:
        resp = await px.client.get("/metrics")
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        bad = await px.client.get("/metrics", headers={"authorization": "Bearer nope"})
        assert bad.status_code == 401
        ok = await px.client.get("/metrics", headers={"authorization": "Bearer k"})
        assert ok.status_code == 200 and "xpyd_requests_total" in ok.text
        assert (await px.client.get("/health")).status_code == 200  # liveness stays open


# ---------------------------------------------------------------- upstream credentials


async def test_upstream_api_key_reaches_instances_that_require_one():
    async with running_proxy(upstream_api_key="up") as px:
        p, d = await px.pd(api_key="up")
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            for stream in (False, True):
                resp = await px.client.post(path, json={**body, "stream": stream},
                                            headers={"authorization": "Bearer client"})  # fmt: skip
                assert resp.status_code == 200, resp.text
        # Every request to P and D carried the key, never the client's header.
        for rec in p.completions() + d.completions():
            assert rec.headers["authorization"] == "Bearer up"
        models = await px.client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
    async with running_proxy() as px:  # no key: the instance's refusal is relayed as JSON
        p, d = await px.pd(api_key="up")
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 401 and "Unauthorized" in resp.json()["error"]["message"]
        assert not d.completions()


async def test_probes_carry_the_upstream_key_never_the_clients():
    """/v1/models probes follow the credentials rule: --upstream-api-key, and the clients'
    --api-key only with --forward-client-auth."""
    async with running_proxy(api_key="client", upstream_api_key="up") as px:
        await px.pd(api_key="up")
        await wait_until(lambda: all(i.models for i in px.registry.all()), what="models learned")
    async with running_proxy(api_key="client") as px:
        p, d = await px.pd(api_key="client")
        models = await px.client.get("/v1/models", headers={"authorization": "Bearer client"})
        assert models.status_code in (401, 502), models.text  # nobody may hand the key on
        probes = [r for r in p.requests + d.requests if r.path == "/v1/models"]
        assert probes and not any("authorization" in r.headers for r in probes)
        assert all(i.models is None for i in px.registry.all())


async def test_client_authorization_forwarded_only_when_asked():
    hdr = {"authorization": "Bearer client"}
    async with running_proxy() as px:
        p, d = await px.pd()
        assert (await px.client.post("/v1/completions", json=COMPLETION, headers=hdr)).status_code == 200
        assert not any("authorization" in r.headers for r in p.completions() + d.completions())
    async with running_proxy(forward_client_auth=True) as px:
        p, d = await px.pd(api_key="client")
        assert (await px.client.post("/v1/completions", json=COMPLETION, headers=hdr)).status_code == 200
        assert [r.headers["authorization"] for r in p.completions() + d.completions()] == [
            "Bearer client"] * 2  # fmt: skip
        # The /v1/models fallback (the proxy learned no models: it has no key) asks on the
        # client's behalf the same way.
        assert all(i.models is None for i in px.registry.all())
        models = await px.client.get("/v1/models", headers=hdr)
        assert models.status_code == 200, models.text
        assert (await px.client.get("/v1/models")).status_code == 401
    async with running_proxy(forward_client_auth=True, upstream_api_key="up") as px:
        p, d = await px.pd(api_key="up")
        assert (await px.client.post("/v1/completions", json=COMPLETION, headers=hdr)).status_code == 200
        assert {r.headers["authorization"] for r in p.completions() + d.completions()} == {"Bearer up"}
    async with running_proxy() as px:  # the fallback without forwarding: no credentials sent
        p, d = await px.pd(api_key="client")
        resp = await px.client.get("/v1/models", headers=hdr)
        assert resp.status_code == 401 and "error" in resp.json()
        assert all("authorization" not in r.headers for r in d.requests)


def test_credential_rule():
    from proxy.config import ProxyConfig
    from proxy.credentials import on_behalf_headers, probe_headers

    cfg = ProxyConfig(api_key="client-key")
    assert probe_headers(cfg) == {} and on_behalf_headers(cfg, "Bearer x") == {}
    cfg = ProxyConfig(api_key="client-key", forward_client_auth=True)
    assert probe_headers(cfg) == {"authorization": "Bearer client-key"}
    assert on_behalf_headers(cfg, "Bearer x") == {"authorization": "Bearer x"}
    assert on_behalf_headers(cfg, None) == {}
    cfg = ProxyConfig(api_key="client-key", forward_client_auth=True, upstream_api_key="up")
    assert probe_headers(cfg) == on_behalf_headers(cfg, "Bearer x") == {"authorization": "Bearer up"}


# ---------------------------------------------------------------- SSE boundary, real sockets


class ScriptedD:
    """A decode instance on a raw socket that streams scripted SSE bytes, each piece in its
    own chunk with a pause between, then ends cleanly or drops the connection. In a piece,
    "{rid}" is the request's X-Request-Id, "{rid1}" and "{rid2}" its two halves."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.clean = True
        self.server: asyncio.Server | None = None
        self.rids: list[str] = []  # the X-Request-Id of each POST, in order

    async def start(self) -> ScriptedD:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader, writer) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                hdrs = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                await reader.readexactly(int(hdrs.get("content-length", 0)))
                if not lines[0].startswith("POST"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
                rid = hdrs.get("x-request-id", "").encode()
                self.rids.append(rid.decode())
                half = len(rid) // 2
                for piece in self.pieces:
                    piece = piece.replace(b"{rid}", rid)
                    piece = piece.replace(b"{rid1}", rid[:half]).replace(b"{rid2}", rid[half:])
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                    await asyncio.sleep(0.03)  # a separate read on the proxy's side
                if not self.clean:
                    writer.transport.abort()
                    return
                writer.write(b"0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def stop(self) -> None:
        self.server.close()


@pytest.mark.parametrize("expose", [False, True])
@pytest.mark.parametrize("case", ["lf", "crlf", "mid-event", "held-id", "split-blank-line",
                                  "clean-split"])  # fmt: skip
async def test_mid_stream_error_starts_a_fresh_event(case, expose):
    d = await ScriptedD().start()
    ev = b'data: {"id":"cmpl-{rid}","choices":[{"text":"x"}]}'
    d.clean = case == "clean-split"
    d.pieces = {
        "lf": [ev + b"\n\n"],
        "crlf": [ev + b"\r\n\r\n"],
        "mid-event": [ev + b"\n\n", b'data: {"id":'],
        "held-id": [ev + b"\n\n", b'data: {"id":"cmpl-___prefill_addr_12'],
        "split-blank-line": [ev + b"\n", b"\n"],
        "clean-split": [b'data: {"id":"cmpl-{rid1}', b'{rid2}"}\n\ndata: {"id":"cmpl-{rid}"}\n\n'],
    }[case]
    try:
        async with running_proxy(first_token="decode", decode=(d.url,), health_interval=0.05,
                                 expose_routing_headers=expose) as px:  # fmt: skip
            await px.fake("P")
            await wait_until(lambda: px.registry.live("D"), what="scripted D healthy")
            resp = await px.client.post("/v1/completions", json={**COMPLETION, "stream": True})
            assert resp.status_code == 200
            text = resp.text
            shown = d.rids[-1] if expose else px.neutral(d.rids[-1])
            if case == "clean-split":  # the id split mid-way is rewritten, no error
                assert not error_events(text) and ("prefill_addr" in text) == expose
                assert text.count("cmpl-" + shown) == 2
                return
            (err,) = error_events(text)
            assert err["code"] == "decode_midstream"
            start = text.index("data: {\"error\"")
            before = text[:start]
            # The error event starts on a boundary, with no blank line added when not needed.
            assert at_event_boundary(before.encode()), repr(before)
            if case in ("lf", "crlf", "split-blank-line"):
                assert before == (ev.decode().replace("{rid}", shown)
                                  + ("\r\n\r\n" if case == "crlf" else "\n\n"))  # fmt: skip
            if case == "held-id":
                # The start of the internal id was held back, then dropped with the stream.
                assert before.endswith('data: {"id":"cmpl-\n\n') != expose
                assert ("prefill_addr" in text) == expose
    finally:
        await d.stop()


# ---------------------------------------------------------------- tools that read /instances


@pytest.mark.parametrize("expose", [False, True])
async def test_launcher_sees_registrations_with_or_without_addresses(expose):
    from scripts.launch import registered
    from scripts.topology import InstanceSpec, ProxySpec

    async with running_proxy(expose_routing_headers=expose) as px:
        p, d = await px.pd()
        port = int(px.url.rsplit(":", 1)[1])
        spec = ProxySpec("proxy", "127.0.0.1", port, 0)
        insts = [InstanceSpec("p0", "P", "127.0.0.1", p.port, 1), InstanceSpec("d0", "D", "127.0.0.1", d.port, 2)]
        assert await asyncio.to_thread(registered, spec, insts) == {"p0", "d0"}
        two_d = insts + [InstanceSpec("d1", "D", "127.0.0.1", free_port(), 3)]
        assert await asyncio.to_thread(registered, spec, two_d) == {"p0"} | ({"d0"} if expose else set())


# ---------------------------------------------------------------- the proxy's kv_transfer_params

CLIENT_PARAMS = {"xpyd_skip_tokens": 3, "xpyd_prefill_prompt_tokens": 2, "xpyd_debug_corrupt_kv": True,
                 "xpyd_later_field": 1, "xpyd_report_transfer_key": True, "other": {"x": 1}}
KEPT = {"xpyd_report_transfer_key": True, "other": {"x": 1}}


def _params(rec) -> dict:
    return json.loads(rec.body.replace(b"NaN", b"null"))["kv_transfer_params"]


@pytest.mark.parametrize("case", ["disaggregated", "first_token", "local", "unparsed", "chat"])
async def test_a_clients_proxy_fields_in_kv_transfer_params_reach_neither_p_nor_d(case):
    """Every xpyd_* field of kv_transfer_params but those a client may ask with is the proxy's:
    a client's own (xpyd_skip_tokens would steer D's KV plan) is stripped on every path, the
    disaggregated one (P and D), the first token from P (P and D's continuation), D alone, a
    body the proxy cannot read (NaN: vLLM's parser takes it; it goes to one D) and chat."""
    body = {**COMPLETION, "kv_transfer_params": dict(CLIENT_PARAMS)}
    path = "/v1/completions"
    opts = {}
    if case == "first_token":
        body["stream"] = True
    elif case == "local":
        opts["local_prefill_threshold"] = 10_000
    elif case == "chat":
        body = {**CHAT, "kv_transfer_params": dict(CLIENT_PARAMS)}
        path = "/v1/chat/completions"
    async with running_proxy(**opts) as px:
        p, d = await px.pd()
        if case == "unparsed":
            raw = json.dumps({**body, "temperature": float("nan")}).encode()
            assert b"NaN" in raw
            resp = await px.client.post(path, content=raw, headers={"content-type": "application/json"})
        else:
            resp = await px.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        if case == "first_token":
            assert resp.headers[XPYD_FIRST_TOKEN] == "prefill"
        sent = [*p.completions(), *d.completions()]
        assert len(sent) == (1 if case in ("local", "unparsed") else 2), [r.path for r in sent]
        for rec in sent:
            params = _params(rec)
            assert {k: v for k, v in params.items() if k not in KEPT} == \
                ({"xpyd_prefill_prompt_tokens": params.get("xpyd_prefill_prompt_tokens")}
                 if case == "first_token" and rec in d.completions() else {}), (rec.path, params)
            assert {k: params[k] for k in KEPT} == KEPT
        if case == "first_token":  # the proxy's own value, not the client's
            assert _params(d.completions()[0])["xpyd_prefill_prompt_tokens"] != 2


async def test_debug_fields_pass_only_with_forward_debug_params():
    async with running_proxy(forward_debug_params=True) as px:
        p, d = await px.pd()
        resp = await px.client.post("/v1/completions", json={**COMPLETION, "kv_transfer_params": dict(CLIENT_PARAMS)})
        assert resp.status_code == 200
        for rec in (*p.completions(), *d.completions()):
            assert _params(rec) == {**KEPT, "xpyd_debug_corrupt_kv": True}
