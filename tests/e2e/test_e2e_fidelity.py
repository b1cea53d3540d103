"""A client cannot tell the proxy from one vLLM server: the differential suite.

Every request of a matrix (completions and chat, streamed and not; greedy limits, seeded
sampling, penalties, stop strings and tokens, logprobs, echo, usage options, structured
output, batches, vLLM's own refusals) goes once to a colocated vLLM server and once through
the proxy, on prompts that are not ASCII too (emoji, CJK, combining marks, and prompts
whose first generated token is part of a character). The answers must be equal: status,
error type, tokens and their logprobs (tests/support/e2e_client.py's comparator), text, finish
reasons, usage, and the fields of every event (its shape, event by event, however the tokens
were grouped into events). Each request's path through the proxy (x-xpyd-path,
x-xpyd-first-token) is asserted where the case names it (and never a rescue), and recorded: the
last test checks that the matrix covered every path it is meant to. D is reached through a
recording relay (tests/support/tap.py): a comparison that fails writes the proxy's bytes, the
reference's and D's own next to the servers' logs.

Two systems, on real vLLM (CPU build), each with its own colocated reference:
- `shipped`: the proxy and the connector with their shipped defaults, vLLM's own defaults
  (thread binding, kv_load_failure_policy=fail), the tiny model's generation config (which
  sets no sampling value);
- `served`: the same model with a generation_config.json that sets default penalties
  (vLLM applies them where a request leaves the field out) and every server started with
  --response-role, --enable-prompt-tokens-details, --enable-request-id-headers (the proxy too)
  and a tool parser that adjusts chat requests (--tool-call-parser muse_glimmer).
The references compute with the OpenMP thread count P and D have (vLLM reserves a core more
for a server with a KV connector): then their logprobs agree with D's bit for bit on one
box (measured here: 0 difference over the whole matrix); LOGPROB_TOL (0.01, two bf16 steps of
these logits) admits the one step a prefill split differently can move a logprob by.

Deliberate differences from one server (README/docs list them): the response's
`kv_transfer_params` (D's report of the transfer, null on a colocated server) and the
system_fingerprint's value (a hash of each server's config; P's and D's hold the KV
connector's). Neither is compared.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from tests.support import api_fidelity, e2e_cluster
from tests.support.api_fidelity import comparable, diff, summary
from tests.support.e2e_client import (
    LOGPROB_TOL,
    MODEL_DIR,
    Answer,
    answer_of,
    parting_step,
    stream_answers,
    text_parting,
    token_bytes,
    with_token_ids,
)
from tests.support.tap import Tap
from xpyd_wire.headers import XPYD_FIRST_TOKEN, XPYD_PATH

pytestmark = pytest.mark.vllm

cluster = e2e_cluster.cluster
MODEL = "tiny-llama"
CONTEXT = 4096  # tests/support/cluster.py's --max-model-len
# vLLM reserves one core for its scheduler, and one more for a server with a KV connector:
# the reference gets the same reservation, so that it computes with P's and D's thread count.
REFERENCE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}
RESPONSE_ROLE = "narrator"
POOLING_MODEL = "tiny-embed"  # the tiny model served with --runner pooling --convert embed (the served system)
# The `served` model's generation config: penalties vLLM applies where a request leaves them out.
GENERATION_DEFAULTS = {"presence_penalty": 1.2, "frequency_penalty": 0.4, "repetition_penalty": 1.1}
# What else the served system's vLLM servers run with: the prompt-cache figures in usage, the request id
# header, and a tool parser that adjusts a chat request whose tool_choice is not "none" (it keeps
# special tokens: skip_special_tokens false).
SERVED_ARGS = ["--enable-prompt-tokens-details", "--enable-request-id-headers", "--tool-call-parser", "muse_glimmer",
               "--enable-auto-tool-choice"]

# Paths the matrix must take through the proxy (x-xpyd-path, and "first_token" for
# x-xpyd-first-token: prefill), and where each is seen.
SEEN: Counter[str] = Counter()
WANTED_PATHS = {"disaggregated", "first_token", "prefill_alone", "local_short", "local_prompt_logprobs",
                "local_verdict", "first_token_to_decode", "local_stored"}


# ---------------------------------------------------------------- systems


class System:
    def __init__(self, proxy: cluster.Server, prefill: cluster.Server, decode: cluster.Server,
                 colocated: cluster.Server, pooling: cluster.Server | None = None, tap: Tap | None = None,
                 log_dir: Path | None = None, sequential: cluster.Server | None = None) -> None:
        self.proxy, self.prefill, self.decode, self.colocated = proxy, prefill, decode, colocated
        # The shipped dispatch (concurrent) gives every request D's first token; a second proxy
        # on the same instances dispatches sequentially, so P's token path is exercised too.
        self.sequential = sequential or proxy
        self.pooling = pooling  # a static P of another model, served as an embedding model
        self.tap = tap  # D's recording relay: the proxy reaches D through it
        self.log_dir = log_dir
        self.dumps: Counter[str] = Counter()  # dumps written, per kind (_dump)
        self.raw: dict[str, bytes] = {}  # the last answer's bytes from each url (call())
        self.client = httpx.Client(timeout=120)

    def servers(self) -> list[cluster.Server]:
        return ([self.proxy, self.prefill, self.decode, self.colocated] + ([self.pooling] if self.pooling else [])
                + ([self.sequential] if self.sequential is not self.proxy else []))

    def stop(self) -> None:
        self.client.close()
        for s in self.servers():
            s.stop()
        if self.tap is not None:
            self.tap.close()


def _start(log_dir: Path, model: Path, vllm_args: list[str], env: dict[str, str] | None = None,
           pooling: bool = False, proxy_args: list[str] | None = None) -> System:
    discs = [e2e_cluster.free_port(), e2e_cluster.free_port()]
    pool_port = e2e_cluster.free_port()
    # The shipped defaults, but a request may ask D to zero its KV (the power test); with `pooling`,
    # a static P serving the tiny model as an embedding model too. The second proxy dispatches
    # sequentially (System.sequential).
    args = ["--forward-debug-params"] + (["--prefill", f"http://127.0.0.1:{pool_port}"] if pooling else []) + (
        proxy_args or [])
    proxy = cluster.start_proxy(e2e_cluster.free_port(), discs[0], log_dir, args)
    sequential = cluster.start_proxy(e2e_cluster.free_port(), discs[1], log_dir, args + ["--dispatch", "sequential"],
                                     name="proxy-sequential")
    started = [proxy, sequential]
    tap = None
    try:
        pool = None
        if pooling:
            pool = cluster.start_vllm("pooling", pool_port, log_dir, model=model, env=e2e_cluster.bind_env(None),
                                      extra_args=["--runner", "pooling", "--convert", "embed",
                                                  "--served-model-name", POOLING_MODEL])
            started.append(pool)
        servers = []
        for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            kv = cluster.kv_transfer_config(role, e2e_cluster.free_port_pair(), port := e2e_cluster.free_port(), None,
                                            proxies=[f"{cluster.HOST}:{d}" for d in discs], heartbeat_interval_s=1.0)
            kv.pop("kv_load_failure_policy")  # vLLM's default: fail
            if role == "kv_consumer":  # lets a request ask D to zero what it loads (the power test)
                kv["kv_connector_extra_config"]["allow_debug_corruption"] = True
                # D registers the relay's port as its own: the proxy's requests and D's answers pass it.
                tap = Tap(port)
                kv["kv_connector_extra_config"]["http_port"] = tap.port
            servers.append(cluster.start_vllm(name, port, log_dir, model=model, kv_config=kv, extra_args=vllm_args,
                                              env={**e2e_cluster.bind_env(None), **(env or {})}))
            started.append(servers[-1])
        colocated = cluster.start_vllm("colocated", e2e_cluster.free_port(), log_dir, model=model,
                                       extra_args=vllm_args,
                                       env={**e2e_cluster.bind_env(None), **REFERENCE_ENV, **(env or {})})
        started.append(colocated)
        cluster.wait_until(started, "/health", 600)
        for front in (proxy, sequential):
            e2e_cluster.wait_instances(front, 1 + pooling, 1)
        return System(proxy, servers[0], servers[1], colocated, pool, tap, log_dir, sequential)
    except BaseException:
        for s in started:
            s.stop()
        if tap is not None:
            tap.close()
        raise


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory):
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    s = _start(tmp_path_factory.mktemp("fidelity-shipped"), MODEL_DIR, [])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, shipped: System):
    """Started after `shipped` is done with (the module's tests run in file order)."""
    shipped.stop()
    model = tmp_path_factory.mktemp("penalised-model")
    for f in MODEL_DIR.iterdir():
        (model / f.name).symlink_to(f)
    (model / "generation_config.json").unlink()
    gen = json.loads(MODEL_DIR.joinpath("generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, **GENERATION_DEFAULTS}))
    # Stored responses (vLLM's store is off by default) and the tokens-in generate route on too.
    s = _start(tmp_path_factory.mktemp("fidelity-served"), model, ["--response-role", RESPONSE_ROLE, "--enable-scale-out",
                                                                  *SERVED_ARGS],
               {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}, pooling=True, proxy_args=["--enable-request-id-headers"])
    yield s
    s.stop()


# ---------------------------------------------------------------- requests and comparison


def call(s: System, url: str, path: str, body: Any, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict, Any]:
    """One request: (status, response headers, the JSON answer or, for a stream, its events
    with [DONE] as the string). The bytes as they came are kept in s.raw[url]."""
    content = raw if raw is not None else json.dumps(body).encode()
    with s.client.stream("POST", url + path, content=content,
                         headers={"content-type": "application/json", **(headers or {})}) as r:
        data = r.read()
        status, head = r.status_code, dict(r.headers)
    s.raw[url] = data
    if head.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in data.decode().split("\n\n") if ln.startswith("data: ")]
        return status, head, [e if e == "[DONE]" else json.loads(e) for e in events]
    try:
        return status, head, json.loads(data)
    except ValueError:
        return status, head, data.decode(errors="replace")


def _parted_at_a_near_tie(got: dict[int, Answer], want: dict[int, Answer], s: System, path: str,
                         body: dict) -> bool:
    """Whether the answers part, and only at a near tie (see e2e_client.NEAR_TIE): with
    logprobs in both, the comparator judges; without, the reference is asked again with them
    and judges alone. Answers that never part are no excuse for any other difference."""
    parted = False
    for i, w in want.items():
        g = got.get(i)
        if g is None:
            return False
        if w.tokens and g.tokens:
            step, why = parting_step(g, w, LOGPROB_TOL)
            if why is not None:
                return False
            parted |= step < len(w.tokens)
            continue
        chat = path.endswith("chat/completions")
        extra = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
        status, _, ref = call(s, s.colocated.url, path, with_token_ids({**body, **extra, "stream": False}))
        if status != 200:
            return False
        ref_answer = answer_of(ref["choices"][i])
        skip = body.get("skip_special_tokens") is not False
        step, tie = text_parting(str(g), ref_answer, token_bytes(skip))
        if step < len(ref_answer.tokens):
            if not tie:
                return False
            parted = True
    return parted


class Route(NamedTuple):
    """The path a case is to take through the proxy: x-xpyd-path, and whether P's token starts
    the answer (x-xpyd-first-token: prefill; True: unless P's token is part of a character, which
    the proxy then counts as held back, and D answers)."""

    path: str
    first: bool = False


SEQUENTIAL = Route("disaggregated")
FIRST = Route("disaggregated", True)
ALONE = Route("prefill_alone", True)


def _held_back(front: cluster.Server) -> float:
    """First tokens from P the proxy held back (part of a character), so far."""
    text = cluster.http_get(front.url + "/metrics")[1].decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith('xpyd_first_token_to_decode_total{reason="held_back"}'))


def _dump(s: System, what: str, why: str, got: bytes, want: bytes, d_bytes: list[tuple[bytes, bytes]],
          kind: str = "failure") -> str:
    """The failing case's bytes next to the servers' logs: the proxy's answer, the reference's,
    and what D was sent and answered meanwhile (its relay's record). ``kind`` names the file: a
    power test's difference is its aim (`expected-N.txt`), not a failure to diagnose."""
    if s.log_dir is None:
        return ""
    s.dumps[kind] += 1
    out = s.log_dir / f"{kind}-{s.dumps[kind]}.txt"
    parts = [f"{what}\n{why}\n", "---- proxy\n", got.decode(errors="replace"),
             "\n---- reference\n", want.decode(errors="replace")]
    for n, (sent, answered) in enumerate(d_bytes):
        parts += [f"\n---- D connection {n}: sent\n", sent.decode(errors="replace"),
                  f"\n---- D connection {n}: answered\n", answered.decode(errors="replace")]
    out.write_text("".join(parts))
    return f" (bytes: {out})"


def check(s: System, path: str, body: Any, raw: bytes | None = None, *, tied_ok: bool = True,
          route: Route | None = None, headers: dict[str, str] | None = None, sequential: bool = False,
          expected: bool = False) -> dict:
    """Send the request to the colocated server and through the proxy; assert the answers
    are equal (see the module's text) and, with ``route``, that the proxy took that path; never a
    rescue (D alone after a failed load: the equality could not show one). A route with P's token,
    or ``sequential``, goes through the sequential proxy (System.sequential). ``expected``: a power
    test, which wants the difference (its dump is named so). Returns the proxy's response headers."""
    front = s.sequential if sequential or (route is not None and route.first) else s.proxy
    want_status, _, want = call(s, s.colocated.url, path, body, raw, headers)
    held = _held_back(front) if route is not None and route.first else 0.0
    mark = s.tap.mark() if s.tap is not None else {}
    got_status, head, got = call(s, front.url, path, body, raw, headers)
    bytes_got, bytes_want = s.raw[front.url], s.raw[s.colocated.url]  # before a near tie's judge asks again
    _seen(head)
    what = f"{path} {json.dumps(body)[:300] if raw is None else raw[:80]!r} via {head.get(XPYD_PATH)}"
    assert head.get(XPYD_PATH) != "local_rescue", f"{what}: rescued"
    assert got_status == want_status, f"{what}: status {got_status} vs {want_status}: {got!r:.400} / {want!r:.400}"
    if route is not None and want_status == 200:
        # A refusal has no path to check: under concurrent dispatch P and D refuse at once, and
        # whichever answers first is relayed (D's without the dispatch headers).
        taken = head.get(XPYD_PATH), head.get(XPYD_FIRST_TOKEN) == "prefill"
        assert taken == tuple(route) or (route.first and taken == (route.path, False) and _held_back(front) > held), \
            f"{what}: took {taken}, not {tuple(route)}"
    if want_status != 200:
        # vLLM's refusal: the same status, error type and parameter (the message may name a
        # request id or an address).
        assert isinstance(got, dict) and isinstance(want, dict), (what, got, want)
        for k in ("type", "param", "code"):
            assert got["error"].get(k) == want["error"].get(k), f"{what}: error {got} vs {want}"
        return head
    chat = path.endswith("chat/completions")
    if isinstance(want, list) and isinstance(got, list):  # streams
        d = diff(*comparable(summary(got, chat), summary(want, chat)))
    else:
        d = diff(got, want)
    if d is not None and tied_ok and isinstance(body, dict):
        if isinstance(want, list):
            g, w = stream_answers(got), stream_answers(want)
        else:
            g = {c["index"]: answer_of(c) for c in got["choices"]}
            w = {c["index"]: answer_of(c) for c in want["choices"]}
        if _parted_at_a_near_tie(g, w, s, path, body):
            return head  # a legitimate near tie (see e2e_client.NEAR_TIE): nothing after it is comparable
    if d is not None:
        d += _dump(s, what, d, bytes_got, bytes_want, s.tap.since(mark) if s.tap is not None else [],
                   "expected" if expected else "failure")
    assert d is None, f"{what}: {d}"
    return head


def _seen(head: dict) -> None:
    path = head.get(XPYD_PATH)
    if path:
        SEEN[path] += 1
    if head.get(XPYD_FIRST_TOKEN) == "prefill":
        SEEN["first_token"] += 1


# ---------------------------------------------------------------- prompts

TEXTS = {
    "ascii": "The river runs past the old mill, and the miller counts the sacks of grain one by one. ",
    "emoji": "Weather today 🌦️ then sun ☀️, later a rainbow 🌈 over the hills 🏔️ and the sea 🌊! ",
    "cjk": "今天天气很好，我们去公园散步吧。山上的樱花已经开了，风很轻。東京の朝はとても静かです。",
    "combining": ("Cafe\u0301 na\u0131\u0308ve re\u0301sume\u0301 — Zo\u0308e\u0308 and A\u030angstro\u0308m "
                  "met at the fjord. "),
}


def long(text: str, chars: int = 900) -> str:
    """Over the proxy's shipped local_prefill_threshold (128 estimated tokens, 4 chars each)."""
    return (text * (chars // len(text) + 1))[:chars]


def completion(prompt: Any, **fields: Any) -> dict:
    return {"model": MODEL, "prompt": prompt, "temperature": 0, **fields}


def chat(content: str, system: str | None = None, **fields: Any) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "temperature": 0, **fields}


def continuing(text: str, **fields: Any) -> dict:
    """A chat request that continues the assistant's message (``text``): the answer's first
    token depends on how that text ends, where after a generation prompt it depends mostly
    on the template's last tokens."""
    return {"model": MODEL, "temperature": 0, "add_generation_prompt": False, "continue_final_message": True,
            "messages": [{"role": "system", "content": "Tell the story."}, {"role": "user", "content": "Go on."},
                         {"role": "assistant", "content": text}], **fields}


def _first_token_of(s: System, path: str, body: dict) -> tuple[str, int]:
    _, _, data = call(s, s.colocated.url, path, {**body, "max_tokens": 1, "return_token_ids": True})
    ch = data["choices"][0]
    return (ch["message"]["content"] if "message" in ch else ch["text"]), ch["token_ids"][0]


@pytest.fixture(scope="module")
def partial_prompts(shipped: System) -> dict[str, str]:
    """Prompts whose greedy first token is part of a character (vLLM answers "" for it),
    found by a deterministic search over slices of the texts (about one in five)."""
    found: dict[str, str] = {}
    pool = "".join(TEXTS.values()) * 8
    for k in range(120):
        start = (k * 37) % (len(pool) - 700)
        prompt = pool[start:start + 600 + k % 50]
        for path, kind, body in (("/v1/completions", "completions", completion(prompt)),
                                 ("/v1/chat/completions", "chat", continuing(prompt))):
            if kind in found:
                continue
            text, _ = _first_token_of(shipped, path, body)
            if text == "":
                found[kind] = prompt
        if len(found) == 2:
            return found
    pytest.fail(f"no prompt with a partial first token in 120 candidates (found {sorted(found)})")


# ---------------------------------------------------------------- the matrix

GREEDY = [
    pytest.param({"max_tokens": 1}, id="max1"),
    pytest.param({"max_tokens": 2}, id="max2"),
    pytest.param({"max_tokens": 17}, id="max17"),
    pytest.param({}, id="max-absent"),
    pytest.param({"max_tokens": None}, id="max-null"),
]


@pytest.mark.parametrize("limits", GREEDY)
@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("text", sorted(TEXTS))
def test_completions_equal_colocated(shipped, text, stream, limits):
    route = (ALONE if limits.get("max_tokens") == 1 else FIRST) if stream else SEQUENTIAL
    check(shipped, "/v1/completions", completion(long(TEXTS[text]), stream=stream, logprobs=2, **limits), route=route)


@pytest.mark.parametrize("limits", [pytest.param({"max_tokens": 1}, id="max1"),
                                    pytest.param({"max_completion_tokens": 9}, id="max9"),
                                    pytest.param({"max_tokens": 9, "max_completion_tokens": None}, id="max9-legacy")])
@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("text", sorted(TEXTS))
def test_chat_equal_colocated(shipped, text, stream, limits):
    body = chat(long(TEXTS[text], 700), system="You answer in one short sentence.", stream=stream, **limits)
    route = (ALONE if limits.get("max_tokens") == 1 else FIRST) if stream else SEQUENTIAL
    check(shipped, "/v1/chat/completions", body, route=route)


_FITTED: dict[int, str] = {}


def _chat_prompt_tokens(s: System, content: str) -> int:
    """The rendered prompt's length of chat(content), as the reference's /tokenize counts it
    (no prefill: a prompt over the context costs nothing to measure)."""
    r = s.client.post(s.colocated.url + "/tokenize", json={"model": MODEL, "messages": chat(content)["messages"]})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def fitted(s: System, left: int) -> dict:
    """A chat request without a limit whose rendered prompt leaves ``left`` tokens of the context
    (or up to 2 more): the longest cut of a long text that fits, found by bisection on its length
    in characters (once per ``left``) and checked against the reference's usage."""
    body = chat(long(TEXTS["ascii"], CONTEXT * 8))
    if left not in _FITTED:
        content = body["messages"][-1]["content"]
        want = CONTEXT - left
        lo, hi = 1, len(content)  # tokens(content[:lo]) <= want < tokens(content[:hi])
        assert _chat_prompt_tokens(s, content) > want
        for _ in range(40):
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _chat_prompt_tokens(s, content[:mid]) <= want else (lo, mid)
        _FITTED[left] = content[:lo]
        _, _, data = call(s, s.colocated.url, "/v1/chat/completions", {**chat(content[:lo]), "max_tokens": 1})
        assert want - 2 <= data["usage"]["prompt_tokens"] <= want, (data["usage"], want)
    body["messages"][-1]["content"] = _FITTED[left]
    return body


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_chat_without_a_limit_runs_to_the_context_end(shipped, stream):
    """No limit: the answer ends at EOS or the context (D's continuation gets what is left
    of it after P's prompt and token): the prompt leaves 20 tokens (or up to 22)."""
    body = fitted(shipped, 20)
    assert CONTEXT - 22 <= _chat_prompt_tokens(shipped, body["messages"][-1]["content"]) <= CONTEXT - 20
    check(shipped, "/v1/chat/completions", {**body, "stream": stream}, route=FIRST if stream else SEQUENTIAL)


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_long_answer_to_the_context_end(shipped, kind):
    """~800 tokens streamed to the context's end (issue 48: a loaded proxy read D's stream 64 KiB and
    more at a time, and the event such a read ended inside went out unrewritten: a text offset not
    moved past P's token, a chat chunk left a completion and its text lost). The completion is the
    chat's rendered prompt as token ids, with logprobs: a KV difference shows as a logprob off."""
    body = {**fitted(shipped, 800), "stream": True}
    if kind == "chat":
        check(shipped, "/v1/chat/completions", body, route=FIRST)
        return
    _, _, data = call(shipped, shipped.colocated.url, "/v1/chat/completions",
                      {**body, "stream": False, "max_tokens": 1, "return_token_ids": True})
    ids = data["prompt_token_ids"]
    check(shipped, "/v1/completions", completion(ids, max_tokens=CONTEXT - len(ids), logprobs=2, stream=True),
          route=FIRST)


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_first_token_that_is_part_of_a_character(shipped, partial_prompts, kind, stream):
    """The leak: P's token is the first byte of a character, vLLM holds it back ("" text).
    Through the proxy the answer was the whole prompt (chat: the rendered template) and then
    the answer. Streamed, the proxy now leaves it to D's first token."""
    for limit in (6, 1):
        if kind == "completions":
            head = check(shipped, "/v1/completions", completion(partial_prompts[kind], max_tokens=limit, stream=stream),
                         sequential=True)
        else:
            head = check(shipped, "/v1/chat/completions", continuing(partial_prompts[kind], max_tokens=limit,
                                                                      stream=stream), sequential=True)
        if stream and limit > 1:
            assert head.get(XPYD_FIRST_TOKEN) is None and head[XPYD_PATH] == "disaggregated"
            SEEN["first_token_to_decode"] += 1


# Each with whether a stream of it may start with P's token (first_token.eligible).
SAMPLING = [
    pytest.param({"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1234}, False, id="seeded"),
    pytest.param({"presence_penalty": 0.7}, False, id="presence"),
    pytest.param({"frequency_penalty": 0.5}, False, id="frequency"),
    pytest.param({"repetition_penalty": 1.3}, True, id="repetition"),
    pytest.param({"min_tokens": 6, "max_tokens": 8}, True, id="min-tokens"),
    pytest.param({"ignore_eos": True, "max_tokens": 12}, True, id="ignore-eos"),
    pytest.param({"n": 2, "max_tokens": 5}, False, id="n2"),
    pytest.param({"skip_special_tokens": False}, True, id="special-tokens"),
    pytest.param({"logit_bias": {"100": 5.0}}, True, id="logit-bias"),
]


# Streams only (vLLM refuses stream_options otherwise: compared among the refusals). Values vLLM's
# model reads as true (1, "yes", "true": pydantic's bool in lax mode) are true to the proxy too.
USAGE = [
    pytest.param({"stream_options": {"include_usage": True}}, True, id="usage"),
    pytest.param({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, True,
                 id="usage-continuous"),
    pytest.param({"stream_options": {"include_usage": 1}, "max_tokens": 1}, True, id="usage-coerced-one-token"),
    pytest.param({"stream_options": {"include_usage": "yes", "continuous_usage_stats": "true"}}, True,
                 id="usage-coerced-continuous"),
]


@pytest.mark.parametrize("fields, stream, first",
                         [pytest.param(p.values[0], s, p.values[1], id=f"{p.id}-{'sse' if s else 'json'}")
                          for p in SAMPLING for s in (True, False)]
                         + [pytest.param(*p.values[:1], True, p.values[1], id=f"{p.id}-sse") for p in USAGE])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_sampling_fields_equal_colocated(shipped, kind, stream, first, fields):
    fields = {"max_tokens": 10, **fields, "stream": stream}
    route = (ALONE if fields["max_tokens"] == 1 else FIRST) if stream and first else SEQUENTIAL
    if kind == "completions":
        check(shipped, "/v1/completions", completion(long(TEXTS["ascii"]), **fields), route=route)
    else:
        check(shipped, "/v1/chat/completions", chat(long(TEXTS["emoji"], 700), **fields), route=route)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_stop_string_that_spans_ps_token_and_ds_first(shipped, stream, include):
    """A stop string made of the end of the first token's text and the start of the second's:
    P's token alone cannot see it (such requests keep D's first token)."""
    prompt = long(TEXTS["ascii"])
    _, _, ref = call(shipped, shipped.colocated.url, "/v1/completions", completion(prompt, max_tokens=4, logprobs=1))
    tokens = ref["choices"][0]["logprobs"]["tokens"]
    stop = tokens[0][-1:] + tokens[1][:2]
    assert stop.strip(), tokens
    check(shipped, "/v1/completions", completion(prompt, max_tokens=8, stop=[stop], stream=stream,
                                                 include_stop_str_in_output=include), route=SEQUENTIAL)
    _, tid = _first_token_of(shipped, "/v1/completions", completion(prompt))
    check(shipped, "/v1/completions", completion(prompt, max_tokens=8, stop_token_ids=[tid], stream=stream),
          route=FIRST if stream else SEQUENTIAL)


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_echo_and_prompt_scoring(shipped, stream):
    """echo, and how eval harnesses score a prompt (echo, logprobs, max_tokens 0): the proxy
    answered its own 400 for max_tokens 0; vLLM answers the prompt with its logprobs."""
    prompt = long(TEXTS["cjk"], 600)
    check(shipped, "/v1/completions", completion(prompt, echo=True, max_tokens=4, stream=stream), route=SEQUENTIAL)
    scoring = Route("local_prompt_logprobs")
    check(shipped, "/v1/completions", completion(prompt, echo=True, logprobs=1, max_tokens=4, stream=stream),
          route=scoring)
    # echo as vLLM's model reads a bool (1 is true): the prompt's logprobs too
    check(shipped, "/v1/completions", completion(prompt, echo=1, logprobs=1, max_tokens=4, stream=stream),
          route=scoring)
    if not stream:
        check(shipped, "/v1/completions", completion(prompt, echo=True, logprobs=1, max_tokens=0), route=scoring)
    check(shipped, "/v1/completions", completion(prompt, prompt_logprobs=1, max_tokens=3, stream=stream),
          route=scoring)


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_batch_and_token_id_prompts(shipped, stream):
    a, b = long(TEXTS["ascii"]), long(TEXTS["combining"])
    check(shipped, "/v1/completions", completion([a, b], max_tokens=5, stream=stream), route=SEQUENTIAL)
    _, _, data = call(shipped, shipped.colocated.url, "/v1/completions",
                      completion(b, max_tokens=1, return_token_ids=True))
    ids = data["choices"][0]["prompt_token_ids"]
    check(shipped, "/v1/completions", completion(ids, max_tokens=7, logprobs=1, stream=stream),
          route=FIRST if stream else SEQUENTIAL)
    check(shipped, "/v1/completions", completion(ids, max_tokens=7, stream=stream, return_tokens_as_token_ids=True,
                                                 logprobs=1), route=SEQUENTIAL)


@pytest.mark.parametrize("fmt", [pytest.param({"type": "json_object"}, id="json_object"),
                                 pytest.param({"type": "json_schema", "json_schema": {
                                     "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                             "required": ["a"]}}}, id="json_schema")])
def test_structured_output(shipped, fmt):
    check(shipped, "/v1/chat/completions", chat(long(TEXTS["ascii"], 600), response_format=fmt, max_tokens=12),
          route=SEQUENTIAL)


def test_a_chat_with_history(shipped):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": long(TEXTS["cjk"], 500)},
                {"role": "assistant", "content": "好的。"}, {"role": "user", "content": long(TEXTS["emoji"], 500)}]
    for stream in (True, False):
        check(shipped, "/v1/chat/completions", {"model": MODEL, "messages": messages, "temperature": 0,
                                                "max_tokens": 8, "stream": stream}, route=FIRST if stream else SEQUENTIAL)
    check(shipped, "/v1/chat/completions", {"model": MODEL, "messages": messages[:-1], "temperature": 0,
                                            "max_tokens": 8, "stream": True, "add_generation_prompt": False,
                                            "continue_final_message": True}, route=FIRST)


def test_short_prompts_are_answered_by_d_alone_and_equal(shipped):
    for stream in (True, False):
        check(shipped, "/v1/completions", completion("Hi there 👋", max_tokens=6, logprobs=2, stream=stream),
              route=Route("local_short"))


REFUSALS = [
    ("/v1/completions", completion("x" * 600, max_tokens=0)),
    ("/v1/completions", completion("x" * 600, max_tokens=-1)),
    ("/v1/completions", completion("x" * 600, max_tokens=CONTEXT + 1)),
    ("/v1/completions", completion("x" * 600, max_tokens=3, min_tokens=5, stream=True)),
    ("/v1/completions", completion("x" * 600, max_tokens=1, min_tokens=2, stream=True)),
    ("/v1/completions", completion("x" * 600, temperature=-1)),
    ("/v1/completions", completion("x" * 600, n=0)),
    ("/v1/completions", completion("x" * 600, logprobs=50, stream=True)),
    ("/v1/completions", completion("x" * 600, top_p=2.0)),
    ("/v1/completions", completion("x" * 600, stream_options={"include_usage": True})),
    ("/v1/completions", {"model": MODEL}),
    ("/v1/completions", completion([])),
    ("/v1/completions", completion(5)),
    ("/v1/completions", completion("x" * 600, stream="yes", max_tokens="3")),  # vLLM converts both: a 200
    ("/v1/completions", completion("x" * 600, model="no-such-model")),
    ("/v1/completions", completion("x" * (CONTEXT * 5), max_tokens=5)),  # prompt over the context
    ("/v1/chat/completions", {"model": MODEL}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/chat/completions", chat("x" * 600, max_completion_tokens=0, stream=True)),
    ("/v1/chat/completions", chat("x" * 600, stream=True, chat_template="{{ 'INJECTED' }}")),
    ("/v1/chat/completions", chat("x" * 600, stream=True, chat_template_kwargs={"chat_template": "{{ 'X' }}"})),
    # A prompt over the context cut to it (-1) with no limit left for the answer: vLLM's 400 (P, asked for
    # one token, cut one more and answered).
    ("/v1/chat/completions", chat("hi " * 5000, stream=True, truncate_prompt_tokens=-1)),
    ("/v1/completions", completion("hi " * 5000, stream=True, truncate_prompt_tokens=-1, max_tokens=None)),
    ("/v1/completions", completion("x" * 600, stream=True, stream_options={"include_usage": "maybe"})),
]


@pytest.mark.parametrize("path, body", REFUSALS, ids=[f"{i}" for i in range(len(REFUSALS))])
def test_what_vllm_refuses_is_refused_the_same_way(shipped, path, body):
    check(shipped, path, body, tied_ok=False)


def test_a_prompt_over_the_context_cut_to_it_with_a_limit(shipped):
    """truncate_prompt_tokens -1 with a limit: vLLM keeps the context less one, as P does: P's
    token may start the answer."""
    for body in (chat("hi " * 5000, stream=True, truncate_prompt_tokens=-1, max_tokens=3),
                 completion("hi " * 5000, stream=True, truncate_prompt_tokens=-1, max_tokens=3)):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        check(shipped, path, body, route=FIRST)


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("given", ["header", "body", "neither"])
def test_the_answer_is_named_as_vllm_names_it(shipped, stream, given):
    """The client's own id (X-Request-Id, else the body's request_id) names the answer, else an id of
    vLLM 0.32's shape (16 hex); no X-Request-Id header (vLLM sends one only when told to)."""
    headers = {"X-Request-Id": "client-id-1"} if given == "header" else {}
    extra = {"request_id": "client-id-1"} if given == "body" else {}
    for path, body in (("/v1/completions", completion(long(TEXTS["cjk"]), max_tokens=4, stream=stream, **extra)),
                       ("/v1/chat/completions", chat(long(TEXTS["cjk"]), max_tokens=4, stream=stream, **extra))):
        check(shipped, path, body, headers=headers, route=FIRST if stream else SEQUENTIAL)
        prefix = "chatcmpl-" if "messages" in body else "cmpl-"
        named = prefix + "client-id-1" if given != "neither" else None
        for url in (shipped.colocated.url, shipped.proxy.url):
            status, head, got = call(shipped, url, path, body, headers=headers)
            ids = {e["id"] for e in got[:-1]} if stream else {got["id"]}
            assert (ids == {named}) if named else (len(ids) == 1 and re.fullmatch(prefix + "[0-9a-f]{16}", ids.pop())), \
                (url, ids)
            assert "x-request-id" not in head, (url, head)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]"])
def test_bodies_the_proxy_cannot_read_get_vllms_own_answer(shipped, raw):
    head = check(shipped, "/v1/completions", None, raw)
    assert head[XPYD_PATH] == "local_verdict"


def test_prompt_one_token_short_of_the_context(shipped):
    """The answer has room for one token: vLLM gives it, with finish_reason length (D got
    max_tokens 0 and refused it, as an error event after P's token)."""
    check(shipped, "/v1/chat/completions", {**fitted(shipped, 1), "stream": True, "max_tokens": 5}, route=FIRST)


@pytest.mark.parametrize("held", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_power_corrupted_kv_is_caught(shipped, stream, held):
    """The comparison can fail: D zeroes the KV it loads (a debug switch of the connector),
    and the answer through the proxy is no longer the colocated server's. All of the prompt's,
    or (``held``) only the part D lacks: D holds the prompt's full blocks from an earlier answer,
    and P ships the rest (105 of 362 tokens; zeroed, they moved the first token's logprob by 0.037
    and parted at step 1: e2e_client.LOGPROB_TOL). Each case has a prompt of its own: D caches the
    full blocks it loaded, zeroed ones too, and no other case may read them."""
    prompt = f"[power {stream} {held}] " + long(TEXTS["ascii"])
    if held:  # D computes and caches the prompt's full blocks, uncorrupted
        call(shipped, shipped.decode.url, "/v1/completions", completion(prompt, max_tokens=1))
    body = completion(prompt, max_tokens=12, logprobs=2, stream=stream,
                      kv_transfer_params={"xpyd_debug_corrupt_kv": True})
    with pytest.raises(AssertionError):
        check(shipped, "/v1/completions", body, tied_ok=False, expected=True)
    zeroed = [ln for ln in shipped.decode.log().splitlines() if "CORRUPTED(test)" in ln]
    loaded = int(re.search(r" tokens=(\d+) ", zeroed[-1]).group(1))
    assert (loaded < 128) if held else (loaded > 256), zeroed[-1]  # the part D lacked (one block), or all


# ---------------------------------------------------------------- the other routes (proxy/api_routes.py)


def check_api(s: System, path: str, body: Any) -> dict:
    """check() for the Responses, Messages and generate routes and the generation-free ones: the
    same status; a refusal's error fields but its message; an answer field for field (ids,
    times and fingerprints by presence); a stream as a client reads it (tests/support/api_fidelity.py)."""
    want_status, _, want = call(s, s.colocated.url, path, body)
    got_status, head, got = call(s, s.proxy.url, path, body)
    _seen(head)
    what = f"{path} {json.dumps(body)[:200]} via {head.get(XPYD_PATH)}"
    assert got_status == want_status, f"{what}: status {got_status} vs {want_status}: {got!r:.400} / {want!r:.400}"
    if want_status != 200 and isinstance(want, dict) and isinstance(got, dict) and isinstance(want.get("error"), dict):
        strip = ("message",)
        want = {**want, "error": {k: v for k, v in want["error"].items() if k not in strip}}
        got = {**got, "error": {k: v for k, v in got["error"].items() if k not in strip}}
    elif isinstance(want, list) and isinstance(got, list):
        summarise = {"/v1/responses": api_fidelity.responses_stream, "/v1/messages": api_fidelity.messages_stream,
                     "/inference/v1/generate": _generated}[path]
        got, want = summarise(got), summarise(want)
    d = diff(got, want)
    assert d is None, f"{what}: {d}"
    return head


def _generated(events: list) -> dict:
    """A generate stream: its tokens and finish reasons, however grouped; [DONE] last."""
    tokens = [t for e in events[:-1] for ch in e["choices"] for t in ch["token_ids"]]
    return {"tokens": tokens, "finish": [ch["finish_reason"] for e in events[:-1] for ch in e["choices"]][-1],
            "done": events[-1]}


def responses_body(text: str, **fields: Any) -> dict:
    # A prefix of its own: the colocated server and P are both cold for it (the usage counts cache hits).
    return {"model": MODEL, "input": f"[responses {len(text)} {sorted(fields)}] " + text, "temperature": 0,
            "max_output_tokens": 12, **fields}


def message_body(text: str, **fields: Any) -> dict:
    return {"model": MODEL, "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": text}],
            **fields}


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("text", sorted(TEXTS))
def test_responses_equal_colocated(shipped, text, stream):
    head = check_api(shipped, "/v1/responses", responses_body(long(TEXTS[text]), stream=stream))
    assert head[XPYD_PATH] == "disaggregated"


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("text", sorted(TEXTS))
def test_messages_equal_colocated(shipped, text, stream):
    head = check_api(shipped, "/v1/messages", message_body(long(TEXTS[text]), stream=stream,
                                                           system="You answer in one line."))
    assert head[XPYD_PATH] == "disaggregated"


def test_responses_and_messages_with_tools_and_instructions_equal_colocated(shipped):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    for stream in (True, False):
        check_api(shipped, "/v1/responses", responses_body(long(TEXTS["cjk"]), stream=stream, tools=[tool],
                                                           instructions="Use the tool when asked.",
                                                           include=["message.output_text.logprobs"], top_logprobs=2))
        check_api(shipped, "/v1/messages", message_body(long(TEXTS["emoji"]), stream=stream, tools=[{
            "name": "get_weather", "description": "The weather", "input_schema": tool["parameters"]}]))


def _sdk_answers(url: str, text: str) -> dict:
    """What the openai SDK (Responses, with a tool definition) and the anthropic SDK (Messages)
    read from `url`, whole and streamed."""
    import anthropic
    import openai

    oc = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    tool = {"type": "function", "name": "lookup", "description": "Look a word up",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}
    ask = {"model": MODEL, "input": "[sdk] " + text, "max_output_tokens": 10, "temperature": 0, "tools": [tool]}
    whole = oc.responses.create(**ask)
    with oc.responses.stream(**ask) as events:
        kinds = [e.type for e in events]
        streamed = events.get_final_response()
    ac = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    msg = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": text}],
           "extra_body": {"temperature": 0}}
    message = ac.messages.create(**msg)
    with ac.messages.stream(**msg) as events:
        streamed_text = events.get_final_text()
        final = events.get_final_message()
    return {"responses": (whole.output_text, whole.status, whole.usage.model_dump()),
            "responses_stream": (streamed.output_text, streamed.status, kinds[0], kinds[-1]),
            "messages": (message.content[0].text, message.stop_reason, message.usage.model_dump()),
            "messages_stream": (streamed_text, final.stop_reason, final.usage.output_tokens)}


def test_openai_and_anthropic_sdks_read_the_colocated_answers(shipped):
    text = long(TEXTS["combining"], 700)
    want, got = (_sdk_answers(url, text) for url in (shipped.colocated.url, shipped.proxy.url))
    assert got == want
    assert got["responses_stream"][2:] == ("response.created", "response.completed")


API_REFUSALS = [
    ("/v1/responses", {"model": MODEL}),
    ("/v1/responses", responses_body("x" * 600, max_output_tokens=CONTEXT * 2)),
    ("/v1/responses", responses_body("x" * 600, model="no-such-model")),
    ("/v1/responses", responses_body("x" * 600, temperature=-1)),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}),
    ("/v1/messages", message_body("x" * 600, max_tokens=0)),
    ("/v1/messages", message_body("x" * 600, model="no-such-model")),
]


@pytest.mark.parametrize("path, body", API_REFUSALS, ids=[f"{i}" for i in range(len(API_REFUSALS))])
def test_what_vllm_refuses_on_the_other_routes_is_refused_the_same_way(shipped, path, body):
    check_api(shipped, path, body)


def test_generation_free_routes_answer_as_vllm_does(shipped):
    for path, body in (("/tokenize", {"model": MODEL, "prompt": TEXTS["combining"]}),
                       ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": TEXTS["emoji"]}]}),
                       ("/detokenize", {"model": MODEL, "tokens": [1, 78, 134, 109, 82]}),
                       ("/v1/messages/count_tokens", message_body(TEXTS["cjk"])),
                       ("/v1/embeddings", {"model": MODEL, "input": "x"}),  # not a pooling model: vLLM's 404
                       ("/v1/score", {"model": MODEL, "text_1": "a", "text_2": "b"})):
        head = check_api(shipped, path, body)
        assert XPYD_PATH not in head  # passed through, not dispatched
    for path in ("/version", "/v1/nope", "/reset_prefix_cache", "/server_info"):
        want, got = (httpx.get(url + path, timeout=30) for url in (shipped.colocated.url, shipped.proxy.url))
        assert (got.status_code, got.json()) == (want.status_code, want.json()), path


def test_a_batch_of_chats_is_answered_by_one_d_and_equal(shipped):
    """/v1/chat/completions/batch: several conversations in one non-streamed request, each its own
    choice; not split (one D prefills and answers them), equal to the colocated answer."""
    batch = {"model": MODEL, "temperature": 0, "max_tokens": 8,
             "messages": [[{"role": "user", "content": long(TEXTS["cjk"], 600)}],
                          [{"role": "system", "content": "Short."}, {"role": "user", "content": TEXTS["emoji"]}]]}
    head = check_api(shipped, "/v1/chat/completions/batch", batch)
    assert XPYD_PATH not in head


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_power_corrupted_kv_is_caught_on_the_other_routes(shipped, path):
    """P and D render the same prompt for these routes, so D's loaded KV is the prompt's: zeroed
    (the connector's debug switch), the answer differs."""
    params = {"kv_transfer_params": {"xpyd_debug_corrupt_kv": True}}
    body = responses_body(long(TEXTS["ascii"]), **params) if path == "/v1/responses" else message_body(
        long(TEXTS["ascii"]), **params)
    with pytest.raises(AssertionError):
        check_api(shipped, path, body)
    assert "CORRUPTED(test)" in shipped.decode.log()


def test_no_load_failed_and_nothing_was_rescued(shipped):
    """Every disaggregated answer above loaded P's KV (vLLM's default policy fails a lost
    load: the proxy would have rescued it with D alone, which the equality cannot show)."""
    for front in (shipped.proxy, shipped.sequential):
        text = cluster.http_get(front.url + "/metrics")[1].decode()
        rescued = [ln for ln in text.splitlines() if ln.startswith('xpyd_dispatch_total{path="local_rescue"}')]
        assert not rescued or float(rescued[0].rsplit(" ", 1)[1]) == 0, (front.name, rescued)
    assert "kv load failed" not in shipped.decode.log()


# ---------------------------------------------------------------- the served system


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_servers_default_penalties_and_response_role(served, kind):
    """vLLM applies the generation config's penalties where a request leaves them out;
    counted over generated tokens, they would come out different if D saw P's token as
    prompt (4 vs 3 in a direct check): D's connector advertises them, and such requests keep
    D's first token; a request that sets them itself may start with P's token. Chat never does
    here: this system's tool parser reads every chat answer. The chat role is the server's
    --response-role."""
    for fields in ({}, {"presence_penalty": 0, "frequency_penalty": 0}, {"max_tokens": 1}):
        body = {"max_tokens": 12, "stream": True, **fields}
        if kind == "completions":
            check(served, "/v1/completions", completion(long(TEXTS["ascii"]), **body),
                  route=FIRST if "presence_penalty" in fields else SEQUENTIAL)
        else:
            check(served, "/v1/chat/completions", chat(long(TEXTS["ascii"], 700), **body), route=SEQUENTIAL)
    if kind == "chat":
        _, _, events = call(served, served.proxy.url, "/v1/chat/completions",
                            chat(long(TEXTS["cjk"], 700), max_tokens=3, stream=True, presence_penalty=0,
                                 frequency_penalty=0))
        assert events[0]["choices"][0]["delta"]["role"] == RESPONSE_ROLE


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_prompt_cache_figures_are_one_servers(served, kind, stream):
    """--enable-prompt-tokens-details: D counts the KV it loaded as cached; the answer reports what
    one server that computed the prompt reports (P's figures): cold, then warm for the same prompt."""
    text = f"[{kind} {stream}] " + long(TEXTS["combining"], 1500)
    fields = {"max_tokens": 4, "stream": stream, "presence_penalty": 0, "frequency_penalty": 0,
              **({"stream_options": {"include_usage": True}} if stream else {})}
    for _ in range(2):  # chat keeps D's first token here (the tool parser): its rewrite of D's answer is tested
        if kind == "completions":
            check(served, "/v1/completions", completion(text, **fields), route=FIRST if stream else SEQUENTIAL)
        else:
            check(served, "/v1/chat/completions", chat(text, **fields), route=SEQUENTIAL)
    _, _, data = call(served, served.proxy.url, "/v1/completions" if kind == "completions" else "/v1/chat/completions",
                      {**(completion(text) if kind == "completions" else chat(text)), "max_tokens": 1})
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the second time: warm


@pytest.mark.parametrize("tool_choice", [None, "none", "absent"])
def test_a_tool_parser_keeps_chat_on_ds_first_token(served, tool_choice):
    """The served system's tool parser (muse_glimmer) reads every chat answer (vLLM streams it through
    the parser: an empty last delta is written {}), and keeps special tokens in one whose tool_choice is
    not "none" (null included): such answers are D's whole (its completion would answer otherwise).
    Here the answer is the begin-of-sequence token, again and again (a logit bias)."""
    body = chat(long(TEXTS["ascii"], 700), max_tokens=5, stream=True, presence_penalty=0, frequency_penalty=0,
                logit_bias={"1": 100})
    if tool_choice != "absent":
        body["tool_choice"] = tool_choice
    check(served, "/v1/chat/completions", body, route=SEQUENTIAL)
    if tool_choice is None:  # the parser kept the special tokens (the stream's deltas are the parser's)
        whole = call(served, served.colocated.url, "/v1/chat/completions", {**body, "stream": False})[2]
        assert "<s>" in whole["choices"][0]["message"]["content"], whole


def test_request_id_headers_where_vllm_sends_them(served):
    """Started with --enable-request-id-headers (vLLM and the proxy alike): X-Request-Id on every
    answer, the client's own when it sent one."""
    body = completion(long(TEXTS["emoji"]), max_tokens=3, presence_penalty=0, frequency_penalty=0)
    for headers in ({"X-Request-Id": "mine-7"}, {}):
        heads = [call(served, url, "/v1/completions", body, headers=headers)[1] for url in (served.colocated.url,
                                                                                           served.proxy.url)]
        for head in heads:
            assert head["x-request-id"] == "mine-7" if headers else re.fullmatch("[0-9a-f]{32}", head["x-request-id"])


def test_stored_responses_and_follow_ups_equal_colocated(served):
    """Each server stores its own chain: through the proxy the response is fetched, followed up
    (on the D that stores it: P cannot render the conversation) and refused as on one server."""
    urls = (served.colocated.url, served.proxy.url)
    body = responses_body(long(TEXTS["emoji"]), max_output_tokens=8)
    made = [httpx.post(url + "/v1/responses", json=body, timeout=120) for url in urls]
    assert made[1].headers[XPYD_PATH] == "disaggregated"
    assert diff(made[1].json(), made[0].json()) is None
    fetched = [httpx.get(f"{url}/v1/responses/{m.json()['id']}", timeout=60) for url, m in zip(urls, made)]
    assert [f.status_code for f in fetched] == [200, 200]
    assert diff(fetched[1].json(), made[1].json()) is None and diff(fetched[0].json(), made[0].json()) is None
    for stream in (False, True):
        follow = [call(served, url, "/v1/responses", {**responses_body("And then? 然后呢？", stream=stream),
                                                      "previous_response_id": m.json()["id"]})
                  for url, m in zip(urls, made)]
        assert follow[1][0] == follow[0][0] == 200 and follow[1][1][XPYD_PATH] == "local_stored"
        _seen(follow[1][1])
        got, want = follow[1][2], follow[0][2]
        if not stream:
            assert got["previous_response_id"] == made[1].json()["id"]
        if stream:
            got, want = api_fidelity.responses_stream(got), api_fidelity.responses_stream(want)
        assert diff(got, want) is None
    for path, method in (("/v1/responses/{}/cancel", "POST"), ("/v1/responses/{}", "GET")):
        for rid in ("resp_nope", None):
            answers = [httpx.request(method, url + path.format(rid or m.json()["id"]), timeout=60)
                       for url, m in zip(urls, made)]
            assert answers[1].status_code == answers[0].status_code, (path, rid)
            if rid:
                assert answers[1].json() == answers[0].json()


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_tokens_in_generate_equals_colocated(served, stream):
    ids = httpx.post(served.colocated.url + "/tokenize", json={"model": MODEL, "prompt": long(TEXTS["cjk"])},
                     timeout=60).json()["tokens"]
    head = check_api(served, "/inference/v1/generate", {"model": MODEL, "token_ids": ids, "stream": stream,
                                                        "sampling_params": {"max_tokens": 10, "temperature": 0}})
    assert head[XPYD_PATH] == "disaggregated"


def test_pooling_and_scoring_through_the_proxy_equal_the_pooling_server(served):
    """A model served for pooling (vLLM's CPU build serves the tiny Llama as an embedding model)
    beside the generating one: its routes reach it through the proxy, answers unchanged."""
    assert served.pooling is not None
    texts = [TEXTS["ascii"][:60], TEXTS["cjk"][:30], TEXTS["emoji"][:40]]
    for path, body in (("/v1/embeddings", {"input": texts}), ("/v1/embeddings", {"input": texts[1], "dimensions": 8}),
                       ("/v2/embed", {"texts": texts, "input_type": "search_document", "embedding_types": ["float"]}),
                       ("/pooling", {"input": texts[2]}), ("/score", {"text_1": texts[0], "text_2": texts[1:]}),
                       ("/v1/rerank", {"query": texts[0], "documents": texts[1:]}), ("/tokenize", {"prompt": texts[1]}),
                       ("/classify", {"input": texts[0]})):
        body = {"model": POOLING_MODEL, **body}
        want = httpx.post(served.pooling.url + path, json=body, timeout=60)
        got = httpx.post(served.proxy.url + path, json=body, timeout=60)
        assert got.status_code == want.status_code, (path, got.text[:300], want.text[:300])
        assert diff(got.json(), want.json()) is None, path


def test_every_path_was_taken(request: pytest.FixtureRequest):
    """The matrix reached each path it is meant to cover (the tests above record them)."""
    if request.config.getoption("keyword"):
        pytest.skip("a part of the matrix was selected (-k)")
    missing = WANTED_PATHS - set(SEEN)
    assert not missing, f"paths never taken: {sorted(missing)}; seen: {dict(SEEN)}"
