"""asyncio.timeout for code that has its event loop in hand.

``asyncio.timeout()`` looks the running loop up three times (in ``timeout()``, and in
``current_task()`` and ``reschedule()`` on entry), and on Python 3.11 every lookup checks
the process id with a ``getpid()`` system call. With asyncio's timeouts and loop lookups the
proxy made 19 such calls per request (``strace -c``), a tenth of its CPU. ``Deadline`` has
the same semantics as ``asyncio.Timeout`` (the task is cancelled at the deadline; the
cancellation becomes TimeoutError at the block's end unless someone else also cancelled
the task) and takes the loop from its caller.
"""

from __future__ import annotations

import asyncio
from types import TracebackType


class Deadline:
    """``async with Deadline(loop, when):`` fails the block with TimeoutError at loop time
    ``when`` (None: no deadline until ``reschedule``)."""

    __slots__ = ("_loop", "_when", "_armed", "_task", "_handle", "_cancelling", "_expired")

    def __init__(self, loop: asyncio.AbstractEventLoop, when: float | None) -> None:
        self._loop = loop
        self._when = when
        self._task: asyncio.Task | None = None
        self._handle: asyncio.Handle | None = None
        self._armed = 0.0  # the loop time the handle fires at
        self._cancelling = 0
        self._expired = False

    @classmethod
    def after(cls, loop: asyncio.AbstractEventLoop, delay: float | None) -> Deadline:
        return cls(loop, None if delay is None else loop.time() + delay)

    def when(self) -> float | None:
        return self._when

    def expired(self) -> bool:
        return self._expired

    def reschedule(self, when: float | None) -> None:
        if self._task is None:
            raise RuntimeError("Deadline has not been entered")
        if self._expired:
            raise RuntimeError("Deadline has expired")
        self._when = when
        if when is not None and self._handle is not None and when >= self._armed:
            # Later than the armed timer: it looks again when it fires. A relay pushes its
            # idle deadline back on every chunk, and a new timer each time costs more.
            return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if when is not None:
            self._arm(when)

    def _arm(self, when: float) -> None:
        loop = self._loop
        self._armed = when
        self._handle = loop.call_soon(self._expire) if when <= loop.time() else loop.call_at(when, self._expire)

    def _expire(self) -> None:
        assert self._task is not None and self._when is not None
        if self._when > self._armed and self._when > self._loop.time():
            self._arm(self._when)  # pushed back meanwhile
            return
        self._task.cancel()
        self._expired = True
        self._handle = None

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task(self._loop)  # given the loop: no lookup
        if task is None:
            raise RuntimeError("Deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self.reschedule(self._when)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:  # fmt: skip
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._expired:
            assert self._task is not None
            # As asyncio.Timeout: the cancellation is ours to turn into TimeoutError unless
            # the task was cancelled by someone else too.
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise TimeoutError from exc
