"""Host buffers in the simulator: reads wait for room, every byte is given back, exact delays."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.workloads import _assemble, table2_workload
from pdserve.dualpath.cost_model import DS_660B, QWEN_32B, prefill_batch_s, profile_from_hf_config
from pdserve.sim.cluster import ClusterSim
from pdserve.sim.config import SimConfig
from pdserve.sim.errors import SimulationStalled
from tests.fuzz_helpers import fuzz_settings
from tests.test_cost_model import DEEPSEEK_V3, QWEN25_32B
from tests.test_sim_invariants import DS27_ONE_RANK, HW2, small_cfg


class _Probe(ClusterSim):
    """Checks every reservation against the buffer and against FIFO order, and records every release
    (time, node, bytes)."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.num_reserved = 0
        self.num_refused = 0
        self.frees: list[tuple[float, int, int]] = []
        # rid -> the nodes it needs room on, for every request refused room and not given it yet: kept
        # from ``_reserve``'s answers alone, independently of the simulator's own waiting lists.
        self.refused: dict[int, set[int]] = {}

    def _reserve(self, req) -> bool:
        pe_node, de_node = req.pe // self.g, self.P + req.de // self.g
        needs = {de_node, pe_node} if req.pe_read else {de_node}
        before = {n: self.buf_used[n] for n in (pe_node, de_node)}
        ok = super()._reserve(req)
        if not ok:
            self.num_refused += 1
            self.refused[req.rid] = needs
            return False
        older = sorted(rid for rid, nodes in self.refused.items() if rid < req.rid and nodes & needs)
        assert not older, f"request {req.rid} given room on {needs} while older {older} wait there"
        self.refused.pop(req.rid, None)
        self.num_reserved += 1
        for n, was in before.items():
            if self.buf_used[n] != was:  # took room here: it fitted, or the buffer was empty
                assert was == 0 or self.buf_used[n] <= self.buf_cap, (n, was, self.buf_used[n])
        assert req.de_buf == req.prompt * self.kv_tok and req.pe_buf == req.pe_read * self.kv_tok
        return True

    def _buf_free(self, node: int, nbytes: int) -> None:
        self.frees.append((self.now, node, nbytes))
        super()._buf_free(node, nbytes)

    def _retry_room(self) -> None:
        # ``_retry_room`` visits only ``room_dirty``: every stalled node whose head read could pass a
        # retry now must be in it (it may hold more).
        for n in self.stalled_nodes:
            head = self.read_q[n][0][0]
            if self.reserved_queued[n] or not self._room_unchanged(head):
                assert n in self.room_dirty, f"stalled node {n} could pass but is not marked"
        assert self.room_dirty <= set(self.stalled_nodes)
        super()._retry_room()

    def _start_read(self, node: int) -> None:
        was_busy = self.snic_busy[node]
        super()._start_read(node)
        if not was_busy and self.snic_busy[node]:
            req = self.read_q[node][0][0]  # the read that started
            assert req.de_buf > 0, f"read of request {req.rid} started on node {node} holding no room"
        assert min(self.reserved_queued) >= 0


class _FullScanRetry(ClusterSim):
    """The retry as first written: every round visits every stalled node in stall order and checks it
    (the simulator visits only the nodes marked dirty). The reference the marked retry must equal."""

    def _retry_room(self) -> None:
        self._retrying_room = True
        fits = []
        granted = True
        while granted:
            granted = False
            for n in list(self.stalled_nodes):
                if self.read_stalled[n]:
                    if not self.reserved_queued[n] and self._room_unchanged(self.read_q[n][0][0]):
                        continue
                    self._start_read(n)
                    granted = granted or not self.read_stalled[n]
            for n in list(self.first_turn_nodes):
                waiting = self.buf_waiting[n]
                while waiting and not self._room_unchanged(waiting[0]) and self._reserve(waiting[0]):
                    req = waiting.popleft()
                    req.reads_left = 0
                    fits.append(req)
                    granted = True
                if not waiting:
                    self.first_turn_nodes.remove(n)
        self._retrying_room = False
        if fits:
            self._ready_together(fits)


def _figures(res) -> tuple:
    return (
        repr(res.jct_s),
        repr(res.jct_mean_s),
        repr(float(res.ttft_s.sum())),
        repr(float(res.tpot_s.sum())),
    )


