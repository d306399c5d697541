"""`fake` backend: moves no bytes, but has the timing and failure semantics of a real one.

For tests of everything above the data plane (state machines, abort races, deadlines). Fake agents
find each other through a module-level registry by agent name, so both ends must live in the SAME
process (e.g. a prefill and a decode engine in one test, each with its own TransferAgent thread).

Injection knobs (constructor options, or attributes changed at run time from the owner thread):
- `delay_s`: a write stays PENDING for this long; its notification becomes visible at the same time.
- `fail_rate`: probability that a write ends FAILED (seeded by `seed`); a failed write sends no notif.
- `fail_next(n)`: the next n writes fail (deterministic).
- `lose_notifications`: writes succeed but the peer never receives the notif.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass

from pdserve.transfer.base import TransferBackend, TransferError, TransferStatus

# agent_name -> FakeBackend. Guarded by _REGISTRY_LOCK: two agents' threads touch each other's inbox.
_REGISTRY: dict[str, FakeBackend] = {}
_REGISTRY_LOCK = threading.Lock()


@dataclass
class _FakeWrite:
    peer_name: str
    done_at_s: float  # time.monotonic() at which the write counts as finished
    fails: bool
    notif_id: int | None  # id of the notif queued in the peer's inbox (None: failed or lost)


def _check_inside(descriptors: list[tuple[int, int]], regions: list[tuple[int, int]], side: str) -> None:
    for addr, nbytes in descriptors:
        if not any(base <= addr and addr + nbytes <= base + size for base, size in regions):
            raise TransferError(f"fake: {side} memory [{addr:#x}, +{nbytes}) is not registered")


class FakeBackend(TransferBackend):
    name = "fake"

    def __init__(
        self,
        agent_name: str,
        delay_s: float = 0.0,
        fail_rate: float = 0.0,
        lose_notifications: bool = False,
        seed: int = 0,
    ) -> None:
        self.agent_name = agent_name
        self.delay_s = delay_s
        self.fail_rate = fail_rate
        self.lose_notifications = lose_notifications
        self._rng = random.Random(seed)
        self._fail_next = 0
        self._handles = itertools.count(1)
        self._writes: dict[int, _FakeWrite] = {}
        self._peers: set[str] = set()
        self._registered: list[tuple[int, int]] = []
        # Inbox: notif_id -> (visible_at_s, sender, notif); written by senders' threads under the lock.
        self._inbox: dict[int, tuple[float, str, bytes]] = {}
        self._notif_ids = itertools.count(1)
        self._closed = False
        with _REGISTRY_LOCK:
            if agent_name in _REGISTRY and not _REGISTRY[agent_name]._closed:
                raise TransferError(f"fake agent {agent_name!r} already exists in this process")
            _REGISTRY[agent_name] = self

    def fail_next(self, num_writes: int) -> None:
        """Make the next `num_writes` writes fail (they report FAILED and deliver no notif)."""
        self._fail_next += num_writes

    def register(self, regions: list[tuple[int, int]]) -> None:
        self._registered = list(regions)

    def local_metadata(self) -> bytes:
        return self.agent_name.encode()

    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        if metadata.decode() != peer_name:
            raise TransferError(f"fake: metadata of {metadata.decode()!r} given for peer {peer_name!r}")
        self._peers.add(peer_name)

    def remove_peer(self, peer_name: str) -> None:
        self._peers.discard(peer_name)

    def write(
        self, peer_name: str, local: list[tuple[int, int]], remote: list[tuple[int, int]], notif: bytes
    ) -> int:
        if len(local) != len(remote):
            raise ValueError(f"write: {len(local)} local descriptors but {len(remote)} remote")
        for (_, n_local), (_, n_remote) in zip(local, remote, strict=True):
            if n_local != n_remote:
                raise ValueError(f"write: descriptor sizes differ ({n_local} vs {n_remote} bytes)")
        if peer_name not in self._peers:
            raise TransferError(f"fake: unknown peer {peer_name!r}")
        # As NIXL: every descriptor inside memory its side registered (a test on the fake passed
        # with an off-by-one page or a wrong base address that NIXL refuses).
        _check_inside(local, self._registered, "local")
        with _REGISTRY_LOCK:
            peer = _REGISTRY.get(peer_name)
            peer_regions = list(peer._registered) if peer is not None else None
        if peer_regions is not None:
            _check_inside(remote, peer_regions, f"remote ({peer_name})")
        fails = self._fail_next > 0 or (self.fail_rate > 0 and self._rng.random() < self.fail_rate)
        if self._fail_next > 0:
            self._fail_next -= 1
        done_at_s = time.monotonic() + self.delay_s
        notif_id = None
        if not fails and not self.lose_notifications:
            with _REGISTRY_LOCK:
                peer = _REGISTRY.get(peer_name)
                if peer is None or peer._closed:
                    raise TransferError(f"fake: peer {peer_name!r} is not running in this process")
                notif_id = next(peer._notif_ids)
                peer._inbox[notif_id] = (done_at_s, self.agent_name, bytes(notif))
        handle = next(self._handles)
        self._writes[handle] = _FakeWrite(peer_name, done_at_s, fails, notif_id)
        return handle

    def read(self, peer_name, local, remote, notif: bytes) -> int:
        """Moves nothing, like `write` (same failure injection and notification delivery)."""
        return self.write(peer_name, local, remote, notif)

    def status(self, handle: int) -> TransferStatus:
        w = self._writes.get(handle)
        if w is None:
            raise TransferError(f"fake: unknown handle {handle}")
        if time.monotonic() < w.done_at_s:
            return TransferStatus.PENDING
        return TransferStatus.FAILED if w.fails else TransferStatus.DONE

    def release(self, handle: int) -> None:
        w = self._writes.pop(handle, None)
        if w is None or w.notif_id is None or time.monotonic() >= w.done_at_s:
            return
        # Aborting a pending write: its notif must never show up at the peer.
        with _REGISTRY_LOCK:
            peer = _REGISTRY.get(w.peer_name)
            if peer is not None:
                peer._inbox.pop(w.notif_id, None)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        now = time.monotonic()
        with _REGISTRY_LOCK:
            ready = sorted((nid, sender, msg) for nid, (at, sender, msg) in self._inbox.items() if at <= now)
            for nid, _, _ in ready:
                del self._inbox[nid]
        return [(sender, msg) for _, sender, msg in ready]

    def close(self) -> None:
        self._closed = True
        self._writes.clear()
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self.agent_name) is self:
                del _REGISTRY[self.agent_name]
