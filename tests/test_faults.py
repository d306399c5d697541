"""Fault injection points (pdserve.faults): configuration, counting, and what each point does."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pdserve import faults
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.nixl_backend import nixl_available
from tests.test_store import KEYS, make_store, payload, put_all, read
from tests.test_transfer_agent import _connect, _wait, fake_agents  # noqa: F401 (fixture)


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.configure(None)
    assert not faults.ENABLED


def test_off_by_default_and_bad_rules_change_nothing():
    assert not faults.ENABLED and faults.check("store.read") is None
    faults.configure([{"point": "store.read", "action": "slow", "delay_s": 0.01}])
    with pytest.raises(faults.FaultConfigError, match="unknown fault point"):
        faults.configure([{"point": "disk.melt", "action": "fail"}])
    with pytest.raises(faults.FaultConfigError, match="not 'drop'"):
        faults.configure([{"point": "store.read", "action": "drop"}])
    assert [r["action"] for r in faults.snapshot()] == ["slow"]  # the bad config replaced nothing


def test_count_kind_and_probability():
    faults.configure(
        [
            {"point": "control.send", "action": "drop", "kind": "abort", "count": 2},
            {"point": "control.send", "action": "delay", "prob": 0.5, "delay_s": 0.1},
        ],
        seed=1,
    )
    assert [faults.check("control.send", "abort").action for _ in range(2)] == ["drop", "drop"]
    hits = [faults.check("control.send", "abort") for _ in range(200)]  # drop used up: delay at ~50%
    assert all(h is None or h.action == "delay" for h in hits)
    assert 70 <= sum(h is not None for h in hits) <= 130


def test_skip_lets_matching_calls_through_first():
    faults.configure(
        [{"point": "transfer.submit", "action": "stall", "kind": "write", "skip": 2, "count": 1}]
    )
    assert faults.check("transfer.submit", "read") is None  # another kind: neither skipped nor fired
    got = [faults.check("transfer.submit", "write") for _ in range(4)]
    assert [g and g.action for g in got] == [None, None, "stall", None]  # 2 through, 1 fired, used up
    snap = faults.snapshot()
    assert snap[0]["skipped"] == 2 and snap[0]["fired"] == 1
    faults.configure(snap)  # a snapshot fed back is a fresh rule: its counters start at 0
    assert faults.check("transfer.submit", "write") is None and faults.snapshot()[0]["skipped"] == 1
    with pytest.raises(faults.FaultConfigError, match="skip >= 0"):
        faults.configure([{"point": "store.read", "action": "fail", "skip": -1}])


IO_BACKENDS = [
    "preadv",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")),
]


def _read_with_one_fault(store, action: str, status: str) -> int:
    """Read every block with one `store.read` fault of `action`: exactly one block has `status`, the
    others their bytes. Returns the bad block's index (reads run on two I/O threads, so which block
    takes the fault is up to the scheduler)."""
    faults.configure([{"point": "store.read", "action": action, "count": 1}])
    res, out = read(store, KEYS)
    bad = [i for i, s in enumerate(res.status) if s != "ok"]
    assert len(bad) == 1 and res.status[bad[0]] == status, res.status
    assert faults.snapshot()[0]["fired"] == 1
    for i in set(range(len(KEYS))) - set(bad):
        assert np.array_equal(out[i], payload(i))
    return bad[0]


@pytest.mark.parametrize("io_backend", IO_BACKENDS)
def test_store_read_corrupt_is_caught_and_removed(tmp_path, io_backend):
    store = make_store(tmp_path, io_backend=io_backend)
    put_all(store)
    bad = [_read_with_one_fault(store, "corrupt", "corrupt")]
    assert store.lookup_keys(KEYS) == bad[0]  # the bad block left the index (and the disk)
    assert store.lookup_keys(KEYS[bad[0] :]) == 0
    store.check_integrity()
    store.close()


@pytest.mark.parametrize("io_backend", IO_BACKENDS)
def test_store_read_fail_and_slow_act_on_every_io_backend(tmp_path, io_backend):
    """The fault point fires per block on the NIXL path too (it used to act on preadv only, so a chaos
    rule silently did nothing on a store read through NIXL)."""
    store = make_store(tmp_path, io_backend=io_backend)
    put_all(store)
    _read_with_one_fault(store, "fail", "ioerror")
    assert store.stats().num_missing == 1 and store.stats().num_corrupt == 0  # the file is kept
    delay_s = 0.05
    faults.configure([{"point": "store.read", "action": "slow", "delay_s": delay_s, "count": 1}])
    t = time.monotonic()
    res, out = read(store, KEYS)
    assert time.monotonic() - t >= delay_s and res.num_ok == len(KEYS)  # slow, not wrong
    assert all(np.array_equal(out[i], payload(i)) for i in range(len(KEYS)))
    store.check_integrity()
    store.close()


def test_store_write_full_disk_and_failures_are_counted_not_raised(tmp_path):
    store = make_store(tmp_path)
    faults.configure([{"point": "store.write", "action": "full", "count": 1}])
    assert store.put(KEYS[0], payload(0)) is False
    assert store.put(KEYS[0], payload(0)) is True  # the disk has room again
    assert store.stats().num_write_failures == 1
    faults.configure([{"point": "store.write", "action": "slow", "delay_s": 0.05}])
    t = time.monotonic()
    assert store.put(KEYS[1], payload(1))
    assert time.monotonic() - t >= 0.05
    store.check_integrity()
    store.close()


def test_transfer_fail_and_stall(fake_agents):  # noqa: F811
    a, b = fake_agents("fa-a"), fake_agents("fa-b")
    _connect(a, b)
    faults.configure([{"point": "transfer.submit", "action": "fail", "count": 1}])
    t1 = a.submit("fa-b", [(0, 64)], [(64, 64)], b"x")
    assert _wait(a.poll_completions, until=lambda acc: acc) == [(t1, TransferStatus.FAILED)]
    faults.configure([{"point": "transfer.submit", "action": "stall"}])
    t2 = a.submit("fa-b", [(0, 64)], [(64, 64)], b"y")
    time.sleep(0.1)
    assert a.poll_completions() == []  # stalled: no completion, no notification
    a.abort(t2)  # only an abort ends it, reported once as failed
    assert _wait(a.poll_completions, until=lambda acc: acc) == [(t2, TransferStatus.FAILED)]
    assert b.poll_notifications() == []
