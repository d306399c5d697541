"""PD roles in one process, driven by hand: exact state transitions, deadlines and abort races.

Two `LLMEngine`s (prefill and decode) on a tiny checkpoint, each with a real `ControlChannel` on
loopback and a `TransferAgent("fake")`, a `PrefillRole` and a `DecodeRole` assembled the way
`PDContext` assembles them. No `AsyncEngine` thread: the test thread plays the engine thread and
turns the loop itself (`role.tick()`, then `engine.step()` while there is work), so every check sits
at a known point between two ticks. Room clocks can be replaced by a fake clock, which makes every
deadline and abort lease deterministic.

The fake backend moves no bytes. Where a test needs the bytes (a commit that passes the handoff gate,
greedy tokens equal to a colocated engine's), the prefill agent's `submit` is wrapped to copy every
descriptor with `ctypes.memmove` first: both pools live in this process, so the fake backend then
behaves as a real in-process copier.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future
from types import SimpleNamespace

import msgspec
import pytest
import torch

from pdserve import LLM, SamplingParams, faults
from pdserve.config import EngineConfig
from pdserve.disagg.control import ControlChannel
from pdserve.disagg.handoff import HandoffRow
from pdserve.disagg.messages import Abort, AbortAck, KVRequest, Register, RegisterAck, Status
from pdserve.disagg.state import AbortTracker, KVState, RoomTable
from pdserve.engine import pd_decode
from pdserve.engine.async_engine import RequestAborted
from pdserve.engine.llm_engine import InvalidRequest, LLMEngine
from pdserve.engine.pd_common import LEASE_MARGIN_S, MIN_LEASE_MARGIN_S, PDConfig, decode_notif
from pdserve.engine.pd_decode import DecodeRole
from pdserve.engine.pd_load import _pending_read_tokens
from pdserve.engine.pd_prefill import PrefillRole, Tombstone
from pdserve.server.pd_context import layout_fingerprint, model_identity
from pdserve.store.joined_reads import JoinedReads, PendingRead
from pdserve.transfer.agent import TransferAgent
from pdserve.transfer.pages import RegionTable
from tests.conftest import tiny_hf_model, wait_until

pytestmark = pytest.mark.timeout(60)

SECRET = b"pd-roles-test-secret"
PAGE_SIZE = 4
MAX_MODEL_LEN = 256
DEADLINE_S = 5.0  # with the fake clock, deadlines pass only when a test moves the clock
LEASE_S = 3 * DEADLINE_S + 1.0  # >= state.min_lease_s (PDConfig refuses less)
_rooms = itertools.count(1001)


def new_room() -> int:
    return next(_rooms)


def prompt(n: int, start: int = 1) -> list[int]:
    """n distinct-looking token ids (vocab 256); different `start`s give different prompts."""
    return [(start * 37 + i * 11) % 251 + 1 for i in range(n)]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


class Sink:
    """Stands in for `AsyncEngine`: roles call `deliver(out, request_id)`; engine steps go here too."""

    def __init__(self) -> None:
        self.items: dict[str, list] = defaultdict(list)

    def deliver(self, out, request_id: str) -> None:
        self.items[request_id].append(out)

    def deliver_step_output(self, out) -> None:
        self.deliver(out, out.request_id)

    deliver_output = deliver_step_output

    def deliver_failed(self, error, request_id: str, finish_reason: str) -> None:
        self.deliver(error, request_id)

    def errors(self, request_id: str) -> list[str]:
        return [str(x) for x in self.items[request_id] if isinstance(x, BaseException)]

    def outputs(self, request_id: str) -> list:
        return [x for x in self.items[request_id] if not isinstance(x, BaseException)]

    def final(self, request_id: str):
        outs = [o for o in self.outputs(request_id) if o.finished]
        assert len(outs) == 1, self.items[request_id]
        return outs[0]


def record_transitions(rooms: RoomTable) -> list[tuple[int, KVState]]:
    """Log every state a room enters (create, advance, fail) on this table."""
    log: list[tuple[int, KVState]] = []
    enter = rooms._enter

    def spy(room: int, state: KVState) -> None:
        enter(room, state)
        log.append((room, KVState(state)))

    rooms._enter = spy
    return log


def fingerprint(engine: LLMEngine) -> str:
    """The layout fingerprint `PDContext` gives a role of this engine."""
    return layout_fingerprint(engine, model_identity(engine))


def make_engine(ckpt: str, num_pages: int = 64, budget: int = 64, page_size: int = PAGE_SIZE) -> LLMEngine:
    return LLMEngine(
        EngineConfig.create(
            ckpt,
            dtype="float32",
            device="cpu",
            page_size=page_size,
            num_pages=num_pages,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=budget,
        )
    )


class Pair:
    """A prefill and a decode role wired to each other through loopback control and fake agents."""

    def __init__(
        self,
        ckpt: str,
        *,
        pe_pages: int = 64,
        de_pages: int = 64,
        pe_budget: int = 64,
        de_page_size: int = PAGE_SIZE,
        staging_threshold: float = 0.5,
        fake_clocks: bool = False,
        copy_bytes: bool = False,
        pe_backend: dict | None = None,
        de_fingerprint: str | None = None,
    ) -> None:
        self.config = PDConfig(
            cluster_secret=SECRET,
            transfer_backend="fake",
            deadline_s=DEADLINE_S,
            abort_lease_s=LEASE_S,
            num_handoff_slots=8,
            growth_reserve_tokens=8,
            staging_threshold=staging_threshold,
            staging_capacity_pages=64,
        )
        # One fake clock per side (rooms; the decode's abort leases too), moved only by the test.
        self.pe_clock = FakeClock() if fake_clocks else None
        self.de_clock = FakeClock() if fake_clocks else None
        self.copy_bytes = copy_bytes
        tag = uuid.uuid4().hex[:8]
        self.pe_engine = make_engine(ckpt, pe_pages, pe_budget)
        self.de_engine = make_engine(ckpt, de_pages, 64, de_page_size)
        self._closers = []
        self.pe_role, self.pe_agent, self.pe_control = self._role(
            PrefillRole,
            self.pe_engine,
            f"prefill-{tag}",
            fingerprint(self.pe_engine),
            pe_backend,
            self.pe_clock,
        )
        self.de_role, self.de_agent, self.de_control = self._role(
            DecodeRole,
            self.de_engine,
            f"decode-{tag}",
            de_fingerprint or fingerprint(self.de_engine),
            None,
            self.de_clock,
        )
        if self.de_clock is not None:
            self.de_role.aborts = AbortTracker(clock=self.de_clock)
        self.pe_sink, self.de_sink = Sink(), Sink()
        self.pe_role.attach(self.pe_sink)
        self.de_role.attach(self.de_sink)
        self.pe_log = record_transitions(self.pe_role.rooms)
        self.de_log = record_transitions(self.de_role.rooms)
        # What crossed the wire, in order.
        self.submits: list[tuple[int, int, int, int]] = []  # (room, seq, total, pages)
        kv = self.pe_engine.runner.kv_cache
        self.page_bytes = kv.layout.bytes_per_page * len(kv.regions())  # one page, every K and V
        self.pe_sent: list[tuple[type, int]] = []
        self.de_sent: list[tuple[type, int]] = []
        self.on_submit = None  # test hook: called with (room, seq, total, local, remote) after the copy
        self._wrap_submit()
        self._wrap_send(self.pe_control, self.pe_sent)
        self._wrap_send(self.de_control, self.de_sent)
        self.prefill_addr = self.pe_control.address

    def _role(self, cls, engine, name, fingerprint, backend_opts, clock):
        # As PDContext: control channel, role, then the agent over KV pool, handoff and staging slots.
        control = ControlChannel("127.0.0.1", SECRET, name)
        self._closers.append(control.close)
        role = cls(engine, self.config, control, None, fingerprint)
        if clock is not None:
            role.rooms = RoomTable(self.config.deadlines(), clock=clock)
        regions = [
            *engine.runner.kv_cache.regions(),
            (role.handoff.base_addr, role.handoff.nbytes),
            role.staging.region(),
        ]
        agent = TransferAgent("fake", name, regions, **(backend_opts or {}))
        if clock is not None:
            agent.clock = clock  # (expiries are set by the room clock)
        self._closers.append(agent.close)
        agent.metadata()
        role.agent = agent
        return role, agent, control

    def _wrap_submit(self) -> None:
        submit = self.pe_agent.submit

        def wrapped(peer, local, remote, notif, **kw):
            room, seq, total = decode_notif(notif)
            if self.copy_bytes:  # the fake backend as a real in-process copier
                for (src, n), (dst, m) in zip(local, remote, strict=True):
                    assert n == m
                    ctypes.memmove(dst, src, n)
            if self.on_submit is not None:
                self.on_submit(room, seq, total, local, remote)
            nbytes = sum(n for _, n in local) - (self.pe_role.handoff.slot_bytes if total else 0)
            self.submits.append((room, seq, total, nbytes // self.page_bytes))
            return submit(peer, local, remote, notif, **kw)

        self.pe_agent.submit = wrapped
        submit_read = self.pe_agent.submit_read

        def wrapped_read(peer, local, remote, notif, **kw):
            if self.copy_bytes:  # the DE path's pulls of the decode's pages, copied for real too
                for (dst, n), (src, m) in zip(local, remote, strict=True):
                    assert n == m
                    ctypes.memmove(dst, src, n)
            return submit_read(peer, local, remote, notif, **kw)

        self.pe_agent.submit_read = wrapped_read

    @staticmethod
    def _wrap_send(control: ControlChannel, log: list) -> None:
        send = control.send

        def wrapped(addr, body, room):
            log.append((type(body), room))
            return send(addr, body, room)

        control.send = wrapped

    @property
    def pe_backend(self):
        return self.pe_agent.backend

    # ---- requests --------------------------------------------------------------------------------
    def requests(self, ids: list[int], max_tokens: int, rid: str, room: int, **params):
        """The pair of requests the router would send: prefill (max_tokens forced to 1) and decode."""
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
        preq = self.pe_engine.make_request(list(ids), sp, rid)
        preq.sampling_params = dataclasses.replace(sp, max_tokens=1)
        preq.max_tokens = 1
        preq.pd = room
        dreq = self.de_engine.make_request(list(ids), sp, rid)
        dreq.pd = (room, self.prefill_addr)
        return preq, dreq

    def submit_both(self, ids, max_tokens, rid, room=None, **params) -> int:
        room = room or new_room()
        preq, dreq = self.requests(ids, max_tokens, rid, room, **params)
        self.pe_role.add(preq, None)
        self.de_role.add(dreq, None)
        return room

    # ---- the loop --------------------------------------------------------------------------------
    def turn(self, prefill: bool = True, decode: bool = True, step_prefill: bool = True) -> None:
        if prefill:
            self.pe_role.tick()
        if decode:
            self.de_role.tick()
        busy = False
        if prefill and step_prefill and self.pe_engine.has_unfinished():
            for out in self.pe_engine.step():
                self.pe_sink.deliver(out, out.request_id)
            busy = True
        if decode and self.de_engine.has_unfinished():
            for out in self.de_engine.step():
                self.de_sink.deliver(out, out.request_id)
            busy = True
        # Every page's references match its holders (requests, the prefill's write pins) at every turn,
        # not only when idle.
        self.pe_engine.check_integrity()
        self.de_engine.check_integrity()
        if not busy:
            time.sleep(0.0005)  # let the control and agent threads move

    def drive(self, until, timeout_s: float = 10.0, **turn_kw) -> None:
        end = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < end, f"condition not reached in {timeout_s} s: {self.describe()}"
            self.turn(**turn_kw)

    def settle(self, seconds: float = 0.05, **turn_kw) -> None:
        """Keep turning for a while (for 'nothing more happens' checks)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.turn(**turn_kw)

    def idle(self) -> bool:
        return (
            len(self.pe_role.rooms) == 0
            and len(self.de_role.rooms) == 0
            and not self.pe_role.by_room
            and not self.de_role.releasing
            and not self.pe_engine.requests
            and not self.de_engine.requests
        )

    def describe(self) -> str:
        return (
            f"prefill rooms {self.pe_role.rooms.counts()} by_room {list(self.pe_role.by_room)} "
            f"pages {self.pe_engine.kv.pool.num_used_pages}; decode rooms {self.de_role.rooms.counts()} "
            f"prealloc {[d.room for d in self.de_role.prealloc]} transfer {list(self.de_role.transfer)} "
            f"releasing {list(self.de_role.releasing)} pages {self.de_engine.kv.pool.num_used_pages}; "
            f"pe sent {self.pe_sent} de sent {self.de_sent}"
        )

    def assert_clean(self) -> None:
        """Nothing held anywhere, and every integrity check passes."""
        for engine, role in ((self.pe_engine, self.pe_role), (self.de_engine, self.de_role)):
            engine.check_integrity()
            role.check_integrity()
            assert engine.kv.pool.num_used_pages == 0
            assert not engine.requests
            assert len(role.rooms) == 0
            assert role.handoff.num_free == role.handoff.num_slots
            assert role.staging.num_used_pages == 0
            assert not role.by_request
        assert not self.pe_role.by_room and not self.pe_role.transfers
        assert not self.de_role.prealloc and not self.de_role.transfer and not self.de_role.releasing
        assert len(self.de_role.aborts) == 0

    def close(self) -> None:
        for close in reversed(self._closers):
            close()


@pytest.fixture(scope="module")
def ckpt(hf_checkpoints) -> str:
    return hf_checkpoints["llama"][0]


@pytest.fixture
def make_pair(ckpt):
    pairs = []

    def make(**kw) -> Pair:
        pair = Pair(ckpt, **kw)
        pairs.append(pair)
        return pair

    yield make
    for p in pairs:
        p.close()


@pytest.fixture(scope="module")
def colocated(ckpt):
    return LLM(ckpt, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=64, max_model_len=256)


def states(log, room) -> list[KVState]:
    return [s for r, s in log if r == room]


FULL_PATH = [KVState.Bootstrapping, KVState.WaitingForInput, KVState.Transferring, KVState.Success]


