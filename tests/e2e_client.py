"""Client-side helpers of the end-to-end tests: prompts, requests, metrics."""

from __future__ import annotations

import json
import time

import e2e_cluster
import httpx

MODEL_DIR = e2e_cluster.ROOT / ".models" / "tiny-llama"
BLOCK = 128
MAX_TOKENS = 16
WORDS = ("river stone maple quiet engine silver garden window orbit lantern harbor "
         "meadow copper violet thunder pocket canyon ribbon walnut glacier").split()


def make_prompt(tokenizer, n_tokens: int, seed: int) -> str:
    """A distinct prompt of about n_tokens tokens (distinct: no prefix-cache hits
    between test cases unless a test wants them)."""
    words = [f"case{seed}"]
    i = seed
    while len(tokenizer(" ".join(words))["input_ids"]) < n_tokens:
        words.append(WORDS[(i * 7 + len(words)) % len(WORDS)])
        i += 3
    return " ".join(words)


def body_for(endpoint: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    b: dict = {"model": "tiny-llama", "temperature": 0, "max_tokens": max_tokens, "stream": stream}
    if endpoint == "completions":
        b["prompt"] = prompt
    else:
        b["messages"] = [{"role": "user", "content": prompt}]
    return b


def generate(base_url: str, endpoint: str, body: dict, headers: dict | None = None,
             timeout: float = 120.0) -> tuple[str, dict]:
    """Run one request; returns (generated text, the final JSON or last chunk)."""
    url = f"{base_url}/v1/{'completions' if endpoint == 'completions' else 'chat/completions'}"
    with httpx.Client(timeout=timeout) as client:
        if not body.get("stream"):
            r = client.post(url, json=body, headers=headers)
            assert r.status_code == 200, r.text
            data = r.json()
            ch = data["choices"][0]
            return (ch["text"] if endpoint == "completions" else ch["message"]["content"]), data
        text, last = [], {}
        with client.stream("POST", url, json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", lines[-3:]
        for ln in lines[:-1]:
            chunk = json.loads(ln[len("data: "):])
            assert "error" not in chunk, chunk
            last = chunk
            for ch in chunk.get("choices", []):
                text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return "".join(text), last


def metric(base_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of a Prometheus counter/gauge's samples matching the labels."""
    _, raw = e2e_cluster.cluster.http_get(base_url + "/metrics", timeout=5)
    total = 0.0
    for line in raw.decode().splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if labels and not all(f'{k}="{v}"' in line for k, v in labels.items()):
            continue
        total += float(line.rsplit(" ", 1)[1])
    return total


def poll(fn, timeout: float, interval: float = 0.2):
    """Call fn until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(interval)


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))
