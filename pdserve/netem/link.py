"""`SharedLink`: one emulated NIC, a fluid weighted-fair (GPS) link whose state lives in shared memory.

Who: `TrafficManager` (traffic.py) opens one per NIC (the node's storage NIC is shared by all engine
processes of the node; each engine's compute NIC is its own); tests call it directly. Every byte move is
a *flow*: `start` registers it (non-blocking), `wait`/`done` observe it, the link serves it at its fair
share of `bytes_per_s`.

Model. Capacity is shared among the active flows by generalized processor sharing: between traffic
classes by weight, counting only classes that have active flows (so KV takes all idle capacity, and with
both active MODEL gets w_model/(w_model+w_kv) = 99/100 and KV 1/100: KV never starves), and equally
among the flows of one class. This is the fluid limit of weighted round robin with infinitesimal quanta:
MODEL traffic is slowed by at most w_kv/(w_model+w_kv) (~1%) by a saturating KV flow and is never
blocked behind a KV quantum. The state is advanced lazily, on every locked operation, from
`last_update_s` to now; flows finishing mid-interval are handled by water-filling (advance to the
earliest finish, remove that flow, redistribute, repeat), so the result does not depend on how often
anyone polls.

Sharing. The state is a fixed-size file (a `struct`-packed header plus a slot table of `max_flows`
flows) mapped with `mmap`; `fcntl.flock` on it excludes other processes, a `threading.Lock` other
threads (flock is per open file description, which threads share). Time is `time.monotonic()`
(CLOCK_MONOTONIC, system-wide on Linux), injectable as `clock` for deterministic single-process tests;
all users of one file must share a clock. A flow whose owner process died is reaped (at most once per
`reap_interval_s`), so a killed engine never blocks a link forever. Invariant: every issued flow id is
active, completed, cancelled or reaped; a completed flow's slot is freed at once, and `done(id)` is
True for any issued id no longer in the table.

Real deployments set every budget to infinity (`bytes_per_s=math.inf`: no file, every flow done at
once) and map the classes to the NIC's QoS instead: InfiniBand service levels via `UCX_IB_SL`, with VL
arbitration weights in OpenSM (`qos_high_limit`, `vlarb_high`, `vlarb_low`); on RoCE, DSCP -> traffic
class via `UCX_IB_TRAFFIC_CLASS`, with PFC and proportional (ETS) weights on the switch.
"""

from __future__ import annotations

import collections
import fcntl
import math
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path


class TrafficClass(IntEnum):
    MODEL = 0  # high priority (weights, activations on the critical path)
    KV = 1  # low priority (KV-cache reads, writes, transfers)


TAG_OTHER, TAG_READ, TAG_WRITE, TAG_TRANSFER = 0, 1, 2, 3
TAG_NAMES = ("other", "read", "write", "transfer")
NUM_CLASSES, NUM_TAGS = 2, 4
MAX_POLL_S = 0.002  # `wait` re-checks at least this often (the rates change when other flows come/go)

_MAGIC = b"PDNETEM1"
# magic, max_flows | bytes_per_s, w_model, w_kv, created_s, last_update_s, last_reap_s
# | next_id, completed, cancelled, reaped | served bytes per class | served bytes per tag
_HEADER = struct.Struct(f"<8sQ6d4Q{NUM_CLASSES}d{NUM_TAGS}d")
_RATE, _CREATED, _UPDATED, _REAPED_AT, _NEXT_ID, _COMPLETED, _CANCELLED, _REAPED = 2, 5, 6, 7, 8, 9, 10, 11
_SERVED_CLS, _SERVED_TAG = 12, 12 + NUM_CLASSES  # first index of each counter array in the header
_SLOT = struct.Struct("<QqBB6xdd")  # flow_id (0 = free), owner pid, cls, tag, total_bytes, remaining_bytes


class LinkConfigError(ValueError):
    """The link file exists with another rate/weights/size, or is not a link file, or bad arguments."""


class LinkFullError(RuntimeError):
    """All `max_flows` slots of the link are taken by active flows."""


