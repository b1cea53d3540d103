"""The x-xpyd-* response headers: what the proxy tells a client about how its request was
served (docs/proxy/index.md). One owner: the proxy writes them, scripts and tests read them.

Always sent: XPYD_PATH (the dispatch path: disaggregated, prefill_alone, local_*), the
timings XPYD_QUEUE_MS, XPYD_PREFILL_MS, XPYD_DECODE_TTFB_MS (milliseconds), and
XPYD_FIRST_TOKEN ("prefill" when P's token started the answer). With
--expose-routing-headers only: XPYD_PREFILL_INSTANCE and XPYD_DECODE_INSTANCE (host:port).
On the LoRA admin routes: XPYD_FANOUT, each instance's answer ("ROLE NAME STATUS-or-kind, ...").
"""

from __future__ import annotations

XPYD_PREFIX = "x-xpyd-"
XPYD_PATH = "x-xpyd-path"
XPYD_QUEUE_MS = "x-xpyd-queue-ms"
XPYD_PREFILL_MS = "x-xpyd-prefill-ms"
XPYD_DECODE_TTFB_MS = "x-xpyd-decode-ttfb-ms"
XPYD_FIRST_TOKEN = "x-xpyd-first-token"
XPYD_PREFILL_INSTANCE = "x-xpyd-prefill-instance"
XPYD_DECODE_INSTANCE = "x-xpyd-decode-instance"
XPYD_FANOUT = "x-xpyd-fanout"

# As the proxy writes them: raw ASGI header names are bytes.
XPYD_PREFIX_RAW = XPYD_PREFIX.encode()
XPYD_PATH_RAW = XPYD_PATH.encode()
XPYD_QUEUE_MS_RAW = XPYD_QUEUE_MS.encode()
XPYD_PREFILL_MS_RAW = XPYD_PREFILL_MS.encode()
XPYD_DECODE_TTFB_MS_RAW = XPYD_DECODE_TTFB_MS.encode()
XPYD_FIRST_TOKEN_RAW = XPYD_FIRST_TOKEN.encode()
XPYD_PREFILL_INSTANCE_RAW = XPYD_PREFILL_INSTANCE.encode()
XPYD_DECODE_INSTANCE_RAW = XPYD_DECODE_INSTANCE.encode()
XPYD_FANOUT_RAW = XPYD_FANOUT.encode()
