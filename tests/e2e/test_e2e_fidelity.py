"""A client cannot tell the proxy from one vLLM server: the differential suite.

Every request of a matrix (completions and chat, streamed and not; greedy limits, seeded
sampling, penalties, stop strings and tokens, logprobs, echo, usage options, structured
output, batches, vLLM's own refusals) goes once to a colocated vLLM server and once through
the proxy, on prompts that are not ASCII too (emoji, CJK, combining marks, and prompts
whose first generated token is part of a character). The answers must be equal: status,
error type, tokens and their logprobs (tests/support/e2e_client.py's comparator), text, finish
reasons, usage, and the fields of every event (its shape). Each request's path through the
proxy (x-xpyd-path, x-xpyd-first-token) is recorded, and the last test checks that the
matrix covered every path it is meant to.

Two systems, on real vLLM (CPU build), each with its own colocated reference:
- `shipped`: the proxy and the connector with their shipped defaults, vLLM's own defaults
  (thread binding, kv_load_failure_policy=fail), the tiny model's generation config (which
  sets no sampling value);
- `served`: the same model with a generation_config.json that sets default penalties
  (vLLM applies them where a request leaves the field out) and every server started with
  --response-role.
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
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import api_fidelity, e2e_cluster
from tests.support.e2e_client import (
    LOGPROB_TOL,
    MODEL_DIR,
    Answer,
    answer_of,
    parting_step,
    stream_answers,
    text_parting,
)
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

# Paths the matrix must take through the proxy (x-xpyd-path, and "first_token" for
# x-xpyd-first-token: prefill), and where each is seen.
SEEN: Counter[str] = Counter()
WANTED_PATHS = {"disaggregated", "first_token", "prefill_alone", "local_short", "local_prompt_logprobs",
                "local_verdict", "first_token_to_decode", "local_stored"}


# ---------------------------------------------------------------- systems


class System:
    def __init__(self, proxy: cluster.Server, prefill: cluster.Server, decode: cluster.Server,
                 colocated: cluster.Server, pooling: cluster.Server | None = None) -> None:
        self.proxy, self.prefill, self.decode, self.colocated = proxy, prefill, decode, colocated
        self.pooling = pooling  # a static P of another model, served as an embedding model
        self.client = httpx.Client(timeout=120)

    def servers(self) -> list[cluster.Server]:
        return [self.proxy, self.prefill, self.decode, self.colocated] + ([self.pooling] if self.pooling else [])

    def stop(self) -> None:
        self.client.close()
        for s in self.servers():
            s.stop()


def _start(log_dir: Path, model: Path, vllm_args: list[str], env: dict[str, str] | None = None,
           pooling: bool = False) -> System:
    disc = e2e_cluster.free_port()
    pool_port = e2e_cluster.free_port()
    # The shipped defaults, but a request may ask D to zero its KV (the power test); with `pooling`,
    # a static P serving the tiny model as an embedding model too.
    proxy = cluster.start_proxy(e2e_cluster.free_port(), disc, log_dir, ["--forward-debug-params"] + (
        ["--prefill", f"http://127.0.0.1:{pool_port}"] if pooling else []))
    started = [proxy]
    try:
        pool = None
        if pooling:
            pool = cluster.start_vllm("pooling", pool_port, log_dir, model=model, env=e2e_cluster.bind_env(None),
                                      extra_args=["--runner", "pooling", "--convert", "embed",
                                                  "--served-model-name", POOLING_MODEL])
            started.append(pool)
        servers = []
        for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            kv = cluster.kv_transfer_config(role, e2e_cluster.free_port_pair(), port := e2e_cluster.free_port(), disc)
            kv.pop("kv_load_failure_policy")  # vLLM's default: fail
            if role == "kv_consumer":  # lets a request ask D to zero what it loads (the power test)
                kv["kv_connector_extra_config"]["allow_debug_corruption"] = True
            servers.append(cluster.start_vllm(name, port, log_dir, model=model, kv_config=kv, extra_args=vllm_args,
                                              env={**e2e_cluster.bind_env(None), **(env or {})}))
            started.append(servers[-1])
        colocated = cluster.start_vllm("colocated", e2e_cluster.free_port(), log_dir, model=model,
                                       extra_args=vllm_args,
                                       env={**e2e_cluster.bind_env(None), **REFERENCE_ENV, **(env or {})})
        started.append(colocated)
        cluster.wait_until(started, "/health", 600)
        e2e_cluster.wait_instances(proxy, 1 + pooling, 1)
        return System(proxy, servers[0], servers[1], colocated, pool)
    except BaseException:
        for s in started:
            s.stop()
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
    s = _start(tmp_path_factory.mktemp("fidelity-served"), model, ["--response-role", RESPONSE_ROLE, "--enable-scale-out"],
               {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}, pooling=True)
    yield s
    s.stop()


# ---------------------------------------------------------------- requests and comparison


def call(s: System, url: str, path: str, body: Any, raw: bytes | None = None) -> tuple[int, dict, Any]:
    """One request: (status, response headers, the JSON answer or, for a stream, its events
    with [DONE] as the string)."""
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    with s.client.stream("POST", url + path, content=content, headers=headers) as r:
        data = r.read()
        status, head = r.status_code, dict(r.headers)
    if head.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in data.decode().split("\n\n") if ln.startswith("data: ")]
        return status, head, [e if e == "[DONE]" else json.loads(e) for e in events]
    try:
        return status, head, json.loads(data)
    except ValueError:
        return status, head, data.decode(errors="replace")


# Fields whose values are the server's own: compared by presence, not value.
_OWN = frozenset({"id", "created", "created_at", "request_id", "previous_response_id", "system_fingerprint"})
# Deliberate differences (see the module's text): not compared at all.
_NOT_COMPARED = frozenset({"kv_transfer_params"})
# Floats compared within LOGPROB_TOL (logprobs); everything else exactly.


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= (LOGPROB_TOL or 0.0)
    return a == b


def diff(got: Any, want: Any, where: str = "") -> str | None:
    """Where two answers (JSON values) differ, field by field: None when every field is
    present in both with equal values (floats within LOGPROB_TOL; _OWN fields by presence)."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"{where}: {got!r} is not an object"
        keys = (set(got) | set(want)) - _NOT_COMPARED
        for k in sorted(keys):
            if k not in got or k not in want:
                return f"{where}.{k}: only in {'got' if k in got else 'want'}"
            if k in _OWN:
                if (got[k] is None) != (want[k] is None):
                    return f"{where}.{k}: {got[k]!r} vs {want[k]!r}"
                continue
            if (d := diff(got[k], want[k], f"{where}.{k}")) is not None:
                return d
        return None
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{where}: {len(got) if isinstance(got, list) else got!r} vs {len(want)} items"
        for i, (g, w) in enumerate(zip(got, want)):
            if (d := diff(g, w, f"{where}[{i}]")) is not None:
                return d
        return None
    return None if _close(got, want) else f"{where}: {got!r} vs {want!r}"