@pytest.mark.parametrize("mode", ["basic", "layerwise", "dual_path", "dualpath", "split"])
def test_reads_wait_for_room_and_every_byte_is_given_back(mode):
    wl = table2_workload("32k", 12, seed=3)
    # ~2.5 requests' KV per node: the buffer binds often on this small cluster.
    cap_gb = 2.5 * 17_000 * DS_660B.kv_bytes_per_token / 1e9
    sim = _Probe(small_cfg(mode, host_buffer_gb=cap_gb, record_intervals=False), wl)
    res = sim.run()
    assert res.num_turns_done == wl.num_turns
    assert sim.num_reserved > 0 and sim.num_refused > 0, "the buffer should have made some read wait"
    assert sim.buf_used == [0] * len(sim.buf_used)  # every reservation released
    assert not sim.stalled_nodes and not any(sim.read_stalled)
    # No node ever holds more than its buffer (a single prompt larger than the buffer would, when it
    # starts into an empty one; none is here).
    assert res.pe_buffer_peak_gb <= cap_gb * (1 + 1e-12)
    assert 0 < res.de_buffer_peak_gb <= cap_gb * (1 + 1e-12)


def _basic_1p1d(host_buffer_gb: float) -> SimConfig:
    """One prefill and one decode node of two GPUs each, Basic, no submit cost: exact timings."""
    return SimConfig(
        num_prefill_nodes=1,
        num_decode_nodes=1,
        hw=HW2,
        model=DS27_ONE_RANK,
        mode="basic",
        submit_us_per_copy=0,
        host_buffer_gb=host_buffer_gb,
    )


def _one_turn_agents(hits: tuple[int, ...], appends: tuple[int, ...], gen: int = 2):
    """One agent per (hit, append) pair, each a single turn of ``gen`` output tokens, all at t=0."""
    return _assemble(
        "one-turn",
        [np.array([a]) for a in appends],
        [np.array([gen])] * len(appends),
        np.zeros(len(appends)),
        hits=[np.array([h]) for h in hits],
    )


def _two_agents(hit_tokens: int, append: int, gen: int):
    return _one_turn_agents((hit_tokens,) * 2, (append,) * 2, gen)


@pytest.mark.parametrize("fits_both", [True, False])
def test_second_read_waits_until_the_first_prompt_leaves_the_de_buffer(fits_both):
    """Two Basic requests, one prefill node (two ranks) and one decode node. Each reserves its hit on
    the prefill node and its whole prompt on the decode node when its read starts. With room for one
    prompt only on the decode node, the second read starts when the first request's KV has moved into
    the decode GPU (its decode join); with room for both it follows the first read at once."""
    m = DS27_ONE_RANK
    hit, new = 64 * 100, 300
    kv = m.kv_bytes_per_token
    # Not fitting: room for both hits on the prefill node (2 x 6,400 tokens) but not for both prompts
    # (2 x 6,700) on the decode node, so only the decode side holds the second read back.
    cap_gb = (2 * (hit + new) if fits_both else 2 * hit + new) * kv / 1e9
    cfg = _basic_1p1d(cap_gb)
    sim = _Probe(cfg, _two_agents(hit, new, 2), keep_requests=True)
    res = sim.run()
    r0, r1 = res.reqs
    assert (r0.pe, r1.pe) == (0, 1)  # round robin: one rank each, no shared CNIC
    B = cfg.hw.cnic_bytes_per_s
    read_s = hit * kv / cfg.hw.snic_bytes_per_s
    load_s = hit * kv / B
    rest = prefill_batch_s(m, [(hit, new)]) + (hit + new) * kv / B  # compute, then send everything
    assert r0.t_first == pytest.approx(read_s + load_s + rest, rel=1e-9)
    assert r0.t_join == pytest.approx(r0.t_first + (hit + new) * kv / B, rel=1e-9)  # decode H2D
    second_read_start = read_s if fits_both else r0.t_join
    assert r1.t_first == pytest.approx(second_read_start + read_s + load_s + rest, rel=1e-9)
    # Basic frees the prefill node's copy once the hit is loaded into the GPU, before compute.
    pe_frees = sorted(t for t, node, _ in sim.frees if node == 0)
    assert pe_frees[0] == pytest.approx(read_s + load_s, rel=1e-9)


def test_a_request_with_nothing_to_read_waits_for_room_for_what_comes_back():
    """Two first turns (no hit): nothing to read, but each needs its prompt's KV room on the decode
    node for what the PE sends back. With room for one, the second is ready only when the first has
    moved into the decode GPU."""
    m = DS27_ONE_RANK
    new = 3000
    kv = m.kv_bytes_per_token
    cfg = _basic_1p1d(1.5 * new * kv / 1e9)
    res = ClusterSim(cfg, _two_agents(0, new, 2), keep_requests=True).run()
    r0, r1 = res.reqs
    B = cfg.hw.cnic_bytes_per_s
    step = prefill_batch_s(m, [(0, new)]) + new * kv / B  # compute, then send
    assert r0.t_first == pytest.approx(step, rel=1e-9)
    assert r0.t_join == pytest.approx(step + new * kv / B, rel=1e-9)
    assert r1.t_first == pytest.approx(r0.t_join + step, rel=1e-9)
    assert res.de_buffer_peak_gb * 1e9 == new * kv


