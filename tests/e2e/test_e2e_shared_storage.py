"""End to end on real vLLM (CPU build) with the SharedStorageConnector: P and D
share a directory; outputs compared token for token with a colocated server.

One cluster for the module (proxy + P + D + colocated reference); the test that
restarts D runs last. Requests go through the proxy (P stores, D loads) or
straight to one server (no proxy: plain vLLM servers sharing a directory).
P and D export their spans (--otlp-traces-endpoint) to a receiver on loopback.
"""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path

import httpx
import pytest
import torch

from connector.shared_storage.store import BlockStore, FileMeta
from tests.support import e2e_shared_storage as ess
from tests.support.e2e_client import (
    BLOCK,
    MODEL_DIR,
    assert_greedy_differs,
    assert_same_greedy,
    body_for,
    generate,
    make_prompt,
    metric,
    poll,
)
from tests.support.otlp_receiver import OtlpReceiver
from xpyd_wire import request_id

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def traces():
    """The OTLP receiver P and D export their spans to."""
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="module")
def ss(tmp_path_factory: pytest.TempPathFactory, traces: OtlpReceiver) -> ess.SSCluster:
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    log_dir = Path(tmp_path_factory.mktemp("ss-logs"))
    store = Path(tmp_path_factory.mktemp("ss-store"))
    c = ess.start(log_dir, store, traces=traces)
    yield c
    c.stop()


