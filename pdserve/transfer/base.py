"""The data-plane interface: one backend object moves bytes from local registered memory into a
peer's registered memory and delivers a notification to the peer once all bytes have landed.

Threading: a backend is owned by exactly ONE thread, the `TransferAgent` thread (NIXL agents are not
thread-safe, and the thread must keep polling so notifications and progress happen). Nothing else
calls a backend directly; engines go through `TransferAgent`'s queues.

Call order (all from the owner thread): `register` once -> `local_metadata` (shipped to peers by the
control plane) -> `add_peer` per registration -> any number of `write` / `read` / `status` /
`release` ->
`get_notifications` continuously -> `close` once.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable


class TransferStatus(enum.IntEnum):
    PENDING = 0
    DONE = 1
    FAILED = 2


class TransferError(RuntimeError):
    """A backend could not do what was asked (unknown peer, unregistered memory, transport error)."""


class TransferBackend(abc.ABC):
    """Abstract data-plane backend. Every method is called by the owning (agent) thread only."""

    name: str

    @abc.abstractmethod
    def register(self, regions: list[tuple[int, ...]]) -> None:
        """Register local memory: KV buffers, handoff slots, staging. Each region is (addr, nbytes) for
        host memory or (addr, nbytes, gpu index) for device memory (`tensor_region` builds either).

        Called once, right after construction, before any `write` or `local_metadata`.
        """

    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque bytes a peer passes to its `add_peer` to be able to write into our regions."""

    @abc.abstractmethod
    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        """Make `peer_name` a valid write target. Called on every registration the prefill accepts:
        first contact, and again when a decode registers anew (a lost RegisterAck, a weight update),
        so it must be idempotent."""

    @abc.abstractmethod
    def remove_peer(self, peer_name: str) -> None:
        """Forget a peer (it died or left). Unknown names are ignored. Called by a prefill for a decode
        silent for `PDConfig.peer_idle_s` with no room left, so never under a live transfer to it."""

    @abc.abstractmethod
    def write(
        self, peer_name: str, local: list[tuple[int, int]], remote: list[tuple[int, int]], notif: bytes
    ) -> int:
        """Start copying local[i] -> remote[i] ((addr, nbytes) pairs, same lengths, nbytes equal pairwise).

        Returns a handle for `status` / `release`. The peer receives `notif` only once all bytes of this
        write have landed. Raises TransferError (or ValueError for malformed lists) if it cannot start.
        """

    def read(
        self, peer_name: str, local: list[tuple[int, int]], remote: list[tuple[int, int]], notif: bytes
    ) -> int:
        """Start copying remote[i] -> local[i] (the peer's registered memory into ours); `notif` reaches
        the peer when done. Same contract as `write` otherwise. Used by the DualPath DE read path: the
        prefill pulls the prompt KV the decode read from the store."""
        raise TransferError(f"{self.name}: reads are not supported")

    @abc.abstractmethod
    def status(self, handle: int) -> TransferStatus:
        """PENDING, DONE or FAILED. Also drives progress for backends that need polling."""

    @abc.abstractmethod
    def release(self, handle: int) -> None:
        """Forget a finished handle, or abort a pending one.

        Invariant: after this returns, no further bytes of that write are written into the peer (a
        backend that cannot cancel waits for the copy to end before returning).
        """

    @abc.abstractmethod
    def get_notifications(self) -> list[tuple[str, bytes]]:
        """(peer_name, notif) received since the last call. Must be called continuously by the owner."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release every handle and registration. Called once, last."""


def tensor_region(t) -> tuple[int, ...]:
    """The registration entry of a contiguous tensor's storage: (addr, nbytes) in host memory,
    (addr, nbytes, gpu index) in device memory."""
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cuda":
        return t.data_ptr(), nbytes, t.device.index or 0
    if t.device.type != "cpu":
        raise TransferError(f"cannot register memory of a {t.device.type} tensor")
    return t.data_ptr(), nbytes


def _make_fake(agent_name: str, **options) -> TransferBackend:
    from pdserve.transfer.fake_backend import FakeBackend

    return FakeBackend(agent_name, **options)


def _make_nixl(agent_name: str, **options) -> TransferBackend:
    from pdserve.transfer.nixl_backend import NixlBackend

    return NixlBackend(agent_name, **options)


# name -> factory; factories import lazily so the package works without NIXL installed.
BACKENDS: dict[str, Callable[..., TransferBackend]] = {"nixl": _make_nixl, "fake": _make_fake}
DEFAULT_BACKEND = "nixl"


def create_backend(name: str, agent_name: str, **options) -> TransferBackend:
    """Build a backend by name ("nixl" default, "fake"). Call it on the thread that will own it."""
    factory = BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {sorted(BACKENDS)}")
    if not agent_name:
        raise ValueError("create_backend: agent_name must be a non-empty, cluster-unique name")
    return factory(agent_name, **options)