# ---- 1. happy path ---------------------------------------------------------------------------------
def test_happy_path_states_page_release_and_greedy_equals_colocated(make_pair, colocated):
    p = make_pair(copy_bytes=True)
    ids = prompt(18)
    room = p.submit_both(ids, 6, "r1")
    assert p.pe_role.rooms.state(room) == KVState.Bootstrapping
    assert p.de_role.rooms.state(room) == KVState.Bootstrapping
    assert p.de_sent == [(Register, 1)]  # registration: once per prefill, echo id 1

    # The prefill computes nothing before the decode's KVRequest says where the pages go.
    p.drive(lambda: p.de_role.rooms.state(room) == KVState.WaitingForInput)
    assert p.pe_engine.kv.pool.num_used_pages == 0
    assert p.de_engine.kv.pool.num_used_pages == 5  # ceil(18 / 4) prompt pages, reserved
    assert (KVRequest, room) in p.de_sent
    p.drive(lambda: p.pe_role.rooms.state(room) != KVState.Bootstrapping, step_prefill=False)
    assert p.pe_role.rooms.state(room) == KVState.WaitingForInput
    assert p.pe_role.queue_sizes() == {"bootstrap": 0, "waiting": 1, "inflight": 0}

    released_in: list[KVState] = []
    release_held = p.pe_engine.release_held

    def spy(req):
        released_in.append(p.pe_role.rooms.state(room))
        release_held(req)

    p.pe_engine.release_held = spy

    # Token 1 on the prefill, the last write (pages + handoff row) goes out; the decode commits.
    p.drive(lambda: bool(p.de_sink.outputs("r1")))
    assert p.submits == [(room, 1, 1, 5)]  # one write: all 5 prompt pages and the handoff row
    assert p.de_sink.outputs("r1")[0].outputs[0].token_ids == p.pe_sink.final("r1").outputs[0].token_ids
    # The decode committed and acked, but the prefill has not processed the ack yet: pages still held.
    assert room not in p.de_role.rooms
    assert p.pe_role.rooms.state(room) == KVState.Transferring
    assert p.pe_engine.kv.pool.num_used_pages == 5
    assert released_in == []
    assert (Status, room) in p.de_sent

    p.drive(lambda: not p.pe_role.by_room)
    assert released_in == [KVState.Success]  # freed only once the decode's Status(Success) arrived
    assert p.pe_engine.kv.pool.num_used_pages == 0
    assert states(p.pe_log, room) == FULL_PATH
    assert states(p.de_log, room) == FULL_PATH

    p.drive(lambda: p.idle())  # the decode goes on decoding from token 2
    ref = colocated.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=6))
    out = p.de_sink.final("r1")
    assert out.outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 6
    assert p.de_role.num_handoff_mismatches == 0
    assert p.pe_role.failures == {} and p.de_role.failures == {}
    assert p.pe_sent == [(RegisterAck, 1)]
    p.assert_clean()


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_on_a_gpu_the_last_pages_and_the_handoff_row_go_in_separate_writes(make_pair, colocated, staged):
    """On a GPU the pages (and staging slots) are GPU memory and the handoff slots host memory, and one
    NIXL transfer moves one kind of memory per side: the last write carried both, so NIXL refused it
    and every ordinary PD request failed on a GPU (found by two reviews; NIXL's RegionIndex raises
    'span host and GPU memory'). With `handoff_apart` (set on a GPU) the pages go first, then the
    handoff row alone; the decode counts both writes and commits."""
    p = make_pair(copy_bytes=True, staging_threshold=-1.0 if staged else 2.0)
    p.pe_role.handoff_apart = True  # as on a GPU: the pool's device is not the handoff's
    handoff = (p.pe_role.handoff.base_addr, p.pe_role.handoff.base_addr + p.pe_role.handoff.nbytes)
    kinds = []
    p.on_submit = lambda room, seq, total, local, remote: kinds.append(
        {handoff[0] <= addr < handoff[1] for addr, _ in local}
    )
    ids = prompt(18)
    room = p.submit_both(ids, 6, "r1")
    p.drive(lambda: p.idle())
    assert kinds == [{False}, {True}]  # the pages alone, then the handoff row alone
    assert p.submits == [(room, 1, 0, 5), (room, 2, 2, 0)]
    ref = colocated.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=6))
    assert p.de_sink.final("r1").outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert p.de_role.num_staged == (1 if staged else 0)
    assert p.pe_role.failures == {} and p.de_role.failures == {}
    p.assert_clean()


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_chunked_prefill_streams_pages_and_decode_prefix_hit_asks_only_the_rest(make_pair, colocated, staged):
    """Budget 8 tokens: a 30-token prompt is written in 4 pieces while later chunks compute. A second
    prompt sharing 24 tokens hits the decode's own prefix cache: the KVRequest covers only pages 6-7.
    Staged: every write goes through the decode's staging slot and is scattered at commit."""
    p = make_pair(copy_bytes=True, pe_budget=8, staging_threshold=-1.0 if staged else 0.5)
    a = prompt(30, start=3)
    b = a[:24] + prompt(6, start=9)
    room_a = p.submit_both(a, 5, "a")
    p.drive(lambda: len(p.submits) == 1)  # then hold the prefill's engine until the decode saw write 1
    p.drive(lambda: p.de_role.rooms.rooms_in(KVState.Transferring) == [room_a], step_prefill=False)
    assert p.de_role.transfer[room_a].notifs == {1} and p.de_role.transfer[room_a].total == 0
    assert p.pe_role.rooms.state(room_a) == KVState.Transferring
    p.drive(lambda: p.idle())
    assert p.submits == [(room_a, 1, 0, 2), (room_a, 2, 0, 2), (room_a, 3, 0, 2), (room_a, 4, 4, 2)]
    assert states(p.pe_log, room_a) == FULL_PATH
    assert states(p.de_log, room_a) == FULL_PATH

    sent_before = len(p.submits)
    room_b = p.submit_both(b, 5, "b")
    kv_requests = []
    handle = p.pe_role._on_kv_request

    def spy(room, sender, msg):
        kv_requests.append((room, msg))
        handle(room, sender, msg)

    p.pe_role._on_kv_request = spy
    p.drive(lambda: p.idle())
    assert [(r, m.decode_prefix_len, len(m.dst_page_ids)) for r, m in kv_requests] == [(room_b, 24, 2)]
    assert p.submits[sent_before:] == [(room_b, 1, 1, 2)]  # pages 6 and 7 (+ the handoff row)
    assert p.de_sent.count((Register, 1)) == 1  # registered once per prefill

    ref = colocated.generate(
        [{"prompt_token_ids": a}, {"prompt_token_ids": b}], SamplingParams(temperature=0, max_tokens=5)
    )
    assert p.de_sink.final("a").outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert p.de_sink.final("b").outputs[0].token_ids == ref[1].outputs[0].token_ids
    # Cached tokens reported = what the prefill did not recompute (its own prefix hit: 24 tokens).
    assert p.de_sink.final("b").num_cached_tokens == 24
    assert p.de_role.num_staged == (2 if staged else 0)
    p.assert_clean()


def test_logprobs_of_token_one_travel_in_the_handoff_row(make_pair, colocated):
    p = make_pair(copy_bytes=True)
    ids = prompt(13, start=5)
    p.submit_both(ids, 3, "lp", logprobs=3)
    p.drive(lambda: p.idle())
    ref = colocated.generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=3, logprobs=3)
    )[0].outputs[0]
    got = p.de_sink.final("lp").outputs[0]
    assert got.token_ids == ref.token_ids
    assert got.logprobs[0].logprob == pytest.approx(ref.logprobs[0].logprob, rel=1e-6)
    assert [t for t, _ in got.logprobs[0].top] == [t for t, _ in ref.logprobs[0].top]
    assert [t.rank for t in got.logprobs] == [t.rank for t in ref.logprobs] == [1, 1, 1]  # (greedy)
    p.assert_clean()


# ---- 2. the metadata gate --------------------------------------------------------------------------
def _expect_gate_failure(p: Pair, room: int, rid: str) -> None:
    p.drive(lambda: p.de_role.num_handoff_mismatches == 1)
    assert p.de_role.rooms.state(room) == KVState.Failed
    assert p.de_role.rooms.reason(room) == "handoff room mismatch"
    assert p.de_sink.errors(rid) == ["PD transfer failed: handoff room mismatch"]
    assert p.de_sink.outputs(rid) == []
    # Two-phase abort: Abort sent, pages held until the prefill's AbortAck.
    assert (Abort, room) in p.de_sent
    assert room in p.de_role.releasing
    assert p.de_engine.kv.pool.num_used_pages > 0
    p.drive(lambda: p.idle())
    assert p.pe_sent[-1] == (AbortAck, room)
    assert p.pe_role.failures == {"aborted by decode": 1}
    assert p.de_role.failures == {"handoff room mismatch": 1}
    assert p.de_role.aborts.num_acked == 1
    assert states(p.pe_log, room)[-1] == KVState.Failed
    p.assert_clean()


def test_gate_fails_request_when_handoff_row_never_landed(make_pair):
    p = make_pair(copy_bytes=False)  # fake: neither KV nor the handoff row is copied
    room = p.submit_both(prompt(10), 4, "g0")
    _expect_gate_failure(p, room, "g0")


def test_gate_fails_request_when_handoff_row_carries_another_room(make_pair):
    p = make_pair(copy_bytes=True)

    def forge(room, seq, total, local, remote):
        if total:  # the last write: land a valid row, but of another room, in the decode's slot
            dst, n = remote[-1]
            row = HandoffRow(room=room + 1, first_token_id=7)
            slot = (dst - p.de_role.handoff.base_addr) // n
            p.de_role.handoff.write_local(slot, row)

    p.on_submit = forge
    room = p.submit_both(prompt(10), 4, "g1")
    _expect_gate_failure(p, room, "g1")


# ---- 3. deadlines in every non-terminal state --------------------------------------------------------
def test_deadline_prefill_bootstrapping_no_kv_request(make_pair):
    p = make_pair(fake_clocks=True)
    room = new_room()
    preq, _ = p.requests(prompt(9), 4, "pb", room)
    p.pe_role.add(preq, None)
    p.settle(0.02, decode=False)
    assert p.pe_role.rooms.state(room) == KVState.Bootstrapping
    p.pe_clock.advance(DEADLINE_S)  # expiry is strict: exactly at the deadline nothing happens
    p.pe_role.tick()
    assert p.pe_role.rooms.state(room) == KVState.Bootstrapping
    p.pe_clock.advance(0.01)
    p.pe_role.tick()
    assert p.pe_sink.errors("pb") == ["prefill failed: deadline in Bootstrapping"]
    assert p.pe_role.rooms.num_expired == 1
    assert p.pe_role.failures == {"deadline in Bootstrapping": 1}
    assert states(p.pe_log, room) == [KVState.Bootstrapping, KVState.Failed]
    assert p.pe_sent == []  # no peer ever asked: nobody to tell
    p.assert_clean()


def test_deadline_prefill_waiting_for_input_reports_failed_status_to_decode(make_pair):
    p = make_pair(fake_clocks=True)
    room = p.submit_both(prompt(9), 4, "pw")
    # The prefill's engine never steps: its room waits for input forever.
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.WaitingForInput, step_prefill=False)
    assert p.de_role.rooms.state(room) == KVState.WaitingForInput
    p.pe_clock.advance(DEADLINE_S + 0.01)
    p.pe_role.tick()
    assert room not in p.pe_role.rooms and not p.pe_engine.requests
    assert p.pe_sent[-1] == (Status, room)
    assert p.pe_sink.errors("pw") == ["prefill failed: deadline in WaitingForInput"]
    # The decode frees on Status(Failed) directly: the prefill promised nothing is in flight.
    p.drive(lambda: p.idle(), step_prefill=False)
    assert p.de_sink.errors("pw") == ["PD transfer failed: prefill failed: deadline in WaitingForInput"]
    assert (Abort, room) not in p.de_sent
    assert p.de_role.aborts.num_acked == 0
    p.assert_clean()


def test_deadline_prefill_transferring_without_success_ack(make_pair):
    p = make_pair(fake_clocks=True, pe_backend={"lose_notifications": True})
    room = p.submit_both(prompt(9), 4, "pt")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.Transferring and not p.pe_role.transfers)
    assert p.de_role.rooms.state(room) == KVState.WaitingForInput  # the notification was lost
    assert p.pe_engine.kv.pool.num_used_pages == 3
    p.pe_clock.advance(DEADLINE_S + 0.01)  # only the prefill's clock moves
    p.pe_role.tick()
    assert room not in p.pe_role.rooms and p.pe_engine.kv.pool.num_used_pages == 0
    assert p.pe_sent[-1] == (Status, room)
    assert p.pe_role.failures == {"deadline in Transferring": 1}
    assert p.pe_sink.errors("pt") == []  # token 1 was sampled; the waiter already got its output
    p.drive(lambda: p.idle())
    assert p.de_sink.errors("pt") == ["PD transfer failed: prefill failed: deadline in Transferring"]
    p.assert_clean()


def test_deadline_decode_bootstrapping_registration_never_answered(make_pair):
    p = make_pair(fake_clocks=True)
    room = new_room()
    _, dreq = p.requests(prompt(9), 4, "db", room)
    p.de_role.add(dreq, None)
    p.settle(0.02, prefill=False)  # the prefill is down: Register is never answered
    assert p.de_role.rooms.state(room) == KVState.Bootstrapping
    assert p.de_engine.kv.pool.num_used_pages == 0
    p.de_clock.advance(DEADLINE_S + 0.01)
    p.de_role.tick()
    assert p.de_sink.errors("db") == ["PD transfer failed: deadline in Bootstrapping"]
    assert p.de_sent == [(Register, 1), (Abort, room)]  # never requested KV: freed at once
    assert p.de_role.queue_sizes() == {"prealloc": 0, "transfer": 0, "releasing": 0}
    p.assert_clean()


def test_deadline_decode_waiting_for_input_frees_only_after_abort_ack(make_pair):
    p = make_pair(fake_clocks=True)
    room = new_room()
    _, dreq = p.requests(prompt(9), 4, "dw", room)
    p.de_role.add(dreq, None)  # the router's request never reaches the prefill
    p.drive(lambda: room in p.pe_role.early)
    assert p.de_role.rooms.state(room) == KVState.WaitingForInput
    p.de_clock.advance(DEADLINE_S + 0.01)
    p.de_role.tick()
    assert p.de_sink.errors("dw") == ["PD transfer failed: deadline in WaitingForInput"]
    assert p.de_sent[-1] == (Abort, room)
    assert room in p.de_role.releasing and p.de_engine.kv.pool.num_used_pages == 3
    p.settle(0.05, prefill=False)  # no ack yet: the pages stay held
    assert p.de_engine.kv.pool.num_used_pages == 3
    p.drive(lambda: p.idle())
    assert p.pe_sent[-1] == (AbortAck, room)  # the prefill acks a room it never saw
    assert p.de_role.aborts.num_acked == 1 and p.de_role.aborts.num_lease_expired == 0
    p.assert_clean()


def test_deadline_decode_waiting_for_input_frees_after_lease_when_prefill_is_gone(make_pair):
    p = make_pair(fake_clocks=True)
    room = new_room()
    _, dreq = p.requests(prompt(9), 4, "dl", room)
    p.de_role.add(dreq, None)
    p.drive(lambda: room in p.pe_role.early)
    p.de_clock.advance(DEADLINE_S + 0.01)
    p.de_role.tick()
    assert room in p.de_role.releasing
    # The prefill is partitioned from now on: the Abort is never answered.
    p.de_clock.advance(LEASE_S)
    p.settle(0.05, prefill=False)
    assert room in p.de_role.releasing and p.de_engine.kv.pool.num_used_pages == 3
    p.de_clock.advance(0.01)
    p.de_role.tick()
    assert p.de_role.aborts.num_lease_expired == 1 and p.de_role.aborts.num_acked == 0
    assert p.de_engine.kv.pool.num_used_pages == 0
    assert not p.de_engine.requests and len(p.de_role.rooms) == 0
    p.de_engine.check_integrity()
    p.de_role.check_integrity()


def test_deadline_decode_transferring_when_last_notification_is_lost(make_pair):
    """Chunked prefill: the first write's notification arrives (decode Transferring), later ones are
    lost. The decode times out in Transferring, aborts, and the prefill acks once nothing is in flight."""
    p = make_pair(fake_clocks=True, pe_budget=8)

    def lose_after_first(room, seq, total, local, remote):
        if seq == 2:  # write 1 is announced (its notif is queued once it is done); the rest are lost
            end = time.monotonic() + 5
            while p.pe_agent.stats.transfers_done < 1 and time.monotonic() < end:
                time.sleep(0.001)
            p.pe_backend.lose_notifications = True

    p.on_submit = lose_after_first
    room = p.submit_both(prompt(30), 4, "dt")
    p.drive(lambda: p.pe_role.by_room[room].sent_last and not p.pe_role.transfers)
    p.drive(lambda: p.de_role.rooms.state(room) == KVState.Transferring)
    p.settle(0.02)
    assert p.de_role.transfer[room].notifs == {1}
    assert p.pe_role.rooms.state(room) == KVState.Transferring
    p.de_clock.advance(DEADLINE_S + 0.01)  # only the decode's clock moves
    p.de_role.tick()
    assert p.de_sink.errors("dt") == ["PD transfer failed: deadline in Transferring"]
    assert room in p.de_role.releasing and p.de_engine.kv.pool.num_used_pages == 8
    p.drive(lambda: p.idle())
    assert p.pe_sent[-1] == (AbortAck, room)
    assert p.pe_role.failures == {"aborted by decode": 1}
    assert p.de_role.aborts.num_acked == 1
    p.assert_clean()


def test_lost_notifications_decode_times_out_in_waiting_for_input(make_pair):
    p = make_pair(fake_clocks=True, pe_backend={"lose_notifications": True})
    room = p.submit_both(prompt(9), 4, "ln")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.Transferring and not p.pe_role.transfers)
    p.settle(0.02)
    assert p.de_role.rooms.state(room) == KVState.WaitingForInput  # every write done, none announced
    p.de_clock.advance(DEADLINE_S + 0.01)
    p.de_role.tick()
    assert p.de_role.rooms.reason(room) == "deadline in WaitingForInput"
    p.drive(lambda: p.idle())
    assert p.de_sink.errors("ln") == ["PD transfer failed: deadline in WaitingForInput"]
    assert p.de_role.aborts.num_acked == 1
    p.assert_clean()


# ---- 4. abort races ----------------------------------------------------------------------------------
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_client_abort_on_decode_mid_transfer_is_two_phase(make_pair, staged):
    p = make_pair(  # writes stay in flight until aborted
        pe_budget=8, pe_backend={"delay_s": 2.0}, staging_threshold=-1.0 if staged else 0.5
    )
    room = p.submit_both(prompt(30), 8, "ab")
    p.drive(lambda: len(p.submits) >= 1)
    pr = p.pe_role.by_room[room]
    assert pr.in_flight and not pr.sent_last and p.pe_role.rooms.state(room) == KVState.Transferring
    assert (pr.staging_offset >= 0) == staged
    assert (p.de_role.staging.num_used_pages == 8) == staged  # the decode's staging slot: all 8 pages

    freed_when: list[tuple[bool, int]] = []
    free = p.de_role._free

    def spy(dr):  # when the decode frees: does the prefill still track the room / have writes?
        freed_when.append((room in p.pe_role.by_room, len(p.pe_role.transfers)))
        free(dr)

    p.de_role._free = spy
    release_held = p.pe_engine.release_held
    released_with_inflight: list[int] = []

    def spy_release(req):
        released_with_inflight.append(len(p.pe_role.by_room[room].in_flight))
        release_held(req)

    p.pe_engine.release_held = spy_release

    assert p.de_role.abort("ab") is None
    assert p.de_sink.errors("ab") == ["PD transfer failed: aborted by client"]
    assert p.de_sent[-1] == (Abort, room)
    assert room in p.de_role.releasing and p.de_engine.kv.pool.num_used_pages == 8
    p.de_role.tick()
    assert p.de_engine.kv.pool.num_used_pages == 8  # still held: no AbortAck yet
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.Failed, step_prefill=False)  # mid-prefill
    assert p.pe_role.rooms.reason(room) == "aborted by decode: aborted by client"
    assert p.de_engine.kv.pool.num_used_pages == 8
    p.drive(lambda: p.idle())
    assert released_with_inflight == [0]  # the prefill freed only once none of its writes was in flight
    assert freed_when == [(False, 0)]  # the decode freed only after the prefill was done with the room
    assert p.pe_sent[-1] == (AbortAck, room)
    assert p.de_role.aborts.num_acked == 1
    assert p.pe_sink.errors("ab")[0] == "prefill failed: aborted by decode: aborted by client"  # unfinished
    assert p.de_sink.outputs("ab") == []
    p.assert_clean()


