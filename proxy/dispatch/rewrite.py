"""The request id a client sees instead of the id P and D were sent.

The internal id names P's and D's KV addresses (``___prefill_addr_{P}___decode_addr_{D}_{uuid}``,
``xpyd-early`` in front when D is asked with P, or ``xpyd-local-{uuid}``) and vLLM echoes it in
every answer (``"id": "cmpl-{id}"``, chat ``"chatcmpl-{id}"``, batches and n > 1 alike, since all
are built from the header). Unless --expose-routing-headers, the relayed bytes get in its place what
one vLLM server would have named the answer after: the client's own id (its X-Request-Id header,
else the body's ``request_id``: vLLM 0.32 takes them in that order), else a neutral id of vLLM's
shape (16 hex digits, as vLLM's random_uuid). The neutral id is a keyed hash of the uuid (a key of
this proxy's, drawn at start): it names no transfer, so a client cannot work out the transfer key
(uuid + prompt index) that P's and D's connectors move its KV under; only a request that asks
(xpyd_report_transfer_key) is told it.

A streamed id may be split across two upstream chunks: the rewriter holds back only a tail
that is a proper prefix of the internal id, before replacing (so the client's id may be any
string). vLLM's chunks end with an SSE event ("\\n\\n"), where nothing can be held: that is the
fast path, one bytes.replace per chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re

import orjson

log = logging.getLogger("xpyd.proxy.rewrite")


class NeutralIds:
    """The neutral id of each internal one, keyed by a secret of this proxy's: 16 hex digits,
    as vLLM 0.32's own (random_uuid), from which the uuid both internal forms end with cannot
    be worked out."""

    __slots__ = ("_keyed", "_last")

    def __init__(self, key: bytes | None = None) -> None:
        # Keyed once; each id copies it (a third cheaper than keying anew).
        self._keyed = hashlib.blake2b(digest_size=8, key=os.urandom(16) if key is None else key)
        self._last = ("", "")  # a request asks more than once (P's answer, D's): computed once

    def neutral(self, internal: str) -> str:
        last = self._last
        if last[0] == internal:
            return last[1]
        h = self._keyed.copy()
        h.update(internal[-32:].encode("ascii"))
        out = h.hexdigest()
        self._last = (internal, out)
        return out

    def shown(self, internal: str, client: str | None) -> str:
        """The id the client sees for ``internal``: its own (``client``), else the neutral one."""
        return self.neutral(internal) if client is None else client

    def rewrite(self, internal: str, client: str | None = None) -> IdRewrite:
        return IdRewrite(internal, self.shown(internal, client))


def _border(old: bytes) -> bool:
    """Whether some proper prefix of ``old`` is also its suffix. A border of 4 bytes or more starts
    with old's first 4, which the ids the proxy builds hold only at their start ("___p", "xpyd"):
    one search rules those out, then the 3 shorter ones are tried."""
    if len(old) > 4 and old.find(old[:4], 1) < 0:
        return old[:1] == old[-1:] or old[:2] == old[-2:] or old[:3] == old[-3:]
    return any(old.startswith(old[i:]) for i in range(1, len(old)))


class IdRewrite:
    """Replaces one internal id by the id the client is shown (written as inside a JSON
    string, where vLLM writes it) in a body or a stream of chunks."""

    __slots__ = ("internal", "shown", "old", "new", "_lead", "_held")

    def __init__(self, internal: str, shown: str) -> None:
        self.internal, self.shown = internal, shown
        self.old = internal.encode("ascii")
        self.new = orjson.dumps(shown)[1:-1]
        # The tail held back is cut before replacing, and no occurrence of `old` can overlap it
        # when `old` has no border (the internal ids have none: they start with "_" or "x" and
        # end in hex). A chunk ending in "\n" holds nothing back: the id has no newline.
        if not self.old or b"\n" in self.old or _border(self.old):
            raise ValueError(f"cannot rewrite {internal!r}")
        self._lead = self.old[:1]
        self._held = b""

    def text(self, value: str) -> str:
        """A string of the answer (not yet written as JSON) as the client is to see it."""
        return value.replace(self.internal, self.shown)

    def whole(self, data: bytes) -> bytes:
        """A complete body (non-streamed answer, error JSON)."""
        return data.replace(self.old, self.new)

    def feed(self, chunk: bytes) -> bytes:
        """The next streamed chunk, rewritten; a possible start of the id is kept back."""
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        old, new = self.old, self.new
        if not chunk or chunk[-1] == 10:  # ends a line ("\n\n": end of an SSE event)
            return chunk.replace(old, new)
        n = len(chunk)
        # Only a tail shorter than the id can be the start of one.
        i = chunk.find(self._lead, max(0, n - len(old) + 1))
        while i >= 0:
            if old.startswith(chunk[i:]):
                self._held = chunk[i:]
                return chunk[:i].replace(old, new)
            i = chunk.find(self._lead, i + 1)
        return chunk.replace(old, new)

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


# ---------------------------------------------------------------- completions' and chat's usage
# With --enable-prompt-tokens-details vLLM reports the prompt tokens it found in its prefix cache
# (and, for chat, those it wrote to it) in prompt_tokens_details. D counts the KV it loaded from P
# as found: P's figures, which one server that computed the prompt reports, replace D's, in the
# one place vLLM writes them (compact JSON, fixed field order: the whole answer, or a stream's last
# usage). Off (the default), vLLM writes null there: P's answer is then searched once, and no
# rewrite is attached.
_DETAILS_OPEN = b'"prompt_tokens_details":{'
_DETAILS = re.compile(rb'"prompt_tokens_details":\{"cached_tokens":(\d+|null)(?:,"created_cache_tokens":(\d+|null))?')


def prefill_details(p_answer: bytes) -> tuple[bytes, bytes] | None:
    """P's (cached_tokens, created_cache_tokens) as JSON values, from its answer; None: absent."""
    if _DETAILS_OPEN not in p_answer:
        return None
    m = _DETAILS.search(p_answer)
    return (m.group(1), m.group(2) or b"null") if m else None


