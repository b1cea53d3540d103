"""HTTP fuzzing of a running proxy (issue 10): a seeded generator sends random and malformed
requests over raw sockets (garbage request lines, bad or oversized headers, bad
content-length, truncated bodies, non-JSON, JSON of the wrong types, huge numbers, deep
nesting, bad unicode, random paths and methods) to a proxy with fake P and D instances.

Every well-formed request gets a response (never a closed connection); nothing hangs; no
response is HTML or shows a traceback; every error the proxy answers is OpenAI error JSON,
none is a 5xx (P and D are healthy); no error is logged; afterwards nothing is left in flight
and a good request still gets its tokens. Bounded: a fixed number of cases per server
implementation, each under a deadline, the whole run under a time budget.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
import logging
import os
import random
import time
from dataclasses import dataclass

import pytest

from tests.support.proxy_helpers import running_proxy, wait_until

# Other seeds and more cases for a longer hunt: XPYD_FUZZ_SEED=7 XPYD_FUZZ_CASES=3000.
SEED = int(os.environ.get("XPYD_FUZZ_SEED", "10"))
CASES = int(os.environ.get("XPYD_FUZZ_CASES", "260"))  # per HTTP implementation
CASE_DEADLINE_S = 5.0
BUDGET_S = float(os.environ.get("XPYD_FUZZ_BUDGET_S", "20"))
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics",
          "/instances", "/", "/v1", "/v1/completions/", "/v1/nope", "/docs", "/openapi.json"]  # fmt: skip
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "FOO"]
LEAKS = (b"Traceback", b"<html", b"<!DOCTYPE", b'File "', b"Error:", b"object at 0x", b"___prefill_addr_")


@dataclass
class Case:
    kind: str
    data: bytes
    well_formed: bool  # valid HTTP framing: must get a response
    half_close: bool = False  # we send no more: the server sees EOF (truncated input)
    head: bool = False  # a HEAD request: no body in the answer


# ---------------------------------------------------------------- the generator


def _json_value(rng: random.Random, depth: int = 0):
    kinds = ["int", "big", "float", "str", "bool", "null", "list", "dict"] if depth < 4 else ["int", "str"]
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, -1, 1, 2, 7, 2**31, 2**63 - 1, -(2**63)])
    if kind == "big":
        return rng.choice([10**30, -(10**40), 2**64])
    if kind == "float":
        return rng.choice([0.5, -1.5, 1e308, 3.0])
    if kind == "str":
        return rng.choice(["", "x", "tiny", "fake-model", "é" * 5, "\u202e", "a" * 3000, "\x00"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["prompt", "model", "x", "messages"]): _json_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}  # fmt: skip


def _body(rng: random.Random, path: str) -> bytes:
    chat = path.endswith("chat/completions")
    good: dict = ({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]} if chat
                  else {"model": "fake-model", "prompt": "hello"})  # fmt: skip
    good["max_tokens"] = rng.randint(1, 4)
    kind = rng.randrange(16)
    if kind == 0:
        return b""
    if kind == 1:  # not JSON
        return rng.choice([b"nope", b"{", b"{'a': 1}", b"\x00\x01\x02", b"[1,2", b"NaN", b"{}garbage"])
    if kind == 2:  # invalid UTF-8 and lone surrogates
        return rng.choice([b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}', b'{"prompt\xc3": 1}',
                           b'{"messages": [{"role": "user", "content": "\\udfff"}]}'])  # fmt: skip
    if kind == 3:  # deep nesting, in the body or inside a field
        n = rng.choice([50, 600, 2000, 20000])
        inner = b"[" * n + b"]" * n
        return inner if rng.random() < 0.3 else b'{"prompt": "x", "max_tokens": 1, "extra": ' + inner + b"}"
    if kind == 4:  # huge numbers
        big = rng.choice([b"1" * 400, b"1e400", b"-1e400", b"18446744073709551616", b"0.0000001"])
        field = rng.choice([b"max_tokens", b"n", b"temperature", b"prompt", b"stream"])
        return b'{"model": "fake-model", "prompt": "x", "' + field + b'": ' + big + b"}"
    if kind == 5:  # the wrong top-level type
        return json.dumps(_json_value(rng)).encode()
    if kind in (6, 7, 8):  # a good request with one field of the wrong type
        field = rng.choice(["prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
                            "model", "n", "stream_options", "temperature", "prompt"])  # fmt: skip
        return json.dumps({**good, field: _json_value(rng)}).encode()
    if kind == 9:  # duplicate keys, odd whitespace
        return b'{"model": "a", "model": "fake-model", \t\n "prompt": "x", "max_tokens": 2}'
    if kind == 10:  # a long prompt (token-id lists, batches)
        return json.dumps({**good, "prompt": rng.choice([[1] * 5000, ["a", "b", 3], [[1, 2], [3]], "y" * 50000])
                           }).encode()  # fmt: skip
    if kind == 11:  # streaming
        return json.dumps({**good, "stream": True, "stream_options": {"include_usage": True}}).encode()
    return json.dumps(good).encode()


def _request(method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (method.encode(), target.encode("latin-1"))]
    lines += [k + b": " + v for k, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def make_case(rng: random.Random) -> Case:
    kind = rng.choices(["valid", "garbage", "bad_header", "bad_length", "truncated", "extra_bytes"],
                       weights=[12, 2, 2, 2, 2, 1])[0]  # fmt: skip
    path = rng.choice(ROUTES + ["/v1/completions", "/v1/chat/completions"] * 3)
    method = "POST" if path.startswith("/v1/c") and rng.random() < 0.8 else rng.choice(METHODS)
    if rng.random() < 0.1:
        path = rng.choice(["/%00", "/../etc/passwd", "//v1//completions", "/v1/completions?x=1&y",
                           "/" + "a" * 4000, "/%ff%fe", "/v1/models#frag", "*"])  # fmt: skip
    body = _body(rng, path) if method not in ("GET", "HEAD") or rng.random() < 0.2 else b""
    headers = [(b"host", b"proxy"), (b"content-type", b"application/json"), (b"connection", b"close")]
    if rng.random() < 0.2:
        headers.append(rng.choice([(b"authorization", b"Bearer x"), (b"x-request-id", b"mine\x80"),
                                   (b"accept-encoding", b"gzip"), (b"expect", b"100-continue"),
                                   (b"x-long", b"v" * 20000), (b"cookie", b"a=b"),
                                   (b"content-type", b"text/plain"), (b"te", b"trailers")]))  # fmt: skip
    if rng.random() < 0.05:
        headers += [(b"x-h%d" % i, b"%d" % i) for i in range(300)]
    # llhttp (httptools) refuses a method it does not know as a bad request, before any app.
    known = method != "FOO"
    if kind == "valid":
        head = method == "HEAD"
        if rng.random() < 0.1 and body:  # chunked instead of content-length
            chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7])
                               for i in range(0, len(body), 7)) + b"0\r\n\r\n"  # fmt: skip
            return Case(kind, _request(method, path, headers + [(b"transfer-encoding", b"chunked")], chunked),
                        known, head=head)  # fmt: skip
        return Case(kind, _request(method, path, headers + [(b"content-length", b"%d" % len(body))], body),
                    known, head=head)  # fmt: skip
    if kind == "extra_bytes":  # content-length shorter than the body: the rest is another "request"
        data = _request(method, path, headers + [(b"content-length", b"%d" % (len(body) // 2))], body)
        return Case(kind, data + b"\r\n" + bytes(rng.randrange(256) for _ in range(40)), known,
                    head=method == "HEAD")  # fmt: skip
    if kind == "garbage":
        data = rng.choice([
            bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))),
            b"GET\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"POST /v1/completions\r\n\r\n",
            b"\r\n\r\n", b"G E T / HTTP/1.1\r\n\r\n", b"GET /\x00 HTTP/1.1\r\nhost: x\r\n\r\n",
            b"POST /v1/completions HTTP/1.1\r\n",  # no end of the headers
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"GET / HTTP/1.1\r\n" + b"x" * 70000 + b"\r\n\r\n",
        ])  # fmt: skip
        return Case(kind, data, False, half_close=True)
    if kind == "bad_header":
        bad = rng.choice([b"no colon here", b"bad name: 1", b"x-ctl: a\x01b", b" folded: yes",
                          b"x-nul: a\x00b", b": empty name", b"x-huge: " + b"h" * 100_000,
                          b"content-length: 5\r\ncontent-length: 6"])  # fmt: skip
        data = _request(method, path, headers + [(b"content-length", b"%d" % len(body))], body)
        data = data.replace(b"\r\n", b"\r\n" + bad + b"\r\n", 1)
        return Case(kind, data, False, half_close=True)
    if kind == "bad_length":
        cl = rng.choice([b"abc", b"-1", b"1.5", b"99999999999999999999999", b"0x10", b" 5", b""])
        extra = [(b"transfer-encoding", b"chunked")] if rng.random() < 0.3 else []
        return Case(kind, _request(method, path, headers + [(b"content-length", cl)] + extra, body), False,
                    half_close=True)  # fmt: skip
    # truncated: a content-length (or chunks) promising more than is sent, then EOF
    data = _request(method, path, headers + [(b"content-length", b"%d" % (len(body) + 50))], body)
    if rng.random() < 0.3:
        data = data[: rng.randint(1, len(data))]
    return Case(kind, data, False, half_close=True)


# ---------------------------------------------------------------- the checks


async def exchange(host: str, port: int, case: Case) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(case.data)
        if case.half_close:
            writer.write_eof()
        await writer.drain()
        out = bytearray()
        async with asyncio.timeout(CASE_DEADLINE_S):
            while chunk := await reader.read(65536):
                out += chunk
        return bytes(out)
    except (ConnectionResetError, BrokenPipeError):
        return b""  # the server refused the rest of what we sent
    finally:
        writer.close()


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        out, rest = bytearray(), body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out += rest[:n]
            rest = rest[n + 2 :]
        body = bytes(out)
    return status, headers, body


def check(case: Case, raw: bytes) -> str | None:
    """What is wrong with the answer to `case`, or None."""
    if case.well_formed and not raw:
        return "no response to a well-formed request"
    if not raw:
        return None
    if not raw.startswith(b"HTTP/1.1 "):
        return "not an HTTP response"
    for leak in LEAKS:
        if leak in raw:
            return f"response shows {leak!r}"
    status, headers, body = parse_response(raw)
    if "html" in headers.get("content-type", ""):
        return "HTML response"
    if not case.well_formed:  # parsers differ in what they tolerate (h11: " 5", huge headers)
        return f"status {status} for malformed input" if status >= 500 else None
    if status >= 500:
        return f"status {status}"
    if status >= 400 and not case.head:
        if not headers.get("content-type", "").startswith("application/json"):
            return "error without JSON"
        try:
            data = json.loads(body)
            if status in (404, 405) and data == {"detail": HTTPStatus(status).phrase}:
                return None  # a route or method the proxy lacks: vLLM's (FastAPI's) own answer
            err = data["error"]
        except (ValueError, KeyError, TypeError):
            return "error body is not OpenAI error JSON"
        if not (isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
                and isinstance(err["message"], str)):  # fmt: skip
            return "error body is not OpenAI error JSON"
    return None


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_fuzzed_requests_are_answered_and_the_proxy_keeps_serving(http, caplog):
    rng = random.Random(f"{SEED}-{http}")
    t_end = time.monotonic() + BUDGET_S
    with caplog.at_level(logging.WARNING):
        async with running_proxy(http=http, max_body_bytes=1024 * 1024) as px:
            p, d = await px.pd()
            host, port = px.url.removeprefix("http://").split(":")
            failures, kinds, statuses = [], {}, {}
            done = 0
            for i in range(CASES):
                if time.monotonic() > t_end:
                    break
                case = make_case(rng)
                raw = await exchange(host, int(port), case)
                problem = check(case, raw)
                done += 1
                kinds[case.kind] = kinds.get(case.kind, 0) + 1
                key = raw[9:12].decode("latin-1") if raw else "closed"
                statuses[key] = statuses.get(key, 0) + 1
                if problem:
                    failures.append((i, case.kind, problem, case.data[:300], raw[:600]))
            assert not failures, "\n".join(map(repr, failures[:10]))
            # Bounded, but enough of each kind actually ran.
            assert done >= CASES // 2, f"only {done} cases within {BUDGET_S}s"
            assert all(kinds.get(k, 0) >= 5 for k in ("valid", "garbage", "bad_header", "truncated")), kinds
            assert statuses.get("200", 0) >= 20 and statuses.get("400", 0) >= 20, statuses
            # Nothing is left in flight (every cancelled request released its instances).
            await wait_until(lambda: all(i.in_flight == 0 for i in px.registry.all()), what="in flight drained")
            # The proxy still serves a good request, with the right tokens.
            good = await px.client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                                                   "max_tokens": 3})  # fmt: skip
            assert good.status_code == 200 and good.json()["choices"][0]["text"] == " t0 t1 t2"
            stream = await px.client.post("/v1/chat/completions", json={
                "model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True})  # fmt: skip
            assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and not _h11_late_response(http, r)]
    assert not errors, [r.getMessage() for r in errors[:5]]


def _h11_late_response(http: str, record: logging.LogRecord) -> bool:
    """uvicorn's h11 protocol starts the app, then finds the body invalid (e.g. a chunked body
    with a content-length too) and answers 400 itself; the app's own answer then fails with
    h11's LocalProtocolError and is logged. The client got the 400: uvicorn's, not ours."""
    exc = record.exc_info[1] if record.exc_info else None
    return http == "h11" and type(exc).__name__ == "LocalProtocolError"


async def test_bodies_the_fuzzer_found():
    """Each was a 500 "internal proxy error" before: the fuzzer's findings, kept as cases."""
    async with running_proxy() as px:
        p, d = await px.pd()
        # Nested deeper than orjson writes (254) but not than it reads (1024): P's body
        # cannot be built; a 400, and no instance is asked.
        deep = b'{"prompt": "x", "max_tokens": 1, "extra": ' + b"[" * 600 + b"]" * 600 + b"}"
        resp = await px.client.post("/v1/completions", content=deep)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_body"
        assert not p.completions() and not d.completions()
        # A chat body with a "prompt" of another type (only completions check it): served.
        chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for prompt in (-(2**63), None, {"a": 1}, 3.5):
            resp = await px.client.post("/v1/chat/completions", json={**chat, "prompt": prompt})
            assert resp.status_code == 200, resp.text
