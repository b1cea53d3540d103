"""SharedStorageConnector storage layer: the hash chain, the block file format,
atomic writes, verified reads, LRU eviction (no vLLM server; real files)."""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from connector.shared_storage import keys
from connector.shared_storage.store import MAGIC, BlockStore, Evictor, FileMeta, Miss, block_path

BS = 16


def meta(**kw) -> FileMeta:
    base = dict(model_id="tiny", block_size=BS, layout="LBHNC", dtype="bfloat16", block_shape=(2, BS, 8),
                layers=("l0", "l1"), rank=0, world=1)
    base.update(kw)
    return FileMeta(**base)


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 2, BS, 8), generator=g).to(torch.bfloat16)


def empty() -> torch.Tensor:
    return torch.empty((2, 2, BS, 8), dtype=torch.bfloat16)


# ---------------------------------------------------------------- hash chain


def test_chain_shares_keys_for_a_shared_prefix_only():
    seed = keys.root("tiny", BS)
    a = list(range(3 * BS + 5))
    b = a[:2 * BS] + [999] * (2 * BS)
    ka, kb = keys.chain(seed, a, BS), keys.chain(seed, b, BS)
    assert len(ka) == 3 and len(kb) == 4  # full blocks only
    assert ka[:2] == kb[:2]
    assert ka[2] != kb[2]
    # A block's key fixes its whole prefix: same tokens after a different prefix differ.
    c = [7] * BS + a[BS:2 * BS]
    assert keys.chain(seed, c, BS)[1] != ka[1]


def test_chain_extends_without_rehashing():
    seed = keys.root("tiny", BS)
    toks = list(range(5 * BS))
    full = keys.chain(seed, toks, BS)
    head = keys.chain(seed, toks[:2 * BS], BS)
    assert head + keys.chain(seed, toks, BS, start=2, prev=head[-1]) == full
    with pytest.raises(ValueError):
        keys.chain(seed, toks, BS, start=2)


def test_root_separates_model_block_size_lora_and_salt():
    toks = list(range(BS))
    roots = [keys.root("tiny", BS), keys.root("other", BS), keys.root("tiny", 2 * BS),
             keys.root("tiny", BS, lora="sql"), keys.root("tiny", BS, cache_salt="s"),
             keys.root("tin", BS, lora="ysql")]
    assert len({keys.chain(r, toks * 2, BS)[0] for r in roots}) == len(roots)
    assert keys.root("tiny", BS) == keys.root("tiny", BS)


# ---------------------------------------------------------------- files


def test_write_then_read_round_trip_and_header(tmp_path: Path):
    s = BlockStore(tmp_path, meta())
    b = block(1)
    n = s.write("ab" * 32, 3, b)
    assert n > b.numel() * 2
    assert s.write("ab" * 32, 3, block(2)) == 0  # exists: not rewritten
    out = empty()
    s.read_into("ab" * 32, out)
    assert torch.equal(out, b)
    raw = s.path("ab" * 32).read_bytes()
    assert raw[:8] == MAGIC
    (hlen,) = struct.unpack("<I", raw[8:12])
    h = json.loads(raw[12:12 + hlen])
    assert (h["model_id"], h["layout"], h["dtype"], h["block_shape"], h["index"]) == ("tiny", "LBHNC", "bfloat16",
                                                                                      [2, BS, 8], 3)
    assert s.path("ab" * 32) == block_path(tmp_path, "ab" * 32, 0, 1)


def test_absent_is_a_miss(tmp_path: Path):
    with pytest.raises(Miss, match="not stored"):
        BlockStore(tmp_path, meta()).read_into("cd" * 32, empty())


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        raw = raw[:len(raw) - 100]
    elif how == "flipped":
        raw[-50] ^= 0xFF
    elif how == "magic":
        raw[0:8] = b"NOTAKVFL"
    elif how == "header":
        raw[12] = ord("x")  # the header's opening brace
    elif how == "trailing":
        raw += b"x"
    elif how == "empty":
        raw = bytearray()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["truncated", "flipped", "magic", "header", "trailing", "empty"])
def test_damaged_file_is_a_miss_and_is_deleted(tmp_path: Path, how: str):
    s = BlockStore(tmp_path, meta())
    k = "ef" * 32
    s.write(k, 0, block(1))
    _damage(s.path(k), how)
    out = empty()
    with pytest.raises(Miss) as e:
        s.read_into(k, out)
    assert e.value.damaged
    assert not s.path(k).exists()  # a producer will write it again
    assert s.write(k, 0, block(1)) > 0
    s.read_into(k, out)
    assert torch.equal(out, block(1))


