"""A chain of blocks in the store stays usable: no block is written past a missing one, a put never
evicts its own ancestors, and a restart (which orders eviction by file mtimes) still takes a chain's
tail first. Each test failed before its fix (a review of the store, 2026-12-04)."""

from __future__ import annotations

import os
import threading
import time
import types

import torch

from pdserve import faults
from pdserve.engine.store_connector import StoreConnector
from pdserve.store import KVBlockStore, block_keys
from pdserve.store.index import TMP_PREFIX, scan_block_files
from tests.test_store import FILE_NBYTES, LAYOUT, payload, read


def _chain(seed: int, num_blocks: int) -> list[bytes]:
    return block_keys([seed * 1000 + i for i in range(4 * num_blocks)], 4, LAYOUT.fingerprint)


def _connector(tmp_path):
    """A write-back connector over a 64-page uint8 pool of LAYOUT's shape (page_size 4 = block_size)."""
    k = [torch.randint(0, 255, (64, 4, 2, 4), dtype=torch.uint8) for _ in range(LAYOUT.num_layers)]
    pool = types.SimpleNamespace(k=k, v=[t.clone() for t in k])
    engine = types.SimpleNamespace(
        kv=types.SimpleNamespace(page_size=4), runner=types.SimpleNamespace(kv_cache=pool)
    )
    store = KVBlockStore(tmp_path, LAYOUT, 1 << 30)
    return store, StoreConnector(engine, store)


