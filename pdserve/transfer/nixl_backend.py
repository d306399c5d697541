"""`nixl` backend: NIXL over UCX (same host: `cma` kernel copies between processes; RDMA on clusters).

Owned by one thread (the TransferAgent's) which must create it: NIXL agents are not thread-safe, and
with `enable_prog_thread=False` (default; faster on few cores) nothing progresses unless the owner
keeps calling `status` / `get_notifications` -- the target side included.

Descriptors are passed to NIXL as Nx3 uint64 numpy arrays (addr, nbytes, device), one per merged run;
NIXL also coalesces adjacent descriptors itself. Memory is host ("DRAM") or GPU ("VRAM", device = the
GPU's index): each side looks its descriptors up in the regions registered -- ours, and the peer's,
which travel in our metadata next to NIXL's own -- so a write from a GPU's KV pool into a peer's GPU
(UCX `cuda_ipc` on one host) or between host buffers is described the same way by the caller.
`write` builds the two descriptor lists directly (`initialize_xfer`): ~0.3 ms for 4096 descriptors
here, so per-(peer, pool) prepped dlists with index lists are not needed for CPU memory at this scale.

Process caveats: create the agent AFTER any fork (a child forked after an agent exists hangs in
`register_memory`); start engines with spawn. `UCX_MODULES='^ib*'` is set (if unset) before the import
to avoid a segfault at exit on hosts with Debian's ibverbs providers and no RDMA.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import msgspec
import numpy as np

from pdserve.transfer.base import TransferBackend, TransferError, TransferStatus

log = logging.getLogger(__name__)

# How long `release` waits for a non-cancellable in-flight copy to end before giving up (seconds).
RELEASE_WAIT_S = 30.0


def import_nixl():
    """(nixl_agent, nixl_agent_config) classes, or raise ImportError. Safe to call repeatedly."""
    os.environ.setdefault("UCX_MODULES", "^ib*")
    # cma copies in segments of this size, one process_vm_writev each (UCX default 512 KiB). Larger
    # segments cut the per-call page-pinning setup: a 64 MiB merged write went from ~130 calls to 2
    # and, with huge-page buffers (kvcache/host_memory.py), from ~4.7 to ~5.9 GB/s here
    # (docs/benchmarks.md). The transfer blocks the owning thread for the whole copy either way (see
    # the module docstring), so nothing waits longer behind a larger segment.
    os.environ.setdefault("UCX_CMA_SEG_SIZE", "64m")
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:  # the CUDA 13 build (hosts whose driver and torch are CUDA 13)
            from nixl_cu13._api import nixl_agent, nixl_agent_config
        except ImportError:
            from nixl._api import nixl_agent, nixl_agent_config
    if "NIXL_LOG_LEVEL" not in os.environ:
        logging.getLogger("nixl").setLevel(logging.WARNING)  # one INFO line per agent otherwise
    return nixl_agent, nixl_agent_config


def nixl_available() -> bool:
    try:
        import_nixl()
    except Exception:  # ImportError, or OSError from a broken native library
        return False
    return True


MEMORY_TYPES = ("DRAM", "VRAM")  # index = the code a region carries in our metadata


class _Metadata(msgspec.Struct, array_like=True):
    """What `local_metadata` ships: NIXL's agent metadata and our registered regions, each
    [addr, nbytes, memory type code, device]."""

    nixl: bytes
    regions: list[tuple[int, int, int, int]]


class RegionIndex:
    """Registered memory of one agent, sorted by address: tells a descriptor's memory type and device.

    `classify` fills column 2 (device) of an Nx3 descriptor array and returns the one memory type
    that every descriptor lies in; NIXL needs one type per descriptor list."""

    def __init__(self, regions: list[tuple[int, int, int, int]]) -> None:
        """Raises ValueError for a region outside the 64-bit address space, of an unknown memory type,
        or overlapping another (a peer's metadata is checked before anything is written to it)."""
        regions = sorted(tuple(int(x) for x in r) for r in regions)
        for addr, nbytes, mem, dev in regions:
            if (
                addr < 0
                or nbytes < 0
                or addr + nbytes >= 1 << 64  # (its end must fit the uint64 bounds below)
                or mem not in (0, 1)
                or not 0 <= dev < 1 << 32
            ):
                raise ValueError(f"bad region (addr {addr}, nbytes {nbytes}, memory {mem}, device {dev})")
        for (a, n, _, _), (b, _, _, _) in itertools.pairwise(regions):
            if a + n > b:
                raise ValueError(f"overlapping regions at {a:#x} and {b:#x}")
        self.regions = regions
        self._starts = np.array([r[0] for r in regions], dtype=np.uint64)
        self._ends = np.array([r[0] + r[1] for r in regions], dtype=np.uint64)
        self._mems = np.array([r[2] for r in regions], dtype=np.int64)
        self._devs = np.array([r[3] for r in regions], dtype=np.uint64)

    def classify(self, descs: np.ndarray) -> str | None:
        """Memory type of `descs` (device column set in place); None if one lies outside every region.
        Raises TransferError if they span host and device memory."""
        if descs.shape[0] == 0:
            return MEMORY_TYPES[0]
        idx = np.searchsorted(self._starts, descs[:, 0], side="right").astype(np.int64) - 1
        if (idx < 0).any():
            return None
        ends = self._ends[idx]
        # (addr <= end first: end - addr would wrap around; addr + nbytes could too)
        if ((descs[:, 0] > ends) | (descs[:, 1] > ends - descs[:, 0])).any():
            return None
        mems = self._mems[idx]
        if (mems != mems[0]).any():
            raise TransferError("nixl: one transfer's descriptors span host and GPU memory")
        descs[:, 2] = self._devs[idx]
        return MEMORY_TYPES[int(mems[0])]


def _region_entry(region) -> tuple[int, int, int, int]:
    """(addr, nbytes) -> host; (addr, nbytes, gpu) -> that GPU's memory."""
    if len(region) == 2:
        return int(region[0]), int(region[1]), 0, 0
    addr, nbytes, gpu = region
    return int(addr), int(nbytes), 1, int(gpu)


def _as_descs(pairs) -> np.ndarray:
    """(addr, nbytes) pairs (list or Nx2 array) -> Nx3 uint64 array (addr, nbytes, dev_id=0)."""
    arr = np.asarray(pairs, dtype=np.uint64)
    if arr.size == 0:
        return np.zeros((0, 3), dtype=np.uint64)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3):
        raise ValueError(f"descriptors must be (addr, nbytes) pairs, got shape {arr.shape}")
    if arr.shape[1] == 3:
        return np.ascontiguousarray(arr)
    out = np.zeros((arr.shape[0], 3), dtype=np.uint64)
    out[:, :2] = arr
    return out