def _shape(value: Any, mapping: bool = False) -> Any:
    """A JSON value's structure: its keys and the kinds of its values, recursively (the keys
    of a completion's top_logprobs maps are tokens, data rather than fields)."""
    if isinstance(value, dict):
        if mapping:
            return ("map", tuple(sorted({repr(_shape(v)) for v in value.values()})))
        return tuple(sorted((k, _shape(v, k == "top_logprobs")) for k, v in value.items() if k not in _NOT_COMPARED))
    if isinstance(value, list):
        return ("list", tuple(sorted({repr(_shape(v, mapping)) for v in value})))
    return None if value is None else type(value).__name__


def _paths(value: Any, at: str = "", mapping: bool = False) -> set[tuple[str, str]]:
    """A JSON value's leaves as (path, kind) pairs, lists and the token-keyed top_logprobs maps
    folded: the union over events does not depend on how the events were grouped (a busy
    server sends an echoed prompt and its first tokens as one event or as two)."""
    if isinstance(value, dict):
        out: set[tuple[str, str]] = {(at, "{}")}
        for k, v in value.items():
            if k not in _NOT_COMPARED:
                out |= _paths(v, f"{at}.*" if mapping else f"{at}.{k}", k == "top_logprobs")
        return out
    if isinstance(value, list):
        return set().union({(at, "[]")}, *(_paths(v, f"{at}[]", mapping) for v in value))
    return {(at, "null" if value is None else type(value).__name__)}


