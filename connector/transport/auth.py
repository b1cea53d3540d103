"""Authentication of the KV control plane with a shared secret.

The key: ``derive_kv_key(secret)`` = HMAC-SHA256(secret, "xpyd-kv-v1"), so the KV
keys never equal the discovery MAC key even when both come from one secret. The
secret itself never travels and is never kept by the transport.

Two mechanisms (``KVAuth.mode``):

- ``mac`` (default): every request carries an auth frame in front of its header::

      [b"\\xc1xKVq1" | ts_ns u64 | nonce 16B | HMAC-SHA256 32B, header, tensor frames...]

  The MAC covers the timestamp, the nonce, the frame count, every frame's length and
  the header's bytes (hence the op, the key, the tensor dtypes and shapes). Tensor
  *contents* are not hashed: hashing gigabytes would cost more than the transfer (see
  the README's numbers); a message cannot be injected or replayed without the key,
  but an on-path attacker could alter payload bytes in flight (use ``curve`` there).
  The server admits a timestamp within ``window_s`` of its clock and each nonce once
  (``ReplayGuard``). Replies to an authenticated request carry
  ``[b"\\xc1xKVr1" | request nonce | HMAC]`` (same coverage, bound to the request),
  so a client acts only on answers from a holder of the key: P ships no KV bytes to
  a peer that did not prove the key at ``reserve``, and D (GET) loads no KV from one.
  ``\\xc1`` is never used by msgpack: a peer without a secret cannot mistake the
  auth frame for a header, and says so.

  The zmq port also authenticates each connection at its handshake (ZMQ's PLAIN
  mechanism, checked by a ZAP handler): the password is ``connect_token``, a key
  derived from the KV key for that alone. libzmq takes no message from a connection
  before its handshake is done and hands a message over only once all of it arrived,
  so without this a peer without the key could make the engine hold frames with
  MORE set, as many as it sent, until it left; now a peer without the key gets no
  further than the handshake (refused: counted as ``handshake``). The token travels in
  clear: someone who reads the traffic can connect too (and still forge nothing: the
  MAC). The byte stream needs no such gate: it reads a header and checks it before
  any payload.

- ``curve``: ZMQ CURVE (CurveZMQ: authenticated and encrypted) with server and client
  key pairs derived from the key, and a ZAP handler that admits only the derived
  client key. Peers are authenticated at the handshake, before libzmq buffers any of
  their messages, and everything is encrypted, at a throughput cost.
"""

from __future__ import annotations

import hmac
import itertools
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import zmq
from zmq.utils import z85

__all__ = [
    "AUTH_MODES", "KVAuth", "MacAuth", "RateLimitedLog", "ReplayGuard", "ZapHandler", "derive_kv_key",
    "is_reply_auth", "is_request_auth",
]

Buffer = bytes | memoryview  # a frame's bytes (zmq.Frame.buffer on the receiving side)
AuthMode = Literal["mac", "curve"]
AUTH_MODES: tuple[str, ...] = ("mac", "curve")

KV_KEY_LABEL = b"xpyd-kv-v1"
REQ_MAGIC = b"\xc1xKVq1"
REP_MAGIC = b"\xc1xKVr1"
_NONCE = 16
_TAG = 32
_TS = struct.Struct(">Q")
REQ_AUTH_LEN = len(REQ_MAGIC) + _TS.size + _NONCE + _TAG
REP_AUTH_LEN = len(REP_MAGIC) + _NONCE + _TAG
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
ZAP_DOMAIN = b"xpyd-kv"
PLAIN_USERNAME = b"xpyd-kv"  # mac's handshake: PLAIN, this name, the connect token as password


def derive_kv_key(secret: str) -> bytes:
    """The KV key: domain-separated from the discovery MAC key made of the same secret."""
    if not secret:
        raise ValueError("an empty KV secret is not a secret (unset it to run without authentication)")
    return hmac.digest(secret.encode(), KV_KEY_LABEL, "sha256")


def _sub(key: bytes, label: bytes) -> bytes:
    return hmac.digest(key, label, "sha256")


