"""Every branch of the DualPath scheduler with exact expectations, plus a hypothesis property test."""

from __future__ import annotations

import heapq
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
    Assignment,
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


def test_de_a_dead_engine_counts_neither_in_its_groups_sum_nor_in_z():
    """The router reports a dead decode `alive` False with whatever load: phase 1 and Z see only the
    live engines (a dead engine's fake huge load once sank its node-mates' group and made them all
    "low"); a group with no live engine sinks below every other; a revived engine counts again."""
    s = make(cfg(), pe_nodes=[0], de_nodes=[1, 1, 1, 2], de_groups=[0, 0, 0, 1])
    s.report_decode(0, 1, 2000, 10_000)
    s.report_decode(1, 2, 100, 10_000)
    s.report_decode(2, 0, 10**12, 0, alive=False)
    s.report_decode(3, 0, 2500, 10_000)
    # Phase 1: group 0 = 2100 (live only) < group 1 = 2500. Z = 1.05 * (56 + 2100) / 2 = 1131.9:
    # e0 (2056) high, e1 (156) low -> e1 (counting the dead one, every engine was low: e0, 1 request)
    assert s.assign([req(1, new=16, dec=56)])[0].decode_engine == 1
    s.report_decode(0, 0, 0, 10_000, alive=False)
    s.report_decode(1, 0, 0, 10_000, alive=False)  # group 0 all dead (0 tokens): sinks
    assert s.assign([req(2, new=16, dec=56)])[0].decode_engine == 3
    s.report_decode(1, 0, 0, 10_000)  # back: group 0 = 0 tokens again, the least loaded
    assert s.assign([req(3, new=16, dec=56)])[0].decode_engine == 1
    s.report_decode(1, 0, 0, 10_000, alive=False)
    s.report_decode(3, 0, 0, 10_000, alive=False)
    assert s.assign([req(4, new=16, dec=56)]) == []  # no live decode: the fetch stops


def test_de_phase1_skips_groups_whose_pools_could_never_hold_the_request():
    """Decodes of unequal pools (`num_total_pages` reported): the least-loaded group whose engines
    could ever hold the request, with this fetch's tentative sums; others go by plain phase 1."""
    s = make(cfg(), pe_nodes=[0], de_nodes=[1, 2, 3], de_groups=[0, 1, 2])
    s.report_decode(0, 0, 0, 10, num_total_pages=10)  # small, idle
    s.report_decode(1, 1, 700, 80, num_total_pages=100)
    s.report_decode(2, 1, 500, 80, num_total_pages=100)
    big, small = req(1, new=16, dec=320), req(2, new=16, dec=32)  # 20 pages; 2 pages
    out = s.assign([big, req(3, new=16, dec=320), small])
    # big -> group 2 (500 < 700; group 0 can never hold 20 pages); the next big -> group 1 (700 < 820);
    # the small one -> group 0 (0 tokens)
    assert [a.decode_engine for a in out] == [2, 1, 0]
    out = s.assign([req(4, new=16, dec=16 * 101)])  # 101 pages: no engine could ever hold it
    assert out == []


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


@pytest.mark.parametrize(
    ("read_path", "pe_queue", "expected"),
    [
        ("shorter_queue", 1_000, (PATH_PE, 640, 0)),  # DE with all four reads: 2,560 > 1,640
        ("shorter_queue", 10_000, (PATH_DE, 0, 640)),  # 2,560 < 10,640: the idle decode side
        ("alternate", 10_000, (PATH_PE, 640, 0)),
        ("split", 10_000, (PATH_PE, 640, 0)),
    ],
)
def test_the_n_choices_of_one_prompt_weigh_one_joined_pe_read_against_n_de_reads(
    read_path, pe_queue, expected
):
    """A request whose prompt feeds several decodes (the `n` choices of one prompt, each to a decode of
    its own): on the DE path each of those decodes reads the stored hit itself, up to n reads over the
    storage NICs; on the PE path the choices share one prefill, whose reads of the same blocks join:
    one read. Under the shorter-queue rule it takes the DE path only where that side's queue with all
    n reads is still the shorter (counted once there, on the first choice's decode node); under the
    ablation's alternation and split, the PE path. A request of one choice is placed as before: the
    DE side, its queue being shorter (alternate: its first request with a hit reads on the PE side)."""
    s = make(cfg(read_path=read_path), pe_nodes=[0], de_nodes=[1])
    s.report_read_queue(0, pe_queue)
    a = s.assign([PendingRequest(1, 640, 100, 750, num_choices=4)])[0]
    assert (a.read_path, a.num_pe_read_tokens, a.num_de_read_tokens) == expected
    pe_read, de_read = expected[1:]
    assert s.read_queue_tokens[:2] == [pe_queue + pe_read, de_read]
    assert s.read_tokens_total[:2] == [pe_read, de_read]
    s.report_read_queue(1, 0)
    b = s.assign([req(2, hit=640)])[0]
    one = (PATH_PE, 640, 0) if read_path == "alternate" else (PATH_DE, 0, 640)
    assert (b.read_path, b.num_pe_read_tokens, b.num_de_read_tokens) == one
    assert req(3) == PendingRequest(3, 0, 100, 110, num_choices=1)  # (one choice: the default)


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


