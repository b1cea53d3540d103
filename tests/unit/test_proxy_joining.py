"""Joining: a discovered instance is a routing candidate only once it has answered its join
probe (/v1/models, else /health); until then it is listed as pending and never selected.
Registrations are bounded per role and per source host (refusals counted), and join probes
are bounded in concurrency. Real ZMQ, real HTTP on loopback, fake vLLM instances.

The burst test runs the proxy as a `python -m proxy` subprocess so that its memory can be
measured alone (VmRSS of that process)."""

from __future__ import annotations

import asyncio
import socket
import time
from contextlib import ExitStack

import httpx
import pytest
import zmq
import zmq.asyncio

from proxy.config import ConfigError, ProxyConfig, load_config
from tests.support.proxy_helpers import FakeVLLM, running_proxy, wait_until
from tests.support.proxy_process import start_proxy, stop, wait_ready
from xpyd_wire.discovery import Registration, encode
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_PATH, XPYD_PREFILL_INSTANCE

# Long enough (~150 estimated tokens) to be disaggregated under the shipped
# local_prefill_threshold (128): these proxies run the defaults.
COMPLETION = {"model": "fake-model", "prompt": "Hello there. " * 46, "max_tokens": 3}
BURST = 5000


def refusing_ports(stack: ExitStack, n: int) -> list[int]:
    """n loopback ports where nothing listens, held so for the test: bound, never listening
    (a connection to one is refused at once, and no one else can start a server there)."""
    ports = []
    for _ in range(n):
        s = stack.enter_context(socket.socket())
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
    return ports


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0.0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, value = line.rsplit(" ", 1)
        sample, _, label_text = key.partition("{")
        got = dict(kv.split("=", 1) for kv in label_text.rstrip("}").split(",")) if label_text else {}
        if sample == name and all(got.get(k) == f'"{v}"' for k, v in labels.items()):
            total += float(value)
    return total


# ---------------------------------------------------------------- the burst


