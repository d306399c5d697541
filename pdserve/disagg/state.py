"""Per-room transfer state on one side of a PD pair, with a deadline in every state, and the two-phase
abort that makes freeing a decode page safe.

Who uses it: each engine's scheduler thread owns one `RoomTable` (prefill and decode alike) and, on the
decode, one `AbortTracker`. Pure Python, single-threaded (no locks), time from an injectable clock.

States (`KVState`) only move forward: Bootstrapping -> WaitingForInput -> Transferring -> Success.
Failed can be entered from any non-terminal state and always wins; Success and Failed are terminal and
never change. Every non-terminal state has its own deadline, measured from the moment the room
entered that state; `expired()` fails the overdue rooms so no room can be stuck anywhere (SGLang has no
deadline in P WaitingForInput/Transferring nor D Bootstrapping). A room id is held from `create` until
`remove` (only allowed once terminal); creating a held id raises DuplicateRoom instead of corrupting
the other request's state.

## Two-phase abort: why a page freed on the decode is never written by a late copy

Only the prefill writes into decode memory (KV pages, staging bytes, the handoff slot), and only for a
room whose KVRequest it received. The decode frees a room's destination pages and slot in exactly
three cases:

1. **Success**: the decode saw every write complete (transfer notification) and the handoff gate pass.
   The prefill issues no write after the last one (the handoff is written last, after all pages).
2. **Peer acknowledged**: the decode marks the room Failed (it will never commit it), sends Abort, and
   calls `AbortTracker.begin(room, lease_s)`. The prefill, on Abort, first marks its room Failed (its
   scheduler submits nothing more for it), then asks its transfer backend to cancel the room's writes
   and waits until the backend reports every write it submitted for the room completed or released,
   and only then sends AbortAck. A prefill that never received the room's KVRequest acks at once: it
   cannot know the destination, and the control channel is FIFO per peer (one PUSH socket, one TCP
   stream), so a KVRequest sent before the Abort cannot arrive after it; the prefill keeps a tombstone
   of aborted rooms so a late router request for the same room is refused. A prefill-side failure is
   reported with Status(Failed), sent under the same condition, so the decode frees on it directly;
   a room the prefill failed before its KVRequest came leaves a tombstone too, and the late KVRequest
   is answered Status(Failed) at once (nothing of the room was ever written).
3. **Lease expiry** (the prefill died, is partitioned, or the ack was lost): the decode frees after
   `lease_s` without an ack. This is safe when `lease_s` exceeds the longest time the prefill may
   still write for the room after the decode sent Abort. A prefill room lives at most the sum of its
   non-terminal deadlines from creation (each state is entered at most once and each has a deadline;
   on expiry the room is Failed, which stops submission, and the backend's abort bounds the in-flight
   tail). `min_lease_s(prefill_deadlines_s, margin_s)` computes that sum plus a margin that must cover
   the in-flight tail and control-message delivery delay; the decode should use at least that.
   The prefill must drop buffered (early) KVRequests after its Bootstrapping deadline so a stale one
   cannot start a room later.

`ready_to_free()` returns each room once: a late AbortAck after a lease expiry is ignored (no double
free), and an ack for a room never begun is ignored.
"""

from __future__ import annotations

import enum
import heapq
import math
import secrets
import time
from collections.abc import Callable

MAX_ROOM = 2**63 - 1


# A prefill room's failure reason when a write to its decode failed; the prefill's answer to the router
# then says "prefill failed: transfer failed", and the router looks at the decode (`Router._attempts`).
TRANSFER_FAILED = "transfer failed"


def new_room() -> int:
    """A random 63-bit room id (never 0: a zero room in a handoff slot means 'not landed'). Here, not
    with the engine roles: the router makes rooms, and it never imports torch (DESIGN §7)."""
    return secrets.randbits(63) or 1