def test_round_robin_skips_dead_engines_and_stops_only_when_none_is_alive():
    """A dead decode reports no free pages: round robin waited on it at its turn, and the router's
    queue never moved again (found by a probe). Dead engines are skipped; the cursor goes on past them."""
    c = policy_config("round_robin", alpha_tokens=1, beta_tokens=1)
    s = make(c, pe_nodes=[0, 1], de_nodes=[2, 2, 3], free_pages=100)
    s.report_decode(0, 0, 1 << 40, 0, alive=False)
    s.report_prefill(1, 0, 2, alive=False)
    out = s.assign([req(i, new=10, dec=16) for i in range(4)])
    assert [a.decode_engine for a in out] == [1, 2, 1, 2]
    assert [a.prefill_engine for a in out] == [0, 0, 0, 0]
    s.report_decode(0, 0, 0, 100)  # back
    assert [a.decode_engine for a in s.assign([req(i, new=10, dec=16) for i in range(3)])] == [0, 1, 2]
    for i in range(3):
        s.report_decode(i, 0, 1 << 40, 0, alive=False)
    assert s.assign([req(9)]) == []


def test_round_robin_passes_over_a_decode_whose_pool_could_never_hold_the_request():
    """Decodes of unequal pools (1,000 and 100 pages): at the small one's turn a 200-page request
    stopped the fetch and never moved the cursor, so it and everything behind it waited to the
    router's queue timeout (a review, 2026-12-05). The small decode loses that turn; small requests
    still go round."""
    c = policy_config("round_robin", alpha_tokens=1, beta_tokens=1)
    s = make(c, pe_nodes=[0], de_nodes=[1, 2], free_pages=0)
    s.report_decode(0, 0, 0, 1000, num_total_pages=1000)
    s.report_decode(1, 0, 0, 100, num_total_pages=100)
    small, big = (lambda i: req(i, new=10, dec=16)), (lambda i: req(i, new=10, dec=200 * PAGE))
    out = s.assign([small(0), big(1), small(2), big(3), small(4)])
    assert [a.decode_engine for a in out] == [0, 0, 1, 0, 1]
    s.report_decode(0, 0, 0, 1000, alive=False)  # the only decode that could hold a big one: it waits
    assert s.assign([big(5), small(6)]) == []


def test_a_dead_prefill_is_never_chosen_by_load_whatever_tokens_it_reported():
    """Only the router's β+1 workaround kept a dead prefill out of the load-aware choice; reported dead
    with 0 tokens, the PE choice named it (a review, 2026-12-05)."""
    s = make(cfg(), pe_nodes=[0, 1], de_nodes=[2])
    s.report_prefill(1, 0, 400)
    s.report_prefill(0, 0, 0, alive=False)
    assert [a.prefill_engine for a in s.assign([req(i) for i in range(2)])] == [1, 1]
    s.report_prefill(0, 0, 0)  # back: the least loaded again
    assert s.assign([req(9)])[0].prefill_engine == 0
    dead_at_start = [EngineLoad(0, 0, alive=False), EngineLoad(1, 1)]
    s = DualPathScheduler(cfg(), dead_at_start, [EngineLoad(0, 2, num_free_pages=100)], 3)
    assert s.assign([req(1, dec=16)])[0].prefill_engine == 1


