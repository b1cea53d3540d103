"""A double of vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py) for the proxy's
event-intake tests: the same sockets (PUB, ROUTER replay), frames, seq numbering and replay
buffer, bound on 127.0.0.1 (vLLM binds only `tcp://*:PORT`). Payloads are encoded with
xpyd_wire.kv_events.encode_batch, which tests/unit/test_kv_events.py checks decodes exactly like
vLLM's own msgspec encoding. Knobs for faults: lose batches (a gap), restart (seq from 0),
go silent, send raw frames. Its order differs from vLLM's (one thread that sends a batch, then
buffers it, and answers replays between batches): it buffers first and answers replays on a
thread of its own; tests/unit/test_kv_events_vllm_publisher.py runs the intake against vLLM's."""

from __future__ import annotations

import threading
import time
from collections import deque

import zmq

from xpyd_wire.kv_events import END_SEQ, EventBatch, encode_batch


class Publisher:
    def __init__(self, topic: str = "", replay: bool = True, buffer_steps: int = 10_000) -> None:
        self.topic = topic
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, list[bytes]]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replay_requests = 0
        self.answer_replays = True
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay_endpoint: str | None = None
        self._router = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            rport = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def _serve_replay(self) -> None:
        assert self._router is not None
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            client, _, start = self._router.recv_multipart()
            self.replay_requests += 1
            if not self.answer_replays:
                continue
            start_seq = int.from_bytes(start, "big")
            with self._lock:
                buffered = list(self._buffer)
            for seq, frames in buffered:
                if seq >= start_seq:
                    self._router.send_multipart([client, b"", *frames])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def publish(self, events, ts: float | None = None, send: bool = True) -> int:
        """Publish one batch (send=False: numbered and buffered but lost on the way)."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            frames = encode_batch(EventBatch(seq, ts or time.time(), tuple(events)), self.topic)
            self._buffer.append((seq, frames))
        if send:
            self._pub.send_multipart(frames)
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self._pub.send_multipart(frames)

    def restart(self) -> None:
        """The engine restarted: seq from 0, empty replay buffer (same sockets)."""
        with self._lock:
            self.seq = 0
            self._buffer.clear()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._ctx.term()


async def publish_until_applied(
    pub: Publisher, events, stream, timeout: float = 10.0, first_wait_s: float = 0.3
) -> None:
    """Publish ``events`` until the proxy's stream (``stream()``: it, or None before it exists)
    has applied what was last published. A SUB misses what a PUB sends before its connection
    is up (ZMQ's slow joiner), so the batch goes again (the events must be idempotent); each
    wait is twice the last, since a large batch takes seconds to apply on a loaded box and
    sending it again every interval only queues more of the same work."""
    from tests.support.waiting import wait_until

    deadline = time.monotonic() + timeout
    wait_s = first_wait_s

    def applied() -> bool:
        st = stream()
        return st is not None and st.next_seq == pub.seq

    while True:
        pub.publish(events)
        try:
            await wait_until(applied, timeout=max(0.1, min(wait_s, deadline - time.monotonic())))
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        wait_s *= 2
