"""D's arrival board (connector/p2p/arrivals.py): a real file in shared memory, written by the
worker rank's side and read by the scheduler's, as in two processes (each side maps it)."""

from __future__ import annotations

import os
import subprocess

import pytest

from connector.p2p import arrivals
from connector.p2p.arrivals import ArrivalReader, ArrivalWriter, board_path

KEY = "0123456789abcdef0123456789abcdef-0"


@pytest.fixture
def board(tmp_path):
    path = board_path("127.0.0.1:40001", str(tmp_path))
    w = ArrivalWriter(path)
    r = ArrivalReader(path)
    yield w, r
    r.close()
    w.close()


def test_a_published_transfer_is_seen_and_no_other(board):
    w, r = board
    assert r.arrived(KEY) is False
    w.publish(KEY)
    assert r.arrived(KEY) is True
    assert r.arrived(KEY[:-1] + "1") is False  # another prompt of the same request


def test_a_begun_transfer_is_seen_as_begun_not_arrived(board):
    w, r = board
    assert r.begun(KEY) is False
    w.publish_begun(KEY)
    assert r.begun(KEY) is True and r.arrived(KEY) is False
    assert r.begun(KEY[:-1] + "1") is False
    w.publish("other-0")  # arrived implies begun
    assert r.begun("other-0") is True


def test_a_key_not_begun_is_not_looked_for_again_until_the_board_changes(board, monkeypatch):
    """A request waiting for its prefill is asked about every engine step: the reader scans the
    board for it again only once something new was written."""
    w, r = board
    scans = []
    find = r._find
    monkeypatch.setattr(r, "_find", lambda h: scans.append(h) or find(h))
    assert r.begun(KEY) is False
    n = len(scans)
    assert r.begun(KEY) is False and r.begun(KEY) is False
    assert len(scans) == n  # nothing written: no scan
    w.publish_begun("other-0")
    assert r.begun(KEY) is False and len(scans) > n
    w.publish_begun(KEY)
    assert r.begun(KEY) is True


def test_begun_on_no_board_is_unknown(tmp_path):
    r = ArrivalReader(board_path("127.0.0.1:40009", str(tmp_path)))
    assert r.begun(KEY) is None


def test_the_board_remembers_the_last_slots_arrivals(board):
    w, r = board
    w.publish(KEY)
    for i in range(arrivals.SLOTS - 1):
        w.publish(f"other-{i}")
    assert r.arrived(KEY) is True  # still in its slot
    w.publish("one-more")  # wraps around onto KEY's slot
    assert r.arrived(KEY) is False
    assert r.arrived("one-more") is True and r.arrived("other-0") is True


def test_a_digest_across_two_slots_is_no_match(tmp_path):
    """Only a digest in a slot of its own counts: bytes that happen to spell it across a
    slot boundary (two neighbouring digests) do not."""
    path = board_path("127.0.0.1:40002", str(tmp_path))
    w = ArrivalWriter(path)
    r = ArrivalReader(path)
    try:
        h = arrivals._digest(KEY)
        at = arrivals.HEADER + arrivals.DIGEST // 2  # half in slot 0, half in slot 1
        w._mm[at:at + arrivals.DIGEST] = h
        assert r.arrived(KEY) is False
        w.publish(KEY)
        assert r.arrived(KEY) is True
    finally:
        r.close()
        w.close()


def test_no_board_or_another_layout_says_no(tmp_path):
    """The scheduler then asks the worker's control socket, as without a board."""
    path = board_path("127.0.0.1:40003", str(tmp_path))
    r = ArrivalReader(path)
    assert r.arrived(KEY) is False  # not made yet
    path.write_bytes(b"x" * arrivals.SIZE)  # not our magic
    assert r.arrived(KEY) is False
    path.write_bytes(arrivals.MAGIC)  # too short
    assert r.arrived(KEY) is False
    w = ArrivalWriter(path)  # made now: read from the next question on
    try:
        w.publish(KEY)
        assert r.arrived(KEY) is True
    finally:
        r.close()
        w.close()


def test_a_stale_board_read_first_is_swapped_for_the_live_one(tmp_path):
    """A previous instance's board under the same name (killed, never removed), mapped before
    this instance's worker made its own: the reader moves to the live board on a miss."""
    path = board_path("127.0.0.1:40007", str(tmp_path))
    stale = ArrivalWriter(path)
    stale.publish("old-transfer")
    r = ArrivalReader(path)
    try:
        assert r.arrived("old-transfer") is True  # mapped the stale board
        live = ArrivalWriter(path)  # replaces the name
        try:
            live.publish(KEY)
            assert r.arrived(KEY) is True
            assert r.arrived("old-transfer") is False
            stale.close()  # the previous instance's late close leaves the live board
            assert path.exists() and r.arrived(KEY) is True
        finally:
            live.close()
        assert not path.exists()
    finally:
        r.close()


def test_the_board_is_private_and_removed_on_close(tmp_path):
    path = board_path("127.0.0.1:40004", str(tmp_path))
    w = ArrivalWriter(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert str(os.getuid()) in path.name
    w.close()
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file left either


def test_boards_of_ended_writers_are_removed_when_a_writer_starts(tmp_path):
    """vLLM can end a worker without closing its connector: the next writer removes the
    boards (and half-made ones) whose writer is gone, and no other file."""
    alive = ArrivalWriter(board_path("127.0.0.1:40012", str(tmp_path)))  # this process: alive
    ended = _ended_pid()
    dead = board_path("127.0.0.1:40010", str(tmp_path))
    made = dead.with_name("made")
    w = ArrivalWriter(made)
    w._mm[len(arrivals.MAGIC):len(arrivals.MAGIC) + 8] = ended.to_bytes(8, "little")
    w._mm.close()
    made.rename(dead)  # as a writer that died in process `ended` left it
    half = tmp_path / f"{board_path('127.0.0.1:40011', str(tmp_path)).name}.{ended}.tmp"
    half.write_bytes(b"")
    other_user = tmp_path / f"xpyd-arrivals-{os.getuid() + 1}-127.0.0.1_40013"
    other_user.write_bytes(b"")
    not_a_board = tmp_path / f"xpyd-arrivals-{os.getuid()}-notes"
    not_a_board.write_bytes(b"something else")
    assert dead.exists() and half.exists()
    new = ArrivalWriter(board_path("127.0.0.1:40014", str(tmp_path)))
    try:
        assert not dead.exists() and not half.exists()
        assert alive.path.exists() and other_user.exists() and not_a_board.exists()
    finally:
        new.close()
        alive.close()


def _ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_board_path_is_one_name_per_address_and_user():
    a, b = board_path("127.0.0.1:40005"), board_path("127.0.0.1:40006")
    assert a != b and a.parent == b.parent
    assert "/" not in board_path("[::1]:40005").name