def test_ids_outside_the_cluster_are_refused_before_anything_changes():
    """A node id past the last node failed `assign` halfway (an IndexError after the cursors and loads
    had moved); a negative engine or node id in a report silently named the last one."""
    with pytest.raises(ValueError, match="node ids"):
        DualPathScheduler(cfg(), [EngineLoad(0, 0)], [EngineLoad(0, 3)], num_nodes=3)
    s = make(cfg(), pe_nodes=[0], de_nodes=[1], num_nodes=2)
    before = (repr(s.prefill), repr(s.decode), list(s.read_queue_tokens))
    for call in (
        lambda: s.report_prefill(-1, 0, 777),
        lambda: s.report_prefill(1, 0, 777),
        lambda: s.report_decode(-1, 0, 0, 5),
        lambda: s.report_read_queue(-1, 999),
        lambda: s.report_read_queue(2, 999),
    ):
        with pytest.raises(ValueError, match="id"):
            call()
    assert (repr(s.prefill), repr(s.decode), list(s.read_queue_tokens)) == before


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
    with pytest.raises(ValueError, match="block_tokens and page_tokens must be > 0"):
        SchedulerConfig(alpha_tokens=1, beta_tokens=1, page_tokens=0)
    with pytest.raises(ValueError, match="at least one prefill and one decode"):
        DualPathScheduler(cfg(), [], [EngineLoad(0, 1)], 2)
    with pytest.raises(ValueError, match="decode engine ids must be 0..n-1"):
        DualPathScheduler(cfg(), [EngineLoad(0, 0)], [EngineLoad(1, 1)], 2)
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


class CountingCost(AdditiveBatchCost):
    """An additive cost that counts its item-cost evaluations."""

    def __init__(self, overhead_s, item_cost_s):
        self.calls = 0

        def counted(cached, new):
            self.calls += 1
            return item_cost_s(cached, new)

        super().__init__(overhead_s, counted)


def test_additive_batch_chunks_from_its_linear_estimate_and_gallops_up():
    """The builder's additive path (the one the simulator and the engines run): the chunk's page count
    is estimated from the item's cost per token, confirmed, and one step up refuses it."""
    cost = CountingCost(1.0, lambda cached, new: 0.01 * new)
    w = [PrefillItem(1, 0, 50), PrefillItem(2, 0, 100)]
    plan = build_prefill_batch(w, cost, quota_s=2.0, page_tokens=PAGE)
    # 2.0 - 1.0 - 0.5 = 0.5 s left -> 50 tokens -> 3 pages (estimate 3.125): 3 fits, 4 does not
    assert plan == (
        (PrefillItem(1, 0, 50),), PrefillItem(2, 0, 48), pytest.approx(1.0 + 0.5 + 0.48)
    )  # fmt: skip
    assert cost.calls == 2 + 2 + 1  # (the two items once each, pages 3 and 4, the plan's cost)
    assert (
        build_prefill_batch(w, lambda pairs: AdditiveBatchCost(1.0, cost.item_cost_s)(pairs), 2.0, PAGE)
        == plan
    )


def test_additive_batch_gallops_down_when_the_estimate_overshoots():
    """A concave item cost (0.1 s x sqrt(new)): the linear estimate from the whole item, 22 pages, is far
    too many. The gallop goes down by doubling steps (20, 17, 12 do not fit; 3 does) and the binary
    search between 3 and 11 finds 5 pages (80 tokens: 0.894 s; 96 would be 0.980 s, past 0.9)."""
    cost = AdditiveBatchCost(0.1, lambda cached, new: 0.1 * new**0.5)
    plan = build_prefill_batch([PrefillItem(7, 0, 1600)], cost, quota_s=1.0, page_tokens=PAGE)
    assert plan == ((), PrefillItem(7, 0, 80), pytest.approx(0.1 + 0.1 * 80**0.5))
    asked = []

    def fits_logged(cached, num_pages):
        asked.append(num_pages)
        return 0.1 + 0.1 * (num_pages * PAGE) ** 0.5 <= 1.0

    from pdserve.dualpath.scheduler import _gallop_bracket

    assert _gallop_bracket(fits_logged, 0, 22.5, 99) == (3, 11)
    assert asked == [22, 20, 17, 12, 3]
    # the plain callable (binary search over all 99 pages) gives the same plan
    assert build_prefill_batch([PrefillItem(7, 0, 1600)], lambda pairs: cost(pairs), 1.0, PAGE) == plan


# ---------------- property test ----------------


# A fetch's inputs for the property tests: a policy, 1-4 PEs and 1-5 DEs (the rest drawn in the test).
_CLUSTER_DRAWS = given(
    data=st.data(),
    policy=st.sampled_from(["round_robin", "round_robin_dual", "dualpath", "split"]),
    num_pe=st.integers(1, 4),
    num_de=st.integers(1, 5),
)


