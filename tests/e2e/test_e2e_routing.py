"""Prefix-aware routing on real vLLM (CPU build, vLLM's default thread binding): 2 P + 2 D
(each publishing its KV events) + a colocated reference server, one workload per policy.

The same servers serve every policy: proxies are started per run on the discovery ports the
instances heartbeat to, and each run gets its own system prompts so the caches start cold
for it. P's own counters (vllm:prefix_cache_hits/queries, deltas over the run) give the hit
rate; every answer must equal the colocated one.

- one proxy, P policies round_robin vs cache_aware on a shared-prefix completions workload;
- two proxies behind haproxy (round robin; without haproxy the client alternates), both
  policies `precise` vs both `cache_aware`, on a multi-turn chat trace with a shared system
  prompt: where each turn is prefilled and decoded, P's hit rate, and the KV bytes P ships
  per turn (P ships only the blocks D lacks, issue 17).

Every vLLM here exports its spans (``--otlp-traces-endpoint``) to one OTLP receiver on loopback
(tests/support/otlp_receiver.py), so a proxy with ``--tracing`` can show one request as one trace:
the proxy's span with P's and D's ``llm_request`` spans as its children (issue 50).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from xpyd_deploy.haproxy_cfg import render_servers
from tests.support import e2e_cluster, otlp_receiver
from tests.support.e2e_client import (
    BLOCK,
    MODEL_DIR,
    answer_of,
    assert_same_greedy,
    body_for,
    generate,
    make_prompt,
    metric,
    poll,
    with_logprobs,
)
from tests.support.e2e_cluster import free_port, free_port_pair
from tests.support.haproxy_helpers import HAPROXY, Balancer, any_free_port
from tests.support.otlp_receiver import OtlpReceiver, render
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_PATH, XPYD_PREFILL_INSTANCE

cluster = e2e_cluster.cluster
pytestmark = pytest.mark.vllm

SYSTEMS = 3
TURNS = 4
SYSTEM_TOKENS = 4 * BLOCK + 20  # 4 full blocks of CPU KV cache shared per system prompt
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def traces():
    """The OTLP receiver every server of the module exports its spans to."""
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, traces: OtlpReceiver):
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    log_dir = Path(tmp_path_factory.mktemp("e2e-routing"))
    discs = (free_port(), free_port())  # every instance registers with both
    env = e2e_cluster.bind_env(None)  # vLLM's default binding
    common = dict(max_num_batched_tokens=e2e_cluster.MAX_BATCHED_TOKENS)
    started: dict[str, cluster.Server] = {}
    try:
        for name, role in (("p0", "kv_producer"), ("p1", "kv_producer"), ("d", "kv_consumer"),
                           ("d1", "kv_consumer")):
            port = free_port()
            kv = cluster.kv_transfer_config(role, free_port_pair(), port, None, heartbeat_interval_s=1.0,
                                            proxies=[f"{cluster.HOST}:{d}" for d in discs])
            started[name] = cluster.start_vllm(
                name, port, log_dir, **common, kv_config=kv, env={**env, **traces.export_env(f"vllm-{name}")},
                extra_args=["--kv-events-config", _events_config(free_port_pair()),
                            "--otlp-traces-endpoint", traces.endpoint])
        started["colocated"] = cluster.start_vllm("colocated", free_port(), log_dir, **common, env=env)
        cluster.wait_until(list(started.values()), "/health", 600)
        yield discs, log_dir, started
    finally:
        for s in started.values():
            s.stop()


def _events_config(port: int) -> str:
    """vLLM's KV events on 127.0.0.1 only (its IPv4-mapped form), replay on the next port."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://[::ffff:127.0.0.1]:{port}",
                       "replay_endpoint": f"tcp://[::ffff:127.0.0.1]:{port + 1}"})  # fmt: skip


