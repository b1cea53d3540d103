"""Announces this instance to the xPyD proxies (the discovery heartbeat).

Runs in the scheduler process, where the load figures live (one per engine,
rank-0 semantics). Announces only once the instance's own HTTP server answers
/health, so a proxy never routes to an instance that cannot take requests yet.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from connector.config import ConnectorConfig
from connector.log import get_logger
from proxy.protocol import MAX_LOAD_COUNT, Load, ProtocolError, Registration, decode, encode

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

logger = get_logger(__name__)

LoadReport = Callable[[], Load]


def heartbeat_load(kv_cache_manager: KVCacheManager | None, running: int, known: int,
                   buffer_usage: float) -> Load:
    """The load a scheduler reports in its heartbeats: running and waiting requests (of the
    `known` ones), KV cache usage (best effort) and the connector's own buffer usage."""
    usage = 0.0
    if kv_cache_manager is not None:
        try:
            usage = float(kv_cache_manager.usage)
        except Exception:  # usage is best effort
            usage = 0.0
    return Load(running, max(0, known - running), _fraction(usage), _fraction(buffer_usage))


def _fraction(x: float) -> float:
    """Clamped to 0..1 (NaN -> 0): the proxy drops a heartbeat whose usage is out of range."""
    return min(1.0, max(0.0, x)) if x == x else 0.0


class Registrar:
    def __init__(self, cfg: ConnectorConfig, load_report: LoadReport,
                 fallbacks_report: Callable[[], int] | None = None) -> None:
        self._cfg = cfg
        self._load_report = load_report
        self._fallbacks_report = fallbacks_report
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="xpyd-registrar", daemon=True)
        self._thread.start()

    def _registration(self, leave: bool = False) -> Registration:
        return Registration(
            role="P" if self._cfg.role == "kv_producer" else "D",
            http_address=f"{self._cfg.http_host}:{self._cfg.http_port}",
            zmq_address=self._cfg.advertised_address,
            load=self._load_report(),
            leave=leave,
            kv_transport_fallbacks=min(self._fallbacks_report(), MAX_LOAD_COUNT) if self._fallbacks_report else 0,
        )

    def _healthy(self) -> bool:
        url = f"http://{self._cfg.http_host}:{self._cfg.http_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:  # noqa: S310 (own loopback/http host)
                return r.status == 200
        except OSError:
            return False

    def check(self) -> str | None:
        """Why the proxy would drop this instance's registrations (its own parser says), or
        None. Heartbeats are sent regardless; this makes a bad address visible at start-up."""
        try:
            decode(encode(self._registration(), self._cfg.discovery_secret), self._cfg.discovery_secret)
        except ProtocolError as e:
            return str(e)
        return None

    def _send_all(self, sockets: dict[str, zmq.Socket], msg: bytes) -> None:
        for addr, sock in sockets.items():
            try:
                sock.send(msg, flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("discovery heartbeat dropped proxy=%s (queue full)", addr)

    def _run(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        for addr in self._cfg.proxies:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 500)
            s.setsockopt(zmq.SNDHWM, 4)
            s.connect(f"tcp://{addr}")
            sockets[addr] = s
        problem = self.check()
        if problem is not None:
            logger.error("the proxies will drop this instance's registrations: %s", problem)
        try:
            while not self._stop.is_set():
                if self._healthy():
                    self._send_all(sockets, encode(self._registration(), self._cfg.discovery_secret))
                self._stop.wait(self._cfg.heartbeat_interval_s)
            self._send_all(sockets, encode(self._registration(leave=True), self._cfg.discovery_secret))
        finally:
            for s in sockets.values():
                s.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3.0)
