"""End to end on real vLLM (CPU build): proxy + 1 P + 1 D, real HTTP, real ZMQ,
real KV transfer, compared token for token with a colocated server.

One cluster for the module (vLLM start-up dominates); tests that break things
run last, in file order.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import e2e_cluster
import httpx
import pytest
from e2e_client import BLOCK, MODEL_DIR, body_for, generate, make_prompt, metric, poll
from e2e_cluster import E2ECluster

pytestmark = pytest.mark.vllm

@pytest.fixture(scope="module")
def sys_(tmp_path_factory: pytest.TempPathFactory) -> E2ECluster:
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    log_dir = Path(tmp_path_factory.mktemp("e2e-logs"))
    c = e2e_cluster.start(log_dir)
    yield c
    c.stop()


def pd_request_id(c: E2ECluster, prefill_kv: str | None = None, decode_kv: str | None = None) -> str:
    p = prefill_kv or c.kv_addr(c.prefill)
    d = decode_kv or c.kv_addr(c.decode)
    return f"___prefill_addr_{p}___decode_addr_{d}_{uuid.uuid4().hex}"


CASES = [
    pytest.param(60, id="1block"),
    pytest.param(3 * BLOCK - 20, id="3blocks-chunked"),  # > MAX_BATCHED_TOKENS: chunked prefill
    pytest.param(6 * BLOCK + 30, id="7blocks-chunked"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("n_tokens", CASES)
def test_disaggregated_equals_colocated(sys_: E2ECluster, tokenizer, n_tokens, endpoint, stream):
    seed = n_tokens * 10 + (endpoint == "chat") * 2 + stream
    prompt = make_prompt(tokenizer, n_tokens, seed)
    body = body_for(endpoint, prompt, stream)
    want, _ = generate(sys_.colocated.url, endpoint, body)
    got, last = generate(sys_.proxy.url, endpoint, body)
    assert got == want
    assert len(want) > 0
    if not stream:
        # D loaded the whole prompt but its last token from P, and says so.
        usage = last["usage"]
        xpyd = last["kv_transfer_params"]["xpyd"]
        assert xpyd["loaded_tokens"] == usage["prompt_tokens"] - 1
        assert xpyd["load_failed"] is False


def test_decode_loaded_prompt_and_computed_one_token(sys_: E2ECluster, tokenizer):
    """D's own metrics: the prompt came over p2p, one prompt token was computed."""
    prompt = make_prompt(tokenizer, 2 * BLOCK + 10, seed=4242)
    body = body_for("completions", prompt, False)
    before_p2p = metric(sys_.decode.url, "vllm:prompt_tokens_cached_by_source_total", {"source": "p2p"})
    before_local = metric(sys_.decode.url, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})
    _, data = generate(sys_.proxy.url, "completions", body)
    n = data["usage"]["prompt_tokens"]
    got = poll(lambda: metric(sys_.decode.url, "vllm:prompt_tokens_cached_by_source_total",
                              {"source": "p2p"}) - before_p2p == n - 1, timeout=10)
    assert got, "D's p2p cached-token counter did not grow by prompt_tokens - 1"
    local = metric(sys_.decode.url, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})
    assert local - before_local == 1
    log = sys_.decode.log()
    key = data["kv_transfer_params"]["xpyd"]["transfer_key"]
    assert re.search(rf"kv loaded req=\S+ transfer={key} tokens={n - 1} ", log), "no load line in D's log"


