"""Helpers for the proxy tests: a real proxy (uvicorn on loopback, port 0) in the test's
event loop, fake vLLM instances registering with it over real ZMQ, bounded polling."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.config import ProxyConfig  # noqa: E402
from proxy.serving.server import ProxyServer  # noqa: E402
from tests.support.fake_vllm import FakeVLLM, Fault  # noqa: E402
from tests.support.ports import free_port
from tests.support.waiting import wait_until

__all__ = ["Fault", "FakeVLLM", "ProxyHandle", "register_dead", "running_proxy", "wait_until", "free_port", "relayed"]

REQUEST_ID_RE = (
    r"^(?:xpyd-early)?___prefill_addr_(?P<p>[^_]+:\d+)___decode_addr_(?P<d>[^_]+:\d+)_(?P<uuid>[0-9a-f]{32})$"
)


def relayed(rec, px: ProxyHandle) -> bytes:
    """An instance's answer as clients get it by default: vLLM's echo of the internal request
    id replaced by the proxy's neutral id (--expose-routing-headers keeps it)."""
    rid = rec.request_id
    return bytes(rec.sent).replace(rid.encode(), px.neutral(rid).encode())


@dataclass
class ProxyHandle:
    server: ProxyServer
    url: str
    discovery: str  # host:port of the ZMQ ROUTER
    client: httpx.AsyncClient
    _fakes: list[FakeVLLM] = field(default_factory=list)
    serving: asyncio.Task | None = None  # the server's serve(): done once it stopped

    @property
    def state(self):
        return self.server.proxy

    @property
    def registry(self):
        return self.server.proxy.registry

    def neutral(self, rid: str) -> str:
        """The id clients are told for the internal request id `rid` (a keyed hash of its uuid)."""
        return self.server.proxy.router.dispatcher.decode.ids.neutral(rid)

    def relayed(self, rec) -> bytes:
        return relayed(rec, self)

    async def fake(self, role: str, **kwargs: Any) -> FakeVLLM:
        """Start a fake instance registering with this proxy, and wait until it is live."""
        fake = FakeVLLM(role, proxy=self.discovery, **kwargs)
        self._fakes.append(fake)
        await fake.start()
        if kwargs.get("register", True):
            await wait_until(
                lambda: any(i.http_address == fake.http_address for i in self.registry.live(role)),
                what=f"{role} {fake.http_address} registered",
            )
        return fake

    async def pd(self, **kwargs: Any) -> tuple[FakeVLLM, FakeVLLM]:
        return await self.fake("P", **kwargs), await self.fake("D", **kwargs)

    async def metric(self, name: str, **labels: str) -> float:
        """Value of one sample from /metrics (0.0 if absent)."""
        text = (await self.client.get("/metrics")).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            key, value = line.rsplit(" ", 1)
            sample, _, label_text = key.partition("{")
            got = ",".join(sorted(label_text.rstrip("}").split(","))) if label_text else ""
            if sample == name and got == want:
                return float(value)
        return 0.0


@asynccontextmanager
async def running_proxy(**overrides: Any) -> AsyncIterator[ProxyHandle]:
    values: dict[str, Any] = dict(
        host="127.0.0.1",
        port=0,
        discovery_host="127.0.0.1",
        discovery_port=0,
        log_level="warning",
        shutdown_grace_s=1.0,
        # These tests send prompts of a few characters and are about the disaggregated
        # path; the shipped threshold (128) would serve them all from D alone. Tests of the
        # threshold set it themselves; test_proxy_config checks the shipped value.
        local_prefill_threshold=0,
        # Most tests here pin down what happens around P and D one after the other (sequential
        # dispatch: D is asked once P answered, and never when P failed). Concurrent dispatch,
        # the shipped default, asks D with P: the tests of it say so (test_proxy_dispatch.py),
        # and the e2e tier runs the shipped defaults.
        dispatch="sequential",
    )
    # Run the whole suite against another upstream client with XPYD_TEST_UPSTREAM_CLIENT.
    if os.environ.get("XPYD_TEST_UPSTREAM_CLIENT"):
        values["upstream_client"] = os.environ["XPYD_TEST_UPSTREAM_CLIENT"]
    if os.environ.get("XPYD_TEST_HTTP"):  # h11 instead of httptools
        values["http"] = os.environ["XPYD_TEST_HTTP"]
    values.update(overrides)
    cfg = ProxyConfig(**values).validate()
    server = ProxyServer(cfg, handle_signals=False)
    task = asyncio.get_running_loop().create_task(server.serve())
    await wait_until(lambda: server.started or task.done(), timeout=10, what="proxy started")
    if task.done():
        task.result()
        raise AssertionError("proxy exited during startup")
    url = f"http://127.0.0.1:{server.port}"
    # verify=False: plain-HTTP loopback only, and it skips ~90 ms of CA loading per client.
    async with httpx.AsyncClient(base_url=url, timeout=10.0, verify=False) as client:
        handle = ProxyHandle(server, url, f"127.0.0.1:{server.proxy.discovery.port}", client, serving=task)
        try:
            yield handle
        finally:
            for fake in handle._fakes:
                await fake.stop()
            server.should_exit = True
            await asyncio.wait_for(task, timeout=10)


async def register_dead(px, role: str) -> str:
    """An instance that registered (and answered its join probe), then stopped: its port
    refuses connections while its registration lives on (heartbeat_timeout)."""
    gone = await px.fake(role, register=False)
    await gone.send_registration()
    addr = gone.http_address
    await wait_until(lambda: any(i.http_address == addr for i in px.registry.live(role)))
    await gone.stop()
    return addr
