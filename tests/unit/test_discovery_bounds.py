"""What a discovery sender may cost the proxy (issue 47, part 1), against a real proxy over
real ZMQ and raw TCP: a flood of small messages from several connections leaves /health fast
and the proxy serving (with and without a discovery secret), and is counted; connections
that complete ZMTP's handshake and then say nothing are held only up to the caps, overall
and per source host, and the rest are shut down as they come."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.fake_vllm import FakeVLLM
from tests.support.proxy_helpers import running_proxy
from tests.support.proxy_process import ROOT, start_proxy, stop, wait_ready
from tests.support.zmtp import closed, idle_connection

FLOOD_S = 4.0
# /health's slowest answer during the flood. A loaded 2-core box answers in well under it; the
# receive loop that never yielded held /health for the whole flood (5 s for a 2.5 s flood).
HEALTH_BOUND_S = 1.5

# Three DEALERs sending small malformed messages as fast as libzmq takes them (a message
# the queue cannot take is dropped here, as a flooder would).
FLOODER = """
import sys, time, zmq
ctx = zmq.Context()
socks = []
for _ in range(3):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect("tcp://" + sys.argv[1])
    socks.append(s)
time.sleep(0.2)
end = time.monotonic() + float(sys.argv[2])
sent = 0
while time.monotonic() < end:
    for s in socks:
        for _ in range(100):
            try:
                s.send(b"\\x93\\x01\\x02\\x03", zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                break
print(sent)
"""


@pytest.mark.parametrize("secret", [None, "flood-secret"], ids=["unsigned", "signed"])
async def test_a_flood_of_small_messages_leaves_health_fast_and_the_proxy_serving(tmp_path, secret):
    extra = ["--log-level", "warning", "--heartbeat-timeout", "30"]
    env_secret = []
    if secret:
        key = tmp_path / "secret"
        key.write_text(secret)
        key.chmod(0o600)
        env_secret = ["--discovery-secret-file", str(key)]
    proc, url, disc = await start_proxy(tmp_path, *extra, *env_secret)
    p = d = None
    try:
        p = await FakeVLLM("P", proxy=disc, secret=secret).start()
        d = await FakeVLLM("D", proxy=disc, secret=secret).start()
        async with httpx.AsyncClient(base_url=url, timeout=30, verify=False) as client:
            await wait_ready(client, url, proc)
            flooder = subprocess.Popen([sys.executable, "-c", FLOODER, disc, str(FLOOD_S)], stdout=subprocess.PIPE,
                                       text=True, cwd=ROOT)
            try:
                worst = 0.0
                t_end = time.monotonic() + FLOOD_S + 1.0
                while time.monotonic() < t_end:
                    t0 = time.perf_counter()
                    r = await client.get("/health")
                    assert r.status_code == 200
                    worst = max(worst, time.perf_counter() - t0)
                    await asyncio.sleep(0.05)
                sent = int(flooder.communicate(timeout=30)[0])
            finally:
                if flooder.poll() is None:
                    flooder.kill()
                    flooder.wait()
            assert sent > 10_000, sent  # a flood indeed
            assert worst < HEALTH_BOUND_S, f"/health took {worst:.2f}s during a flood of {sent} messages"
            # After it, a completion is served at once (the flood's backlog does not hold it).
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "Hi", "max_tokens": 2},
                                  timeout=10)
            assert r.status_code == 200, r.text
            assert time.perf_counter() - t0 < 5.0
            metrics = (await client.get("/metrics")).text
            dropped = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                          if line.startswith("xpyd_discovery_messages_total{") and "accepted" not in line
                          and "left" not in line)  # fmt: skip
            assert 'result="rate_limited"' in metrics and dropped > 0
    finally:
        for fake in (p, d):
            if fake is not None:
                await fake.stop()
        await stop(proc)


# ---------------------------------------------------------------- idle connections


async def settled(socks: list[socket.socket], n_closed: int, timeout: float = 10.0) -> list[bool]:
    """Each socket closed or not, once `n_closed` of them are (or at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        state = [closed(s) for s in socks]
        if sum(state) >= n_closed or time.monotonic() > deadline:
            await asyncio.sleep(0.3)  # and no more than that
            return [closed(s) or was for s, was in zip(socks, state)]
        await asyncio.sleep(0.05)


async def test_idle_connections_are_held_only_up_to_the_caps():
    """Connections that complete ZMTP's handshake and then say nothing: from one host at most
    --discovery-max-connections-per-source are held, from all at most
    --discovery-max-connections; the rest are shut down as they come (they were all held, and
    1,000 of them took the descriptors HTTP clients need). Freed slots are used again."""
    socks: list[socket.socket] = []
    async with running_proxy(discovery_max_connections=12, discovery_max_connections_per_source=8) as px:
        port = px.state.discovery.port
        try:
            first = [idle_connection(port, "127.0.0.1") for _ in range(10)]
            socks += first
            state = await settled(first, 2)
            assert sum(state) == 2 and not any(state[:8]), state
            second = [idle_connection(port, "127.0.0.2") for _ in range(6)]
            socks += second
            state = await settled(second, 2)
            assert sum(state) == 2 and not any(state[:4]), state
            assert await px.metric("xpyd_discovery_connections_refused_total", reason="source_limit") == 2
            assert await px.metric("xpyd_discovery_connections_refused_total", reason="limit") == 2
            assert await px.metric("xpyd_discovery_connections") == 12
            # /health is not held up by any of it.
            t0 = time.perf_counter()
            assert (await px.client.get("/health")).status_code == 200 and time.perf_counter() - t0 < 1.0
            # Connections that leave free their slots.
            for s in first[:4]:
                s.close()
            deadline = time.monotonic() + 10
            while await px.metric("xpyd_discovery_connections") > 8:
                assert time.monotonic() < deadline, "closed connections still counted"
                await asyncio.sleep(0.05)
            third = [idle_connection(port, "127.0.0.2") for _ in range(4)]
            socks += third
            assert await settled(third, 1, timeout=1.0) == [False] * 4
        finally:
            for s in socks:
                s.close()
