"""End to end on real vLLM (CPU build) with the SharedStorageConnector: P and D
share a directory; outputs compared token for token with a colocated server.

One cluster for the module (proxy + P + D + colocated reference); the test that
restarts D runs last. Requests go through the proxy (P stores, D loads) or
straight to one server (no proxy: plain vLLM servers sharing a directory).
"""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path

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
from xpyd_wire import request_id

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def ss(tmp_path_factory: pytest.TempPathFactory) -> ess.SSCluster:
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    log_dir = Path(tmp_path_factory.mktemp("ss-logs"))
    store = Path(tmp_path_factory.mktemp("ss-store"))
    c = ess.start(log_dir, store)
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