@pytest.mark.timeout(600)  # its waits are sized for a box at load 30
async def test_burst_of_dead_registrations_costs_no_request_and_little_memory(tmp_path, capsys):
    """5,000 registrations of addresses where nothing listens, in one burst from the source
    the real instances use (the default set-up: everything on loopback, no secret), while and
    after clients send requests: no request fails or touches a dead address, the registry
    holds at most --discovery-max-per-source of them (pending, never selected), the rest are
    refused and counted, and the proxy's RSS grows by little."""
    proc, url, disc = await start_proxy(tmp_path, "--expose-routing-headers", "--log-level", "warning")
    p = await FakeVLLM("P", proxy=disc).start()
    d = await FakeVLLM("D", proxy=disc).start()
    ctx = zmq.asyncio.Context()
    results: list[tuple[int, dict]] = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=20, verify=False) as client:
            await wait_ready(client, url, proc)

            async def ask(n: int, gap: float) -> None:
                for _ in range(n):
                    r = await client.post("/v1/completions", json=COMPLETION)
                    results.append((r.status_code, dict(r.headers)))
                    await asyncio.sleep(gap)

            await ask(10, 0)  # warm-up: every code path the burst and the requests take
            (await client.get("/instances")).raise_for_status()
            (await client.get("/metrics")).raise_for_status()
            before = rss_kib(proc.pid)

            with ExitStack() as held:
                ports = refusing_ports(held, 256)
                # The first ones (those that fit the bound) refuse connections for sure; the
                # rest, refused at registration, name privileged ports nobody serves HTTP on.
                addresses = [f"127.0.0.1:{port}" for port in ports]
                addresses += [f"127.0.0.1:{port}" for port in range(1, BURST - len(ports) + 1)]
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)  # queue the whole burst, do not block on it
                sock.connect(f"tcp://{disc}")
                during = asyncio.create_task(ask(30, 0.02))
                t0 = time.monotonic()
                for k, addr in enumerate(addresses):
                    reg = Registration("PD"[k % 2], addr, f"127.0.0.1:{20000 + k}")
                    await sock.send(encode(reg))
                    if k % 100 == 99:
                        await asyncio.sleep(0)  # let the clients' requests interleave
                sent_s = time.monotonic() - t0

                async def handled() -> bool:  # each one registered, refused, or over its source's rate
                    text = (await client.get("/metrics")).text
                    refused = metric(text, "xpyd_discovery_refused_total")
                    over = metric(text, "xpyd_discovery_messages_total", result="rate_limited")
                    return refused + over + len((await client.get("/instances")).json()) - 2 >= BURST

                deadline = time.monotonic() + 30
                while not await handled():
                    assert time.monotonic() < deadline, "the burst was not handled within 30 s"
                    await asyncio.sleep(0.05)
                handled_s = time.monotonic() - t0
                await during
                await ask(20, 0)  # after the burst, while the dead ones are still registered
                # Not one request failed, and every one went P -> D, the real ones (no retry, no
                # fallback): a dead address never cost a client request anything.
                assert len(results) == 60
                failed = [status for status, _ in results if status != 200]
                assert not failed, failed
                for _, headers in results:
                    assert headers[XPYD_PATH] == "disaggregated"
                    assert headers[XPYD_PREFILL_INSTANCE] == p.http_address
                    assert headers[XPYD_DECODE_INSTANCE] == d.http_address
                assert len(p.completions()) == len(d.completions()) == 60

                # Every pending one has been probed (and failed) at least once by now.
                async def probed() -> list[dict]:
                    insts = (await client.get("/instances")).json()
                    dead = [i for i in insts if i["http_address"] not in (p.http_address, d.http_address)]
                    return dead if all(i["probe_error"] for i in dead) else []

                deadline = time.monotonic() + 120  # 20 s ran out at load 30 on 2 cores
                while not (dead := await probed()):
                    assert time.monotonic() < deadline, "pending instances not probed in 120 s"
                    await asyncio.sleep(0.05)
                after = rss_kib(proc.pid)
                text = (await client.get("/metrics")).text
                insts = (await client.get("/instances")).json()

                # A healthy instance from another host joins promptly despite the crowd; one
                # from the crowded host is refused until slots free (heartbeat expiry).
                t_join = time.monotonic()
                late = await FakeVLLM("D", proxy=f"127.0.0.3:0;{disc}").start()
                deadline = time.monotonic() + 10
                while not any(i["http_address"] == late.http_address and not i["pending"]
                              for i in (await client.get("/instances")).json()):  # fmt: skip
                    assert time.monotonic() < deadline, "late instance not a candidate in 10 s"
                    await asyncio.sleep(0.005)
                join_ms = (time.monotonic() - t_join) * 1000
                await late.stop()
                refused_p = metric(text, "xpyd_discovery_refused_total", role="P", reason="source_limit")
                crowded = await FakeVLLM("P", proxy=disc).start()
                try:
                    deadline = time.monotonic() + 10
                    while metric((await client.get("/metrics")).text, "xpyd_discovery_refused_total",
                                 role="P", reason="source_limit") <= refused_p:  # fmt: skip
                        assert time.monotonic() < deadline, "crowded-source instance not refused"
                        await asyncio.sleep(0.02)
                    assert crowded.http_address not in (await client.get("/instances")).text
                finally:
                    await crowded.stop()
                sock.close(linger=0)

        assert metric(text, "xpyd_prefill_retries_total") == 0
        assert metric(text, "xpyd_decode_retries_total") == 0
        # No dead address in the per-instance error counters (a label per advertised address
        # would grow /metrics without bound).
        assert metric(text, "xpyd_upstream_errors_total") == 0
        # Bounded: the source holds 64 (the real P and D among them), the rest refused.
        assert len(insts) == 64 and len(dead) == 62
        assert all(i["source"] == "127.0.0.1" for i in insts)
        # Those over the source's message rate (200/s) were dropped before they were read (and
        # a few of the real P's and D's heartbeats from the same host with them).
        over = metric(text, "xpyd_discovery_messages_total", result="rate_limited")
        assert BURST - 62 <= metric(text, "xpyd_discovery_refused_total", reason="source_limit") + over <= BURST
        assert metric(text, "xpyd_instances", role="P") == metric(text, "xpyd_instances", role="D") == 1
        growth_mib = (after - before) / 1024
        with capsys.disabled():
            print(f"\nburst: sent in {sent_s:.2f}s, handled in {handled_s:.2f}s; proxy RSS "
                  f"{before / 1024:.1f} -> {after / 1024:.1f} MiB (+{growth_mib:.2f}); "
                  f"late healthy instance a candidate after {join_ms:.0f} ms")  # fmt: skip
        # Unbounded, the same burst grew it by ~50 MiB; a few MiB are allocator noise.
        assert growth_mib < 8, growth_mib
        assert join_ms < 2000, join_ms
    finally:
        ctx.destroy(linger=0)
        await p.stop()
        await d.stop()
        await stop(proc)


