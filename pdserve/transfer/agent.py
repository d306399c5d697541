"""`TransferAgent`: the one thread that owns a transfer backend; engines talk to it through queues.

Who calls what, when:
- An engine creates ONE TransferAgent at startup (after any fork; engines run under spawn) with the
  regions to register (KV buffers, handoff slots, staging), then ships `metadata()` to peers in its
  registration message and calls `add_peer` for each peer registration it receives.
- The prefill scheduler calls `submit` per send and `abort` on a two-phase abort; every step it drains
  `poll_completions()` (each transfer id exactly once, DONE or FAILED).
- The decode scheduler drains `poll_notifications()` every step.
All public methods are non-blocking and thread-safe, except `metadata()`, which waits (once, at
startup) until the thread has created the backend, `wait_notifications()`, which sleeps up to its
timeout, and `close()`, which joins the thread.

Expiry: a transfer submitted with `expires_s` (the agent's `clock`) is never started past it, and one
still in flight then is aborted by this thread (reported FAILED, `stats.transfers_expired`). The prefill
passes its room's end of life: the decode frees an aborted room's pages after a lease longer than
that, which is safe only if no write of the room outlives it, even while the engine thread that
would abort them is stalled (a long step, a weight load) and this thread is not; after a paused
process resumes, this thread drops what it had not started rather than start it. Limits: one slow
`release` (NIXL waits up to 30 s for a copy it could not cancel) delays the others' expiry, and a
copy the hardware already took may still land (as for any abort).

Length (~460 lines, a third of it docstrings): one thread's loop and the commands it takes; the
backends (`fake`, `nixl`) and the emulated links (`pdserve.netem`) live in their own modules.

The thread loop: apply queued commands (add/remove peer, submit, abort) -> check pending transfers ->
drain backend notifications -> wait for the next command up to `poll_interval_s`. It polls even when
idle: with NIXL's progress thread off, notifications only arrive while someone polls. A backend
exception fails only the transfer it concerns (reported FAILED); any other exception is logged,
counted in `stats.backend_errors`, and the loop continues.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve import faults
from pdserve.transfer.base import TransferError, TransferStatus, create_backend

log = logging.getLogger(__name__)

# (transfer_id, status, latency_s, nbytes), called on the agent thread; keep it cheap (metrics).
CompletionHook = Callable[[int, TransferStatus, float, int], None]


@dataclass
class TransferStats:
    """Counters for metrics. Written by the agent thread only; readers get a `snapshot()`."""

    transfers_submitted: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    transfers_aborted: int = 0  # also counted in done or failed
    transfers_expired: int = 0  # past their `expires_s`: never started, or aborted here (also counted
    # aborted, and failed)
    bytes_submitted: int = 0
    bytes_done: int = 0
    descriptors_submitted: int = 0
    notifications_received: int = 0
    backend_errors: int = 0
    link_waits: int = 0  # submits that waited for a flow slot on a full emulated link (then went on)
    # Recent (n, submit -> final seconds), n = the transfer's place among those finished (1, 2, ...):
    # a reader takes the entries past the last n it saw (the counters and this deque are written
    # apart, so a count read between the two writes cannot pair with the wrong latency).
    latencies_s: deque = field(default_factory=lambda: deque(maxlen=4096))

    def snapshot(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "latencies_s"}
        out["latencies_s"] = list(self.latencies_s)
        return out


class _Submit(NamedTuple):
    """A submit on the command queue (`kind` first, as every command: ("abort", id), ...)."""

    kind: str  # "submit"
    transfer_id: int
    peer: str
    local: list  # (addr, nbytes) per descriptor
    remote: list
    notif: bytes
    submitted_s: float  # time.monotonic() when queued (latency)
    op: str  # "write" or "read"
    expires_s: float | None  # (the agent's `clock`) see the module docstring


@dataclass
class _Pending:
    handle: int | None  # backend handle; None if write() failed
    nbytes: int
    submitted_s: float
    expires_s: float | None = None  # (the agent's clock) aborted by the agent thread past it


class TransferAgent:
    def __init__(
        self,
        backend: str,
        agent_name: str,
        regions: list[tuple[int, int]],
        poll_interval_s: float = 0.001,
        on_complete: CompletionHook | None = None,
        start_timeout_s: float = 60.0,
        **options,
    ) -> None:
        """Start the thread; `options` go to the backend constructor (e.g. delay_s for fake)."""
        self.backend_name = backend
        self.agent_name = agent_name
        self.poll_interval_s = poll_interval_s
        self.on_complete = on_complete
        self.stats = TransferStats()
        self._start_timeout_s = start_timeout_s
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._completions: queue.SimpleQueue = queue.SimpleQueue()
        self._notifications: queue.SimpleQueue = queue.SimpleQueue()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._metadata = b""
        self._closed = False
        self.backend = None  # set by the thread; touch only from tests that own no other thread
        # Node emulation (pdserve.netem): set before the first submit. A transfer first crosses the
        # emulated compute NIC (a KV-class flow); the real copy is submitted when that flow completes,
        # so the peer sees the data (and its notification) no earlier than the emulated link allows.
        self.traffic = None
        self.clock: Callable[[], float] = time.monotonic  # of `expires_s` (tests inject a fake one)
        self._delayed: dict[int, tuple] = {}  # transfer id -> (flow, submit command); agent thread only
        self._thread = threading.Thread(
            target=self._run,
            args=(backend, agent_name, list(regions), options),
            name=f"transfer-agent-{agent_name}",
            daemon=True,
        )
        self._thread.start()

    # ---- public API (any thread) ----

    def metadata(self) -> bytes:
        """Backend metadata for peers. Blocks until the thread has started; raises TransferError if
        the backend could not be created."""
        if not self._started.wait(self._start_timeout_s):
            raise TransferError(
                f"transfer agent {self.agent_name!r} did not start in {self._start_timeout_s} s"
            )
        if self._start_error is not None:
            raise TransferError(f"transfer agent {self.agent_name!r} failed to start: {self._start_error!r}")
        return self._metadata

    def add_peer(self, name: str, metadata: bytes) -> None:
        self._commands.put(("add_peer", name, bytes(metadata)))

    def remove_peer(self, name: str) -> None:
        self._commands.put(("remove_peer", name))

    def submit(
        self,
        peer: str,
        local: list[tuple[int, int]],
        remote: list[tuple[int, int]],
        notif: bytes,
        expires_s: float | None = None,
    ) -> int:
        """Queue a write of local[i] -> remote[i] on `peer`; `notif` reaches the peer after all bytes.
        Returns a transfer id reported exactly once by `poll_completions`. TransferError once closed
        (no thread would report it). `expires_s` (by `clock`): not started past it, aborted if still
        in flight then (see the module docstring)."""
        return self._queue("write", peer, local, remote, notif, expires_s)

    def submit_read(
        self,
        peer: str,
        local: list[tuple[int, int]],
        remote: list[tuple[int, int]],
        notif: bytes,
        expires_s: float | None = None,
    ) -> int:
        """Queue a read of the peer's remote[i] into local[i]; reported by `poll_completions` like a
        write, and expires like one."""
        return self._queue("read", peer, local, remote, notif, expires_s)

    def _queue(self, op: str, peer: str, local, remote, notif: bytes, expires_s: float | None) -> int:
        with self._ids_lock:  # (with close(): a submit is queued before "close", or refused)
            self._check_open()
            transfer_id = next(self._ids)
            self._commands.put(
                _Submit(
                    "submit", transfer_id, peer, local, remote, bytes(notif), time.monotonic(), op, expires_s
                )
            )
        return transfer_id

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"transfer agent {self.agent_name!r} is closed")

    def abort(self, transfer_id: int) -> None:
        """Stop a transfer. Once it is reported (FAILED, or DONE if it had already finished), no
        further bytes of it are written. Aborting an id already reported is a no-op."""
        self._commands.put(("abort", transfer_id))

    def poll_completions(self) -> list[tuple[int, TransferStatus]]:
        return _drain(self._completions)

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        return _drain(self._notifications)

    def wait_notifications(self, timeout_s: float) -> list[tuple[str, bytes]]:
        """Like `poll_notifications`, but sleeps up to `timeout_s` for the first one: a receiver with
        nothing else to do wakes when a notification lands instead of spinning on the CPU the copy needs."""
        try:
            first = self._notifications.get(timeout=timeout_s)
        except queue.Empty:
            return []
        return [first, *_drain(self._notifications)]

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread: pending transfers are released (aborted) and the backend is closed."""
        with self._ids_lock:  # (a submit that got its id is queued before this; later ones are refused)
            if self._closed:
                return
            self._closed = True
            self._commands.put(("close",))
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- agent thread ----

    def _run(self, backend_name: str, agent_name: str, regions, options) -> None:
        backend = None
        try:
            backend = create_backend(backend_name, agent_name, **options)
            backend.register(regions)
            self._metadata = backend.local_metadata()
            self.backend = backend
        except BaseException as e:  # reported through metadata(); nothing else to run
            if isinstance(e, ImportError):  # (not installed: the reason is all there is to say)
                log.error("transfer agent %s: backend %s failed to start: %s", agent_name, backend_name, e)
            else:
                log.exception("transfer agent %s: backend %s failed to start", agent_name, backend_name)
            self._start_error = e
            if backend is not None:  # (memory it registered before the failure; its name, in-process)
                try:
                    backend.close()
                except Exception:
                    log.exception("transfer agent %s: backend close failed", agent_name)
            self._started.set()
            return
        self._started.set()
        pending: dict[int, _Pending] = {}
        running = True
        while running:
            try:
                running = self._step(backend, pending)
            except Exception:  # never die silently: log, count, keep polling
                self.stats.backend_errors += 1
                log.exception("transfer agent %s: loop error", agent_name)
                time.sleep(self.poll_interval_s)
        # Every transfer is reported and the backend closed, whatever one of them raises (a link
        # closed under this thread by a PDContext.close whose join timed out killed the thread here:
        # nothing reported, NIXL memory left registered; a review, 2026-12-04).
        try:
            for transfer_id in list(pending):
                try:
                    self._finish(backend, pending, transfer_id, TransferStatus.FAILED, aborted=True)
                except Exception:
                    log.exception("transfer agent %s: ending transfer %d failed", agent_name, transfer_id)
            for transfer_id in list(self._delayed):
                self._drop_delayed(pending, transfer_id)
        finally:
            try:
                backend.close()
            except Exception:
                log.exception("transfer agent %s: backend close failed", agent_name)

    def _step(self, backend, pending: dict[int, _Pending]) -> bool:
        """One loop iteration; returns False when asked to close."""
        timeout_s = self.poll_interval_s
        while True:
            try:
                cmd = self._commands.get(timeout=timeout_s) if timeout_s else self._commands.get_nowait()
            except queue.Empty:
                break
            timeout_s = 0  # after the first command, only drain what is already queued
            if cmd[0] == "close":
                return False
            self._apply(backend, pending, cmd)
        now = self.clock()
        active_ids = self._active_flow_ids() if self._delayed and self.traffic is not None else None
        for transfer_id, (flow, cmd) in list(self._delayed.items()):
            if _past(cmd.expires_s, now):  # (still crossing the emulated link, or stalled: nothing copied)
                self._expired(transfer_id)
                self._drop_delayed(pending, transfer_id)
            elif self._flow_done(pending, transfer_id, flow, active_ids):
                del self._delayed[transfer_id]
                self._submit(backend, pending, cmd)
        self._check_pending(backend, pending)
        try:
            notifs = backend.get_notifications()
        except Exception:
            self.stats.backend_errors += 1
            log.exception("transfer agent %s: get_notifications failed", self.agent_name)
            notifs = []
        for n in notifs:
            self._notifications.put(n)
        self.stats.notifications_received += len(notifs)
        return True

    def _apply(self, backend, pending: dict[int, _Pending], cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "submit":
            # Counted when taken, whatever follows (a link delay, a stall, a malformed list, an abort
            # before the copy): every transfer later counted done or failed was counted here first.
            self.stats.transfers_submitted += 1
            try:
                if _past(cmd.expires_s, self.clock()):  # (queued while this thread or the link was behind)
                    self._expired(cmd.transfer_id)
                    pending[cmd.transfer_id] = _Pending(None, 0, cmd.submitted_s)
                    self._finish(backend, pending, cmd.transfer_id, TransferStatus.FAILED, aborted=True)
                elif self.traffic is not None:
                    # A full link queues the flow (it starts at a later `done()`): a real NIC queues
                    # work, so a full link delays a transfer rather than failing it.
                    flow = self.traffic.transfer_start(sum(int(n) for _, n in cmd.local))
                    if flow.flow_id is None:
                        self.stats.link_waits += 1
                    self._delayed[cmd.transfer_id] = (flow, cmd)
                else:
                    self._submit(backend, pending, cmd)
            except Exception as e:  # a malformed descriptor list: fail this one
                # The command left the queue: unless reported here, its id would never be reported, and
                # a caller waiting for it (the layerwise lane) would wait out its deadline.
                self.stats.backend_errors += 1
                log.warning("transfer agent %s: submit %d failed: %r", self.agent_name, cmd.transfer_id, e)
                pending[cmd.transfer_id] = _Pending(None, 0, cmd.submitted_s)
                self._finish(backend, pending, cmd.transfer_id, TransferStatus.FAILED)
        elif kind == "abort":
            transfer_id = cmd[1]
            if transfer_id in self._delayed:
                self._drop_delayed(pending, transfer_id)
            elif transfer_id in pending:
                p = pending[transfer_id]
                status = self._status(backend, p)
                final = TransferStatus.DONE if status == TransferStatus.DONE else TransferStatus.FAILED
                self._finish(backend, pending, transfer_id, final, aborted=True)
        elif kind == "add_peer":
            try:
                backend.add_peer(cmd[1], cmd[2])
            except Exception:
                self.stats.backend_errors += 1
                log.exception("transfer agent %s: add_peer(%s) failed", self.agent_name, cmd[1])
        elif kind == "remove_peer":
            try:
                backend.remove_peer(cmd[1])
            except Exception:
                self.stats.backend_errors += 1
                log.exception("transfer agent %s: remove_peer(%s) failed", self.agent_name, cmd[1])

    def _active_flow_ids(self) -> set[int] | None:
        """The flows still crossing this engine's emulated link, read once per step for every delayed
        transfer (each flow's own `done()` read the whole link: O(flows) per transfer per step). None
        when the link cannot say: each flow is then asked alone, and a failing one dropped alone."""
        try:
            return self.traffic.cnic.active_flow_ids()
        except Exception:
            return None

    def _flow_done(self, pending: dict[int, _Pending], transfer_id: int, flow, active_ids=None) -> bool:
        """Whether a transfer has crossed its emulated link; one whose link fails (closed) is dropped
        as failed, alone: it raised out of the whole step, and every other transfer's reporting
        waited behind it."""
        try:
            return flow.done(active_ids)
        except Exception:
            log.exception("transfer agent: emulated link of transfer %d failed", transfer_id)
            self.stats.backend_errors += 1
            self._drop_delayed(pending, transfer_id)
            return False

    def _drop_delayed(self, pending: dict[int, _Pending], transfer_id: int) -> None:
        """Abort a transfer still crossing the emulated link: nothing was copied; report it failed."""
        flow, cmd = self._delayed.pop(transfer_id)
        with contextlib.suppress(Exception):  # (its link closed: nothing of it was copied either way)
            flow.cancel()
        pending[transfer_id] = _Pending(None, sum(int(n) for _, n in cmd.local), cmd.submitted_s)
        self._finish(None, pending, transfer_id, TransferStatus.FAILED, aborted=True)

    def _submit(self, backend, pending: dict[int, _Pending], cmd: tuple) -> None:
        _, transfer_id, peer, local, remote, notif, submitted_s, op, expires_s = cmd  # (a _Submit)
        nbytes = sum(int(n) for _, n in local)
        rule = faults.check("transfer.submit", op) if faults.ENABLED else None
        if (
            rule is not None and rule.action == "stall"
        ):  # never copies, never completes: only an abort ends it
            self._delayed[transfer_id] = (_NeverDone(), cmd)
            return
        self.stats.bytes_submitted += nbytes
        self.stats.descriptors_submitted += len(local)
        try:
            if rule is not None:
                raise RuntimeError("injected transfer failure")
            handle = (backend.read if op == "read" else backend.write)(peer, local, remote, notif)
        except Exception as e:
            self.stats.backend_errors += 1
            log.warning("transfer agent %s: write %d to %s failed: %r", self.agent_name, transfer_id, peer, e)
            pending[transfer_id] = _Pending(None, nbytes, submitted_s)
            self._finish(backend, pending, transfer_id, TransferStatus.FAILED)
            return
        pending[transfer_id] = _Pending(handle, nbytes, submitted_s, expires_s)

    def _status(self, backend, p: _Pending) -> TransferStatus:
        if p.handle is None:
            return TransferStatus.FAILED
        try:
            return backend.status(p.handle)
        except Exception as e:
            self.stats.backend_errors += 1
            log.warning("transfer agent %s: status failed: %r", self.agent_name, e)
            return TransferStatus.FAILED

    def _check_pending(self, backend, pending: dict[int, _Pending]) -> None:
        now = self.clock()
        for transfer_id, p in list(pending.items()):
            status = self._status(backend, p)
            if status == TransferStatus.PENDING and _past(p.expires_s, now):
                self._expired(transfer_id)  # (released before it is reported, as an abort)
                self._finish(backend, pending, transfer_id, TransferStatus.FAILED, aborted=True)
            elif status != TransferStatus.PENDING:
                self._finish(backend, pending, transfer_id, status)

    def _expired(self, transfer_id: int) -> None:
        self.stats.transfers_expired += 1
        log.warning(
            "transfer agent %s: transfer %d outlived its expiry (its room's life): aborted here",
            self.agent_name,
            transfer_id,
        )

    def _finish(
        self, backend, pending: dict[int, _Pending], transfer_id: int, status: TransferStatus, aborted=False
    ) -> None:
        """Release the backend handle, then report: the release precedes the report, so a reported id
        never writes again (the two-phase abort relies on it)."""
        p = pending.pop(transfer_id)
        if p.handle is not None:
            try:
                backend.release(p.handle)
            except Exception:
                self.stats.backend_errors += 1
                log.exception("transfer agent %s: release failed", self.agent_name)
        latency_s = time.monotonic() - p.submitted_s
        if status == TransferStatus.DONE:
            self.stats.transfers_done += 1
            self.stats.bytes_done += p.nbytes
        else:
            self.stats.transfers_failed += 1
        self.stats.transfers_aborted += int(aborted)
        self.stats.latencies_s.append((self.stats.transfers_done + self.stats.transfers_failed, latency_s))
        self._completions.put((transfer_id, status))
        if self.on_complete is not None:
            try:
                self.on_complete(transfer_id, status, latency_s, p.nbytes)
            except Exception:
                log.exception("transfer agent %s: on_complete hook failed", self.agent_name)


class _NeverDone:
    """The flow of a stalled transfer (fault injection): it never completes."""

    def done(self, active_ids=None) -> bool:
        return False

    def cancel(self) -> None:
        pass


def _past(expires_s: float | None, now: float) -> bool:
    return expires_s is not None and now > expires_s


def _drain(q: queue.SimpleQueue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