def test_a_stalled_prefills_writes_end_with_its_rooms_life_before_the_decodes_lease_frees_pages(make_pair):
    """DESIGN §4: a freed page is never written by a late copy. The decode frees an aborted room's pages
    a lease after its Abort (no AbortAck came); that is safe only if the prefill's writes of the room
    are over by then. Its engine thread aborts them at the room's deadline, but a stalled engine thread
    (a long step, a paused process) does not, and its transfer agent kept the writes alive: the decode
    reused the pages a live write aimed at (a review). The agent now aborts them itself at the room's
    end of life, which comes before the lease ends."""
    p = make_pair(fake_clocks=True, pe_budget=8, pe_backend={"delay_s": 30.0})  # the write stays in flight
    room = p.submit_both(prompt(30), 8, "old")
    p.drive(lambda: len(p.submits) >= 1)
    pr = p.pe_role.by_room[room]
    assert pr.in_flight and p.pe_role.rooms.state(room) == KVState.Transferring
    # From here the prefill's engine thread does not run; its agent thread does.
    p.de_role.abort("old", client_abort=True)
    p.de_role.tick()
    assert room in p.de_role.releasing
    life_s = p.config.room_life_s
    assert life_s < p.config.lease_s  # (what makes the agent's abort come first)
    p.pe_clock.advance(life_s + 0.01)
    stats = p.pe_agent.stats
    deadline = time.monotonic() + 10
    while getattr(stats, "transfers_expired", 0) < len(pr.in_flight) and time.monotonic() < deadline:
        time.sleep(0.005)  # (the agent's thread: its clock says the room's life is over)
    assert stats.transfers_done + stats.transfers_failed == stats.transfers_submitted  # nothing can land
    assert stats.transfers_expired == len(pr.in_flight) >= 1
    p.de_clock.advance(p.config.lease_s + 0.01)
    p.turn(prefill=False)
    assert room not in p.de_role.releasing  # (the lease freed the pages: no write of the room is alive)
    p.drive(lambda: p.idle())  # the prefill's thread comes back: the room fails, nothing else happens
    assert p.pe_role.rooms.num_expired == 1 and room not in p.pe_role.by_room
    p.assert_clean()


def test_decode_abort_mid_transfer_counts_one_failure(make_pair):
    p = make_pair(pe_budget=8, pe_backend={"delay_s": 2.0})
    room = p.submit_both(prompt(30), 8, "ab2")
    p.drive(lambda: len(p.submits) >= 1)
    p.de_role.abort("ab2")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.Failed, step_prefill=False)
    p.drive(lambda: p.idle())
    assert p.pe_role.failures == {"aborted by decode": 1}
    assert p.pe_sink.errors("ab2") == ["prefill failed: aborted by decode: aborted by client"]
    assert room not in p.pe_role.rooms


def test_abort_reaches_prefill_before_router_request_is_acked(make_pair):
    p = make_pair()
    room = new_room()
    _, dreq = p.requests(prompt(9), 4, "early", room)
    p.de_role.add(dreq, None)
    p.drive(lambda: room in p.pe_role.early)  # KVRequest beat the router's POST to the prefill
    p.de_role.abort("early")
    assert room in p.de_role.releasing and p.de_engine.kv.pool.num_used_pages == 3
    p.drive(lambda: p.idle())
    assert p.pe_sent == [(RegisterAck, 1), (AbortAck, room)]
    assert p.de_role.aborts.num_acked == 1
    p.assert_clean()


def test_router_request_after_acked_abort_never_writes_into_freed_decode_pages(make_pair):
    p = make_pair()
    room = new_room()
    preq, dreq = p.requests(prompt(9), 4, "late", room)
    p.de_role.add(dreq, None)
    p.drive(lambda: room in p.pe_role.early)
    p.de_role.abort("late")
    p.drive(lambda: not p.de_role.releasing)  # acked: the decode freed (and may reuse) the pages
    assert p.de_engine.kv.pool.num_used_pages == 0
    # The router's request for the room arrives late: refused as a failure (503: the router retries
    # it elsewhere), not as a bad request (a 400 the router would relay) nor as an abort.
    with pytest.raises(RuntimeError, match="aborted by its decode engine: aborted by client") as refused:
        p.pe_role.add(preq, None)
    assert type(refused.value) is RuntimeError
    p.settle(0.1)
    assert p.submits == []
    assert room not in p.pe_role.early


def test_early_kv_requests_and_tombstones_are_kept_for_their_bound_and_no_longer(make_pair):
    """DESIGN §8 says no room is left in any table after a request ends. The prefill keeps two on
    purpose: a KVRequest that beat the router's request (for one deadline) and a tombstone of a room
    that ended before one side knew it (for the abort lease). Neither was checked: a prune that stopped
    working would grow them by one entry per such room, unseen. Each goes at its bound (room clock),
    and `check_integrity` holds that none outlived its bound at the last prune."""
    p = make_pair(fake_clocks=True)
    parked, aborted = new_room(), new_room()
    _, dreq = p.requests(prompt(9), 4, "parked", parked)
    p.de_role.add(dreq, None)
    p.drive(lambda: parked in p.pe_role.early)  # (the router's request never comes)
    preq, _ = p.requests(prompt(9, start=40), 4, "gone", aborted)
    p.pe_role.add(preq, None)
    p.pe_role.abort("gone")
    p.settle(0.02, decode=False)
    assert aborted in p.pe_role.tombstones and parked in p.pe_role.early
    p.pe_clock.advance(p.config.deadline_s - 0.01)
    p.turn(decode=False)
    assert parked in p.pe_role.early  # (within its bound)
    p.pe_role.check_integrity()
    p.pe_clock.advance(0.02)
    p.turn(decode=False)
    assert parked not in p.pe_role.early and aborted in p.pe_role.tombstones
    p.pe_role.check_integrity()
    p.pe_clock.advance(p.config.lease_s)
    p.turn(decode=False)
    assert p.pe_role.tombstones == {} and p.pe_role.early == {}
    p.pe_role.check_integrity()
    old = p.pe_role.pruned_at_s - p.config.lease_s - 1  # (one a broken prune would have left)
    p.pe_role.tombstones[aborted] = Tombstone(old, "test", False, False)
    with pytest.raises(AssertionError):
        p.pe_role.check_integrity()
    del p.pe_role.tombstones[aborted]
    p.de_role.abort("parked")
    p.drive(lambda: p.idle())
    p.assert_clean()


@pytest.mark.parametrize("client_abort", [True, False], ids=["abort_request", "other_failure"])
def test_prefill_abort_before_the_decode_asked_answers_its_late_kv_request_at_once(make_pair, client_abort):
    """/abort_request reaches the prefill while the decode's half is still being tokenized (the
    decode's own abort_request found nothing to end). The decode's KVRequest comes after the room is
    gone: it is told Failed at once (before: parked, the decode waited out its deadline, then a 503),
    and an abort on purpose reaches the decode's caller as an abort (RequestAborted), not an error."""
    p = make_pair(fake_clocks=True)  # no clock moves: a deadline cannot be what ends the decode's room
    room = new_room()
    preq, dreq = p.requests(prompt(9), 4, "pa", room)
    p.pe_role.add(preq, None)
    p.settle(0.02, decode=False)
    assert p.pe_role.abort("pa", client_abort=client_abort) is None
    p.settle(0.02, decode=False)  # nothing in flight: reaped at once
    assert room not in p.pe_role.by_room and p.pe_role.tombstones[room].client_abort == client_abort
    assert [type(x) for x in p.pe_sink.items["pa"]] == [RequestAborted if client_abort else RuntimeError]
    assert p.pe_sent == []  # no decode asked yet: nobody to tell

    p.de_role.add(dreq, None)
    p.drive(lambda: p.idle())
    assert p.de_sink.errors("pa") == ["PD transfer failed: prefill failed: aborted by client"]
    assert [type(x) for x in p.de_sink.items["pa"]] == [RequestAborted if client_abort else RuntimeError]
    assert p.pe_sent == [(RegisterAck, 1), (Status, room)]
    assert room not in p.pe_role.early  # answered, not parked
    assert p.de_role.failures == {"prefill failed": 1} and p.de_engine.kv.pool.num_used_pages == 0
    p.assert_clean()


def test_kv_request_polled_after_the_room_failed_but_before_it_was_reaped_is_answered(make_pair):
    """The decode's KVRequest reaches the prefill's next tick after the room failed (an abort between
    ticks; a busy prefill's step can last long) but before `_reap` released it. It is answered Failed
    with the rest (before: ignored as a duplicate KVRequest, and the decode waited out its deadline)."""
    p = make_pair(fake_clocks=True)  # no deadline passes: only the answer can end the decode's room
    room = p.submit_both(prompt(9), 4, "between")
    p.drive(lambda: (KVRequest, room) in p.de_sent)  # (the prefill ticked before the decode sent it)
    wait_until(  # delivered to the prefill's inbox, not yet polled
        lambda: any(isinstance(e.body, KVRequest) and e.room == room for e in list(p.pe_control._inbox)),
        10,
        "the KVRequest in the prefill's inbox",
        0.001,
    )
    assert p.pe_role.abort("between", client_abort=True) is None
    p.drive(lambda: p.idle())
    assert p.pe_role.failures == {"aborted by client": 1}  # (no "duplicate KVRequest ignored")
    assert (Status, room) in p.pe_sent
    assert [type(x) for x in p.de_sink.items["between"]] == [RequestAborted]
    assert room not in p.pe_role.tombstones  # (told directly: nothing left to answer later)
    p.assert_clean()


def test_decode_abort_request_ends_the_prefills_half_as_an_abort_and_a_late_one_too(make_pair):
    """/abort_request on the decode (its id is the one a client sees) while the prefill computes: the
    prefill's caller (the router) gets RequestAborted, so it answers "abort" and is not retried on
    another prefill; a room the decode aborted before the router's request reached the prefill
    refuses that request the same way."""
    p = make_pair(pe_budget=8, pe_backend={"delay_s": 2.0})
    room = p.submit_both(prompt(30), 8, "da")
    p.drive(lambda: len(p.submits) >= 1)
    assert p.de_role.abort("da", client_abort=True) is None
    assert [type(x) for x in p.de_sink.items["da"]] == [RequestAborted]
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.Failed, step_prefill=False)  # mid-prefill
    p.drive(lambda: p.idle())
    assert p.pe_role.rooms.num_expired == 0
    assert p.pe_sink.errors("da") == ["prefill failed: aborted by decode: aborted by client"]
    assert [type(x) for x in p.pe_sink.items["da"] if isinstance(x, BaseException)] == [RequestAborted]

    late = new_room()
    preq, dreq = p.requests(prompt(9), 4, "late2", late)
    p.de_role.add(dreq, None)
    p.drive(lambda: late in p.pe_role.early)
    p.de_role.abort("late2", client_abort=True)
    p.drive(lambda: not p.de_role.releasing)
    with pytest.raises(RequestAborted, match="aborted by its decode engine: aborted by client"):
        p.pe_role.add(preq, None)
    p.assert_clean()


def test_after_new_weights_a_decode_registered_under_the_old_ones_is_refused_at_once(make_pair):
    """A weight update on the prefill only (`new_weights`): the decode registered under the old
    fingerprint, so its KVRequest is refused with Status(Failed) to its registered address (it frees
    at once: no deadline or lease passes here), never written to. Once the decode has the new weights
    too, it registers again (a fresh registration id) and the pair serves."""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    p.submit_both(prompt(9), 2, "old")
    p.drive(lambda: p.idle())
    p.pe_role.new_weights("new-weights|layout")
    assert not p.pe_role.peers and len(p.pe_role.stale_peers) == 1
    room = p.submit_both(prompt(9, start=2), 2, "mixed")
    p.drive(lambda: p.idle())
    assert p.submits == [(room - 1, 1, 1, 3)]  # (only the first request's write: none for "mixed")
    assert p.de_sink.errors("mixed") == [
        "PD transfer failed: prefill failed: decode registered under weights this prefill no longer serves"
    ]
    assert p.de_role.rooms.num_expired == 0 and not p.de_role.releasing
    # It registers again (a fresh id) rather than be refused forever; with its old weights it is
    # refused at registration, before any KV is asked for.
    (peer,) = p.de_role.peers.values()
    assert peer.state == "new" and peer.reg_id == 2
    p.submit_both(prompt(9, start=4), 2, "refused")
    p.drive(lambda: p.idle())
    assert p.de_sink.errors("refused")[0].startswith(
        "PD transfer failed: registration refused by prefill: KV layout"
    )
    p.de_role.new_weights("new-weights|layout")
    p.submit_both(prompt(9, start=3), 2, "new")
    p.drive(lambda: p.idle())
    assert len(p.de_sink.final("new").outputs[0].token_ids) == 2
    assert [m for m in p.de_sent if m[0] is Register] == [(Register, 1), (Register, 2), (Register, 3)]
    assert len(p.pe_role.peers) == 1 and not p.pe_role.stale_peers
    p.assert_clean()


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_pages_a_weight_update_could_not_drop_are_never_hit_under_the_new_weights(make_pair, ckpt, side):
    """A weight update with abort_running while a room still holds pages the reset cannot drop (the
    decode's prefix hits while its KV arrives; the prefill's source pages before the decode's ack):
    once released they return to the prefix cache under the old weights' keys, which no request
    computes any more. Before, the next request with that prompt hit them: KV of other weights."""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    ids = prompt(18)
    p.submit_both(ids, 2, "first")
    p.drive(lambda: p.idle())
    if side == "decode":  # the same prompt again: the decode holds its prefix hits, asks for the rest
        room = p.submit_both(ids, 2, "second")
        p.drive(lambda: p.de_role.rooms.state(room) == KVState.WaitingForInput, prefill=False)
        assert p.de_role.transfer[room].num_hit_tokens > 0
    else:  # sent and committed, the decode's ack not yet processed: the prefill still holds its pages
        p.pe_engine.kv.pool.reset_prefix_cache()
        room = p.submit_both(prompt(18, start=2), 2, "second")
        p.drive(lambda: bool(p.de_sink.outputs("second")))
        assert room in p.pe_role.by_room
    engine, role = (p.de_engine, p.de_role) if side == "decode" else (p.pe_engine, p.pe_role)
    engine.update_weights(ckpt, abort_running=True, abort=lambda rid: role.abort(rid, True))
    p.drive(lambda: p.idle())
    again = ids if side == "decode" else prompt(18, start=2)
    hits, _ = engine.kv.match_prefix(engine.make_request(list(again), SamplingParams(max_tokens=2), "third"))
    assert hits == []


def test_abort_after_decode_failure_keeps_pages_until_ack(make_pair):
    p = make_pair(fake_clocks=True)
    room = new_room()
    _, dreq = p.requests(prompt(9), 4, "twice", room)
    p.de_role.add(dreq, None)
    p.drive(lambda: room in p.pe_role.early)
    p.de_clock.advance(DEADLINE_S + 0.01)
    p.de_role.tick()
    assert p.de_sink.errors("twice")  # the stream gets the error; generate()'s finally aborts:
    p.de_role.abort("twice")
    assert p.de_engine.kv.pool.num_used_pages == 3  # still held: the prefill has not acked
    p.drive(lambda: not p.de_role.releasing)
    p.de_engine.check_integrity()


def test_duplicate_room_is_invalid_on_both_sides(make_pair):
    p = make_pair(copy_bytes=True)
    room = new_room()
    preq, dreq = p.requests(prompt(9), 4, "d1", room)
    p.pe_role.add(preq, None)
    p.de_role.add(dreq, None)
    preq2, dreq2 = p.requests(prompt(5), 4, "d2", room)
    with pytest.raises(InvalidRequest, match="already active on this prefill"):
        p.pe_role.add(preq2, None)
    with pytest.raises(InvalidRequest, match="already active on this decode"):
        p.de_role.add(dreq2, None)
    assert "d2" not in p.pe_engine.requests and "d2" not in p.de_engine.requests
    assert p.pe_role.by_request == {"d1": room} and p.de_role.by_request == {"d1": room}
    p.drive(lambda: p.idle())  # the first request is untouched
    assert p.de_sink.errors("d1") == [] and p.de_sink.final("d1").outputs[0].token_ids
    p.assert_clean()


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_duplicate_request_id_leaves_no_room_behind(make_pair, side):
    p = make_pair()
    first, second = new_room(), new_room()
    add = p.pe_role.add if side == "prefill" else p.de_role.add
    pick = 0 if side == "prefill" else 1
    add(p.requests(prompt(9), 4, "same", first)[pick], None)
    with pytest.raises(InvalidRequest, match="already active"):
        add(p.requests(prompt(9), 4, "same", second)[pick], None)
    role = p.pe_role if side == "prefill" else p.de_role
    assert second not in role.rooms