def test_de_buffer_holds_each_prompt_from_its_read_until_the_decode_h2d():
    """The decode node's buffer holds a request's whole prompt KV (the DE-read hit, then what the PE
    sends back) from its first read until its decode H2D; two overlapping requests: peak = both."""
    m = DS27_ONE_RANK
    hit, new = 64 * 100, 300
    cfg = SimConfig(
        num_prefill_nodes=1, num_decode_nodes=1, hw=HW2, model=m, mode="dualpath", submit_us_per_copy=0
    )
    sim = _Probe(cfg, _two_agents(hit, new, 2), keep_requests=True)
    res = sim.run()
    kv = m.kv_bytes_per_token
    assert res.de_buffer_peak_gb * 1e9 == 2 * (hit + new) * kv
    de_frees = sorted((t, b) for t, node, b in sim.frees if node == 1)
    assert de_frees == sorted((r.t_join, r.prompt * kv) for r in res.reqs)
    assert sim.buf_used == [0, 0]


def test_unbounded_buffer_never_delays_and_the_default_is_the_models():
    wl = table2_workload("32k", 12, seed=3)
    for mode in ("basic", "dualpath"):
        sim = _Probe(small_cfg(mode, host_buffer_gb=math.inf, record_intervals=False), wl)
        res = sim.run()
        assert sim.num_refused == 0 and res.num_turns_done == wl.num_turns
        assert res.pe_buffer_peak_gb > 0
    assert SimConfig().host_buffer_bytes == 80e9  # DS-660B (paper: 80 GB per node)
    assert SimConfig(model=QWEN_32B).host_buffer_bytes == 320e9
    assert SimConfig(host_buffer_gb=12.5).host_buffer_bytes == 12.5e9
    with pytest.raises(ValueError, match="host_buffer_gb"):
        SimConfig(host_buffer_gb=-1)
    with pytest.raises(ValueError, match="host_buffer_gb"):
        SimConfig(host_buffer_gb=math.nan)


def test_hf_configs_get_the_papers_buffer_for_their_attention_kind():
    assert profile_from_hf_config(DEEPSEEK_V3).host_buffer_bytes == 80e9  # MLA: the DS deployments'
    assert profile_from_hf_config(QWEN25_32B).host_buffer_bytes == 320e9  # GQA: Qwen's


@fuzz_settings(40)
@given(
    mode=st.sampled_from(["basic", "layerwise", "dual_path", "dualpath", "split"]),
    requests_per_buffer=st.floats(min_value=0.05, max_value=4.0),
    seed=st.integers(min_value=0, max_value=3),
    num_prefill_nodes=st.integers(min_value=1, max_value=3),
    num_decode_nodes=st.integers(min_value=1, max_value=4),
)
def test_any_buffer_size_finishes_every_request_and_frees_everything(
    mode, requests_per_buffer, seed, num_prefill_nodes, num_decode_nodes
):
    """No deadlock, no read without room and no leak for any buffer size, down to a fraction of one
    request (a node with an empty buffer takes any size), in every mode (split reads included) and on
    shapes where a split request's two reads start on different nodes' queues. A release retries only
    the stalled nodes whose head it may concern (at 48P96D nearly every node waits for room, and
    scanning them all on each release cost ~10% of the run): the same run, to the bit, as retrying
    every stalled node (`_FullScanRetry`)."""
    wl = table2_workload("32k", 24, seed=seed)
    cap_gb = requests_per_buffer * 17_000 * DS_660B.kv_bytes_per_token / 1e9
    cfg = small_cfg(
        mode,
        host_buffer_gb=cap_gb,
        record_intervals=False,
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
    )
    sim = _Probe(cfg, wl)
    res = sim.run()
    assert res.num_turns_done == wl.num_turns
    assert _figures(res) == _figures(_FullScanRetry(cfg, wl).run())
    assert sim.buf_used == [0] * len(sim.buf_used)
    assert not sim.stalled_nodes and not any(len(w) for w in sim.buf_waiting)
    assert sim.reserved_queued == [0] * len(sim.reserved_queued)
    assert not sim.refused and not any(sim.room_wait)