def test_prefix_hit_on_decode_loads_only_the_rest(sys_: E2ECluster, tokenizer):
    base = make_prompt(tokenizer, 2 * BLOCK + 40, seed=777)
    generate(sys_.proxy.url, "completions", body_for("completions", base, False))
    longer = base + " " + make_prompt(tokenizer, BLOCK, seed=778)
    body = body_for("completions", longer, False)
    want, _ = generate(sys_.colocated.url, "completions", body)
    got, data = generate(sys_.proxy.url, "completions", body)
    assert got == want
    n = data["usage"]["prompt_tokens"]
    loaded = data["kv_transfer_params"]["xpyd"]["loaded_tokens"]
    # D's prefix cache held at least the first 2 full blocks of `base`.
    assert loaded <= n - 1 - 2 * BLOCK
    assert loaded > 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_power_corrupted_kv_changes_output(sys_: E2ECluster, tokenizer, endpoint):
    """Proof the equality tests can fail: zero the received KV and the output differs."""
    prompt = make_prompt(tokenizer, 3 * BLOCK, seed=31337 + (endpoint == "chat"))
    body = body_for(endpoint, prompt, False)
    want, _ = generate(sys_.colocated.url, endpoint, body)
    body["kv_transfer_params"] = {"xpyd_debug_corrupt_kv": True}
    got, _ = generate(sys_.proxy.url, endpoint, body)
    assert got != want
    assert "CORRUPTED(test)" in sys_.decode.log()


# ---------------- faults: nothing hangs, nothing leaks ----------------

def _idle(c: E2ECluster, s) -> bool:
    st = c.engine_stats(s)
    return st["ok"] and all(st[k] == 0 for k in ("recv_bytes", "recv_items", "send_bytes",
                                                 "send_items", "pending_sends", "pending_loads"))


def test_decode_recomputes_when_kv_never_comes(sys_: E2ECluster, tokenizer):
    """P answered but never sent (dead, or gone): D waits kv_load_timeout_s, then
    recomputes (kv_load_failure_policy=recompute) — correct tokens, no hang."""
    prompt = make_prompt(tokenizer, BLOCK + 50, seed=5150)
    body = body_for("completions", prompt, False)
    want, _ = generate(sys_.colocated.url, "completions", body)
    rid = pd_request_id(sys_, prefill_kv=f"127.0.0.1:{e2e_cluster.free_port()}")
    t0 = time.monotonic()
    got, data = generate(sys_.decode.url, "completions", body, {"X-Request-Id": rid},
                         timeout=e2e_cluster.KV_LOAD_TIMEOUT_S + 30)
    elapsed = time.monotonic() - t0
    assert got == want
    assert e2e_cluster.KV_LOAD_TIMEOUT_S * 0.9 <= elapsed <= e2e_cluster.KV_LOAD_TIMEOUT_S + 15
    assert "kv load timed out" in sys_.decode.log()
    # The response says the load failed (D recomputed), not that it loaded the prompt.
    assert data["kv_transfer_params"]["xpyd"]["load_failed"] is True
    assert data["kv_transfer_params"]["xpyd"]["loaded_tokens"] == 0
    assert poll(lambda: _idle(sys_, sys_.decode), timeout=5)


def test_unclaimed_kv_is_dropped_after_ttl(sys_: E2ECluster, tokenizer):
    """P pushed KV for a request that never reaches D: D drops it after the TTL."""
    prompt = make_prompt(tokenizer, BLOCK + 10, seed=9001)
    rid = pd_request_id(sys_)
    generate(sys_.prefill.url, "completions", body_for("completions", prompt, False, max_tokens=1),
             {"X-Request-Id": rid})
    assert poll(lambda: sys_.engine_stats(sys_.decode)["recv_items"] == 1, timeout=10)
    assert poll(lambda: _idle(sys_, sys_.decode), timeout=e2e_cluster.BUFFER_TTL_S + 10, interval=0.5)
    assert "dropped expired transfer" in sys_.decode.log()
    assert poll(lambda: _idle(sys_, sys_.prefill), timeout=5)


