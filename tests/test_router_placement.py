"""The router's DualPath placement alone (no processes): load reports in, exact assignments out."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.router.engines import Engine
from pdserve.router.placement import Placement, PlacementError
from pdserve.router.prompts import PrefixIndex, prompt_pieces, prompt_shape

BPT = 4096  # KV bytes per token


def report(node: str, role: str, **kw) -> dict:
    base = {
        "role": role,
        "node": node,
        "num_seqs": 0,
        "num_tokens": 0,
        "num_free_pages": 1000,
        "num_total_pages": 1000,
        "page_size": 16,
        "kv_block_size": 64,
        "kv_bytes_per_token": BPT,
        "read_queue_tokens": 0,
        "planned_read_tokens": 0,
        "node_read_queue_bytes": 0,
        "snic_bytes_per_s": 8e6,
        "snic_bytes_served": 0,
        "snic_read_bytes_served": 0,
        "time_s": time.time(),
    }
    return base | kw


def cluster(policy: str):
    pe = [Engine("http://p", "prefill", healthy=True)]
    de = [Engine("http://d0", "decode", healthy=True), Engine("http://d1", "decode", healthy=True)]
    pl = Placement(policy, pe, de)
    pl.on_load(pe[0], report("p0", "prefill"))
    pl.on_load(de[0], report("d0", "decode"))
    assert pl.scheduler is None  # not every engine has reported yet
    pl.on_load(de[1], report("d1", "decode"))
    assert pl.scheduler is not None
    return pl, pe, de


def place_all(pl: Placement, prompts: list[list[int]], max_tokens: int = 16):
    async def go():
        return await asyncio.gather(*(pl.place(p, len(p), max_tokens) for p in prompts))

    return [placed.assignment for placed in asyncio.run(go())]


def test_prefix_index_counts_whole_blocks_seen_before_and_leaves_one_token():
    idx = PrefixIndex(block_tokens=4)
    a = list(range(10))
    assert idx.hit_tokens(a) == 0
    idx.record(a)  # blocks [0..3], [4..7] recorded (the partial tail is not)
    assert idx.hit_tokens(a + [99, 98]) == 8
    assert idx.hit_tokens(list(range(8))) == 4  # at least one token is left to compute
    assert idx.hit_tokens([0, 1, 2, 7] + list(range(4, 10))) == 0  # chained: a changed block breaks it


def est_then_record(idx: PrefixIndex, pieces, num_tokens: int) -> int:
    """A text or chat prompt's estimate, then the prompt recorded (as the router does once an engine
    took it)."""
    hits, keys = idx.estimated_hits_and_keys(pieces, num_tokens)
    idx.record_keys(keys)
    return hits


def test_hit_tokens_and_keys_are_both_with_one_hashing():
    """Placement hashes each token-id prompt once (~1 ms per 32k tokens), not once per step; its keys
    recorded give the index `record` gives."""
    one, two = PrefixIndex(block_tokens=4, capacity=6), PrefixIndex(block_tokens=4, capacity=6)
    prompts = [list(range(10)), list(range(8)), list(range(13)), [5] * 9, list(range(17)), list(range(3))]
    for ids in prompts:
        hits = one.hit_tokens(ids)
        one.record(ids)
        hits_two, keys = two.hit_tokens_and_keys(ids)
        two.record_keys(keys)
        assert hits_two == hits
        assert list(one._keys) == list(two._keys)  # the same keys in the same LRU order (capacity 6)


def test_text_and_chat_prompts_get_hit_estimates_from_their_pieces():
    """No tokenizer in the router: a text's 256-character chunks and a chat's messages are chained;
    the leading ones seen before count as hits at 4 characters per token, in whole blocks (64)."""
    idx = PrefixIndex(block_tokens=64)
    text = "".join(chr(97 + i % 26) for i in range(1000))  # 3 full chunks (the 232-char tail is not one)
    assert [c for _, c in prompt_pieces({"prompt": text})] == [256, 256, 256]
    assert est_then_record(idx, prompt_pieces({"prompt": text}), 250) == 0
    longer = text + "x" * 600  # 6 chunks: the first 3 seen before = 768 chars = 192 tokens = 3 blocks
    assert est_then_record(idx, prompt_pieces({"prompt": longer}), 400) == 192
    assert est_then_record(idx, prompt_pieces({"prompt": "b" + longer}), 400) == 0  # chained
    assert prompt_pieces({"prompt": "\ud800" * 300}) is not None  # (a lone surrogate: no crash)

    system = {"role": "system", "content": "s" * 1200}
    turn1 = {"messages": [system, {"role": "user", "content": "u" * 400}]}
    assert est_then_record(idx, prompt_pieces(turn1), prompt_shape(turn1)[1]) == 0
    reply = {"role": "assistant", "content": "a" * 300}
    turn2 = {"messages": turn1["messages"] + [reply, {"role": "user", "content": "v" * 200}]}
    # The first turn's messages (1,600 chars = 400 tokens) are hits: 6 whole blocks.
    assert est_then_record(idx, prompt_pieces(turn2), prompt_shape(turn2)[1]) == 384
    # Key order inside a message does not matter; another tool list changes everything after it.
    reordered = {"messages": [{"content": "s" * 1200, "role": "system"}] + turn2["messages"][1:]}
    assert est_then_record(idx, prompt_pieces(reordered), prompt_shape(reordered)[1]) == 512
    tools = {"tools": [{"type": "function", "function": {"name": "ls"}}]}
    assert est_then_record(idx, prompt_pieces(turn2 | tools), prompt_shape(turn2 | tools)[1]) == 0
    assert prompt_pieces({"prompt": [1, 2, 3]}) is None
    # The template's own fields are part of the first piece (they change every rendered token).
    thinking = turn2 | {"chat_template_kwargs": {"enable_thinking": False}}
    assert est_then_record(idx, prompt_pieces(thinking), prompt_shape(thinking)[1]) == 0
    # A crafted body costs bounded work: 4,096 pieces at most; nesting too deep to write: no estimate.
    assert len(prompt_pieces({"messages": [{}] * 10_000})) == 4096
    assert len(prompt_pieces({"prompt": "x" * (256 * 5000)})) == 4096
    deep: dict = {}
    for _ in range(5000):
        deep = {"k": deep}
    assert prompt_pieces({"messages": [{"role": "user", "content": "x", "extra": deep}]}) is None


def test_a_chat_agents_next_turn_reads_by_the_read_queues_not_always_on_the_prefill_side():
    """Without hit estimates a chat request had no hits, and the scheduler always picked the PE read
    path for it; with them, a second turn's stored prefix is read where the queue is shorter."""
    pl, _, _ = cluster("dualpath")
    turns = []
    for i in range(4):
        first = {"messages": [{"role": "system", "content": f"agent {i} " * 300}]}
        turns.append(first)
        second = {"messages": first["messages"] + [{"role": "user", "content": "go on " * 50}]}
        turns.append(second)

    async def go():
        out = []
        for body in turns:
            ids, n = prompt_shape(body)
            placed = await pl.place(ids, n, 16, prompt_pieces(body))
            pl.record(placed)  # (an engine took it)
            out.append(placed.assignment)
        return out

    out = asyncio.run(go())
    firsts, seconds = out[0::2], out[1::2]
    assert all(a.num_pe_read_tokens + a.num_de_read_tokens == 0 for a in firsts)  # nothing stored yet
    hits = [a.num_pe_read_tokens + a.num_de_read_tokens for a in seconds]
    assert hits == [576] * 4  # (2,400 characters: 600 tokens, 9 whole blocks of 64)
    assert {a.read_path for a in seconds} == {"pe", "de"}


