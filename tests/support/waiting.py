"""Bounded waits for tests: one home for wait_until."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


async def wait_until(
    predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.01, what: str = ""
) -> Any:
    """Poll predicate until truthy; fail the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)
