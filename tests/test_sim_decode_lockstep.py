"""Decode ranks of one EP group step in lockstep: exact step times against the cost model."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pdserve.bench.workloads import _assemble
from pdserve.dualpath.cost_model import decode_attn_fn, decode_step_s
from pdserve.sim.cluster import ClusterSim
from pdserve.sim.config import SimConfig
from tests.test_sim_invariants import DS27_ONE_RANK, HW2


def _first_turns(new_tokens: int, gens: tuple[int, ...]):
    """One first turn per agent (nothing to read), all with the same prompt."""
    return _assemble(
        "first-turns",
        [np.array([new_tokens])] * len(gens),
        [np.array([g]) for g in gens],
        np.zeros(len(gens)),
        hits=[np.array([0])] * len(gens),
    )


def _run(decode_ep_gpus: int):
    m = replace(DS27_ONE_RANK, decode_ep_gpus=decode_ep_gpus)
    cfg = SimConfig(num_prefill_nodes=1, num_decode_nodes=1, hw=HW2, model=m, mode="basic")
    res = ClusterSim(cfg, _first_turns(3000, (3, 6)), keep_requests=True).run()
    return m, res.reqs


def test_two_ranks_step_together_and_share_the_moe_work():
    """EP2 decode group, one sequence on each rank (same prompt, same join time): while both run a
    step is overhead + 2 sequences' per-sequence work / 2 ranks + the slower rank's attention; when
    one leaves, the other steps at overhead + 1 / 2 of one sequence's work + its attention."""
    m, (r0, r1) = _run(2)
    assert (r0.de, r1.de) == (0, 1) and r0.t_join == r1.t_join
    attn = decode_attn_fn(m)(1, r0.prompt)
    both = m.decode_step_overhead_s + 2 * m.decode_s_per_seq / 2 + attn
    alone = m.decode_step_overhead_s + 1 * m.decode_s_per_seq / 2 + attn
    assert r0.t_done - r0.t_join == pytest.approx(2 * both, rel=1e-12)  # 3 tokens: 1 from prefill
    assert r1.t_done - r1.t_join == pytest.approx(2 * both + 3 * alone, rel=1e-12)


def test_independent_ranks_step_alone():
    m, (r0, r1) = _run(1)
    step = decode_step_s(m, 1, r0.prompt)
    assert r0.t_done - r0.t_join == pytest.approx(2 * step, rel=1e-12)
    assert r1.t_done - r1.t_join == pytest.approx(5 * step, rel=1e-12)
    # The same step as the lockstep pair while both ran (one sequence per rank: no imbalance).
    m2, (q0, _) = _run(2)
    assert q0.t_done - q0.t_join == pytest.approx(r0.t_done - r0.t_join, rel=1e-12)


def test_the_slowest_rank_sets_the_step():
    """Unequal ranks: a short-context sequence decodes alone on rank 0, then a 38K-token context joins
    rank 1; from then on every step of the group costs the long context's attention, so the short
    sequence finishes exactly when the cost model says for that schedule."""
    m = replace(DS27_ONE_RANK, decode_ep_gpus=2)
    wl = _assemble(
        "unequal",
        [np.array([200]), np.array([200])],
        [np.array([40]), np.array([40])],
        np.zeros(2),
        hits=[np.array([0]), np.array([64 * 600])],  # a short and a 38K-token context
    )
    cfg = SimConfig(num_prefill_nodes=1, num_decode_nodes=1, hw=HW2, model=m, mode="basic")
    short, long_ = ClusterSim(cfg, wl, keep_requests=True).run().reqs
    assert (short.de, long_.de) == (0, 1) and short.t_join < long_.t_join < short.t_done
    attn = decode_attn_fn(m)
    over, per_seq = m.decode_step_overhead_s, m.decode_s_per_seq
    step_alone = over + per_seq / 2 + attn(1, short.prompt)
    step_both = over + 2 * per_seq / 2 + max(attn(1, short.prompt), attn(1, long_.prompt))
    decoded = (long_.t_join - short.t_join) / step_alone
    expect = long_.t_join + (short.gen - 1 - decoded) * step_both
    assert short.t_done == pytest.approx(expect, rel=1e-9)
    # Had the short one kept its own attention the schedule would differ measurably.
    own = long_.t_join + (short.gen - 1 - decoded) * (over + per_seq + attn(1, short.prompt))
    assert abs(own - expect) > 1e-3


def test_a_group_that_empties_forgets_its_slowest_rank():
    """A long context decodes on rank 0 and leaves, emptying the group; later a short context joins
    rank 1 alone: its steps cost its own attention, not the departed long context's."""
    m = replace(DS27_ONE_RANK, decode_ep_gpus=2)
    wl = _assemble(
        "one-after-the-other",
        [np.array([200]), np.array([200])],
        [np.array([3]), np.array([5])],
        np.array([0.0, 60.0]),  # the second agent arrives long after the first is done
        hits=[np.array([64 * 600]), np.array([0])],
    )
    cfg = SimConfig(num_prefill_nodes=1, num_decode_nodes=1, hw=HW2, model=m, mode="basic")
    long_, short = ClusterSim(cfg, wl, keep_requests=True).run().reqs
    assert long_.t_done < short.t_join and (long_.de, short.de) == (0, 1)
    step = m.decode_step_overhead_s + m.decode_s_per_seq / 2 + decode_attn_fn(m)(1, short.prompt)
    assert short.t_done - short.t_join == pytest.approx((short.gen - 1) * step, rel=1e-12)