def _draw_queue(data, min_new_tokens: int) -> list[PendingRequest]:
    """Up to 30 requests: hits of 0-20 blocks of 64 tokens, new and decode tokens drawn."""
    return [
        PendingRequest(
            rid,
            data.draw(st.integers(0, 20)) * 64,
            data.draw(st.integers(min_new_tokens, 300)),
            data.draw(st.integers(1, 400)),
        )
        for rid in range(data.draw(st.integers(0, 30)))
    ]


@fuzz_settings(150)
@_CLUSTER_DRAWS
def test_property_never_exceeds_free_pages_and_assigns_once(data, policy, num_pe, num_de):
    c = policy_config(policy, alpha_tokens=data.draw(st.integers(0, 5000)), beta_tokens=10**9)
    pes = [EngineLoad(i, i % 2) for i in range(num_pe)]
    free = [data.draw(st.integers(0, 40)) for _ in range(num_de)]
    des = [EngineLoad(i, 2 + i % 3, i % 2, num_free_pages=f) for i, f in enumerate(free)]
    s = DualPathScheduler(c, pes, des, num_nodes=5)
    for n in range(5):
        s.report_read_queue(n, data.draw(st.integers(0, 3000)))
    queue = _draw_queue(data, min_new_tokens=1)
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


@fuzz_settings(150)
@_CLUSTER_DRAWS
def test_property_dead_or_too_small_decodes_never_get_a_request(data, policy, num_pe, num_de):
    c = policy_config(policy, alpha_tokens=data.draw(st.integers(0, 5000)), beta_tokens=10**9)
    s = DualPathScheduler(
        c,
        [EngineLoad(i, i % 2) for i in range(num_pe)],
        [EngineLoad(i, 2 + i % 3, i % 2) for i in range(num_de)],
        num_nodes=5,
    )
    alive = [data.draw(st.booleans()) for _ in range(num_de)]
    total = [data.draw(st.integers(1, 40)) for _ in range(num_de)]
    free = [data.draw(st.integers(0, t)) for t in total]
    for i in range(num_de):
        s.report_decode(i, 0, data.draw(st.integers(0, 10**6)), free[i], alive[i], total[i])
    queue = _draw_queue(data, min_new_tokens=1)
    out = s.assign(queue)
    assert [a.request_id for a in out] == [r.request_id for r in queue[: len(out)]]
    used = [0] * num_de
    for a, r in zip(out, queue, strict=False):
        assert alive[a.decode_engine]
        used[a.decode_engine] += r.num_decode_pages(16)
    assert all(used[i] <= free[i] for i in range(num_de))


