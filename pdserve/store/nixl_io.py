"""Block-file reads through NIXL's POSIX backend (`io_backend="nixl"`; optional dependency).

Who: `KVBlockStore.read_blocks` calls `NixlPosixReader.read` from one coordinator thread at a time (a
lock serialises callers: NIXL agents are not thread-safe). What: for a batch of open block files it
registers the files (`FILE` segments `(0, 0, fd)`) and the destination host memory (`DRAM`), posts ONE
READ transfer with two descriptors per block -- the 4 KiB header into a scratch row and the payload
straight into the caller's buffer -- and polls it to completion. The backend runs with its default
queue (no io_uring/aio options set); without `O_DIRECT`, Linux AIO completes synchronously, so the
transfer advances only while polled. A short read anywhere fails the whole transfer (NIXL reports no
per-descriptor status): the caller then re-reads that batch with `os.preadv` to find the bad block.
The import is lazy (`pdserve.transfer.nixl_backend.import_nixl`), so the store works without NIXL.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

import numpy as np

from pdserve import faults
from pdserve.store.fileformat import HEADER_NBYTES

log = logging.getLogger(__name__)

_agent_ids = itertools.count()


class NixlReadError(RuntimeError):
    """The NIXL transfer failed as a whole (a short read, a vanished file, a backend error)."""


class NixlPosixReader:
    def __init__(self) -> None:
        from pdserve.transfer.nixl_backend import import_nixl  # lazy: NIXL is optional

        nixl_agent, nixl_agent_config = import_nixl()
        name = f"pdserve-store-{os.getpid()}-{next(_agent_ids)}"
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self._agent.create_backend("POSIX", {})
        self._name = name
        self._lock = threading.Lock()

    def read(self, reads: list[tuple[int, int, int, int]]) -> None:
        """Perform `(fd, file_offset, host_addr, nbytes)` reads in one transfer; raise NixlReadError.

        Every host range must stay alive (and every fd open) until this returns.
        """
        if not reads:
            return
        arr = np.asarray(reads, dtype=np.uint64)
        fds = sorted({int(fd) for fd in arr[:, 0]})
        with self._lock:
            agent = self._agent
            try:
                dram = agent.register_memory(
                    [(int(a), int(n), 0, "") for _, _, a, n in reads], "DRAM", ["POSIX"]
                )
            except Exception as e:  # the batch is re-read with preadv
                raise NixlReadError(f"registering the buffers failed: {e!r}") from e
            try:
                files = agent.register_memory([(0, 0, fd, "") for fd in fds], "FILE", ["POSIX"])
            except Exception as e:
                agent.deregister_memory(dram, ["POSIX"])  # else the buffers stay registered
                raise NixlReadError(f"registering the files failed: {e!r}") from e
            handle = None
            try:
                local = np.stack([arr[:, 2], arr[:, 3], np.zeros(len(reads), np.uint64)], axis=1)
                remote = np.stack([arr[:, 1], arr[:, 3], arr[:, 0]], axis=1)
                handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs(np.ascontiguousarray(local), "DRAM"),
                    agent.get_xfer_descs(np.ascontiguousarray(remote), "FILE"),
                    self._name,
                    backends=["POSIX"],
                )
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                if state != "DONE":
                    raise NixlReadError(f"NIXL POSIX read ended in state {state}")
            except NixlReadError:
                raise
            except Exception as e:  # nixlBackendError & co: the batch is re-read with preadv
                raise NixlReadError(str(e)) from e
            finally:  # each release runs even if an earlier one raises
                try:
                    if handle is not None:
                        handle.release()
                finally:
                    try:
                        agent.deregister_memory(files, ["POSIX"])
                    finally:
                        agent.deregister_memory(dram, ["POSIX"])

    def close(self) -> None:
        self._agent = None


def read_blocks_nixl(store, reader: NixlPosixReader, keys, views, stamps_ns: list[int]) -> list[str]:
    """`KVBlockStore.read_blocks` with io_backend="nixl": open + size-check each file, one NIXL transfer
    for all of them, then verify (and on a failed transfer re-read) in the store's I/O pool."""
    status: list[str | None] = [None] * len(keys)
    opened: list[tuple[int, int, os.stat_result]] = []
    headers = np.empty((len(keys), HEADER_NBYTES), dtype=np.uint8)
    for i, key in enumerate(keys):
        fd, st, s = store._open(key)
        if fd is None:
            status[i] = store._settle(key, s, st)
        else:
            opened.append((i, fd, st))
    try:
        reads = []
        for i, fd, _ in opened:
            reads.append((fd, 0, headers[i].ctypes.data, HEADER_NBYTES))
            reads.append((fd, HEADER_NBYTES, views[i].ctypes.data, store.layout.block_nbytes))
        try:
            reader.read(reads)
            nixl_ok = True
        except Exception as e:
            log.warning("kv store: NIXL read failed (%s); re-reading with preadv", e)
            nixl_ok = False

        def verify(item):
            i, fd, st = item
            if not nixl_ok:
                return i, store._read_one_preadv(keys[i], views[i], stamps_ns[i])
            if faults.ENABLED:  # the same fault point as the preadv path, per block
                try:
                    rule = store._read_fault()
                except OSError:
                    return i, store._settle(keys[i], "ioerror", st)
                if rule is not None and rule.action == "corrupt" and views[i].size:
                    views[i][views[i].size // 2] ^= 0xFF
            s = store._verify(keys[i], headers[i], views[i])
            if s == "ok":
                store.touch(fd, stamps_ns[i], keys[i])
            return i, store._settle(keys[i], s, st)

        for i, s in store._io_pool.map(verify, opened):
            status[i] = s
    finally:
        for _, fd, _ in opened:
            os.close(fd)
    return status  # type: ignore[return-value]