def test_flipped_payload_passes_without_verification(tmp_path: Path):
    """The power of the CRC: with it off the same damage reads as valid (wrong) KV."""
    k = "ef" * 32
    BlockStore(tmp_path, meta()).write(k, 0, block(1))
    _damage(block_path(tmp_path, k, 0, 1), "flipped")
    out = empty()
    BlockStore(tmp_path, meta(), verify=False).read_into(k, out)
    assert not torch.equal(out, block(1))


@pytest.mark.parametrize("field,value", [("model_id", "other"), ("dtype", "float16"), ("layout", "LBNHC"),
                                         ("block_size", 2 * BS), ("layers", ("l0", "lx"))])
def test_mismatched_file_is_a_miss_and_is_kept(tmp_path: Path, field: str, value: object):
    k = "12" * 32
    BlockStore(tmp_path, meta(**{field: value})).write(k, 0, block(1))
    with pytest.raises(Miss, match=f"{field} mismatch") as e:
        BlockStore(tmp_path, meta()).read_into(k, empty())
    assert not e.value.damaged
    assert block_path(tmp_path, k, 0, 1).exists()


def test_wrong_block_shape_is_a_miss(tmp_path: Path):
    k = "34" * 32
    BlockStore(tmp_path, meta(block_shape=(2, BS, 4))).write(k, 0, torch.zeros((2, 2, BS, 4), dtype=torch.bfloat16))
    with pytest.raises(Miss, match="block_shape mismatch"):
        BlockStore(tmp_path, meta()).read_into(k, empty())


def test_ranks_have_their_own_files(tmp_path: Path):
    k = "56" * 32
    BlockStore(tmp_path, meta(rank=1, world=2)).write(k, 0, block(1))
    with pytest.raises(Miss, match="not stored"):
        BlockStore(tmp_path, meta(rank=0, world=2)).read_into(k, empty())
    with pytest.raises(Miss, match="not stored"):  # a TP=1 instance never reads a TP=2 shard
        BlockStore(tmp_path, meta()).read_into(k, empty())


def test_concurrent_writers_and_readers_never_see_partial_files(tmp_path: Path):
    """Writers race on the same keys (temp file + rename) while readers read: every
    read is a miss (not there yet) or the complete block, never a damaged file."""
    n_keys, rounds = 6, 15
    ks = [f"{i:02x}" * 32 for i in range(n_keys)]
    want = {k: block(i) for i, k in enumerate(ks)}
    stop = threading.Event()
    errors: list[str] = []
    good_reads = [0]

    def writer() -> None:
        s = BlockStore(tmp_path, meta())
        for r in range(rounds):
            for k in ks:
                s.write(k, 0, want[k])
                if r == rounds - 1:
                    continue  # the last round's blocks stay: readers get whole reads even on a loaded box
                try:
                    os.unlink(s.path(k))  # force the next round to write again
                except FileNotFoundError:
                    pass  # another writer's unlink won

    def reader() -> None:
        s = BlockStore(tmp_path, meta())
        out = empty()
        while not stop.is_set():
            for k in ks:
                try:
                    s.read_into(k, out)
                except Miss as m:
                    if m.reason != "not stored":
                        errors.append(m.reason)
                    continue
                if not torch.equal(out, want[k]):
                    errors.append("wrong content")
                good_reads[0] += 1

    writers = [threading.Thread(target=writer) for _ in range(3)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join(60)
    deadline = time.monotonic() + 10
    while good_reads[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in readers:
        t.join(10)
    assert errors == []
    assert good_reads[0] > 0
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp-")]  # no temp file left behind


def test_failed_write_leaves_no_file(tmp_path: Path):
    s = BlockStore(tmp_path, meta())
    k = "78" * 32
    with pytest.raises(Exception):
        s.write(k, 0, torch.zeros(3, dtype=torch.bfloat16).expand(2, 3))  # not contiguous: refused
    assert not s.path(k).exists()
    assert not list(tmp_path.rglob(".tmp-*"))


# ---------------------------------------------------------------- eviction


def _file_size(tmp_path: Path) -> int:
    return sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))