@pytest.mark.parametrize("replay", ["identical", "one_page_short"])
def test_replayed_kv_request_mid_transfer_never_frees_decode_pages_early(make_pair, replay):
    """A second KVRequest for a room past Bootstrapping is ignored, whatever it asks. (A mismatched one
    used to fail the room and send Status(Failed) at once, with the first request's writes in flight:
    the decode would have freed pages under them.)"""
    p = make_pair(pe_budget=8, pe_backend={"delay_s": 2.0}, copy_bytes=True)
    kv_requests = []
    handle = p.pe_role._on_kv_request

    def spy(room, sender, msg):
        kv_requests.append(msg)
        handle(room, sender, msg)

    p.pe_role._on_kv_request = spy
    room = p.submit_both(prompt(30), 8, "replay")
    p.drive(lambda: len(p.submits) >= 1)
    assert p.pe_role.by_room[room].in_flight
    in_flight_at_status: list[int] = []
    send = p.pe_control.send

    def spy_send(addr, body, r):  # Status(Failed) promises: no write of the room can still land
        if isinstance(body, Status) and r == room:
            pr = p.pe_role.by_room.get(room)
            in_flight_at_status.append(len(pr.in_flight) if pr else 0)
        return send(addr, body, r)

    p.pe_control.send = spy_send
    # A captured KVRequest replayed with the decode's identity (HMAC does not stop replays), as is or
    # one destination page short.
    first = kv_requests[0]
    replayed = (
        first
        if replay == "identical"
        else msgspec.structs.replace(first, dst_page_ids=first.dst_page_ids[:-1])
    )
    p.de_control.send(p.prefill_addr, replayed, room)
    p.drive(lambda: p.pe_role.failures.get("duplicate KVRequest ignored") == 1)
    assert p.pe_role.by_room[room].in_flight  # the replay arrived while the first writes were in flight
    p.drive(lambda: p.idle())
    # The replay is ignored and counted; the room is not failed under writes in flight (no
    # Status(Failed) is ever sent while one could still land), and the real request completes.
    assert in_flight_at_status == []
    assert p.pe_role.failures == {"duplicate KVRequest ignored": 1}
    assert p.de_sink.errors("replay") == [] and len(p.de_sink.final("replay").outputs[0].token_ids) == 8
    p.assert_clean()


# ---- 5. transfer failure ----------------------------------------------------------------------------
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_injected_transfer_failure_fails_both_sides_and_frees_everything(make_pair, staged):
    p = make_pair(copy_bytes=True, staging_threshold=-1.0 if staged else 0.5)
    p.pe_backend.fail_next(1)
    room = p.submit_both(prompt(11), 4, "tf")
    p.drive(lambda: p.idle())
    assert p.submits == [(room, 1, 1, 3)]
    assert states(p.pe_log, room) == [*FULL_PATH[:3], KVState.Failed]
    assert p.pe_role.failures == {"transfer failed": 1}
    assert p.pe_sent[-1] == (Status, room)
    assert p.de_sink.errors("tf") == ["PD transfer failed: prefill failed: transfer failed"]
    assert states(p.de_log, room) == [KVState.Bootstrapping, KVState.WaitingForInput, KVState.Failed]
    assert (Abort, room) not in p.de_sent  # Status(Failed) already promised nothing is in flight
    assert p.pe_agent.stats.transfers_failed == 1
    p.assert_clean()


def test_transfer_failure_mid_chunked_prefill(make_pair):
    p = make_pair(copy_bytes=True, pe_budget=8)
    p.pe_backend.fail_next(1)  # the first of four writes fails while later chunks still compute
    room = p.submit_both(prompt(30), 4, "tf2")
    p.drive(lambda: p.idle())
    assert p.submits[0] == (room, 1, 0, 2)
    assert p.pe_role.rooms.num_expired == 0 and p.de_role.rooms.num_expired == 0
    assert p.de_sink.errors("tf2") == ["PD transfer failed: prefill failed: transfer failed"]
    assert p.pe_role.failures.get("transfer failed", 0) >= 1
    p.assert_clean()


# ---- 6. layout fingerprint --------------------------------------------------------------------------
def test_layout_mismatch_refused_at_registration(make_pair):
    p = make_pair(de_page_size=8)  # the decode's pages are twice as big: incompatible layouts
    assert fingerprint(p.pe_engine) != fingerprint(p.de_engine)
    room = p.submit_both(prompt(9), 4, "lm")
    p.drive(lambda: p.idle())
    errors = p.de_sink.errors("lm")
    assert len(errors) == 1 and "layout mismatch" in errors[0]
    assert "registration refused by prefill" in errors[0]
    assert p.pe_role.failures["layout_mismatch"] == 1
    assert p.pe_sent[0] == (RegisterAck, 1)
    assert not p.pe_role.peers
    assert p.submits == []
    # The decode never asked for KV: it told the prefill to drop the room, and both are clean.
    assert (Abort, room) in p.de_sent and (KVRequest, room) not in p.de_sent
    pe_errors = p.pe_sink.errors("lm")
    assert len(pe_errors) == 1 and pe_errors[0].startswith("prefill failed: aborted by decode: ")
    assert "layout mismatch" in pe_errors[0]
    p.assert_clean()


# ---- 7. decode admission --------------------------------------------------------------------------
def test_a_request_that_fills_the_decode_pool_exactly_is_admitted(make_pair):
    """7 + 2 tokens fill 2 pages of 4 (the last sampled token holds no KV), which the engines accept.
    The decode reserved a growth page on top of the prompt's 2, one it would never use, so the room
    waited in admission until the prefill's Bootstrapping deadline failed it (a review of this
    session's changes); the reserve is capped at what the request can use past its prompt's pages."""
    p = make_pair(de_pages=2, copy_bytes=True)
    p.submit_both(prompt(7), 2, "exact")
    p.drive(lambda: any(o.finished for o in p.de_sink.outputs("exact")) or p.de_sink.errors("exact"))
    assert not p.de_sink.errors("exact") and len(p.de_sink.final("exact").outputs[0].token_ids) == 2
    p.drive(lambda: p.idle())
    p.assert_clean()


def test_decode_admission_has_no_head_of_line_blocking(make_pair):
    """16 decode pages of 4 tokens, growth reserve 1 page each. A (6 + 1 pages) is admitted; B (10 + 1)
    does not fit in the 9 left; C (2 + 1), behind B, is admitted. Freeing A lets B in. (Aging is off:
    it runs on the real clock, and a stalled test process must not turn it on; the next test covers it.)"""
    p = make_pair(de_pages=16)
    p.de_role.config = dataclasses.replace(p.de_role.config, admission_aging_s=3600.0)
    rooms = {}
    for rid, n in (("A", 24), ("B", 40), ("C", 8)):
        rooms[rid] = new_room()
        _, dreq = p.requests(prompt(n, start=len(rooms)), 4, rid, rooms[rid])
        p.de_role.add(dreq, None)  # the prefill never gets these: their KVRequests stay early
    p.drive(lambda: {rooms["A"], rooms["C"]} <= set(p.pe_role.early))
    assert [d.room for d in p.de_role.prealloc] == [rooms["B"]]
    assert set(p.de_role.transfer) == {rooms["A"], rooms["C"]}
    assert [r for t, r in p.de_sent if t is KVRequest] == [rooms["A"], rooms["C"]]
    assert p.de_engine.kv.pool.num_used_pages == 8
    assert p.de_role._reserved_pages() == 2
    assert p.de_role.rooms.state(rooms["B"]) == KVState.Bootstrapping
    p.settle(0.05)
    assert [d.room for d in p.de_role.prealloc] == [rooms["B"]]

    p.de_role.abort("A")  # two-phase: B gets A's pages only after the prefill's AbortAck
    p.de_role.tick()
    assert [d.room for d in p.de_role.prealloc] == [rooms["B"]]
    p.drive(lambda: rooms["B"] in p.de_role.transfer)
    assert p.de_role.aborts.num_acked == 1
    assert [r for t, r in p.de_sent if t is KVRequest] == [rooms["A"], rooms["C"], rooms["B"]]
    assert p.de_engine.kv.pool.num_used_pages == 12


def test_decode_admission_does_not_replan_a_room_that_cannot_fit(make_pair):
    """A waiting room that did not fit was planned again on every pass of the engine loop: its prefix
    matched again (~0.2 ms for a 30k-token prompt; 26-29 ms a pass with 128 rooms waiting, found by a
    performance review). While its pages cannot fit it is skipped; once pages free up it is planned
    and admitted, as before."""
    p = make_pair(de_pages=16)
    p.de_role.config = dataclasses.replace(p.de_role.config, admission_aging_s=3600.0)
    rooms = {}
    for rid, n in (("A", 24), ("B", 40)):  # as above: B (10 + 1 pages) does not fit beside A
        rooms[rid] = new_room()
        _, dreq = p.requests(prompt(n, start=len(rooms)), 4, rid, rooms[rid])
        p.de_role.add(dreq, None)
    p.drive(lambda: rooms["A"] in p.de_role.transfer and p.de_role.prealloc[0].num_miss_hits >= 0)
    planned = []
    match = p.de_engine.kv.match_prefix
    p.de_engine.kv.match_prefix = lambda req: planned.append(req.request_id) or match(req)
    p.settle(0.05)
    assert planned == [] and [d.room for d in p.de_role.prealloc] == [rooms["B"]]
    p.de_role.abort("A")
    p.drive(lambda: rooms["B"] in p.de_role.transfer)
    assert planned == ["B"]  # planned again once A's pages were free, and admitted


def test_decode_whose_running_request_outgrew_the_pool_releases_a_committed_one_instead_of_stalling(
    make_pair, colocated
):
    """Found by review: a committed request waits in the decode's scheduler (max_num_seqs) holding its
    prompt pages; the only running request outgrows the pool and preempts itself to the queue's head,
    where it needs more pages than are free. Nothing ran, and admission stopped at the head: the engine
    spun with work left and both clients waited until they timed out. Now the committed request's pages
    are released (it recomputes), the head runs, and both answer what one engine does."""
    p = make_pair(de_pages=8, copy_bytes=True)
    sched = p.de_engine.scheduler
    sched.config = dataclasses.replace(sched.config, max_num_seqs=1)
    long_ids, b_ids = prompt(4, start=1), prompt(8, start=2)
    p.submit_both(long_ids, 28, "long")  # 4 + 28 = 32 tokens: the whole 8-page pool
    p.drive(lambda: len(sched.running) == 1 and len(p.de_sink.outputs("long")) >= 2)
    room = p.submit_both(b_ids, 4, "b")
    p.drive(lambda: room not in p.de_role.rooms)  # b's KV arrived: it waits in the scheduler with pages
    assert any(r.request_id == "b" and r.page_ids for r in sched.waiting)
    p.drive(lambda: all(any(o.finished for o in p.de_sink.outputs(rid)) for rid in ("long", "b")))
    assert sched.num_preemptions >= 2  # long preempted itself; b's pages were released for it
    for rid, ids, n in (("long", long_ids, 28), ("b", b_ids, 4)):
        ref = colocated.generate(
            {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        assert p.de_sink.final(rid).outputs[0].token_ids == ref[0].outputs[0].token_ids, rid
    assert p.de_engine.kv.pool.num_used_pages == 0
    p.de_engine.check_integrity()


def test_a_stale_registration_registers_again_for_the_rooms_still_waiting(make_pair):
    """The prefill's weights changed: the first KVRequest is refused as a stale registration and the
    decode forgets it. A second room for that prefill, still waiting for pages, waited for a Register
    nobody sent until its Bootstrapping deadline (found by review); now the decode registers again
    at once, and the prefill, on other weights, refuses it: the room fails with that reason."""
    p = make_pair(fake_clocks=True, de_pages=8, copy_bytes=True)
    p.submit_both(prompt(9, start=5), 2, "warm")  # registers the decode under the old weights
    p.drive(lambda: p.idle())
    p.pe_role.new_weights("new-weights|layout")
    p.submit_both(prompt(16), 2, "first")  # (4 pages + 1 of growth: token 17's KV needs a 5th)
    second = p.submit_both(prompt(16, start=2), 2, "second")  # (does not fit beside first: waits)
    p.drive(lambda: bool(p.de_sink.errors("first")))
    assert "no longer serves" in p.de_sink.errors("first")[0]
    assert second in [d.room for d in p.de_role.prealloc]
    p.drive(lambda: bool(p.de_sink.errors("second")))  # (no clock moves: no deadline can pass)
    assert "registration refused by prefill" in p.de_sink.errors("second")[0]
    assert len([m for m in p.de_sent if m[0] is Register]) == 2


def test_prefill_step_hook_never_writes_for_a_room_past_its_deadline(make_pair):
    """Deadlines were swept before a step only: a room whose deadline passed during a long forward
    still had its pages and handoff sent by the post-step hook, and the write restarted its clock in
    Transferring, eating the margin of the decode's abort lease (the sum of the prefill's deadlines;
    found by review). The sweep runs after the forward too: the room fails, nothing is sent."""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    room = p.submit_both(prompt(9), 2, "late")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.WaitingForInput, step_prefill=False)
    writes = []
    p.on_submit = lambda r, seq, total, local, remote: writes.append(r)
    execute = p.pe_engine.runner.execute

    def slow_forward(sched):
        p.pe_clock.advance(p.config.deadline_s + 1.0)  # the forward outlasts the room's deadline
        return execute(sched)

    p.pe_engine.runner.execute = slow_forward
    p.turn(decode=False)  # tick (nothing expired yet), then the long step and its post-step hook
    p.pe_engine.runner.execute = execute
    assert writes == [] and p.pe_role.rooms.state(room) == KVState.Failed
    assert p.pe_role.rooms.reason(room) == "deadline in WaitingForInput"


def test_decode_admission_aging_stops_overtaking_a_starved_request(make_pair):
    """As above, but B has already waited `admission_aging_s` (0 here): C may not overtake it any more,
    so a stream of small requests cannot starve B past the prefill's deadline. A's pages go to B."""
    p = make_pair(de_pages=16)
    p.de_role.config = dataclasses.replace(p.de_role.config, admission_aging_s=0.0)
    rooms = {}
    for rid, n in (("A", 24), ("B", 40), ("C", 8)):
        rooms[rid] = new_room()
        _, dreq = p.requests(prompt(n, start=len(rooms)), 4, rid, rooms[rid])
        p.de_role.add(dreq, None)
    p.drive(lambda: rooms["A"] in p.pe_role.early)
    p.settle(0.05)
    assert [d.room for d in p.de_role.prealloc] == [rooms["B"], rooms["C"]]  # C waits behind B
    p.de_role.abort("A")
    p.drive(lambda: rooms["C"] in p.de_role.transfer)
    assert [r for t, r in p.de_sent if t is KVRequest] == [rooms["A"], rooms["B"], rooms["C"]]


# ---- 8. found by the chaos suite (tests/test_chaos.py) ----------------------------------------------
def _lossy(control, drop) -> list:
    """Make `control.send` lose the messages `drop(body)` picks; returns the lost ones' (type, room)."""
    lost, send = [], control.send

    def wrapped(addr, body, room):
        if drop(body, lost):
            lost.append((type(body), room))
            return True  # the sender believes it went out
        return send(addr, body, room)

    control.send = wrapped
    return lost


def test_lost_register_is_sent_again(make_pair):
    """A lost Register (or RegisterAck) used to leave the peer `registering` for good: every request for
    that prefill then expired in Bootstrapping. The decode re-sends it while requests wait."""
    p = make_pair(fake_clocks=True, copy_bytes=True)  # room deadlines never pass: only the retry helps
    lost = _lossy(p.de_control, lambda body, lost: isinstance(body, Register) and not lost)
    p.submit_both(prompt(9), 4, "rg")
    p.drive(lambda: p.idle(), timeout_s=10)
    assert lost == [(Register, 1)] and (Register, 1) in p.de_sent  # lost once, sent again
    assert p.de_sink.errors("rg") == [] and len(p.de_sink.final("rg").outputs[0].token_ids) == 4
    p.assert_clean()


def test_status_failed_frees_a_room_whose_abort_was_lost(make_pair):
    """The decode aborted after its KVRequest, but the Abort was lost; the prefill fails the room at its
    own deadline and reports Status(Failed) -- the same promise as an AbortAck. The decode frees the
    pages then, not a whole lease later."""
    p = make_pair(fake_clocks=True)
    lost = _lossy(p.de_control, lambda body, lost: isinstance(body, Abort))
    room = p.submit_both(prompt(9), 4, "sa")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.WaitingForInput, step_prefill=False)
    p.de_role.abort("sa")
    assert lost == [(Abort, room)] and room in p.de_role.releasing
    p.pe_clock.advance(DEADLINE_S + 0.01)  # only the prefill's clock: the decode's lease never ends
    p.drive(lambda: p.idle(), step_prefill=False)
    assert p.pe_sent[-1] == (Status, room)
    assert p.de_role.aborts.num_acked == 1 and p.de_role.aborts.num_lease_expired == 0
    p.assert_clean()


def test_retry_with_the_same_rid_runs_while_the_failed_room_waits_for_its_ack(make_pair, colocated):
    """A failed room's pages wait for the prefill's ack (or the lease); its request id does not. The
    router retries a failed attempt with the client's rid, and with one decode that retry was refused
    as a duplicate id (a 409 to the client) until the old room's lease ran out."""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    lost = _lossy(p.de_control, lambda body, lost: isinstance(body, Abort))  # no ack comes back
    room = p.submit_both(prompt(9), 4, "again")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.WaitingForInput, step_prefill=False)
    p.de_role.abort("again")  # (as a transfer failure does: the decode fails the room after KVRequest)
    assert lost == [(Abort, room)] and room in p.de_role.releasing
    held = list(p.de_role.releasing[room].req.page_ids)
    assert held and "again" not in p.de_engine.requests  # the id is free, the pages are not
    # The prefill's half ends too (its router saw the failure); its Status(Failed), which would free
    # the old pages, is lost as well.
    _lossy(p.pe_control, lambda body, lost: isinstance(body, Status) and body.state == KVState.Failed)
    p.pe_role.abort("again")
    p.drive(lambda: not p.pe_engine.requests and room not in p.pe_role.by_room, step_prefill=False)

    room2 = p.submit_both(prompt(9), 4, "again")
    p.drive(lambda: any(o.finished for o in p.de_sink.outputs("again")))
    ref = colocated.generate([{"prompt_token_ids": prompt(9)}], SamplingParams(temperature=0, max_tokens=4))
    assert p.de_sink.final("again").outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert room2 != room and room in p.de_role.releasing  # the old pages stayed held throughout
    assert all(p.de_engine.kv.pool.ref_count(page) >= 1 for page in held)
    p.de_role.abort("again")  # an abort of the finished retry does not touch the old room
    assert room in p.de_role.releasing
    p.de_clock.advance(LEASE_S + 0.01)
    p.drive(lambda: p.idle())
    assert p.de_role.aborts.num_lease_expired == 1
    p.assert_clean()


