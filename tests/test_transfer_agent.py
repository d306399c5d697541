"""TransferAgent: one thread owning a backend; ids reported once; failures reported, never raised."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

import pytest

from pdserve.transfer.agent import TransferAgent
from pdserve.transfer.base import TransferError, TransferStatus


def _wait(fn, timeout_s: float = 5.0, until=bool):
    """Call fn() until until(accumulated) holds; returns the accumulated list."""
    acc: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        acc += fn()
        if until(acc):
            return acc
        time.sleep(0.002)
    return acc


@pytest.fixture
def fake_agents():
    agents = []

    def make(name, **options):
        a = TransferAgent("fake", name, [(0, 4096)], **options)
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()
        assert not a.alive


def _connect(a: TransferAgent, b: TransferAgent) -> None:
    a.add_peer(b.agent_name, b.metadata())
    b.add_peer(a.agent_name, a.metadata())


def test_fake_agent_ids_reported_once_and_notifications(fake_agents):
    a, b = fake_agents("ag-a"), fake_agents("ag-b")
    _connect(a, b)
    ids = [a.submit("ag-b", [(0, 64)], [(64, 64)], b"n%d" % i) for i in range(20)]
    assert len(set(ids)) == 20
    done = _wait(a.poll_completions, until=lambda acc: len(acc) >= 20)
    time.sleep(0.02)
    done += a.poll_completions()
    assert sorted(done) == sorted((i, TransferStatus.DONE) for i in ids)  # each id exactly once
    notifs = _wait(b.poll_notifications, until=lambda acc: len(acc) >= 20)
    assert notifs == [("ag-a", b"n%d" % i) for i in range(20)]
    s = a.stats.snapshot()
    assert (s["transfers_submitted"], s["transfers_done"], s["bytes_done"], s["descriptors_submitted"]) == (
        20,
        20,
        20 * 64,
        20,
    )
    assert len(s["latencies_s"]) == 20
    assert b.stats.notifications_received == 20


def test_wait_notifications_blocks_until_one_lands(fake_agents):
    a, b = fake_agents("wn-a"), fake_agents("wn-b")
    _connect(a, b)
    t0 = time.monotonic()
    assert b.wait_notifications(0.05) == []  # nothing sent: returns empty after the timeout
    assert time.monotonic() - t0 >= 0.05
    a.submit("wn-b", [(0, 64)], [(64, 64)], b"first")
    a.submit("wn-b", [(0, 64)], [(64, 64)], b"second")
    got = b.wait_notifications(5.0)
    deadline = time.monotonic() + 5.0
    while len(got) < 2 and time.monotonic() < deadline:
        got += b.wait_notifications(0.1)
    assert got == [("wn-a", b"first"), ("wn-a", b"second")]  # in order, each once
    assert b.poll_notifications() == []


def test_fake_agent_failures_are_reported_not_raised(fake_agents):
    a, b = fake_agents("fl-a"), fake_agents("fl-b")
    _connect(a, b)
    seen = []
    a.on_complete = lambda tid, st, lat, nbytes: seen.append((tid, st, nbytes))
    t_unknown = a.submit("nobody", [(0, 8)], [(0, 8)], b"x")  # backend raises TransferError
    t_bad = a.submit("fl-b", [(0, 8)], [(0, 16)], b"x")  # backend raises ValueError
    done = _wait(a.poll_completions, until=lambda acc: len(acc) >= 2)
    assert sorted(done) == [(t_unknown, TransferStatus.FAILED), (t_bad, TransferStatus.FAILED)]
    assert a.alive and a.stats.transfers_failed == 2 and a.stats.backend_errors == 2
    assert sorted(seen) == [(t_unknown, TransferStatus.FAILED, 8), (t_bad, TransferStatus.FAILED, 8)]
    # Injected failure (the backend reports FAILED), then the agent still works.
    a._commands.put(("noop",))  # unknown commands are ignored
    t_ok = a.submit("fl-b", [(0, 8)], [(0, 8)], b"ok")
    assert _wait(a.poll_completions) == [(t_ok, TransferStatus.DONE)]
    assert _wait(b.poll_notifications) == [("fl-a", b"ok")]


def test_fake_agent_injected_failure_and_abort(fake_agents, fake_clock):
    a = fake_agents("ab-a", delay_s=0.5)  # the backend's clock only moves when the test moves it
    b = fake_agents("ab-b")
    _connect(a, b)
    a.metadata()
    a.backend.fail_next(1)  # test-only: the backend lives on the agent thread
    t_fail = a.submit("ab-b", [(0, 8)], [(0, 8)], b"fail")
    t_abort = a.submit("ab-b", [(0, 8)], [(0, 8)], b"abort")
    a.abort(t_abort)
    a.abort(t_abort)  # twice: still reported once
    # The abort is reported at once; the injected failure only when the write would have finished.
    done = _wait(a.poll_completions, timeout_s=10, until=lambda acc: len(acc) >= 1)
    assert done == [(t_abort, TransferStatus.FAILED)]
    fake_clock.now_s += 1.0  # past both writes' finish time: the aborted one must not complete now
    done += _wait(a.poll_completions, timeout_s=10, until=lambda acc: len(acc) >= 1)
    time.sleep(0.1)  # a few more agent-loop iterations
    done += a.poll_completions()
    assert sorted(done) == [(t_fail, TransferStatus.FAILED), (t_abort, TransferStatus.FAILED)]
    assert a.stats.transfers_aborted == 1
    assert b.poll_notifications() == []  # neither the failed nor the aborted write notifies
    a.abort(t_abort)  # after it was reported: no-op
    time.sleep(0.01)
    assert a.poll_completions() == []


def test_a_transfer_past_its_expiry_is_aborted_by_the_agent_itself(fake_agents):
    """`expires_s` (the prefill's room end of life): a write still in flight then is aborted by the
    agent's own thread (the engine thread that would abort it may be stalled, and the decode frees
    the room's pages a lease later); one already expired when the thread takes it is never started;
    one held before it started (a stall, as one waiting for the emulated link) is dropped. Each is
    reported FAILED once, and counted."""
    from pdserve import faults

    clock = SimpleNamespace(now_s=50.0)
    a, b = fake_agents("exp-a", delay_s=30.0), fake_agents("exp-b")
    a.clock = lambda: clock.now_s
    _connect(a, b)
    in_flight = a.submit("exp-b", [(0, 8)], [(0, 8)], b"late", expires_s=60.0)
    fine = a.submit("exp-b", [(0, 8)], [(0, 8)], b"fine", expires_s=1e9)
    stale = a.submit("exp-b", [(0, 8)], [(0, 8)], b"stale", expires_s=49.0)
    assert _wait(a.poll_completions, until=lambda acc: len(acc) >= 1) == [(stale, TransferStatus.FAILED)]
    assert a.stats.descriptors_submitted == 2  # (the stale one never reached the backend)
    time.sleep(0.05)
    assert a.poll_completions() == []  # (both still in flight: the backend takes 30 s)
    clock.now_s = 60.5
    assert _wait(a.poll_completions, until=lambda acc: len(acc) >= 1) == [(in_flight, TransferStatus.FAILED)]
    time.sleep(0.05)
    assert a.poll_completions() == []  # (the other has no expiry to speak of)
    a.abort(fine)
    assert _wait(a.poll_completions, until=lambda acc: len(acc) >= 1) == [(fine, TransferStatus.FAILED)]
    assert a.stats.transfers_expired == 2 and a.stats.transfers_aborted == 3
    assert b.poll_notifications() == []

    c, d = fake_agents("exp-c"), fake_agents("exp-d")
    c.clock = lambda: clock.now_s
    _connect(c, d)
    faults.configure([{"point": "transfer.submit", "action": "stall", "count": 1}])
    try:  # (a stalled transfer waits, never copied, where one crossing the emulated link waits)
        stalled = c.submit("exp-d", [(0, 8)], [(0, 8)], b"stalled", expires_s=70.0)
        time.sleep(0.1)
        assert c.poll_completions() == []
        clock.now_s = 70.5
        got = _wait(c.poll_completions, until=lambda acc: len(acc) >= 1)
    finally:
        faults.configure(None)
    assert got == [(stalled, TransferStatus.FAILED)] and c.stats.transfers_expired == 1


def test_a_submit_that_cannot_start_is_reported_failed_not_lost(fake_agents, tmp_path):
    """A malformed descriptor list used to raise in the agent's loop after the command left the queue:
    the id was never reported, and a caller waiting for it (the layerwise lane) waited out its
    deadline. On a full emulated NIC (a slow one: the writes crossing it, the rest waiting for a flow
    slot), aborting every id reports each exactly once, wherever it was."""
    from pdserve.netem import NodeConfig, TrafficManager

    a, b = fake_agents("A-bad"), fake_agents("B-bad")
    a.add_peer("B-bad", b.metadata())
    bad = a.submit("B-bad", [(0, 64, 0, 1)], [(0, 64, 0, 1)], b"x")  # 4-tuples: not (addr, nbytes)
    good = a.submit("B-bad", [(0, 64)], [(0, 64)], b"y")
    got = dict(_wait(a.poll_completions, until=lambda acc: len(acc) == 2))
    assert got == {bad: TransferStatus.FAILED, good: TransferStatus.DONE}

    tm = TrafficManager(NodeConfig(node="n0", node_dir=str(tmp_path), cnic_bytes_per_s=1e3))
    try:
        c, d = fake_agents("C-full"), fake_agents("D-full")
        c.add_peer("D-full", d.metadata())
        c.traffic = tm
        ids = [c.submit("D-full", [(0, 64)], [(0, 64)], b"z") for _ in range(300)]  # > the link's flows
        time.sleep(0.5)
        for i in ids:
            c.abort(i)
        got = dict(_wait(c.poll_completions, until=lambda acc: len(acc) == len(ids)))
        assert sorted(got) == ids  # every id reported exactly once
        s = c.stats.snapshot()  # (aborted while waiting for the link: counted submitted all the same)
        assert s["transfers_submitted"] == s["transfers_done"] + s["transfers_failed"] == 300, s
    finally:
        tm.close()
    s = a.stats.snapshot()  # a malformed list was counted failed but never submitted: in flight < 0
    assert s["transfers_submitted"] == s["transfers_done"] + s["transfers_failed"] == 2, s
    assert [n for n, _ in s["latencies_s"]] == [1, 2]  # (each latency by its place among those finished)


def test_a_submit_after_close_is_refused_not_lost(fake_agents):
    """The thread that reports ids is gone: the id was handed out and never reported, and a waiter
    (the layerwise lane) waited out its deadline."""
    a = fake_agents("closed")
    a.metadata()
    a.close()
    with pytest.raises(TransferError, match="is closed"):
        a.submit("anyone", [(0, 8)], [(0, 8)], b"late")
    with pytest.raises(TransferError, match="is closed"):
        a.submit_read("anyone", [(0, 8)], [(0, 8)], b"late")


def test_a_full_emulated_link_delays_transfers_instead_of_failing_them(fake_agents, tmp_path):
    """300 writes on an emulated CNIC of 256 flow slots: the 44 that find it full wait, FIFO, and all
    300 complete (a real NIC queues work; before, those 44 were reported FAILED and failed their
    rooms)."""
    from pdserve.netem import NodeConfig, TrafficManager

    tm = TrafficManager(NodeConfig(node="n0", node_dir=str(tmp_path), cnic_bytes_per_s=1e4))
    try:
        c, d = fake_agents("C-wait"), fake_agents("D-wait")
        c.add_peer("D-wait", d.metadata())
        c.traffic = tm
        ids = [c.submit("D-wait", [(0, 64)], [(0, 64)], b"w") for _ in range(300)]
        got = _wait(c.poll_completions, timeout_s=30.0, until=lambda acc: len(acc) == len(ids))
        assert sorted(i for i, _ in got) == ids
        assert {st for _, st in got} == {TransferStatus.DONE}
        assert c.stats.link_waits == 300 - tm.cnic.max_flows == 44
        assert c.stats.transfers_failed == 0
    finally:
        tm.close()


def test_the_agent_reads_its_emulated_link_once_per_step_not_once_per_delayed_transfer(fake_agents, tmp_path):
    """200 writes crossing a slow emulated CNIC together: each agent step asked the link `done()` for
    every one of them, and each ask reads and advances the whole slot table (~0.4 ms at 256 flows:
    ~80 ms per step here, behind which every completion and notification waited). Now a step reads
    the link once for all of them; the transfers complete as before."""
    from pdserve.netem import NodeConfig, TrafficManager

    tm = TrafficManager(NodeConfig(node="n0", node_dir=str(tmp_path), cnic_bytes_per_s=2e4))
    passes = steps = 0
    state, step = tm.cnic._state, None

    def counted_state():
        nonlocal passes
        passes += 1
        return state()

    tm.cnic._state = counted_state
    try:
        c, d = fake_agents("C-once"), fake_agents("D-once")
        c.add_peer("D-once", d.metadata())
        step = c._step

        def counted_step(*a):
            nonlocal steps
            steps += 1
            return step(*a)

        c._step = counted_step
        c.traffic = tm
        ids = [c.submit("D-once", [(0, 64)], [(0, 64)], b"w") for _ in range(200)]
        got = _wait(c.poll_completions, timeout_s=30.0, until=lambda acc: len(acc) == len(ids))
        assert sorted(i for i, _ in got) == ids
        assert {st for _, st in got} == {TransferStatus.DONE}
        # One start per transfer, one read per step (plus the odd flow that starts inside a step).
        assert passes <= 200 + steps + 5, (passes, steps)
        assert steps > 5  # (they crossed the link over many steps: 12.8 kB at 20 kB/s)
    finally:
        tm.close()


def test_fake_agent_close_fails_pending(fake_agents):
    a, b = fake_agents("cl-a", delay_s=5.0), fake_agents("cl-b")
    _connect(a, b)
    t = a.submit("cl-b", [(0, 8)], [(0, 8)], b"never")
    time.sleep(0.01)
    a.close()
    assert a.poll_completions() == [(t, TransferStatus.FAILED)]


def test_agent_start_failure_is_reported():
    a = TransferAgent("nope", "bad", [])
    with pytest.raises(TransferError, match="failed to start"):
        a.metadata()
    a.close()


# ---------------------------------------------------------------- nixl, two spawned processes

NUM_PAGES, PAGE_NBYTES = 32, 1024
SRC_PAGES, DST_PAGES = [1, 2, 3, 9, 30, 4], [7, 8, 9, 0, 31, 12]


def _receiver(conn) -> None:
    import torch

    from pdserve.transfer.agent import TransferAgent

    kv = [torch.zeros(NUM_PAGES, PAGE_NBYTES, dtype=torch.uint8) for _ in range(2)]
    agent = TransferAgent("nixl", "ta-recv", [(t.data_ptr(), t.numel()) for t in kv])
    conn.send((agent.metadata(), [t.data_ptr() for t in kv]))
    g = torch.Generator().manual_seed(3)
    expect = [
        torch.randint(0, 256, (NUM_PAGES, PAGE_NBYTES), dtype=torch.uint8, generator=g) for _ in range(2)
    ]
    notifs = _wait(agent.poll_notifications, timeout_s=30)
    ok = all(
        torch.equal(k[d], e[s])
        for k, e in zip(kv, expect, strict=True)
        for s, d in zip(SRC_PAGES, DST_PAGES, strict=True)
    )
    conn.send((notifs, ok))
    agent.close()


def _sender(conn) -> None:
    import torch

    from pdserve.transfer.agent import TransferAgent
    from pdserve.transfer.pages import RegionTable, merge_runs, page_descriptors

    g = torch.Generator().manual_seed(3)
    kv = [torch.randint(0, 256, (NUM_PAGES, PAGE_NBYTES), dtype=torch.uint8, generator=g) for _ in range(2)]
    agent = TransferAgent("nixl", "ta-send", [(t.data_ptr(), t.numel()) for t in kv])
    md, peer_addrs = conn.recv()
    agent.add_peer("ta-recv", md)
    local, remote = page_descriptors(
        merge_runs(SRC_PAGES, DST_PAGES),
        RegionTable(tuple(t.data_ptr() for t in kv), (PAGE_NBYTES,) * 2),
        RegionTable(tuple(peer_addrs), (PAGE_NBYTES,) * 2),
    )
    t_bad = agent.submit("ta-recv", [(kv[0].data_ptr(), 8)], [(peer_addrs[0] + (1 << 40), 8)], b"bad")
    t_unknown = agent.submit("nobody", local, remote, b"x")
    t_ok = agent.submit("ta-recv", local, remote, b"room-7")
    done = _wait(agent.poll_completions, timeout_s=30, until=lambda acc: len(acc) >= 3)
    time.sleep(0.05)
    done += agent.poll_completions()
    conn.send((sorted(done), (t_bad, t_unknown, t_ok), agent.alive, agent.stats.snapshot()))
    conn.recv()
    agent.close()


@pytest.mark.timeout(120)
def test_nixl_agent_between_processes():
    from pdserve.transfer.nixl_backend import nixl_available

    if not nixl_available():
        pytest.skip("NIXL is not installed (nixl-cu12)")
    ctx = mp.get_context("spawn")  # never fork around NIXL agents
    (rp, rc), (sp, sc) = ctx.Pipe(), ctx.Pipe()
    procs = [
        ctx.Process(target=_receiver, args=(rc,), daemon=True),
        ctx.Process(target=_sender, args=(sc,), daemon=True),
    ]
    for p in procs:
        p.start()
    try:
        assert rp.poll(60)
        sp.send(rp.recv())
        assert sp.poll(60)
        done, (t_bad, t_unknown, t_ok), alive, stats = sp.recv()
        assert done == sorted(
            [(t_bad, TransferStatus.FAILED), (t_unknown, TransferStatus.FAILED), (t_ok, TransferStatus.DONE)]
        )
        assert alive and stats["transfers_failed"] == 2 and stats["transfers_done"] == 1
        assert stats["descriptors_submitted"] == 1 + 2 * 4 + 2 * 4  # 4 runs x 2 regions, twice, + 1
        assert rp.poll(30)
        notifs, ok = rp.recv()
        assert notifs == [("ta-send", b"room-7")]
        assert ok
        sp.send("stop")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def test_a_backend_that_fails_to_start_is_closed(monkeypatch):
    """A failed `register` left the backend open (a review of the transfer layer): NIXL memory
    registered before the failure was never deregistered, and a fake agent's name stayed taken, so a
    new agent under it was refused."""
    from pdserve.transfer import fake_backend

    def failing_register(self, regions):
        raise RuntimeError("registration failed (e.g. a memlock limit)")

    monkeypatch.setattr(fake_backend.FakeBackend, "register", failing_register)
    agent = TransferAgent("fake", "start-fails", [(0, 4096)])
    with pytest.raises(TransferError, match="failed to start"):
        agent.metadata()
    agent.close()
    monkeypatch.undo()
    fake_backend.FakeBackend("start-fails").close()  # (the name is free again)


def test_a_submit_racing_close_is_reported_or_refused():
    """`submit` checked that the agent was open, then queued its command: a `close` in between queued
    "close" first, the thread ended without seeing the submit, and its id was never reported (the
    layerwise lane would wait out its deadline on it). Submit and close now take one lock: here the
    submit is held inside its queueing while close runs, and its id is reported (failed)."""
    import threading

    agent = TransferAgent("fake", "submit-vs-close", [(0, 4096)])
    agent.metadata()
    entered, gate = threading.Event(), threading.Event()

    class SlowSubmits:  # the agent's command queue, whose put of a submit waits for `gate`
        def __init__(self, commands) -> None:
            self.commands = commands
            self.get, self.get_nowait = commands.get, commands.get_nowait

        def put(self, cmd) -> None:
            if cmd[0] == "submit":
                entered.set()
                gate.wait(5)
            self.commands.put(cmd)

    agent._commands = SlowSubmits(agent._commands)
    result: dict = {}

    def submit():
        try:
            result["id"] = agent.submit("anyone", [(0, 8)], [(0, 8)], b"late")
        except TransferError as e:
            result["error"] = e

    submitter = threading.Thread(target=submit)
    submitter.start()
    assert entered.wait(5)
    closer = threading.Thread(target=agent.close)
    closer.start()
    time.sleep(0.05)  # (close runs now, while the submit is queueing)
    gate.set()
    submitter.join(5)
    closer.join(10)
    assert "error" not in result
    reported = _wait(agent.poll_completions, timeout_s=2.0)
    assert reported == [(result["id"], TransferStatus.FAILED)], reported


def test_the_agent_reports_everything_and_closes_its_backend_when_its_links_close_under_it(monkeypatch):
    """PDContext.close closed the emulated links after `agent.close()`, whose join times out while a
    release waits (NIXL: up to 30 s for a copy); the agent thread then raised in its shutdown (a closed
    link), never reported the transfer crossing the link and never closed its backend (NIXL memory left
    registered; a review, 2026-12-04)."""
    import tempfile

    from pdserve.netem.traffic import NodeConfig, TrafficManager
    from pdserve.transfer.fake_backend import FakeBackend

    recv = FakeBackend("cl-recv")
    recv.register([(0, 1 << 30)])
    agent = TransferAgent("fake", "cl-send", [(0, 1 << 30)], delay_s=5.0)
    agent.add_peer("cl-recv", b"cl-recv")
    agent.metadata()
    closed = []
    release, close = FakeBackend.release, FakeBackend.close

    def slow_release(self, handle):  # (as NIXL's, waiting for a copy)
        time.sleep(1.0)
        release(self, handle)

    def recording_close(self):
        closed.append(self.agent_name)
        close(self)

    monkeypatch.setattr(FakeBackend, "release", slow_release)
    monkeypatch.setattr(FakeBackend, "close", recording_close)
    in_backend = agent.submit("cl-recv", [(0, 10)], [(0, 10)], b"a")
    time.sleep(0.05)
    traffic = TrafficManager(
        NodeConfig(node="n", node_dir=tempfile.mkdtemp(), cnic_bytes_per_s=1e6, engine="e")
    )
    agent.traffic = traffic
    crossing = agent.submit("cl-recv", [(0, 10_000_000)], [(0, 10_000_000)], b"b")  # 10 s on the link
    time.sleep(0.05)
    agent.close(timeout_s=0.2)  # (the join times out ...)
    traffic.close()  # (... and the links close under the running thread)
    reported = _wait(agent.poll_completions, timeout_s=5.0, until=lambda acc: len(acc) == 2)
    recv.close()
    assert "cl-send" in closed
    assert {t for t, _ in reported} == {in_backend, crossing}
    assert all(status == TransferStatus.FAILED for _, status in reported)