def test_send_to_dead_decode_times_out_and_frees(sys_: E2ECluster, tokenizer):
    prompt = make_prompt(tokenizer, BLOCK + 10, seed=9002)
    rid = pd_request_id(sys_, decode_kv=f"127.0.0.1:{e2e_cluster.free_port()}")
    _, data = generate(sys_.prefill.url, "completions",
                       body_for("completions", prompt, False, max_tokens=1), {"X-Request-Id": rid})
    assert data["choices"][0]["finish_reason"] == "length"
    assert poll(lambda: _idle(sys_, sys_.prefill), timeout=e2e_cluster.SEND_TIMEOUT_S + 10)
    assert "kv send failed" in sys_.prefill.log()
    # The delayed-free blocks went back: KV usage returns to zero.
    assert poll(lambda: metric(sys_.prefill.url, "vllm:kv_cache_usage_perc") == 0.0, timeout=10)


def test_client_abort_mid_stream_frees_both_sides(sys_: E2ECluster, tokenizer):
    prompt = make_prompt(tokenizer, 2 * BLOCK, seed=6060)
    body = body_for("completions", prompt, True, max_tokens=3000)
    body["ignore_eos"] = True
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", sys_.proxy.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for ln in r.iter_lines():
                if ln.startswith("data: {"):
                    break  # first token arrived: hang up
    assert poll(lambda: metric(sys_.decode.url, "vllm:num_requests_running") == 0, timeout=15)
    assert poll(lambda: _idle(sys_, sys_.decode) and _idle(sys_, sys_.prefill), timeout=10)
    assert poll(lambda: metric(sys_.decode.url, "vllm:kv_cache_usage_perc") == 0.0, timeout=10)
    assert poll(lambda: metric(sys_.prefill.url, "vllm:kv_cache_usage_perc") == 0.0, timeout=10)


def test_abort_while_decode_waits_for_kv(sys_: E2ECluster, tokenizer):
    """A request aborted while D waits for KV is released at once, not at the deadline."""
    prompt = make_prompt(tokenizer, BLOCK + 10, seed=6061)
    rid = pd_request_id(sys_, prefill_kv=f"127.0.0.1:{e2e_cluster.free_port()}")
    with httpx.Client(timeout=1.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(sys_.decode.url + "/v1/completions", json=body_for("completions", prompt, False),
                        headers={"X-Request-Id": rid})
    t0 = time.monotonic()
    assert poll(lambda: _idle(sys_, sys_.decode), timeout=e2e_cluster.KV_LOAD_TIMEOUT_S)
    assert time.monotonic() - t0 < e2e_cluster.KV_LOAD_TIMEOUT_S - 1
    assert "kv load cancelled" in sys_.decode.log()


def test_prefill_killed_after_answering(sys_: E2ECluster, tokenizer):
    """Last: SIGKILL P right after it answered a prefill; D, asked next (as the
    proxy would), answers within the load deadline and the proxy stops routing
    to the dead P."""
    prompt = make_prompt(tokenizer, BLOCK + 20, seed=7070)
    body = body_for("completions", prompt, False)
    want, _ = generate(sys_.colocated.url, "completions", body)
    rid = pd_request_id(sys_)
    generate(sys_.prefill.url, "completions", body_for("completions", prompt, False, max_tokens=1),
             {"X-Request-Id": rid})
    sys_.prefill.kill()
    t0 = time.monotonic()
    got, _ = generate(sys_.decode.url, "completions", body, {"X-Request-Id": rid},
                      timeout=e2e_cluster.KV_LOAD_TIMEOUT_S + 30)
    assert time.monotonic() - t0 < e2e_cluster.KV_LOAD_TIMEOUT_S + 15
    assert got == want
    # Through the proxy: no live P once its heartbeat expires -> 503, not a hang.
    assert poll(lambda: e2e_cluster.cluster.http_get(sys_.proxy.url + "/ready")[0] == 503, timeout=15)
    with httpx.Client(timeout=30) as client:
        r = client.post(sys_.proxy.url + "/v1/completions", json=body)
    assert r.status_code == 503
    assert r.json()["error"]["message"]
