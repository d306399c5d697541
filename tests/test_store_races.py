"""The persistent KV store under what shares its directory or its disk: a read-only mount, another
engine's eviction or `remove_files` racing this one, and the write-back thread's end. Each test failed
before its fix (a review of the store, 2026-12-02, sixth session)."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import types

import numpy as np
import pytest
import torch

from tests.test_store import KEYS, LAYOUT, make_store, payload


def _nixl_available() -> bool:
    try:
        from pdserve.transfer.nixl_backend import import_nixl

        import_nixl()
        return True
    except Exception:  # noqa: BLE001
        return False


# ---- 1. a read-only (or not-owned) store directory serves nothing ---------------------------------
@pytest.mark.parametrize(
    "backend",
    ["preadv", pytest.param("nixl", marks=pytest.mark.skipif(not _nixl_available(), reason="no NIXL"))],
)
def test_read_only_store_still_serves_its_blocks(tmp_path, monkeypatch, backend):
    """KVBlockStore.__init__ promises "read-only root: the store still serves whatever exists", and put
    treats a failed touch as harmless. But the read paths bump the file's mtime with os.utime(fd) after
    verifying the block (touch_on_read, the default), and on a read-only mount (EROFS) -- or for a file
    owned by another user (EACCES/EPERM) -- that raises: preadv turns a verified, byte-exact block into
    "ioerror" (every read of every block fails, forever: "ioerror" keeps the index entry, so every
    lookup keeps promising the hit); the NIXL path lets the OSError escape and fails the whole read.
    Confirmed on a real `mount -o remount,ro,bind` (unshare -m); simulated here by os.utime raising
    EROFS, as the kernel does on such a mount."""
    with make_store(tmp_path) as w:
        for i, k in enumerate(KEYS):
            assert w.put(k, payload(i))
    real_utime = os.utime

    def read_only_utime(target, *a, **kw):
        raise OSError(errno.EROFS, "Read-only file system")

    s = make_store(tmp_path, io_backend=backend)
    try:
        assert s.lookup_keys(KEYS) == 3
        out = np.zeros((3, LAYOUT.block_nbytes), dtype=np.uint8)
        with monkeypatch.context() as m:
            m.setattr(os, "utime", read_only_utime)
            result = s.read_blocks(KEYS, out)
        assert result.status == ["ok"] * 3, result.status
        for i in range(3):
            assert np.array_equal(out[i], payload(i))
    finally:
        os.utime = real_utime
        s.close()


# ---- 2. a read that finds a block missing un-indexes a block a concurrent put just stored ----------
def test_missing_read_does_not_unindex_a_block_stored_meanwhile(tmp_path):
    """Interleaving (deterministic here): this process's index lists K, another process sharing the
    directory evicted K's file; a read of K opens nothing ("missing"); before the reader's `_settle`
    takes the lock, this process's write-back thread puts K again (dedup path: touch fails -> the
    block is written, renamed and indexed under the lock). `_settle("missing")` then removes K from
    the index unconditionally, although its file is on disk. Result: an unindexed file that this
    process never counts against capacity nor evicts (disk over capacity), and index != disk.
    `_settle` for "ioerror"/BAD statuses re-checks the path; "missing" does not (block_store.py
    `_settle`, the `else` branch)."""
    s = make_store(tmp_path, capacity_blocks=1)
    other = make_store(tmp_path, capacity_blocks=1)
    try:
        assert s.put(KEYS[0], payload(0))
        assert other.lookup_keys(KEYS[:1]) == 1
        other.evict(keys=[KEYS[0]])  # evicted by the other process: s's index still lists it
        assert not s.path_for(KEYS[0]).exists()

        real_open = s._open

        def open_then_concurrent_put(key):
            res = real_open(key)
            if res[2] == "missing" and key == KEYS[0]:
                assert s.put(KEYS[0], payload(0))  # the writer thread lands here, before _settle
            return res

        s._open = open_then_concurrent_put
        out = np.zeros((1, LAYOUT.block_nbytes), dtype=np.uint8)
        assert s.read_blocks(KEYS[:1], out).status == ["missing"]
        s._open = real_open
        assert s.path_for(KEYS[0]).exists()  # the block is on disk ...
        assert s.put(KEYS[1], payload(1))  # ... and the next put (capacity 1 block) must evict it
        on_disk = [p for p in s.dir.rglob("*.kvb")]
        assert len(on_disk) <= 1, f"{len(on_disk)} block files on disk, capacity 1 block"
        s.check_integrity()
    finally:
        s.close()
        other.close()


# ---- 3. opening a store while another process removes the directory: FileNotFoundError ------------
def test_store_open_survives_a_concurrent_remove_files(tmp_path, monkeypatch):
    """`scan_block_files` (index.py) tolerates a file vanishing between scandir and stat, but not a
    fan-out subdirectory vanishing between the root listing and `os.scandir(sub.path)` (or the root
    itself after `is_dir()`): another engine's `remove_files()` (weight update) running while this
    one opens / rescans the same directory makes `KVBlockStore(...)` raise FileNotFoundError --
    at start-up that kills the engine (PDContext.__init__ -> _open_store), in on_new_weights it
    drops the store for the engine's lifetime."""
    with make_store(tmp_path) as w:
        for i, k in enumerate(KEYS):
            assert w.put(k, payload(i))
    store_dir = w.dir
    real_scandir = os.scandir

    raced = []

    def scandir_racing_rmtree(path=".", *a):
        if (
            not raced
            and isinstance(path, str | os.PathLike)
            and os.path.dirname(os.fspath(path)) == os.fspath(store_dir)
        ):
            raced.append(path)  # a fan-out subdirectory: the other engine's remove_files() wins the race
            with monkeypatch.context() as inner:
                inner.setattr(os, "scandir", real_scandir)
                shutil.rmtree(store_dir, ignore_errors=True)
        return real_scandir(path, *a)

    with monkeypatch.context() as m:
        m.setattr(os, "scandir", scandir_racing_rmtree)
        s = make_store(tmp_path)  # must not raise: a vanished directory is an empty store
    assert raced
    try:
        assert s.lookup_keys(KEYS) == 0
        assert s.put(KEYS[0], payload(0)) in (True, False)  # (never raises)
    finally:
        s.close()


