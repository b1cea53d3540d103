"""Helpers of tests/unit/test_connector_first_contact.py that other tests use too (moved from it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def connector_log(module: str = "producer") -> Iterator[_Lines]:
    """A P2P connector module's INFO lines (connector/p2p/; the producer's: its 'kv sent' lines)
    while the block runs."""
    lines = _Lines()
    log = logging.getLogger(f"vllm.xpyd.connector.p2p.{module}")
    log.addHandler(lines)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