@dataclass(frozen=True, slots=True)
class KVAuth:
    """What a transport needs to authenticate; build it with ``from_secret``.

    ``window_s`` bounds the clock skew between hosts a ``mac`` timestamp may have
    (and how long nonces are remembered); ``replay_capacity`` bounds that memory.
    """

    mode: AuthMode
    mac_key: bytes = field(repr=False)
    curve_server: tuple[bytes, bytes] = field(repr=False)  # (public, secret), z85
    curve_client: tuple[bytes, bytes] = field(repr=False)
    connect_token: bytes = field(default=b"", repr=False)  # mac: the zmq handshake's password
    window_s: float = 30.0
    replay_capacity: int = 1 << 17

    @classmethod
    def from_secret(cls, secret: str, mode: str = "mac", **kw: float | int) -> "KVAuth":
        if mode not in AUTH_MODES:
            raise ValueError(f"kv_auth must be one of {AUTH_MODES}, got {mode!r}")
        key = derive_kv_key(secret)

        def pair(label: bytes) -> tuple[bytes, bytes]:
            # Any 32 bytes are a Curve25519 secret key (the scalar is clamped on use).
            sk = z85.encode(_sub(key, label))
            return zmq.curve_public(sk), sk

        return cls(mode, _sub(key, b"mac"), pair(b"curve-server"), pair(b"curve-client"),  # type: ignore[arg-type]
                   _sub(key, b"connect"), **kw)


def is_request_auth(frame: Buffer) -> bool:
    return len(frame) == REQ_AUTH_LEN and bytes(frame)[:len(REQ_MAGIC)] == REQ_MAGIC


def is_reply_auth(frame: Buffer) -> bool:
    return len(frame) == REP_AUTH_LEN and bytes(frame)[:len(REP_MAGIC)] == REP_MAGIC


def _pack_lens(lens: Sequence[int]) -> bytes:
    return struct.pack(f">I{len(lens)}Q", len(lens), *lens)


class ReplayGuard:
    """Admits each nonce once while its timestamp is inside the window.

    Bounded: past ``capacity`` nonces the oldest is forgotten and the floor rises to
    its timestamp, so a forgotten nonce can never be admitted again (a message must
    be newer than the floor). Under an absurd rate the floor catches up with the
    clock and fresh messages are refused rather than replays admitted.
    """

    def __init__(self, window_s: float, capacity: int) -> None:
        self._window_ns = int(window_s * 1e9)
        self._capacity = capacity
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> ts_ns, arrival order
        self._floor = 0

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, ts: int, nonce: bytes, now: int) -> str | None:
        """None (and the nonce is remembered), "stale" or "replay"."""
        if abs(now - ts) > self._window_ns:
            return "stale"
        if ts <= self._floor or nonce in self._seen:
            return "replay"
        seen = self._seen
        while seen:  # forget what the window already refuses
            oldest, oldest_ts = next(iter(seen.items()))
            if oldest_ts >= now - self._window_ns:
                break
            del seen[oldest]
        while len(seen) >= self._capacity:
            _, forgotten_ts = seen.popitem(last=False)
            self._floor = max(self._floor, forgotten_ts)
        seen[nonce] = ts
        return None