class KVState(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = frozenset({KVState.Failed, KVState.Success})
NON_TERMINAL = (KVState.Bootstrapping, KVState.WaitingForInput, KVState.Transferring)


class DuplicateRoom(ValueError):
    """`create` of a room id that is still held (active, or terminal and not yet removed)."""


class UnknownRoom(KeyError):
    """A room id that is not in the table."""


def _check_room(room: int) -> None:
    if not isinstance(room, int) or isinstance(room, bool) or not 0 < room <= MAX_ROOM:
        raise ValueError(f"room must be an int in (0, 2**63): {room!r}")


class _Entry:
    __slots__ = ("state", "entered_s", "reason", "epoch")

    def __init__(self, state: KVState, entered_s: float, epoch: int) -> None:
        self.state = state
        self.entered_s = entered_s  # clock time the current state was entered
        self.reason = ""  # why it failed; "" unless state is Failed
        self.epoch = epoch  # bumped on every state change; stale heap entries carry an older one


class RoomTable:
    """room -> state, entry time and failure reason. See the module docstring for the rules."""

    def __init__(
        self, deadlines_s: dict[KVState, float], clock: Callable[[], float] = time.monotonic
    ) -> None:
        for s in NON_TERMINAL:
            d = deadlines_s.get(s)
            if d is None or not (isinstance(d, int | float) and math.isfinite(d) and d > 0):
                raise ValueError(
                    f"a finite deadline > 0 is required for every non-terminal state; {s.name}: {d!r}"
                )
        self.deadlines_s = {s: float(deadlines_s[s]) for s in NON_TERMINAL}
        self._clock = clock
        self._rooms: dict[int, _Entry] = {}
        # Min-heap of (deadline time, room, epoch) for active rooms; an entry is live only while its epoch
        # equals the room's current epoch (lazy deletion keeps `expired` O(k log n), not O(n)).
        self._heap: list[tuple[float, int, int]] = []
        self._epoch = 0
        self.num_expired = 0  # rooms failed by a deadline, for metrics

    # ---- mutations -----------------------------------------------------------------------------
    def create(self, room: int, state: KVState = KVState.Bootstrapping) -> None:
        _check_room(room)
        state = KVState(state)
        if state in TERMINAL:
            raise ValueError(f"a room starts in a non-terminal state, not {state.name}")
        if room in self._rooms:
            raise DuplicateRoom(f"room {room} is already held (state {self._rooms[room].state.name})")
        self._rooms[room] = _Entry(state, 0.0, 0)
        self._enter(room, state)

    def advance(self, room: int, new_state: KVState) -> KVState:
        """Move forward to new_state; a backward or same-state move is ignored (the deadline clock of the
        current state keeps running). Failed wins from any non-terminal state. Returns the state now."""
        e = self._get(room)
        new_state = KVState(new_state)
        if e.state in TERMINAL:
            return e.state
        if new_state == KVState.Failed:
            self.fail(room, "failed")
        elif new_state > e.state:
            self._enter(room, new_state)
        return e.state

    def fail(self, room: int, reason: str) -> None:
        """Mark Failed with a reason; no-op on a terminal room (the first outcome stands)."""
        e = self._get(room)
        if e.state in TERMINAL:
            return
        self._enter(room, KVState.Failed)
        e.reason = reason or "failed"

    def expired(self) -> list[int]:
        """Fail every active room whose current state outlived its deadline (strictly: now > entry +
        deadline), with reason "deadline in <State>"; return them in deadline order."""
        now = self._clock()
        out = []
        while self._heap and self._heap[0][0] < now:
            _, room, epoch = heapq.heappop(self._heap)
            e = self._rooms.get(room)
            if e is None or e.epoch != epoch:
                continue  # stale: the room moved on or was removed
            self.fail(room, f"deadline in {e.state.name}")
            self.num_expired += 1
            out.append(room)
        return out

    def remove(self, room: int) -> None:
        """Forget a terminal room and free its id. Removing an active room is a caller bug."""
        e = self._get(room)
        if e.state not in TERMINAL:
            raise ValueError(f"room {room} is still active ({e.state.name}); fail it first")
        del self._rooms[room]
        if len(self._heap) > 64 and len(self._heap) > 4 * len(self._rooms):
            self._compact()

    # ---- queries -------------------------------------------------------------------------------
    def state(self, room: int) -> KVState:
        return self._get(room).state

    def reason(self, room: int) -> str:
        return self._get(room).reason

    def deadline_s(self, room: int) -> float | None:
        """Clock time at which the room's current state expires; None when terminal."""
        e = self._get(room)
        return None if e.state in TERMINAL else e.entered_s + self.deadlines_s[e.state]

    def now(self) -> float:
        """The table's clock (injectable: the roles time their peers' registrations by it too)."""
        return self._clock()

    def time_left_s(self, room: int) -> float:
        """Seconds before the room's current state expires (0 when terminal or already past)."""
        deadline = self.deadline_s(room)
        return 0.0 if deadline is None else max(0.0, deadline - self._clock())

    def ended(self, room: int) -> bool:
        """Terminal, or past its state's deadline (strictly, as `expired` decides: not yet failed)."""
        deadline = self.deadline_s(room)
        return deadline is None or self._clock() > deadline

    def active_rooms(self) -> list[int]:
        return [r for r, e in self._rooms.items() if e.state not in TERMINAL]

    def rooms_in(self, state: KVState) -> list[int]:
        return [r for r, e in self._rooms.items() if e.state == state]

    def counts(self) -> dict[KVState, int]:
        """Rooms held per state (for queue gauges)."""
        out = dict.fromkeys(KVState, 0)
        for e in self._rooms.values():
            out[e.state] += 1
        return out

    def __contains__(self, room: object) -> bool:
        return room in self._rooms

    def __len__(self) -> int:
        """Rooms held, terminal ones not yet removed included."""
        return len(self._rooms)

    def check_integrity(self) -> None:
        live = {}
        for deadline, room, epoch in self._heap:
            e = self._rooms.get(room)
            if e is not None and e.epoch == epoch:
                assert room not in live, f"room {room} has two live deadlines"
                live[room] = deadline
        for room, e in self._rooms.items():
            _check_room(room)
            assert isinstance(e.state, KVState), (room, e.state)
            assert (e.reason != "") == (e.state == KVState.Failed), (room, e.state, e.reason)
            if e.state in TERMINAL:
                assert room not in live, f"terminal room {room} still has a deadline"
            else:
                assert live.get(room) == e.entered_s + self.deadlines_s[e.state], (
                    f"room {room} lost its deadline"
                )

    # ---- internals -----------------------------------------------------------------------------
    def _get(self, room: int) -> _Entry:
        e = self._rooms.get(room)
        if e is None:
            raise UnknownRoom(room)
        return e

    def _enter(self, room: int, state: KVState) -> None:
        e = self._rooms[room]
        self._epoch += 1
        e.state, e.entered_s, e.epoch = state, self._clock(), self._epoch
        if state not in TERMINAL:
            heapq.heappush(self._heap, (e.entered_s + self.deadlines_s[state], room, e.epoch))

    def _compact(self) -> None:
        self._heap = [h for h in self._heap if (e := self._rooms.get(h[1])) is not None and e.epoch == h[2]]
        heapq.heapify(self._heap)


def min_lease_s(prefill_deadlines_s: dict[KVState, float], margin_s: float) -> float:
    """Smallest safe decode-side abort lease: the prefill room's longest possible life (sum of its
    non-terminal deadlines) plus a margin for the in-flight tail and control-message delay."""
    return sum(float(prefill_deadlines_s[s]) for s in NON_TERMINAL) + float(margin_s)


class AbortTracker:
    """Decode-side second phase of an abort: rooms whose pages are held until the prefill acks or the
    lease runs out. Owned by the decode's scheduler thread; see the module docstring for the proof."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lease_end_s: dict[int, float] = {}
        self._acked: set[int] = set()
        self.num_acked = 0  # freed because the peer acked
        self.num_lease_expired = 0  # freed because the lease ran out (peer dead, partitioned, ack lost)

    def begin(self, room: int, lease_s: float) -> None:
        """We stopped using the room and sent Abort; hold its pages until ack or lease end. A second
        begin for a pending room is a no-op (the first lease stands: it started when we stopped)."""
        _check_room(room)
        if not (isinstance(lease_s, int | float) and math.isfinite(lease_s) and lease_s > 0):
            raise ValueError(f"lease_s must be finite and > 0: {lease_s!r}")
        if room not in self._lease_end_s:
            self._lease_end_s[room] = self._clock() + lease_s

    def acked(self, room: int) -> bool:
        """The peer's AbortAck (or Status(Failed)) arrived. Returns False, changing nothing, for a room
        that is not pending (never begun, already returned by ready_to_free, or a duplicate ack)."""
        if room not in self._lease_end_s or room in self._acked:
            return False
        self._acked.add(room)
        return True

    def ready_to_free(self) -> list[int]:
        """Rooms whose pages may be freed now (acked, or lease strictly past); each is returned once and
        forgotten. Acked rooms come first, then expired leases, each in begin order."""
        now = self._clock()
        acked = [r for r in self._lease_end_s if r in self._acked]
        expired = [r for r, end in self._lease_end_s.items() if r not in self._acked and now > end]
        for r in acked:
            del self._lease_end_s[r]
        for r in expired:
            del self._lease_end_s[r]
        self._acked.difference_update(acked)
        self.num_acked += len(acked)
        self.num_lease_expired += len(expired)
        return acked + expired

    def pending(self) -> list[int]:
        return list(self._lease_end_s)

    def __contains__(self, room: object) -> bool:
        return room in self._lease_end_s

    def __len__(self) -> int:
        return len(self._lease_end_s)

    def check_integrity(self) -> None:
        assert self._acked <= set(self._lease_end_s), "acked rooms must be pending"
        for room, end in self._lease_end_s.items():
            _check_room(room)
            assert math.isfinite(end), (room, end)