def _with_figures(data: bytes, cached: bytes, created: bytes) -> bytes:
    """``data`` with P's figures (JSON values) in place of D's prompt_tokens_details ones."""
    if _DETAILS_OPEN not in data:
        return data

    def one(m: re.Match[bytes]) -> bytes:
        out = b'"prompt_tokens_details":{"cached_tokens":' + cached
        return out + b',"created_cache_tokens":' + created if m.group(2) is not None else out

    return _DETAILS.sub(one, data)


class DetailsRewrite:
    """D's completions or chat answer with P's prompt-cache figures (see above), over the id
    rewrite (``inner``): the interface of IdRewrite. A stream is rewritten event by event: the
    bytes after its last complete event are held until the event ends."""

    __slots__ = ("_inner", "_cached", "_created", "_held")

    def __init__(self, figures: tuple[bytes, bytes], inner: IdRewrite | None) -> None:
        self._inner = inner
        self._cached, self._created = figures
        self._held = b""

    def _sub(self, data: bytes) -> bytes:
        return _with_figures(data, self._cached, self._created)

    def text(self, value: str) -> str:
        return value if self._inner is None else self._inner.text(value)

    def whole(self, data: bytes) -> bytes:
        return self._sub(data if self._inner is None else self._inner.whole(data))

    def feed(self, chunk: bytes) -> bytes:
        data = chunk if self._inner is None else self._inner.feed(chunk)
        if self._held:
            data = self._held + data
        end = data.rfind(b"\n\n")
        if end < 0:
            self._held = data
            return b""
        self._held = data[end + 2:]
        return self._sub(data[:end + 2])

    def flush(self) -> bytes:
        tail = b"" if self._inner is None else self._inner.flush()
        held, self._held = self._held + tail, b""
        return self._sub(held)

    def drop(self) -> None:
        if self._inner is not None:
            self._inner.drop()
        self._held = b""


class LateDetails:
    """DetailsRewrite for a stream relayed before P answered (D's first token came first,
    disaggregated.py): P's figures are not known yet. D's events go on as they come until one
    carries prompt_tokens_details (with --enable-prompt-tokens-details: the usage); from that
    one on the stream waits for P's answer (``holding``: the relay awaits ``settle``). P's call
    usually ends a token or two into the stream, and from then on this is DetailsRewrite."""

    __slots__ = ("_prefill", "_inner", "_known", "_cached", "_created", "_held", "holding")

    def __init__(self, prefill: asyncio.Future[bytes], inner: IdRewrite | None) -> None:
        self._prefill = prefill  # P's call: its answer, or its failure
        self._inner = inner
        self._known = False
        self._cached = self._created = b""  # P's figures once known; empty: P reported none
        self._held = b""
        self.holding = False

    def _learn(self) -> bool:
        """Whether P's figures are known (P's call ended); learnt once it has."""
        if not self._known and self._prefill.done():
            answer = None if self._prefill.cancelled() or self._prefill.exception() else self._prefill.result()
            figures = prefill_details(answer) if answer is not None else None
            if figures is None and answer is None:
                log.warning("prefill failed after the decode stream began: D's prompt_tokens_details relayed")
            self._cached, self._created = figures or (b"", b"")
            self._known = True
        return self._known

    def _sub(self, data: bytes) -> bytes:
        return _with_figures(data, self._cached, self._created) if self._cached else data

    def _events(self, data: bytes) -> bytes:
        """The complete events of ``data`` that may go now; the rest is held."""
        end = data.rfind(b"\n\n")
        if end < 0:
            self._held = data
            return b""
        done, self._held = data[:end + 2], data[end + 2:]
        if self._known or _DETAILS_OPEN not in done or self._learn():
            return self._sub(done)
        # This event has D's figures and P's are still to come: it and what follows wait.
        before = done.rfind(b"\n\n", 0, done.find(_DETAILS_OPEN))
        start = before + 2 if before >= 0 else 0
        self._held = done[start:] + self._held
        self.holding = True
        return done[:start]

    def text(self, value: str) -> str:
        return value if self._inner is None else self._inner.text(value)

    def whole(self, data: bytes) -> bytes:
        """A complete body, with P's figures if P answered (streams alone get a LateDetails)."""
        self._learn()
        return self._sub(data if self._inner is None else self._inner.whole(data))

    def feed(self, chunk: bytes) -> bytes:
        data = chunk if self._inner is None else self._inner.feed(chunk)
        if self._held:
            data = self._held + data
        if self.holding:
            self._held = data
            return b""
        return self._events(data)

    async def settle(self) -> bytes:
        """Wait for P's call to end (bounded by its own deadline; never cancelled from here)
        and return what was held that may go now."""
        if not self._prefill.done():
            await asyncio.wait((self._prefill,))
        self._learn()
        self.holding = False
        held, self._held = self._held, b""
        return self._events(held)

    def flush(self) -> bytes:
        tail = b"" if self._inner is None else self._inner.flush()
        held, self._held = self._held + tail, b""
        self._learn()  # not settled: a stream that ended inside its usage event keeps D's figures
        return self._sub(held)

    def drop(self) -> None:
        if self._inner is not None:
            self._inner.drop()
        self._held = b""