# ---------------------------------------------------------------- one mistyped instance


async def test_mistyped_instance_gets_no_traffic():
    """An operator's typo: a D advertises a port where nothing listens, and keeps
    heartbeating. It is listed as pending (with why) and never gets a request."""
    with ExitStack() as held:
        (port,) = refusing_ports(held, 1)
        typo = f"127.0.0.1:{port}"
        async with running_proxy(expose_routing_headers=True, health_interval=0.2) as px:
            p, d = await px.pd()
            sender = await px.fake("D", register=False)
            reg = Registration("D", typo, "127.0.0.1:1")
            await sender.send_raw(encode(reg))
            await wait_until(lambda: typo in [i.http_address for i in px.registry.every()],
                             what="the mistyped D registered")
            for _ in range(20):
                await sender.send_raw(encode(reg))  # it keeps heartbeating
                r = await px.client.post("/v1/completions", json=COMPLETION)
                assert r.status_code == 200, r.text
                assert r.headers[XPYD_DECODE_INSTANCE] == d.http_address
                assert r.headers[XPYD_PATH] == "disaggregated"
            assert len(d.completions()) == 20
            # Not even a retry: the typo was never tried.
            assert await px.metric("xpyd_decode_retries_total") == 0
            assert typo not in (await px.client.get("/metrics")).text
            # Retried in the background (health_interval 0.2 s), still not answering.
            await asyncio.sleep(0.5)
            await wait_until(lambda: [i for i in px.registry.every()
                                      if i.http_address == typo and i.probe_error],  # fmt: skip
                             what="the mistyped D probed")
            (entry,) = [i for i in (await px.client.get("/instances")).json()
                        if i["http_address"] == typo]  # fmt: skip
            assert entry["pending"] is True and entry["probe_error"] == "connect"
            assert await px.metric("xpyd_instances", role="D") == 1
            assert await px.metric("xpyd_instances_pending", role="D") == 1
            assert (await px.client.get("/ready")).json()["decode"] == 1
            assert typo not in (await px.client.get("/metrics")).text  # retries are not counted


# ---------------------------------------------------------------- becoming a candidate