class LinkIntegrityError(AssertionError):
    """`check_integrity` found an inconsistent state (a bug, or a foreign writer)."""


class _Flow:
    __slots__ = ("slot", "flow_id", "pid", "cls", "tag", "total_bytes", "remaining_bytes")

    def __init__(self, slot, flow_id, pid, cls, tag, total_bytes, remaining_bytes):
        self.slot, self.flow_id, self.pid, self.cls, self.tag = slot, flow_id, pid, cls, tag
        self.total_bytes, self.remaining_bytes = total_bytes, remaining_bytes


# Every open link of this process: a forked child gets fresh thread locks (one a thread held at the
# fork stays held in the child, which then blocked on its first use of the link).
_LINKS: weakref.WeakSet = weakref.WeakSet()


def _fresh_locks_after_fork() -> None:
    for link in list(_LINKS):
        link._tlock = threading.Lock()
        link.waiting_lock = threading.Lock()
        link.waiting = collections.deque()  # (the parent's queued flows are the parent's)


os.register_at_fork(after_in_child=_fresh_locks_after_fork)


class SharedLink:
    """One rate-limited link shared by every process that opens the same `path` (see module doc)."""

    def __init__(
        self,
        path: str | Path,
        bytes_per_s: float,
        weights: tuple[float, float] = (99, 1),
        max_flows: int = 256,
        *,
        clock: Callable[[], float] = time.monotonic,
        reap_interval_s: float = 1.0,
    ):
        if not bytes_per_s > 0:
            raise LinkConfigError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        if len(weights) != NUM_CLASSES or not all(0 < w < math.inf for w in weights):
            raise LinkConfigError(f"weights must be {NUM_CLASSES} positive finite numbers, got {weights}")
        if max_flows < 1:
            raise LinkConfigError(f"max_flows must be >= 1, got {max_flows}")
        self.path, self.bytes_per_s = Path(path), float(bytes_per_s)
        self.weights = (float(weights[0]), float(weights[1]))
        self.max_flows, self.reap_interval_s, self._clock = max_flows, reap_interval_s, clock
        self._tlock = threading.Lock()
        self._state_buf: bytearray | None = None  # inside `_state`: the private copy being changed
        _LINKS.add(self)
        # This process's flows waiting for a slot, oldest first (`traffic.Flow`: FIFO among them).
        self.waiting: collections.deque = collections.deque()
        self.waiting_lock = threading.Lock()
        self._fd, self._mm = -1, None
        self.eps_bytes = 1e-6 + self.bytes_per_s * 1e-9  # rounding slack: 1 ns of link time
        self.unlimited = math.isinf(self.bytes_per_s)
        if self.unlimited:  # zero-cost path: no file, ids and counters are process-local
            self._next_id, self._served_cls, self._served_tag = 1, [0.0] * NUM_CLASSES, [0.0] * NUM_TAGS
        else:
            self._open()

    # ---- file and locking -------------------------------------------------------------------------
    def _open(self) -> None:
        size = _HEADER.size + self.max_flows * _SLOT.size
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self._pid = os.getpid()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._open_locked(size)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            self.close()
            raise

    def _open_locked(self, size: int) -> None:
        st_size, now_s = os.fstat(self._fd).st_size, self._clock()
        if st_size not in (0, size) or (st_size and os.pread(self._fd, len(_MAGIC), 0) != _MAGIC):
            raise LinkConfigError(f"{self.path}: not a link file of {self.max_flows} flow slots")
        if st_size:
            h = list(_HEADER.unpack_from(os.pread(self._fd, _HEADER.size, 0)))
            if not (math.isclose(h[_RATE], self.bytes_per_s) and tuple(h[3:5]) == self.weights):
                raise LinkConfigError(
                    f"{self.path} exists with bytes_per_s={h[_RATE]} weights={tuple(h[3:5])}, "
                    f"opened with bytes_per_s={self.bytes_per_s} weights={self.weights}"
                )
        # A new file, or one whose time is ahead of the clock (left over from before a reboot): reset.
        if not st_size or h[_UPDATED] > now_s + 1.0:
            hdr = (_MAGIC, self.max_flows, self.bytes_per_s, *self.weights, now_s, now_s, now_s, 1, 0, 0, 0)
            zeros = [0.0] * (NUM_CLASSES + NUM_TAGS)
            os.pwrite(self._fd, _HEADER.pack(*hdr, *zeros) + bytes(size - _HEADER.size), 0)
        self._mm = mmap.mmap(self._fd, size)

    @contextmanager
    def _locked(self):
        if self._mm is None:
            raise ValueError(f"link {self.path} is closed")
        with self._tlock:
            if os.getpid() != self._pid:  # forked: the inherited fd shares our parent's flock
                self._mm.close()
                os.close(self._fd)
                self._open()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def _view(self):
        """Where the state is read and written: inside `_state` its private copy, else the file."""
        return self._state_buf if self._state_buf is not None else self._mm

    def _read_header(self) -> list:
        return list(_HEADER.unpack_from(self._view, 0))

    def _read_flows(self) -> list[_Flow]:
        raw = self._view[_HEADER.size : _HEADER.size + self.max_flows * _SLOT.size]
        return [_Flow(i, *t) for i, t in enumerate(_SLOT.iter_unpack(raw)) if t[0] != 0]

    def _write_slot(self, f: _Flow) -> None:
        vals = (f.flow_id, f.pid, f.cls, f.tag, f.total_bytes, f.remaining_bytes)
        _SLOT.pack_into(self._view, _HEADER.size + f.slot * _SLOT.size, *vals)

    @contextmanager
    def _state(self):
        """Locked, advanced to now: yields (header list, active flows); writes both back on exit.

        Every change goes to a private copy of the file's state, written back in one copy at the end:
        written piece by piece (freed slots during the advance, the header, then each slot), a process
        killed in between left a mix of old and new (ids issued != completed + cancelled + reaped +
        active; a flow's bytes served twice, faster than the rate)."""
        with self._locked():
            size = _HEADER.size + self.max_flows * _SLOT.size
            self._state_buf = bytearray(self._mm[:size])
            try:
                h, flows = self._read_header(), self._read_flows()
                self._advance(h, flows, self._clock())
                try:
                    yield h, flows  # callers raise only before they mutate, so writing back is always safe
                finally:
                    _HEADER.pack_into(self._state_buf, 0, *h)
                    for f in flows:
                        self._write_slot(f)
                    self._mm[:size] = self._state_buf
            finally:
                self._state_buf = None

    # ---- fluid model --------------------------------------------------------------------------------
    def _rates(self, flows: list[_Flow]) -> list[float]:
        """Per-flow bytes/s: GPS among the classes with active flows, equal shares within a class."""
        counts = [0] * NUM_CLASSES
        for f in flows:
            counts[f.cls] += 1
        total_weight = sum(w for w, n in zip(self.weights, counts, strict=True) if n)
        return [self.bytes_per_s * self.weights[f.cls] / total_weight / counts[f.cls] for f in flows]

    def _advance(self, h: list, flows: list[_Flow], now_s: float) -> None:
        """Serve `flows` from h.last_update_s to `now_s` (water-filling); free finished/dead flows' slots."""
        dt_s, h[_UPDATED] = max(0.0, now_s - h[_UPDATED]), max(now_s, h[_UPDATED])
        active = list(flows)
        while dt_s > 0 and active:
            rates = self._rates(active)
            finish_s = [f.remaining_bytes / r for f, r in zip(active, rates, strict=True)]
            step_s = min(dt_s, min(finish_s))
            for f, r, t in zip(active, rates, finish_s, strict=True):
                served = f.remaining_bytes if t <= step_s else r * step_s
                if f.remaining_bytes - served <= self.eps_bytes:  # float time: finish within ~1 ns
                    served = f.remaining_bytes
                f.remaining_bytes -= served
                h[_SERVED_CLS + f.cls] += served
                h[_SERVED_TAG + f.tag] += served
            dt_s = 0.0 if step_s == dt_s else dt_s - step_s
            active = [f for f in active if f.remaining_bytes > 0]
        for f in flows:
            if f.remaining_bytes <= 0:
                f.flow_id, h[_COMPLETED] = 0, h[_COMPLETED] + 1  # completed
        if now_s - h[_REAPED_AT] >= self.reap_interval_s:
            h[_REAPED_AT] = now_s
            for f in flows:
                if f.flow_id and not _pid_alive(f.pid):
                    f.flow_id, h[_REAPED] = 0, h[_REAPED] + 1  # reaped
        for f in [f for f in flows if f.flow_id == 0]:
            self._write_slot(f)  # the slot is free now
            flows.remove(f)

    # ---- API ----------------------------------------------------------------------------------------
    def start(self, nbytes: int, cls: TrafficClass, tag: int = TAG_OTHER) -> int:
        """Register a flow of `nbytes` (non-blocking); returns its id. 0 bytes: done at once."""
        cls, tag = TrafficClass(cls), int(tag)
        if nbytes < 0 or not 0 <= tag < NUM_TAGS:
            raise ValueError(f"bad flow: nbytes={nbytes} tag={tag}")
        if self.unlimited:
            self._served_cls[cls] += nbytes
            self._served_tag[tag] += nbytes
            self._next_id += 1
            return self._next_id - 1
        with self._state() as (h, flows):
            used = {f.slot for f in flows}
            slot = next((i for i in range(self.max_flows) if i not in used), None)
            if slot is None and nbytes:
                raise LinkFullError(f"{self.path}: all {self.max_flows} flow slots are active")
            flow_id, h[_NEXT_ID] = h[_NEXT_ID], h[_NEXT_ID] + 1
            if nbytes == 0:
                h[_COMPLETED] += 1
                return flow_id
            flows.append(_Flow(slot, flow_id, os.getpid(), int(cls), tag, float(nbytes), float(nbytes)))
            return flow_id

    def _remaining(self, flow_id: int) -> tuple[float, float]:
        """(remaining bytes, current bytes/s) of an active flow; (0, inf) once it is done."""
        if self.unlimited:
            return 0.0, math.inf
        with self._state() as (h, flows):
            if not 0 < flow_id < h[_NEXT_ID]:
                raise ValueError(f"flow id {flow_id} was never issued by {self.path}")
            for f, r in zip(flows, self._rates(flows), strict=True):
                if f.flow_id == flow_id:
                    return f.remaining_bytes, r
            return 0.0, math.inf

    def done(self, flow_id: int) -> bool:
        return self._remaining(flow_id)[0] == 0

    def active_flow_ids(self) -> set[int]:
        """The ids of the flows still crossing the link, in one locked pass: an issued id not in it is
        done. (A caller with many flows to check asks once, not `done` per flow: each call reads and
        advances the whole slot table, ~0.4 ms at 256 flows.)"""
        if self.unlimited:
            return set()
        with self._state() as (_, flows):
            return {f.flow_id for f in flows}

    def wait(self, flow_id: int, timeout_s: float | None = None) -> None:
        """Block until the flow is done: sleep to its predicted finish (at most MAX_POLL_S), re-check."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining_bytes, bytes_per_s = self._remaining(flow_id)
            if remaining_bytes == 0:
                return
            sleep_s = min(remaining_bytes / bytes_per_s, MAX_POLL_S)
            if deadline_s is not None:
                left_s = deadline_s - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError(f"flow {flow_id} on {self.path}: {remaining_bytes:.0f} bytes left")
                sleep_s = min(sleep_s, left_s)
            time.sleep(sleep_s)

    def cancel(self, flow_id: int) -> None:
        """Drop the flow if still active (its unserved bytes are never served)."""
        if self.unlimited:
            return
        with self._state() as (h, flows):
            for f in flows:
                if f.flow_id == flow_id:
                    f.flow_id, h[_CANCELLED] = 0, h[_CANCELLED] + 1
                    self._write_slot(f)
                    flows.remove(f)
                    return

    def transmit(self, nbytes: int, cls: TrafficClass, tag: int = TAG_OTHER) -> None:
        self.wait(self.start(nbytes, cls, tag))

    def pending_bytes(self, tag: int | None = None, cls: TrafficClass | None = None) -> int:
        """Remaining bytes of the active flows (all processes), optionally filtered by tag and class."""
        if self.unlimited:
            return 0
        with self._state() as (_, flows):
            sel = [f for f in flows if (tag is None or f.tag == tag) and (cls is None or f.cls == cls)]
            return math.ceil(sum(f.remaining_bytes for f in sel))

    def stats(self) -> dict:
        """Cumulative counters (sample twice and divide by the interval for utilization)."""
        if self.unlimited:
            served_cls, served_tag, counts, h = self._served_cls, self._served_tag, [0, 0], None
        else:
            with self._state() as (h, flows):
                served_cls, served_tag = h[_SERVED_CLS:_SERVED_TAG], h[_SERVED_TAG:]
                counts = [sum(f.cls == c for f in flows) for c in range(NUM_CLASSES)]
        return {
            "bytes_per_s": self.bytes_per_s,
            "weights": self.weights,
            "served_bytes_by_class": {c.name: served_cls[c] for c in TrafficClass},
            "served_bytes_by_tag": dict(zip(TAG_NAMES, served_tag, strict=True)),
            "active_flows_by_class": {c.name: counts[c] for c in TrafficClass},
            "completed_flows": self._next_id - 1 if h is None else h[_COMPLETED],
            "cancelled_flows": 0 if h is None else h[_CANCELLED],
            "reaped_flows": 0 if h is None else h[_REAPED],
        }

    def check_integrity(self) -> None:
        """Raise LinkIntegrityError unless the raw (not advanced) state is consistent."""
        if self.unlimited:
            return
        with self._locked():
            h, flows, problems = self._read_header(), self._read_flows(), []
            ids = [f.flow_id for f in flows]
            if len(set(ids)) != len(ids) or any(not 0 < i < h[_NEXT_ID] for i in ids):
                problems.append(f"bad flow ids {ids} (next_id {h[_NEXT_ID]})")
            for f in flows:
                if not (0 < f.remaining_bytes <= f.total_bytes and f.cls < NUM_CLASSES and f.tag < NUM_TAGS):
                    problems.append(f"bad slot {f.slot}: {f.cls=} {f.tag=} {f.remaining_bytes=}")
            if h[_COMPLETED] + h[_CANCELLED] + h[_REAPED] + len(flows) != h[_NEXT_ID] - 1:
                problems.append(
                    f"{h[_NEXT_ID] - 1} ids issued != {h[_COMPLETED]}+{h[_CANCELLED]}+{h[_REAPED]}+{len(flows)}"
                )
            served_bytes = sum(h[_SERVED_CLS:_SERVED_TAG])
            capacity_bytes = self.bytes_per_s * (h[_UPDATED] - h[_CREATED])
            if served_bytes > capacity_bytes * (1 + 1e-9) + self.eps_bytes * (h[_COMPLETED] + 1):
                problems.append(f"served {served_bytes} bytes > capacity {capacity_bytes}")
            if not math.isclose(served_bytes, sum(h[_SERVED_TAG:]), rel_tol=1e-9, abs_tol=1e-6):
                problems.append("served bytes by class and by tag disagree")
            if min(h[_SERVED_CLS:]) < 0:
                problems.append("negative served bytes")
        if problems:
            raise LinkIntegrityError(f"{self.path}: " + "; ".join(problems))

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SharedLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only (a zombie, not yet joined, still counts as alive)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        pass
    return True


def transmit_all(links: Iterable[SharedLink], nbytes: int, cls: TrafficClass, tag: int = TAG_OTHER) -> None:
    """A move crossing several links (e.g. SNIC then CNIC): a flow on each, wait for all (fluid: the
    slowest link's share bounds the move; no store-and-forward delay is modelled)."""
    started: list[tuple[SharedLink, int]] = []
    try:
        for link in links:
            started.append((link, link.start(nbytes, cls, tag)))
    except BaseException:  # (LinkFullError on a later link: the earlier flows moved nothing for it)
        for link, flow_id in started:
            link.cancel(flow_id)
        raise
    for link, flow_id in started:
        link.wait(flow_id)