def _proxy(disc: int, log_dir: Path, policy: str, decode_policy: str = "round_robin",
           name: str = "proxy", extra_args: tuple[str, ...] = (), env: dict[str, str | None] | None = None
           ) -> cluster.Server:  # fmt: skip
    """A proxy with `policy` for P, waiting until both Ps and both Ds have registered (and,
    for precise, until it knows every instance's KV index)."""
    # --expose-routing-headers: which P prefilled is read from x-xpyd-prefill-instance.
    args = ["--prefill-policy", policy, "--decode-policy", decode_policy, "--heartbeat-timeout", "5",
            "--expose-routing-headers", *extra_args]
    if "precise" in (policy, decode_policy):
        args += ["--tokenizer", str(MODEL_DIR)]
    proxy = cluster.start_proxy(free_port(), disc, log_dir / f"{policy}-{name}", args, name=name, env=env)
    cluster.wait_until([proxy], "/health", 60)

    def registered() -> bool:
        status, raw = cluster.http_get(proxy.url + "/instances")
        live = [i for i in json.loads(raw) if not i["pending"]] if status == 200 else []
        roles = [i["role"] for i in live]
        known = all((i.get("kv_events") or {}).get("state") == "known" for i in live)
        return roles.count("P") == 2 and roles.count("D") == 2 and known

    if not poll(registered, timeout=60):
        proxy.stop()
        raise AssertionError(f"instances did not register with the {policy} proxy")
    return proxy


def _counters(ps: list[cluster.Server]) -> tuple[float, float]:
    hits = sum(metric(p.url, "vllm:prefix_cache_hits_total") for p in ps)
    queries = sum(metric(p.url, "vllm:prefix_cache_queries_total") for p in ps)
    return hits, queries


def _run(servers, tokenizer, policy: str, seed: int) -> tuple[float, dict[int, set[str]]]:
    """The shared-prefix workload through a proxy with `policy`: P's hit rate over the run
    and, per system prompt, the Ps that prefilled it. Outputs are checked on the way."""
    discs, log_dir, s = servers
    ps = [s["p0"], s["p1"]]
    systems = [make_prompt(tokenizer, SYSTEM_TOKENS, seed + k) for k in range(SYSTEMS)]
    proxy = _proxy(discs[0], log_dir, policy)
    try:
        hits0, queries0 = _counters(ps)
        used: dict[int, set[str]] = {k: set() for k in range(SYSTEMS)}
        for turn in range(TURNS):  # turn-major: the system prompts interleave
            for k, system in enumerate(systems):
                body = with_logprobs("completions", body_for(
                    "completions", f"{system}\nUser {turn}: question {turn} for {k}?", False, max_tokens=MAX_TOKENS))
                want, _ = generate(s["colocated"].url, "completions", body)
                r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                data = r.json()
                assert_same_greedy(answer_of(data["choices"][0]), want)
                assert data["kv_transfer_params"]["xpyd"]["load_failed"] is False
                used[k].add(r.headers[XPYD_PREFILL_INSTANCE])
        # Counters are updated by each engine step; wait until the last request is counted.
        n_requests = SYSTEMS * TURNS
        t_end = time.monotonic() + 10
        while True:
            hits, queries = _counters(ps)
            if queries - queries0 >= n_requests * SYSTEM_TOKENS or time.monotonic() > t_end:
                break
            time.sleep(0.2)
        return (hits - hits0) / (queries - queries0), used
    finally:
        proxy.stop()


def test_cache_aware_beats_round_robin_on_prefill_prefix_hits(servers, tokenizer):
    rr_rate, rr_used = _run(servers, tokenizer, "round_robin", seed=7100)
    ca_rate, ca_used = _run(servers, tokenizer, "cache_aware", seed=7200)
    print(f"P prefix-cache hit rate: round_robin {rr_rate:.3f}, cache_aware {ca_rate:.3f}")
    # round_robin: every system prompt is prefilled cold on both Ps (6 misses of 12);
    # cache_aware: once, on one P (3 of 12). 4 of ~4.2 blocks hit on a warm request.
    assert ca_rate > rr_rate + 0.15, (rr_rate, ca_rate)
    assert ca_rate > 0.6, ca_rate
    assert all(len(v) == 2 for v in rr_used.values()), rr_used
    assert all(len(v) == 1 for v in ca_used.values()), ca_used  # one P per system prompt
    assert len(set().union(*ca_used.values())) == 2  # and both Ps in use