# ---- 4. the write-back thread outlives PDContext.close (keeps the engine and its KV pool alive) ----
def test_pd_context_close_stops_the_store_writer_thread(tmp_path):
    """StoreConnector starts a daemon "kvstore-writer" thread per connector and nothing ever stops it:
    PDContext.close() flushes and closes the KVBlockStore but the thread stays blocked in
    `_writes.get()` forever, holding the connector -> engine -> runner.kv_cache (the whole KV pool,
    GPU memory on CUDA) and the closed store. Each PDContext built and closed in one process (tests,
    an embedding app) leaks one thread and one KV pool; so does on_new_weights' "serving without a
    store" path (role.store = None)."""
    from pdserve.engine.store_connector import StoreConnector
    from pdserve.server.pd_context import PDContext

    page_size = 4
    k = [torch.zeros(8, page_size, 2, 2, dtype=torch.uint8) for _ in range(LAYOUT.num_layers)]
    engine = types.SimpleNamespace(
        kv=types.SimpleNamespace(page_size=page_size),
        runner=types.SimpleNamespace(kv_cache=types.SimpleNamespace(k=k, v=[t.clone() for t in k])),
    )
    store = make_store(tmp_path)
    connector = StoreConnector(engine, store)
    writer = connector._writer
    assert writer.is_alive()

    ctx = object.__new__(PDContext)
    closed = []
    ctx.store = store
    ctx.role = types.SimpleNamespace(store=connector)
    ctx.agent = types.SimpleNamespace(close=lambda: closed.append("agent"))
    ctx.control = types.SimpleNamespace(close=lambda: closed.append("control"))
    ctx.traffic = None
    ctx.bootstrap = None
    ctx.close()
    assert closed == ["agent", "control"]
    writer.join(timeout=5)
    assert not writer.is_alive(), "kvstore-writer thread still running after PDContext.close()"
    assert not [t for t in threading.enumerate() if t is writer]
