"""Faults on real vLLM (CPU build, vLLM's default thread binding): P talks to two
D instances directly (the proxy's part is covered elsewhere).

- D1 has a KV buffer too small for a 3-block prompt: P's reservation is refused
  before any byte moves, D1's load fails on its next step and D1 recomputes.
- D2 is frozen (SIGSTOP): sends to it wait out their deadline on its own queue,
  while D1's transfers go through at once.
- D3 has another kv_secret than P: P's connection is refused at its handshake (P ships no KV byte),
  D3 gets nothing, waits out its short load deadline and recomputes.

P, D1 and D2 share a kv_secret: every transfer here is authenticated.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from pathlib import Path

import pytest

from connector.transport import KVAuth, TcpTransport
from tests.support import e2e_cluster
from tests.support.e2e_client import BLOCK, assert_same_greedy, body_for, generate, make_prompt, poll
from tests.support.e2e_cluster import free_port, free_port_pair

cluster = e2e_cluster.cluster
pytestmark = pytest.mark.vllm

LOAD_TIMEOUT_S = 20.0  # long on purpose: a fail-fast load must not come near it
SEND_TIMEOUT_S = 4.0
SMALL_BUFFER = 100_000  # one 64 KiB block of the tiny model fits, three do not
KV_SECRET = "faults-kv-secret"
OTHER_SECRET = "a different kv secret"
OTHER_LOAD_TIMEOUT_S = 4.0  # D3 waits this long for KV that is refused, then recomputes


def _rid(p_kv: int, d_kv: int) -> str:
    return f"___prefill_addr_127.0.0.1:{p_kv}___decode_addr_127.0.0.1:{d_kv}_{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def pdd(tmp_path_factory: pytest.TempPathFactory):
    log_dir = Path(tmp_path_factory.mktemp("e2e-faults"))
    ports = {name: (free_port(), free_port_pair()) for name in ("prefill", "d1", "d2", "d3")}
    common = dict(kv_load_timeout_s=LOAD_TIMEOUT_S, send_timeout_s=SEND_TIMEOUT_S, kv_secret=KV_SECRET)
    env = e2e_cluster.bind_env(None)  # vLLM's default binding
    servers = {}
    for name, role, extra in (("prefill", "kv_producer", {}), ("d1", "kv_consumer", {"kv_buffer_size": SMALL_BUFFER}),
                              ("d2", "kv_consumer", {}),
                              ("d3", "kv_consumer", {"kv_secret": OTHER_SECRET,
                                                     "kv_load_timeout_s": OTHER_LOAD_TIMEOUT_S})):
        port, kv = ports[name]
        servers[name] = cluster.start_vllm(
            name, port, log_dir, max_num_batched_tokens=e2e_cluster.MAX_BATCHED_TOKENS, env=env,
            kv_config=cluster.kv_transfer_config(role, kv, port, None, **{**common, **extra}))
    try:
        cluster.wait_until(list(servers.values()), "/health", 600)
        yield servers
    finally:
        for s in servers.values():
            try:
                os.killpg(s.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            s.stop()


def _disaggregated(p, d, prompt: str, timeout: float = LOAD_TIMEOUT_S + 30) -> tuple[str, dict, float]:
    rid = _rid(p.kv_port, d.kv_port)
    generate(p.url, "completions", body_for("completions", prompt, False, max_tokens=1), {"X-Request-Id": rid})
    t0 = time.monotonic()
    body = {**body_for("completions", prompt, False), "kv_transfer_params": {"xpyd_report_transfer_key": True}}
    got, data = generate(d.url, "completions", body, {"X-Request-Id": rid}, timeout=timeout)
    return got, data, time.monotonic() - t0


def test_full_decode_buffer_fails_the_load_at_once_and_recomputes(pdd, tokenizer):
    p, d1 = pdd["prefill"], pdd["d1"]
    prompt = make_prompt(tokenizer, 3 * BLOCK - 10, seed=4401)
    want, _ = generate(p.url, "completions", body_for("completions", prompt, False))  # P's own answer
    got, data, elapsed = _disaggregated(p, d1, prompt)
    assert_same_greedy(got, want)
    assert data["kv_transfer_params"]["xpyd"]["load_failed"] is True
    key = data["kv_transfer_params"]["xpyd"]["transfer_key"]
    assert re.search(rf"refused kv transfer={key} reason=recv buffer full", d1.log())
    # The load failed at once (D's own figure; the answer's wall time also holds D computing the
    # prompt itself, which a loaded box stretches), far from its deadline.
    failed = re.search(rf"kv load failed req=\S+ transfer={key} after ([0-9.]+)ms error=recv buffer full", d1.log())
    assert failed and float(failed[1]) < 1000, failed and failed[0]
    assert elapsed < LOAD_TIMEOUT_S, f"D1 waited {elapsed:.1f}s for KV that was refused (deadline {LOAD_TIMEOUT_S}s)"
    # A prompt that fits still moves.
    small = make_prompt(tokenizer, 60, seed=4402)
    want, _ = generate(p.url, "completions", body_for("completions", small, False))
    got, data, _ = _disaggregated(p, d1, small)
    assert_same_greedy(got, want)
    assert data["kv_transfer_params"]["xpyd"]["loaded_tokens"] == data["usage"]["prompt_tokens"] - 1


def test_frozen_decode_does_not_delay_a_healthy_one(pdd, tokenizer):
    p, d1, d2 = pdd["prefill"], pdd["d1"], pdd["d2"]
    os.killpg(d2.proc.pid, signal.SIGSTOP)
    try:
        # Two prefills whose KV goes to the frozen D2: its queue waits out the deadline.
        for i in range(2):
            generate(p.url, "completions", body_for("completions", make_prompt(tokenizer, 60, seed=4500 + i),
                                                    False, max_tokens=1), {"X-Request-Id": _rid(p.kv_port, d2.kv_port)})
        # Meanwhile D1's transfer goes through at once.
        prompt = make_prompt(tokenizer, 60, seed=4510)
        want, _ = generate(p.url, "completions", body_for("completions", prompt, False))
        got, data, elapsed = _disaggregated(p, d1, prompt)
        assert_same_greedy(got, want)
        assert data["kv_transfer_params"]["xpyd"]["load_failed"] is False
        key = data["kv_transfer_params"]["xpyd"]["transfer_key"]
        wait_ms = float(re.search(rf"kv loaded req=\S+ transfer={key} .*wait_ms=([0-9.]+)", d1.log())[1])
        assert wait_ms < 1000, f"D1's load waited {wait_ms} ms behind the frozen D2"
    finally:
        os.killpg(d2.proc.pid, signal.SIGCONT)
    # D2 answers again. Wait until P is done with the two sends it queued for D2 (each ended:
    # failed at its deadline, or taken once D2 woke) and, if P marked D2 dead, until a probe
    # found it alive again: only then is P's next transfer to D2 expected to go through.
    d2_peer = f"127.0.0.1:{d2.kv_port}"

    def settled() -> bool:
        log = p.log()
        dead, back = log.count(f"kv peer {d2_peer} marked dead"), log.count(f"kv peer {d2_peer} answers again")
        return _kv_stats(p, KV_SECRET)["pending_sends"] == 0 and dead == back

    assert poll(settled, timeout=SEND_TIMEOUT_S + 20), "P still holds D2's sends, or still takes D2 for dead"
    prompt = make_prompt(tokenizer, 70, seed=4520)
    want, _ = generate(p.url, "completions", body_for("completions", prompt, False))
    got, data, _ = _disaggregated(p, d2, prompt)
    assert_same_greedy(got, want)
    assert data["kv_transfer_params"]["xpyd"]["load_failed"] is False


def _kv_stats(s, secret: str) -> dict:
    """A server's rank-0 KV engine accounting, asked with ``secret``."""
    with TcpTransport(auth=KVAuth.from_secret(secret)) as t:
        reply, _ = t.call(f"127.0.0.1:{s.kv_port}", {"op": "stats"}, timeout_s=5.0)
    return reply


