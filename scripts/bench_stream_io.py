#!/usr/bin/env python3
"""CPU time of the byte stream's socket loops per message (connector/transport/stream.py),
against Python's timeout mode (what they did before) and a raw socket, in one process on
loopback: the measured side's thread CPU (user + sys), which a loaded machine disturbs far
less than GB/s.

    python -m scripts.bench_stream_io [--sizes 16,64,256] [--repeats 9]

recv: ``recv_whole`` (blocking, SO_RCVTIMEO from the deadline, MSG_WAITALL: one call per
tensor) vs ``poll`` (``settimeout`` + ``recv_into`` until full: a poll and a recv per chunk
the kernel has ready) vs ``raw`` (a blocking ``recv_into`` loop, no deadline: the bench's raw
socket). send: ``send_parts`` (blocking ``sendmsg``, SO_SNDTIMEO) vs ``poll`` (``settimeout`` +
``sendmsg``) vs ``raw`` (``sendall`` per part). Each message is 4 parts; medians of
``--repeats`` interleaved in a new seeded order each repeat.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import sys
import threading
import time

import numpy as np

from connector.transport import stream  # noqa: E402

MiB = 1 << 20


def recv_poll(sock: socket.socket, view: memoryview, deadline: float) -> None:
    stream.recv_exact(sock, view, deadline)  # Python's timeout mode (heads still use it)


def recv_raw(sock: socket.socket, view: memoryview, deadline: float) -> None:
    sock.settimeout(None)
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError
        got += k


def send_poll(sock: socket.socket, parts: list[np.ndarray], deadline: float) -> None:
    """send_parts as it was: ``settimeout`` then ``sendmsg`` per chunk."""
    views = [memoryview(p).cast("B") for p in parts]
    i = 0
    while i < len(views):
        sock.settimeout(stream._left(deadline))
        sent = sock.sendmsg(views[i:i + stream.IOV_MAX])
        while sent and i < len(views):
            n = len(views[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def send_raw(sock: socket.socket, parts: list[np.ndarray], deadline: float) -> None:
    sock.settimeout(None)
    for p in parts:
        sock.sendall(p)


def _timed(measured, other) -> float:
    """Run ``other`` in a thread and ``measured`` here; this thread's CPU seconds."""
    t = threading.Thread(target=other, daemon=True)
    t.start()
    t0 = time.thread_time()
    measured()
    cpu = time.thread_time() - t0
    t.join(60)
    return cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    with socket.create_server(("127.0.0.1", 0)) as ls:
        tx = socket.create_connection(ls.getsockname(), timeout=30)
        rx, _ = ls.accept()
    print(f"thread CPU ms per message (4 parts), one process on loopback, median of {args.repeats}")
    head = (f"{'MiB':>4} {'recv':>6} {'r-poll':>6} {'r-raw':>6} {'recv/raw':>8} {'poll/raw':>8}"
            f" {'send':>6} {'s-poll':>6} {'s-raw':>6} {'send/raw':>8} {'poll/raw':>8}")
    print(head)
    print("-" * len(head))
    for mib in args.sizes:
        n = mib * MiB
        src = [np.random.default_rng(i).integers(0, 256, n // 4, dtype=np.uint8) for i in range(4)]
        dst = np.empty(n, dtype=np.uint8)
        dst[:] = 1  # faulted in once, as reused memory is

        def fill(fn):
            return lambda: fn(rx, memoryview(dst), time.monotonic() + 120)

        def put_all(fn):
            return lambda: fn(tx, src, time.monotonic() + 120)

        cases = {
            "recv": (fill(stream.recv_whole), put_all(send_raw)),
            "r-poll": (fill(recv_poll), put_all(send_raw)),
            "r-raw": (fill(recv_raw), put_all(send_raw)),
            "send": (put_all(stream.send_parts), fill(recv_raw)),
            "s-poll": (put_all(send_poll), fill(recv_raw)),
            "s-raw": (put_all(send_raw), fill(recv_raw)),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        order = list(cases)
        shuffle = random.Random(mib).shuffle
        for rep in range(args.repeats + 1):  # the first is a warm-up
            shuffle(order)
            for name in order:
                measured, other = cases[name]
                cpu = _timed(measured, other)
                if rep:
                    times[name].append(cpu)
        if not np.array_equal(dst, np.concatenate(src)):
            print("MISMATCH", file=sys.stderr)
            return 1
        m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{mib:4d} {m['recv']:6.1f} {m['r-poll']:6.1f} {m['r-raw']:6.1f} {m['recv'] / m['r-raw']:8.0%}"
              f" {m['r-poll'] / m['r-raw']:8.0%} {m['send']:6.1f} {m['s-poll']:6.1f} {m['s-raw']:6.1f}"
              f" {m['send'] / m['s-raw']:8.0%} {m['s-poll'] / m['s-raw']:8.0%}", flush=True)
    tx.close()
    rx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