def summary(events: list, chat: bool) -> dict:
    """A stream as what a client reads of it, independent of how the tokens were grouped
    into events (a busy server's API process merges the outputs it has not sent yet, so the
    count of events is not the server's to fix): per choice its text, logprobs, finish and
    stop reasons; the usage of the last event that has one; the kinds of events (their
    fields' shapes); the last event's fields (vLLM puts the fingerprint there); [DONE] last."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for e in events[:-1]:
        assert isinstance(e, dict), e
        if e.get("usage") is not None:
            usage = e["usage"]
        for ch in e.get("choices") or ():
            c = choices.setdefault(ch["index"], {"text": "", "logprobs": {}, "finish_reason": None,
                                                  "stop_reason": None, "role": None})
            delta = ch.get("delta") or {}
            c["text"] += (delta.get("content") or "") if chat else (ch.get("text") or "")
            c["role"] = c["role"] or delta.get("role")
            for k, v in (ch.get("logprobs") or {}).items():
                c["logprobs"][k] = c["logprobs"].get(k, []) + (v or [])
            if ch.get("finish_reason") is not None:
                c["finish_reason"], c["stop_reason"] = ch["finish_reason"], ch.get("stop_reason")
    middle = [e for e in events[:-1]
              if e.get("choices") and all(ch.get("finish_reason") is None for ch in e["choices"])]
    ends = [e for e in events[:-1] if not any(e is m for m in middle)]
    return {"choices": choices, "usage": usage,
            # Events before any choice finished, and the rest (a finish, the usage event).
            "kinds": {"middle": sorted(set().union(*(_paths(e) for e in middle))),
                      "ends": sorted({repr(_shape(e)) for e in ends})},
            "last": sorted(events[-2]) if len(events) > 1 and isinstance(events[-2], dict) else None,
            "done": events[-1] if events else None}


def comparable(got: dict, want: dict) -> tuple[dict, dict]:
    """Two stream summaries as far as grouping leaves them comparable: a short answer that a
    busy API process merged into its finishing event has no event before the finish (seen in
    a CI-like run: two tokens and the stop in one event through D, two events colocated), so
    the kinds of those events are compared only where both streams have some."""
    if not got["kinds"]["middle"] or not want["kinds"]["middle"]:
        got = {**got, "kinds": {**got["kinds"], "middle": None}}
        want = {**want, "kinds": {**want["kinds"], "middle": None}}
    return got, want


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
        status, _, ref = call(s, s.colocated.url, path, {**body, **extra, "stream": False})
        if status != 200:
            return False
        ref_answer = answer_of(ref["choices"][i])
        step, tie = text_parting(str(g), ref_answer)
        if step < len(ref_answer.tokens):
            if not tie:
                return False
            parted = True
    return parted


def check(s: System, path: str, body: Any, raw: bytes | None = None, *, tied_ok: bool = True) -> dict:
    """Send the request to the colocated server and through the proxy; assert the answers
    are equal (see the module's text). Returns the proxy's response headers."""
    want_status, _, want = call(s, s.colocated.url, path, body, raw)
    got_status, head, got = call(s, s.proxy.url, path, body, raw)
    _seen(head)
    what = f"{path} {json.dumps(body)[:300] if raw is None else raw[:80]!r} via {head.get(XPYD_PATH)}"
    assert got_status == want_status, f"{what}: status {got_status} vs {want_status}: {got!r:.400} / {want!r:.400}"
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
    check(shipped, "/v1/completions", completion(long(TEXTS[text]), stream=stream, logprobs=2, **limits))


@pytest.mark.parametrize("limits", [pytest.param({"max_tokens": 1}, id="max1"),
                                    pytest.param({"max_completion_tokens": 9}, id="max9"),
                                    pytest.param({"max_tokens": 9, "max_completion_tokens": None}, id="max9-legacy")])
@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("text", sorted(TEXTS))
def test_chat_equal_colocated(shipped, text, stream, limits):
    body = chat(long(TEXTS[text], 700), system="You answer in one short sentence.", stream=stream, **limits)
    check(shipped, "/v1/chat/completions", body)


_FITTED: dict[int, str] = {}


def fitted(s: System, left: int) -> dict:
    """A chat request without a limit whose rendered prompt leaves about ``left`` tokens of
    the context (found once per ``left``: each try prefills ~4k tokens)."""
    body = chat(long(TEXTS["ascii"], CONTEXT * 4))
    if left not in _FITTED:
        content = body["messages"][-1]["content"]
        for _ in range(8):
            _, _, data = call(s, s.colocated.url, "/v1/chat/completions",
                              {**chat(content), "max_tokens": 1, "stream": False})
            prompt = data["usage"]["prompt_tokens"] if "usage" in data else CONTEXT * 2
            over = prompt - (CONTEXT - left)
            if 0 <= -over <= 2:
                break
            content = content[: max(1, len(content) - (over + 1) * len(content) // prompt)]
        _FITTED[left] = content
    body["messages"][-1]["content"] = _FITTED[left]
    return body


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_chat_without_a_limit_runs_to_the_context_end(shipped, stream):
    """No limit: the answer ends at EOS or the context (D's continuation gets what is left
    of it after P's prompt and token)."""
    check(shipped, "/v1/chat/completions", {**fitted(shipped, 20), "stream": stream})


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_first_token_that_is_part_of_a_character(shipped, partial_prompts, kind, stream):
    """The leak: P's token is the first byte of a character, vLLM holds it back ("" text).
    Through the proxy the answer was the whole prompt (chat: the rendered template) and then
    the answer. Streamed, the proxy now leaves it to D's first token."""
    for limit in (6, 1):
        if kind == "completions":
            head = check(shipped, "/v1/completions", completion(partial_prompts[kind], max_tokens=limit, stream=stream))
        else:
            head = check(shipped, "/v1/chat/completions", continuing(partial_prompts[kind], max_tokens=limit,
                                                                      stream=stream))
        if stream and limit > 1:
            assert head.get(XPYD_FIRST_TOKEN) is None and head[XPYD_PATH] == "disaggregated"
            SEEN["first_token_to_decode"] += 1


SAMPLING = [
    pytest.param({"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1234}, id="seeded"),
    pytest.param({"presence_penalty": 0.7}, id="presence"),
    pytest.param({"frequency_penalty": 0.5}, id="frequency"),
    pytest.param({"repetition_penalty": 1.3}, id="repetition"),
    pytest.param({"min_tokens": 6, "max_tokens": 8}, id="min-tokens"),
    pytest.param({"ignore_eos": True, "max_tokens": 12}, id="ignore-eos"),
    pytest.param({"n": 2, "max_tokens": 5}, id="n2"),
    pytest.param({"skip_special_tokens": False}, id="special-tokens"),
    pytest.param({"logit_bias": {"100": 5.0}}, id="logit-bias"),
]


# Streams only (vLLM refuses stream_options otherwise: compared among the refusals).
USAGE = [
    pytest.param({"stream_options": {"include_usage": True}}, id="usage"),
    pytest.param({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, id="usage-continuous"),
]


@pytest.mark.parametrize("fields, stream", [pytest.param(p.values[0], s, id=f"{p.id}-{'sse' if s else 'json'}")
                                            for p in SAMPLING for s in (True, False)]
                         + [pytest.param(p.values[0], True, id=f"{p.id}-sse") for p in USAGE])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_sampling_fields_equal_colocated(shipped, kind, stream, fields):
    fields = {"max_tokens": 10, **fields, "stream": stream}
    if kind == "completions":
        check(shipped, "/v1/completions", completion(long(TEXTS["ascii"]), **fields))
    else:
        check(shipped, "/v1/chat/completions", chat(long(TEXTS["emoji"], 700), **fields))


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
                                                 include_stop_str_in_output=include))
    _, tid = _first_token_of(shipped, "/v1/completions", completion(prompt))
    check(shipped, "/v1/completions", completion(prompt, max_tokens=8, stop_token_ids=[tid], stream=stream))


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_echo_and_prompt_scoring(shipped, stream):
    """echo, and how eval harnesses score a prompt (echo, logprobs, max_tokens 0): the proxy
    answered its own 400 for max_tokens 0; vLLM answers the prompt with its logprobs."""
    prompt = long(TEXTS["cjk"], 600)
    check(shipped, "/v1/completions", completion(prompt, echo=True, max_tokens=4, stream=stream))
    head = check(shipped, "/v1/completions", completion(prompt, echo=True, logprobs=1, max_tokens=4, stream=stream))
    assert head[XPYD_PATH] == "local_prompt_logprobs"
    if not stream:
        head = check(shipped, "/v1/completions", completion(prompt, echo=True, logprobs=1, max_tokens=0))
        assert head[XPYD_PATH] == "local_prompt_logprobs"
    check(shipped, "/v1/completions", completion(prompt, prompt_logprobs=1, max_tokens=3, stream=stream))


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_batch_and_token_id_prompts(shipped, stream):
    a, b = long(TEXTS["ascii"]), long(TEXTS["combining"])
    check(shipped, "/v1/completions", completion([a, b], max_tokens=5, stream=stream))
    _, _, data = call(shipped, shipped.colocated.url, "/v1/completions",
                      completion(b, max_tokens=1, return_token_ids=True))
    ids = data["choices"][0]["prompt_token_ids"]
    check(shipped, "/v1/completions", completion(ids, max_tokens=7, logprobs=1, stream=stream))
    check(shipped, "/v1/completions", completion(ids, max_tokens=7, stream=stream, return_tokens_as_token_ids=True,
                                                 logprobs=1))


@pytest.mark.parametrize("fmt", [pytest.param({"type": "json_object"}, id="json_object"),
                                 pytest.param({"type": "json_schema", "json_schema": {
                                     "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                             "required": ["a"]}}}, id="json_schema")])
def test_structured_output(shipped, fmt):
    check(shipped, "/v1/chat/completions", chat(long(TEXTS["ascii"], 600), response_format=fmt, max_tokens=12))


def test_a_chat_with_history(shipped):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": long(TEXTS["cjk"], 500)},
                {"role": "assistant", "content": "好的。"}, {"role": "user", "content": long(TEXTS["emoji"], 500)}]
    for stream in (True, False):
        check(shipped, "/v1/chat/completions", {"model": MODEL, "messages": messages, "temperature": 0,
                                                "max_tokens": 8, "stream": stream})
    check(shipped, "/v1/chat/completions", {"model": MODEL, "messages": messages[:-1], "temperature": 0,
                                            "max_tokens": 8, "stream": True, "add_generation_prompt": False,
                                            "continue_final_message": True})


def test_short_prompts_are_answered_by_d_alone_and_equal(shipped):
    for stream in (True, False):
        head = check(shipped, "/v1/completions", completion("Hi there 👋", max_tokens=6, logprobs=2, stream=stream))
        assert head[XPYD_PATH] == "local_short"


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
]


@pytest.mark.parametrize("path, body", REFUSALS, ids=[f"{i}" for i in range(len(REFUSALS))])
def test_what_vllm_refuses_is_refused_the_same_way(shipped, path, body):
    check(shipped, path, body, tied_ok=False)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]"])
def test_bodies_the_proxy_cannot_read_get_vllms_own_answer(shipped, raw):
    head = check(shipped, "/v1/completions", None, raw)
    assert head[XPYD_PATH] == "local_verdict"


def test_prompt_one_token_short_of_the_context(shipped):
    """The answer has room for one token: vLLM gives it, with finish_reason length (D got
    max_tokens 0 and refused it, as an error event after P's token)."""
    check(shipped, "/v1/chat/completions", {**fitted(shipped, 1), "stream": True, "max_tokens": 5})


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_power_corrupted_kv_is_caught(shipped, stream):
    """The comparison can fail: D zeroes the KV it loads (a debug switch of the connector),
    and the answer through the proxy is no longer the colocated server's."""
    body = completion(long(TEXTS["ascii"]), max_tokens=12, logprobs=2, stream=stream,
                      kv_transfer_params={"xpyd_debug_corrupt_kv": True})
    with pytest.raises(AssertionError):
        check(shipped, "/v1/completions", body, tied_ok=False)
    assert "CORRUPTED(test)" in shipped.decode.log()


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
    text = cluster.http_get(shipped.proxy.url + "/metrics")[1].decode()
    rescued = [ln for ln in text.splitlines() if ln.startswith('xpyd_dispatch_total{path="local_rescue"}')]
    assert not rescued or float(rescued[0].rsplit(" ", 1)[1]) == 0, rescued
    assert "kv load failed" not in shipped.decode.log()


# ---------------------------------------------------------------- the served system


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_servers_default_penalties_and_response_role(served, kind):
    """vLLM applies the generation config's penalties where a request leaves them out;
    counted over generated tokens, they would come out different if D saw P's token as
    prompt (4 vs 3 in a direct check): D's connector advertises them, and such requests keep
    D's first token. The chat role is the server's --response-role."""
    for fields in ({}, {"presence_penalty": 0, "frequency_penalty": 0}, {"max_tokens": 1}):
        body = {"max_tokens": 12, "stream": True, **fields}
        if kind == "completions":
            head = check(served, "/v1/completions", completion(long(TEXTS["ascii"]), **body))
        else:
            head = check(served, "/v1/chat/completions", chat(long(TEXTS["ascii"], 700), **body))
        if not fields:  # the server's penalties apply: D's first token
            assert head.get(XPYD_FIRST_TOKEN) is None, head
        elif "presence_penalty" in fields:  # the request's own values win: P's token may start it
            assert head.get(XPYD_FIRST_TOKEN) == "prefill" or _held_back(served), head
    if kind == "chat":
        _, _, events = call(served, served.proxy.url, "/v1/chat/completions",
                            chat(long(TEXTS["cjk"], 700), max_tokens=3, stream=True, presence_penalty=0,
                                 frequency_penalty=0))
        assert events[0]["choices"][0]["delta"]["role"] == RESPONSE_ROLE


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


def _held_back(s: System) -> bool:
    """The proxy counted a first token from P held back (part of a character)."""
    text = cluster.http_get(s.proxy.url + "/metrics")[1].decode()
    return any(ln.startswith('xpyd_first_token_to_decode_total{reason="held_back"}') and not ln.endswith(" 0.0")
               for ln in text.splitlines())


def test_every_path_was_taken(request: pytest.FixtureRequest):
    """The matrix reached each path it is meant to cover (the tests above record them)."""
    if request.config.getoption("keyword"):
        pytest.skip("a part of the matrix was selected (-k)")
    missing = WANTED_PATHS - set(SEEN)
    assert not missing, f"paths never taken: {sorted(missing)}; seen: {dict(SEEN)}"