def test_alpha_defaults_to_three_seconds_of_the_slowest_snic():
    pl, _, _ = cluster("dualpath")
    assert pl.scheduler.config.alpha_tokens == int(3.0 * 8e6 / BPT)
    assert pl.scheduler.config.page_tokens == 16 and pl.scheduler.config.block_tokens == 64


def test_round_robin_reads_on_prefill_node_dualpath_spreads_by_read_queue():
    prompts = [[i] * 300 + list(range(i, i + 100)) for i in range(4)]
    for policy in ("round_robin", "dualpath"):
        pl, _, _ = cluster(policy)
        for p in prompts:
            pl.index.record(p[:256])  # 256 tokens of each prompt are "stored": 4 blocks of hits
        out = place_all(pl, prompts)
        if policy == "round_robin":
            assert [(a.decode_engine, a.read_path) for a in out] == [
                (0, "pe"),
                (1, "pe"),
                (0, "pe"),
                (1, "pe"),
            ]
            assert pl.read_paths == {"pe": 4, "de": 0}
        else:
            # Shorter read queue wins; each placement adds 256 tokens to its node's queue. The first
            # goes to the PE node (tie on queue and history: PE path), then the decodes' nodes, ...
            assert [a.read_path for a in out] == ["pe", "de", "de", "pe"]
            assert sorted({a.decode_engine for a in out if a.read_path == "de"}) == [0, 1]
            assert pl.scheduler.read_queue_tokens == [256, 256, 512]  # nodes d0, d1, p0
        assert all(a.num_pe_read_tokens + a.num_de_read_tokens == 256 for a in out)


