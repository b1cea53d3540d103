"""LoRA adapters through the proxy on real vLLM (CPU build; issue 46, section 3).

One system: a proxy with an admin key, P and D with the KV connector, and a colocated
reference server, all started with --enable-lora and runtime LoRA updating on
(VLLM_ALLOW_RUNTIME_LORA_UPDATING). The adapter is made here (scripts/make_tiny_lora.py: a
rank-8 adapter of every projection of the tiny model, nonzero, deterministic), no download.
The same adapter is loaded on the reference directly and on P and D through the proxy;
then each test sends the same request to both and compares:
- the admin routes' answers (status and body) for a load, a load again, a load of a
  directory that does not exist, an unload, and the 404 for the unloaded adapter;
- /v1/models, card for card (ids in order, parent, root; not `created` nor the permission ids,
  a server's own);
- greedy answers for the adapter (completions and chat, streamed and not; prompts long enough
  for P then D, and short ones D answers alone): token for token and logprob for logprob as the
  reference's, and not the base model's. P's KV computed with the adapter is what D loads:
  wrong KV (the base model's) would not give the reference's tokens.
The reference computes with P's and D's OpenMP thread count (vLLM reserves one core more
for a server with a KV connector), as in tests/e2e/test_e2e_fidelity.py.
Cost: three vLLM servers (~1.5-2 min to start on a 2-core box) and ~30 requests.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from scripts.make_tiny_lora import make_lora
from tests.support import e2e_cluster
from tests.support.e2e_client import (
    LOGPROB_TOL,
    MODEL_DIR,
    assert_greedy_differs,
    assert_same_greedy,
    body_for,
    generate,
)
from xpyd_wire.headers import XPYD_FANOUT, XPYD_PATH

pytestmark = pytest.mark.vllm

cluster = e2e_cluster.cluster
MODEL = "tiny-llama"
ADAPTER = "tiny-lora"
ADMIN_KEY = "e2e-admin-key"
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
REFERENCE_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "2"}  # P's and D's thread count (module text)
LONG = ("The river ran past the old stone mill where the miller kept his ledgers of grain and "
        "the names of every farmer who came down from the hills in autumn")  # P, then D
SHORT = "The quiet garden"  # under --local-prefill-threshold: D alone


@dataclass
class System:
    proxy: cluster.Server
    prefill: cluster.Server
    decode: cluster.Server
    colocated: cluster.Server
    adapter: Path
    client: httpx.Client

    def admin(self, server: cluster.Server, path: str, body: dict, key: str | None = ADMIN_KEY) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return self.client.post(server.url + path, json=body, headers=headers)

    def both(self, path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
        """(through the proxy, from the reference)"""
        return self.admin(self.proxy, path, body), self.admin(self.colocated, path, body, key=None)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory):
    if not MODEL_DIR.joinpath("model.safetensors").exists():
        pytest.fail("tiny model missing: run scripts/setup.sh")
    log_dir = tmp_path_factory.mktemp("lora")
    adapter = make_lora(log_dir / ADAPTER)
    key_file = e2e_cluster.secret_file(log_dir, "admin-key", ADMIN_KEY)
    disc = e2e_cluster.free_port()
    proxy = cluster.start_proxy(e2e_cluster.free_port(), disc, log_dir, [
        "--admin-api-key-file", str(key_file), "--expose-routing-headers",
        "--local-prefill-threshold", str(e2e_cluster.LOCAL_PREFILL_THRESHOLD),
        "--models-refresh-interval", "1"])  # fmt: skip
    started = [proxy]
    try:
        servers = []
        for role, name in (("kv_producer", "prefill"), ("kv_consumer", "decode")):
            kv = cluster.kv_transfer_config(role, e2e_cluster.free_port_pair(), port := e2e_cluster.free_port(), disc)
            servers.append(cluster.start_vllm(name, port, log_dir, kv_config=kv, extra_args=LORA_ARGS,
                                              env={**e2e_cluster.bind_env(None), **LORA_ENV}))
            started.append(servers[-1])
        colocated = cluster.start_vllm("colocated", e2e_cluster.free_port(), log_dir, extra_args=LORA_ARGS,
                                       env={**e2e_cluster.bind_env(None), **LORA_ENV, **REFERENCE_ENV})
        started.append(colocated)
        cluster.wait_until(started, "/health", 600)
        e2e_cluster.wait_instances(proxy, 1, 1)
    except BaseException:
        for s in started:
            s.stop()
        raise
    s = System(proxy, servers[0], servers[1], colocated, adapter, httpx.Client(timeout=120))
    yield s
    s.client.close()
    for server in started:
        server.stop()


def same(via: httpx.Response, ref: httpx.Response) -> None:
    """The proxy answered as the reference: status, body, and content type (none for vLLM's
    success text)."""
    assert (via.status_code, via.content) == (ref.status_code, ref.content), (via.text, ref.text)
    assert via.headers.get("content-type") == ref.headers.get("content-type")


def test_loading_through_the_proxy_answers_as_one_vllm(system: System):
    load = {"lora_name": ADAPTER, "lora_path": str(system.adapter)}
    missing = {"lora_name": ADAPTER, "lora_path": str(system.adapter.parent / "no-such-adapter")}
    via, ref = system.both("/v1/load_lora_adapter", missing)
    same(via, ref)
    assert via.status_code == 404
    assert system.admin(system.proxy, "/v1/load_lora_adapter", load, key="wrong").status_code == 401
    via, ref = system.both("/v1/load_lora_adapter", load)
    same(via, ref)
    assert via.text == f"Success: LoRA adapter '{ADAPTER}' added successfully."
    assert via.headers[XPYD_FANOUT] == (f"P 127.0.0.1:{system.prefill.port} 200, "
                                        f"D 127.0.0.1:{system.decode.port} 200")  # fmt: skip
    via, ref = system.both("/v1/load_lora_adapter", load)  # again: vLLM's 400, from each instance alike
    same(via, ref)
    assert via.status_code == 400


def _cards(server: cluster.Server, client: httpx.Client) -> list[dict]:
    """/v1/models' cards without what each server makes up (created, the permission's id)."""
    data = client.get(server.url + "/v1/models").json()["data"]
    return [{k: v for k, v in card.items() if k not in ("created", "permission")} for card in data]


def test_models_list_the_adapter_as_vllm_does(system: System):
    cards = _cards(system.proxy, system.client)
    assert [c["id"] for c in cards] == [MODEL, ADAPTER]
    assert cards[1]["parent"] == MODEL and cards[1]["root"] == str(system.adapter)
    assert cards == _cards(system.colocated, system.client)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_adapters_answers_are_the_references_and_not_the_base_models(system: System, endpoint: str,
                                                                        stream: bool):
    for prompt in (LONG, SHORT):
        body = {**body_for(endpoint, prompt, stream), "model": ADAPTER}
        got, _ = generate(system.proxy.url, endpoint, body)
        want, _ = generate(system.colocated.url, endpoint, body)
        assert_same_greedy(got, want, LOGPROB_TOL)
        base, _ = generate(system.colocated.url, endpoint, {**body, "model": MODEL})
        assert_greedy_differs(want, base)


def test_a_long_prompt_for_the_adapter_goes_through_p_and_d(system: System):
    for prompt, path in ((LONG, "disaggregated"), (SHORT, "local_short")):
        r = system.client.post(system.proxy.url + "/v1/completions",
                               json={**body_for("completions", prompt, False), "model": ADAPTER})
        assert r.status_code == 200, r.text
        assert r.headers[XPYD_PATH] == path
        assert r.json()["model"] == ADAPTER


def test_unloading_through_the_proxy_then_vllms_404_for_the_adapter(system: System):
    via, ref = system.both("/v1/unload_lora_adapter", {"lora_name": ADAPTER})
    same(via, ref)
    assert via.text == f"Success: LoRA adapter '{ADAPTER}' removed successfully."
    assert [c["id"] for c in _cards(system.proxy, system.client)] == [MODEL]
    body = json.dumps({**body_for("completions", LONG, False), "model": ADAPTER})
    headers = {"content-type": "application/json"}
    via, ref = (system.client.post(s.url + "/v1/completions", content=body, headers=headers)
                for s in (system.proxy, system.colocated))  # fmt: skip
    same(via, ref)
    assert via.status_code == 404 and via.json()["error"]["type"] == "NotFoundError"
    via, ref = system.both("/v1/unload_lora_adapter", {"lora_name": ADAPTER})  # nothing left: vLLM's 404
    same(via, ref)
    assert via.status_code == 404


def test_an_adapter_only_d_holds_is_served_by_d_alone_as_the_reference(system: System):
    """Loaded on D by hand, not on P: the proxy learns it from D's /v1/models and sends the
    adapter's prompts to D alone, never to the base-model P (which answers vLLM's 404 for it:
    a wasted round trip, then D judging alone; a P holding another adapter of that name would
    compute KV that D must not load)."""
    load = {"lora_name": ADAPTER, "lora_path": str(system.adapter)}
    for server in (system.decode, system.colocated):
        assert system.admin(server, "/v1/load_lora_adapter", load, key=None).status_code == 200
    deadline = time.monotonic() + 60
    while ADAPTER not in [c["id"] for c in _cards(system.proxy, system.client)]:
        assert time.monotonic() < deadline, "the proxy never learned D's adapter"
        time.sleep(0.5)
    for endpoint in ("completions", "chat"):
        body = {**body_for(endpoint, LONG, False), "model": ADAPTER}
        r = system.client.post(system.proxy.url + ("/v1/completions" if endpoint == "completions"
                                                   else "/v1/chat/completions"), json=body)  # fmt: skip
        assert r.status_code == 200 and r.headers[XPYD_PATH] == "local_no_prefill", r.text
        got, _ = generate(system.proxy.url, endpoint, body)
        want, _ = generate(system.colocated.url, endpoint, body)
        assert_same_greedy(got, want, LOGPROB_TOL)
