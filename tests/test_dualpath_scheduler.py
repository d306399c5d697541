"""Every branch of the DualPath scheduler with exact expectations, plus a hypothesis property test."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.dualpath.scheduler import (
    PATH_DE,
    PATH_PE,
    PATH_SPLIT,
    AdditiveBatchCost,
    DualPathScheduler,
    EngineLoad,
    PendingRequest,
    PrefillItem,
    SchedulerConfig,
    build_prefill_batch,
    policy_config,
    split_hit_tokens,
)
from tests.fuzz_helpers import fuzz_settings

PAGE = 16


def req(rid: int, hit: int = 0, new: int = 100, dec: int | None = None) -> PendingRequest:
    return PendingRequest(rid, hit, new, hit + new + 10 if dec is None else dec)


def make(
    cfg: SchedulerConfig,
    pe_nodes: list[int],
    de_nodes: list[int],
    de_groups: list[int] | None = None,
    free_pages: int = 10_000,
    num_nodes: int = 8,
) -> DualPathScheduler:
    pes = [EngineLoad(i, n) for i, n in enumerate(pe_nodes)]
    groups = de_groups if de_groups is not None else [0] * len(de_nodes)
    des = [
        EngineLoad(i, n, g, num_free_pages=free_pages)
        for i, (n, g) in enumerate(zip(de_nodes, groups, strict=True))
    ]
    return DualPathScheduler(cfg, pes, des, num_nodes)


def cfg(**kw) -> SchedulerConfig:
    base = dict(alpha_tokens=1000, beta_tokens=5000)
    base.update(kw)
    return SchedulerConfig(**base)


# ---------------- PE choice ----------------


def test_pe_min_tokens_ties_to_lowest_id():
    s = make(cfg(), pe_nodes=[0, 0, 1], de_nodes=[2])
    s.report_prefill(0, 1, 300)
    s.report_prefill(1, 1, 200)
    s.report_prefill(2, 1, 200)
    a = s.assign([req(7)])
    assert a[0].prefill_engine == 1  # 200 tokens on engines 1 and 2: lowest id wins


def test_pe_beta_filter_excludes_overloaded_engines():
    s = make(cfg(beta_tokens=250), pe_nodes=[0, 1], de_nodes=[2])
    s.report_prefill(0, 1, 251)  # > beta: never chosen even though node 0 ...
    s.report_prefill(1, 1, 250)  # == beta is allowed
    assert s.assign([req(1)])[0].prefill_engine == 1


def test_pe_all_over_beta_stops_the_fetch():
    s = make(cfg(beta_tokens=100), pe_nodes=[0], de_nodes=[1])
    s.report_prefill(0, 1, 101)
    assert s.assign([req(1), req(2)]) == []


def test_pe_fetch_stops_midway_when_beta_is_reached():
    # Each request adds 100 new tokens to the chosen PE; beta 150 lets each engine take exactly 2.
    s = make(cfg(beta_tokens=150), pe_nodes=[0, 1], de_nodes=[2])
    out = s.assign([req(i, new=100) for i in range(5)])
    assert [a.prefill_engine for a in out] == [0, 1, 0, 1]


def test_pe_prefers_node_with_read_queue_at_most_alpha():
    s = make(cfg(alpha_tokens=1000), pe_nodes=[0, 1], de_nodes=[2])
    s.report_prefill(0, 0, 0)
    s.report_prefill(1, 5, 900)  # more tokens, but its node's read queue is short
    s.report_read_queue(0, 1001)
    s.report_read_queue(1, 1000)
    assert s.assign([req(1)])[0].prefill_engine == 1


def test_pe_falls_back_to_long_queue_nodes_when_none_is_short():
    s = make(cfg(alpha_tokens=10), pe_nodes=[0, 1], de_nodes=[2])
    s.report_prefill(0, 0, 50)
    s.report_prefill(1, 0, 40)
    s.report_read_queue(0, 11)
    s.report_read_queue(1, 5000)
    assert s.assign([req(1)])[0].prefill_engine == 1  # both over alpha: min tokens


def test_pe_tokens_updated_between_assignments():
    s = make(cfg(), pe_nodes=[0, 0], de_nodes=[1])
    s.report_prefill(0, 0, 0)
    s.report_prefill(1, 0, 50)
    out = s.assign([req(1, new=100), req(2, new=10), req(3, new=10)])
    # e0: 0 -> 100; then e1 (50) -> 60; then e1 (60 < 100) -> 70
    assert [a.prefill_engine for a in out] == [0, 1, 1]
    assert s.prefill[0].num_tokens == 100 and s.prefill[1].num_tokens == 70
    assert s.prefill[1].num_seqs == 2


# ---------------- DE choice ----------------


def test_de_phase1_group_with_min_tokens_and_sums_grow():
    s = make(cfg(), pe_nodes=[0], de_nodes=[1, 1, 2, 2], de_groups=[0, 0, 1, 1])
    s.report_decode(0, 1, 500, 10_000)
    s.report_decode(1, 0, 0, 10_000)  # group 0: 500
    s.report_decode(2, 0, 300, 10_000)
    s.report_decode(3, 0, 0, 10_000)  # group 1: 300
    out = s.assign([req(1, new=100, dec=250), req(2, new=100, dec=10)])
    # r1 -> group 1 (300 < 500), group 1 becomes 550; r2 -> group 0 (500 < 550)
    assert [a.decode_engine for a in out] == [3, 1]


def test_de_low_engine_with_fewest_requests():
    s = make(cfg(), pe_nodes=[0], de_nodes=[1, 1, 1])
    s.report_decode(0, 5, 100, 10_000)
    s.report_decode(1, 2, 300, 10_000)
    s.report_decode(2, 3, 200, 10_000)
    # R = {r}, len 60: Z = 1.05 * (60 + 600) / 3 = 231. low: e0 (160), e2 (260>231 no) -> only e0?
    # e0: 100 + 60 = 160 <= 231 low; e1: 360 high; e2: 260 high. Low with fewest seqs = e0.
    assert s.assign([req(1, new=50, dec=60)])[0].decode_engine == 0


def test_de_low_engines_tie_on_seqs_breaks_on_tokens_then_id():
    s = make(cfg(), pe_nodes=[0], de_nodes=[1, 1, 1])
    s.report_decode(0, 2, 100, 10_000)
    s.report_decode(1, 2, 90, 10_000)
    s.report_decode(2, 2, 90, 10_000)
    # Z = 1.05 * (10 + 280) / 3 = 101.5; all are low (<= 110? e0: 110 > 101.5 high; e1/e2: 100 low)
    assert s.assign([req(1, new=5, dec=10)])[0].decode_engine == 1


def test_de_all_high_choose_min_tokens():
    s = make(cfg(z_factor=0.5), pe_nodes=[0], de_nodes=[1, 1])
    s.report_decode(0, 1, 100, 10_000)
    s.report_decode(1, 9, 80, 10_000)
    # Z = 0.5 * (20 + 180) / 2 = 50: both high -> min tokens = e1 despite 9 seqs
    assert s.assign([req(1, new=5, dec=20)])[0].decode_engine == 1


def test_de_free_pages_filter_and_z_uses_fitting_prefix():
    s = make(cfg(), pe_nodes=[0], de_nodes=[1, 1])
    s.report_decode(0, 0, 0, 3)  # 3 pages = 48 tokens
    s.report_decode(1, 9, 900, 100)
    # r needs ceil(60/16) = 4 pages: e0 lacks pages even though it is idle -> e1
    assert s.assign([req(1, new=10, dec=60)])[0].decode_engine == 1


def test_de_no_pages_anywhere_stops_fetch():
    s = make(cfg(), pe_nodes=[0], de_nodes=[1], free_pages=3)
    out = s.assign([req(1, new=10, dec=60)])
    assert out == []
    assert s.prefill[0].num_tokens == 0  # nothing committed for a request that was not placed


def test_de_pages_accounted_across_one_fetch():
    s = make(cfg(), pe_nodes=[0], de_nodes=[1], free_pages=8)
    out = s.assign([req(1, new=10, dec=64), req(2, new=10, dec=64), req(3, new=10, dec=64)])
    assert len(out) == 2  # 4 pages each
    assert s.decode[0].num_free_pages == 0


# ---------------- read path ----------------


def test_read_path_shorter_queue_and_tie_goes_to_pe():
    s = make(cfg(), pe_nodes=[0], de_nodes=[1])
    s.report_read_queue(0, 100)
    s.report_read_queue(1, 100)
    a = s.assign([req(1, hit=640)])[0]
    assert (a.read_path, a.num_pe_read_tokens, a.num_de_read_tokens) == (PATH_PE, 640, 0)
    assert s.read_queue_tokens == [740, 100, 0, 0, 0, 0, 0, 0]
    b = s.assign([req(2, hit=64)])[0]
    assert (b.read_path, b.num_de_read_tokens) == (PATH_DE, 64)
    assert s.read_queue_tokens[1] == 164


def test_read_path_zero_hit_is_pe_with_no_read():
    s = make(cfg(), pe_nodes=[0], de_nodes=[1])
    s.report_read_queue(0, 10**6)
    a = s.assign([req(1, hit=0)])[0]
    assert (a.read_path, a.num_pe_read_tokens, a.num_de_read_tokens) == (PATH_PE, 0, 0)


def test_read_path_alternate():
    s = make(cfg(read_path="alternate"), pe_nodes=[0], de_nodes=[1])
    paths = [a.read_path for a in s.assign([req(i, hit=64) for i in range(4)])]
    assert paths == [PATH_PE, PATH_DE, PATH_PE, PATH_DE]


def test_read_path_split_water_fills_in_blocks():
    s = make(cfg(read_path="split"), pe_nodes=[0], de_nodes=[1])
    s.report_read_queue(0, 640)
    s.report_read_queue(1, 0)
    a = s.assign([req(1, hit=1280)])[0]
    # level = (640 + 0 + 1280)/2 = 960: PE takes 320 (5 blocks), DE takes 960
    assert (a.read_path, a.num_pe_read_tokens, a.num_de_read_tokens) == (PATH_SPLIT, 320, 960)
    assert s.read_queue_tokens[:2] == [960, 960]


def test_split_degenerates_to_single_paths():
    assert split_hit_tokens(640, 0, 10_000, 64) == 640
    assert split_hit_tokens(640, 10_000, 0, 64) == 0
    assert split_hit_tokens(0, 0, 0, 64) == 0
    assert split_hit_tokens(128, 0, 0, 64) == 64
    # half a block rounds toward the PE side: ideal 32 tokens -> 1 block
    assert split_hit_tokens(128, 32, 0, 64) == 64
    s = make(cfg(read_path="split"), pe_nodes=[0], de_nodes=[1])
    s.report_read_queue(1, 10_000)
    assert s.assign([req(1, hit=640)])[0].read_path == PATH_PE
    s.report_read_queue(0, 20_000)
    assert s.assign([req(2, hit=640)])[0].read_path == PATH_DE


# ---------------- round robin (Basic) ----------------


def test_round_robin_cycles_and_reads_on_pe():
    c = policy_config("round_robin", alpha_tokens=1, beta_tokens=1)
    s = make(c, pe_nodes=[0, 1], de_nodes=[2, 2, 3])
    s.report_prefill(0, 0, 10**9)  # load is ignored by round robin
    out = s.assign([req(i, hit=64) for i in range(4)])
    assert [a.prefill_engine for a in out] == [0, 1, 0, 1]
    assert [a.decode_engine for a in out] == [0, 1, 2, 0]
    assert {a.read_path for a in out} == {PATH_PE}
    # the cursor survives across fetches
    assert s.assign([req(9)])[0].prefill_engine == 0


def test_round_robin_stops_when_next_de_lacks_pages():
    c = policy_config("round_robin", alpha_tokens=1, beta_tokens=1)
    s = make(c, pe_nodes=[0], de_nodes=[1, 1], free_pages=100)
    s.report_decode(1, 0, 0, 0)
    out = s.assign([req(1, new=10, dec=16), req(2, new=10, dec=16), req(3)])
    assert [a.decode_engine for a in out] == [0]


def test_policy_names_and_validation():
    assert policy_config("dualpath", alpha_tokens=1, beta_tokens=2).read_path == "shorter_queue"
    assert policy_config("split", alpha_tokens=1, beta_tokens=2).read_path == "split"
    assert policy_config("round_robin_dual", alpha_tokens=1, beta_tokens=2).read_path == "alternate"
    with pytest.raises(ValueError, match="unknown policy"):
        policy_config("nope", alpha_tokens=1, beta_tokens=2)
    with pytest.raises(ValueError):
        SchedulerConfig(alpha_tokens=1, beta_tokens=1, read_path="x")
    with pytest.raises(ValueError):
        SchedulerConfig(alpha_tokens=1, beta_tokens=1, engine_choice="x")
    with pytest.raises(ValueError):
        SchedulerConfig(alpha_tokens=-1, beta_tokens=1)
    with pytest.raises(ValueError):
        DualPathScheduler(cfg(), [EngineLoad(1, 0)], [EngineLoad(0, 1)], 2)
    assert make(cfg(), [0], [1]).assign([]) == []


# ---------------- batch building ----------------


def linear_cost(pairs):
    # 10 ms fixed + 1 ms per new token + 0.001 ms per cached token
    return 0.010 + sum(n * 1e-3 + c * 1e-6 for c, n in pairs)


def test_batch_fills_fifo_then_chunks_last_by_binary_search():
    w = [PrefillItem(1, 0, 100), PrefillItem(2, 0, 100), PrefillItem(3, 1000, 200)]
    plan = build_prefill_batch(w, linear_cost, quota_s=0.300, page_tokens=PAGE)
    assert [i.request_id for i in plan.items] == [1, 2]
    # left 0.300 - 0.210 - 0.001 (cached) = 0.089 s -> 89 tokens -> 5 pages = 80 tokens
    assert plan.chunk == PrefillItem(3, 1000, 80)
    assert plan.predicted_s == pytest.approx(0.010 + 0.280 + 0.001)


def test_batch_all_fit_no_chunk():
    w = [PrefillItem(1, 0, 50), PrefillItem(2, 0, 50)]
    plan = build_prefill_batch(w, linear_cost, quota_s=0.3)
    assert len(plan.items) == 2 and plan.chunk is None
    assert plan.predicted_s == pytest.approx(0.110)


def test_batch_head_over_quota_is_chunked():
    plan = build_prefill_batch([PrefillItem(1, 0, 1000)], linear_cost, quota_s=0.3, page_tokens=PAGE)
    assert plan.items == () and plan.chunk == PrefillItem(1, 0, 288)  # 290 tokens -> 18 pages


def test_batch_next_does_not_fit_even_one_page():
    w = [PrefillItem(1, 0, 280), PrefillItem(2, 0, 100)]
    plan = build_prefill_batch(w, linear_cost, quota_s=0.3, page_tokens=PAGE)
    assert [i.request_id for i in plan.items] == [1] and plan.chunk is None


def test_batch_progress_when_one_page_exceeds_quota():
    plan = build_prefill_batch([PrefillItem(1, 0, 1000)], linear_cost, quota_s=0.001, page_tokens=PAGE)
    assert plan.chunk == PrefillItem(1, 0, 16)
    plan = build_prefill_batch([PrefillItem(1, 0, 10)], linear_cost, quota_s=0.001, page_tokens=PAGE)
    assert plan.items == (PrefillItem(1, 0, 10),) and plan.chunk is None
    assert build_prefill_batch([], linear_cost, 0.3).items == ()


# ---------------- property test ----------------


@fuzz_settings(150)
@given(
    data=st.data(),
    policy=st.sampled_from(["round_robin", "round_robin_dual", "dualpath", "split"]),
    num_pe=st.integers(1, 4),
    num_de=st.integers(1, 5),
)
def test_property_never_exceeds_free_pages_and_assigns_once(data, policy, num_pe, num_de):
    c = policy_config(policy, alpha_tokens=data.draw(st.integers(0, 5000)), beta_tokens=10**9)
    pes = [EngineLoad(i, i % 2) for i in range(num_pe)]
    free = [data.draw(st.integers(0, 40)) for _ in range(num_de)]
    des = [EngineLoad(i, 2 + i % 3, i % 2, num_free_pages=f) for i, f in enumerate(free)]
    s = DualPathScheduler(c, pes, des, num_nodes=5)
    for n in range(5):
        s.report_read_queue(n, data.draw(st.integers(0, 3000)))
    queue = [
        PendingRequest(
            rid,
            data.draw(st.integers(0, 20)) * 64,
            data.draw(st.integers(1, 300)),
            data.draw(st.integers(1, 400)),
        )
        for rid in range(data.draw(st.integers(0, 30)))
    ]
    assigned: dict[int, object] = {}
    used = [0] * num_de
    pending = list(queue)
    for _ in range(4):  # several fetches; between them nothing finishes
        out = s.assign(pending)
        assert [a.request_id for a in out] == [r.request_id for r in pending[: len(out)]]  # FIFO prefix
        for a, r in zip(out, pending, strict=False):
            assert a.request_id not in assigned
            assigned[a.request_id] = a
            used[a.decode_engine] += r.num_decode_pages(16)
            assert a.num_pe_read_tokens + a.num_de_read_tokens == r.num_hit_tokens
        pending = pending[len(out) :]
    for i in range(num_de):
        assert used[i] <= free[i]
        assert s.decode[i].num_free_pages == free[i] - used[i] >= 0


def test_scheduler_does_not_import_torch():
    code = (
        "import sys; import pdserve.dualpath.scheduler, pdserve.sim, pdserve.sim.cluster, pdserve.sim.cli, "
        "pdserve.sim.scenarios, pdserve.bench.workloads; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@fuzz_settings(200)
@given(
    toks=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    queues=st.lists(st.integers(0, 2000), min_size=4, max_size=4),
    updates=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 300)), max_size=10),
)
def test_property_pe_choice_equals_brute_force_scan(toks, queues, updates):
    """The heap-based PE choice equals a plain scan with key (read_q > α, tok_e, id), tok_e ≤ β."""
    c = cfg(alpha_tokens=1000, beta_tokens=200)
    s = make(c, pe_nodes=[i % 4 for i in range(len(toks))], de_nodes=[5], num_nodes=6)
    for i, t in enumerate(toks):
        s.report_prefill(i, 0, t)
    for n, q in enumerate(queues):
        s.report_read_queue(n, q)
    for eid, t in updates:
        if eid < len(toks):
            s.report_prefill(eid, 0, t)
    ok = [e for e in s.prefill if e.num_tokens <= 200]
    expect = min(
        ok, key=lambda e: (s.read_queue_tokens[e.node_id] > 1000, e.num_tokens, e.engine_id), default=None
    )
    got = s._choose_prefill()
    assert (got.engine_id if got else None) == (expect.engine_id if expect else None)
    assert s._choose_prefill() is got  # a query leaves the heap as it was


@fuzz_settings(300)
@given(
    items=st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 3000)), min_size=1, max_size=6),
    quota=st.integers(1, 20_000),
    overhead=st.integers(0, 50),
    quad=st.integers(0, 3),
)
def test_property_additive_gallop_equals_plain_binary_search(items, quota, overhead, quad):
    """The additive fast path (linear estimate + gallop) picks the same plan as the generic binary search.

    Integer-valued costs so both paths' float sums are exact; ``quad`` makes the per-token cost grow with
    the chunk (like attention), so the linear estimate is off and the gallop has to walk.
    """

    def item(c: int, n: int) -> float:
        return float(n * (1 + c // 1000) + quad * n * n // 64)

    waiting = [PrefillItem(i, c, n) for i, (c, n) in enumerate(items)]
    fast = build_prefill_batch(waiting, AdditiveBatchCost(float(overhead), item), float(quota), PAGE)
    plain = build_prefill_batch(
        waiting, lambda pairs: float(overhead) + sum(item(c, n) for c, n in pairs), float(quota), PAGE
    )
    assert fast == plain
    lazy = build_prefill_batch(iter(waiting), AdditiveBatchCost(float(overhead), item), float(quota), PAGE)
    assert lazy == fast
