"""Bridge between an engine's paged KV pool and the persistent block store (DualPath, issue 5).

Who calls what (all on the engine thread, except the writer thread's `put`s):
* `persist(req)` after a request's KV grew (decode write-back): every newly full block of its tokens
  is gathered from the pool into a host buffer and queued for the writer thread, off the critical path.
* `lookup(req)` / `start_read(req, num_blocks)`: how many leading blocks of a prompt the store holds,
  and an asynchronous read of them into a host buffer (the store's I/O threads). A read of blocks
  another read in flight covers joins it (the `n` choices of one prompt, on one engine at once): the
  storage NIC, the bottleneck DualPath exists for, carries those blocks once.
* `scatter_blocks(buf, num_blocks, page_ids)` copies read blocks into pool pages (store/upload.py).

Block payload (pdserve.store.layout): [layers, K then V of block_size tokens, token-major]; a block of
`block_size` tokens spans `block_size // page_size` pool pages, so a layer's K half of a block is those
pages' K rows, contiguous, byte for byte.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.kvcache.hashing import cached_keys, salted_root
from pdserve.store.block_store import KVBlockStore
from pdserve.store.joined_reads import JoinedReads, PendingRead
from pdserve.store.keys import store_root_key
from pdserve.store.layout import BlockLayout
from pdserve.store.upload import scatter_chunks, scatter_staging
from pdserve.transfer.staging import wide_rows

log = logging.getLogger(__name__)

PERSIST_CHUNK_NBYTES = 64 << 20  # write-back gathers up to this much KV per device-to-host copy


class StoreConnector:
    def __init__(self, engine, store: KVBlockStore) -> None:
        self.engine = engine
        self.store = store
        self.layout: BlockLayout = store.layout
        self.page_size = engine.kv.page_size
        if self.layout.block_size % self.page_size:
            raise ValueError(
                f"block_size {self.layout.block_size} is not a multiple of page_size {self.page_size}"
            )
        self.pages_per_block = self.layout.block_size // self.page_size
        self.root = store_root_key(self.layout.fingerprint)  # the store's chain root (store/keys.py)
        kv = engine.runner.kv_cache
        # Per layer: K and V pools viewed as bytes per page [num_pages, page_bytes].
        self._k = [k.view(k.shape[0], -1).view(torch.uint8) for k in kv.k]
        self._v = [v.view(v.shape[0], -1).view(torch.uint8) for v in kv.v]
        self._scatter_staging: torch.Tensor | None = None  # pinned slots of a GPU pool's scatters
        self.reads = JoinedReads()  # store reads in flight, joined by requests of one prefix
        self.num_blocks_written = 0
        self.num_blocks_skipped = 0  # full blocks write-back found stored already (never gathered)
        self.num_write_failures = 0
        self._writes: queue.Queue = queue.Queue(maxsize=1024)
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-writer", daemon=True)
        self._writer.start()

    # ---- keys and lookup -----------------------------------------------------------------------
    def keys_for(self, req: Request, num_blocks: int) -> list[bytes]:
        """Keys of the request's first `num_blocks` full blocks (cached on the request, extended as it
        grows: write-back asks again at every block boundary)."""
        root = salted_root(self.root, req.cache_salt)
        return cached_keys(req.block_key_cache, req.all_token_ids, self.layout.block_size, root, num_blocks)

    def lookup(self, req: Request) -> int:
        """Leading blocks of the prompt in the store, leaving at least one token to compute."""
        max_blocks = (req.num_prompt_tokens - 1) // self.layout.block_size
        if max_blocks <= 0:
            return 0
        return self.store.lookup_keys(self.keys_for(req, max_blocks))

    def start_read(
        self, req: Request, num_blocks: int, now_s: float = 0.0, max_join_age_s: float = math.inf
    ) -> PendingRead:
        """Read the request's first `num_blocks` (> 0) blocks into host memory; or join a read in flight
        of a chain that starts with them (a sibling's), unless it was submitted more than
        `max_join_age_s` before `now_s` (the caller's clock): the same buffer and future, no I/O."""
        nbytes = self.layout.block_nbytes
        alloc = lambda n: torch.empty((n, nbytes), dtype=torch.uint8)  # noqa: E731
        return self.reads.read(self.store, self.keys_for(req, num_blocks), alloc, now_s, max_join_age_s)

    # ---- pool <-> blocks -----------------------------------------------------------------------
    def gather_blocks(self, page_ids: list[int], first: int, last: int) -> torch.Tensor:
        """Payloads of blocks [first, last) from the pool, a copy on the pool's device:
        [last - first, block_nbytes], each row K then V of every layer in turn (store/layout.py)."""
        ppb = self.pages_per_block
        idx = torch.tensor(page_ids[first * ppb : last * ppb], dtype=torch.long, device=self._k[0].device)
        num_blocks = last - first
        parts = []
        for k, v in zip(self._k, self._v, strict=True):
            # [num_blocks * ppb, page_bytes] -> [num_blocks, ppb * page_bytes]: a block's pages, in order
            # (selected as wide rows: 1.7x faster than bytes on a CPU)
            parts += [t.index_select(0, idx).view(torch.uint8).view(num_blocks, -1) for t in wide_rows(k, v)]
        return torch.cat(parts, dim=1)

    def scatter_blocks(self, buf: torch.Tensor, num_blocks: int, page_ids: list[int]) -> None:
        """Blocks [num_blocks, block_nbytes] -> the pool pages covering tokens [0, num_blocks * block_size):
        runs of whole blocks go to the pool's device in one copy each, through pinned staging on a GPU,
        then each layer is cut out there (store/upload.py; on an H200 per-layer strided copies ran at
        5.2 GB/s, runs of blocks from pinned memory at 40.9)."""
        device = self._k[0].device  # `buf` is host memory (the store reads into it); the pool may not be
        idx = torch.tensor(page_ids[: num_blocks * self.pages_per_block], dtype=torch.long, device=device)
        if self._scatter_staging is None:
            self._scatter_staging = scatter_staging(self.layout, device)
        scatter_chunks(buf, num_blocks, self.layout, idx, self._k, self._v, self._scatter_staging)
        if device.type == "cuda":
            # The caller then lets the prefill read these pages over the network (DE read path), and
            # may free `buf`: the copies queued on the stream must have landed first.
            torch.cuda.current_stream(device).synchronize()

    # ---- write-back ----------------------------------------------------------------------------
    def persist(self, req: Request, final: bool = False) -> int:
        """Queue every full block of the request's computed tokens not yet queued, but for leading blocks
        the store holds already (skipped). Returns how many were queued.

        Blocks are queued in chain order and never past one that could not be: keys are chained, so a
        block after a missing one is never found by a lookup (the writer refuses such a block too:
        `KVBlockStore.put`). The ones the writer's queue has no room for now wait for the next call
        (the request holds their pages until its last call, `final`, after which they are counted as
        write failures). Never raises: the store never fails a request."""
        try:
            return self._persist(req, final)
        except Exception:  # noqa: BLE001 - e.g. the gather's device memory; the next call tries again
            self.num_write_failures += 1
            log.exception("kv store write-back failed")
            return 0

    def _persist(self, req: Request, final: bool) -> int:
        num_full = req.num_computed_tokens // self.layout.block_size
        done = req.num_blocks_persisted
        if num_full <= done:
            return 0
        keys = self.keys_for(req, num_full)
        if done == 0:
            # Its first write-back: the leading blocks may be stored already (this turn's hit, read
            # from the store; an earlier turn; a sibling). They are skipped, not gathered and copied to
            # host only for the writer to find them there: in a multi-turn conversation that was the
            # whole context again at every turn, on the engine thread.
            done = req.num_blocks_persisted = self.store.stored_prefix(keys)
            self.num_blocks_skipped += done
            if done:  # their files' mtimes: the writer's (disk I/O never runs on this thread)
                try:
                    self._writes.put_nowait((self.store, keys[:done], -1, None))
                except queue.Full:  # (recency across a restart only: the index has it)
                    pass
            if num_full <= done:
                return 0
        # Only as many blocks as the writer's queue takes now (this thread alone fills it, so its room
        # only grows meanwhile): the disk is behind, the rest waits for a later call and is not
        # gathered now. Every gathered row is then queued, so no queued row keeps a mostly dropped
        # chunk alive.
        room = max(0, self._writes.maxsize - self._writes.qsize())
        end = done + min(num_full - done, room)
        queued = done
        chunk = max(1, PERSIST_CHUNK_NBYTES // self.layout.block_nbytes)
        for first in range(done, end, chunk):
            last = min(first + chunk, end)
            # One gather and one device-to-host copy per chunk, not per block (on CUDA each `.cpu()`
            # waits for the stream); chunks bound the device scratch for a whole long prompt.
            payloads = self.gather_blocks(req.page_ids, first, last).cpu().numpy()  # for the writer
            for b in range(first, last):
                try:  # (the chain's keys and this block's index: its ancestors, sliced by the writer)
                    self._writes.put_nowait((self.store, keys, b, payloads[b - first]))
                except queue.Full:  # a flush() sentinel took the last slot: the rest waits
                    break
                queued = b + 1
            if queued < last:
                break
        req.num_blocks_persisted = queued
        if final and queued < num_full:  # its pages go now: those blocks are not stored this turn
            self.num_write_failures += num_full - queued
        return queued - done

    @property
    def num_writes_pending(self) -> int:
        """Blocks queued for write-back and not yet on disk (or failed): the writer's backlog. Every
        block a request queued is counted here before its response ends, so 0 after a response means
        its write-back is done (tests wait on it; operators watch it grow when the disk is behind).
        A row touching the files of skipped blocks (`persist`) counts as one until it is done."""
        return self._writes.unfinished_tasks

    def retarget(self, store: KVBlockStore, flush_timeout_s: float = 30.0) -> None:
        """Engine thread, after a weight update: read and write `store` (the new weights' identity:
        another directory and key chain) from now on. Write-backs queued for the old one land there
        (each row names its store; the flush waits for them within its timeout, and a hung disk
        does not hang the update); keys cached on requests were of the old chain, and those
        requests are gone."""
        if (
            store.layout.block_size != self.layout.block_size
            or store.layout.block_nbytes != self.layout.block_nbytes
        ):
            raise ValueError("a store of another block layout")  # (only the model identity may change)
        if not self.flush(flush_timeout_s):  # (the disk is hung: those land in the old store, or never)
            log.warning(
                "kv store: write-backs still queued for the old weights' store after %.0f s", flush_timeout_s
            )
        self.store, self.layout = store, store.layout
        self.root = store_root_key(self.layout.fingerprint)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is on disk (tests, shutdown, `retarget`), at most
        `timeout_s` in all, also when the queue is full behind a slow or hung disk (the marker's own
        place in the queue is waited for within it). True if they all were."""
        done = threading.Event()
        until_s = time.monotonic() + timeout_s
        try:
            self._writes.put((None, None, 0, done), timeout=timeout_s)
        except queue.Full:
            log.warning("kv store: %d write-backs still queued after %.0f s", self._writes.qsize(), timeout_s)
            return False
        return done.wait(max(0.0, until_s - time.monotonic()))

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush, then stop the writer thread (PDContext.close, or a store dropped after a weight
        update). It held this connector -- the engine and its whole KV pool -- for the process's life.
        Bounded by `timeout_s` twice at most behind a hung disk; the thread is a daemon."""
        self.flush(timeout_s)
        try:
            self._writes.put((None, None, 0, None), timeout=timeout_s)
        except queue.Full:
            return
        self._writer.join(timeout_s)

    def _write_loop(self) -> None:
        while True:
            store, keys, b, payload = self._writes.get()
            if keys is None and payload is None:  # close()
                self._writes.task_done()
                return
            try:
                if keys is None:
                    payload.set()
                elif payload is None:  # blocks write-back skipped, stored already (persist)
                    store.touch_files(keys)
                elif store.put(keys[b], np.ascontiguousarray(payload), ancestors=keys[:b]):
                    self.num_blocks_written += 1
                else:
                    self.num_write_failures += 1
            except Exception:  # noqa: BLE001 - the store never fails a request
                self.num_write_failures += 1
                log.exception("kv store write failed")
            finally:
                self._writes.task_done()