def test_reports_keep_reads_in_transit_until_a_later_report():
    pl, pe, de = cluster("dualpath")
    p = list(range(400))
    pl.index.record(p[:320])
    (a,) = place_all(pl, [p])
    node = pl.node_ids["p0"] if a.read_path == "pe" else pl.node_ids[f"d{a.decode_engine}"]
    reporter = pe[0] if a.read_path == "pe" else de[a.decode_engine]
    name = "p0" if a.read_path == "pe" else f"d{a.decode_engine}"
    # Report times relative to when the router assigned the read (not to "now": a slow machine must not
    # move a report across the assignment).
    (assigned_s, _tokens), *_ = pl._recent_reads[node]
    # A report taken before the assignment reached the engine shows an idle node: the read counts.
    pl.on_load(reporter, report(name, reporter.role, time_s=assigned_s - 0.5))
    assert pl.scheduler.read_queue_tokens[node] == 320
    # A report taken well after it: the engine's own figure (here its link's backlog) is the truth.
    pl.on_load(reporter, report(name, reporter.role, node_read_queue_bytes=64 * BPT, time_s=assigned_s + 1))
    assert pl.scheduler.read_queue_tokens[node] == 64


def test_waits_for_decode_pages_then_places_in_order():
    pl, _, de = cluster("dualpath")
    for e, n in zip(de, ("d0", "d1"), strict=True):  # both full (a full decode holds many tokens)
        pl.on_load(e, report(n, "decode", num_free_pages=0, num_seqs=50, num_tokens=16_000))

    async def go():
        task = asyncio.ensure_future(pl.place(list(range(64)), 64, 16))
        await asyncio.sleep(0.01)
        assert not task.done() and len(pl.queue) == 1  # no decode has pages: it waits (FIFO)
        pl.on_load(de[1], report("d1", "decode", num_free_pages=10, num_seqs=49, num_tokens=15_000))
        return await asyncio.wait_for(task, 1.0)

    a = asyncio.run(go()).assignment
    assert a.decode_engine == 1 and not pl.queue


@pytest.mark.parametrize("policy", ["dualpath", "round_robin", "round_robin_dual"])
def test_dead_engines_are_not_chosen_and_bad_requests_are_refused(policy):
    pl, pe, de = cluster(policy)
    de[0].healthy = False
    pl.on_health(de[0])
    out = place_all(pl, [list(range(50)) for _ in range(3)])  # (round robin waited for d0 for good)
    assert [a.decode_engine for a in out] == [1, 1, 1]
    with pytest.raises(PlacementError, match="largest decode engine has 1000"):
        asyncio.run(pl.place(list(range(100)), 100, 16_000))
    with pytest.raises(ValueError, match="only in the simulator"):
        Placement("split", pe, de)
    with pytest.raises(ValueError, match="unknown policy"):
        Placement("fastest", pe, de)


def _placement(decodes: list[tuple[str, dict]], queue_timeout_s: float = 600.0, dead=()):
    """One prefill; decodes as (node, report fields); those in `dead` then lost to health checks."""
    pe = [Engine("http://p", "prefill", healthy=True)]
    de = [Engine(f"http://d{i}", "decode", healthy=True) for i in range(len(decodes))]
    pl = Placement("dualpath", pe, de, queue_timeout_s=queue_timeout_s)
    pl.on_load(pe[0], report("p0", "prefill"))
    for e, (node, fields) in zip(de, decodes, strict=True):
        pl.on_load(e, report(node, "decode", **fields))
    for i in dead:
        de[i].healthy = False
        pl.on_health(de[i])
    return pl


