"""RoomTable and AbortTracker: every transition, deadlines in every state, and abort races (fake clock)."""

from __future__ import annotations

import pytest

from pdserve.disagg.state import (
    AbortTracker,
    DuplicateRoom,
    KVState,
    RoomTable,
    UnknownRoom,
    min_lease_s,
)

B, W, T, S, F = (
    KVState.Bootstrapping,
    KVState.WaitingForInput,
    KVState.Transferring,
    KVState.Success,
    KVState.Failed,
)
DEADLINES = {B: 10.0, W: 20.0, T: 30.0}


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def table(clock):
    t = RoomTable(DEADLINES, clock=clock)
    yield t
    t.check_integrity()


def test_values_are_the_wire_values():
    assert [int(s) for s in (F, B, W, T, S)] == [0, 1, 2, 3, 4]


def test_forward_path_and_terminal_success(table):
    table.create(1)
    assert table.state(1) == B and table.active_rooms() == [1] and len(table) == 1
    assert table.advance(1, W) == W
    assert table.advance(1, T) == T
    assert table.advance(1, S) == S
    assert table.active_rooms() == [] and len(table) == 1 and table.reason(1) == ""
    # Terminal: nothing changes it, not even Failed.
    for s in (B, W, T, F):
        assert table.advance(1, s) == S
    table.fail(1, "late")
    assert table.state(1) == S and table.reason(1) == ""


def test_skipping_forward_is_allowed_backward_is_ignored(table):
    table.create(1)
    assert table.advance(1, T) == T  # B -> T directly (e.g. prefix pages sent before KVRequest? allowed)
    assert table.advance(1, W) == T
    assert table.advance(1, B) == T
    assert table.advance(1, T) == T
    table.create(2, W)
    assert table.advance(2, B) == W and table.state(2) == W


@pytest.mark.parametrize("start", [B, W, T])
def test_failed_wins_from_every_non_terminal_state(table, start):
    table.create(7)
    table.advance(7, start)
    table.fail(7, "peer died")
    assert table.state(7) == F and table.reason(7) == "peer died"
    for s in (B, W, T, S):
        assert table.advance(7, s) == F
    table.fail(7, "second reason")
    assert table.reason(7) == "peer died"  # the first outcome stands
    table.create(8, start)
    assert table.advance(8, F) == F and table.reason(8) == "failed"


def test_duplicate_room(table):
    table.create(5)
    with pytest.raises(DuplicateRoom):
        table.create(5)
    with pytest.raises(DuplicateRoom):
        table.create(5, T)
    table.advance(5, T)
    assert table.state(5) == T  # the rejected create changed nothing
    table.fail(5, "x")
    with pytest.raises(DuplicateRoom):  # terminal but still held
        table.create(5)
    table.remove(5)
    table.create(5)  # the id is free again
    assert table.state(5) == B and table.reason(5) == ""


def test_remove_rules_and_unknown_rooms(table):
    table.create(3)
    with pytest.raises(ValueError):
        table.remove(3)  # still active
    with pytest.raises(UnknownRoom):
        table.remove(4)
    with pytest.raises(UnknownRoom):
        table.state(4)
    with pytest.raises(UnknownRoom):
        table.advance(4, T)
    with pytest.raises(UnknownRoom):
        table.fail(4, "x")
    table.advance(3, S)
    table.remove(3)
    assert len(table) == 0 and 3 not in table


def test_bad_inputs(clock):
    with pytest.raises(ValueError):
        RoomTable({B: 1.0, W: 1.0}, clock=clock)  # Transferring has no deadline
    with pytest.raises(ValueError):
        RoomTable({B: 1.0, W: float("inf"), T: 1.0}, clock=clock)
    with pytest.raises(ValueError):
        RoomTable({B: 1.0, W: 0.0, T: 1.0}, clock=clock)
    t = RoomTable(DEADLINES, clock=clock)
    for room in (0, -1, 2**63, True, "1"):
        with pytest.raises(ValueError):
            t.create(room)
    for state in (S, F):
        with pytest.raises(ValueError):
            t.create(9, state)
    assert len(t) == 0


@pytest.mark.parametrize("state", [B, W, T])
def test_deadline_in_every_non_terminal_state(table, clock, state):
    table.create(11)
    if state != B:
        clock.advance(DEADLINES[B] - 1)  # time spent before entering `state` does not count against it
        table.advance(11, state)
    assert table.deadline_s(11) == clock.now_s + DEADLINES[state]
    assert table.time_left_s(11) == DEADLINES[state] and not table.ended(11)
    clock.advance(DEADLINES[state])  # exactly at the deadline: not yet expired
    assert table.expired() == [] and table.state(11) == state
    assert not table.ended(11) and table.time_left_s(11) == 0  # `ended` is as strict as `expired`
    clock.advance(0.001)
    assert table.ended(11)  # (the layerwise lane's check, before `expired` has run)
    assert table.expired() == [11]
    assert table.state(11) == F and table.reason(11) == f"deadline in {state.name}"
    assert table.expired() == []  # reported once
    assert table.num_expired == 1 and table.deadline_s(11) is None
    assert table.ended(11) and table.time_left_s(11) == 0  # terminal