async def test_answering_instance_becomes_a_candidate_promptly(capsys):
    """Registration -> join probe -> candidate, timed; also when /v1/models fails but
    /health answers, and when the HTTP server comes up only after the first heartbeat."""
    async with running_proxy(health_interval=0.2) as px:
        await px.fake("P")
        times = []
        for _ in range(5):
            d = await px.fake("D", register=False)
            t0 = time.monotonic()
            await d.send_registration()
            await wait_until(lambda: any(i.http_address == d.http_address
                                         for i in px.registry.live("D")),  # fmt: skip
                             interval=0.001, what="D a candidate")
            times.append((time.monotonic() - t0) * 1000)
            (inst,) = [i for i in px.registry.live("D") if i.http_address == d.http_address]
            assert inst.models is not None and "fake-model" in inst.models  # learned on joining
            r = await px.client.post("/v1/completions", json=COMPLETION)
            assert r.status_code == 200
            await d.stop()
            px.registry.remove("D", d.http_address, "test")
        # No /v1/models (or one the proxy may not read): /health decides.
        bare = await px.fake("D", register=False)
        bare.models_status = 404
        await bare.send_registration()
        await wait_until(lambda: px.registry.live("D"), what="D admitted on /health")
        assert px.registry.live("D")[0].models is None
        await bare.stop()
        px.registry.remove("D", bare.http_address, "test")
        # Heartbeats before its HTTP server is up (vLLM's connector starts before the API
        # server): pending, then a candidate at a retry once it answers.
        early = FakeVLLM("D", proxy=px.discovery)
        try:
            with ExitStack() as held:
                (early.port,) = refusing_ports(held, 1)
                early.start_heartbeats()
                await wait_until(lambda: [i for i in px.registry.every()
                                          if i.http_address == early.http_address and i.probe_error],
                                 what="early D probed and pending")  # fmt: skip
                assert not px.registry.live("D")
            started = time.monotonic()
            await early.start()  # binds the port now
            await wait_until(lambda: px.registry.live("D"), what="early D admitted")
            retry_ms = (time.monotonic() - started) * 1000
        finally:
            await early.stop()
    median = sorted(times)[len(times) // 2]
    with capsys.disabled():
        print(f"\ncandidate after registration: median {median:.1f} ms, max {max(times):.1f} ms "
              f"(5 runs); after a late HTTP start: {retry_ms:.0f} ms (health_interval 0.2 s)")
    assert max(times) < 1000
    assert retry_ms < 2000


async def test_pending_instance_is_listed_without_addresses_by_default():
    with ExitStack() as held:
        (port,) = refusing_ports(held, 1)
        async with running_proxy(api_key="k") as px:
            sender = await px.fake("P", register=False)
            await sender.send_raw(encode(Registration("P", f"127.0.0.1:{port}", "127.0.0.1:1")))
            await wait_until(lambda: px.registry.count_pending("P") == 1 and
                             px.registry.every()[0].probe_error)  # fmt: skip
            (entry,) = (await px.client.get("/instances", headers={"authorization": "Bearer k"})).json()
            assert entry["pending"] is True and entry["probe_error"] == "connect"
            assert not {"http_address", "zmq_address", "source"} & set(entry)


# ---------------------------------------------------------------- bounds


async def test_registrations_beyond_the_bounds_are_refused_and_counted():
    with ExitStack() as held:
        ports = refusing_ports(held, 12)
        async with running_proxy(discovery_max_per_source=3, discovery_max_per_role=5) as px:
            ctx = zmq.asyncio.Context()
            try:
                socks = {}
                for host in ("127.0.0.1", "127.0.0.2", "127.0.0.3"):
                    s = socks[host] = ctx.socket(zmq.DEALER)
                    s.setsockopt(zmq.LINGER, 0)
                    s.connect(f"tcp://{host}:0;{px.discovery}")  # from this source address

                async def send(host: str, role: str, port: int) -> None:
                    await socks[host].send(encode(Registration(role, f"127.0.0.1:{port}", "127.0.0.1:1")))

                for port in ports[:4]:  # 3 fit 127.0.0.1's bound, the 4th is refused
                    await send("127.0.0.1", "P", port)
                await wait_until(lambda: px.state.metrics.discovery_refused.labels("P", "source_limit")
                                 ._value.get() == 1, what="source refusal")  # fmt: skip
                # Another source still may; its owner's heartbeat is never refused, another
                # source's for the same address is (issue 36: a conflict, not a heartbeat).
                # (One socket at a time: ZMQ orders messages per connection only.)
                await send("127.0.0.2", "P", ports[4])
                await send("127.0.0.2", "P", ports[0])  # another's address: refused
                await send("127.0.0.1", "P", ports[0])  # its owner's heartbeat
                await wait_until(lambda: px.registry.count_pending("P") == 4, what="4 P")
                for port in ports[5:8]:  # P reaches 5: the role bound (the 3rd is refused)
                    await send("127.0.0.3", "P", port)
                await send("127.0.0.3", "D", ports[8])  # D has room
                await wait_until(lambda: px.registry.count_pending("D") == 1, what="D registered")
                assert px.registry.count_pending("P") == 5
                assert {i.source for i in px.registry.every()} == {"127.0.0.1", "127.0.0.2", "127.0.0.3"}
                assert await px.metric("xpyd_discovery_refused_total", role="P", reason="source_limit") == 1
                assert await px.metric("xpyd_discovery_refused_total", role="P", reason="role_limit") == 2
                assert await px.metric("xpyd_discovery_refused_total", role="P", reason="conflict") == 1
                assert await px.metric("xpyd_discovery_messages_total", result="refused") == 4
                # A slot frees when one leaves.
                await socks["127.0.0.1"].send(encode(Registration("P", f"127.0.0.1:{ports[0]}",
                                                                  "127.0.0.1:1", leave=True)))
                await send("127.0.0.1", "P", ports[9])
                await wait_until(lambda: any(i.http_address == f"127.0.0.1:{ports[9]}"
                                             for i in px.registry.every()), what="slot reused")
            finally:
                ctx.destroy(linger=0)


async def test_join_probes_are_bounded_in_concurrency():
    """Ten instances that accept connections and never answer, registered at once: at most
    --probe-concurrency connections are open at any time, and none becomes a candidate."""
    spans: list[tuple[float, float]] = []  # (accepted, closed by the proxy), monotonic

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opened = time.monotonic()
        try:
            await reader.read()  # until the proxy gives up and closes
        finally:
            spans.append((opened, time.monotonic()))
            writer.close()

    def most_open(slack: float) -> int:
        """Most connections open at once; each counted as closed `slack` s early, since the
        proxy's close and its next connect may reach this loop in either order."""
        events = sorted([(a, 1) for a, _ in spans] + [(b - slack, -1) for _, b in spans])
        now = most = 0
        for _, step in events:
            now += step
            most = max(most, now)
        return most

    servers = [await asyncio.start_server(silent, f"127.0.0.{k}", 0) for k in range(1, 11)]
    try:
        async with running_proxy(probe_concurrency=2, probe_timeout=1.0, health_interval=5) as px:
            sender = await px.fake("P", register=False)
            for srv in servers:
                host, port = srv.sockets[0].getsockname()[:2]
                await sender.send_raw(encode(Registration("D", f"{host}:{port}", "127.0.0.1:1")))
            await wait_until(lambda: len([i for i in px.registry.every() if i.probe_error]) == 10,
                             what="all ten probed")  # fmt: skip
            assert all(i.probe_error == "timeout" for i in px.registry.every())
            assert not px.registry.live("D")
        assert len(spans) == 10
        assert most_open(slack=0.5) == 2, spans  # each lasts probe_timeout, 1 s (slack for a loaded box)
    finally:
        for srv in servers:
            srv.close()


def test_bound_options():
    cfg = load_config(["--discovery-max-per-role", "10", "--discovery-max-per-source", "4",
                       "--probe-concurrency", "8"], env={})  # fmt: skip
    assert (cfg.discovery_max_per_role, cfg.discovery_max_per_source, cfg.probe_concurrency) == (10, 4, 8)
    env = load_config([], env={"XPYD_DISCOVERY_MAX_PER_SOURCE": "16"})
    assert env.discovery_max_per_source == 16
    defaults = ProxyConfig()
    assert (defaults.discovery_max_per_role, defaults.discovery_max_per_source,
            defaults.probe_concurrency) == (1024, 64, 32)  # fmt: skip
    for name in ("discovery_max_per_role", "discovery_max_per_source", "probe_concurrency"):
        with pytest.raises(ConfigError, match=name):
            ProxyConfig(**{name: 0}).validate()
