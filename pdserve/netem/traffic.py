"""`TrafficManager`: one per engine process, it routes the engine's byte moves onto the emulated NICs.

Who: an engine process builds one from its `NodeConfig`; the store connector calls `storage_read_start`
/ `storage_write` (the node's storage NIC, shared by all engines of the node: its link file is
`{node_dir}/{node}.snic`), the KV transfer path calls `transfer_start` (this engine's own compute NIC,
`{node_dir}/{node}.{engine}.cnic`); schedulers read `read_queue_bytes` (node-wide backlog of storage
reads) and metrics read `snapshot`. With the default infinite rates no file is created and every move is
done at once, so production code can call it unconditionally.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path

from pdserve.netem.link import (
    MAX_POLL_S,
    TAG_READ,
    TAG_TRANSFER,
    TAG_WRITE,
    LinkFullError,
    SharedLink,
    TrafficClass,
)

_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class NodeConfig:
    """Where an engine sits and its NIC budgets (bytes/s; `math.inf` = unlimited, no emulation).

    All engines of one node must pass the same `node`, `node_dir`, `snic_bytes_per_s` and `weights`
    (else `LinkConfigError` on open); `engine` must be unique within the node.
    """

    node: str
    node_dir: str
    snic_bytes_per_s: float = math.inf
    cnic_bytes_per_s: float = math.inf
    engine: str = "e0"
    weights: tuple[float, float] = (99, 1)  # (MODEL, KV) GPS weights

    def __post_init__(self):
        for field, name in (("node", self.node), ("engine", self.engine)):
            if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or set(name) == {"."}:
                raise ValueError(f"NodeConfig.{field} must match [A-Za-z0-9_.-]+, got {name!r}")
        for field in ("snic_bytes_per_s", "cnic_bytes_per_s"):
            if not getattr(self, field) > 0:  # also rejects NaN
                raise ValueError(f"NodeConfig.{field} must be > 0 (math.inf = unlimited)")
        if len(self.weights) != 2 or not all(0 < w < math.inf for w in self.weights):
            raise ValueError(f"NodeConfig.weights must be two positive finite numbers, got {self.weights}")
        object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))  # hashable, exact


class Flow:
    """Handle of one started move: `done()` (non-blocking), `wait(timeout_s)`, `cancel()`.

    A flow may be queued rather than started (`flow_id` None): its link had every flow slot taken.
    A real NIC queues work instead of refusing it; so do we, first come first served among this
    process's flows of the link (`link.waiting`): a new flow queues behind any waiting one, and a
    waiting flow's `done()` or `wait()` starts waiting flows from the oldest, up to itself, as slots
    free. (A queued flow retried only at its own polls, and a newer flow took every freed slot
    first: an old transfer waited until it expired. Flows of other processes sharing the link are
    not ordered with these.)"""

    __slots__ = ("link", "flow_id", "_queued")

    def __init__(self, link: SharedLink, flow_id: int | None, queued: tuple | None = None):
        self.link, self.flow_id, self._queued = link, flow_id, queued

    @classmethod
    def start_or_queue(cls, link: SharedLink, nbytes: int, traffic: TrafficClass, tag: int) -> Flow:
        with link.waiting_lock:
            if not link.waiting:
                try:
                    return cls(link, link.start(nbytes, traffic, tag))
                except LinkFullError:
                    pass
            flow = cls(link, None, (nbytes, traffic, tag))
            link.waiting.append(flow)
            return flow

    def _try_start(self) -> bool:
        if self.flow_id is None and self._queued is not None:
            with self.link.waiting_lock:
                waiting = self.link.waiting
                while waiting and self.flow_id is None:  # (oldest first, up to this one)
                    head = waiting[0]
                    try:
                        head.flow_id = self.link.start(*head._queued)
                    except LinkFullError:
                        break
                    head._queued = None
                    waiting.popleft()
        return self.flow_id is not None

    @property
    def queued_bytes(self) -> int:
        """Bytes of a flow still waiting for a slot (0 once started or cancelled)."""
        return 0 if self._queued is None else int(self._queued[0])

    def done(self, active_ids: AbstractSet[int] | None = None) -> bool:
        """Whether the flow has crossed its link. `active_ids`: the link's `active_flow_ids()` taken
        just before, for a caller that checks many flows at once (one pass over the link, not one per
        flow); a flow that starts in this call is looked up on the link itself."""
        started = self.flow_id is not None
        if not self._try_start():
            return self._queued is None  # (cancelled before it started: nothing left to cross)
        if active_ids is None or not started:
            return self.link.done(self.flow_id)
        return self.flow_id not in active_ids

    def wait(self, timeout_s: float | None = None) -> None:
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._try_start():
            if self._queued is None:
                return  # cancelled before it started
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise TimeoutError(f"flow on {self.link.path}: still waiting for a flow slot")
            time.sleep(MAX_POLL_S)
        self.link.wait(self.flow_id, None if deadline_s is None else max(0.0, deadline_s - time.monotonic()))

    def cancel(self) -> None:
        with self.link.waiting_lock:
            if self.flow_id is None:  # (still waiting for a slot: it leaves the queue, never starts)
                if self._queued is not None:
                    self._queued = None
                    self.link.waiting.remove(self)
                return
        self.link.cancel(self.flow_id)


class TrafficManager:
    """The engine's links: `snic` and `snic_tx` (the node-shared storage NIC's receive and transmit
    directions: a NIC is full duplex, so write-back never takes read bandwidth, as in the paper where
    the SNIC's B is per direction) and `cnic` (its own compute NIC)."""

    def __init__(self, config: NodeConfig):
        self.config = config
        node_dir = Path(config.node_dir)
        if math.isfinite(config.snic_bytes_per_s) or math.isfinite(config.cnic_bytes_per_s):
            node_dir.mkdir(parents=True, exist_ok=True)
        self.snic = SharedLink(node_dir / f"{config.node}.snic", config.snic_bytes_per_s, config.weights)
        try:
            self.snic_tx = SharedLink(
                node_dir / f"{config.node}.snic.tx", config.snic_bytes_per_s, config.weights
            )
            self.cnic = SharedLink(
                node_dir / f"{config.node}.{config.engine}.cnic", config.cnic_bytes_per_s, config.weights
            )
        except BaseException:
            self.snic.close()
            if hasattr(self, "snic_tx"):
                self.snic_tx.close()
            raise

    def storage_read_start(self, nbytes: int, cls: TrafficClass = TrafficClass.KV) -> Flow:
        """Start a read from storage over the node's SNIC (non-blocking; queued when the SNIC has
        every flow slot taken: the store thread's `wait` starts it)."""
        return Flow.start_or_queue(self.snic, nbytes, cls, TAG_READ)

    def storage_write(self, nbytes: int, cls: TrafficClass = TrafficClass.KV) -> None:
        """Write to storage over the node's SNIC (transmit side); blocks until the bytes are through
        (first for a flow slot, when every one is taken)."""
        Flow.start_or_queue(self.snic_tx, nbytes, cls, TAG_WRITE).wait()

    def transfer_start(self, nbytes: int, cls: TrafficClass = TrafficClass.KV) -> Flow:
        """Start an engine-to-engine transfer over this engine's CNIC (non-blocking; queued when the
        CNIC has every flow slot taken: the caller's next `done()` may start it)."""
        return Flow.start_or_queue(self.cnic, nbytes, cls, TAG_TRANSFER)

    def read_queue_bytes(self) -> int:
        """Unserved bytes of storage reads on this node's SNIC, from every engine of the node, and
        this engine's reads still waiting for a flow slot (the scheduler's read queue: with every slot
        taken, it was capped at what 256 flows held, exactly when the SNIC was most behind)."""
        with self.snic.waiting_lock:
            queued = sum(f.queued_bytes for f in self.snic.waiting if f._queued[2] == TAG_READ)
        return self.snic.pending_bytes(tag=TAG_READ) + queued

    def snapshot(self) -> dict:
        return {
            "node": self.config.node,
            "engine": self.config.engine,
            "snic": self.snic.stats(),
            "snic_tx": self.snic_tx.stats(),
            "cnic": self.cnic.stats(),
            "read_queue_bytes": self.read_queue_bytes(),
        }

    def close(self) -> None:
        self.snic.close()
        self.snic_tx.close()
        self.cnic.close()

    def __enter__(self) -> TrafficManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