def test_each_state_restarts_its_own_clock_and_same_state_does_not(table, clock):
    table.create(1)
    clock.advance(9)
    table.advance(1, B)  # same state: the Bootstrapping clock keeps running
    clock.advance(2)
    assert table.expired() == [1] and table.reason(1) == "deadline in Bootstrapping"
    table.create(2)
    clock.advance(9)
    table.advance(2, W)
    clock.advance(19)
    table.advance(2, T)
    clock.advance(29)
    assert table.expired() == [] and table.state(2) == T
    clock.advance(2)
    assert table.expired() == [2]


def test_expired_ignores_terminal_and_removed_rooms_and_orders_by_deadline(table, clock):
    for room in (1, 2, 3, 4):
        table.create(room)
    table.advance(1, S)
    table.fail(2, "aborted")
    table.remove(2)
    table.advance(3, T)  # deadline 30 s from now
    clock.advance(10.5)
    assert table.expired() == [4]
    clock.advance(30)
    assert table.expired() == [3]
    assert table.state(1) == S and 2 not in table
    assert table.counts() == {F: 2, B: 0, W: 0, T: 0, S: 1}


def test_many_rooms_heap_stays_consistent(table, clock):
    for room in range(1, 501):
        table.create(room)
        if room % 3 == 0:
            table.advance(room, W)
        if room % 5 == 0:
            table.advance(room, S)
            table.remove(room)
    table.check_integrity()
    clock.advance(10.5)
    expired = table.expired()
    assert sorted(expired) == [r for r in range(1, 501) if r % 3 and r % 5]
    clock.advance(10)
    assert sorted(table.expired()) == [r for r in range(1, 501) if r % 3 == 0 and r % 5]
    for room in list(table.rooms_in(F)):
        table.remove(room)
    assert len(table) == 0


def test_abort_ack_before_lease(clock):
    tr = AbortTracker(clock=clock)
    tr.begin(5, lease_s=60)
    assert tr.ready_to_free() == [] and 5 in tr
    assert tr.acked(5) is True
    assert tr.acked(5) is False  # duplicate ack
    assert tr.ready_to_free() == [5]
    assert tr.ready_to_free() == [] and len(tr) == 0
    clock.advance(61)
    assert tr.acked(5) is False and tr.ready_to_free() == []  # no double free
    assert (tr.num_acked, tr.num_lease_expired) == (1, 0)
    tr.check_integrity()


def test_abort_lease_expiry_then_late_ack(clock):
    tr = AbortTracker(clock=clock)
    tr.begin(5, lease_s=60)
    clock.advance(60)
    assert tr.ready_to_free() == []  # exactly at the lease end: still held
    clock.advance(0.001)
    assert tr.ready_to_free() == [5]
    assert tr.acked(5) is False  # the late ack is ignored: freed exactly once
    assert tr.ready_to_free() == []
    assert (tr.num_acked, tr.num_lease_expired) == (0, 1)


def test_abort_ack_and_expiry_in_the_same_turn(clock):
    tr = AbortTracker(clock=clock)
    tr.begin(1, lease_s=10)
    tr.begin(2, lease_s=10)
    tr.begin(3, lease_s=100)
    clock.advance(11)
    tr.acked(2)  # ack arrived after its lease ran out, before anyone freed: counted as acked, once
    assert tr.ready_to_free() == [2, 1]
    assert tr.pending() == [3]
    tr.check_integrity()


def test_abort_rebegin_does_not_extend_and_unknown_ack_ignored(clock):
    tr = AbortTracker(clock=clock)
    assert tr.acked(9) is False
    tr.begin(9, lease_s=10)
    clock.advance(8)
    tr.begin(9, lease_s=10)  # second begin: the first lease stands
    clock.advance(2.5)
    assert tr.ready_to_free() == [9]
    tr.begin(9, lease_s=10)  # a freed room may be aborted again later (new request, reused id)
    assert tr.pending() == [9]
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            tr.begin(10, lease_s=bad)
    with pytest.raises(ValueError):
        tr.begin(0, lease_s=1)


def test_min_lease_covers_the_prefill_room_lifetime():
    assert min_lease_s(DEADLINES, margin_s=5) == 65.0


def test_state_and_messages_are_pure_python():
    import subprocess
    import sys

    code = (
        "import sys, pdserve.disagg.state, pdserve.disagg.messages; "
        "bad = [m for m in ('torch', 'numpy', 'zmq') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