def _request(num_tokens: int, num_computed: int):
    return types.SimpleNamespace(
        all_token_ids=[5000 + i for i in range(num_tokens)],
        block_key_cache=[],
        cache_salt=None,
        num_blocks_persisted=0,
        page_ids=list(range(num_tokens // 4)),
        num_computed_tokens=num_computed,
    )


def test_a_restart_still_evicts_a_chain_tail_first(tmp_path):
    """The rescan orders eviction by mtime. The head, written first, was the oldest file (and equal
    mtimes were ordered by key bytes): the first eviction after a restart took chain A's head and left
    its 3 other blocks unreachable. A put now stamps its block just below its parent's mtime."""
    s = KVBlockStore(tmp_path, LAYOUT, 8 * FILE_NBYTES)
    a, b, c = _chain(1, 4), _chain(2, 4), _chain(3, 1)
    for keys in (a, b):
        for i, k in enumerate(keys):
            assert s.put(k, payload(i), ancestors=keys[:i])
    mtimes = [os.stat(s.path_for(k)).st_mtime_ns for k in a]
    assert mtimes == sorted(mtimes, reverse=True) and len(set(mtimes)) == 4  # head newest, no ties
    s.close()
    s = KVBlockStore(tmp_path, LAYOUT, 8 * FILE_NBYTES)
    assert s.keys_lru_first()[:4] == a[::-1]
    assert s.put(c[0], payload(9))  # one eviction: A's tail
    assert s.lookup_keys(a) == 3 and s.lookup_keys(b) == 4
    s.check_integrity()
    s.close()


def test_reads_and_write_back_touches_stamp_the_head_newest(tmp_path):
    """Blocks are read in parallel and each was touched with its own "now" (often equal): their order
    on disk was random. A read, and the write-back's touch of a stored prefix, now stamp the head
    newest and each later block 1 ns older, so a restart keeps the used chain and its prefix."""
    s = KVBlockStore(tmp_path, LAYOUT, 8 * FILE_NBYTES)
    a, b = _chain(1, 4), _chain(2, 4)
    for keys in (a, b):
        for i, k in enumerate(keys):
            assert s.put(k, payload(i), ancestors=keys[:i])
    time.sleep(0.002)
    assert read(s, a)[0].num_prefix_ok == 4  # A is now newer than B
    stamps = [os.stat(s.path_for(k)).st_mtime_ns for k in a]
    assert [x - stamps[0] for x in stamps] == [0, -1, -2, -3]
    assert s.touch_files(b[:2]) == 2  # the write-back's touch of B's stored prefix: B newest again
    stamps_b = [os.stat(s.path_for(k)).st_mtime_ns for k in b]
    assert stamps_b[1] == stamps_b[0] - 1 and stamps_b[0] > stamps[0]
    s.close()
    blocks, _, _ = scan_block_files(s.dir, FILE_NBYTES)
    assert [k for k, _, _ in blocks] == [b[3], b[2], a[3], a[2], a[1], a[0], b[1], b[0]]


def test_a_put_never_evicts_its_own_ancestors(tmp_path):
    """Only the key being written was protected, and after `_chain_used` its parent was the chain's
    least recently used block: a chain of 8 into a store of 4 evicted its own parent at every put past
    capacity, ending with a 3-block prefix and an unreachable orphan. Now the extra blocks are
    refused and the store keeps the first 4."""
    s = KVBlockStore(tmp_path, LAYOUT, 4 * FILE_NBYTES)
    keys = _chain(4, 8)
    stored = [s.put(k, payload(i), ancestors=keys[:i]) for i, k in enumerate(keys)]
    assert stored == [True] * 4 + [False] * 4
    assert s.lookup_keys(keys) == 4 and s.stats().num_evictions == 0
    s.check_integrity()
    s.close()


def test_write_back_never_writes_blocks_after_a_hole(tmp_path):
    """One block's write failed (a full disk) and the writer went on with the rest of its chain: files
    that took room and could never be found. The store now refuses a block whose parent it lacks."""
    store, c = _connector(tmp_path)
    faults.configure([{"point": "store.write", "action": "full", "skip": 1, "count": 1}])
    try:
        req = _request(32, 32)
        assert c.persist(req) == 8
        assert c.flush()
    finally:
        faults.configure([])
    assert store.lookup_keys(c.keys_for(req, 8)) == 1 and store.stats().num_blocks == 1
    assert store.stats().num_put_orphans == 6 and c.num_write_failures == 7
    store.check_integrity()
    c.close()
    store.close()


def test_write_back_with_a_full_queue_leaves_no_hole(tmp_path):
    """The blocks the writer's queue had no room for were marked persisted anyway: the next call wrote
    the blocks after them, unreachable. They now wait for the next call (the request's pages hold them),
    and the final call counts what is still left as write failures."""
    store, c = _connector(tmp_path)
    gate = threading.Event()
    real_put = store.put
    store.put = lambda *a, **kw: (gate.wait(), real_put(*a, **kw))[1]  # a disk that is behind
    c._writes.maxsize = 3
    req = _request(32, 16)  # 4 full blocks; the queue takes 3
    assert c.persist(req) == 3 and req.num_blocks_persisted == 3
    gate.set()
    assert c.flush()
    req.num_computed_tokens = 32
    assert c.persist(req) == 3 and req.num_blocks_persisted == 6  # block 3 first, then 4 and 5
    assert c.persist(req, final=True) == 0 and c.num_write_failures == 2  # 6, 7: no room, pages go
    assert c.flush()
    assert store.stats().num_blocks == store.lookup_keys(c.keys_for(req, 8)) == 6
    c.close()
    store.close()


def test_an_overwrite_put_respects_capacity(tmp_path):
    """An overwrite reserved no room (the key was there), but the key could be evicted while its file
    was written, and the rename then added a block nobody made room for: 4 blocks in a store of 3."""
    s = KVBlockStore(tmp_path, LAYOUT, 3 * FILE_NBYTES)
    keys = _chain(5, 4)
    for i in range(3):
        assert s.put(keys[i], payload(i))
    writing, go = threading.Event(), threading.Event()
    real_write_all = KVBlockStore._write_all

    def slow_write_all(fd, bufs):
        if threading.current_thread().name == "overwriter":
            writing.set()
            go.wait()
        real_write_all(fd, bufs)

    s._write_all = slow_write_all
    t = threading.Thread(
        target=s.put, args=(keys[0], payload(0)), kwargs={"overwrite": True}, name="overwriter"
    )
    t.start()
    assert writing.wait(5)
    s.put(keys[3], payload(3))
    go.set()
    t.join()
    s.check_integrity()
    s.close()


def test_a_dead_writers_temp_file_under_our_reused_pid_is_stale(tmp_path):
    """A container restart reuses pids: a crashed writer's temp file named with our pid looked alive
    (ours), and the rescan kept it until the next restart. One older than this process's store code
    is stale; one of ours written since is not."""
    s = KVBlockStore(tmp_path, LAYOUT, 8 * FILE_NBYTES)
    sub = s.dir / "ab"
    sub.mkdir()
    host = os.uname().nodename
    old = sub / f"{TMP_PREFIX}{host}-{os.getpid()}-aaa"
    new = sub / f"{TMP_PREFIX}{host}-{os.getpid()}-bbb"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    past = time.time() - 3600
    os.utime(old, (past, past))
    s.rescan()
    assert not old.exists() and new.exists()
    new.unlink()
    s.close()


def test_a_short_read_is_read_on_not_taken_for_a_truncated_file(tmp_path, monkeypatch):
    """NFS may return fewer bytes than asked before the end of a file: one `preadv` read that as
    "truncated", and the good block was deleted. The read goes on until the views are full."""
    s = KVBlockStore(tmp_path, LAYOUT, 8 * FILE_NBYTES)
    keys = _chain(6, 2)
    for i, k in enumerate(keys):
        assert s.put(k, payload(i), ancestors=keys[:i])
    real_preadv = os.preadv

    def short_preadv(fd, buffers, offset):  # at most 1,000 bytes per call
        budget, capped = 1000, []
        for b in buffers:
            if budget <= 0:
                break
            view = memoryview(b).cast("B")
            capped.append(view[:budget])
            budget -= len(capped[-1])
        return real_preadv(fd, capped, offset)

    monkeypatch.setattr(os, "preadv", short_preadv)
    result, buf = read(s, keys)
    assert result.num_prefix_ok == 2 and s.lookup_keys(keys) == 2
    assert all(bytes(buf[i]) == bytes(payload(i)) for i in range(2))
    s.close()