def test_a_read_does_not_take_room_an_older_first_turn_waits_for():
    """Room on a node goes in FIFO order over reads and first turns. Request 0 reads a large hit and
    holds its prompt's room on the decode node; request 1, a first turn, does not fit beside it and
    waits; request 2's small read would fit, but it is younger than request 1, so its read starts only
    when request 1 has been given room (request 0's KV moved into the decode GPU), not as soon as the
    storage NIC is free."""
    m = DS27_ONE_RANK
    kv = m.kv_bytes_per_token
    hits, news = (6400, 0, 640), (300, 1000, 60)
    cap_tokens = hits[0] + news[0] + hits[2] + news[2]  # requests 0 and 2 fit together, 0 and 1 do not
    wl = _one_turn_agents(hits, news)
    cfg = replace(_basic_1p1d(cap_tokens * kv / 1e9), record_intervals=True)
    sim = _Probe(cfg, wl, keep_requests=True)
    res = sim.run()
    r0, r1, r2 = res.reqs
    (first, _, _), (second, _, _) = res.links["snic"][0].intervals
    assert first == 0.0
    read0_s = hits[0] * kv / cfg.hw.snic_bytes_per_s
    assert r0.t_join > read0_s
    assert second == pytest.approx(r0.t_join, rel=1e-12)  # not read0_s: request 1 goes first
    assert r1.t_first > r0.t_join  # request 1 waited for that room too
    assert sim.num_refused >= 2  # request 1 for room, request 2 behind it


def test_basic_load_frees_room_and_restarts_the_waiting_read():
    """One prefill GPU, two decode nodes of one GPU: the two requests' prompts go to different decode
    nodes, but their hits share the prefill node's buffer, which holds one. The second read starts
    exactly when the first request's hit is loaded into the GPU (Basic frees it then), not later."""
    m = DS27_ONE_RANK
    hit, new = 64 * 100, 300
    kv = m.kv_bytes_per_token
    hw1 = replace(HW2, gpus_per_node=1)
    cfg = replace(_basic_1p1d(1.5 * hit * kv / 1e9), hw=hw1, num_decode_nodes=2, record_intervals=True)
    sim = _Probe(cfg, _two_agents(hit, new, 2), keep_requests=True)
    res = sim.run()
    r0, r1 = res.reqs
    assert (r0.pe, r1.pe, r0.de, r1.de) == (0, 0, 0, 1)
    read_s = hit * kv / hw1.snic_bytes_per_s
    load_s = hit * kv / hw1.cnic_bytes_per_s
    (first, _, _), (second, _, _) = res.links["snic"][0].intervals
    assert first == 0.0
    assert second == pytest.approx(read_s + load_s, rel=1e-12)  # not at read_s: no room until loaded
    assert res.buffer_peak_bytes[0] == hit * kv


@pytest.mark.parametrize("num_prefill_nodes,num_decode_nodes", [(2, 2), (2, 4)])
def test_split_reads_never_start_without_room_on_two_prefill_nodes(num_prefill_nodes, num_decode_nodes):
    """Regression (found in review): a split request reserving at its PE read counted its DE read as
    able to pass before it was queued, and the stalled DE node then started its head read holding no
    room (2 x 2 nodes, seed 0: a deadlock). Every started read must hold room."""
    wl = table2_workload("32k", 24, seed=0)
    cap_gb = 0.5 * 17_000 * DS_660B.kv_bytes_per_token / 1e9
    cfg = small_cfg(
        "split",
        host_buffer_gb=cap_gb,
        record_intervals=False,
        num_prefill_nodes=num_prefill_nodes,
        num_decode_nodes=num_decode_nodes,
    )
    sim = _Probe(cfg, wl)  # asserts in every _start_read
    assert sim.run().num_turns_done == wl.num_turns
    assert sim.buf_used == [0] * len(sim.buf_used)


def test_an_offline_run_that_runs_out_of_events_raises():
    """A wait nothing can end (here: a storage NIC that never starts a read) is an error, not a result
    with missing turns."""

    class NeverReads(ClusterSim):
        def _start_read(self, node: int) -> None:
            pass

    wl = table2_workload("32k", 4, seed=1)
    with pytest.raises(SimulationStalled, match="turns open"):
        NeverReads(small_cfg("dualpath", record_intervals=False), wl).run()


def test_requests_given_room_at_the_same_instant_share_one_group_step():
    """Three first turns; the buffer holds the first one's prompt, so the other two (smaller) wait and
    get room together when it moves into the decode GPU: on the two ranks of one lockstep prefill group
    they must share one step, not take two."""
    m = replace(DS27_ONE_RANK, prefill_ep_gpus=2)
    news = (3000, 1000, 1000)
    wl = _one_turn_agents((0, 0, 0), news)
    cap_gb = news[0] * m.kv_bytes_per_token / 1e9
    cfg = replace(_basic_1p1d(cap_gb), model=m)
    r0, r1, r2 = ClusterSim(cfg, wl, keep_requests=True).run().reqs
    assert (r1.pe, r2.pe) == (1, 0)  # round robin: the two waiting ones on different ranks
    assert r1.t_first > r0.t_join and r1.t_first == r2.t_first
