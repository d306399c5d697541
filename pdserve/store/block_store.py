"""`KVBlockStore`: the persistent KV store -- a directory of full blocks, one file per block.

Who calls what, when:
- the decode engine's write-back calls `put(key, block_bytes)` as each block fills (off the critical
  path); `put` never raises for I/O trouble: a read-only or full disk returns False and is counted;
- the engines' `StoreConnector.lookup` calls `lookup_keys(keys)` (`lookup(token_ids)` is for tests
  and tools) to learn how many leading full blocks are stored; the router never reads the store (it
  estimates hits itself, `router/prompts.PrefixIndex`);
- the PE or DE read path calls `submit_read(keys, host_buffer)` (a Future; the engine thread never
  blocks on disk) or `read_blocks` (blocking) and recomputes every token of a block the `ReadResult`
  marks bad; bad files are removed and counted, so the next lookup no longer reports them.

Layout on disk: `<root_dir>/<fingerprint hash>/<key[0] hex>/<key hex>.kvb`, each a 4 KiB header
(`fileformat.py`: magic, version, fingerprint, key, payload length, checksum) + the payload. Writes are
atomic: temp file in the same directory, optional fsync, `os.replace`; concurrent writers of one key
write identical bytes and the last rename wins, so a reader never sees a torn file. Several processes
may share the directory: `lookup_keys` adopts blocks other processes wrote (one `stat` past the indexed
prefix), a block another process evicted reads as "missing". Each process enforces `capacity_bytes` on
its own view of the directory.

I/O paths (`io_backend`): "preadv" -- a thread pool; per block one `open`, `fstat`, ONE `os.preadv`
of header + payload straight into the caller's buffer, checksum in the same thread (numpy and preadv
release the GIL). "nixl" -- NIXL's POSIX backend moves all blocks of a call in one transfer, then the
pool verifies. "auto" = "preadv". Measured (docs/bench_store.md, 2-core VM, 4 and 16 MiB blocks): the
two are within run-to-run noise of each other, warm (3.1-3.9 GB/s) and cold (0.9-1.5 GB/s) -- both end
in the same kernel page-cache copy, and the checksum, not the read call, is what costs. preadv wins the
tie because it needs no optional native dependency, reports a short read per block (a NIXL transfer
fails as a whole and must be redone with preadv to find the bad block) and parallelises the copy over
the pool, where the NIXL transfer advances on one polling thread. NIXL stays selectable for backends only
it reaches (GDS, O_DIRECT with io_uring/aio, which the notes measure ~2x faster for small cold reads).

Length (~600 lines): the index, eviction and the read and write paths share one lock and one view of
the directory; the file format, keys and index structure are their own modules.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from pathlib import Path

import numpy as np

from pdserve import faults
from pdserve.store.fileformat import (
    HEADER_NBYTES,
    BlockFormatError,
    _as_u8,
    check_header,
    decode_header,
    encode_header,
    payload_checksum,
)
from pdserve.store.index import BlockIndex, block_path, scan_block_files, tmp_path
from pdserve.store.keys import block_keys
from pdserve.store.layout import BlockLayout
from pdserve.store.results import BAD_STATUSES, BlockSizeError, ReadResult, StoreStats, block_views

log = logging.getLogger(__name__)


# Blocks another process used since this one last saw them are spared by an eviction (made most
# recently used here) at most this many times per eviction: one stat each, under the store's lock.
MAX_SPARED_PER_EVICTION = 64
# `close()` waits this long for reads already running (a hung disk must not hold a weight update or an
# engine's exit); reads still queued are cancelled at once.
CLOSE_WAIT_S = 10.0


class KVBlockStore:
    def __init__(
        self,
        root_dir: str | os.PathLike,
        layout: BlockLayout,
        capacity_bytes: int,
        num_io_threads: int = 4,
        io_backend: str = "auto",
        checksum: str = "psum64",
        fsync: bool = False,
        touch_on_read: bool = True,
        stale_tmp_s: float = 300.0,
    ) -> None:
        if io_backend not in ("auto", "preadv", "nixl"):
            raise ValueError(f"io_backend must be auto, preadv or nixl, not {io_backend!r}")
        self.layout = layout
        self.capacity_bytes = int(capacity_bytes)
        self.file_nbytes = HEADER_NBYTES + layout.block_nbytes
        self.checksum = checksum
        self.fsync = fsync
        self.touch_on_read = touch_on_read
        fp_hash = hashlib.blake2b(layout.fingerprint.encode(), digest_size=8).hexdigest()
        self.dir = Path(root_dir) / fp_hash  # one subdirectory per layout: stores of many models coexist
        self.io_backend = "preadv" if io_backend == "auto" else io_backend
        self._nixl = None
        if self.io_backend == "nixl":
            from pdserve.store.nixl_io import NixlPosixReader  # lazy: optional

            self._nixl = NixlPosixReader()
        self._lock = threading.Lock()  # guards _index, _reserved_bytes, _stats, renames and unlinks
        self._index = BlockIndex()
        self._reserved_bytes = 0  # room made for puts in flight (so parallel puts respect capacity)
        self._stats = StoreStats(0, self.capacity_bytes, 0)
        self._io_pool = ThreadPoolExecutor(max(1, num_io_threads), thread_name_prefix="kvstore-io")
        self._submit_pool = ThreadPoolExecutor(2, thread_name_prefix="kvstore-read")
        self._reads: set[Future] = set()  # submitted, not done (`close` waits for the running ones)
        # Node emulation (pdserve.netem.TrafficManager), set by the engine: reads and writes first
        # cross the node's emulated storage NIC (KV class). None: no emulation, no cost.
        self.traffic = None
        self._closed = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # read-only root: the store still serves whatever exists
            log.warning("kv store: cannot create %s: %s", self.dir, e)
        self.rescan(stale_tmp_s)

    # ---- index maintenance -------------------------------------------------------------------------
    def rescan(self, stale_tmp_s: float = 300.0) -> None:
        """Rebuild the index from the directory (startup; or after another process changed a lot).

        Removes stale temp files (crashed writers) and block files of the wrong size (counted corrupt);
        LRU order = file mtimes; then evicts down to capacity.
        """
        blocks, stale, wrong_size = scan_block_files(self.dir, self.file_nbytes, stale_tmp_s)
        for path in stale + wrong_size:
            self._unlink_quiet(path)
        with self._lock:
            self._index = BlockIndex()
            for key, nbytes, mtime_ns in blocks:
                self._index.add(key, nbytes)
                self._index.note_mtime(key, mtime_ns)
            self._stats.num_corrupt += len(wrong_size)
            self._make_room_locked(0, protect=())

    def _unlink_quiet(self, path: Path) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    def _make_room_locked(self, need_bytes: int, protect) -> bool:
        """Evict LRU blocks until `need_bytes` more fit under capacity. Caller holds the lock."""
        over = self._index.used_bytes + self._reserved_bytes + need_bytes - self.capacity_bytes
        if over <= 0:
            return True
        spared: set[bytes] = set()  # (each block is looked at once per call)
        while over > 0:
            victims = self._index.victims(over, [*protect, *spared])
            if not victims:
                break
            for key in victims:
                if len(spared) < MAX_SPARED_PER_EVICTION and self._used_elsewhere(key):
                    self._index.touch(key)  # another process used it since: most recently used here
                    spared.add(key)
                    continue
                self._unlink_quiet(block_path(self.dir, key))
                over -= self._index.remove(key)
                self._stats.num_evictions += 1
        return self._index.used_bytes + self._reserved_bytes + need_bytes <= self.capacity_bytes

    def _used_elsewhere(self, key: bytes) -> bool:
        """Whether another process sharing the directory touched `key`'s file since this one last set
        or saw its mtime (a read there moves only the file's mtime, not this index's order). One stat.
        Caller holds the lock."""
        known = self._index.known_mtime(key)
        if known is None:
            return False
        try:
            mtime_ns = os.stat(block_path(self.dir, key)).st_mtime_ns
        except OSError:
            return False
        if mtime_ns <= known:
            return False
        self._index.note_mtime(key, mtime_ns)
        return True

    def path_for(self, key: bytes) -> Path:
        return block_path(self.dir, key)

    # ---- writes ------------------------------------------------------------------------------------
    def put(self, key: bytes, data, overwrite: bool = False, ancestors: Sequence[bytes] = ()) -> bool:
        """Persist block `key` (payload `layout.block_nbytes` bytes: bytes/memoryview/ndarray/CPU tensor).

        True if the block is stored afterwards (written now, or already there). False if it could not be
        written (full or read-only disk, capacity smaller than one block): counted, never raised. Raises
        BlockSizeError for a wrong-size payload, ValueError for an empty key. Thread-safe; blocks the caller for the write.
        `ancestors`: the keys before `key` in its chain, head first (write-back passes them):
        * the block is written only if the one before it is stored: keys are chained, so a block past a
          missing one is never found by a lookup -- written, it only took room (a write-back that lost
          a block to a full disk or queue used to go on writing the rest of the chain);
        * room is never made by evicting them (a chain longer than the store used to evict its own
          parent at every put, leaving a 3-block prefix and an orphan);
        * they are marked used after it, the head last, so that eviction takes a chain's tail first
          (`_chain_used`), and the new file's mtime is set just below its parent's, so that a restart,
          which orders eviction by mtime, takes the tail first too (`_stamp_ns`).
        """
        arr = _as_u8(data)
        if arr.size != self.layout.block_nbytes:
            raise BlockSizeError(
                f"block payload is {arr.size} bytes, layout needs {self.layout.block_nbytes}"
            )
        if not key:  # (an empty key named `<dir>/.kvb`, outside the fan-out directories the scan reads)
            raise ValueError("a block key must not be empty")
        parent = ancestors[-1] if ancestors else None
        if parent is not None and not self._is_stored(parent, protect=ancestors[:-1]):
            with self._lock:
                self._stats.num_put_orphans += 1
            return False
        stored = self._put(key, arr, overwrite, (key, *ancestors), self._stamp_ns(parent))
        if stored and parent is not None:
            with self._lock:
                self._chain_used(ancestors)
        return stored

    def _is_stored(self, key: bytes, protect: Sequence[bytes] = ()) -> bool:
        """In this process's index, or written by another process sharing the directory (adopted, making
        room never from `protect`: the chain's blocks before `key`)."""
        with self._lock:
            if key in self._index:
                return True
        return self._adopt([key], protect=protect) == 1

    def _stamp_ns(self, parent: bytes | None) -> int:
        """The mtime a block's file gets when it is put: now, in ns, or 1 ns below its parent's if that is
        older. On disk too a chain's blocks then get older from head to tail, so the rescan at a restart
        (LRU = mtime order) evicts a chain tail first, as this process's index does. Before, the head was
        the oldest file (written first) and the first eviction after a restart left the rest of its chain
        unreachable. (The kernel stamps a new file with a clock of a few ms: files written in a row got
        equal mtimes, ordered by key bytes.) One stat with a parent."""
        t_ns = time.time_ns()
        if parent is not None:
            with contextlib.suppress(OSError):
                t_ns = min(t_ns, os.stat(block_path(self.dir, parent)).st_mtime_ns - 1)
        return t_ns

    def stored_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` this process's index holds, for a write-back that then skips them
        (never gathers nor copies them). Index only, under one lock: no disk I/O, as the engine thread
        calls it and the store may be on NFS, and no window in which a counted block is evicted. Each
        counts as a `put` of a block already there (`num_put_dedup`) and the chain is marked used head
        last, as `put`'s `ancestors` do. Their files' mtimes (recency across a restart) are the
        writer's to touch (`touch_files`). Blocks another process wrote end the prefix (`put`, which
        adopts them, is what the write-back then does)."""
        with self._lock:
            n = self._index.longest_prefix(keys)
            self._chain_used(keys[:n])
            self._stats.num_put_dedup += n
        return n

    def touch_files(self, keys: Sequence[bytes]) -> int:
        """Mark the files of `keys` (a chain's, head first) used: their mtimes, which order eviction
        after a restart, are set to now for the head and 1 ns older per block after it (`_stamp_ns`'s
        order). The write-back writer does it for the blocks `stored_prefix` counted. A key whose file
        is gone (another process sharing the directory evicted it) is forgotten, as `put` and reads do:
        its chain is a miss from there, and the turn that recomputes it writes it back. Returns how many
        were touched."""
        touched = 0
        now_ns = time.time_ns()
        for i, key in enumerate(keys):
            path = block_path(self.dir, key)
            try:
                self._stamp(path, key, now_ns - i)
            except FileNotFoundError:
                with self._lock:
                    if not path.exists():
                        self._index.remove(key)
                continue
            except OSError:  # (no permission to touch it, ...: it is there)
                pass
            touched += 1
        return touched

    def _chain_used(self, keys: Sequence[bytes]) -> None:
        """Mark a chain's `keys` (head first) used, the head last: the head becomes the most recently
        used. Blocks are chained, so a block is a hit only with every block before it: evicting a
        chain's head first (plain LRU, as blocks are written and read head first) left the rest on
        disk, taking room and never read again; taken tail first, a chain keeps a usable prefix (as
        the page pool frees a request's tail first). Index only (no file times: O(len) syscalls per
        block written would grow with the context). Caller holds the lock."""
        for key in reversed(keys):
            self._index.touch(key)

    def _put(
        self, key: bytes, arr: np.ndarray, overwrite: bool, protect: Sequence[bytes], stamp_ns: int
    ) -> bool:
        """(`put` past its checks: `protect`, the keys room is never made from; `stamp_ns`, its file's
        mtime, set whether it is written now or was there already)"""
        path = block_path(self.dir, key)
        with self._lock:
            if key in self._index and not overwrite:
                self._index.touch(key)
                self._stats.num_put_dedup += 1
                dedup = True
            else:
                dedup = False
        if dedup:
            # Recency lives in the file's mtime too (as on a read), so a restart keeps this use.
            try:
                self._stamp(path, key, stamp_ns)
                return True
            except FileNotFoundError:
                # Indexed but gone: another process sharing the directory evicted it (or a rescan of
                # one started with a smaller capacity). Forget it (unless this process stored it again
                # meanwhile: rename and index go together under the lock) and store it below, as
                # promised; returning True here left a chain's block missing while lookups counted it.
                with self._lock:
                    self._stats.num_put_dedup -= 1
                    if not path.exists():
                        self._index.remove(key)
            except OSError:  # (no permission to touch it, ...: it is there)
                return True
        # Another process wrote it: adopted, room made never from the chain before it (with no
        # `protect`, the adoption evicted the chain's own parent, just marked least recently used, and
        # unlinked it for every process sharing the directory; a review, 2026-12-05).
        if not overwrite and self._adopt([key], protect=protect[1:]) == 1:
            with self._lock:
                self._stats.num_put_dedup += 1
            with contextlib.suppress(OSError):
                self._stamp(path, key, stamp_ns)
            return True
        with self._lock:
            # A whole block's room, an overwrite's too: the key may be evicted while its file is
            # written, and the rename then adds a block nobody made room for (over capacity).
            need_bytes = self.file_nbytes
            if not self._make_room_locked(need_bytes, protect=protect):
                self._stats.num_write_failures += 1
                return False
            self._reserved_bytes += need_bytes
        tmp = None
        try:
            rule = faults.check("store.write") if faults.ENABLED else None
            if rule is not None:
                if rule.action == "slow":
                    time.sleep(rule.delay_s)
                elif rule.action == "full":
                    raise OSError(errno.ENOSPC, "injected: no space left on device")
                else:
                    raise OSError(errno.EIO, "injected store write failure")
            if self.traffic is not None:
                self.traffic.storage_write(self.file_nbytes)
            header = encode_header(self.layout, key, payload_checksum(arr, self.checksum), self.checksum)
            path.parent.mkdir(exist_ok=True)
            tmp = tmp_path(path)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                self._write_all(fd, [header, memoryview(arr)])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:  # rename + index under the lock: an eviction never unlinks a fresh file
                os.replace(tmp, path)
                tmp = None
                # The chain's mtime order only once renamed: a temp file stamped with its parent's old
                # time looked stale (> 300 s) to another store's start-up scan, which deleted it mid-write.
                with contextlib.suppress(OSError):
                    os.utime(path, ns=(stamp_ns, stamp_ns))
                self._index.add(key, self.file_nbytes)
                self._index.note_mtime(key, stamp_ns)
                self._reserved_bytes -= need_bytes  # the room is now accounted in used_bytes
                need_bytes = 0
                self._stats.num_puts += 1
            return True
        except OSError as e:
            log.warning("kv store: put of block %s failed: %s", key.hex()[:12], e)
            with self._lock:
                self._stats.num_write_failures += 1
            return False
        finally:
            with self._lock:
                self._reserved_bytes -= need_bytes
            if tmp is not None:
                self._unlink_quiet(tmp)

    @staticmethod
    def _read_all(fd: int, views: list[memoryview]) -> int:
        """preadv into `views` from offset 0 until they are full or the file ends; the bytes read. A
        short read is not the end of the file on every filesystem (NFS may return one): read as
        truncated, a good block would be deleted."""
        total = 0
        while views:
            n = os.preadv(fd, views, total)
            if n <= 0:
                break
            total += n
            _consume(views, n)
        return total

    @staticmethod
    def _write_all(fd: int, bufs: list) -> None:
        views = [memoryview(b).cast("B") for b in bufs]
        while views:
            n = os.writev(fd, views)
            if n <= 0:
                raise OSError(errno.EIO, "writev wrote nothing")
            _consume(views, n)

    # ---- lookups -----------------------------------------------------------------------------------
    def lookup(self, token_ids) -> int:
        """Number of leading full blocks of `token_ids` that are stored (partial last block ignored)."""
        return self.lookup_keys(block_keys(token_ids, self.layout.block_size, self.layout.fingerprint))

    def lookup_keys(self, keys) -> int:
        """Number of leading `keys` stored. Adopts blocks written by other processes into the index."""
        with self._lock:
            n = self._index.longest_prefix(keys)
        if n < len(keys):
            n += self._adopt(keys[n:], protect=keys[:n])  # (room made for them never evicts the first n)
        with self._lock:
            # A hit is a use: left least recently used, the blocks just counted were the next put's
            # victims, before the read that follows the lookup (a review, 2026-12-05).
            self._chain_used(keys[:n])
            self._stats.lookup_hit_blocks += n
            self._stats.lookup_miss_blocks += len(keys) - n
        return n

    def _adopt(self, keys, protect: Sequence[bytes] = ()) -> int:
        """Index the leading `keys` whose files exist with the right size, evicting others (never
        `protect`, the chain's blocks before them) to make room; returns how many are indexed. Those
        that do not fit beside `protect` are left out from the tail (their files stay: the process that
        wrote them counts them)."""
        n = 0
        mtimes_ns = []
        for key in keys:
            try:
                st = os.stat(block_path(self.dir, key))
            except OSError:
                break
            if st.st_size != self.file_nbytes:
                break
            mtimes_ns.append(st.st_mtime_ns)
            n += 1
        if n:
            with self._lock:
                added = [self._index.add(key, self.file_nbytes) for key in keys[:n]]
                for key, mtime_ns in zip(keys[:n], mtimes_ns, strict=True):
                    self._index.note_mtime(key, mtime_ns)
                if not self._make_room_locked(0, protect=[*protect, *keys[:n]]):
                    while n and self._index.used_bytes + self._reserved_bytes > self.capacity_bytes:
                        n -= 1
                        if added[n]:
                            self._index.remove(keys[n])
                self._chain_used([*protect, *keys[:n]])
        return n

    # ---- reads -------------------------------------------------------------------------------------
    def read_blocks(self, keys, out, flow=None) -> ReadResult:
        """Read blocks `keys` into host memory `out` and verify them; blocks the calling thread.

        `out`: a contiguous uint8 array/tensor of >= len(keys) * block_nbytes bytes (block i at row i), or
        a list of per-block writable views. Bad blocks are removed from disk and the index and counted.
        """
        t0 = time.perf_counter()
        if flow is not None:  # the emulated storage NIC first (see submit_read)
            flow.wait()
        keys = list(keys)
        views = block_views(out, len(keys), self.layout.block_nbytes)
        # Each block read ok gets mtime now - its place in the read, in ns (`touch`): the head of
        # what was read the newest, as `touch_files` does (the blocks are read in parallel, so "now" at
        # each block's read made their order on disk random, and the mtimes of a fast run equal).
        now_ns = time.time_ns()
        stamps_ns = [now_ns - i for i in range(len(keys))]
        if self._nixl is not None:
            from pdserve.store.nixl_io import read_blocks_nixl

            status = read_blocks_nixl(self, self._nixl, keys, views, stamps_ns)
        else:
            status = list(self._io_pool.map(self._read_one_preadv, keys, views, stamps_ns))
        good = [k for k, s in zip(keys, status, strict=True) if s == "ok"]
        with self._lock:
            self._chain_used(good)  # (a read is of one chain's blocks, head first)
            self._stats.read_ok_blocks += len(good)
        result = ReadResult(keys, status, len(good) * self.layout.block_nbytes)
        result.elapsed_s = time.perf_counter() - t0
        return result

    def submit_read(self, keys, out) -> Future:
        """`read_blocks` on a store thread; the Future yields the ReadResult. `out` must outlive it."""
        keys = list(keys)
        # The flow joins the node's storage link now, so the node's read queue counts this read while
        # it waits for a store thread.
        flow = self.traffic.storage_read_start(len(keys) * self.file_nbytes) if self.traffic else None
        try:
            future = self._submit_pool.submit(self.read_blocks, keys, out, flow)
        except BaseException:  # (a closed store: the flow took the SNIC and counted in its read queue)
            if flow is not None:
                flow.cancel()
            raise
        with self._lock:
            self._reads.add(future)
        future.add_done_callback(lambda f, flow=flow: self._read_ended(f, flow))
        return future

    def _read_ended(self, future: Future, flow) -> None:
        """A submitted read's end: forgotten; one `close` cancelled before it started gives its emulated
        storage-link flow back (it joined the link at submit)."""
        with self._lock:
            self._reads.discard(future)
        if future.cancelled() and flow is not None:
            flow.cancel()

    def _open(self, key: bytes) -> tuple[int | None, os.stat_result | None, str]:
        """(fd, fstat, "") for a readable block file of the right size, else (None, fstat|None, status)."""
        try:
            fd = os.open(block_path(self.dir, key), os.O_RDONLY)
        except FileNotFoundError:
            return None, None, "missing"
        except OSError:
            return None, None, "ioerror"
        try:
            st = os.fstat(fd)
        except OSError:  # (ESTALE on NFS: it raised out of the whole read, and leaked the fd)
            os.close(fd)
            return None, None, "ioerror"
        if st.st_size != self.file_nbytes:
            os.close(fd)
            return None, st, "truncated"
        return fd, st, ""

    def _read_one_preadv(self, key: bytes, view: np.ndarray, stamp_ns: int) -> str:
        fd, st, status = self._open(key)
        if fd is None:
            return self._settle(key, status, st)
        try:
            header = bytearray(HEADER_NBYTES)
            rule = self._read_fault() if faults.ENABLED else None
            n = self._read_all(fd, [memoryview(header), memoryview(view).cast("B")])
            if rule is not None and rule.action == "corrupt" and view.size:
                view[view.size // 2] ^= 0xFF  # a flipped byte in transit: the checksum must catch it
            status = "truncated" if n != self.file_nbytes else self._verify(key, header, view)
            if status == "ok":
                self.touch(fd, stamp_ns, key)
        except OSError:
            status = "ioerror"
        finally:
            os.close(fd)
        return self._settle(key, status, st)

    def touch(self, fd: int, stamp_ns: int, key: bytes) -> None:
        """Mark a block just read as recently used: its mtime (which orders eviction after a restart)
        becomes `stamp_ns`, if `touch_on_read`. Best effort, as in `put`: on a read-only mount (EROFS)
        or a file another user owns (EPERM) the verified block is still served -- it used to read as
        "ioerror", every time."""
        if self.touch_on_read:
            with contextlib.suppress(OSError):
                self._stamp(fd, key, stamp_ns)

    def _stamp(self, target, key: bytes, stamp_ns: int) -> None:
        """Set block `key`'s file mtime (`target`: its path, or an open fd) and record it as this
        process's own (`_used_elsewhere` tells another process's use by a newer one). Raises what
        `os.utime` raises; the lock must not be held."""
        os.utime(target, ns=(stamp_ns, stamp_ns))
        with self._lock:
            self._index.note_mtime(key, stamp_ns)

    @staticmethod
    def _read_fault():
        """The `store.read` fault point, once per block read on either I/O path: `fail` raises the
        OSError a failed read raises, `slow` sleeps here, `corrupt` is returned for the caller to flip a
        byte of the block once it is read."""
        rule = faults.check("store.read")
        if rule is not None and rule.action == "fail":
            raise OSError(errno.EIO, "injected store read failure")
        if rule is not None and rule.action == "slow":
            time.sleep(rule.delay_s)
        return rule

    def _verify(self, key: bytes, header, view: np.ndarray) -> str:
        try:
            hdr = decode_header(header)
        except BlockFormatError:
            return "corrupt"
        bad = check_header(hdr, self.layout, key)
        if bad:
            return bad
        return "ok" if payload_checksum(view, hdr.checksum_algo) == hdr.checksum else "corrupt"

    def _settle(self, key: bytes, status: str, st) -> str:
        """Count a non-ok read; drop the key from the index; remove the bad file if still the same one."""
        if status == "ok":
            return status
        path = block_path(self.dir, key)
        with self._lock:
            if status in BAD_STATUSES:
                self._stats.num_corrupt += 1
                try:  # only our inode: a concurrent put may already have replaced it with a good file
                    now = os.stat(path)
                    if st is None or (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                        os.unlink(path)
                        self._index.remove(key)
                except OSError:
                    self._index.remove(key)
            else:
                self._stats.num_missing += 1
                # (only if still gone: our own write-back may have stored it again since the open,
                # and un-indexing its file left it on disk, never counted nor evicted)
                if status == "missing" and not os.path.exists(path):
                    self._index.remove(key)
        return status

    # ---- maintenance -------------------------------------------------------------------------------
    def evict(self, keys=None, num_bytes: int = 0) -> list[bytes]:
        """Remove `keys` (if given) and then LRU blocks until `num_bytes` are freed; returns the keys."""
        with self._lock:
            victims = [k for k in (keys or []) if k in self._index]
            freed = len(victims) * self.file_nbytes
            if num_bytes > freed:
                victims += self._index.victims(num_bytes - freed, protect=victims)
            for key in victims:
                self._unlink_quiet(block_path(self.dir, key))
                self._index.remove(key)
                self._stats.num_evictions += 1
        return victims

    def keys_lru_first(self) -> list[bytes]:
        with self._lock:
            return self._index.keys_lru_first()

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**{k: v for k, v in self._stats.__dict__.items()})
            s.used_bytes, s.num_blocks = self._index.used_bytes, len(self._index)
            return s

    def check_integrity(self) -> None:
        """Raise AssertionError unless index == block files on disk and the bytes add up. Call when no
        put/read is in flight in this process (other processes must not write the directory meanwhile)."""
        blocks, _, wrong = scan_block_files(self.dir, self.file_nbytes, stale_tmp_s=float("inf"))
        with self._lock:
            on_disk = {k for k, _, _ in blocks}
            indexed = set(self._index.keys_lru_first())
            assert not wrong, f"block files of the wrong size: {wrong}"
            assert on_disk == indexed, f"{len(on_disk - indexed)} unindexed, {len(indexed - on_disk)} missing"
            assert self._index.used_bytes == len(indexed) * self.file_nbytes, "bytes accounting broken"
            assert self._reserved_bytes == 0, "reservation leaked"
            assert self._index.used_bytes <= self.capacity_bytes, "over capacity"

    def remove_files(self) -> bool:
        """After `close()`: delete this store's directory, with the blocks other processes wrote to it
        (those of weights no longer served: a process still sharing it reads them as missing, and
        recomputes). True if it is gone; I/O trouble is logged, never raised."""
        if not self._closed:
            raise RuntimeError("remove_files() needs a closed store")
        with self._lock:
            self._index = BlockIndex()
        shutil.rmtree(self.dir, ignore_errors=True)
        gone = not self.dir.exists()
        if gone:
            log.info("kv store: removed %s", self.dir)
        else:
            log.warning("kv store: could not remove all of %s", self.dir)
        return gone

    def close(self) -> None:
        """Cancel queued reads (their users see a failed read and recompute), wait up to `CLOSE_WAIT_S`
        for running ones, stop the threads, release NIXL. Files stay: that is the point. It waited for
        every read without a limit: a hung disk held a weight update (which closes the old weights'
        store on the engine thread) or an engine's exit for as long as it hung (a review, 2026-12-05).
        A read still running then is left to its thread, and NIXL (which it may be using) unreleased."""
        if self._closed:
            return
        self._closed = True
        self._submit_pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = list(self._reads)
        _, hung = futures_wait(running, timeout=CLOSE_WAIT_S)
        self._io_pool.shutdown(wait=not hung, cancel_futures=bool(hung))
        if hung:
            log.warning(
                "kv store: closed with %d read(s) still running after %.0f s", len(hung), CLOSE_WAIT_S
            )
        elif self._nixl is not None:
            self._nixl.close()

    def __enter__(self) -> KVBlockStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _consume(views: list[memoryview], num_bytes: int) -> None:
    """Drop the first `num_bytes` from a list of buffers (a short `readv` or `writev` goes on from there)."""
    while views and num_bytes >= len(views[0]):
        num_bytes -= len(views[0])
        views.pop(0)
    if views and num_bytes:
        views[0] = views[0][num_bytes:]