# ---------------------------------------------------------------- multi-turn chat, two proxies

CONVERSATIONS = 3
CHAT_TURNS = 3
CHAT_SYSTEM_TOKENS = 2 * BLOCK + 40
CHAT_MAX_TOKENS = 16


class _Front:
    """Two proxies and what clients talk to: haproxy in round robin in front of them, or
    (without haproxy) the client alternating between them itself."""

    def __init__(self, proxies: list[cluster.Server], log_dir: Path) -> None:
        self.proxies = proxies
        self.lb: Balancer | None = None
        self._i = 0
        if HAPROXY is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            port = any_free_port(cluster.HOST)
            cfg = log_dir / "haproxy.cfg"
            cfg.write_text(render_servers("routing", [(p.name, cluster.HOST, p.port) for p in proxies],
                                          (cluster.HOST, port), (cluster.HOST, any_free_port(cluster.HOST))))
            self.lb = Balancer(cfg, log_dir, f"http://{cluster.HOST}:{port}")
            if not poll(lambda: self._ready(), timeout=30):
                self.lb.stop()
                raise AssertionError(f"haproxy never answered /ready: {self.lb.log.read_text()[-2000:]}")

    def _ready(self) -> bool:
        try:
            return httpx.get(self.lb.url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def url(self) -> str:
        if self.lb is not None:
            return self.lb.url
        self._i += 1
        return self.proxies[self._i % 2].url


def _kv_sent(ps: list[cluster.Server]) -> tuple[float, float]:
    """(sends completed, KV bytes sent) over the Ps, from vLLM's /metrics."""
    sends = sum(metric(p.url, "vllm:xpyd_kv_transfers_total", {"role": "send", "result": "ok"}) for p in ps)
    return sends, sum(metric(p.url, "vllm:xpyd_kv_bytes_total", {"direction": "sent"}) for p in ps)


def _block_bytes() -> int:
    """bf16 K and V of one CPU KV-cache block over all layers of the tiny model."""
    cfg = json.loads(MODEL_DIR.joinpath("config.json").read_text())
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * BLOCK * 2 * cfg["head_dim"] * 2


def _chat_run(servers, tokenizer, policy: str, seed: int) -> dict:
    """The chat trace through two proxies with `policy` for P and D. Per turn: the P and D
    that served it, its prompt tokens and the KV bytes P shipped; P's hit rate overall."""
    discs, log_dir, s = servers
    ps = [s["p0"], s["p1"]]
    system = make_prompt(tokenizer, CHAT_SYSTEM_TOKENS, seed)
    # Every turn brings two blocks' worth of new tokens: over the proxy's local threshold
    # (128) even where D holds the rest, so each turn goes through P.
    convs = [[{"role": "system", "content": system},
              {"role": "user", "content": make_prompt(tokenizer, 2 * BLOCK + 10 * c, seed + 1 + c)}]
             for c in range(CONVERSATIONS)]  # fmt: skip
    proxies: list[cluster.Server] = []
    front: _Front | None = None
    turns: list[list[dict]] = [[] for _ in range(CONVERSATIONS)]
    try:
        for i, d in enumerate(discs):
            proxies.append(_proxy(d, log_dir, policy, policy, name=f"proxy{i}"))
        front = _Front(proxies, log_dir / f"{policy}-lb")
        hits0, queries0 = _counters(ps)
        for turn in range(CHAT_TURNS):
            for c, messages in enumerate(convs):
                body = with_logprobs("chat", {"model": "tiny-llama", "messages": messages, "temperature": 0,
                                              "max_tokens": CHAT_MAX_TOKENS})  # fmt: skip
                want, _ = generate(s["colocated"].url, "chat", body)
                sends0, sent0 = _kv_sent(ps)
                r = httpx.post(front.url() + "/v1/chat/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                data = r.json()
                assert_same_greedy(answer_of(data["choices"][0]), want)
                turn_info = {"path": r.headers.get(XPYD_PATH, "disaggregated"), "p": None,
                             "d": r.headers[XPYD_DECODE_INSTANCE], "prompt": data["usage"]["prompt_tokens"],
                             "bytes": 0.0}  # fmt: skip
                if turn_info["path"] == "disaggregated":
                    assert data["kv_transfer_params"]["xpyd"]["load_failed"] is False, data["kv_transfer_params"]
                    # vLLM reports the connector's counters with a step: wait for this send's.
                    assert poll(lambda: _kv_sent(ps)[0] >= sends0 + 1, timeout=10), "P's send never counted"
                    turn_info.update(p=r.headers[XPYD_PREFILL_INSTANCE], bytes=_kv_sent(ps)[1] - sent0)
                turns[c].append(turn_info)
                answer = data["choices"][0]["message"]["content"]
                # A new question long enough to go through P (the proxy's local threshold).
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": make_prompt(tokenizer, 2 * BLOCK, seed + 100 * turn + c)}]
        time.sleep(1.0)  # the last steps' counters
        hits, queries = _counters(ps)
        served = {}
        if front.lb is not None:
            served = {p.name: sum(1 for r in front.lb.requests() if r[0] == p.name) for p in proxies}
        return {"hit_rate": (hits - hits0) / max(1.0, queries - queries0), "turns": turns, "via": served}
    finally:  # whatever was started, also when a start failed halfway
        if front is not None and front.lb is not None:
            front.lb.stop()
        for p in proxies:
            p.stop()


def test_precise_keeps_each_conversation_where_its_history_is_over_two_proxies(servers, tokenizer):
    precise = _chat_run(servers, tokenizer, "precise", seed=7300)
    guess = _chat_run(servers, tokenizer, "cache_aware", seed=7400)
    block_bytes = _block_bytes()
    first = precise["turns"][0][0]  # nothing of it was anywhere: every block shipped
    assert first["bytes"] == -(-first["prompt"] // BLOCK) * block_bytes, first
    for name, run in (("precise", precise), ("cache_aware", guess)):
        per_turn = [[(t["p"] and t["p"][-5:], t["d"][-5:], t["prompt"], round(t["bytes"] / block_bytes, 2))
                     for t in conv] for conv in run["turns"]]  # fmt: skip
        print(f"\n{name}: P hit rate {run['hit_rate']:.3f}, requests per proxy {run['via']}; per conversation "
              f"(P, D, prompt tokens, KV blocks shipped) per turn: {per_turn}")
    if HAPROXY is not None:  # both proxies took part
        assert all(n >= 2 for n in precise["via"].values()), precise["via"]
    for conv in precise["turns"]:
        # Each turn brings two blocks of new tokens: none is served by D alone.
        assert all(t["path"] == "disaggregated" for t in conv), conv
        for prev, turn in zip(conv, conv[1:]):
            # The next turn is prefilled where its history was prefilled and decoded where
            # it was decoded, whichever proxy routed it.
            assert (turn["p"], turn["d"]) == (prev["p"], prev["d"]), conv
            # P shipped only the blocks after those D holds: the previous turn's prompt and
            # answer are there (at most the block where they end is shipped again).
            new_blocks = -(-turn["prompt"] // BLOCK) - prev["prompt"] // BLOCK
            assert 0 < turn["bytes"] <= new_blocks * block_bytes, (turn, prev, block_bytes)
    assert precise["hit_rate"] >= guess["hit_rate"] - 0.05, (precise["hit_rate"], guess["hit_rate"])
    assert precise["hit_rate"] > 0.5, precise["hit_rate"]


def test_one_request_is_one_trace_across_the_proxy_p_and_d(servers, traces: OtlpReceiver, tokenizer):
    """--tracing (issue 50): the client's trace holds the proxy's span, and P's and D's vLLM
    ``llm_request`` spans (each engine's own export) are its children, under the P and D it chose."""
    discs, log_dir, s = servers
    trace_id, client_span = "5a1e" * 8, "c0ffee00c0ffee00"
    proxy = _proxy(discs[0], log_dir, "round_robin", name="proxy-traced", extra_args=("--tracing",),
                   env=traces.export_env("xpyd-proxy"))
    try:
        body = body_for("completions", make_prompt(tokenizer, SYSTEM_TOKENS, 9100), False, max_tokens=MAX_TOKENS)
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=300,
                       headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
        assert r.status_code == 200, r.text
        assert r.headers[XPYD_PATH] == "disaggregated"
    finally:
        proxy.stop()  # SIGTERM: the proxy exports what its batch holds before it exits

    def whole(spans) -> bool:
        names = [x.name for x in spans if x.trace_id == trace_id]
        return (any(x.service == "xpyd-proxy" for x in spans if x.trace_id == trace_id)
                and names.count("llm_request") >= 2 and "kv send" in names and "kv load" in names)

    spans = [x for x in traces.wait_for(whole, 120, "proxy span, both engines' and the connector's spans")
             if x.trace_id == trace_id]
    print(render(spans))  # the trace as text (docs/tracing.md shows one)
    saved = Path(os.environ.get("XPYD_TRACE_JSON") or log_dir / "trace.json")
    otlp_receiver.save(spans, saved)  # scripts/trace_picture.py draws it (docs/img/trace.png)
    print(f"trace saved: {saved}")
    (root,) = [x for x in spans if x.service == "xpyd-proxy"]
    assert root.parent_span_id == client_span and root.name == "POST /v1/completions"
    by_url = {v.url.removeprefix("http://"): k for k, v in s.items()}
    p, d = (f"vllm-{by_url[r.headers[h]]}" for h in (XPYD_PREFILL_INSTANCE, XPYD_DECODE_INSTANCE))
    engines = {x.service: x for x in spans if x.name == "llm_request"}
    assert sorted(engines) == sorted((p, d)) and len(spans) == 5, [(x.service, x.name) for x in spans]
    assert all(x.parent_span_id == root.span_id for x in engines.values())
    # The connector's spans (connector/tracing.py): P's send and D's load of this request's KV, children of
    # the proxy's span too, from each engine's EngineCore process, with the workers' numbers.
    (send,), (load,) = ([x for x in spans if x.name == n] for n in ("kv send", "kv load"))
    assert (send.service, load.service) == (p, d) and send.parent_span_id == load.parent_span_id == root.span_id
    assert send.attributes["xpyd.kv.transfer"] == load.attributes["xpyd.kv.transfer"]
    for kv in (send, load):
        assert kv.attributes["xpyd.kv.result"] == "ok" and kv.attributes["xpyd.kv.ms"] >= 0, kv.attributes
    assert send.attributes["xpyd.kv.bytes"] == load.attributes["xpyd.kv.bytes"] > 0
    assert load.attributes["xpyd.kv.tokens"] > 0 and send.attributes["xpyd.kv.blocks"] > 0
    assert engines[d].start_ns <= load.start_ns and load.end_ns <= engines[d].end_ns
    assert root.attributes["xpyd.prefill.instance"] == r.headers[XPYD_PREFILL_INSTANCE]
    assert root.attributes["xpyd.decode.instance"] == r.headers[XPYD_DECODE_INSTANCE]
    assert root.attributes["xpyd.path"] == "disaggregated"
    # Each engine's span is its own request: P's one token (the prefill), D's answer (or its rest).
    tokens = {x: engines[x].attributes.get("gen_ai.usage.completion_tokens") for x in (p, d)}
    assert tokens[p] == 1 and tokens[d] >= 1, tokens