def test_scheduler_does_not_import_torch():
    code = (
        "import sys; import pdserve.dualpath.scheduler, pdserve.sim, pdserve.sim.cluster, pdserve.sim.cli, "
        "pdserve.sim.scenarios, pdserve.bench.workloads, pdserve.router.routes, pdserve.router.control; "
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


# ---------------- audit follow-ups: exact expectations for the remaining branches ----------------


def plain_pe_scan(s: DualPathScheduler) -> EngineLoad | None:
    """Algorithm 1's PE choice as a plain scan: min (read_q(node) > α, tok_e, id) over tok_e ≤ β."""
    alpha, beta = s.config.alpha_tokens, s.config.beta_tokens
    ok = [e for e in s.prefill if e.num_tokens <= beta]
    return min(
        ok, key=lambda e: (s.read_queue_tokens[e.node_id] > alpha, e.num_tokens, e.engine_id), default=None
    )


def test_de_phase1_heap_follows_the_min_group_across_and_between_fetches():
    # 8 groups, one DE each, engine i in group 7 - i (so engine ids and group ids disagree). Groups 0
    # and 1 are light, groups 2..7 carry 1000 tokens and never win.
    s = make(cfg(), pe_nodes=[0], de_nodes=[1] * 8, de_groups=[7 - i for i in range(8)])
    for e in range(8):
        s.report_decode(e, 0, 1000, 10_000)
    s.report_decode(7, 0, 100, 10_000)  # group 0: 100
    s.report_decode(6, 0, 40, 10_000)  # group 1: 40
    out = s.assign([req(i, dec=d) for i, d in enumerate([50, 30, 15, 25, 10])])
    # r0 (50): g1 40 -> 90;  r1 (30): g1 90 < g0 100 -> 120;  r2 (15): g0 100 < 120 -> 115;
    # r3 (25): g0 115 < g1 120 -> 140;  r4 (10): g1 120 < g0 140 -> 130.
    assert [7 - a.decode_engine for a in out] == [1, 1, 0, 0, 1]
    assert [a.decode_engine for a in out] == [6, 6, 7, 7, 6]
    assert s.decode[7].num_tokens == 140 and s.decode[6].num_tokens == 130
    # Second fetch: only groups 0 and 1 changed (4 x 2 dirty <= 8 groups), so the heap is updated
    # incrementally and still holds the stale entries (40, g1) and (100, g0) of the first fetch.
    s.report_decode(7, 2, 60, 10_000)  # group 0's DE finished work: 140 -> 60
    assert s._group_dirty == {0, 1}
    out = s.assign([req(10, dec=5), req(11, dec=80), req(12, dec=1)])
    # r10 (5): g0 60 < g1 130 -> 65;  r11 (80): g0 65 -> 145;  r12 (1): g1 130 < g0 145 -> 131.
    # (The stale (40, g1) would send r10 to g1; the stale (140, g0) from the first fetch equals g0's
    # tentative sum after r11, which is exactly when it is correct again.)
    assert [a.decode_engine for a in out] == [7, 7, 6]
    assert [s.decode[7].num_tokens, s.decode[6].num_tokens] == [145, 131]
    # Third fetch stops: r20 goes to g1 (131 < 145), whose DE has no pages; nothing is committed, so
    # g1 is not dirty and its tentative entry (136, g1) is stale. Its real sum must be back in the heap:
    # once the pages return (same tokens, still not dirty) the next request goes to g1, not g0. Three
    # more dirty groups (5 of 8) make that fetch rebuild the heap first: one entry per group, no
    # leftover duplicate of (131, g1) to hide a missing re-insert.
    for e in (0, 1, 2):
        s.report_decode(e, 0, 999, 10_000)  # groups 7, 6, 5: still far above g0 and g1
    s.report_decode(6, 3, 131, 0)
    assert s.assign([req(20, dec=5)]) == []
    s.report_decode(6, 3, 131, 10_000)
    assert not s._group_dirty
    assert [a.decode_engine for a in s.assign([req(21, dec=5)])] == [6]


def test_pe_heap_compaction_keeps_choices_equal_to_a_plain_scan(monkeypatch):
    # The PE heap is compacted when it holds more than 4 x nodes + 64 entries (72 for 2 nodes). A
    # report that lowers an engine below its node's best pushes a fresh entry, so 300 falling reports
    # push ~300 entries; the old ones sit below the live bests, so queries pop few of them away.
    s = make(cfg(alpha_tokens=100, beta_tokens=250), pe_nodes=[0, 0, 1, 1], de_nodes=[2], num_nodes=3)
    s.report_read_queue(1, 500)  # node 1 is over α: its engines only win when node 0 has none under β
    compactions = []
    heapify = heapq.heapify

    def counting_heapify(x):
        if x is s._pe_heap:
            compactions.append(len(x))
        heapify(x)

    monkeypatch.setattr(heapq, "heapify", counting_heapify)
    for k in range(300):
        s.report_prefill(k % 4, 0, 400 - k)
        if k % 7 == 3:
            s.report_prefill((k + 1) % 4, 0, 350)  # a rise: rescans the node when it hits the best
        assert len(s._pe_heap) <= 4 * 2 + 64
        want = plain_pe_scan(s)
        assert s._choose_prefill() is want
    assert len(compactions) >= 3
    assert all(n == 2 for n in compactions)  # rebuilt from the two nodes' live bests
    s.report_prefill(0, 0, 300)  # > β
    s.report_prefill(1, 0, 120)
    s.report_prefill(2, 0, 100)
    s.report_prefill(3, 0, 240)
    out = s.assign([req(i, new=100) for i in range(6)])
    # r0: node 0 (short queue) has e1 120 -> 220; r1: e1 220 <= β -> 320; r2: node 0 has none under β,
    # fall back to node 1: e2 100 -> 200; r3: e2 200 < e3 240 -> 300; r4: e3 240 -> 340; r5: none.
    assert [a.prefill_engine for a in out] == [1, 1, 2, 2, 3]
    assert plain_pe_scan(s) is None and s._choose_prefill() is None


def _one_read(s: DualPathScheduler, rid: int, hit: int, queues: tuple[int, int]) -> Assignment:
    """Report the PE node's (0) and DE node's (1) read queues, then place one request."""
    for node, tokens in enumerate(queues):
        s.report_read_queue(node, tokens)
    return s.assign([req(rid, hit=hit)])[0]


def test_read_path_equal_queues_prefers_side_that_read_less_so_far():
    # PE on node 0, DE on node 1. First request: equal queues and totals -> PE reads 640.
    s = make(cfg(), pe_nodes=[0], de_nodes=[1])
    a = s.assign([req(1, hit=640)])[0]
    assert (a.read_path, a.num_pe_read_tokens) == (PATH_PE, 640)
    assert s.read_tokens_total[:2] == [640, 0]
    b = _one_read(s, 2, 64, queues=(100, 100))  # queues equal again; totals 640 (PE) vs 0 (DE)
    assert (b.read_path, b.num_pe_read_tokens, b.num_de_read_tokens) == (PATH_DE, 0, 64)
    assert s.read_tokens_total[:2] == [640, 64]
    # Mirror: the DE node has read more so far (640 vs 0, then 640 vs 64) -> the PE side. Together with
    # the case above this fails if the totals were ignored (on either side) or compared the wrong way.
    t = make(cfg(), pe_nodes=[0], de_nodes=[1])
    c = _one_read(t, 1, 640, queues=(1000, 0))  # force the first read onto the DE node
    assert (c.read_path, c.num_de_read_tokens) == (PATH_DE, 640)
    assert t.read_tokens_total[:2] == [0, 640]
    d = _one_read(t, 2, 64, queues=(100, 100))
    assert (d.read_path, d.num_pe_read_tokens, d.num_de_read_tokens) == (PATH_PE, 64, 0)
    e = _one_read(t, 3, 64, queues=(100, 100))  # totals 64 (PE) vs 640 (DE), both non-zero
    assert (e.read_path, e.num_pe_read_tokens) == (PATH_PE, 64)
    assert t.read_tokens_total[:2] == [128, 640]
    # Unequal queues still dominate: the PE node has read less but its queue is longer.
    f = _one_read(t, 4, 64, queues=(101, 100))
    assert (f.read_path, f.num_de_read_tokens) == (PATH_DE, 64)


def test_de_high_engines_tied_on_tokens_take_fewer_requests_then_lowest_id():
    s = make(cfg(z_factor=0.5), pe_nodes=[0], de_nodes=[1, 1, 1, 1])
    s.report_decode(0, 5, 100, 10_000)
    s.report_decode(1, 3, 100, 10_000)
    s.report_decode(2, 3, 100, 10_000)
    s.report_decode(3, 1, 101, 10_000)
    # Z = 0.5 x (20 + 401) / 4 = 52.6: all high (>= 120). Min (tok, seq, id): e1 and e2 have 100
    # tokens and 3 seqs -> e1 (e0 has 5 seqs; e3 has the fewest seqs but 101 tokens).
    assert s.assign([req(1, new=5, dec=20)])[0].decode_engine == 1


def test_de_phase1_tie_between_groups_goes_to_lowest_group_id():
    # Engine i is in group 2 - i, every group at 200 tokens: ties go to the lowest *group* id.
    s = make(cfg(), pe_nodes=[0], de_nodes=[1, 1, 1], de_groups=[2, 1, 0])
    for e in range(3):
        s.report_decode(e, 0, 200, 10_000)
    out = s.assign([req(i, dec=10) for i in range(4)])
    # r0: g0 (200,200,200) -> 210; r1: g1 (200,200) -> 210; r2: g2 200 -> 210; r3: all 210 -> g0.
    assert [a.decode_engine for a in out] == [2, 1, 0, 2]


def test_de_z_uses_requests_that_fit_group_pages_when_several_fit():
    # One group of 3 DEs with 12 + 12 + 11 = 35 free pages; tokens 225 / 200 / 175 (sum 600);
    # seqs 0 / 1 / 2. Queue pages: 10, 10, 10, 8, 2 (tokens 160, 160, 160, 128, 32).
    s = make(cfg(), pe_nodes=[0], de_nodes=[1, 1, 1])
    s.report_decode(0, 0, 225, 12)
    s.report_decode(1, 1, 200, 12)
    s.report_decode(2, 2, 175, 11)
    queue = [req(i, new=100, dec=d) for i, d in enumerate([160, 160, 160, 128, 32])]
    # R = the first three (30 pages); the 4th needs 8 of the 5 left, so R stops there (the 5th
    # would fit but comes after). Z = 1.05 x (480 + 600) / 3 = 378.
    # r0 (160): e0 385 > 378 high; e1 360 low; e2 335 low -> low with fewest seqs: e1.
    # r1 (160): e1 has 2 pages left; e0 385 high; e2 335 low -> e2.
    # r2 (160): only e0 has 10 pages (12) -> e0 (high, the only candidate).
    # r3 (8 pages): e0 2, e1 2, e2 1 -> no DE has the pages: the fetch stops.
    out = s.assign(queue)
    assert [a.decode_engine for a in out] == [1, 2, 0]
    assert [e.num_free_pages for e in s.decode] == [2, 2, 1]
    # What other thresholds would have chosen for r0 (the test fails if Z is computed differently):
    engines = [
        EngineLoad(0, 1, 0, 0, 225, 12),
        EngineLoad(1, 1, 0, 1, 200, 12),
        EngineLoad(2, 1, 0, 2, 175, 11),
    ]
    choose = DualPathScheduler._choose_decode
    assert choose(queue[0], 10, engines, 1.05 * (480 + 600) / 3).engine_id == 1  # R = first 3
    assert choose(queue[0], 10, engines, 1.05 * (512 + 600) / 3).engine_id == 0  # R skipping r3
    assert choose(queue[0], 10, engines, 1.05 * (640 + 600) / 3).engine_id == 0  # R = whole queue
    assert choose(queue[0], 10, engines, 1.05 * (320 + 600) / 3).engine_id == 2  # R = first 2
    assert choose(queue[0], 10, engines, 1.05 * (160 + 600) / 3).engine_id == 2  # R = {r0}


def test_prefill_room_cut_with_beta_binding_places_what_algorithm_1_places(monkeypatch):
    # β = 250, two PEs at 50 tokens, every request 100 new tokens: each PE takes 3 (50 -> 150 -> 250
    # -> 350) and then the fetch stops, so Algorithm 1 places exactly 6 of the 8. The room bound is
    # (200 + 200) // 100 + 2 = 6, so the cut binds and is tight.
    def build() -> DualPathScheduler:
        s = make(cfg(beta_tokens=250), pe_nodes=[0, 1], de_nodes=[2])
        s.report_prefill(0, 0, 50)
        s.report_prefill(1, 0, 50)
        return s

    queue = [req(i, new=100) for i in range(8)]
    s = build()
    assert s._prefill_room(queue) == 6
    out = s.assign(queue)
    assert [a.request_id for a in out] == [0, 1, 2, 3, 4, 5]
    assert [a.prefill_engine for a in out] == [0, 1, 0, 1, 0, 1]
    assert [e.num_tokens for e in s.prefill] == [350, 350]
    uncut = build()
    monkeypatch.setattr(uncut, "_prefill_room", lambda q: len(q))
    assert uncut.assign(queue) == out


def test_prefill_room_requests_without_new_tokens_are_all_placed_under_beta():
    # Regression: _prefill_room used to clamp the minimum new-token count to 1, so the room was
    # 0 // 1 + 1 = 1 and only one request was placed. Algorithm 1: the PE stays at 100 <= β after each
    # 0-token request, so all three are placed.
    s = make(cfg(beta_tokens=100), pe_nodes=[0], de_nodes=[1])
    s.report_prefill(0, 1, 100)
    out = s.assign([req(i, hit=64, new=0) for i in range(3)])
    assert [(a.request_id, a.prefill_engine, a.decode_engine) for a in out] == [
        (0, 0, 0),
        (1, 0, 0),
        (2, 0, 0),
    ]


def test_read_path_alternate_skips_requests_without_hits():
    """``alternate`` counts only requests that read something.

    A request with no hit returns the PE path with no read and leaves the alternation where it was,
    so the next request with hits takes the side that was due; the cursor survives across fetches.
    """
    c = policy_config("round_robin_dual", alpha_tokens=1, beta_tokens=1)
    s = make(c, pe_nodes=[0], de_nodes=[1])
    hits = [64, 0, 64, 0, 0, 64, 64]
    out = s.assign([req(i, hit=h) for i, h in enumerate(hits)])
    assert [(a.read_path, a.num_pe_read_tokens, a.num_de_read_tokens) for a in out] == [
        (PATH_PE, 64, 0),
        (PATH_PE, 0, 0),  # no hit: not counted
        (PATH_DE, 0, 64),
        (PATH_PE, 0, 0),
        (PATH_PE, 0, 0),
        (PATH_PE, 64, 0),
        (PATH_DE, 0, 64),
    ]
    assert s.read_tokens_total[:2] == [128, 128]
    nxt = s.assign([req(9, hit=0), req(10, hit=128)])
    assert [(a.read_path, a.num_pe_read_tokens) for a in nxt] == [(PATH_PE, 0), (PATH_PE, 128)]


@fuzz_settings(150)
@_CLUSTER_DRAWS
def test_property_finite_beta_stops_only_when_head_is_unplaceable_and_drains_to_exactly_once(
    data, policy, num_pe, num_de
):
    """β finite (it binds): each fetch assigns a FIFO prefix, never a request twice, never a PE over β
    (load aware) and never more pages than a DE has; a fetch that stops early leaves a head that cannot
    be placed at that moment; once engines drain, every request is assigned exactly once.

    Stopping conditions read off the code: round robin stops when the DE under the cursor lacks the
    pages. Load aware stops when no PE is ≤ β, or when no DE of the head's phase-1 group (min Σ tok_e,
    then lowest id, over the loads after this fetch's commits) has the pages; the ``_prefill_room`` cut
    only stops a fetch when every PE is over β (with 0 new tokens drawn too: the room is then unbounded).
    """
    beta = data.draw(st.integers(0, 600))
    c = policy_config(policy, alpha_tokens=data.draw(st.integers(0, 5000)), beta_tokens=beta)
    load_aware = c.engine_choice == "load_aware"
    cap = [data.draw(st.integers(25, 60)) for _ in range(num_de)]  # 25 pages hold any request (≤ 400)
    de_free = [data.draw(st.integers(0, k)) for k in cap]
    pes = [EngineLoad(i, i % 2) for i in range(num_pe)]
    des = [EngineLoad(i, 2 + i % 3, i % 2, num_free_pages=f) for i, f in enumerate(de_free)]
    s = DualPathScheduler(c, pes, des, num_nodes=5)
    pe_tok = [data.draw(st.integers(0, 700)) for _ in range(num_pe)]
    for i, t in enumerate(pe_tok):
        s.report_prefill(i, 0, t)
    de_tok = [0] * num_de
    for n in range(5):
        s.report_read_queue(n, data.draw(st.integers(0, 3000)))
    queue = _draw_queue(data, min_new_tokens=0)
    assigned: dict[int, Assignment] = {}
    pending = list(queue)
    rr = 0  # round robin cursor (PE and DE cursors move together from 0)

    def fetch() -> int:
        nonlocal pending, rr
        out = s.assign(pending)
        assert [a.request_id for a in out] == [r.request_id for r in pending[: len(out)]]
        for a, r in zip(out, pending, strict=False):
            assert a.request_id not in assigned
            assigned[a.request_id] = a
            assert a.num_pe_read_tokens + a.num_de_read_tokens == r.num_hit_tokens
            if load_aware:
                assert pe_tok[a.prefill_engine] <= beta
            else:
                assert (a.prefill_engine, a.decode_engine) == (rr % num_pe, rr % num_de)
                rr += 1
            pe_tok[a.prefill_engine] += r.num_new_tokens
            de_tok[a.decode_engine] += r.num_decode_tokens
            de_free[a.decode_engine] -= r.num_decode_pages(PAGE)
            assert de_free[a.decode_engine] >= 0
        assert [e.num_tokens for e in s.prefill] == pe_tok
        assert [(e.num_tokens, e.num_free_pages) for e in s.decode] == list(zip(de_tok, de_free, strict=True))
        pending = pending[len(out) :]
        if pending:
            pages = pending[0].num_decode_pages(PAGE)
            if not load_aware:
                assert de_free[rr % num_de] < pages
            else:
                groups = sorted({i % 2 for i in range(num_de)})
                g = min(groups, key=lambda g: (sum(de_tok[i] for i in range(num_de) if i % 2 == g), g))
                no_pe = all(t > beta for t in pe_tok)
                no_de = all(de_free[i] < pages for i in range(num_de) if i % 2 == g)
                assert no_pe or no_de
        return len(out)

    def drain(pe_mask: list[bool], de_mask: list[bool]) -> None:
        for i in range(num_pe):
            if pe_mask[i]:
                pe_tok[i] = 0
                s.report_prefill(i, 0, 0)
        for i in range(num_de):
            if de_mask[i]:
                de_tok[i], de_free[i] = 0, cap[i]
                s.report_decode(i, 0, 0, cap[i])

    for _ in range(3):  # loads only grow, then some engines finish their work
        fetch()
        drain(
            data.draw(st.lists(st.booleans(), min_size=num_pe, max_size=num_pe)),
            data.draw(st.lists(st.booleans(), min_size=num_de, max_size=num_de)),
        )
    for _ in range(len(queue) + 1):
        if not pending:
            break
        drain([True] * num_pe, [True] * num_de)
        assert fetch() >= 1  # every PE at 0 <= β and every DE empty: the head always fits
    assert not pending
    assert sorted(assigned) == [r.request_id for r in queue]
