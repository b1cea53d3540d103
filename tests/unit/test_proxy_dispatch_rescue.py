"""D alone after every disaggregated attempt failed before D's first byte (the local rescue):
when it runs, on which D, under which deadline, and what the client and the operator see.
Real proxy, fake instances over real HTTP and ZMQ (mutation survivors of
proxy/dispatch/rescue.py and the paths that lead to it)."""

from __future__ import annotations

from tests.support.proxy_helpers import Fault, running_proxy, wait_until
from xpyd_wire.headers import XPYD_DECODE_INSTANCE, XPYD_PATH

COMPLETION = {"model": "fake-model", "prompt": "Hello there", "max_tokens": 5}


async def register_dead(px, role: str) -> str:
    """An instance that registered (and answered its join probe), then stopped: its port
    refuses connections while its registration lives on (heartbeat_timeout)."""
    gone = await px.fake(role, register=False)
    await gone.send_registration()
    addr = gone.http_address
    await wait_until(lambda: any(i.http_address == addr for i in px.registry.live(role)))
    await gone.stop()
    return addr


async def test_rescue_after_a_concurrent_attempt_whose_d_refused_before_p_answered():
    """Concurrent dispatch: the D paired with P refused the connection while P was still
    prefilling, so the attempt failed before P answered (no D answer was ever due). D alone
    on the other D then gets the whole first-byte deadline, from now."""
    async with running_proxy(dispatch="concurrent", decode_retries=0, heartbeat_timeout=30,
                             expose_routing_headers=True) as px:  # fmt: skip
        p = await px.fake("P")
        dead = await register_dead(px, "D")  # first in the table: round robin asks it first
        d = await px.fake("D")
        p.fault = Fault(delay=0.3)
        resp = await px.client.post("/v1/completions", json=COMPLETION)
        assert resp.status_code == 200, resp.text
        assert resp.headers[XPYD_PATH] == "local_rescue"
        assert resp.headers[XPYD_DECODE_INSTANCE] == d.http_address != dead
        (alone,) = d.completions()
        assert alone.request_id.startswith("xpyd-local-") and alone.json == COMPLETION
        assert await px.metric("xpyd_dispatch_total", path="local_rescue") == 1