def test_a_dead_decode_leaves_its_groups_z_to_the_live_engines():
    """One decode node (one group) of three; d2 dies. Its fake load (2**40 tokens) entered
    Z = 1.05 x (Σ len + Σ tok_e) / |E|: every live engine counted as low, and the choice went to the
    fewest requests, d0 (20,000 tokens), instead of by tokens. Over the live engines, Z ≈ 10.6K: d0
    is high, d1 (200 tokens) low: d1."""
    pl = _placement(
        [("n", dict(num_seqs=1, num_tokens=20_000, num_free_pages=500)),
         ("n", dict(num_seqs=2, num_tokens=200, num_free_pages=980)), ("n", {})],
        dead=[2],
    )  # fmt: skip
    assert asyncio.run(pl.place(list(range(40)), 40, 16)).assignment.decode_engine == 1


def test_a_dead_decode_does_not_take_its_live_node_mates_out_of_placement():
    """Node A: a0 dead, a1 idle; node B's only decode is full. The dead engine's fake load made group
    A never the least loaded: phase 1 picked B, which has no pages, and the request waited to the
    queue timeout though a1 could take it at once."""
    pl = _placement(
        [("A", {}), ("A", {}), ("B", dict(num_seqs=60, num_tokens=15_900, num_free_pages=0))],
        queue_timeout_s=2.0,
        dead=[0],
    )
    assert asyncio.run(pl.place(list(range(40)), 40, 16)).assignment.decode_engine == 1


def test_a_request_only_a_dead_decode_could_hold_is_refused_at_once():
    """At once (it waited to the queue timeout), and as the outage it is, a 503 (a 400 blamed the
    client); one bigger than every decode's pool, live or not, is the client's 400."""
    pl = _placement(
        [("d0", dict(num_free_pages=2000, num_total_pages=2000)), ("d1", {})], queue_timeout_s=2.0, dead=[0]
    )
    with pytest.raises(PlacementError, match="only a decode engine out of service") as e:
        asyncio.run(pl.place(list(range(100)), 100, 1500 * 16))
    assert e.value.status == 503
    with pytest.raises(PlacementError, match="largest decode engine has 2000") as e:
        asyncio.run(pl.place(list(range(100)), 100, 2500 * 16))
    assert e.value.status == 400


def test_phase_1_skips_a_decode_group_whose_pools_could_never_hold_the_request():
    """Decodes of unequal pools: the idle small node (500 pages) is the least loaded group, but none
    of its engines could ever hold a 1,007-page request. Phase 1 sent it there and the queue head
    waited to the timeout (the group stays least loaded while idle); it goes to the big node."""
    pl = _placement(
        [("small", dict(num_free_pages=500, num_total_pages=500)),
         ("big", dict(num_free_pages=1900, num_total_pages=2000, num_seqs=1, num_tokens=1500))],
        queue_timeout_s=2.0,
    )  # fmt: skip
    assert asyncio.run(pl.place(list(range(100)), 100, 1000 * 16)).assignment.decode_engine == 1
    small = asyncio.run(pl.place(list(range(50)), 50, 16)).assignment  # (a small one: the least loaded group)
    assert small.decode_engine == 0


@pytest.mark.parametrize("kw", [{"alpha_tokens": -1}, {"beta_tokens": -5}])
def test_a_negative_alpha_or_beta_is_refused_when_the_placement_is_made(kw):
    """Refused only when the scheduler was built, inside the load poller, which swallowed it: the
    router answered "retry shortly" forever."""
    pe, de = [Engine("http://p", "prefill", healthy=True)], [Engine("http://d", "decode", healthy=True)]
    with pytest.raises(ValueError, match="must be >= 0"):
        Placement("dualpath", pe, de, **kw)


def test_prompt_shape_of_bodies():
    assert prompt_shape({"prompt": [1, 2, 3]}) == ([1, 2, 3], 3)
    assert prompt_shape({"prompt": [[4, 5]]}) == ([4, 5], 2)
    assert prompt_shape({"prompt": "x" * 40}) == (None, 10)
    assert prompt_shape({"messages": [{"role": "user", "content": "y" * 8}]}) == (None, 2)


