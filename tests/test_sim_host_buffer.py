"""Host buffers in the simulator: reads wait for room, every byte is given back, exact delays."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.workloads import _assemble, table2_workload
from pdserve.dualpath.cost_model import DS_660B, QWEN_32B, prefill_batch_s, profile_from_hf_config
from pdserve.sim.cluster import ClusterSim
from pdserve.sim.config import SimConfig
from tests.test_cost_model import DEEPSEEK_V3, QWEN25_32B
from tests.test_sim_invariants import DS27_ONE_RANK, HW2, small_cfg


class _Probe(ClusterSim):
    """Records, for every read that starts, the buffer use just before it; counts refused starts."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.starts: list[tuple[int, int, int]] = []  # (node, used before, bytes)
        self.refused = 0

    def _start_read(self, node: int) -> None:
        req, tokens = self.read_q[node][0]
        before = self.buf_used[node]
        super()._start_read(node)
        if self.snic_busy[node]:
            self.starts.append((node, before, tokens * self.kv_tok))
        else:
            self.refused += 1


@pytest.mark.parametrize("mode", ["basic", "layerwise", "dual_path", "dualpath", "split"])
def test_reads_wait_for_room_and_every_byte_is_given_back(mode):
    wl = table2_workload("32k", 12, seed=3)
    # ~2.5 requests' hit KV per node: the buffer binds often on this small cluster.
    cap_gb = 2.5 * 17_000 * DS_660B.kv_bytes_per_token / 1e9
    sim = _Probe(small_cfg(mode, host_buffer_gb=cap_gb, record_intervals=False), wl)
    res = sim.run()
    assert res.num_turns_done == wl.num_turns
    cap = cap_gb * 1e9
    assert sim.starts and sim.refused > 0, "the buffer should have made some read wait"
    for node, before, nbytes in sim.starts:
        assert before == 0 or before + nbytes <= cap, (node, before, nbytes)
    assert sim.buf_used == [0] * len(sim.buf_used)  # all reads and returns released
    # Prefill nodes hold only reads, so they never exceed the buffer (unless one read alone does).
    biggest_read = max(n for _, _, n in sim.starts)
    assert res.pe_buffer_peak_gb * 1e9 <= max(cap, biggest_read)
    assert res.de_buffer_peak_gb > 0 or mode == "oracle"


def _two_agents(hit_tokens: int, append: int, gen: int):
    return _assemble(
        "two",
        [np.array([append])] * 2,
        [np.array([gen])] * 2,
        np.zeros(2),
        hits=[np.array([hit_tokens])] * 2,
    )


@pytest.mark.parametrize("fits_both", [True, False])
def test_basic_second_read_waits_until_the_first_is_loaded(fits_both):
    """Two Basic requests read through one prefill SNIC into different ranks. With room for one hit,
    the second read starts only when the first request's KV is loaded into its GPU (its buffer is
    freed then), which delays its first token by exactly that load."""
    m = DS27_ONE_RANK
    hit, new = 64 * 100, 300
    kv = m.kv_bytes_per_token
    cap_gb = (2 if fits_both else 1) * hit * kv / 1e9
    cfg = SimConfig(
        num_prefill_nodes=1,
        num_decode_nodes=1,
        hw=HW2,
        model=m,
        mode="basic",
        submit_us_per_copy=0,
        host_buffer_gb=cap_gb,
    )
    res = ClusterSim(cfg, _two_agents(hit, new, 2), keep_requests=True).run()
    r0, r1 = res.reqs
    assert (r0.pe, r1.pe) == (0, 1)  # round robin: one rank each, no shared CNIC
    B = cfg.hw.cnic_bytes_per_s
    read_s = hit * kv / cfg.hw.snic_bytes_per_s
    load_s = hit * kv / B
    rest = prefill_batch_s(m, [(hit, new)]) + (hit + new) * kv / B  # compute, then send everything
    assert r0.t_first == pytest.approx(read_s + load_s + rest, rel=1e-9)
    second_read_start = read_s if fits_both else read_s + load_s
    assert r1.t_first == pytest.approx(second_read_start + read_s + load_s + rest, rel=1e-9)
    assert res.pe_buffer_peak_gb == pytest.approx(cap_gb)


def test_de_buffer_holds_the_prompt_until_the_decode_h2d():
    """On a decode node the buffer holds the DE-read hit and the KV the PE returns until the request's
    decode H2D; one request alone: peak = its whole prompt KV, all released after."""
    m = DS27_ONE_RANK
    hit, new = 64 * 100, 300
    cfg = SimConfig(
        num_prefill_nodes=1, num_decode_nodes=1, hw=HW2, model=m, mode="dualpath", submit_us_per_copy=0
    )
    sim = ClusterSim(cfg, _two_agents(hit, new, 2), keep_requests=True)
    res = sim.run()
    kv = m.kv_bytes_per_token
    de_bytes = sum(r.de_read + r.new + r.pe_read for r in res.reqs) * kv  # read there + returned
    assert 0 < res.de_buffer_peak_gb * 1e9 <= de_bytes
    # The two requests overlap in time, so the peak is more than one prompt.
    assert res.de_buffer_peak_gb * 1e9 > (hit + new) * kv
    assert sim.buf_used == [0, 0]


def test_unbounded_buffer_never_delays_and_the_default_is_the_models():
    wl = table2_workload("32k", 12, seed=3)
    for mode in ("basic", "dualpath"):
        sim = _Probe(small_cfg(mode, host_buffer_gb=math.inf, record_intervals=False), wl)
        res = sim.run()
        assert sim.refused == 0 and res.num_turns_done == wl.num_turns
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