class MacAuth:
    """Signs and checks the ``mac`` mechanism's auth frames (see the module docstring).

    Clients call ``sign_request`` / ``check_reply`` from any thread; the server thread
    alone calls ``check_request`` / ``sign_reply`` (the replay guard is its own).
    """

    def __init__(self, auth: KVAuth, clock: Callable[[], int] = time.time_ns) -> None:
        self._key = auth.mac_key
        self._clock = clock
        self._prefix = secrets.token_bytes(_NONCE - 8)  # unique per process and transport
        self._count = itertools.count()  # next() is atomic under the GIL
        self._guard = ReplayGuard(auth.window_s, auth.replay_capacity)

    def _tag(self, magic: bytes, stamp: bytes, header: Buffer, lens: Sequence[int]) -> bytes:
        return hmac.digest(self._key, b"".join((magic, stamp, _pack_lens(lens), header)), "sha256")

    # A message's body is [header, tensor frames...]; ``lens`` are all their lengths.

    # ---- client ----
    def sign_request(self, header: Buffer, lens: Sequence[int]) -> tuple[bytes, bytes]:
        """(auth frame, nonce)."""
        nonce = self._prefix + next(self._count).to_bytes(8, "big")
        stamp = _TS.pack(self._clock()) + nonce
        return REQ_MAGIC + stamp + self._tag(REQ_MAGIC, stamp, header, lens), nonce

    def check_reply(self, nonce: bytes, auth_frame: Buffer, header: Buffer, lens: Sequence[int]) -> str | None:
        """None if this is the genuine reply to the call with this nonce; else "stale"
        (a reply to an earlier call) or "bad_mac"."""
        got = bytes(auth_frame)[len(REP_MAGIC):]
        if got[:_NONCE] != nonce:
            return "stale"
        return None if hmac.compare_digest(got[_NONCE:], self._tag(REP_MAGIC, nonce, header, lens)) else "bad_mac"

    # ---- server ----
    def check_request(self, auth_frame: Buffer, header: Buffer, lens: Sequence[int]) -> tuple[str | None, bytes]:
        """(None, nonce) for a genuine, fresh request; else (reason, b"")."""
        if not is_request_auth(auth_frame):
            return "unauthenticated", b""
        raw = bytes(auth_frame)
        stamp = raw[len(REQ_MAGIC):-_TAG]
        if not hmac.compare_digest(raw[-_TAG:], self._tag(REQ_MAGIC, stamp, header, lens)):
            return "bad_mac", b""
        ts, nonce = _TS.unpack_from(stamp)[0], stamp[_TS.size:]
        why = self._guard.check(ts, nonce, self._clock())
        return (why, b"") if why else (None, nonce)

    def sign_reply(self, nonce: bytes, header: Buffer, lens: Sequence[int]) -> bytes:
        return REP_MAGIC + nonce + self._tag(REP_MAGIC, nonce, header, lens)


class RateLimitedLog:
    """At most one line per ``key`` every ``interval_s``; the lines in between are
    counted and reported with the next one (a flood must not flood the log)."""

    def __init__(self, log: Callable[..., None], interval_s: float = 10.0) -> None:
        self._log = log
        self._interval = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e18) < self._interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._last[key] = now
            n = self._suppressed.pop(key, 0)
        self._log(msg + (" (%d more like it not logged)" if n else ""), *args, *((n,) if n else ()))


class ZapHandler:
    """ZAP (RFC 27) for one zmq context: admits CURVE clients with the derived client key,
    or (mac) PLAIN clients with the connect token, only. Runs in its own thread; refusals
    go to ``on_refuse``."""

    def __init__(self, ctx: zmq.Context, auth: KVAuth, on_refuse: Callable[[str, str], None]) -> None:
        self._client = z85.decode(auth.curve_client[0]) if auth.mode == "curve" else None
        self._token = auth.connect_token if auth.mode == "mac" else None
        self._on_refuse = on_refuse
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="xpyd-kv-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if not sock.poll(50, zmq.POLLIN):
                    continue
                msg = sock.recv_multipart()
                if len(msg) < 6:
                    sock.send_multipart([b"1.0", msg[1] if len(msg) > 1 else b"", b"500", b"bad ZAP request",
                                         b"", b""])
                    continue
                version, request_id, _domain, address, _identity, mechanism, *creds = msg
                ok = self._admits(mechanism, creds)
                if not ok:
                    self._on_refuse(address.decode(errors="replace"), mechanism.decode(errors="replace"))
                sock.send_multipart([version, request_id, b"200" if ok else b"400",
                                     b"OK" if ok else b"another kv_secret", b"", b""])
        except zmq.ZMQError:
            pass  # context terminated
        finally:
            sock.close(linger=0)

    def _admits(self, mechanism: bytes, creds: list[bytes]) -> bool:
        if mechanism == b"CURVE" and self._client is not None:
            return len(creds) == 1 and hmac.compare_digest(creds[0], self._client)
        if mechanism == b"PLAIN" and self._token is not None:
            return len(creds) == 2 and creds[0] == PLAIN_USERNAME and hmac.compare_digest(creds[1], self._token)
        return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
