"""What the HTTP edge limits (proxy/serving/edge.py) cost per request, isolated from everything else.

One uvicorn connection (the proxy's corked protocol, with and without the edge) on an
in-memory transport serves keep-alive requests to a minimal ASGI app, interleaved rounds,
medians: the difference per request is what the edge adds (byte counting while a head is
read, the phase stamps; its sweep runs once per interval, not per request).

    .venv/bin/python -m scripts.bench_edge --requests 20000 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from proxy.serving.corked import corked_protocol
from proxy.serving.edge import Edge, EdgeLimits

BODY = b'{"model": "m", "prompt": "hello there", "max_tokens": 16, "stream": true}'
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\ncontent-type: application/json\r\n"
           b"accept: */*\r\nuser-agent: bench\r\ncontent-length: %d\r\n\r\n%s") % (len(BODY), BODY)


class Sink(asyncio.Transport):
    """A transport that keeps nothing: the response bytes are counted and dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


async def app(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def run(protocol_cls: type, requests: int) -> float:
    """Seconds per request for `requests` keep-alive requests on one connection."""
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning")
    config.load()
    state = ServerState()
    proto = protocol_cls(config=config, server_state=state, app_state={})
    sink = Sink()
    proto.connection_made(sink)
    done = 0
    t0 = time.perf_counter()
    for _ in range(requests):
        proto.data_received(REQUEST)
        while state.tasks:  # the request's ASGI task and the corked flush
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        done += 1
    elapsed = time.perf_counter() - t0
    assert sink.written >= requests * 40, "responses missing"
    proto.connection_lost(None)
    return elapsed / done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--http", default="httptools", choices=("httptools", "h11"))
    args = ap.parse_args()
    variants = {
        "corked": corked_protocol(args.http),
        "corked+edge": corked_protocol(args.http, Edge(EdgeLimits())),
    }
    results: dict[str, list[float]] = {k: [] for k in variants}
    loop = asyncio.new_event_loop()
    try:
        for name, cls in variants.items():  # warm-up
            loop.run_until_complete(run(cls, 2000))
        for _ in range(args.rounds):
            for name, cls in variants.items():
                results[name].append(loop.run_until_complete(run(cls, args.requests)))
    finally:
        loop.close()
    base = statistics.median(results["corked"])
    print(f"{args.http}: {args.requests} keep-alive requests per round, median of {args.rounds} interleaved rounds")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"  {name:12s} {med * 1e6:7.2f} us/request  ({(med - base) * 1e6:+.2f} us, x{med / base:.3f})")


if __name__ == "__main__":
    main()
