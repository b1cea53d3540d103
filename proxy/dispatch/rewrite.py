"""The neutral request id: what clients see instead of the id P and D were sent.

The internal id names P's and D's KV addresses (``___prefill_addr_{P}___decode_addr_{D}_{uuid}``,
or ``xpyd-local-{uuid}``) and vLLM echoes it in every answer (``"id": "cmpl-{id}"``, chat
``"chatcmpl-{id}"``, batches and n > 1 alike, since all are built from the header). Unless
--expose-routing-headers, the relayed bytes get the neutral id in its place, so ids look like
vLLM's own (``cmpl-<32 hex>``) and the x-request-id header says the same. The neutral id is a
keyed hash of the uuid (a key of this proxy's, drawn at start): it names no transfer, so a
client cannot work out the transfer key (uuid + prompt index) that P's and D's connectors
move its KV under; only a request that asks (xpyd_report_transfer_key) is told it.

A streamed id may be split across two upstream chunks: the rewriter holds back only a tail
that is a proper prefix of the internal id. vLLM's chunks end with an SSE event ("\\n\\n"),
where nothing can be held: that is the fast path, one bytes.replace per chunk.
"""

from __future__ import annotations

import hashlib
import os
import re

_HEX = b"0123456789abcdef"


class NeutralIds:
    """The neutral id of each internal one, keyed by a secret of this proxy's: 32 hex digits,
    as vLLM's own, from which the uuid both internal forms end with cannot be worked out."""

    __slots__ = ("_keyed", "_last")

    def __init__(self, key: bytes | None = None) -> None:
        # Keyed once; each id copies it (a third cheaper than keying anew).
        self._keyed = hashlib.blake2b(digest_size=16, key=os.urandom(16) if key is None else key)
        self._last = ("", "")  # a request asks twice (header, rewrite): computed once

    def neutral(self, internal: str) -> str:
        last = self._last
        if last[0] == internal:
            return last[1]
        h = self._keyed.copy()
        h.update(internal[-32:].encode("ascii"))
        out = h.hexdigest()
        self._last = (internal, out)
        return out

    def rewrite(self, internal: str) -> IdRewrite:
        return IdRewrite(internal, self.neutral(internal))


class IdRewrite:
    """Replaces one internal id by its neutral form in a body or a stream of chunks."""

    __slots__ = ("old", "new", "_lead", "_held")

    def __init__(self, internal: str, neutral: str) -> None:
        self.old = internal.encode("ascii")
        self.new = neutral.encode("ascii")
        # The held tail can never overlap a replacement: `new` is hex only and `old` starts
        # with a non-hex byte, so a tail that is a prefix of `old` starts after any `new`.
        # A chunk ending in "\n" holds nothing back: the id has no newline.
        if self.new.translate(None, _HEX) or self.old[0] in _HEX or b"\n" in self.old:
            raise ValueError(f"cannot rewrite {internal!r} to {neutral!r}")
        self._lead = self.old[:1]
        self._held = b""

    def whole(self, data: bytes) -> bytes:
        """A complete body (non-streamed answer, error JSON)."""
        return data.replace(self.old, self.new)

    def feed(self, chunk: bytes) -> bytes:
        """The next streamed chunk, rewritten; a possible start of the id is kept back."""
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        data = chunk.replace(self.old, self.new)
        if not data or data[-1] == 10:  # ends a line ("\n\n": end of an SSE event)
            return data
        old = self.old
        n = len(data)
        # Only a tail shorter than the id can be the start of one.
        i = data.find(self._lead, max(0, n - len(old) + 1))
        while i >= 0:
            if old.startswith(data[i:]):
                self._held = data[i:]
                return data[:i]
            i = data.find(self._lead, i + 1)
        return data

    def flush(self) -> bytes:
        """What is held back, at the clean end of the stream: D's bytes, sent as they are
        (a stream that ends inside its own id is already broken)."""
        held, self._held = self._held, b""
        return held

    def drop(self) -> None:
        """The stream broke: a held start of the internal id is never sent."""
        self._held = b""


# ---------------------------------------------------------------- the Responses API's usage
# vLLM reports the prompt tokens a response found in its prefix cache, and those it wrote to it,
# in every Responses answer. D counts the KV it loaded from P as found and writes none: the
# client would read "all cached" where one server, which computed the prompt, reports what P
# reports. So D's two figures are replaced by P's, in the one place vLLM writes them (compact
# JSON, fixed field order: the whole answer, or a stream's response.completed event).
_USAGE = re.compile(rb'"input_tokens_details":\{"cached_tokens":\d+,"cache_write_tokens":\d+')


def prefill_cache_usage(p_answer: bytes) -> tuple[int, int] | None:
    """P's (cached_tokens, cache_write_tokens) from its Responses answer; None if absent."""
    m = re.search(rb'"input_tokens_details":\{"cached_tokens":(\d+),"cache_write_tokens":(\d+)', p_answer)
    return (int(m.group(1)), int(m.group(2))) if m else None


class UsageRewrite:
    """D's Responses answer with P's cache figures (see above), in a body or a stream; the same
    interface as IdRewrite. A stream is rewritten event by event: the bytes after its last
    complete event are held until the event ends (vLLM ends each write with one)."""

    __slots__ = ("new", "_held")

    def __init__(self, cached: int, written: int) -> None:
        self.new = b'"input_tokens_details":{"cached_tokens":%d,"cache_write_tokens":%d' % (cached, written)
        self._held = b""

    def whole(self, data: bytes) -> bytes:
        return _USAGE.sub(self.new, data)

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk if self._held else chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._held = data
            return b""
        self._held = data[end + 2:]
        return self.whole(data[:end + 2])

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return self.whole(held)

    def drop(self) -> None:
        self._held = b""
