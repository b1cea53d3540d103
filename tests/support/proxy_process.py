"""Helpers of tests/unit/test_proxy_shutdown.py that other tests use too (moved from it)."""

from __future__ import annotations

import asyncio
import os
import sys

import httpx

from tests.support.proxy_helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def start_proxy(tmp_path, *extra: str):
    port, disc = free_port(), free_port()
    log = open(tmp_path / "proxy.log", "wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--discovery-host",
        "127.0.0.1",
        "--discovery-port",
        str(disc),
        *extra,
        cwd=ROOT,
        stdout=log,
        stderr=log,
    )
    log.close()
    return proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{disc}"


async def wait_ready(client: httpx.AsyncClient, url: str, proc) -> None:
    async def ready() -> bool:
        try:
            return (await client.get(url + "/ready")).status_code == 200
        except httpx.TransportError:
            return False

    deadline = asyncio.get_running_loop().time() + 240  # a proxy's start (its imports) took over 120 s at load 34
    while not await ready():
        assert proc.returncode is None, "proxy exited during startup"
        assert asyncio.get_running_loop().time() < deadline, "proxy not ready after 240s"
        await asyncio.sleep(0.05)


async def stop(proc) -> None:
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