def test_an_engine_down_at_start_does_not_block_placement_and_joins_when_it_reports():
    pe = [Engine("http://p", "prefill", healthy=True)]
    de = [Engine("http://d0", "decode", healthy=True), Engine("http://d1", "decode", healthy=False)]
    pl = Placement("dualpath", pe, de)
    pl.on_load(pe[0], report("p0", "prefill"))
    pl.on_load(de[0], report("d0", "decode"))
    assert pl.scheduler is not None  # d1 is down: nobody waits for it
    assert [a.decode_engine for a in place_all(pl, [list(range(40))] * 2)] == [0, 0]
    de[1].healthy = True
    pl.on_load(de[1], report("d1", "decode"))  # back: rebuilt with its real node
    assert sorted(pl.node_ids) == ["d0", "d1", "p0"]
    pl.on_load(de[0], report("d0", "decode", num_seqs=5, num_tokens=5000))
    assert [a.decode_engine for a in place_all(pl, [list(range(40))])] == [1]


def test_a_request_to_a_router_just_started_waits_for_the_first_reports(monkeypatch):
    """A freshly started router answers /health before its load poller's first round: a request sent
    then was a 503 "retry shortly" (seen in the cluster test once the router bound its port before
    starting). It now waits for the reports, up to FIRST_REPORTS_WAIT_S."""
    import pdserve.router.placement as placement

    pe = [Engine("http://p", "prefill", healthy=True)]
    de = [Engine("http://d0", "decode", healthy=True)]
    pl = Placement("dualpath", pe, de)

    async def go():
        later = asyncio.get_running_loop().call_later
        later(0.1, pl.on_load, pe[0], report("p0", "prefill"))
        later(0.15, pl.on_load, de[0], report("d0", "decode"))
        return await pl.place(list(range(40)), 40, 8)

    assert asyncio.run(go()).assignment.decode_engine == 0
    monkeypatch.setattr(placement, "FIRST_REPORTS_WAIT_S", 0.05)
    fresh = Placement("dualpath", pe, de)
    with pytest.raises(PlacementError, match="retry shortly"):
        asyncio.run(fresh.place(list(range(40)), 40, 8))


def test_an_engine_down_at_the_build_is_moved_to_its_node_when_it_reports():
    """An engine without a report when the scheduler was built sits on a placeholder node of its own.
    Its first report named a node its node-mate had reported already, so nothing was rebuilt: it stayed
    on the placeholder for good, whose read queue nobody reports (0), and a PE-side read was booked on
    its swamped real node (a review, 2026-12-04). A report of another node than the one the scheduler
    has the engine on now rebuilds."""
    pe = [Engine("http://p0", "prefill", healthy=True), Engine("http://p1", "prefill", healthy=False)]
    de = [Engine("http://d0", "decode", healthy=True)]
    pl = Placement("dualpath", pe, de)
    pl.on_load(pe[0], report("n0", "prefill"))
    pl.on_load(de[0], report("d0", "decode"))
    assert pl.scheduler is not None and pl.built_nodes["http://p1"] == "unreported:http://p1"
    pe[1].healthy = True
    pl.on_health(pe[1])
    pl.on_load(pe[1], report("n0", "prefill", node_read_queue_bytes=10**12))
    assert pl.built_nodes["http://p1"] == "n0"
    assert pl.scheduler.prefill[1].node_id == pl.scheduler.prefill[0].node_id == pl.node_ids["n0"]
    assert set(pl.node_ids) == {"n0", "d0"}


def test_a_dead_engines_last_report_leaves_its_nodes_read_queue():
    """Without node emulation a node's read queue is its engines' reported reads. A prefill that died
    with 500,000 tokens queued kept them in its node's queue until it came back, and α sent the work
    of its idle node-mate elsewhere (a review, 2026-12-05)."""
    pe = [Engine(f"http://p{i}", "prefill", healthy=True) for i in range(3)]
    de = [Engine("http://d0", "decode", healthy=True)]
    pl = Placement("dualpath", pe, de, alpha_tokens=1000)
    no_emulation = dict(node_read_queue_bytes=-1)
    pl.on_load(pe[0], report("n0", "prefill", read_queue_tokens=500_000, **no_emulation))
    pl.on_load(pe[1], report("n0", "prefill", **no_emulation))
    pl.on_load(pe[2], report("n1", "prefill", num_tokens=100, read_queue_tokens=500, **no_emulation))
    pl.on_load(de[0], report("d0", "decode", **no_emulation))
    n0 = pl.node_ids["n0"]
    assert pl.scheduler.read_queue_tokens[n0] == 500_000
    pe[0].healthy = False
    pl.on_health(pe[0])
    assert pl.scheduler.read_queue_tokens[n0] == 0
    assert [a.prefill_engine for a in place_all(pl, [list(range(40))])] == [1]


