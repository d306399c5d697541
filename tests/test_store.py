"""Persistent KV store alone (issue 5, point 1): keys, lookup, round trip, LRU eviction, bad data,
restart recovery and failure to write. Tiny blocks (2 layers x 4 tokens x 16 B = 128 B payloads)."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest
import torch

from pdserve.kvcache.hashing import chain_key
from pdserve.kvcache.kv_cache import KVLayout
from pdserve.store import BlockLayout, BlockSizeError, KVBlockStore, block_keys, store_root_key
from pdserve.store.fileformat import HEADER_NBYTES
from pdserve.store.index import TMP_PREFIX, block_path

LAYOUT = BlockLayout(num_layers=2, block_size=4, bytes_per_token_layer=16, fingerprint="test|fp")
FILE_NBYTES = HEADER_NBYTES + LAYOUT.block_nbytes
TOKENS = list(range(100, 112))  # 3 full blocks
KEYS = block_keys(TOKENS, 4, LAYOUT.fingerprint)


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, LAYOUT.block_nbytes, dtype=np.uint8)


def make_store(path, capacity_blocks: int = 100, **kw) -> KVBlockStore:
    return KVBlockStore(path, LAYOUT, capacity_blocks * FILE_NBYTES, num_io_threads=2, **kw)


@pytest.fixture
def store(tmp_path):
    s = make_store(tmp_path)
    yield s
    s.check_integrity()
    s.close()


def read(store, keys):
    out = np.zeros((len(keys), LAYOUT.block_nbytes), dtype=np.uint8)
    return store.read_blocks(keys, out), out


def put_all(store, keys=KEYS):
    for i, k in enumerate(keys):
        assert store.put(k, payload(i))
        store.check_integrity()


# ---- layout and keys ---------------------------------------------------------------------------------
def test_layout_ranges_and_from_kv_layout():
    kv = KVLayout(3, 10, 16, 2, 8, "float16", 2)
    lay = BlockLayout.from_kv_layout(kv, block_size=64, model="m")
    assert lay.bytes_per_token_layer == 64 and lay.layer_nbytes == 4096 and lay.block_nbytes == 12288
    assert lay.layer_range(1) == (4096, 4096)
    assert lay.k_range(2) == (8192, 2048) and lay.v_range(2) == (10240, 2048)
    with pytest.raises(ValueError):
        BlockLayout.from_kv_layout(kv, block_size=40)
    with pytest.raises(IndexError):
        lay.layer_range(3)
    # the page size is not part of the fingerprint; the block size and the model are
    assert BlockLayout.from_kv_layout(KVLayout(3, 10, 32, 2, 8, "float16", 2), 64, "m") == lay
    assert BlockLayout.from_kv_layout(kv, 32, "m").fingerprint != lay.fingerprint
    assert BlockLayout.from_kv_layout(kv, 64, "other").fingerprint != lay.fingerprint


def test_block_keys_exact_and_chained():
    keys = block_keys(list(range(10)), 4, "test|fp")  # partial third block has no key
    assert [k.hex() for k in keys] == ["abc6149de455a85bb388d9ea0d5dd963", "391b1fd7811cdac6cf3e5adfcf870bea"]
    assert keys[0] == chain_key(store_root_key("test|fp"), [0, 1, 2, 3])
    assert keys[1] == chain_key(keys[0], [4, 5, 6, 7])
    assert block_keys(list(range(12)), 4, "test|fp")[:2] == keys
    assert block_keys(list(range(12)), 4, "test|fp", start_key=keys[1], start_block=2) == [
        block_keys(list(range(12)), 4, "test|fp")[2]
    ]
    other = block_keys(list(range(10)), 4, "test|fp2")
    assert not set(other) & set(keys)


# ---- lookup, round trip --------------------------------------------------------------------------
def test_lookup_prefixes(store):
    assert store.lookup(TOKENS) == 0
    put_all(store)
    assert store.lookup([]) == 0
    assert store.lookup(TOKENS[:3]) == 0  # partial block ignored
    assert store.lookup(TOKENS[:7]) == 1
    assert store.lookup(TOKENS) == 3
    assert store.lookup(TOKENS + [1, 2, 3, 4, 5]) == 3
    diverged = TOKENS[:5] + [777] + TOKENS[6:]  # differs inside block 1
    assert store.lookup(diverged) == 1
    missing_middle = [KEYS[0], b"\0" * 16, KEYS[2]]
    assert store.lookup_keys(missing_middle) == 1
    s = store.stats()
    assert s.num_blocks == 3 and s.used_bytes == 3 * FILE_NBYTES


def test_round_trip_all_input_kinds(store):
    inputs = [payload(0).tobytes(), memoryview(payload(1).tobytes()), payload(2)]
    for k, data in zip(KEYS, inputs, strict=True):
        assert store.put(k, data)
    extra = block_keys(list(range(16)), 4, LAYOUT.fingerprint)[3]
    assert store.put(extra, torch.from_numpy(payload(3)))
    keys = KEYS + [extra]
    res, out = read(store, keys)
    assert res.status == ["ok"] * 4 and res.num_prefix_ok == 4 and res.bytes_read == 4 * LAYOUT.block_nbytes
    for i in range(4):
        assert np.array_equal(out[i], payload(i))
    # per-block views (e.g. slots of a bigger host buffer), a torch destination, and the async form
    host = torch.zeros(8, LAYOUT.block_nbytes, dtype=torch.uint8)
    res = store.submit_read([keys[2], keys[0]], [host[5], host[1]]).result(timeout=10)
    assert res.ok == [True, True]
    assert np.array_equal(host[5].numpy(), payload(2)) and np.array_equal(host[1].numpy(), payload(0))
    assert store.put(KEYS[0], payload(0)) and store.stats().num_put_dedup == 1  # already stored
    with pytest.raises(BlockSizeError):
        store.put(KEYS[0], np.zeros(LAYOUT.block_nbytes - 1, np.uint8))
    res, _ = read(store, [b"\1" * 16])
    assert res.status == ["missing"] and res.num_missing == 1


# ---- eviction --------------------------------------------------------------------------------------
def test_stored_prefix_counts_leading_blocks_as_puts_of_blocks_already_there(tmp_path):
    """What write-back skips: the leading keys indexed, each counted as a dedup put and its chain marked
    used head last (as `put` with its ancestors would); a gap ends the prefix. `touch_files` (the
    writer's, off the engine thread) updates their mtimes and forgets one whose file another process
    removed."""
    s = make_store(tmp_path, capacity_blocks=4)
    assert s.stored_prefix(KEYS) == 0
    other = block_keys(list(range(200, 204)), 4, LAYOUT.fingerprint)[0]
    for i, key in enumerate(KEYS[:2]):
        assert s.put(key, payload(i))
    assert s.put(other, payload(9))  # written last: the most recently used
    assert s.stored_prefix(KEYS) == 2 and s.stats().num_put_dedup == 2
    assert s.stored_prefix([KEYS[0], KEYS[2], KEYS[1]]) == 1  # (a gap ends it)
    assert s.put(KEYS[2], payload(2))
    assert s.stored_prefix(KEYS) == 3
    # the chain was marked used after `other`, head last: room for two more blocks evicts `other`
    # first, then the chain's tail
    for i, key in enumerate(block_keys(list(range(300, 308)), 4, LAYOUT.fingerprint)):
        assert s.put(key, payload(20 + i))
    assert s.lookup_keys([other]) == 0 and s.lookup_keys(KEYS) == 2
    os.utime(block_path(s.dir, KEYS[1]), (1, 1))  # (an old file, as after days unused)
    os.remove(block_path(s.dir, KEYS[0]))  # (another process sharing the directory evicted it)
    assert s.stored_prefix(KEYS) == 2  # the index alone: no disk I/O on the engine thread
    assert os.stat(block_path(s.dir, KEYS[1])).st_mtime == 1
    assert s.touch_files(KEYS[:2]) == 1  # (the writer's part: mtimes, and a file gone is forgotten)
    assert os.stat(block_path(s.dir, KEYS[1])).st_mtime > time.time() - 60
    assert s.stored_prefix(KEYS) == 0 and s.lookup_keys(KEYS) == 0
    s.check_integrity()
    s.close()


def test_lru_eviction_order_exact(tmp_path):
    keys = block_keys(list(range(24)), 4, LAYOUT.fingerprint)  # 6 keys
    s = make_store(tmp_path, capacity_blocks=3)
    put_all(s, keys[:3])
    assert read(s, [keys[0]])[0].ok == [True]  # k0 becomes most recently used
    assert s.put(keys[3], payload(3))
    assert set(s.keys_lru_first()) == {keys[0], keys[2], keys[3]}  # k1 evicted (LRU)
    assert s.put(keys[4], payload(4))
    assert s.keys_lru_first() == [keys[0], keys[3], keys[4]]  # k2 evicted
    assert not s.path_for(keys[1]).exists() and not s.path_for(keys[2]).exists()
    assert s.stats().num_evictions == 2 and s.stats().used_bytes == 3 * FILE_NBYTES
    s.check_integrity()
    assert s.evict(keys=[keys[3]]) == [keys[3]]
    assert s.evict(num_bytes=1) == [keys[0]]
    assert s.keys_lru_first() == [keys[4]]
    s.check_integrity()
    tiny = KVBlockStore(tmp_path / "tiny", LAYOUT, FILE_NBYTES - 1)
    assert tiny.put(keys[5], payload(5)) is False and tiny.stats().num_write_failures == 1
    tiny.check_integrity()
    s.close()
    tiny.close()


def test_a_chain_written_back_or_read_is_evicted_tail_first(tmp_path):
    """Blocks are chained: block i is a hit only with blocks 0..i-1. Written back (and read) head first,
    plain LRU made a chain's head its oldest block and evicted it first: three blocks stayed on disk
    and none was usable (found by review). Write-back passes the ancestors; a read marks its chain
    used head last. Now the tail goes first and the chain keeps its prefix; and a put never makes room
    by evicting its own ancestors (it did: a chain longer than the store kept 2 blocks and an orphan)."""
    keys = block_keys(list(range(100, 116)), 4, LAYOUT.fingerprint)  # one 4-block chain
    s = make_store(tmp_path, capacity_blocks=3)
    for i, k in enumerate(keys[:3]):
        assert s.put(k, payload(i), ancestors=keys[:i])
        s.check_integrity()
    assert s.keys_lru_first() == [keys[2], keys[1], keys[0]]
    assert s.put(keys[3], payload(3), ancestors=keys[:3]) is False  # only its own chain to evict
    assert s.keys_lru_first() == [keys[2], keys[1], keys[0]] and s.lookup_keys(keys) == 3
    assert s.stats().num_write_failures == 1 and s.stats().num_evictions == 0
    other = block_keys(list(range(500, 504)), 4, LAYOUT.fingerprint)
    assert read(s, keys[:2])[0].num_prefix_ok == 2
    assert s.keys_lru_first() == [keys[2], keys[1], keys[0]]  # (read head first, marked head last)
    assert s.put(other[0], payload(9))
    assert s.keys_lru_first() == [keys[1], keys[0], other[0]]
    assert s.put(block_keys(list(range(600, 604)), 4, LAYOUT.fingerprint)[0], payload(8))
    assert s.lookup_keys(keys) == 1  # k1 (the tail) went before k0
    assert s.put(keys[2], payload(2), ancestors=keys[:2]) is False  # its parent k1 is gone
    assert s.stats().num_put_orphans == 1 and s.lookup_keys(keys) == 1
    s.check_integrity()
    s.close()


def test_a_lookup_never_evicts_the_prefix_it_counts(tmp_path):
    """A lookup counts the indexed head of a chain, then adopts the next blocks another process wrote;
    making room for them evicted LRU blocks, the counted head among them: 2 hits reported, 0 readable
    (found by review). The counted blocks are protected; what does not fit beside them is left out."""
    small, other_process = make_store(tmp_path, capacity_blocks=2), make_store(tmp_path)
    unrelated = block_keys(list(range(500, 504)), 4, LAYOUT.fingerprint)[0]
    assert small.put(KEYS[0], payload(0)) and small.put(unrelated, payload(9))  # k0 is the LRU one
    assert other_process.put(KEYS[1], payload(1)) and other_process.put(KEYS[2], payload(2))
    assert small.lookup_keys(KEYS) == 2  # k0, and k1 adopted (unrelated evicted); k2 does not fit
    assert read(small, KEYS[:2])[0].num_prefix_ok == 2
    assert small.keys_lru_first() == [KEYS[1], KEYS[0]] and small.stats().used_bytes == 2 * FILE_NBYTES
    assert other_process.path_for(KEYS[2]).exists()  # (not ours to remove, nor to count)
    small.close()
    other_process.close()


# ---- bad data --------------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [HEADER_NBYTES + 77, HEADER_NBYTES + LAYOUT.block_nbytes - 1, 40])
def test_flipped_byte_is_detected_and_removed(store, offset):
    put_all(store)
    path = store.path_for(KEYS[1])
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x10
    path.write_bytes(bytes(raw))
    res, out = read(store, KEYS)
    assert res.status == ["ok", "corrupt", "ok"] and res.num_corrupt == 1 and res.bad_indices == [1]
    assert res.num_prefix_ok == 1 and np.array_equal(out[2], payload(2))
    assert not path.exists() and store.lookup(TOKENS) == 1
    assert store.stats().num_corrupt == 1 and store.stats().num_blocks == 2
    store.check_integrity()


def test_truncated_and_missing_files(store):
    put_all(store)
    os.truncate(store.path_for(KEYS[0]), FILE_NBYTES - 10)
    os.unlink(store.path_for(KEYS[2]))
    res, _ = read(store, KEYS)
    assert res.status == ["truncated", "ok", "missing"]
    assert (res.num_corrupt, res.num_missing, res.num_prefix_ok) == (1, 1, 0)
    s = store.stats()
    assert (s.num_corrupt, s.num_missing, s.num_blocks) == (1, 1, 1)
    assert not store.path_for(KEYS[0]).exists() and store.lookup(TOKENS) == 0
    store.check_integrity()


def test_wrong_fingerprint_file(tmp_path, store):
    other_layout = BlockLayout(2, 4, 16, "other|fp")  # same sizes, different model
    other = KVBlockStore(tmp_path / "other", other_layout, 10 * FILE_NBYTES)
    assert other.put(KEYS[0], payload(0))
    put_all(store)
    os.replace(other.path_for(KEYS[0]), store.path_for(KEYS[0]))
    res, _ = read(store, KEYS)
    assert res.status == ["fingerprint", "ok", "ok"] and res.num_corrupt == 1
    assert store.lookup(TOKENS) == 0
    other.close()


# ---- atomicity, concurrency, restart --------------------------------------------------------------
def test_stale_temp_files_cleaned_at_restart(tmp_path):
    s = make_store(tmp_path)
    put_all(s)
    s.close()
    sub = s.path_for(KEYS[0]).parent
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = os.uname().nodename
    crashed = sub / f"{TMP_PREFIX}{host}-{dead.pid}-abc"  # a writer that died mid-put
    crashed.write_bytes(b"partial")
    old = sub / f"{TMP_PREFIX}elsewhere-1-def"  # another host's, older than stale_tmp_s
    old.write_bytes(b"partial")
    os.utime(old, (time.time() - 1000, time.time() - 1000))
    live = sub / f"{TMP_PREFIX}{host}-{os.getpid()}-0123"  # a live writer's: must be left alone
    live.write_bytes(b"partial")
    s2 = make_store(tmp_path)
    assert not crashed.exists() and not old.exists() and live.exists()
    assert s2.lookup(TOKENS) == 3 and s2.stats().num_blocks == 3
    live.unlink()
    s2.check_integrity()
    s2.close()


def test_concurrent_puts_of_one_key_threads(store):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as ex:
        assert all(ex.map(lambda _: store.put(KEYS[0], payload(0), overwrite=True), range(32)))
    files = [p for p in store.dir.rglob("*") if p.is_file()]
    assert [p.name for p in files] == [store.path_for(KEYS[0]).name]  # one file, no temp left
    res, out = read(store, KEYS[:1])
    assert res.ok == [True] and np.array_equal(out[0], payload(0))
    assert store.stats().used_bytes == FILE_NBYTES


def _put_many(path: str, n: int) -> int:
    s = make_store(path)
    ok = sum(s.put(KEYS[0], payload(0), overwrite=True) for _ in range(n))
    s.close()
    return ok


def test_concurrent_puts_of_one_key_processes(tmp_path):
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(2) as pool:
        assert pool.starmap(_put_many, [(str(tmp_path), 25)] * 2) == [25, 25]
    s = make_store(tmp_path)
    files = [p for p in s.dir.rglob("*") if p.is_file()]
    assert [p.name for p in files] == [s.path_for(KEYS[0]).name]
    res, out = read(s, KEYS[:1])
    assert res.ok == [True] and np.array_equal(out[0], payload(0))
    s.check_integrity()
    s.close()


def test_restart_recovery_and_lru(tmp_path):
    keys = block_keys(list(range(16)), 4, LAYOUT.fingerprint)
    s = make_store(tmp_path, capacity_blocks=4)
    put_all(s, keys)
    t = time.time() - 100
    for i, k in enumerate(keys):  # distinct, old mtimes: write order k0 < k1 < k2 < k3
        os.utime(s.path_for(k), (t + i, t + i))
    assert read(s, [keys[1]])[0].ok == [True]  # the read bumps k1's mtime to now
    time.sleep(0.01)
    assert s.put(keys[0], np.zeros(LAYOUT.block_nbytes, np.uint8))  # a re-put (dedup) is a use too
    assert s.keys_lru_first() == [keys[2], keys[3], keys[1], keys[0]]
    lookups = [s.lookup(list(range(n))) for n in range(0, 17, 3)]
    s.close()
    s2 = make_store(tmp_path, capacity_blocks=4)
    assert s2.keys_lru_first() == [keys[2], keys[3], keys[1], keys[0]]  # the order survives a restart
    assert [s2.lookup(list(range(n))) for n in range(0, 17, 3)] == lookups == [0, 0, 1, 2, 3, 3]
    s2.check_integrity()
    s2.close()
    s3 = make_store(tmp_path, capacity_blocks=2)  # smaller capacity: the two LRU blocks go
    assert s3.keys_lru_first() == [keys[1], keys[0]] and s3.stats().num_evictions == 2
    s3.check_integrity()
    s3.close()


def test_blocks_written_by_another_process_are_adopted(tmp_path):
    reader, writer = make_store(tmp_path), make_store(tmp_path)
    assert reader.lookup(TOKENS) == 0
    put_all(writer)
    assert reader.lookup(TOKENS) == 3  # one stat per key past the indexed prefix
    assert read(reader, KEYS)[0].num_ok == 3
    reader.check_integrity()
    writer.evict(keys=[KEYS[2]])  # evicted elsewhere: reads as missing here, then forgotten
    assert read(reader, KEYS)[0].status == ["ok", "ok", "missing"]
    reader.check_integrity()
    reader.close()
    writer.close()


@pytest.mark.parametrize("how", ["evicted", "rescanned smaller"])
def test_a_put_of_a_block_another_process_removed_stores_it_again(tmp_path, how):
    """`b` indexes blocks that another process sharing the directory then removes (its eviction, or
    its start-up rescan with a smaller capacity). b's next put of such a block must write it: it
    returned True without writing (its index said "there" and the failed touch was ignored), so a
    chain's block stayed missing while b's lookups counted it (found by a two-store state machine)."""
    b = make_store(tmp_path)
    put_all(b)
    if how == "evicted":
        other = make_store(tmp_path)
        assert other.lookup_keys(KEYS) == 3
        other.evict(keys=[KEYS[0]])
    else:
        other = make_store(tmp_path, capacity_blocks=1)  # rescan: keeps one block file
    gone = [k for k in KEYS if not b.path_for(k).exists()]
    assert gone
    for k in gone:
        assert b.put(k, payload(KEYS.index(k)))
    assert all(b.path_for(k).exists() for k in KEYS)
    assert read(b, KEYS)[0].status == ["ok"] * 3
    b.check_integrity()
    b.close()
    other.close()


def test_remove_files_deletes_this_layouts_directory_only_and_after_close(tmp_path):
    """The previous weights' store after an update: its directory goes, with blocks another process
    wrote; a store of another layout (other weights) beside it keeps its blocks; a process still
    sharing the removed directory reads its blocks as missing."""
    import dataclasses

    old, other_process = make_store(tmp_path), make_store(tmp_path)
    new = KVBlockStore(tmp_path, dataclasses.replace(LAYOUT, fingerprint="test|fp2"), 100 * FILE_NBYTES)
    put_all(old, KEYS[:2])
    other_process.put(KEYS[2], payload(2))  # (not in `old`'s index)
    new_keys = block_keys(TOKENS, 4, "test|fp2")
    put_all(new, new_keys)
    with pytest.raises(RuntimeError, match="closed store"):
        old.remove_files()  # (still open: it may be reading)
    assert old.dir.is_dir()
    old.close()
    assert old.remove_files() and not old.dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [new.dir.name]
    assert read(new, new_keys)[0].num_ok == 3
    assert read(other_process, KEYS)[0].status == ["missing"] * 3
    other_process.close()
    new.check_integrity()
    new.close()


# ---- write failures never raise --------------------------------------------------------------------
def test_disk_full_and_read_only_return_false(store, monkeypatch):
    put_all(store, KEYS[:1])

    def full(fd, bufs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(os, "writev", full)
        assert store.put(KEYS[1], payload(1)) is False
    real_open = os.open

    def read_only(path, flags, *a, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(30, "Read-only file system")
        return real_open(path, flags, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "open", read_only)
        assert store.put(KEYS[1], payload(1)) is False
    blocker = store.path_for(KEYS[2]).parent  # a file where the subdirectory must go: mkdir fails
    if not blocker.exists():
        blocker.write_bytes(b"")
        assert store.put(KEYS[2], payload(2)) is False
        blocker.unlink()
    assert store.stats().num_write_failures >= 2 and store.lookup(TOKENS) == 1
    assert not [p for p in store.dir.rglob(f"{TMP_PREFIX}*")]
    store.check_integrity()
    assert store.put(KEYS[1], payload(1))  # and it recovers once the disk does


def test_random_operations_keep_integrity(tmp_path):
    rng = np.random.default_rng(7)
    keys = block_keys(list(range(40)), 4, LAYOUT.fingerprint)
    s = make_store(tmp_path, capacity_blocks=4)
    model: list[bytes] = []  # expected LRU order
    for _ in range(120):
        op, k = rng.integers(0, 3), keys[rng.integers(0, len(keys))]
        if op == 0:
            assert s.put(k, payload(keys.index(k)))
            if k in model:
                model.remove(k)
            model.append(k)
            del model[:-4]
        elif op == 1:
            res, out = read(s, [k])
            assert res.ok == [k in model]
            if k in model:
                assert np.array_equal(out[0], payload(keys.index(k)))
                model.remove(k)
                model.append(k)
        else:
            assert s.lookup_keys([k]) == (k in model)
            if k in model:  # (a lookup hit is a use)
                model.remove(k)
                model.append(k)
        assert s.keys_lru_first() == model
        s.check_integrity()
    s.close()


# ---- a review of the store (2026-12-05) --------------------------------------------------------------
def test_a_put_that_adopts_another_processes_block_never_evicts_its_own_ancestors(tmp_path):
    """Store B (same directory) wrote a 6-block chain; A (4 blocks) writes back the same turn. A's puts
    adopt B's files, and the adoption made room from the chain itself: A's parent, just marked least
    recently used, was unlinked for both (B's lookup fell from 6 to 3), and A indexed a hole."""
    keys = block_keys(list(range(200, 224)), 4, LAYOUT.fingerprint)  # 6 blocks
    a, b = make_store(tmp_path, capacity_blocks=4), make_store(tmp_path)
    for i, k in enumerate(keys):
        assert b.put(k, payload(i), ancestors=keys[:i])
    assert [a.put(k, payload(i), ancestors=keys[:i]) for i, k in enumerate(keys)] == [True] * 4 + [False] * 2
    assert a.keys_lru_first() == keys[:4][::-1] and a.lookup_keys(keys) == 4
    assert all(a.path_for(k).exists() for k in keys) and b.lookup_keys(keys) == 6
    a.close()
    b.close()


def test_a_lookup_hit_counts_as_a_use(tmp_path):
    """A lookup left the blocks it counted least recently used: the next put (a write-back, or any put
    between the lookup and its read) evicted exactly them, and the read found them missing."""
    s = make_store(tmp_path, capacity_blocks=4)
    chain_a, chain_b = (block_keys(list(range(t, t + 8)), 4, LAYOUT.fingerprint) for t in (300, 400))
    for chain in (chain_a, chain_b):
        for i, k in enumerate(chain):
            assert s.put(k, payload(i), ancestors=chain[:i])
    assert s.lookup_keys(chain_a) == 2
    assert s.keys_lru_first() == [chain_b[1], chain_b[0], chain_a[1], chain_a[0]]
    assert s.put(block_keys([1, 2, 3, 4], 4, LAYOUT.fingerprint)[0], payload(7))
    assert read(s, chain_a)[0].num_prefix_ok == 2  # (chain B's tail went instead)
    s.check_integrity()
    s.close()


def test_a_block_file_that_cannot_be_stated_is_an_io_error_of_that_block(tmp_path, monkeypatch):
    """`fstat` failing after `open` (ESTALE on NFS: another client removed the file) raised out of the
    whole read, losing the good blocks, and leaked the descriptor."""
    import errno

    from pdserve.store import block_store

    s = make_store(tmp_path)
    put_all(s)
    bad_fd = []
    real_open, real_fstat = os.open, os.fstat

    def open_(path, *a, **k):
        fd = real_open(path, *a, **k)
        if str(path).endswith(KEYS[1].hex() + ".kvb"):
            bad_fd.append(fd)
        return fd

    def fstat_(fd):
        if fd in bad_fd:
            bad_fd.remove(fd)  # (the descriptor's number is reused by the next open)
            raise OSError(errno.ESTALE, "Stale file handle")
        return real_fstat(fd)

    monkeypatch.setattr(block_store.os, "open", open_)
    monkeypatch.setattr(block_store.os, "fstat", fstat_)
    before = len(os.listdir("/proc/self/fd"))
    assert read(s, KEYS)[0].status == ["ok", "ioerror", "ok"]
    assert len(os.listdir("/proc/self/fd")) == before
    s.close()


def test_a_block_written_with_an_old_stamp_is_not_a_stale_temp_file_while_written(tmp_path, monkeypatch):
    """A block's mtime is set just below its parent's (the chain's order on disk). It was set on the
    temp file before the rename: a parent an hour old made the temp file look an hour old, and another
    store opening the directory meanwhile (an engine start, a weight update back) deleted it: the put
    failed, and the chain's later blocks were refused as orphans."""
    from pdserve.store import block_store

    s = make_store(tmp_path)
    assert s.put(KEYS[0], payload(0))
    hour_ago_ns = time.time_ns() - 3600 * 10**9
    os.utime(s.path_for(KEYS[0]), ns=(hour_ago_ns, hour_ago_ns))
    real_replace = os.replace

    def open_another_store_then_rename(src, dst):  # (the temp file is written, not yet renamed)
        make_store(tmp_path).close()  # (its start-up scan deletes stale temp files)
        real_replace(src, dst)

    monkeypatch.setattr(block_store.os, "replace", open_another_store_then_rename)
    assert s.put(KEYS[1], payload(1), ancestors=KEYS[:1])
    assert (
        os.stat(s.path_for(KEYS[1])).st_mtime_ns == hour_ago_ns - 1
    )  # (the chain's order, after the rename)
    s.check_integrity()
    s.close()


def test_an_empty_key_is_refused_and_an_unlistable_directory_skipped(tmp_path, monkeypatch):
    """An empty key wrote `<dir>/.kvb`, outside the fan-out directories (check_integrity then failed);
    a fan-out directory another user's engine made unreadable (umask 077) raised PermissionError at
    the store's start (shown by the error itself: this test may run as root, whom modes do not stop)."""
    from pdserve.store import index

    s = make_store(tmp_path)
    with pytest.raises(ValueError, match="must not be empty"):
        s.put(b"", payload(0))
    put_all(s)
    s.close()
    unreadable = str(s.path_for(KEYS[0]).parent)
    real_scandir = index.os.scandir

    def scandir(path):
        if str(path) == unreadable:
            raise PermissionError(13, "Permission denied", path)
        return real_scandir(path)

    monkeypatch.setattr(index.os, "scandir", scandir)
    t = make_store(tmp_path)  # (raised PermissionError)
    assert KEYS[0] not in t.keys_lru_first()  # (its directory was not listed: its block not indexed)
    t.close()


def test_a_block_another_process_keeps_reading_is_not_this_ones_lru_victim(tmp_path):
    """Two stores on one directory (a decode writing back, a prefill reading on the PE path): the reads
    of the other only move the files' mtimes, and the writer evicted by its own index's order, the hot
    chain A first. Before evicting, it now compares the file's mtime with the one it last gave it."""
    writer, reader = make_store(tmp_path, capacity_blocks=4), make_store(tmp_path, capacity_blocks=4)
    chain_a, chain_b, chain_c = (
        block_keys(list(range(t, t + 8)), 4, LAYOUT.fingerprint) for t in (0, 100, 200)
    )
    for chain in (chain_a, chain_b):
        for i, k in enumerate(chain):
            assert writer.put(k, payload(i), ancestors=chain[:i])
    time.sleep(0.002)  # (the reader's stamps come after the writer's)
    assert reader.lookup_keys(chain_a) == 2 and read(reader, chain_a)[0].num_prefix_ok == 2
    for i, k in enumerate(chain_c):
        assert writer.put(k, payload(i), ancestors=chain_c[:i])
    assert [writer.path_for(k).exists() for k in chain_a + chain_b] == [True, True, False, False]
    assert read(reader, chain_a)[0].num_prefix_ok == 2
    assert writer.keys_lru_first() == [chain_a[1], chain_a[0], chain_c[1], chain_c[0]]
    writer.check_integrity()
    writer.close()
    reader.close()


def test_close_cancels_queued_reads_and_waits_for_running_ones_a_bounded_time(tmp_path, monkeypatch):
    """`close()` waited for every read without a limit: a hung disk held a weight update (which closes
    the old weights' store on the engine thread) or an engine's exit for as long as it hung."""
    from concurrent.futures import CancelledError

    from pdserve import faults
    from pdserve.store import block_store

    s = make_store(tmp_path)
    put_all(s)
    monkeypatch.setattr(block_store, "CLOSE_WAIT_S", 0.3)
    faults.configure([{"point": "store.read", "action": "slow", "delay_s": 2.0}])
    try:
        outs = [np.zeros((1, LAYOUT.block_nbytes), dtype=np.uint8) for _ in range(3)]
        reads = [s.submit_read(KEYS[i : i + 1], outs[i]) for i in range(3)]  # 2 store threads: 1 queued
        time.sleep(0.1)
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 1.5  # (was the slow reads' 2 s and then the queued one's 2 s)
        assert reads[2].cancelled()
        with pytest.raises(CancelledError):
            reads[2].result()
        assert [r.result(timeout=10).status for r in reads[:2]] == [["ok"], ["ok"]]  # (left to finish)
    finally:
        faults.configure([])