def test_decode_with_another_secret_refuses_the_kv_and_recomputes(pdd, tokenizer):
    p, d3 = pdd["prefill"], pdd["d3"]
    prompt = make_prompt(tokenizer, 2 * BLOCK + 10, seed=4601)
    want, _ = generate(p.url, "completions", body_for("completions", prompt, False))  # P's own answer
    got, data, elapsed = _disaggregated(p, d3, prompt)
    assert_same_greedy(got, want)  # D3 recomputed the prompt (kv_load_failure_policy=recompute)
    xpyd = data["kv_transfer_params"]["xpyd"]
    assert xpyd["load_failed"] is True and xpyd["loaded_tokens"] == 0
    assert elapsed < OTHER_LOAD_TIMEOUT_S + 20, f"D3 took {elapsed:.1f}s (deadline {OTHER_LOAD_TIMEOUT_S}s)"
    # D3 refused P's connection at its handshake (P holds another key), before any KV byte; P says why.
    assert re.search(r"kv send failed .*refused the connection at its handshake: it refused this kv_secret",
                     p.log()), "P did not say why"
    assert re.search(r"refused handshake request", d3.log())
    assert re.search(r"kv load timed out", d3.log())
    st = _kv_stats(d3, OTHER_SECRET)
    assert st["refused"]["handshake"] >= 1 and st["refused"]["unauthenticated"] == 0
    assert all(st[k] == 0 for k in ("recv_bytes", "recv_reserved_bytes", "recv_items", "pending_loads"))
    # The rest of the system is unaffected: authenticated transfers to D1 still move.
    small = make_prompt(tokenizer, 60, seed=4602)
    want, _ = generate(p.url, "completions", body_for("completions", small, False))
    got, data, _ = _disaggregated(p, pdd["d1"], small)
    assert_same_greedy(got, want)
    assert data["kv_transfer_params"]["xpyd"]["loaded_tokens"] == data["usage"]["prompt_tokens"] - 1
    assert not any(_kv_stats(pdd["d1"], KV_SECRET)["refused"].values())
