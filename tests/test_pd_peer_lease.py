"""Registrations are leases (PDConfig.peer_idle_s): a prefill forgets a decode that has been silent
that long and holds no room there, and removes it from its transfer agent; a decode forgets a prefill
it has not used that long, and registers again with one it has been silent to for `peer_renew_s`
before asking it for KV. Before, every decode restart (a new agent name) stayed registered on every
prefill for the prefill's life, NIXL remote agent included.

Fake clocks (tests/test_pd_roles.Pair): the leases pass only when a test moves a clock.
"""

from __future__ import annotations

import dataclasses
import time

import pytest

from pdserve.disagg.messages import KVRequest, Register
from pdserve.disagg.state import KVState
from pdserve.engine.pd_common import PEER_GC_INTERVAL_S, PDConfig
from tests.test_pd_roles import DEADLINE_S, Pair, prompt


@pytest.fixture(scope="module")
def ckpt(hf_checkpoints) -> str:
    return hf_checkpoints["llama"][0]


@pytest.fixture
def make_pair(ckpt):
    pairs: list[Pair] = []

    def make(**kw) -> Pair:
        pairs.append(Pair(ckpt, **kw))
        return pairs[-1]

    yield make
    for p in pairs:
        p.close()


def _known_to_backend(p, name: str) -> bool:
    return name in p.pe_backend._peers