def test_room_that_failed_while_its_store_read_was_in_flight_never_computes(make_pair):
    """PE read path: the prefill was paused past a room's deadline while the room's store read was in
    flight. On resume the read is done too; the room must fail before the read can start the layerwise
    lane, whose writes could land in decode pages freed after the decode's lease."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    p = make_pair(fake_clocks=True)
    read = Future()
    p.pe_role.store = SimpleNamespace(
        layout=SimpleNamespace(block_size=2 * PAGE_SIZE),
        lookup=lambda req: 2,
        start_read=lambda req, n, now_s=0.0, *_: PendingRead(
            [b"k0", b"k1"], [None, None], read, started_s=now_s
        ),
        reads=JoinedReads(),  # (none in flight: this read is the test's own)
    )
    room = new_room()
    preq, dreq = p.requests(prompt(20), 4, "sr", room)
    preq.read_path = "pe"
    p.pe_role.add(preq, None)
    p.de_role.add(dreq, None)
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.WaitingForInput)  # KVRequest in, read not
    assert p.pe_role.by_room[room].store_read is not None
    p.pe_clock.advance(DEADLINE_S + 0.01)
    read.set_result(SimpleNamespace(num_prefix_ok=2, keys=[b"k0", b"k1"], num_ok=2))
    p.pe_role.tick()
    assert p.pe_sink.errors("sr") == ["prefill failed: deadline in WaitingForInput"]
    assert p.pe_role.layerwise.num_runs == 0 and p.submits == []
    p.drive(lambda: p.idle())
    p.assert_clean()


# ---- 9. found by a review of the transfer path ------------------------------------------------------
@pytest.mark.parametrize("source", ["prefix_cache", "store"])
def test_decode_admission_counts_evictable_prefix_hits_and_store_reads(make_pair, source):
    """16 decode pages. r1's 6 prompt pages end up cached (evictable); another request holds 9 pages,
    leaving 1 free + those 6. r3 shares r1's 6 pages and needs 2 more plus 2 of growth. Counted as free,
    the 6 hits made r3 look like 4 of 7 pages; acquired, they are not allocatable, and `allocate`
    refused under an `assert` that killed the engine (leaking the handoff slot taken just before).
    Store (DE read path): the store covers more than the hits, so the whole prompt needs fresh pages
    (8 + 2 > 7), where the check had subtracted the hits it then dropped."""
    p = make_pair(de_pages=16, copy_bytes=True)
    ids1 = prompt(24, start=3)
    p.submit_both(ids1, 1, "r1")
    p.drive(lambda: p.idle())
    pool = p.de_engine.kv.pool
    cached = sorted(pool.evictable_page_ids())
    assert len(cached) == 6
    other = p.de_engine.make_request(prompt(36, start=9), SamplingParams(max_tokens=4), "other")
    assert p.de_engine.kv.allocate(other, 36)  # a running decode's 9 pages
    p.de_engine.extra_page_refs.append(lambda: other.page_ids)  # held by the test, not a request
    assert pool.num_free_pages == 7 and sorted(pool.evictable_page_ids()) == cached
    if source == "store":
        read = Future()
        p.de_role.store = SimpleNamespace(
            layout=SimpleNamespace(block_size=7 * PAGE_SIZE),  # one block: 28 tokens > the 24 hit tokens
            lookup=lambda req: 1,
            start_read=lambda req, n, now_s=0.0, *_: PendingRead([b"k0"], [None], read, started_s=now_s),
            persist=lambda req, final=False: None,
            reads=JoinedReads(),  # (none in flight: this read is the test's own)
        )
    room = new_room()
    preq, dreq = p.requests(ids1 + prompt(8, start=7), 8, "r3", room)
    dreq.read_path = "de" if source == "store" else None
    p.pe_role.add(preq, None)
    p.de_role.add(dreq, None)
    for _ in range(20):
        p.turn(prefill=False)
    assert [d.req.request_id for d in p.de_role.prealloc] == ["r3"]  # waits; the engine is alive
    assert p.de_role.handoff.num_free == p.de_role.handoff.num_slots
    assert pool.num_free_pages == 7 and sorted(pool.evictable_page_ids()) == cached  # nothing acquired
    assert (KVRequest, room) not in p.de_sent

    p.de_engine.kv.free(other)  # 16 pages allocatable: r3 fits now
    if source == "store":
        p.drive(lambda: room in p.de_role.transfer, prefill=False)
        assert len(dreq.page_ids) == 8 and not set(dreq.page_ids) & set(cached)  # fresh; the hits unused
        assert p.de_role.transfer[room].num_hit_tokens == 0
        read.set_result(SimpleNamespace(num_prefix_ok=0, keys=[b"k0"], num_ok=0))  # computes it all
    p.drive(lambda: p.idle())
    assert p.de_sink.errors("r3") == [] and len(p.de_sink.final("r3").outputs[0].token_ids) == 8
    # Prefix cache: the KVRequest asked only for pages 6 and 7. Store (nothing read): for all 8 pages,
    # of which the prefill's own prefix cache held 6 (sent before it computed the rest).
    sent = [s for s in p.submits if s[0] == room]
    assert sent == ([(room, 1, 1, 2)] if source == "prefix_cache" else [(room, 1, 0, 6), (room, 2, 2, 2)])
    p.assert_clean()


def test_prefill_pins_the_source_pages_of_writes_in_flight_across_preemption(make_pair, colocated):
    """16 prefill pages, two 40-token prompts chunked 24 tokens a step: B is preempted while its first
    writes are in flight (each takes 1 s). Its pages used to go straight back to the pool, where the
    next allocation could overwrite them while the data plane still copied them to the decode. Each
    write now holds a reference on its source pages until the agent reports it."""
    p = make_pair(pe_pages=16, pe_budget=24, pe_backend={"delay_s": 1.0}, copy_bytes=True)
    kv = p.pe_engine.runner.kv_cache
    base, page_bytes = kv.regions()[0][0], kv.layout.bytes_per_page
    srcs: dict[int, set[int]] = defaultdict(set)  # room -> our pages its writes read

    def on_submit(room, seq, total, local, remote):
        for addr, n in local:
            if base <= addr < base + page_bytes * 16:  # region 0: pages of every region are alike
                srcs[room].update(range((addr - base) // page_bytes, (addr - base + n) // page_bytes))

    p.on_submit = on_submit
    a, b = prompt(40, start=1), prompt(40, start=5)
    p.submit_both(a, 4, "A")
    rb = p.submit_both(b, 4, "B")
    pool, sched = p.pe_engine.kv.pool, p.pe_engine.scheduler
    p.drive(lambda: sched.num_preemptions and srcs[rb])
    assert p.pe_agent.stats.transfers_done + p.pe_agent.stats.transfers_failed == 0  # all in flight
    pr = p.pe_role.by_room[rb]
    assert pr.in_flight and not pr.req.page_ids  # B was preempted: it holds no page itself
    assert {pg: pool.ref_count(pg) for pg in srcs[rb]} == dict.fromkeys(srcs[rb], 1)  # the writes' pins
    taken = pool.allocate(pool.num_free_pages)
    assert not set(taken) & srcs[rb]
    pool.release(taken)

    p.drive(lambda: p.idle())
    ref = colocated.generate(
        [{"prompt_token_ids": a}, {"prompt_token_ids": b}], SamplingParams(temperature=0, max_tokens=4)
    )
    assert p.de_sink.final("A").outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert p.de_sink.final("B").outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert p.pe_role.pinned == {}
    p.assert_clean()


def _register_like(de: DecodeRole, **changes) -> Register:
    """The decode's own Register, with `changes`."""
    return msgspec.structs.replace(de.register_message(), **changes)


def _capture_sends(control: ControlChannel) -> list:
    """Record (body, room) of everything `control` sends from now on."""
    sent, send = [], control.send

    def wrapped(addr, body, room):
        sent.append((body, room))
        return send(addr, body, room)

    control.send = wrapped
    return sent