def test_an_engine_that_moved_node_and_died_before_the_rebuild_is_taken_out():
    """A prefill reports a new node while the rebuild waits for an engine that has just come up; then
    it dies. Its health change looked its new node up in the old scheduler: a KeyError that failed the
    health round and left the dead prefill placeable (a review, 2026-12-05)."""
    pe = [Engine("http://p0", "prefill", healthy=True), Engine("http://p1", "prefill", healthy=True)]
    de = [Engine("http://d0", "decode", healthy=True), Engine("http://d1", "decode", healthy=False)]
    pl = Placement("dualpath", pe, de)
    for e, node in zip(pe + de[:1], ("n0", "n1", "d0"), strict=True):
        pl.on_load(e, report(node, e.role))
    de[1].healthy = True
    pl.on_health(de[1])  # up, not yet reported: a rebuild must wait for it
    pl.on_load(pe[0], report("n7", "prefill"))
    assert "n7" not in pl.node_ids  # deferred
    pe[0].healthy = False
    pl.on_health(pe[0])
    assert not pl.scheduler.prefill[0].alive
    assert [a.prefill_engine for a in place_all(pl, [list(range(40))] * 2)] == [1, 1]
    pl.on_load(de[1], report("d1", "decode"))  # the rebuild, with the moved node
    assert "n7" in pl.node_ids


def test_a_report_taken_before_an_assignment_arrived_does_not_free_its_booking():
    """One 100-page decode. A load report taken before the first request reached it showed all 100 pages
    free; it overwrote the booking and a second 60-page request was booked there too: 120 pages on a
    100-page decode (a review, 2026-12-05). Bookings count until a report taken after them, as reads do."""
    pl = _placement([("d0", dict(num_free_pages=100, num_total_pages=100))])
    pe, de = pl.prefills[0], pl.decodes[0]
    assigned_s = time.time()  # (the assignment is made at this time or a moment after)
    assert place_all(pl, [list(range(40))], max_tokens=60 * 16 - 40 + 1)[0].decode_engine == 0
    assert pl.scheduler.decode[0].num_free_pages == 40
    pl.on_load(de, report("d0", "decode", num_free_pages=100, num_total_pages=100, time_s=assigned_s - 0.5))
    pl.on_load(pe, report("p0", "prefill", time_s=assigned_s - 0.5))
    assert pl.scheduler.decode[0].num_free_pages == 40
    assert pl.scheduler.decode[0].num_seqs == 1 and pl.scheduler.prefill[0].num_tokens == 40

    async def second():
        task = asyncio.ensure_future(pl.place(list(range(100, 140)), 40, 60 * 16 - 40 + 1))
        await asyncio.sleep(0.01)
        assert not task.done()  # 60 pages do not fit in the 40 left
        # The first request took its pages (a report after it), then finished: its pages are back.
        pl.on_load(de, report("d0", "decode", num_free_pages=40, num_seqs=1, time_s=assigned_s + 1))
        await asyncio.sleep(0.01)
        assert not task.done()
        pl.on_load(de, report("d0", "decode", num_free_pages=100, time_s=assigned_s + 2))
        return await asyncio.wait_for(task, 1.0)

    assert asyncio.run(second()).assignment.decode_engine == 0


def test_a_nodes_read_queue_is_the_larger_of_its_link_and_its_engines_views():
    """The link's view holds reads still crossing the storage NIC; reads past it but still reading
    from disk are only in the engines' own counts. The router used the link's view alone (pd_load's
    docstring promised the larger of the two), and with an unlimited SNIC that view was always 0
    (a review, 2026-12-05)."""
    pe = [Engine("http://p0", "prefill", healthy=True)]
    de = [Engine("http://d0", "decode", healthy=True)]
    pl = Placement("dualpath", pe, de)
    pl.on_load(pe[0], report("n0", "prefill", read_queue_tokens=5000, node_read_queue_bytes=0))
    pl.on_load(de[0], report("d0", "decode"))
    assert pl.scheduler.read_queue_tokens[pl.node_ids["n0"]] == 5000
    pl.on_load(pe[0], report("n0", "prefill", read_queue_tokens=5000, node_read_queue_bytes=8000 * BPT))
    assert pl.scheduler.read_queue_tokens[pl.node_ids["n0"]] == 8000
