#!/usr/bin/env python3
"""A minimal round-robin TCP load balancer, standing in for nginx / haproxy / a cloud LB in
front of several xPyD proxies (the multi-proxy demo and test). A connection goes to the
next backend; one that refuses or does not connect within --connect-timeout is skipped
for that connection (each backend tried at most once), so a stopped proxy costs clients
nothing but a retry inside the balancer.

    python scripts/tcp_lb.py --listen 127.0.0.1:9000 --backend 127.0.0.1:8000 --backend 127.0.0.2:8000
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import sys

log = logging.getLogger("xpyd.tcp_lb")


def _addr(s: str) -> tuple[str, int]:
    host, port = s.rsplit(":", 1)
    return host, int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            writer.close()
        except RuntimeError:
            pass


class Balancer:
    def __init__(self, backends: list[tuple[str, int]], connect_timeout: float) -> None:
        self.backends = backends
        self.connect_timeout = connect_timeout
        self._next = itertools.cycle(range(len(backends)))

    async def handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        start = next(self._next)
        for k in range(len(self.backends)):
            host, port = self.backends[(start + k) % len(self.backends)]
            try:
                b_reader, b_writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                            self.connect_timeout)
            except (OSError, asyncio.TimeoutError) as e:
                log.warning("backend %s:%s unavailable (%s), trying the next", host, port, e)
                continue
            await asyncio.gather(_pipe(c_reader, b_writer), _pipe(b_reader, c_writer))
            return
        log.error("no backend accepted the connection")
        c_writer.close()


async def serve(listen: tuple[str, int], backends: list[tuple[str, int]], connect_timeout: float) -> None:
    lb = Balancer(backends, connect_timeout)
    server = await asyncio.start_server(lb.handle, *listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening on %s:%s -> %s", *listen, ", ".join(f"{h}:{p}" for h, p in backends))
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, type=_addr, help="HOST:PORT")
    ap.add_argument("--backend", required=True, action="append", type=_addr, help="HOST:PORT (repeat)")
    ap.add_argument("--connect-timeout", type=float, default=2.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(args.listen, args.backend, args.connect_timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
