"""PUT (synchronous) and GET (D pulls) send modes on real vLLM: P and D talk
directly (the proxy's part is covered elsewhere). D runs without prefix caching
so its own plain answer for the same prompt is an independent colocated
baseline from the same server."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.support import e2e_cluster
from tests.support.e2e_client import assert_same_greedy, body_for, generate, make_prompt
from tests.support.e2e_cluster import free_port, free_port_pair

cluster = e2e_cluster.cluster
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("send_type", ["PUT", "GET"])
def test_send_mode_matches_local_compute(send_type, tokenizer, tmp_path: Path):
    p_port, d_port, p_kv, d_kv = free_port(), free_port(), free_port_pair(), free_port_pair()
    extra = dict(kv_load_timeout_s=20.0, send_timeout_s=5.0)
    p = cluster.start_vllm("prefill", p_port, tmp_path, max_num_batched_tokens=256,
                           kv_config=cluster.kv_transfer_config("kv_producer", p_kv, p_port, None,
                                                                send_type=send_type, **extra))
    d = cluster.start_vllm("decode", d_port, tmp_path, max_num_batched_tokens=256,
                           extra_args=["--no-enable-prefix-caching"],
                           kv_config=cluster.kv_transfer_config("kv_consumer", d_kv, d_port, None,
                                                                send_type=send_type, **extra))
    try:
        cluster.wait_until([p, d], "/health", 600)
        for n_tokens, seed in ((100, 1), (600, 2)):  # 600 > 256: chunked prefill on P
            prompt = make_prompt(tokenizer, n_tokens, seed=seed + (send_type == "GET") * 10)
            body = body_for("completions", prompt, False)
            want, _ = generate(d.url, "completions", body)  # plain id: D computes it all
            rid = f"___prefill_addr_127.0.0.1:{p_kv}___decode_addr_127.0.0.1:{d_kv}_{uuid.uuid4().hex}"
            generate(p.url, "completions", body_for("completions", prompt, False, max_tokens=1),
                     {"X-Request-Id": rid})
            got, data = generate(d.url, "completions", body, {"X-Request-Id": rid})
            assert_same_greedy(got, want)
            assert data["kv_transfer_params"]["xpyd"]["loaded_tokens"] == data["usage"]["prompt_tokens"] - 1
        assert "kv load timed out" not in d.log()
    finally:
        p.stop()
        d.stop()