def _until(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def _serve(p, rid: str, n: int = 9, max_tokens: int = 4) -> list[int]:
    p.submit_both(prompt(n), max_tokens, rid)
    p.drive(lambda: p.idle(), timeout_s=10)
    assert p.de_sink.errors(rid) == []
    return p.de_sink.final(rid).outputs[0].token_ids


def test_prefill_forgets_a_silent_decode_and_its_agent_entry(make_pair):
    p = make_pair(fake_clocks=True, copy_bytes=True)
    _serve(p, "a")
    decode_name = p.de_agent.agent_name
    assert p.pe_role.num_peers == 1 and _known_to_backend(p, decode_name)
    idle_s = p.config.peer_idle_s

    p.pe_clock.advance(idle_s)  # exactly the idle limit: still known (strict, as deadlines)
    p.pe_role.tick()
    assert p.pe_role.num_peers == 1 and p.pe_role.num_peers_forgotten == 0
    p.pe_clock.advance(PEER_GC_INTERVAL_S)  # (idle peers are looked for once a second)
    p.pe_role.tick()
    assert p.pe_role.num_peers == 0 and p.pe_role.num_peers_forgotten == 1
    _until(lambda: not _known_to_backend(p, decode_name))  # (the agent thread applies it)
    p.assert_clean()


def test_a_decode_that_talks_is_never_forgotten(make_pair):
    """Anything the decode sends (here a KVRequest per request) restarts the prefill's idle clock."""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    expected = _serve(p, "w0")
    for i in range(1, 4):
        p.pe_clock.advance(p.config.peer_idle_s * 0.6)  # 3 x 0.6: well past the limit in all
        assert _serve(p, f"w{i}") == expected
    p.pe_clock.advance(2.0)
    p.pe_role.tick()
    assert p.pe_role.num_peers == 1 and p.pe_role.num_peers_forgotten == 0


def test_a_decode_silent_for_the_renewal_time_registers_before_asking(make_pair):
    """Its next request sends Register first (the prefill may have forgotten it), then the KVRequest,
    and is served: no request waits out a deadline for a registration the prefill dropped."""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    expected = _serve(p, "r0")
    assert [t for t, _ in p.de_sent].count(Register) == 1
    # Both sides idle past the prefill's limit: the prefill forgets, the decode must renew.
    p.pe_clock.advance(p.config.peer_idle_s + 1.0)
    p.de_clock.advance(p.config.peer_renew_s + 0.01)
    p.pe_role.tick()
    assert p.pe_role.num_peers == 0
    p.de_sent.clear()
    assert _serve(p, "r1") == expected
    kinds = [t for t, _ in p.de_sent]
    assert kinds[:2] == [Register, KVRequest], p.de_sent
    assert p.pe_role.num_peers == 1 and p.pe_role.failures == {}
    p.assert_clean()


def test_a_decode_renews_in_time_for_a_prefill_that_forgets_sooner_than_itself(make_pair):
    """The prefill's RegisterAck says how long it keeps a silent decode (`peer_idle_s`, a flag of each
    engine): a decode configured for longer renews within a quarter of the prefill's. Before, it went
    by its own value only, and its first request after the prefill forgot it waited out the
    Bootstrapping deadline (the KVRequest refused, with no one to tell)."""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    p.pe_role.config = dataclasses.replace(p.config, peer_idle_s=40.0)  # (before the decode registers)
    assert p.de_role.config.peer_idle_s == 600.0
    expected = _serve(p, "s0")
    for clock in (p.pe_clock, p.de_clock):
        clock.advance(10.0)  # a quarter of the prefill's limit: no renewal yet
    p.de_sent.clear()
    assert _serve(p, "s1") == expected and Register not in [t for t, _ in p.de_sent]
    p.pe_clock.advance(40.0 + PEER_GC_INTERVAL_S + 0.01)
    p.pe_role.tick()
    assert p.pe_role.num_peers == 0  # the prefill forgot the decode
    p.de_clock.advance(10.01)
    p.de_sent.clear()
    assert _serve(p, "s2") == expected
    assert [t for t, _ in p.de_sent][:2] == [Register, KVRequest], p.de_sent
    assert p.pe_role.num_peers == 1 and p.pe_role.failures == {}
    p.assert_clean()


def test_a_decode_within_the_renewal_time_does_not_register_again(make_pair):
    p = make_pair(fake_clocks=True, copy_bytes=True)
    _serve(p, "n0")
    p.de_clock.advance(p.config.peer_renew_s)  # exactly the renewal time: not yet
    p.de_sent.clear()
    _serve(p, "n1")
    assert Register not in [t for t, _ in p.de_sent]


def test_a_decode_whose_room_is_still_in_flight_is_kept(make_pair):
    """A room whose write is still in flight holds its decode, however long the silence: only once the
    room is gone is the decode forgotten (removing a NIXL peer under a live transfer is not safe)."""
    p = make_pair(
        fake_clocks=True, copy_bytes=True, pe_backend={"delay_s": 1.0}
    )  # every write takes 1 s of real time
    room = p.submit_both(prompt(9), 4, "f")
    p.drive(lambda: bool(p.pe_role.transfers))
    p.pe_clock.advance(p.config.peer_idle_s + 5.0)
    p.pe_role.tick()  # the room fails (its deadline) but its write is in flight: it stays
    assert room in p.pe_role.by_room and p.pe_role.rooms.state(room) == KVState.Failed
    assert p.pe_role.num_peers == 1 and p.pe_role.num_peers_forgotten == 0
    p.drive(lambda: p.idle(), timeout_s=10)
    p.pe_clock.advance(1.0)  # (the next look for idle peers)
    p.pe_role.tick()
    assert p.pe_role.num_peers == 0 and p.pe_role.num_peers_forgotten == 1
    p.assert_clean()


def test_decode_forgets_a_prefill_it_has_not_used(make_pair):
    p = make_pair(fake_clocks=True, copy_bytes=True)
    _serve(p, "d0")
    assert p.de_role.num_peers == 1
    p.de_clock.advance(p.config.peer_idle_s)
    p.de_role.tick()
    assert p.de_role.num_peers == 1
    p.de_clock.advance(1.01)
    p.de_role.tick()
    assert p.de_role.num_peers == 0 and p.de_role.num_peers_forgotten == 1
    # A later request for it is a first contact again: Register, then served.
    p.pe_clock.advance(p.config.peer_idle_s + 2.0)
    p.de_sent.clear()
    _serve(p, "d1")
    assert [t for t, _ in p.de_sent][:2] == [Register, KVRequest]
    p.assert_clean()


def test_decode_keeps_a_prefill_its_waiting_room_names(make_pair):
    """A room still waiting for a prefill (here: the prefill never answers) keeps that prefill's entry,
    however long it has been unused. (An idle limit below the room's deadline makes the case: with the
    defaults every room ends long before.)"""
    p = make_pair(fake_clocks=True, copy_bytes=True)
    p.de_role.config = dataclasses.replace(p.config, peer_idle_s=1.0)
    room = p.submit_both(prompt(9), 4, "k")
    p.settle(0.02, prefill=False)
    assert p.de_role.rooms.state(room) == KVState.Bootstrapping
    p.de_clock.advance(DEADLINE_S - 0.5)  # past the idle limit, not yet the room's deadline
    p.settle(0.02, prefill=False)
    assert p.de_role.num_peers == 1 and p.de_role.num_peers_forgotten == 0
    p.drive(lambda: p.idle(), timeout_s=10)  # the prefill answers at last: served
    assert p.de_sink.errors("k") == [] and len(p.de_sink.final("k").outputs[0].token_ids) == 4
    p.assert_clean()


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_peer_idle_must_be_finite_and_positive(value):
    with pytest.raises(ValueError, match="peer_idle_s"):
        PDConfig(cluster_secret=b"s", peer_idle_s=value)
