"""Running the proxy under uvicorn, with a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from proxy.config import ProxyConfig, is_loopback
from proxy.serving.app import ProxyState, create_app, fast_path
from proxy.serving.corked import corked_protocol
from proxy.serving.edge import Edge, EdgeLimits

log = logging.getLogger("xpyd.proxy")


class ProxyServer(uvicorn.Server):
    """uvicorn.Server that marks the proxy as draining on a signal (so /ready answers 503)
    and, unlike uvicorn, does not re-raise the signal afterwards: a drained proxy exits 0."""

    def __init__(self, cfg: ProxyConfig, handle_signals: bool = True) -> None:
        app = create_app(cfg)
        self.proxy: ProxyState = app.state.proxy
        self.handle_signals = handle_signals
        limits = EdgeLimits(cfg.max_header_bytes, cfg.header_timeout, cfg.body_timeout, cfg.max_connections)
        refused = self.proxy.metrics.http_refused
        self.edge = Edge(limits, lambda reason: refused.labels(reason).inc())
        if not is_loopback(cfg.host) and cfg.api_key is None:
            log.warning("serving the API on %s without --api-key: anyone who reaches it can use every instance "
                        "(set --api-key-file or XPYD_API_KEY, or bind --host 127.0.0.1 behind a gateway that "
                        "authenticates)", cfg.host)
        if self.edge.max_connections < cfg.max_connections:
            log.info("max_connections lowered to %d: half the file-descriptor limit (raise `ulimit -n`)",
                        self.edge.max_connections)
        config = uvicorn.Config(
            fast_path(app),
            host=cfg.host,
            port=cfg.port,
            loop=cfg.loop,
            # One system call for what a response writes in one loop turn (proxy/serving/corked.py).
            # ... and its HTTP edge limits, before any authentication (proxy/serving/edge.py).
            http=corked_protocol(cfg.http, self.edge),
            h11_max_incomplete_event_size=cfg.max_header_bytes,
            lifespan="on",
            log_level=cfg.log_level,
            access_log=False,  # per-request logging costs more than the proxying itself
            proxy_headers=False,  # X-Forwarded-* rewriting: unused here, and per-request work
            server_header=False,
            timeout_graceful_shutdown=cfg.shutdown_grace_s,
            # Clients (load balancers, SDKs) keep connections open between requests.
            timeout_keep_alive=30,
            backlog=4096,
        )
        super().__init__(config)

    @property
    def port(self) -> int:
        """The bound HTTP port (useful with port 0)."""
        return self.servers[0].sockets[0].getsockname()[1]

    async def shutdown(self, sockets: Any = None) -> None:
        await super().shutdown(sockets)
        self.edge.stop()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self.handle_signals:
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.proxy.draining:
            log.info(
                "signal received, draining signal=%s grace_s=%s in_flight=%d",
                signal.Signals(sig).name,
                self.config.timeout_graceful_shutdown,
                sum(i.in_flight for i in self.proxy.registry.live("D")),
            )
        self.proxy.draining = True
        super().handle_exit(sig, frame)