def disk_tokens(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_cached_by_source_total", {"source": "disk"})


def xpyd(data: dict) -> dict:
    return (data.get("kv_transfer_params") or {}).get("xpyd") or {}


def header(path: Path) -> dict:
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<I", raw[8:12])
    return json.loads(raw[12:12 + hlen])


def store_on_p(c: ess.SSCluster, prompt: str) -> dict[int, Path]:
    """Send prompt straight to P (no proxy) and return the block files its
    request wrote, by block index (the writer finishes shortly after the answer)."""
    before = set(c.block_files())
    _, data = generate(c.prefill.url, "completions", body_for("completions", prompt, False))
    want = data["usage"]["prompt_tokens"] // BLOCK
    files = poll(lambda: (lambda new: new if len(new) >= want else None)(set(c.block_files()) - before), 10)
    assert files, f"P did not store {want} blocks"
    return {header(p)["index"]: p for p in files}


def expected_loaded(n_prompt: int) -> int:
    return min((n_prompt // BLOCK) * BLOCK, n_prompt - 1)


@pytest.mark.parametrize("endpoint,n_tokens", [
    ("completions", 60),  # no full block: nothing stored, D computes it all
    ("completions", 3 * BLOCK - 20),  # chunked prefill on P (256 tokens a step)
    ("completions", 6 * BLOCK + 30),
    ("chat", 2 * BLOCK + 50),
], ids=["1block", "3blocks-chunked", "7blocks-chunked", "chat-3blocks"])
def test_disaggregated_equals_colocated(ss: ess.SSCluster, tokenizer, endpoint: str, n_tokens: int):
    prompt = make_prompt(tokenizer, n_tokens, seed=n_tokens + 1000 * (endpoint == "chat"))
    body = body_for(endpoint, prompt, False)
    want, _ = generate(ss.colocated.url, endpoint, body)
    before = disk_tokens(ss.decode.url)
    got, data = generate(ss.proxy.url, endpoint, body)
    assert_same_greedy(got, want)
    n = data["usage"]["prompt_tokens"]
    loaded = expected_loaded(n)
    assert xpyd(data).get("loaded_tokens", 0) == loaded
    assert xpyd(data).get("load_failed", False) is False
    assert poll(lambda: disk_tokens(ss.decode.url) - before == loaded, 10)


def test_one_request_through_storage_is_one_trace(ss: ess.SSCluster, traces: OtlpReceiver, tokenizer):
    """P's ``kv store`` (a part per prefill chunk, each written) and D's ``kv load`` of the same blocks
    are children of the client's span (the proxy passes its traceparent on), each from its engine, with
    the same transfer, blocks and bytes (connector/tracing.py)."""
    trace_id, client_span = "5701" * 8, "c0ffee00c0ffee01"
    body = body_for("completions", make_prompt(tokenizer, 6 * BLOCK + 30, seed=81), False)  # 4 chunks on P
    r = httpx.post(ss.proxy.url + "/v1/completions", json=body, timeout=300,
                   headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]

    def both(spans) -> bool:
        names = [x.name for x in spans if x.trace_id == trace_id]
        return "kv store" in names and "kv load" in names

    spans = [x for x in traces.wait_for(both, 60, "P's kv store and D's kv load") if x.trace_id == trace_id]
    (store,), (load,) = ([x for x in spans if x.name == name] for name in ("kv store", "kv load"))
    assert (store.service, load.service) == ("vllm-prefill", "vllm-decode")
    assert store.parent_span_id == load.parent_span_id == client_span
    for kv in (store, load):
        assert kv.attributes["xpyd.kv.result"] == "ok" and kv.attributes["xpyd.kv.storage"] == "shared", kv.attributes
    assert store.attributes["xpyd.kv.transfer"] == load.attributes["xpyd.kv.transfer"]
    assert store.attributes["xpyd.kv.blocks"] == load.attributes["xpyd.kv.blocks"] == n // BLOCK
    assert store.attributes["xpyd.kv.bytes"] == load.attributes["xpyd.kv.bytes"] > 0
    assert load.attributes["xpyd.kv.tokens"] == expected_loaded(n)


def test_no_proxy_common_prefix_reuses_stored_blocks(ss: ess.SSCluster, tokenizer):
    """A goes to P only; B = A + more text goes to D only. D loads the 3 full
    blocks it shares with A from the files P wrote for A, and computes the rest."""
    a = make_prompt(tokenizer, 3 * BLOCK + 20, seed=31)
    files = store_on_p(ss, a)
    assert sorted(files) == [0, 1, 2]
    b = a + " " + make_prompt(tokenizer, BLOCK, seed=32)
    body = body_for("completions", b, False)
    want, _ = generate(ss.colocated.url, "completions", body)
    before = disk_tokens(ss.decode.url)
    got, data = generate(ss.decode.url, "completions", body)
    assert_same_greedy(got, want)
    assert xpyd(data)["loaded_tokens"] == 3 * BLOCK
    assert poll(lambda: disk_tokens(ss.decode.url) - before == 3 * BLOCK, 10)
    assert re.search(r"kv loaded from storage req=\S+ blocks=3 first_block=0 ", ss.decode.log())
    assert set(ss.block_files()) >= set(files.values())


def test_corrupted_file_is_detected_and_recomputed(ss: ess.SSCluster, tokenizer):
    prompt = make_prompt(tokenizer, 3 * BLOCK + 30, seed=41)
    files = store_on_p(ss, prompt)
    raw = bytearray(files[1].read_bytes())
    raw[-100] ^= 0x5A  # one byte of block 1's KV payload
    files[1].write_bytes(bytes(raw))
    body = body_for("completions", prompt, False)
    want, _ = generate(ss.colocated.url, "completions", body)
    got, data = generate(ss.decode.url, "completions", body)
    assert_same_greedy(got, want)  # recomputed from block 1 on
    assert xpyd(data)["load_failed"] is True
    assert xpyd(data)["loaded_tokens"] == BLOCK  # block 0 was good
    log = ss.decode.log()
    assert re.search(r"kv storage miss req=\S+ loaded_blocks=1 of 3 .*block 1 key=\w+: checksum mismatch", log)
    assert not files[1].exists()  # the damaged file was dropped
    # The next store of the prompt writes it again.
    generate(ss.prefill.url, "completions", body)
    assert poll(lambda: files[1].exists(), 10)


def test_wrong_kv_with_a_valid_checksum_changes_the_output(ss: ess.SSCluster, tokenizer):
    """Power check: KV that passes every check but is wrong (zeros, re-checksummed)
    makes D's output differ from the colocated one, so the equalities above mean
    D really used the stored KV."""
    prompt = make_prompt(tokenizer, 3 * BLOCK + 30, seed=51)
    files = store_on_p(ss, prompt)
    for idx, path in files.items():
        h = header(path)
        meta = FileMeta(h["model_id"], h["block_size"], h["layout"], h["dtype"], tuple(h["block_shape"]),
                        tuple(h["layers"]), h["rank"], h["world"])
        path.unlink()
        BlockStore(ss.store, meta).write(h["key"], idx, torch.zeros(h["nbytes"], dtype=torch.uint8))
    body = body_for("completions", prompt, False)
    want, _ = generate(ss.colocated.url, "completions", body)
    got, data = generate(ss.decode.url, "completions", body)
    assert xpyd(data) == {"storage": "shared", "loaded_tokens": 3 * BLOCK, "load_failed": False,
                          "waited_for_producer": False}
    assert_greedy_differs(got, want)


def test_decode_waits_for_a_store_that_never_comes_then_recomputes(ss: ess.SSCluster, tokenizer):
    """A proxy-style request reaches D although P never stored its prompt (P lost
    it): D waits for the files up to kv_load_timeout_s, then computes the prompt."""
    prompt = make_prompt(tokenizer, 2 * BLOCK + 30, seed=71)
    body = body_for("completions", prompt, False)
    want, _ = generate(ss.colocated.url, "completions", body)
    rid = request_id.build(ss.kv_addr(ss.prefill), ss.kv_addr(ss.decode))
    t0 = time.monotonic()
    got, data = generate(ss.decode.url, "completions", body, headers={"X-Request-Id": rid})
    elapsed = time.monotonic() - t0
    assert_same_greedy(got, want)
    assert xpyd(data) == {"storage": "shared", "loaded_tokens": 0, "load_failed": True,
                          "waited_for_producer": True}
    assert ess.KV_LOAD_TIMEOUT_S <= elapsed < ess.KV_LOAD_TIMEOUT_S + 20


def test_restart_of_decode_keeps_the_kv(ss: ess.SSCluster, tokenizer):
    """Through the proxy, then D restarts (empty prefix cache): the same prompt is
    served from the files, and the output is still the colocated one."""
    prompt = make_prompt(tokenizer, 4 * BLOCK + 10, seed=61)
    body = body_for("completions", prompt, False)
    want, _ = generate(ss.colocated.url, "completions", body)
    got, data = generate(ss.proxy.url, "completions", body)
    assert_same_greedy(got, want)
    assert xpyd(data)["loaded_tokens"] == 4 * BLOCK
    ss.restart_decode()
    assert disk_tokens(ss.decode.url) == 0
    got, data = generate(ss.proxy.url, "completions", body)
    assert_same_greedy(got, want)
    assert xpyd(data)["loaded_tokens"] == 4 * BLOCK and xpyd(data)["load_failed"] is False
    assert poll(lambda: disk_tokens(ss.decode.url) == 4 * BLOCK, 10)
    assert "kv loaded from storage" in ss.decode.log()
