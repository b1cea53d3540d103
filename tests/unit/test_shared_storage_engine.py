"""SharedStorageConnector worker engine: blocks copied out of one KV cache, written
by the writer thread, read back by another engine's loader into different block
ids (real files, CPU tensors in the CPU backend's cache shape)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from connector import layout as kvlayout
from connector.shared_storage.engine import StorageEngine, file_meta
from connector.shared_storage.metadata import FetchSpec, StoreSpec
from connector.shared_storage.store import BlockStore
from tests.support.shared_storage_engines import BS, LAYERS, SHAPE, caches, chain, engine, wait_poll


@pytest.fixture
def engines(tmp_path: Path):
    made: list[StorageEngine] = []

    def make(c, **kw) -> StorageEngine:
        e = engine(tmp_path, c, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_store_then_load_into_other_blocks(engines):
    a, b = caches(1), caches(2)
    ea, eb = engines(a), engines(b)
    ks = chain(3)
    assert ea.submit_store(StoreSpec("p", (3, 4, 9), ks, 0))
    a_copy = {n: t.clone() for n, t in a.items()}
    for t in a.values():
        t.zero_()  # the blocks are reused at once: the store must have copied them
    assert ea.flush(10)
    eb.submit_load(FetchSpec("d", (7, 0, 5), ks, 0, 0.0))
    r = wait_poll(eb, "d")
    assert r.invalid_block_ids == set()
    for n in LAYERS:
        assert torch.equal(b[n][[7, 0, 5]], a_copy[n][[3, 4, 9]])
    assert ea.stats.stored_blocks == 3 and eb.stats.loaded_blocks == 3


def test_non_contiguous_layout_uses_the_gathered_copy(tmp_path: Path):
    """A layout whose blocks are not one byte run (e.g. a GPU backend's) goes through
    gather's index_select path; bytes on disk are the same."""
    a = caches(3)
    lay = kvlayout.BlockLayout("LBHNC", "bfloat16", SHAPE, contiguous_blocks=False)
    e = StorageEngine(BlockStore(tmp_path, file_meta("tiny", BS, lay, list(a), 0, 1)), a, lay, 0, 1 << 30, 1.0)
    b = caches(4)
    eb = engine(tmp_path, b)
    try:
        ks = chain(2, salt=9)
        e.submit_store(StoreSpec("p", (5, 2), ks, 0))
        assert e.flush(10)
        eb.submit_load(FetchSpec("d", (1, 8), ks, 0, 0.0))
        wait_poll(eb, "d")
        for n in LAYERS:
            assert torch.equal(b[n][[1, 8]], a[n][[5, 2]])
    finally:
        e.close()
        eb.close()


def test_second_store_of_the_same_blocks_writes_nothing(engines):
    a = caches(1)
    ea = engines(a)
    ks = chain(2)
    ea.submit_store(StoreSpec("p1", (1, 2), ks, 0))
    ea.submit_store(StoreSpec("p2", (1, 2, 3), chain(3), 0))  # shares the first 2 keys
    assert ea.flush(10)
    assert (ea.stats.stored_blocks, ea.stats.existing_blocks) == (3, 2)


def test_missing_block_fails_it_and_everything_after_it(engines, tmp_path: Path):
    a, b = caches(1), caches(2)
    ea, eb = engines(a), engines(b)
    ks = chain(4)
    ea.submit_store(StoreSpec("p", (0, 1, 2, 3), ks, 0))
    assert ea.flush(10)
    eb.store.path(ks[1]).unlink()
    before = {n: t.clone() for n, t in b.items()}
    eb.submit_load(FetchSpec("d", (8, 9, 10, 11), ks, 0, 0.0))
    r = wait_poll(eb, "d")
    assert r.invalid_block_ids == {9, 10, 11}  # the chain breaks at block 1
    for n in LAYERS:
        assert torch.equal(b[n][8], a[n][0])
        assert torch.equal(b[n][9:12], before[n][9:12])  # nothing written past the miss


def test_corrupt_block_is_reported_and_deleted(engines):
    a, b = caches(1), caches(2)
    ea, eb = engines(a), engines(b)
    ks = chain(2)
    ea.submit_store(StoreSpec("p", (0, 1), ks, 0))
    assert ea.flush(10)
    p = eb.store.path(ks[0])
    raw = bytearray(p.read_bytes())
    raw[-10] ^= 0x40
    p.write_bytes(bytes(raw))
    eb.submit_load(FetchSpec("d", (4, 5), ks, 0, 0.0))
    assert wait_poll(eb, "d").invalid_block_ids == {4, 5}
    assert not p.exists()


def test_load_waits_for_a_file_the_producer_writes_later(engines):
    a, b = caches(1), caches(2)
    ea, eb = engines(a), engines(b)
    ks = chain(2)
    eb.submit_load(FetchSpec("d", (4, 5), ks, 0, wait_s=5.0))
    time.sleep(0.3)
    assert "d" not in eb.poll(set()).finished  # still waiting
    ea.submit_store(StoreSpec("p", (0, 1), ks, 0))
    r = wait_poll(eb, "d")
    assert r.invalid_block_ids == set()
    for n in LAYERS:
        assert torch.equal(b[n][[4, 5]], a[n][[0, 1]])


def test_an_idle_poll_waits_for_a_pending_read_and_wakes_when_it_ends(engines):
    """A step that computes nothing waits (bounded) for a read instead of returning into
    vLLM's next empty step: D waiting for P's files would otherwise spin its engine."""
    a, b = caches(1), caches(2)
    ea, eb = engines(a), engines(b)
    ks = chain(2)
    eb.submit_load(FetchSpec("d", (4, 5), ks, 0, wait_s=30.0))
    timer = threading.Timer(0.3, lambda: ea.submit_store(StoreSpec("p", (0, 1), ks, 0)))
    timer.start()
    t0 = time.monotonic()
    try:
        r = eb.poll(set(), wait_s=20.0)
    finally:
        timer.join()
    assert r.finished == {"d"} and 0.25 <= time.monotonic() - t0 < 10
    t0 = time.monotonic()
    assert eb.poll(set(), wait_s=20.0).finished == set()  # nothing pending: no wait
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    eb.poll(set(), wait_s=0.3, awaiting=True)  # requests await a producer's first file: its bound
    assert time.monotonic() - t0 >= 0.25


def test_load_gives_up_at_its_deadline(engines):
    eb = engines(caches(2))
    t0 = time.monotonic()
    eb.submit_load(FetchSpec("d", (4, 5), chain(2), 0, wait_s=0.4))
    r = wait_poll(eb, "d")
    assert 0.35 <= time.monotonic() - t0 < 5
    assert r.invalid_block_ids == {4, 5}


def test_aborted_load_writes_nothing(engines):
    a, b = caches(1), caches(2)
    ea, eb = engines(a), engines(b)
    ks = chain(2)
    ea.submit_store(StoreSpec("p", (0, 1), ks, 0))
    assert ea.flush(10)
    before = {n: t.clone() for n, t in b.items()}
    eb.submit_load(FetchSpec("d", (4, 5), ks, 0, 0.0))
    read = eb._reads["d"]
    deadline = time.monotonic() + 30
    while not read.done:  # the read is done; the request finished before poll applied it
        assert time.monotonic() < deadline, "the read never finished"
        time.sleep(0.01)
    r = eb.poll({"d"})
    assert r.finished == {"d"} and r.invalid_block_ids == set()
    for n in LAYERS:
        assert torch.equal(b[n], before[n])
    assert eb.pending_loads == 0


def test_full_writer_queue_blocks_the_step_then_drops(engines, monkeypatch):
    """Back-pressure: a store that does not fit waits for the writer, up to
    queue_wait_s, and is dropped (logged) if the writer is stuck. (2 s: the writer, let go,
    frees room well within it on a loaded box.)"""
    a = caches(1)
    one = 2 * BS * 8 * 2 * len(LAYERS)  # bytes of one block, all layers
    ea = engines(a, queue_bytes=2 * one, queue_wait_s=2.0)
    gate = threading.Event()
    real_write = ea.store.write
    monkeypatch.setattr(ea.store, "write", lambda *a, **k: (gate.wait(10), real_write(*a, **k))[1])
    assert ea.submit_store(StoreSpec("p1", (0, 1), chain(2, 1), 0))  # taken by the writer, stuck
    t0 = time.monotonic()
    assert ea.submit_store(StoreSpec("p2", (0, 1), chain(2, 2), 0)) is False
    assert 1.9 <= time.monotonic() - t0 < 6
    assert ea.stats.dropped_stores == 1
    # Once the writer moves, a waiting store goes through.
    threading.Timer(0.1, gate.set).start()
    assert ea.submit_store(StoreSpec("p3", (0, 1), chain(2, 3), 0))
    assert ea.flush(10)
    assert ea.stats.stored_blocks == 4


def test_writer_evicts_to_the_limit(engines, tmp_path: Path):
    a = caches(1)
    probe = engines(a)
    probe.submit_store(StoreSpec("p0", (0,), chain(1, 100), 0))
    assert probe.flush(10)
    size = next(tmp_path.rglob("*.kv")).stat().st_size
    ea = engines(a, max_bytes=3 * size)
    for i in range(6):
        ea.submit_store(StoreSpec(f"p{i + 1}", (i,), chain(1, i), 0))
    assert ea.flush(10)
    assert ea.stats.stored_blocks == 6
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.kv")) <= 3 * size
