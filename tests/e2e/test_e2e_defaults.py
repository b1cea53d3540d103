"""2 P + 1 D + two proxies, as a new user runs them: vLLM's defaults everywhere (its
CPU thread binding, no ``kv_load_failure_policy`` — so a failed load would be vLLM's
``fail`` — no kv_secret, the proxy's default policies), the P2P connector in PUT_ASYNC.

Every request must be answered 200 with the tokens D computes for the prompt alone,
and every transfer must load: each P's first contact with D included (it used to time
out on 2-core Intel boxes, issue 21). Each P -> D first-contact latency is logged by P
("kv peer ... first contact ms=") and printed here for the record.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from connector.transport import TcpTransport
from proxy.config import ProxyConfig
from proxy.openai_api import estimate_prompt_tokens
from tests.support import e2e_cluster
from tests.support.e2e_client import (
    BLOCK,
    MODEL_DIR,
    answer_of,
    assert_same_greedy,
    body_for,
    generate,
    make_prompt,
    with_logprobs,
)
from tests.support.e2e_cluster import free_port, free_port_pair
from xpyd_wire import request_id
from xpyd_wire.headers import XPYD_PATH

cluster = e2e_cluster.cluster
pytestmark = pytest.mark.vllm

REQUESTS = 40
# The tiny model's tokenizer (1,024 words) spends ~2 characters a token, the proxy's
# estimate 4: prompts of 2 blocks + 60 tokens (~650 characters) are over the shipped
# local_prefill_threshold (128 estimated tokens) and go through P; short ones do not.
TOKENS = 2 * BLOCK + 60
# Of REQUESTS, at most this many may be served by D alone after a failed load.
MAX_RESCUED = REQUESTS // 10


def _over_threshold(prompt: str) -> str:
    assert estimate_prompt_tokens({"prompt": prompt}) >= ProxyConfig().local_prefill_threshold, len(prompt)
    return prompt


def _kv_config(role: str, kv_port: int, http_port: int, proxies: list[str]) -> dict:
    cfg = cluster.kv_transfer_config(role, kv_port, http_port, None, proxies=proxies, heartbeat_interval_s=1.0)
    del cfg["kv_load_failure_policy"]  # vLLM's default ("fail"), as in vLLM's own P2P example
    return cfg


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory):
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    log_dir = Path(tmp_path_factory.mktemp("e2e-defaults"))
    discs = [free_port(), free_port()]
    servers: dict[str, cluster.Server] = {}
    try:
        for i, disc in enumerate(discs):
            servers[f"proxy{i}"] = cluster.start_proxy(free_port(), disc, log_dir, name=f"proxy{i}")
        proxies = [f"{cluster.HOST}:{d}" for d in discs]
        env = e2e_cluster.bind_env(None)  # vLLM's default CPU thread binding
        for name, role in (("p0", "kv_producer"), ("p1", "kv_producer"), ("d", "kv_consumer")):
            port = free_port()
            servers[name] = cluster.start_vllm(
                name, port, log_dir, max_num_batched_tokens=e2e_cluster.MAX_BATCHED_TOKENS, env=env,
                kv_config=_kv_config(role, free_port_pair(), port, proxies))
        cluster.wait_until([servers["proxy0"], servers["proxy1"]], "/health", 60)
        cluster.wait_until([servers[n] for n in ("p0", "p1", "d")], "/health", 600)
        for i in range(2):
            e2e_cluster.wait_instances(servers[f"proxy{i}"], prefill=2, decode=1)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def _local_rescues(proxy) -> float:
    """Requests the proxy served by D alone after a failed disaggregated attempt."""
    _, raw = cluster.http_get(proxy.url + "/metrics")
    m = re.search(rb'xpyd_dispatch_total\{path="local_rescue"\} ([0-9.]+)', raw)
    return float(m[1]) if m else 0.0


def _first_contacts(log: str) -> list[float]:
    return [float(ms) for ms in re.findall(r"kv peer \S+ first contact ms=([0-9.]+)", log)]


def test_requests_over_two_proxies_all_answer_correctly(system, tokenizer):
    """REQUESTS sequential requests alternating between the proxies (each proxy's round
    robin alternates the Ps): every one 200 with the tokens D computes for the prompt
    alone; each P's first contact with D made ahead of its first send and never failed.

    A transfer may still fail on a badly loaded box (a put's reply stalled past
    send_timeout_s, 1 of 40 with two CPU hogs on 2 cores): D then fails the request under
    vLLM's default policy and the proxy rescues it; those are counted and printed."""
    d = system["d"]
    failures: list[str] = []
    rescued = 0
    for i in range(REQUESTS):
        prompt = _over_threshold(make_prompt(tokenizer, TOKENS + 7 * (i % 5), seed=21000 + i))
        body = with_logprobs("completions", body_for("completions", prompt, False))
        proxy = system[f"proxy{i % 2}"]
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
        if r.status_code != 200:
            failures.append(f"request {i} via {proxy.name}: {r.status_code} {r.text[:300]}")
            continue
        data = r.json()
        xpyd = (data.get("kv_transfer_params") or {}).get("xpyd") or {}
        if xpyd.get("loaded_tokens") != data["usage"]["prompt_tokens"] - 1:
            rescued += 1  # served by D alone after its load failed
        # D computing the prompt itself (a fresh cache_salt: nothing cached, nothing loaded).
        want, _ = generate(d.url, "completions", {**body, "cache_salt": uuid.uuid4().hex})
        assert_same_greedy(answer_of(data["choices"][0]), want)
    assert not failures, failures
    sent = {name: len(re.findall(r"kv sent( slowly)? req=", system[name].log())) for name in ("p0", "p1")}
    assert all(n >= REQUESTS // 4 for n in sent.values()), sent  # both Ps served
    contacts = {name: _first_contacts(system[name].log()) for name in ("p0", "p1")}
    rescues = sum(_local_rescues(system[f"proxy{i}"]) for i in range(2))
    print(f"\nfirst contact P -> D (ms): {contacts}; transfers per P: {sent}; rescued by D alone: {rescued} "
          f"(the proxies counted {rescues})")
    # A rescue is the exception (a stalled put on a badly loaded box: 1 of 40 seen); were
    # transfers failing as a rule, D alone would still answer every request correctly.
    assert rescued <= MAX_RESCUED and rescues <= MAX_RESCUED, (rescued, rescues)
    assert len(re.findall(r"kv load failed", d.log())) <= MAX_RESCUED
    for name in ("p0", "p1"):
        log = system[name].log()
        assert contacts[name], f"{name} made no first contact"
        assert "first contact ahead of the send failed" not in log, name
        # Each P's first send found the contact made (phases_ms queue:..,contact:0.0).
        first_send = re.search(r"kv sent( slowly)? req=.* phases_ms=queue:[0-9.]+,contact:([0-9.]+)", log)
        assert first_send and float(first_send.group(2)) < 50, (name, first_send and first_send.group(0)[-80:])


def test_short_prompt_is_answered_by_decode_alone(system, tokenizer):
    """Under the shipped threshold a short prompt skips P: D's own greedy tokens, no
    transfer, and the proxy says which path it took."""
    d = system["d"]
    prompt = make_prompt(tokenizer, 40, seed=23000)
    assert estimate_prompt_tokens({"prompt": prompt}) < ProxyConfig().local_prefill_threshold
    body = with_logprobs("completions", body_for("completions", prompt, False))
    sent_before = {n: system[n].log().count("kv sent") for n in ("p0", "p1")}
    r = httpx.post(system["proxy0"].url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.headers[XPYD_PATH] == "local_short", r.text[:300]
    want, _ = generate(d.url, "completions", {**body, "cache_salt": uuid.uuid4().hex})
    assert_same_greedy(answer_of(r.json()["choices"][0]), want)
    assert {n: system[n].log().count("kv sent") for n in ("p0", "p1")} == sent_before


def test_decode_warns_about_the_default_failure_policy(system):
    assert "kv_load_failure_policy is 'fail'" in system["d"].log()


class _LostTransferHandler(BaseHTTPRequestHandler):
    """A stand-in P (the other side of the boundary under test): answers the proxy's
    prefill like vLLM, but instead of sending the KV tells D's connector that the transfer
    is lost (the abort notice a real P sends when its send fails), before it answers. D
    plans the load, the load fails at once, and under vLLM's default policy D fails the
    request: the proxy must still answer the client correctly."""

    aborted: list[str]  # transfer keys told lost (set on the class by the test)

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, obj: dict) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self._json({"object": "list", "data": [{"id": "tiny-llama", "object": "model"}]}
                   if self.path == "/v1/models" else {})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        tid = request_id.parse(self.headers.get("x-request-id", ""))
        if tid is not None:
            t = TcpTransport()
            try:
                t.call(tid.decode_addr, {"op": "abort", "keys": {tid.key: "sender gave up: test"}}, timeout_s=5)
            finally:
                t.close()
            self.aborted.append(tid.key)
        msg = {"message": {"role": "assistant", "content": "a"}} if b"messages" in body else {"text": "a"}
        self._json({"id": "x", "object": "completion", "model": "tiny-llama",
                    "choices": [{"index": 0, "finish_reason": "length", **msg}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_lost_transfer_under_default_policy_is_rescued_by_decode_alone(system, tokenizer, tmp_path, stream):
    """D's load fails (P reported the transfer lost) and vLLM's default policy fails the
    request on D: the proxy asks D once more alone, and the client gets D's own answer."""
    d = system["d"]
    handler = type("Handler", (_LostTransferHandler,), {"aborted": []})
    fake = ThreadingHTTPServer((cluster.HOST, 0), handler)
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    proxy = None
    try:
        d_kv = f"{cluster.HOST}:{d.kv_port}"
        proxy = cluster.start_proxy(free_port(), free_port(), tmp_path, name=f"proxy-rescue-{stream}", extra_args=[
            "--prefill", f"http://{cluster.HOST}:{fake.server_address[1]},kv={cluster.HOST}:{free_port()}",
            "--decode", f"{d.url},kv={d_kv}"])
        cluster.wait_until([proxy], "/health", 60)
        e2e_cluster.wait_instances(proxy, prefill=1, decode=1)
        prompt = _over_threshold(make_prompt(tokenizer, TOKENS + 10, seed=22000 + stream))
        body = body_for("completions", prompt, stream)
        failed_before = d.log().count("kv load failed")
        got, _ = generate(proxy.url, "completions", body)
        want, _ = generate(d.url, "completions", {**body, "stream": False, "cache_salt": uuid.uuid4().hex})
        assert_same_greedy(got, want)
        assert handler.aborted, "the proxy never asked the stand-in P"
        assert d.log().count("kv load failed") > failed_before  # D really failed the load first
        _, raw = cluster.http_get(proxy.url + "/metrics")
        assert re.search(rb'xpyd_dispatch_total\{path="local_rescue"\} 1\.0', raw), raw.decode()[-2000:]
    finally:
        if proxy is not None:
            proxy.stop()
        fake.shutdown()
        fake.server_close()