def test_eviction_keeps_the_limit_and_drops_least_recently_used(tmp_path: Path):
    s = BlockStore(tmp_path, meta())
    one = s.write("00" * 32, 0, block(0))
    limit = 4 * one
    ev = Evictor(tmp_path, limit, rescan_s=3600)
    ev.scan()
    ks = [f"{i:02x}" * 32 for i in range(10)]
    base = time.time() - 100
    for i, k in enumerate(ks[1:], start=1):
        ev.added(s.write(k, 0, block(i)))
        os.utime(s.path(k), (base + i, base + i))  # deterministic order: key i written at base+i
        if i == 1:
            os.utime(s.path(ks[0]), (base, base))
        if i == 3:
            s.read_into(ks[0], empty())  # used: now the most recent
        ev.maybe_evict()
        assert _file_size(tmp_path) <= limit
    left = {p.name.split(".")[0] for p in tmp_path.rglob("*.kv")}
    assert ks[0] in left  # read recently: survived
    assert ks[9] in left and ks[8] in left
    assert ks[1] not in left and ks[2] not in left  # oldest unused went first
    assert ev.evicted_files >= 5


def test_eviction_counts_files_written_by_others(tmp_path: Path):
    """Another instance's writes are seen by the periodic rescan."""
    s = BlockStore(tmp_path, meta())
    one = s.write("00" * 32, 0, block(0))
    ev = Evictor(tmp_path, 2 * one, rescan_s=0.0)
    for i in range(1, 5):
        s.write(f"{i:02x}" * 32, 0, block(i))  # not reported to ev
    ev.maybe_evict()
    assert _file_size(tmp_path) <= 2 * one


def test_no_limit_never_evicts_and_stale_temp_files_are_swept(tmp_path: Path):
    s = BlockStore(tmp_path, meta())
    for i in range(3):
        s.write(f"{i:02x}" * 32, 0, block(i))
    stale = tmp_path / "00" / ".tmp-leftover"
    stale.write_bytes(b"x")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert Evictor(tmp_path, 0).maybe_evict() == 0
    assert len(list(tmp_path.rglob("*.kv"))) == 3
    Evictor(tmp_path, 10**12, rescan_s=0.0).maybe_evict()
    assert not stale.exists()


# ---------------------------------------------------------------- what others may plant in the store


def test_what_the_store_creates_is_private(tmp_path: Path):
    root = tmp_path / "store"
    s = BlockStore(root, meta())
    k = "a1" * 32
    s.write(k, 0, block(1))
    assert os.stat(root).st_mode & 0o777 == 0o700
    assert os.stat(s.path(k).parent).st_mode & 0o777 == 0o700
    assert os.stat(s.path(k)).st_mode & 0o777 == 0o600


def test_a_link_planted_in_the_store_is_never_followed(tmp_path: Path):
    """Someone who may write the shared directory links a key's directory, or a block's name,
    to files elsewhere: reads miss (a valid block there is not loaded), writes do not land
    there, and the target is neither touched nor deleted."""
    elsewhere = BlockStore(tmp_path / "elsewhere", meta())
    s = BlockStore(tmp_path / "store", meta())
    k_dir, k_file = "b2" * 32, "c3" * 32
    for k in (k_dir, k_file):
        elsewhere.write(k, 0, block(7))
    # The key's directory is a link to the other store's.
    os.symlink(elsewhere.path(k_dir).parent, s.root / k_dir[:2])
    # The block file's name is a link to a valid block of the same key elsewhere.
    s.path(k_file).parent.mkdir(mode=0o700)
    os.symlink(elsewhere.path(k_file), s.path(k_file))
    target = elsewhere.path(k_file)
    os.utime(target, (1_000_000, 1_000_000))
    for k in (k_dir, k_file):
        assert not s.stored(k)
        with pytest.raises(Miss):
            s.read_into(k, empty())
    assert os.stat(target).st_mtime == 1_000_000 and target.exists()
    with pytest.raises(OSError):  # a link where the key's directory belongs: nothing is written through it
        s.write(k_dir, 0, block(1))
    assert sorted(p.name for p in elsewhere.path(k_dir).parent.iterdir()) == [elsewhere.path(k_dir).name]
    s.write(k_file, 0, block(1))  # the link is touched, not its target
    assert os.stat(target).st_mtime == 1_000_000


def test_a_fifo_under_a_blocks_name_is_a_miss_not_a_wait(tmp_path: Path):
    s = BlockStore(tmp_path, meta())
    k = "d4" * 32
    s.path(k).parent.mkdir(mode=0o700)
    os.mkfifo(s.path(k))
    result: list = []

    def read():
        try:
            s.read_into(k, empty())
        except Miss as e:
            result.append(e.reason)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        os.close(os.open(s.path(k), os.O_WRONLY | os.O_NONBLOCK))  # release the reader
        t.join(10)
        pytest.fail("reading a FIFO in the store blocked")
    assert result and not s.stored(k)