@pytest.mark.parametrize(
    "change, error",
    [
        ("one_region_short", "KV region mismatch: prefill has"),
        ("bytes_per_page", "KV region mismatch"),
        ("handoff_slot_bytes", "handoff slot size mismatch"),
    ],
)
def test_register_that_does_not_match_our_regions_is_refused(make_pair, change, error):
    """Only the fingerprint used to be compared: a Register with another region table was acked, and
    building the first write's descriptors raised inside the engine's step (killing the engine).
    (Fake clocks: on a loaded CI machine the warm request's room once outlived the real 5 s deadline,
    and its abort counted as a second failure.)"""
    p = make_pair(copy_bytes=True, fake_clocks=True)
    p.submit_both(prompt(12), 1, "warm")
    p.drive(lambda: p.idle())
    de, kv = p.de_role, p.de_role.local_kv
    changes = {
        "one_region_short": dict(
            kv_base_addrs=list(kv.base_addrs[:-1]), kv_bytes_per_page=list(kv.bytes_per_page[:-1])
        ),
        "bytes_per_page": dict(kv_bytes_per_page=[kv.bytes_per_page[0] * 2] * kv.num_regions),
        "handoff_slot_bytes": dict(handoff_slot_bytes=de.handoff.slot_bytes // 2),
    }[change]
    acks = _capture_sends(p.pe_control)
    p.de_control.send(p.prefill_addr, _register_like(de, **changes), 99)  # same decode identity
    p.drive(lambda: acks)
    [(ack, reg_id)] = acks
    assert reg_id == 99 and isinstance(ack, RegisterAck) and not ack.ok and error in ack.error
    assert sum(p.pe_role.failures.values()) == 1
    # The refusal left the earlier, valid registration in place: requests still go through.
    p.submit_both(prompt(12, start=4), 4, "after")
    p.drive(lambda: p.idle())
    assert p.de_sink.errors("after") == [] and len(p.de_sink.final("after").outputs[0].token_ids) == 4
    p.assert_clean()


def test_a_destination_we_cannot_describe_fails_only_its_room(make_pair):
    """The last line of defence behind the Register check: a write whose descriptors cannot be built
    (here: a peer entry with one region short, set behind the check's back) fails that room; the
    engine's step goes on, and the next request is served."""
    p = make_pair(copy_bytes=True)
    p.submit_both(prompt(12), 1, "warm")
    p.drive(lambda: p.idle())
    [(sender, good)] = p.pe_role.peers.items()
    short = RegionTable(good.kv.base_addrs[:-1], good.kv.bytes_per_page[:-1])
    p.pe_role.peers[sender] = dataclasses.replace(good, kv=short)
    room = p.submit_both(prompt(12, start=4), 4, "bad")
    p.drive(lambda: p.idle())
    assert p.pe_role.failures == {"bad destination": 1}
    assert p.de_sink.errors("bad")[0].startswith("PD transfer failed: prefill failed: bad destination")
    assert (Status, room) in p.pe_sent and p.submits[-1][0] != room  # nothing of the room went out
    p.pe_role.peers[sender] = good
    p.submit_both(prompt(12, start=6), 4, "next")
    p.drive(lambda: p.idle())
    assert len(p.de_sink.final("next").outputs[0].token_ids) == 4
    p.assert_clean()


@pytest.mark.parametrize(
    "fields, error",
    [
        (dict(dst_page_ids=[10**9, 0]), "a page id beyond the decode's 64 pages"),
        (dict(dst_page_ids=[64, 0]), "a page id beyond the decode's 64 pages"),
        (dict(dst_page_ids=[5, 5]), "a page id appears twice"),
        (dict(handoff_slot=8), "handoff slot 8 of 8"),
        (dict(handoff_slot=10**6), "handoff slot 1000000 of 8"),
        (dict(staging_offset=63), "staging pages [63, +2) outside the decode's 64"),
        (
            dict(dst_page_ids=[1], decode_prefix_len=4, hit_page_ids=[64]),
            "a page id beyond the decode's 64 pages",
        ),
        (dict(dst_page_ids=[1], decode_prefix_len=4, hit_page_ids=[1]), "a page id appears twice"),
    ],
    ids=["page_far", "page_64", "dup_page", "slot_8", "slot_far", "staging", "hit_page", "hit_overlap"],
)
def test_kv_request_out_of_the_decodes_registered_bounds_fails_the_room(make_pair, fields, error):
    """KVRequest fields were checked for sign only: one authenticated KVRequest could aim our writes
    (and DE-path reads) anywhere in the decode's registered memory. Checked against what its Register
    announced (64 pages, 8 handoff slots, 64 staging pages), it fails the room while it is still
    Bootstrapping: nothing was written, so Status(Failed) goes out at once."""
    p = make_pair()
    p.submit_both(prompt(12), 1, "warm")
    p.drive(lambda: p.idle())
    room = new_room()
    preq, _ = p.requests(prompt(8, start=2), 1, "x", room)  # 2 pages
    p.pe_role.add(preq, None)
    request = KVRequest(**(dict(dst_page_ids=[0, 1], handoff_slot=0, decode_prefix_len=0) | fields))
    p.de_control.send(p.prefill_addr, request, room)
    p.drive(lambda: p.idle(), decode=False)
    assert p.pe_sink.errors("x") == [f"prefill failed: bad KVRequest: {error}"]
    assert states(p.pe_log, room) == [KVState.Bootstrapping, KVState.Failed]
    assert p.pe_sent[-1] == (Status, room) and all(r != room for r, *_ in p.submits)
    assert p.pe_role.layerwise.num_runs == 0
    p.assert_clean()


@pytest.mark.parametrize("num_prompt_tokens", [7, 8])
def test_kv_request_whose_decode_prefix_leaves_nothing_to_compute_fails_the_room(
    make_pair, num_prompt_tokens
):
    """A decode prefix of 8 tokens for a 7-token prompt passed the page-count check (2 pages either
    way); the layerwise lane started its first pull, failed before its forward, and left the pull in
    flight: the room was never reaped, the decode never told, a staging slot held for ever (a review,
    2026-12-05). Refused while Bootstrapping now, as a prefix of the whole prompt is."""
    p = make_pair()
    p.submit_both(prompt(12), 1, "warm")  # (the decode registers)
    p.drive(lambda: p.idle())
    room = new_room()
    preq, _ = p.requests(prompt(num_prompt_tokens, start=2), 1, "x", room)
    p.pe_role.add(preq, None)
    p.de_control.send(p.prefill_addr, KVRequest(dst_page_ids=[], handoff_slot=0, decode_prefix_len=8,
                                                hit_page_ids=[1, 2]), room)  # fmt: skip
    p.drive(lambda: p.idle(), decode=False)
    assert p.pe_sink.errors("x") == [
        f"prefill failed: bad KVRequest: a decode prefix of 8 tokens leaves nothing of the prompt's "
        f"{num_prompt_tokens} to compute"
    ]
    assert states(p.pe_log, room) == [KVState.Bootstrapping, KVState.Failed]
    assert p.pe_role.layerwise.num_runs == 0
    p.assert_clean()


@pytest.mark.parametrize("state", [KVState.WaitingForInput, KVState.Transferring])
def test_success_before_the_last_write_is_ignored(make_pair, state):
    """Status(Success) used to be accepted in any state: the room jumped to Success, `_reap` released it
    and the last write (remaining pages and the handoff row) never went out; the decode waited for it
    until its deadline. Now only the ack of a sent last write counts."""
    p = make_pair(pe_budget=8, copy_bytes=True)
    room = p.submit_both(prompt(30), 8, "early")
    if state == KVState.WaitingForInput:
        p.drive(lambda: p.pe_role.rooms.state(room) == state, step_prefill=False)
    else:
        p.drive(lambda: len(p.submits) >= 1)
    assert p.pe_role.rooms.state(room) == state and not p.pe_role.by_room[room].sent_last
    p.de_control.send(p.prefill_addr, Status(state=KVState.Success), room)
    p.drive(lambda: p.pe_role.failures, step_prefill=False)
    assert p.pe_role.failures == {"early Success ignored": 1}
    assert p.pe_role.rooms.state(room) == state
    p.drive(lambda: p.idle())
    assert p.submits[-1] == (room, 4, 4, 2)  # the last write went out: 4 writes, pages 6-7 last
    assert p.de_sink.errors("early") == [] and len(p.de_sink.final("early").outputs[0].token_ids) == 8
    assert states(p.pe_log, room) == FULL_PATH
    p.assert_clean()


def test_timed_out_layerwise_pull_keeps_its_staging_slot_until_the_read_is_released(make_pair):
    """DE path: a pull of the decode's hit pages into our staging slot outlives its wait. `abort` only
    queues the request to the agent, so the slot used to be freed (and reusable) while the read could
    still land in it. It is freed once the agent reports the read released."""
    p = make_pair(pe_backend={"delay_s": 2.0})
    p.submit_both(prompt(12), 1, "warm")
    p.drive(lambda: p.idle(), timeout_s=15)
    # The wait is bounded by the room's time left in its state: a room with a 0.05 s deadline.
    rooms, room = p.pe_role.rooms, new_room()
    rooms.deadlines_s = {**rooms.deadlines_s, KVState.WaitingForInput: 0.05}
    rooms.create(room, KVState.WaitingForInput)
    [peer] = p.pe_role.peers.values()
    pr = SimpleNamespace(room=room, peer=peer, in_flight=set(), created_s=rooms.now())
    start, finish = p.pe_role.layerwise.from_decode_pages(pr, [0, 1])
    start(0)
    slot_pages = p.pe_role.staging.pages_for(2, 2)  # K and V of 2 pages, packed
    assert p.pe_role.staging.num_used_pages == slot_pages and len(pr.in_flight) == 1
    with pytest.raises(RuntimeError, match="deadline in WaitingForInput"):
        finish(0)
    rooms.fail(room, "test over")
    rooms.remove(room)
    assert pr.in_flight == set()
    assert p.pe_role.staging.num_used_pages == slot_pages  # not reusable: the read may still land
    p.pe_role.check_integrity()
    p.drive(lambda: p.pe_role.staging.num_used_pages == 0, decode=False)  # reported: freed
    # (the pull: aborted before it copied, so failed; the warm-up's write may also count as aborted,
    # DONE, when the decode's ack beat the agent's completion report: seen once under load)
    stats = p.pe_agent.stats
    assert stats.transfers_failed == 1 and stats.transfers_aborted >= 1 and p.pe_role.abandoned_reads == {}
    p.pe_role.check_integrity()


def test_load_report_reads_survive_the_engine_thread_changing_rooms():
    """`pd_load.load_report` runs on the HTTP thread, unlocked. Two reads were not snapshots: the sum
    over the live `transfer` dict (the engine thread admits a room mid-iteration: RuntimeError) and a
    room's `store_read` read twice (the engine thread finishes the read in between: AttributeError).
    Deterministic stand-ins for the engine thread's interleaving:"""
    role = SimpleNamespace(transfer={})

    class Admitting:
        @property
        def growth_pages(self) -> int:
            role.transfer[len(role.transfer) + 1] = SimpleNamespace(growth_pages=5)  # admitted meanwhile
            return 2

    role.transfer[0] = Admitting()
    assert DecodeRole._reserved_pages(role) == 2

    class Finishing:
        reads = 0

        @property
        def store_read(self):
            self.reads += 1
            if self.reads > 1:
                return None  # done meanwhile
            return SimpleNamespace(keys=[b"k0", b"k1"], buffer=[b"b0", b"b1"], future=object())

    assert _pending_read_tokens([Finishing()], block_size=64) == 128


def test_decode_waits_out_a_prefill_whose_rooms_live_longer_than_its_own_lease(make_pair):
    """The lease floor is about the *prefill's* deadlines; a decode started with shorter ones than its
    prefill (engines launched by hand) would free pages that prefill may still write. The prefill's
    RegisterAck now says how long its rooms live, and the decode holds aborted pages that long + 1 s."""
    p = make_pair()
    slow = dataclasses.replace(p.config, deadline_s=3 * DEADLINE_S, abort_lease_s=None)
    p.pe_role.config = slow  # before the decode registers
    p.submit_both(prompt(12), 1, "warm")
    p.drive(lambda: p.idle())
    [peer] = p.de_role.peers.values()
    assert slow.room_life_s == 9 * DEADLINE_S > LEASE_S == p.de_role.config.lease_s
    assert peer.lease_s == slow.room_life_s + MIN_LEASE_MARGIN_S


def test_a_store_read_budget_is_below_the_state_deadline():
    """`store_read_budget_s`: half the state deadline unless set; one at or past the deadline would
    leave nothing to leave behind (the room fails first), so it is refused."""
    assert PDConfig(cluster_secret=b"s").store_read_budget_s == 15.0
    assert PDConfig(cluster_secret=b"s", deadline_s=8.0, store_read_timeout_s=2.0).store_read_budget_s == 2.0
    for timeout_s in (0.0, -1.0, 8.0, 9.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="store_read_timeout_s must be in"):
            PDConfig(cluster_secret=b"s", deadline_s=8.0, store_read_timeout_s=timeout_s)


def test_abort_lease_is_never_below_the_prefills_longest_room_life():
    """state.min_lease_s: a lease shorter than the prefill's three deadlines lets the decode reuse pages
    a partitioned prefill may still write. The defaults were 60 s against a bound of 90 s (and 60 s
    against 180 s with the benchmark's 60 s deadlines); nothing checked a configured one."""
    default = PDConfig(cluster_secret=b"s")
    assert default.abort_lease_s is None  # as given: derived, so dataclasses.replace keeps deriving
    assert default.room_life_s == 90.0 and default.lease_s == 90.0 + LEASE_MARGIN_S == 100.0
    assert dataclasses.replace(default, deadline_s=60.0).lease_s == 190.0
    assert PDConfig(cluster_secret=b"s", deadline_s=2.0, abort_lease_s=7.0).lease_s == 7.0
    for lease_s in (6.99, 6.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="below the safe minimum of 7.0 s"):
            PDConfig(cluster_secret=b"s", deadline_s=2.0, abort_lease_s=lease_s)
    for deadline_s in (0.0, -1.0, float("nan"), float("inf"), 1e6):  # a room life RegisterAck can carry
        with pytest.raises(ValueError, match="deadline_s must be in"):
            PDConfig(cluster_secret=b"s", deadline_s=deadline_s)
    # `pdserve serve` / `launch`: 0 (the default) asks for the derived lease.
    from pdserve.launch import cluster_args

    assert cluster_args("model-dir").pd_abort_lease_s == 0.0


def test_a_waiting_de_path_request_looks_the_store_up_once_per_refresh_interval(make_pair, monkeypatch):
    """A request that would fit with its prefix hits but not by the store path (whole prompt fresh)
    waits; it used to look the store up on every admission pass (each lookup may stat files and counts
    in the store's hit metrics): 20 lookups in 20 turns. Once the refresh interval has passed it looks
    again (blocks written back since, e.g. the previous turn's last ones, count)."""
    p = make_pair(de_pages=16, copy_bytes=True)
    ids1 = prompt(24, start=3)
    p.submit_both(ids1, 1, "r1")
    p.drive(lambda: p.idle())
    kv = p.de_engine.kv
    holder = p.de_engine.make_request(ids1 + [1], SamplingParams(max_tokens=4), "holder")
    hits, keys = kv.match_prefix(holder)
    assert len(hits) == 6 and kv.allocate(holder, 1, hits, keys)  # the hit pages are in use
    other = p.de_engine.make_request(prompt(20, start=9), SamplingParams(max_tokens=4), "other")
    assert kv.allocate(other, 20)
    p.de_engine.extra_page_refs.append(lambda: holder.page_ids + other.page_ids)  # the test holds them
    lookups = []
    p.de_role.store = SimpleNamespace(  # a store that has one 7-page block of every prompt
        layout=SimpleNamespace(block_size=7 * PAGE_SIZE),
        lookup=lambda req: lookups.append(req.request_id) or 1,
        start_read=lambda req, n, now_s=0.0, *_: PendingRead([b"k0"], [None], Future(), started_s=now_s),
        persist=lambda req, final=False: None,
        reads=JoinedReads(),  # (none in flight: this read is the test's own)
    )
    preq, dreq = p.requests(ids1 + prompt(4, start=7), 8, "r3", new_room())
    dreq.read_path = "de"
    p.pe_role.add(preq, None)
    p.de_role.add(dreq, None)
    # (the interval set around each phase, so that a slow turn on a loaded machine changes nothing)
    monkeypatch.setattr(pd_decode, "STORE_LOOKUP_REFRESH_S", 1e9)
    for _ in range(20):
        p.turn(prefill=False)
    assert [d.req.request_id for d in p.de_role.prealloc] == ["r3"]  # still waiting for pages
    assert lookups == ["r3"]
    monkeypatch.setattr(pd_decode, "STORE_LOOKUP_REFRESH_S", 0.05)
    time.sleep(0.06)
    p.turn(prefill=False)  # the interval has passed: it looks again
    monkeypatch.setattr(pd_decode, "STORE_LOOKUP_REFRESH_S", 1e9)
    for _ in range(2):
        p.turn(prefill=False)
    assert lookups == ["r3", "r3"]


@pytest.mark.parametrize("chunk_blocks", [1, None])  # write-back gathers a block at a time, or all at once
def test_decode_writes_back_the_block_its_last_step_filled(make_pair, tmp_path, monkeypatch, chunk_blocks):
    """18 prompt tokens, 7 generated: the decode computes KV for 24 tokens (the last token is never
    fed), three 8-token blocks. The third fills in the step that samples the last token, after which
    the request's pages are freed; the per-step write-back ran only after that, so the next turn (this
    context plus the answer) missed the block. All three are written, with the pool's bytes."""
    from pdserve.engine import store_connector
    from pdserve.engine.store_connector import StoreConnector
    from pdserve.store.block_store import KVBlockStore
    from pdserve.store.layout import BlockLayout

    p = make_pair(copy_bytes=True)
    layout = BlockLayout.from_kv_layout(p.de_engine.runner.kv_cache.layout, 2 * PAGE_SIZE, model="t")
    store = KVBlockStore(tmp_path, layout, 1 << 30)
    p.de_role.store = connector = StoreConnector(p.de_engine, store)
    if chunk_blocks is not None:
        monkeypatch.setattr(store_connector, "PERSIST_CHUNK_NBYTES", chunk_blocks * layout.block_nbytes)
    kv_cache, ppb = p.de_engine.runner.kv_cache, 2
    captured = {}
    gather = connector.gather_blocks

    def spy(page_ids, first, last):
        """Record, while the pages are live, what each block must hold (store/layout.py: per layer K
        then V, the block's pages in order), written out by hand from the pool."""
        for b in range(first, last):
            idx = page_ids[b * ppb : (b + 1) * ppb]
            layers = zip(kv_cache.k, kv_cache.v, strict=True)
            parts = [t[idx].flatten().view(torch.uint8) for k_v in layers for t in k_v]
            captured[b] = torch.cat(parts)
        return gather(page_ids, first, last)

    connector.gather_blocks = spy
    p.submit_both(prompt(18), 7, "r1")
    p.drive(lambda: p.idle())
    connector.flush()
    assert connector.num_blocks_written == 3 and connector.num_write_failures == 0
    tokens = prompt(18) + list(p.de_sink.final("r1").outputs[0].token_ids)
    nxt = p.de_engine.make_request(tokens, SamplingParams(max_tokens=1), "next-turn")
    assert connector.lookup(nxt) == 3  # all three blocks of the 24 computed tokens
    buf = torch.empty((3, layout.block_nbytes), dtype=torch.uint8)
    assert store.read_blocks(connector.keys_for(nxt, 3), buf).num_prefix_ok == 3
    for b in range(3):
        assert torch.equal(buf[b], captured[b].cpu())
    p.assert_clean()
    store.close()


def test_the_next_turns_write_back_skips_the_blocks_stored_already(make_pair, tmp_path):
    """Turn 1 (18 prompt + 7 generated tokens) writes back three 8-token blocks. Turn 2 is that context
    plus 14 new tokens: 38 prompt + 3 generated = 40 computed, five blocks, of which the store holds the
    first three. Write-back gathered and copied all five to host (the whole context again at every
    turn, on the engine thread) for the writer to find three there; it now gathers blocks 3 and 4 only,
    and the store ends up with all five, the next turn's lookup finding them."""
    from pdserve.engine.store_connector import StoreConnector
    from pdserve.store.block_store import KVBlockStore
    from pdserve.store.layout import BlockLayout

    p = make_pair(copy_bytes=True)
    layout = BlockLayout.from_kv_layout(p.de_engine.runner.kv_cache.layout, 2 * PAGE_SIZE, model="t")
    store = KVBlockStore(tmp_path, layout, 1 << 30)
    p.de_role.store = connector = StoreConnector(p.de_engine, store)
    gathered: list[tuple[int, int]] = []
    gather = connector.gather_blocks
    connector.gather_blocks = lambda ids, first, last: (
        gathered.append((first, last)) or gather(ids, first, last)
    )
    p.submit_both(prompt(18), 7, "turn-1")
    p.drive(lambda: p.idle())
    assert connector.flush() and connector.num_blocks_written == 3 and connector.num_blocks_skipped == 0
    assert sum(last - first for first, last in gathered) == 3
    context = prompt(18) + list(p.de_sink.final("turn-1").outputs[0].token_ids) + prompt(14, start=9)
    gathered.clear()
    dedup_before = store.stats().num_put_dedup
    p.submit_both(context, 3, "turn-2")
    p.drive(lambda: p.idle())
    assert connector.flush()
    assert sorted(b for first, last in gathered for b in range(first, last)) == [3, 4]
    assert connector.num_blocks_skipped == 3 and connector.num_blocks_written == 3 + 2
    assert store.stats().num_put_dedup == dedup_before + 3  # (counted as puts of blocks already there)
    turn_3 = context + list(p.de_sink.final("turn-2").outputs[0].token_ids) + [7]
    nxt = p.de_engine.make_request(turn_3, SamplingParams(max_tokens=1), "turn-3")
    assert connector.lookup(nxt) == 5
    p.assert_clean()
    store.close()


def test_decode_keeps_the_batch_within_max_num_seqs_without_failing_the_waiting(make_pair, colocated):
    """A committed room joined the running batch directly, so the decode's batch grew past
    max_num_seqs without bound (and past the step budget, the last decodes got no token). It now
    queues in the scheduler with its KV in its pages: with a limit of 1, the second request's KV
    arrives, it waits while the first decodes, and it runs once that one finishes. Holding it back
    before the transfer instead (a first fix) failed it at the Bootstrapping deadline on both sides
    (found by a review): here both clocks move past the deadline while it waits, and nothing fails."""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    sched = p.de_engine.scheduler
    sched.config = dataclasses.replace(sched.config, max_num_seqs=1)
    ids = {"long": prompt(10, start=1), "short": prompt(10, start=2)}
    p.submit_both(ids["long"], 40, "long")
    p.drive(lambda: len(sched.running) == 1 and len(p.de_sink.outputs("long")) >= 3)
    room = p.submit_both(ids["short"], 4, "short")
    p.drive(lambda: room not in p.de_role.rooms)  # its KV arrived; the room is done
    short = next(r for r in sched.waiting if r.request_id == "short")
    assert short.page_ids and [r.request_id for r in sched.running] == ["long"]
    p.de_clock.advance(DEADLINE_S + 0.01)
    p.pe_clock.advance(DEADLINE_S + 0.01)
    most = 0

    def both_done() -> bool:
        nonlocal most
        most = max(most, len(sched.running))
        return all(any(o.finished for o in p.de_sink.outputs(rid)) for rid in ids)

    p.drive(both_done)
    assert most == 1 and not p.de_sink.errors("short") and not p.pe_sink.errors("short")
    for rid, toks in ids.items():
        n = 40 if rid == "long" else 4
        ref = colocated.generate(
            {"prompt_token_ids": toks}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )
        assert p.de_sink.final(rid).outputs[0].token_ids == ref[0].outputs[0].token_ids
    p.drive(lambda: p.idle())
    p.assert_clean()


def test_engine_integrity_check_matches_references_to_holders(ckpt):
    """LLMEngine.check_integrity compares every page's reference count with the active requests that
    hold it (and the roles' extra references): before, with requests active it checked only the pool
    itself, so a lost or extra reference (a page reused while still read) went unseen."""
    engine = make_engine(ckpt)
    req = engine.make_request(prompt(10), SamplingParams(max_tokens=4), "r")
    engine.add(req)
    engine.step()
    assert len(req.page_ids) == 3
    engine.check_integrity()
    engine.kv.pool.acquire([req.page_ids[0]])  # an extra reference nobody accounts for
    with pytest.raises(AssertionError, match="holders"):
        engine.check_integrity()
    engine.extra_page_refs.append(lambda: [req.page_ids[0]])  # a role declaring it (a write pin)
    engine.check_integrity()


def test_write_back_behind_a_slow_disk_queues_no_more_than_the_queue_takes(monkeypatch):
    """A full writer queue (the disk is behind) takes one block of a 64-block persist: only that block
    is gathered, and its payload keeps no more host memory than itself; the rest waits for a later call
    and is counted lost if the request's last call finds no room either. Before, the whole chunk was
    gathered and every queued row kept its chunk alive (x chunk/block host memory; found by a review)."""
    import threading

    from pdserve.engine import store_connector
    from pdserve.engine.store_connector import StoreConnector

    page, ppb, page_bytes = 4, 2, 256
    k = [torch.zeros(512, page_bytes, dtype=torch.uint8) for _ in range(2)]
    v = [torch.zeros(512, page_bytes, dtype=torch.uint8) for _ in range(2)]
    block_nbytes = ppb * page_bytes * 2 * len(k)
    layout = SimpleNamespace(block_size=page * ppb, block_nbytes=block_nbytes, fingerprint="t")
    gate = threading.Event()
    taken = threading.Event()  # (the writer is in its first put)
    store = SimpleNamespace(
        layout=layout,
        put=lambda key, data, ancestors=(): taken.set() or gate.wait() or True,
        stored_prefix=lambda keys: 0,
    )  # a stuck disk, holding none of these blocks
    engine = SimpleNamespace(
        kv=SimpleNamespace(page_size=page), runner=SimpleNamespace(kv_cache=SimpleNamespace(k=k, v=v))
    )
    monkeypatch.setattr(store_connector, "PERSIST_CHUNK_NBYTES", 16 * block_nbytes)
    conn = StoreConnector(engine, store)
    conn._writes.maxsize = 4

    def req(i: int, num_blocks: int):
        tokens = [(i * 7919 + j) % 50_000 for j in range(num_blocks * page * ppb + 1)]
        return SimpleNamespace(
            request_id=f"r{i}",
            num_computed_tokens=num_blocks * page * ppb,
            page_ids=[j % 512 for j in range(num_blocks * ppb)],
            block_key_cache=[],
            cache_salt=None,
            num_blocks_persisted=0,
            all_token_ids=tokens,
        )

    for i in range(5):  # the writer holds one block, the queue holds four: full
        conn.persist(req(i, 1))
        assert i > 0 or taken.wait(timeout=10)
    conn._writes.get_nowait()  # the disk finished one: one slot free
    conn._writes.task_done()
    gathered = []
    gather = conn.gather_blocks
    monkeypatch.setattr(conn, "gather_blocks", lambda ids, a, b: gathered.append(b - a) or gather(ids, a, b))
    long_req = req(9, 64)
    assert conn.persist(long_req) == 1 and long_req.num_blocks_persisted == 1
    assert gathered == [1] and conn.num_write_failures == 0  # the other 63 wait for a later call
    payload = conn._writes.queue[-1][3]  # (store, keys, block index, payload)
    assert (payload.base.nbytes if payload.base is not None else payload.nbytes) == block_nbytes
    assert conn.persist(long_req, final=True) == 0  # its last call, the queue still full: 63 lost
    assert gathered == [1] and conn.num_write_failures == 63
    gate.set()


def test_a_flush_behind_a_hung_disk_keeps_its_timeout_and_queued_rows_keep_their_store():
    """The writer is stuck in a put (a hung disk) and the queue is full (persist fills it when the disk
    is behind). `flush(timeout_s)` returns False within its timeout: it blocked on the full queue with
    no timeout, and `retarget` (a weight update, on the engine thread) with it. The rows queued before
    a retarget are written to the store they were queued for, not the new weights' one (they were
    written to whichever store was current when the writer reached them)."""
    import threading

    from pdserve.engine.store_connector import StoreConnector

    layout = SimpleNamespace(block_size=4, block_nbytes=16, fingerprint="t")
    gate = threading.Event()
    written: dict[str, list[bytes]] = {"old": [], "new": []}

    def store(name: str):
        def put(key, data, ancestors=()):
            gate.wait()
            written[name].append(key)
            return True

        return SimpleNamespace(layout=layout, put=put)

    old, new = store("old"), store("new")
    kv = SimpleNamespace(k=[torch.zeros(8, 8, dtype=torch.uint8)], v=[torch.zeros(8, 8, dtype=torch.uint8)])
    engine = SimpleNamespace(kv=SimpleNamespace(page_size=4), runner=SimpleNamespace(kv_cache=kv))
    conn = StoreConnector(engine, old)
    conn._writes.maxsize = 3
    rows = [(old, [bytes([i]) * 16], 0, torch.zeros(16, dtype=torch.uint8)) for i in range(4)]
    conn._writes.put_nowait(rows[0])
    while conn._writes.qsize():  # the writer took it and is stuck in the disk
        time.sleep(0.01)
    for row in rows[1:]:
        conn._writes.put_nowait(row)
    t0 = time.monotonic()
    assert conn.flush(timeout_s=0.2) is False
    conn.retarget(new, flush_timeout_s=0.2)
    waited_s = time.monotonic() - t0
    assert conn.store is new
    gate.set()
    assert conn.flush(timeout_s=10)
    assert waited_s < 2.0
    assert written == {"old": [r[1][0] for r in rows], "new": []}


def _with_store(p, tmp_path):
    """Both roles on one persistent store (8-token blocks); returns it."""
    from pdserve.engine.store_connector import StoreConnector
    from pdserve.store.block_store import KVBlockStore
    from pdserve.store.layout import BlockLayout

    layout = BlockLayout.from_kv_layout(p.de_engine.runner.kv_cache.layout, 2 * PAGE_SIZE, model="t")
    store = KVBlockStore(tmp_path, layout, 1 << 30)
    p.de_role.store = StoreConnector(p.de_engine, store)
    p.pe_role.store = StoreConnector(p.pe_engine, store)
    return store


def _stored_turn(p, store, rid: str) -> list[int]:
    """A first turn (no store hit) whose blocks the decode writes back; returns the next turn's prompt
    (that context plus new tokens), with both prefix caches emptied so the store is the only source."""
    ids = prompt(40, start=5)
    p.submit_both(ids, 2, rid)
    p.drive(lambda: p.idle())
    p.de_role.store.flush()
    p.de_engine.kv.pool.reset_prefix_cache()
    p.pe_engine.kv.pool.reset_prefix_cache()
    return ids + list(p.de_sink.final(rid).outputs[0].token_ids) + prompt(5, start=9)


def _submit_read_path(p, ids: list[int], max_tokens: int, rid: str, read_path: str, room: int = 0) -> int:
    """Both halves of a request that reads its stored KV through `read_path` ("pe" or "de")."""
    room = room or new_room()
    preq, dreq = p.requests(ids, max_tokens, rid, room)
    preq.read_path = dreq.read_path = read_path
    p.pe_role.add(preq, None)
    p.de_role.add(dreq, None)
    return room


@pytest.mark.parametrize("how", ["deadline", "deadline at the last layer", "failed write"])
def test_layerwise_run_stops_when_its_room_ends(tmp_path, how):
    """The layerwise lane does not return to the engine loop between layers, so it never looked at its
    room: past the room's deadline (after which the decode's lease may free the pages) it went on
    writing layers, and a room failed mid-run (a write reported failed) was written to, then handed
    its token, with the failure counted and reported twice (found by a review). Now the run stops at
    the next layer: one error, counted once, nothing more sent, everything released."""
    model = tmp_path / "model"
    tiny_hf_model("llama", num_hidden_layers=4).save_pretrained(model)  # 4 layers: room for a middle
    p = Pair(str(model), copy_bytes=True, fake_clocks=True)
    store = _with_store(p, tmp_path / "store")
    ids = _stored_turn(p, store, "seed")
    room = new_room()
    sent = []

    def on_submit(r, seq, total, local, remote):
        if r != room:
            return
        sent.append(seq)
        if seq == 2 and how == "deadline":
            p.pe_clock.advance(DEADLINE_S + 1)  # layer 1's write took the room past its deadline
        if seq == 4 and how == "deadline at the last layer":  # (the error must still reach the client)
            p.pe_clock.advance(DEADLINE_S + 1)
        if seq == 2 and how == "failed write":  # layer 0's write has been reported failed by now
            end = time.monotonic() + 10
            while p.pe_agent.stats.transfers_failed < 1 and time.monotonic() < end:
                time.sleep(0.001)

    p.on_submit = on_submit
    if how == "failed write":  # the first layer's write is reported failed while the lane runs on
        faults.configure([{"point": "transfer.submit", "action": "fail", "kind": "write", "count": 1}])
    before = dict(p.pe_role.failures)
    try:
        _submit_read_path(p, ids, 2, "t2", "pe", room)
        p.drive(lambda: p.pe_sink.errors("t2"))
        p.settle(0.2)
    finally:
        faults.configure(None)
    expected = "transfer failed" if how == "failed write" else "deadline in Transferring"
    assert p.pe_sink.errors("t2") == [f"prefill failed: {expected}"]
    assert p.pe_sink.outputs("t2") == []  # no token 1 for a failed room
    assert {k: v - before.get(k, 0) for k, v in p.pe_role.failures.items() if v != before.get(k, 0)} == {
        expected: 1
    }
    # Layers 2 and 3 and the handoff never went out (a failed write is seen at layer 1's or layer 2's
    # check, whichever comes after the agent reported it).
    if how == "failed write":
        assert sent in ([1], [1, 2])
    else:
        assert sent == ([1, 2] if how == "deadline" else [1, 2, 3, 4])  # no handoff (seq 5) either
    p.de_clock.advance(LEASE_S + 1)  # (the decode learns of it, or waits out its lease)
    p.drive(lambda: p.idle())
    p.assert_clean()
    store.close()
    p.close()


@pytest.mark.parametrize("read_path", ["pe", "de"])
@pytest.mark.parametrize("staging_pages", [8, 4])
def test_layerwise_staging_packs_a_layer_or_falls_back(
    make_pair, colocated, tmp_path, read_path, staging_pages
):
    """A layerwise send or pull moves one layer (K and V: 2 regions), but took a slot page per page,
    each with room for all 2L regions: a 12-page prompt needed 12 of an 8-page pool and failed ('no
    staging room'), where it needs 12 x 2 / 2L = 6 (found by a review: the default pool then capped
    the read paths at 8k tokens). Packed, it runs in 8 pages, and the metrics see its output like a
    step's. In 4 pages it cannot run even packed: it is prefilled the ordinary way instead. Both give
    a colocated engine's tokens, and report as cached what was not recomputed."""
    from pdserve.transfer.staging import StagingPool

    p = make_pair(copy_bytes=True)
    store = _with_store(p, tmp_path)
    ids = _stored_turn(p, store, "seed")
    s = p.pe_role.staging  # the same registered buffer, `staging_pages` slot pages of it
    p.pe_role.staging = StagingPool(s.num_regions, s.bytes_per_page, staging_pages, buffer=s.buffer)
    assert -(-len(ids) // PAGE_SIZE) == 12 and p.pe_role.staging.pages_for(2, 12) == 6
    observed = []
    p.pe_sink.deliver_step_output = lambda out: observed.append(out) or p.pe_sink.deliver(out, out.request_id)
    _submit_read_path(p, ids, 2, "t2", read_path)
    p.drive(lambda: p.idle())
    assert p.pe_sink.errors("t2") == [] and p.de_sink.errors("t2") == []
    out = p.de_sink.final("t2")
    if staging_pages == 8:
        assert p.pe_role.layerwise.num_runs == 1 and [o.request_id for o in observed] == ["t2"]
        # the 40-token context's 5 stored blocks, whichever side read them
        assert (out.num_cached_tokens, out.metrics["cached_tokens_storage"]) == (40, 40)
    else:
        assert p.pe_role.layerwise.num_runs == 0 and p.pe_role.num_layerwise_fallbacks == 1
        # the fallback recomputed the prompt (both prefix caches were emptied): nothing was cached. On
        # the DE path the decode's store read was counted anyway (40 here; with the prefill's own
        # prefix hits added, a review saw 80 "cached" tokens of a 47-token prompt)
        assert (out.num_cached_tokens, out.metrics["cached_tokens_storage"]) == (0, 0)
    ref = colocated.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    )
    assert p.de_sink.final("t2").outputs[0].token_ids == ref[0].outputs[0].token_ids
    p.pe_role.staging = s
    p.assert_clean()
    store.close()


def test_layerwise_send_slot_blocked_only_by_the_runs_own_pull_still_goes_out(make_pair, colocated, tmp_path):
    """The lane pulls layer l+1 (DE path) before it sends layer l. A slot another room's write held at
    the start of the pool put that pull in the middle; once the write completed, the free space on
    either side of the pull was smaller than the send's slot though their sum was not, nothing else
    was in flight, and the room failed ('no staging room for a layerwise send'). The lane now takes
    its pending pull out of staging first (that layer loses its overlap) and sends."""
    from pdserve.transfer.staging import StagingPool

    p = make_pair(copy_bytes=True)
    store = _with_store(p, tmp_path)
    ids = _stored_turn(p, store, "seed") + prompt(13, start=11)  # 60 tokens: 10 stored pages, 5 sent
    s = p.pe_role.staging
    role = p.pe_role
    role.staging = pool = StagingPool(s.num_regions, s.bytes_per_page, 9, buffer=s.buffer)
    pull, send = pool.pages_for(2, 10), pool.pages_for(2, 5)
    assert (pull, send) == (5, 3)  # fits: 5 + 3 <= 9, the pull at [2, 7) leaves [0, 2) and [7, 9)
    blocker = pool.alloc(2)  # another room's write in flight, at [0, 2)
    role.staging_slots[-1] = blocker
    alloc, drain = pool.alloc, role.drain_completions
    failed_sends = []

    def alloc_watch(num_pages):
        slot = alloc(num_pages)
        if slot is None and num_pages == send:
            failed_sends.append(num_pages)
        return slot

    def drain_watch():
        if failed_sends and -1 in role.staging_slots:  # that write completes once the send waits
            pool.free(role.staging_slots.pop(-1))
        drain()

    pool.alloc, role.drain_completions = alloc_watch, drain_watch
    _submit_read_path(p, ids, 2, "t2", "de")
    p.drive(lambda: p.idle())
    assert failed_sends  # the layout above happened
    assert p.pe_sink.errors("t2") == [] and p.de_sink.errors("t2") == []
    assert role.layerwise.num_runs == 1
    ref = colocated.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    )
    assert p.de_sink.final("t2").outputs[0].token_ids == ref[0].outputs[0].token_ids
    role.staging = s
    p.assert_clean()
    store.close()


