"""Prefix-aware prefill routing on real vLLM (CPU build, vLLM's default thread binding):
2 P + 1 D + a colocated reference server, one shared-prefix workload per policy.

The same servers serve both policies: the proxy is restarted on the same discovery port
(instances keep heartbeating to it), and each policy gets its own system prompts so the
Ps' prefix caches start cold for it. P's own counters (vllm:prefix_cache_hits/queries,
deltas over the run) give the hit rate; every answer must equal the colocated one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import e2e_cluster
import httpx
import pytest
from e2e_client import (BLOCK, MODEL_DIR, answer_of, assert_same_greedy, body_for, generate, make_prompt, metric, poll,
                        with_logprobs)
from e2e_cluster import free_port, free_port_pair

cluster = e2e_cluster.cluster
pytestmark = pytest.mark.vllm

SYSTEMS = 3
TURNS = 4
SYSTEM_TOKENS = 4 * BLOCK + 20  # 4 full blocks of CPU KV cache shared per system prompt
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    log_dir = Path(tmp_path_factory.mktemp("e2e-routing"))
    disc = free_port()
    env = e2e_cluster.bind_env(None)  # vLLM's default binding
    common = dict(max_num_batched_tokens=e2e_cluster.MAX_BATCHED_TOKENS, env=env)
    started: dict[str, cluster.Server] = {}
    try:
        for name, role in (("p0", "kv_producer"), ("p1", "kv_producer"), ("d", "kv_consumer")):
            port = free_port()
            started[name] = cluster.start_vllm(
                name, port, log_dir, **common,
                kv_config=cluster.kv_transfer_config(role, free_port_pair(), port, disc))  # fmt: skip
        started["colocated"] = cluster.start_vllm("colocated", free_port(), log_dir, **common)
        cluster.wait_until(list(started.values()), "/health", 600)
        yield disc, log_dir, started
    finally:
        for s in started.values():
            s.stop()


def _proxy(disc: int, log_dir: Path, policy: str) -> cluster.Server:
    """A proxy with `policy` for P, waiting until both Ps and the D have registered."""
    # --expose-routing-headers: which P prefilled is read from x-xpyd-prefill-instance.
    proxy = cluster.start_proxy(free_port(), disc, log_dir / policy,
                                ["--prefill-policy", policy, "--heartbeat-timeout", "5",
                                 "--expose-routing-headers"])  # fmt: skip
    cluster.wait_until([proxy], "/health", 60)

    def registered() -> bool:
        status, raw = cluster.http_get(proxy.url + "/instances")
        roles = [i["role"] for i in json.loads(raw)] if status == 200 else []
        return roles.count("P") == 2 and roles.count("D") == 1

    if not poll(registered, timeout=30):
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
    disc, log_dir, s = servers
    ps = [s["p0"], s["p1"]]
    systems = [make_prompt(tokenizer, SYSTEM_TOKENS, seed + k) for k in range(SYSTEMS)]
    proxy = _proxy(disc, log_dir, policy)
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
                used[k].add(r.headers["x-xpyd-prefill-instance"])
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