class NixlBackend(TransferBackend):
    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        enable_prog_thread: bool = False,
        num_threads: int = 0,
        ucx_backend: str = "UCX",
    ) -> None:
        nixl_agent, nixl_agent_config = import_nixl()
        cfg = nixl_agent_config(
            enable_prog_thread=enable_prog_thread, num_threads=num_threads, backends=[ucx_backend]
        )
        self.agent_name = agent_name
        self._agent = nixl_agent(agent_name, cfg)
        if ucx_backend not in self._agent.backends:
            raise TransferError(f"NIXL backend plugin {ucx_backend!r} is not available")
        self._reg_descs: list = []
        self._local = RegionIndex([])
        self._remote: dict[str, RegionIndex] = {}  # our peer name -> its registered memory
        self._peers: dict[str, str] = {}  # our peer name -> NIXL's remote agent name
        self._peer_by_nixl: dict[str, str] = {}
        self._handles = itertools.count(1)
        self._xfers: dict[int, object] = {}  # handle -> nixl_xfer_handle, or None for a notif-only write

    def register(self, regions: list[tuple[int, ...]]) -> None:
        if self._reg_descs or self._local.regions:
            raise TransferError("register() is called once")
        entries = [_region_entry(r) for r in regions]
        index = RegionIndex(entries)  # (ValueError for overlapping or impossible regions)
        gpus = {dev for _, _, mem, dev in entries if mem == 1}
        if gpus:
            # UCX finds the CUDA context of GPU memory through the calling thread: make the GPU's
            # primary context current on this (the owner) thread before any registration.
            import torch

            torch.cuda.set_device(min(gpus))
        for code, mem in enumerate(MEMORY_TYPES):
            rows = [(addr, nbytes, dev) for addr, nbytes, c, dev in entries if c == code]
            if rows:
                self._reg_descs.append(self._agent.register_memory(_as_descs(rows), mem))
        self._local = index

    def local_metadata(self) -> bytes:
        return msgspec.msgpack.encode(_Metadata(self._agent.get_agent_metadata(), self._local.regions))

    def add_peer(self, peer_name: str, metadata: bytes) -> None:
        try:
            md = msgspec.msgpack.decode(metadata, type=_Metadata)
            regions = RegionIndex(md.regions)  # checked before NIXL learns of the peer
        except (msgspec.DecodeError, ValueError) as e:
            raise TransferError(f"nixl: malformed metadata from {peer_name!r}: {e}") from e
        nixl_name = self._agent.add_remote_agent(md.nixl)
        if isinstance(nixl_name, bytes):  # 1.5.1 returns bytes
            nixl_name = nixl_name.decode()
        self._peers[peer_name] = nixl_name
        self._peer_by_nixl[nixl_name] = peer_name
        self._remote[peer_name] = regions

    def remove_peer(self, peer_name: str) -> None:
        nixl_name = self._peers.pop(peer_name, None)
        self._remote.pop(peer_name, None)
        if nixl_name is None:
            return
        self._peer_by_nixl.pop(nixl_name, None)
        try:
            self._agent.remove_remote_agent(nixl_name)
        except Exception as e:  # the peer may already be gone; nothing else to undo
            log.warning("nixl: remove_remote_agent(%s) failed: %s", nixl_name, e)

    def write(self, peer_name, local, remote, notif: bytes) -> int:
        return self._xfer("WRITE", peer_name, local, remote, notif)

    def read(self, peer_name, local, remote, notif: bytes) -> int:
        return self._xfer("READ", peer_name, local, remote, notif)

    def _xfer(self, op: str, peer_name, local, remote, notif: bytes) -> int:
        nixl_name = self._peers.get(peer_name)
        if nixl_name is None:
            raise TransferError(f"nixl: unknown peer {peer_name!r} (add_peer first)")
        local_descs, remote_descs = _as_descs(local), _as_descs(remote)
        if local_descs.shape[0] != remote_descs.shape[0]:
            raise ValueError(
                f"write: {local_descs.shape[0]} local descriptors but {remote_descs.shape[0]} remote"
            )
        if not np.array_equal(local_descs[:, 1], remote_descs[:, 1]):
            raise ValueError("write: local and remote descriptor sizes differ")
        handle = next(self._handles)
        if local_descs.shape[0] == 0:  # nothing to move: just tell the peer
            self._agent.send_notif(nixl_name, notif)
            self._xfers[handle] = None
            return handle
        local_mem = self._local.classify(local_descs)
        remote_mem = self._remote[peer_name].classify(remote_descs)
        if local_mem is None or remote_mem is None:
            side = "local" if local_mem is None else "remote"
            raise TransferError(
                f"nixl: cannot create transfer to {peer_name!r}: {side} memory not registered"
            )
        try:
            xfer = self._agent.initialize_xfer(
                op,
                self._agent.get_xfer_descs(local_descs, local_mem),
                self._agent.get_xfer_descs(remote_descs, remote_mem),
                nixl_name,
                notif,
            )
        except Exception as e:  # nixlNotFoundError etc.: memory not registered on either side
            raise TransferError(f"nixl: cannot create transfer to {peer_name!r}: {e!r}") from e
        # With cma this call performs the whole copy (GIL released) -- hence the dedicated thread.
        try:
            state = self._agent.transfer(xfer)
        except Exception as e:  # release the handle now, not whenever the GC collects it
            xfer.release()
            raise TransferError(f"nixl: posting transfer to {peer_name!r} failed: {e!r}") from e
        if state == "ERR":
            xfer.release()
            raise TransferError(f"nixl: posting transfer to {peer_name!r} failed")
        self._xfers[handle] = xfer
        return handle

    def status(self, handle: int) -> TransferStatus:
        if handle not in self._xfers:
            raise TransferError(f"nixl: unknown handle {handle}")
        xfer = self._xfers[handle]
        if xfer is None:
            return TransferStatus.DONE
        try:
            state = self._agent.check_xfer_state(xfer)
        except Exception as e:
            log.warning("nixl: check_xfer_state failed: %r", e)
            return TransferStatus.FAILED
        if state == "DONE":
            return TransferStatus.DONE
        if state == "PROC":
            return TransferStatus.PENDING
        return TransferStatus.FAILED

    def release(self, handle: int) -> None:
        xfer = self._xfers.pop(handle, None)
        if xfer is None:
            return
        # NIXL's UCX release "succeeds" on an in-flight transfer but cannot stop posted puts: wait
        # for the copy to end first (invariant of release(): no bytes land after we return).
        deadline = time.monotonic() + RELEASE_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self._agent.check_xfer_state(xfer) != "PROC":
                    break
            except Exception:
                break
            time.sleep(0.0005)
        try:
            xfer.release()
        except Exception as e:  # leaked; nixl_agent.__del__ retries leaked handles
            log.warning("nixl: releasing transfer %d failed: %r", handle, e)

    def get_notifications(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for nixl_name, msgs in self._agent.get_new_notifs().items():
            if isinstance(nixl_name, bytes):
                nixl_name = nixl_name.decode()
            peer = self._peer_by_nixl.get(nixl_name, nixl_name)
            out.extend((peer, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        for handle in list(self._xfers):
            self.release(handle)
        for peer in list(self._peers):
            self.remove_peer(peer)
        for descs in self._reg_descs:
            try:
                self._agent.deregister_memory(descs)
            except Exception as e:
                log.warning("nixl: deregister_memory failed: %r", e)
        self._reg_descs = []
        self._agent = None