def test_a_prefill_whose_pool_holds_the_prompt_takes_a_request_whose_output_would_not_fit_it(
    make_pair, colocated
):
    """A prefill holds only the prompt's KV (it samples one token, which takes no slot); the output
    grows on the decode. A prefill with a smaller pool than its decodes' (they need room to grow, it
    does not) refused, as "needs more KV pages than this engine has in total", every request whose
    prompt + max_tokens outgrew the prefill's pool, though the pair could serve it."""
    p = make_pair(pe_pages=4, copy_bytes=True)  # (16 tokens of KV on the prefill, 256 on the decode)
    ids = prompt(13)  # 4 pages on the prefill; with 20 new tokens, 8 on the decode
    p.submit_both(ids, 20, "big-output")
    p.drive(lambda: p.idle())
    ref = colocated.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=20))
    assert p.de_sink.final("big-output").outputs[0].token_ids == ref[0].outputs[0].token_ids
    p.assert_clean()
    with pytest.raises(InvalidRequest, match="more KV pages than this engine has in total"):
        p.pe_engine.make_request(prompt(17), SamplingParams(max_tokens=1))  # (the prompt itself: 5 pages)


def test_retry_with_the_same_rid_on_the_prefill_runs_while_the_failed_rooms_writes_are_in_flight(
    make_pair, colocated
):
    """The prefill's mirror of the decode's case: the decode failed the room (here its client aborted)
    while the prefill's writes to it were in flight, so the prefill held the room until they settle.
    The router retries under the client's rid (on another decode, with the same prefill): the prefill
    refused it as a duplicate id (a 409) until the writes settled. Its pages stay pinned by those
    writes; the request id is free once its first token was answered."""
    p = make_pair(copy_bytes=True, pe_backend={"delay_s": 1.0})  # every write takes 1 s
    room = p.submit_both(prompt(9), 4, "again")
    p.drive(lambda: bool(p.pe_role.transfers) and p.pe_sink.outputs("again"))
    p.de_role.abort("again")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.Failed)
    assert p.pe_role.by_room[room].in_flight  # (its writes still run: the room stays)
    assert "again" not in p.pe_engine.requests and p.pe_role.pinned  # the id is free, the pages are not
    room2 = p.submit_both(prompt(9), 4, "again")
    p.drive(lambda: any(o.finished for o in p.de_sink.outputs("again")), timeout_s=20)
    ref = colocated.generate([{"prompt_token_ids": prompt(9)}], SamplingParams(temperature=0, max_tokens=4))
    assert p.de_sink.final("again").outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert room2 != room
    p.drive(lambda: p.idle(), timeout_s=20)
    assert p.pe_role.by_request == {} and p.de_role.aborts.num_acked == 1
    p.assert_clean()


def test_the_routers_abort_of_an_answered_prefill_half_by_its_room_frees_its_rid_for_the_retry(make_pair):
    """router/app.py `_abort_answered_half`: the prefill answered its token 1, then the decode died (no
    Abort reaches the prefill: its writes are in flight). The router ends that half before it retries
    under the client's rid on the same prefill. As a plain `/abort_request {"rid"}` (found by a
    review) it ended nothing: `AsyncEngine.abort_now` ends requests being streamed, and the answered
    half's stream had ended, so the retry was a duplicate id (the client's 409); by prefix it could
    end others named `<rid>_...`. Named by its room (`abort_room`), that half ends and frees the id."""
    import asyncio
    import threading

    from pdserve.engine.async_engine import AsyncEngine

    p = make_pair(copy_bytes=True, pe_backend={"delay_s": 5.0})  # the failed room's writes stay in flight
    room = new_room()
    preq, dreq = p.requests(prompt(9), 4, "again", room)
    p.de_role.add(dreq, None)
    stop = threading.Event()

    def decode_alive():  # the decode, until it "dies" (stops without a word to the prefill)
        while not stop.is_set():
            p.de_role.tick()
            if p.de_engine.has_unfinished():
                for out in p.de_engine.step():
                    p.de_sink.deliver(out, out.request_id)
            else:
                time.sleep(0.0005)

    aengine = AsyncEngine(p.pe_engine, role=p.pe_role, check_integrity_when_idle=False)
    decode = threading.Thread(target=decode_alive, daemon=True)
    decode.start()
    counts = {}

    async def go():
        outs = [o async for o in aengine.generate(preq)]  # the prefill's answer: token 1
        assert outs and outs[-1].finished
        stop.set()
        decode.join(5)  # the decode is dead
        assert p.pe_role.transfers, "the failed room's writes should still be in flight"
        counts["by rid"] = await aengine.abort_now("again")  # (nothing streams under it)
        counts["other id"] = await aengine.abort_room(room, "again_1")  # (not that room's id)
        counts["other room"] = await aengine.abort_room(new_room(), "again")
        counts["by room"] = await aengine.abort_room(room, "again")
        preq2, _ = p.requests(prompt(9), 4, "again", new_room())  # the retry: same rid, new room
        retry = aengine.generate(preq2)
        try:
            await asyncio.wait_for(retry.__anext__(), 0.5)  # (accepted: it waits for its decode)
        except TimeoutError:
            pass
        finally:
            await retry.aclose()

    try:
        asyncio.run(go())
    finally:
        stop.set()
        aengine.shutdown()
    assert counts == {"by rid": 0, "other id": 0, "other room": 0, "by room": 1}
    assert p.pe_role.failures.get("aborted by its router") == 1


