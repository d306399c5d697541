"""Store reads that requests of one prefix share: the `n` choices of one prompt reach one engine
together, and each would read the same stored blocks again over the node's storage NIC, the
bottleneck DualPath exists for. A read of blocks that a read in flight covers joins it instead; so
does one that a read which has ended covers while its owner still holds it (a choice whose request
reached the engine thread only after a long step, during which the first choice's read ended; the
prefill holds its read until its layerwise run takes the buffer, the decode until it has copied the
blocks into its pages).

Who calls it: `engine/store_connector.py` (`StoreConnector.start_read`, on an engine thread) for
every store read of a PD engine; `pdserve bench store` (its "joined" case). The store's I/O threads
call `_ended` when a read completes.

Chained keys (store/keys.py): a block's key names its whole prefix, so a read whose keys contain a
request's last key holds that request's blocks as its own first rows.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pdserve.store.block_store import KVBlockStore


@dataclass
class PendingRead:
    """One request's store read. `buffer` and `future` may be another request's (`shared`): its read of
    a chain whose first blocks are this request's; both only read the buffer once the future is done."""

    keys: list[bytes]  # this request's blocks (chained keys: the last one names the whole prefix)
    buffer: object  # uint8 [>= len(keys), block_nbytes] host memory: rows [0, len(keys)) are its blocks
    future: Future  # Future[ReadResult] of the read's own keys
    shared: bool = False  # joined another request's read: no I/O of its own
    started_s: float = 0.0  # when the read (the owner's, for a joined one) was submitted, caller's clock

    def num_prefix_ok(self, result) -> int:
        """This request's leading good blocks, of a shared read's result too."""
        return min(result.num_prefix_ok, len(self.keys))


class JoinedReads:
    """Reads in flight, by each of their keys; requests of a prefix one covers join it.

    Invariants: `_reads` holds owners' reads, each under its own keys; a read's entries go when it
    ends (`_ended`, under the lock, with its bad-block count), those of its leading good blocks to
    `_ended_reads` (all of them if it read every block), which holds them weakly: joinable while the owner's request holds its read, and no
    longer (it never keeps a buffer alive). Nothing else refers to an owner's read (its future's
    callback holds a weak reference): when its request drops it, it and its buffer are freed at once,
    not at the cyclic GC's next pass."""

    def __init__(self) -> None:
        self._reads: dict[bytes, PendingRead] = {}
        self._ended_reads: weakref.WeakValueDictionary[bytes, PendingRead] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()  # (the store's I/O threads end reads)
        self.num_blocks_joined = 0  # blocks a request took from another's read (in flight or held)
        # Blocks a read found corrupt, truncated or missing: counted once per read when it ends, also
        # when no request is left to use it and however many joined it.
        self.num_blocks_bad = 0

    def read(
        self,
        store: KVBlockStore,
        keys: list[bytes],
        alloc: Callable[[int], object],
        now_s: float = 0.0,
        max_join_age_s: float = math.inf,
    ) -> PendingRead:
        """Read `keys` (> 0) from `store` into `alloc(len(keys))`; or join a read in flight whose keys
        start with them, submitted at most `max_join_age_s` before `now_s` (one in flight longer is
        stuck, as far as its callers are concerned: they leave it behind), or an ended one: the same
        buffer and future, no I/O."""

        def fresh(r: PendingRead | None) -> bool:
            return r is not None and now_s - r.started_s <= max_join_age_s

        with self._lock:
            in_flight = self._reads.get(keys[-1])
            covering = in_flight if fresh(in_flight) else self._ended_reads.get(keys[-1])
        if covering is not None:
            self.num_blocks_joined += len(keys)
            return PendingRead(
                keys, covering.buffer, covering.future, shared=True, started_s=covering.started_s
            )
        buffer = alloc(len(keys))
        read = PendingRead(keys, buffer, store.submit_read(keys, buffer), started_s=now_s)
        with self._lock:
            for key in keys:
                if not fresh(self._reads.get(key)):  # (a key a younger read covers stays with it)
                    self._reads[key] = read
        # (at once if it has ended; weakly: the future refers to the read no more than the read to it)
        read.future.add_done_callback(lambda _, ref=weakref.ref(read): self._ended(ref()))
        return read

    @property
    def num_in_flight(self) -> int:
        """Reads in flight (not counting the requests that joined them)."""
        with self._lock:
            return len({id(r) for r in self._reads.values()})

    def _ended(self, read: PendingRead | None) -> None:
        """(a store I/O thread, or the caller's if the read ended before its callback was added; `read`
        is None only if nothing held it any more: `_reads` does until this runs, unless two threads
        read the same keys at once and the second's read was never indexed: the engines read from
        one thread each)"""
        if read is None:
            return
        future = read.future
        failed = future.cancelled() or future.exception() is not None  # (its users log the error)
        with self._lock:
            result = None if failed else future.result()
            # (a request whose blocks end before the first bad one joins; one that needs that block
            # reads anew: it may have been written since, or come back from another replica)
            num_good = 0 if result is None else result.num_prefix_ok
            for i, key in enumerate(read.keys):
                if self._reads.get(key) is read:
                    del self._reads[key]
                    if i < num_good:
                        self._ended_reads[key] = read
            if result is not None:
                self.num_blocks_bad += len(result.keys) - result.num_ok

    def check_integrity(self) -> None:
        """Raise AssertionError unless every indexed read is an owner's, under its own keys (whether
        it has ended is not checked: its callback may be on its way), and every ended one kept is an
        owner's, under its own keys of its leading good blocks only."""
        with self._lock:
            for key, read in list(self._ended_reads.items()):
                assert key in read.keys and not read.shared, "an ended read indexed wrongly"
                assert read.future.done() and read.keys.index(key) < read.future.result().num_prefix_ok, (
                    "an ended read kept under a block it did not read well"
                )
            for key, read in self._reads.items():
                assert key in read.keys, "a read indexed under a key not its own"
                assert not read.shared, "a joined read indexed"
