"""KV-event intake on real vLLM (CPU build; issue 17, part 1): one P instance publishes its KV
events (bound on 127.0.0.1 only, through vLLM's IPv4-mapped form), its connector advertises
them in its heartbeat, and the proxy subscribes: /instances shows the index known and
growing by the prompts' full blocks. The engine restarted at the same address: the proxy's
index of it starts over, empty and known."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support import e2e_cluster
from tests.support.e2e_client import BLOCK, body_for, generate, load_tokenizer, make_prompt, poll
from tests.support.e2e_cluster import free_port, free_port_pair

cluster = e2e_cluster.cluster
pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 2 * BLOCK + 40  # two full blocks of vLLM's CPU block size (128)


def _start_p(log_dir: Path, port: int, kv: int, events: int, disc: int) -> cluster.Server:
    ev = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://[::ffff:127.0.0.1]:{events}",
          "replay_endpoint": f"tcp://[::ffff:127.0.0.1]:{events + 1}"}
    return cluster.start_vllm("prefill", port, log_dir, env=e2e_cluster.bind_env(None),
                              kv_config=cluster.kv_transfer_config("kv_producer", kv, port, disc),
                              extra_args=["--kv-events-config", json.dumps(ev)])


def _events(proxy: cluster.Server) -> dict | None:
    status, raw = cluster.http_get(proxy.url + "/instances", timeout=5)
    if status != 200:
        return None
    entries = [i for i in json.loads(raw) if i["role"] == "P" and not i["pending"]]
    return entries[0]["kv_events"] if entries else None


def _wait(proxy: cluster.Server, pred, timeout: float = 30.0) -> dict:
    got = poll(lambda: (lambda v: v if v and pred(v) else None)(_events(proxy)), timeout)
    assert got, f"proxy's view of the instance's events: {_events(proxy)}"
    return got


def _prefill(p: cluster.Server, prompt: str) -> None:
    generate(p.url, "completions", body_for("completions", prompt, False, max_tokens=1))


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory):
    log_dir = Path(tmp_path_factory.mktemp("e2e-kv-events"))
    disc = free_port()
    proxy = cluster.start_proxy(free_port(), disc, log_dir, ["--heartbeat-timeout", "5"])
    ports = (free_port(), free_port_pair(), free_port_pair(), disc)
    servers = {"proxy": proxy, "p": _start_p(log_dir, *ports)}
    try:
        cluster.wait_until([proxy], "/health", 60)
        cluster.wait_until([servers["p"]], "/health", 600)
        yield servers, ports, log_dir
    finally:
        for s in servers.values():
            s.stop()


def test_index_grows_with_prompts_and_resets_on_restart(system):
    servers, ports, log_dir = system
    proxy = servers["proxy"]
    tok = load_tokenizer()
    a, b = (make_prompt(tok, PROMPT_TOKENS, seed) for seed in (1701, 1702))

    v = _wait(proxy, lambda v: v["state"] == "known")
    assert v["blocks"] == 0 and v["cap"] > 0  # the capacity the connector advertised
    _prefill(servers["p"], a)
    v = _wait(proxy, lambda v: v["blocks"] >= 2)
    assert v["blocks"] == 2 and v["state"] == "known"
    _prefill(servers["p"], b)
    _wait(proxy, lambda v: v["blocks"] == 4)
    seq = _events(proxy)["next_seq"]
    _prefill(servers["p"], a)  # a prefix-cache hit: no new block
    _prefill(servers["p"], make_prompt(tok, BLOCK // 2, 1703))  # no full block: nothing stored
    time.sleep(1.0)
    v = _events(proxy)
    assert v["blocks"] == 4 and v["dropped"] == 0 and v["next_seq"] >= seq and v["gaps"] == 0

    # The engine restarts at the same address: whatever the proxy knew of it is gone.
    servers["p"].stop()
    servers["p"] = _start_p(log_dir, *ports)
    cluster.wait_until([servers["p"]], "/health", 600)
    v = _wait(proxy, lambda v: v["state"] == "known" and v["blocks"] == 0, timeout=60)
    _prefill(servers["p"], b)
    _wait(proxy, lambda v: v["blocks"] == 2)


# ---------------------------------------------------------------- exact prompt keys (part 2)
# proxy/routing/prompt_keys.py against the same server's /tokenize: the token ids a `precise` policy
# would key a prompt by are the ones vLLM computes, on every request shape it reproduces.

TOKENIZE_CASES = {
    "text": {"prompt": "river stone maple quiet engine"},
    "text-no-special": {"prompt": "river stone maple", "add_special_tokens": False},
    "non-ascii": {"prompt": "Grüße aus Köln — 東京 🚀 naïve café"},
    "long-text": {"prompt": " ".join(["garden window orbit lantern harbor"] * 200)},
    "chat": {"messages": [{"role": "system", "content": "You are terse."},
                          {"role": "user", "content": "Name a river."},
                          {"role": "assistant", "content": "The Rhine."},
                          {"role": "user", "content": "Another, in Köln?"}]},
    "chat-parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                                             {"type": "text", "text": "second ✓"}]}]},
    "chat-no-generation-prompt": {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    "chat-continue": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
                      "add_generation_prompt": False, "continue_final_message": True},
}


def _vllm_tokens(p: cluster.Server, body: dict) -> list[int]:
    import httpx

    r = httpx.post(p.url + "/tokenize", json={"model": "tiny-llama", **body}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()["tokens"]


@pytest.mark.parametrize("case", list(TOKENIZE_CASES))
def test_prompt_token_ids_equal_vllms(system, case: str):
    from proxy.routing.prompt_keys import CHAT, COMPLETIONS, PromptTokenizer
    from tests.support.e2e_client import MODEL_DIR

    servers, _, _ = system
    body = TOKENIZE_CASES[case]
    path = CHAT if "messages" in body else COMPLETIONS
    (ours,) = PromptTokenizer(MODEL_DIR).token_ids(path, body)
    assert ours == _vllm_tokens(servers["p"], body)


def test_batch_prompt_token_ids_equal_vllms_per_element(system):
    from proxy.routing.prompt_keys import COMPLETIONS, PromptTokenizer
    from tests.support.e2e_client import MODEL_DIR

    servers, _, _ = system
    batch = ["river stone", "東京 maple", "quiet " * 50]
    ours = PromptTokenizer(MODEL_DIR).token_ids(COMPLETIONS, {"prompt": batch})
    assert ours == [_vllm_tokens(servers["p"], {"prompt": p}) for p in batch]
    # What vLLM counted when it served the batch: the same sizes.
    _, data = generate(servers["p"].url, "completions", {**body_for("completions", batch[0], False, max_tokens=1),
                                                         "prompt": batch})
    assert data["usage"]["prompt_tokens"] == sum(len(t) for t in ours)


@pytest.mark.parametrize("prompt", ["river stone maple quiet engine", [1, 305, 77, 912, 4, 4, 600]],
                         ids=["text", "token-ids"])
def test_prompt_token_ids_equal_what_vllm_served(system, prompt):
    """The ids vLLM really ran (echoed back as token ids), not only what /tokenize says."""
    from proxy.routing.prompt_keys import COMPLETIONS, PromptTokenizer
    from tests.support.e2e_client import MODEL_DIR

    servers, _, _ = system
    (ours,) = PromptTokenizer(MODEL_DIR).token_ids(COMPLETIONS, {"prompt": prompt})
    body = {**body_for("completions", "x", False, max_tokens=1), "prompt": prompt, "echo": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    _, data = generate(servers["p"].url, "completions", body)
    echoed = data["choices"][0]["logprobs"]["tokens"][: data["usage"]["prompt_tokens"]]
    assert [int(t.removeprefix("token_id:")) for t in echoed] == ours