def test_a_late_failure_or_router_abort_of_a_room_that_succeeded_changes_nothing(make_pair, colocated):
    """The prefill's room succeeded (the decode acked the last write) and waits for `_reap` (the same
    tick, unless something else arrives first): a late Status(Failed) or the router's abort of that
    room still counted a failure ("a few counters drift", docs/reliability.md). The first outcome
    stands: nothing counted, and the room is reaped as a success. The router's abort still frees the
    client's rid at once (it retries under it here): the decode's ack can come before the agent
    reports the last write, and the id was held until then (a review: a retry refused as a duplicate)."""
    p = make_pair(copy_bytes=True)
    reap, drain = p.pe_role._reap, p.pe_role.drain_completions
    p.pe_role._reap = lambda: None  # (held, so the succeeded room can be seen before it goes)
    ids = prompt(13, start=5)
    room = p.submit_both(ids, 3, "ok")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.Success)
    failures = dict(p.pe_role.failures)
    p.pe_role._fail(room, "decode failed: late")
    assert p.pe_role.failures == failures and p.pe_role.rooms.state(room) == KVState.Success
    assert p.pe_role.abort_room(room, "other-id") == 0 and "ok" in p.pe_engine.requests
    assert p.pe_role.abort_room(room, "ok") == 1
    assert "ok" not in p.pe_engine.requests and "ok" not in p.pe_role.by_request
    assert p.pe_role.failures == failures and p.pe_role.rooms.state(room) == KVState.Success
    p.pe_role._reap = reap
    p.drive(lambda: p.idle())
    ref = colocated.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=3))
    assert p.de_sink.final("ok").outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert p.pe_role.failures == failures
    p.assert_clean()

    # The ack before the agent's report of the last write (its completion held): a room that succeeded
    # with a write in flight, so `_reap` waits; the router's abort frees the id for its retry at once,
    # and the retry runs to its end on this prefill while the old write still reads its pinned pages.
    p.pe_role.drain_completions = lambda: None
    room = p.submit_both(ids, 3, "again")
    p.drive(lambda: p.pe_role.rooms.state(room) == KVState.Success)
    assert p.pe_role.by_room[room].in_flight and p.pe_role.pinned
    assert p.pe_role.abort_room(room, "again") == 1
    assert p.pe_role.abort_room(room, "again") == 1  # (twice: harmless)
    finished = lambda: [o for o in p.de_sink.outputs("again") if o.finished]  # noqa: E731
    p.drive(lambda: len(finished()) == 1)  # (the decode had all the KV: the first answer ends)
    retry = p.submit_both(ids, 3, "again")  # (was: DuplicateRequestId until the completion came)
    p.drive(lambda: p.pe_role.rooms.state(retry) == KVState.Success)
    p.pe_role.drain_completions = drain
    p.drive(lambda: p.idle())
    assert [list(o.outputs[0].token_ids) for o in finished()] == [list(ref[0].outputs[0].token_ids)] * 2
    assert p.pe_role.failures == failures
    p.assert_clean()


# ---- a review of the PD protocol (2026-12-04, evening) -------------------------------------------------
def test_the_inflight_gauge_counts_a_transferring_room_once(make_pair):
    """`inflight` added the Transferring rooms and the rooms with writes in flight: a Transferring room
    with a write in flight, the ordinary case, counted twice."""
    p = make_pair(pe_budget=8, pe_backend={"delay_s": 2.0})
    room = p.submit_both(prompt(30), 8, "q")
    p.drive(lambda: len(p.submits) >= 1)
    assert p.pe_role.by_room[room].in_flight and p.pe_role.rooms.state(room) == KVState.Transferring
    assert p.pe_role.queue_sizes() == {"bootstrap": 0, "waiting": 0, "inflight": 1}


def test_a_failed_room_waiting_for_its_writes_is_not_load_to_compute(make_pair):
    """A room that failed after token 1 with writes still in flight: its request is freed (computed
    tokens back to 0), and `/pd/load` reported its whole prompt as tokens to compute, and the room as a
    sequence, until it was reaped: placement kept away from an idle prefill."""
    from pdserve.engine.pd_load import load_report

    p = make_pair(pe_budget=64, pe_backend={"delay_s": 2.0})
    room = p.submit_both(prompt(30), 8, "ld")
    p.drive(lambda: p.pe_role.by_room[room].sent_last)  # token 1 out, writes in flight
    before = load_report(p.pe_role, "n")
    p.pe_role.abort("ld", client_abort=True)
    assert p.pe_role.by_room[room].in_flight and p.pe_role.rooms.state(room) == KVState.Failed
    after = load_report(p.pe_role, "n")
    assert (before.num_seqs, before.num_tokens) == (1, 0)
    assert (after.num_seqs, after.num_tokens) == (0, 0)


def test_a_room_started_from_an_early_kv_request_lives_from_that_request(make_pair):
    """The decode's KVRequest beat the router's request (parked up to a deadline); the decode's abort
    right after it was lost, so the decode's lease ran from then. The room's life (its writes' expiry
    in the agent, which holds while the prefill's engine thread is stalled) counted from the router's
    request: up to a deadline after the lease, a write was still in flight into pages the decode had
    freed. It now counts from the KVRequest."""
    p = make_pair(fake_clocks=True, pe_budget=8, pe_backend={"delay_s": 60.0})
    lost = _lossy(p.de_control, lambda body, lost: isinstance(body, Abort))
    room = new_room()
    preq, dreq = p.requests(prompt(30), 8, "early", room)
    p.de_role.add(dreq, None)
    p.drive(lambda: room in p.pe_role.early)  # the KVRequest is parked on the prefill
    p.de_role.abort("early", client_abort=True)  # its Abort is lost: the lease runs from here
    assert lost and room in p.de_role.releasing
    dt = DEADLINE_S - 0.01  # the router's request arrives just inside the parked bound
    p.pe_clock.advance(dt)
    p.de_clock.advance(dt)
    p.pe_role.add(preq, None)
    p.drive(lambda: len(p.submits) >= 1, decode=False)
    assert p.pe_role.by_room[room].in_flight
    remaining = p.config.lease_s - dt + 0.01  # the prefill's engine thread stalls from here
    p.pe_clock.advance(remaining)
    p.de_clock.advance(remaining)
    p.turn(prefill=False)
    assert room not in p.de_role.releasing  # the decode's lease is over: pages freed
    stats = p.pe_agent.stats

    def alive() -> int:
        return stats.transfers_submitted - stats.transfers_done - stats.transfers_failed

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:  # (the agent's thread reads its clock)
        time.sleep(0.01)
    assert alive() == 0, "a write of the room is still in flight after the decode freed its pages"


def test_a_weight_update_after_the_wall_clock_stepped_back_registers_a_newer_route(ckpt, monkeypatch):
    """The bootstrap route's epoch was the wall clock: after an NTP step back the route a weight update
    registers was "not newer" (StaleRoute), and the update ended as weights lost."""
    import pdserve.server.pd_context as pd_context

    engine = make_engine(ckpt)
    config = PDConfig(cluster_secret=b"s", transfer_backend="fake", bootstrap_port=0)
    ctx = pd_context.PDContext(engine, "prefill", config)
    try:
        first = ctx._route_epoch
        now_ns = time.time_ns()
        monkeypatch.setattr(pd_context.time, "time_ns", lambda: now_ns - 60 * 10**9)  # stepped back 60 s
        ctx.on_new_weights("other-weights")
        assert ctx._route_epoch == first + 1
    finally:
        ctx.close()


def test_a_first_token_logprob_the_handoff_cannot_carry_fails_its_room_not_the_engine(tmp_path, monkeypatch):
    """fp16 logits that overflow give a NaN logprob. The colocated engine returns it; a PD prefill put
    it in the handoff row, whose encoder refuses NaN (BadHandoffRow), raised from the step hook: the
    prefill's engine thread ended, and every later request to it failed (a review, 2026-12-05). Now
    that room fails, with the reason, and the prefill goes on serving."""
    import sys

    model = tiny_hf_model("llama")
    with torch.no_grad():  # (logits of +-60000 in fp16: their softmax overflows to NaN)
        signs = torch.rand(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)) < 0.5
        model.lm_head.weight.copy_(torch.where(signs, -60000.0, 60000.0))
    model.half().save_pretrained(tmp_path)

    def fp16_engine(ckpt, num_pages=64, budget=64, page_size=PAGE_SIZE):
        return LLMEngine(
            EngineConfig.create(
                ckpt, dtype="float16", device="cpu", page_size=page_size, num_pages=num_pages,
                max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget,
            )
        )  # fmt: skip

    monkeypatch.setattr(sys.modules[__name__], "make_engine", fp16_engine)
    p = Pair(str(tmp_path), copy_bytes=True)
    try:
        ids = list(range(1, 19))
        p.submit_both(ids, 4, "nan", logprobs=1)
        p.drive(lambda: p.idle(), timeout_s=20)
        (error,) = p.de_sink.errors("nan")
        assert "the first token cannot be handed off" in error and "NaN" in error, error
        p.submit_both(ids, 4, "plain")  # (no logprobs asked: nothing NaN to hand off)
        p.drive(lambda: p.idle(), timeout_s=20)
        assert len(p.de_sink.final("plain").outputs[0].token_ids) == 4
        p.assert_clean()
    finally:
        p.close()


def test_a_prefill_serving_two_decodes_has_a_handoff_row_for_each_of_their_rooms(ckpt):
    """The prefill's handoff rows (the source of each room's last write, held until its decode's Success
    is reaped) were as many as one decode admits, and shared by every decode: two decodes of 8 rows
    each, 12 requests (6 each, within their admission), and 4 rooms failed "no free handoff slot" once
    their whole prompt was computed (a review, 2026-12-05)."""
    from pdserve.engine.pd_decode import DecodeRole

    p = Pair(ckpt, copy_bytes=True)
    try:
        engine2 = make_engine(ckpt)
        role2, _, _ = p._role(
            DecodeRole, engine2, f"decode2-{uuid.uuid4().hex[:6]}", fingerprint(engine2), None, None
        )
        sink2 = Sink()
        role2.attach(sink2)
        assert p.pe_role.handoff.num_slots == 16 * 8 and role2.handoff.num_slots == 8
        rids = []
        for i in range(12):
            room = new_room()
            preq, dreq = p.requests(prompt(4, start=10 + 7 * i), 3, f"r{i}", room)
            p.pe_role.add(preq, None)
            if i % 2:  # every other request to the second decode
                dreq = engine2.make_request(list(dreq.prompt_token_ids), dreq.sampling_params, f"r{i}")
                dreq.pd = (room, p.prefill_addr)
                role2.add(dreq, None)
            else:
                p.de_role.add(dreq, None)
            rids.append((f"r{i}", sink2 if i % 2 else p.de_sink))

        def done() -> bool:
            role2.tick()
            if engine2.has_unfinished():
                for out in engine2.step():
                    sink2.deliver(out, out.request_id)
            return all(sink.errors(rid) or any(o.finished for o in sink.outputs(rid)) for rid, sink in rids)

        p.drive(done, timeout_s=20)
        assert p.pe_role.failures == {}
        assert [len(sink.final(rid).outputs[0].token_ids) for rid, sink in rids] == [3] * 12
    finally:
        p.close()


def test_a_room_whose_last_write_finds_no_handoff_row_waits_for_one_instead_of_failing(make_pair):
    """Every handoff row of the prefill taken (as by rooms of many decodes whose Successes are not yet
    reaped): a room whose prompt is computed used to fail "no free handoff slot" after all its compute.
    It now waits for a row, oldest first, and goes on as rows come back; nothing fails."""
    p = make_pair(copy_bytes=True)
    taken = [p.pe_role.handoff.alloc() for _ in range(p.pe_role.handoff.num_slots)]
    assert None not in taken and p.pe_role.handoff.num_free == 0
    rooms = [p.submit_both(prompt(9, start=3 + i), 3, f"w{i}") for i in range(2)]
    p.drive(lambda: list(p.pe_role.rows_wanted) == rooms)
    p.settle(0.05)
    assert list(p.pe_role.rows_wanted) == rooms  # still waiting: nothing failed, nothing reordered
    assert p.pe_role.failures == {} and p.pe_sink.errors("w0") == [] == p.pe_sink.errors("w1")
    assert all(not p.de_sink.outputs(f"w{i}") for i in range(2))
    p.pe_role.check_integrity()

    # One row back: the older room takes it at the next reap, the other waits for that same row,
    # freed once the decode's Success for the first is reaped.
    p.pe_role.handoff.free(taken.pop())
    p.pe_role.tick()
    assert list(p.pe_role.rows_wanted) == rooms[1:] and p.pe_role.by_room[rooms[0]].sent_last
    p.drive(lambda: all(any(o.finished for o in p.de_sink.outputs(f"w{i}")) for i in range(2)) and p.idle())
    assert p.pe_role.handoff.num_free == 1
    assert [len(p.de_sink.final(f"w{i}").outputs[0].token_ids) for i in range(2)] == [3, 3]
    assert p.pe_role.failures == {} and not p.pe_role.rows_wanted
    for slot in taken:
        p.pe_role.handoff.free(slot)
    p.assert_clean()


def test_a_room_waiting_for_a_handoff_row_fails_at_its_deadline_and_leaves_the_queue(make_pair):
    p = make_pair(fake_clocks=True)
    taken = [p.pe_role.handoff.alloc() for _ in range(p.pe_role.handoff.num_slots)]
    room = p.submit_both(prompt(9), 4, "wd")
    p.drive(lambda: room in p.pe_role.rows_wanted)
    state = p.pe_role.rooms.state(room)
    assert state in (KVState.WaitingForInput, KVState.Transferring)
    p.pe_clock.advance(DEADLINE_S + 0.01)
    p.pe_role.tick()
    assert not p.pe_role.rows_wanted and room not in p.pe_role.rooms
    assert p.pe_role.failures == {f"deadline in {state.name}": 1}
    p.drive(lambda: p.idle())
    assert p.de_sink.errors("wd") == [f"PD transfer failed: prefill failed: deadline in {state.name}"]
    for slot in taken:  # freed after the room ended: nothing is handed a row for it
        p.pe_role.handoff.free(slot)
    p.pe_role.tick()
    p.assert_clean()


def test_a_decodes_load_report_counts_what_the_scheduler_books(make_pair):
    """The scheduler books a request on a decode at its whole length, prompt + max_tokens - 1 (its
    len(r)); the decode reported the current lengths of admitted requests only, so its load fell at
    every report below what had been booked, and a request waiting for its KV counted nothing (a
    review, 2026-12-05)."""
    from pdserve.engine.pd_load import load_report

    p = make_pair()
    room = new_room()
    _, dreq = p.requests(prompt(9), 4, "dl", room)
    p.de_role.add(dreq, None)  # (waiting for its pages and KV: nothing admitted yet)
    report = load_report(p.de_role, "n")
    assert (report.num_seqs, report.num_tokens) == (1, 9 + 4 - 1)
    preq, _ = p.requests(prompt(9), 4, "dl", room)
    p.pe_role.add(preq, None)
    p.drive(lambda: p.idle())
    assert (load_report(p.de_role, "n").num_seqs, load_report(p.de_role, "n").num_tokens) == (0, 0)
    p.assert_clean()


def test_an_unlimited_snic_reports_no_node_read_queue(make_pair, tmp_path):
    """`launch --nodes` gives every engine a node dir, with or without `--snic-mbps`. Without, the
    SNIC link has no shared state: its read queue always read 0 and its counters were this process's
    own, and the router took that 0 for the node's queue over the engines' reads in flight (a review,
    2026-12-05). Such a report says -1 (no node view) and leaves the SNIC figures at 0."""
    from pdserve.engine.pd_load import load_report
    from pdserve.netem.traffic import NodeConfig, TrafficManager

    p = make_pair()
    with TrafficManager(NodeConfig("n0", str(tmp_path / "nodes"))) as unlimited:
        report = load_report(p.pe_role, "n0", unlimited)
    assert (report.node_read_queue_bytes, report.node_read_queue_tokens) == (-1, -1)
    assert (report.snic_bytes_per_s, report.snic_bytes_served) == (0.0, 0)
    limited = NodeConfig("n1", str(tmp_path / "nodes"), snic_bytes_per_s=1e6)
    with TrafficManager(limited) as tm:
        report = load_report(p.pe_role, "n1", tm)
    assert report.node_read_queue_bytes == 0 and report.snic_bytes_per_s == 1e6
