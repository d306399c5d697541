"""The scheduler alone (pure Python, no model): exact page ids, chunk sizes, admission and
preemption order. The test plays the model runner: it advances `num_computed_tokens` and appends a
token for each request that reached its end, as `LLMEngine.step` does."""

from __future__ import annotations

from pdserve.config import SchedulerConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.kv_manager import KVManager
from pdserve.sampling_params import SamplingParams


def make(num_pages=16, page_size=4, budget=8, max_seqs=4, prefix=True) -> Scheduler:
    kv = KVManager(num_pages, page_size, enable_prefix_caching=prefix)
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256), kv
    )


def req(rid: str, n: int, start: int = 0, max_tokens: int = 100) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), max_tokens)


def run_step(s: Scheduler):
    out = s.schedule()
    for r, n in zip(out.requests, out.num_new_tokens, strict=True):
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(1000 + len(r.output_token_ids))
        s.kv.cache_computed_pages(r)
    s.kv.check_integrity()
    return [(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens, strict=True)], out


def test_chunked_prefill_shares_step_with_decode():
    s = make(budget=8)
    a, b = req("a", 3), req("b", 13, start=100)
    s.add(a)
    s.add(b)
    assert run_step(s)[0] == [("a", 3), ("b", 5)]  # a's prompt, b's first chunk (budget 8)
    assert a.page_ids == [0] and b.page_ids == [1, 2]
    assert a.output_token_ids == [1000] and b.output_token_ids == []
    assert run_step(s)[0] == [("a", 1), ("b", 7)]  # a decodes; b's second chunk fills the rest
    assert run_step(s)[0] == [("a", 1), ("b", 1)]  # b's last prompt token, then b samples
    # a crossed into its 2nd page one step earlier (its 5th token), so it took page 4 first.
    assert b.output_token_ids == [1000] and b.page_ids == [1, 2, 3, 5] and a.page_ids == [0, 4]
    assert run_step(s)[0] == [("a", 1), ("b", 1)]


def test_max_num_seqs_and_fifo_admission():
    s = make(budget=100, max_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 2, start=10 * i))
    assert run_step(s)[0] == [("r0", 2), ("r1", 2)]
    assert [r.request_id for r in s.waiting] == ["r2"]
    s.finish(s.running[0], RequestStatus.FINISHED_STOPPED)
    assert run_step(s)[0] == [("r1", 1), ("r2", 2)]


def test_prefix_hit_on_admission_counts_cached_tokens():
    s = make(budget=100)
    a = req("a", 10)
    s.add(a)
    run_step(s)
    b = req("b", 12)  # shares a's first 10 tokens -> 2 full pages (8 tokens) hit
    s.add(b)
    sched, _ = run_step(s)
    assert sched == [("a", 1), ("b", 4)]
    assert b.num_cached_tokens == 8 and b.page_ids[:2] == a.page_ids[:2]
    assert s.kv.num_hit_tokens == 8 and s.kv.num_query_tokens == 22


def test_no_prefix_caching_means_no_hits():
    s = make(budget=100, prefix=False)
    a = req("a", 10)
    s.add(a)
    run_step(s)
    b = req("b", 12)
    s.add(b)
    assert run_step(s)[0] == [("a", 1), ("b", 12)]
    assert s.kv.pool.num_cached_pages == 0


def test_preemption_evicts_latest_admitted_and_recomputes():
    # 4 pages of 4 tokens. a: 7 tokens (2 pages), b: 8 tokens (2 pages): pool full after admission.
    s = make(num_pages=4, budget=100)
    a, b = req("a", 7), req("b", 8, start=50)
    s.add(a)
    s.add(b)
    assert run_step(s)[0] == [("a", 7), ("b", 8)]
    assert a.page_ids == [0, 1] and b.page_ids == [2, 3]
    # a's 8th token fits its page; b's 9th token needs a 5th page -> b (latest admitted) is preempted.
    sched, out = run_step(s)
    assert sched == [("a", 1)] and out.preempted == [b]
    assert b.status == RequestStatus.WAITING and b.page_ids == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [1000]  # generated tokens survive preemption
    assert list(s.waiting) == [b] and b.num_preemptions == 1
    # a now needs a 3rd page; b is readmitted only when it fits, recomputing prompt + its output.
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    sched, _ = run_step(s)
    # b's 2 full prompt pages were published before preemption: they are prefix hits now.
    assert sched == [("b", 1)] and b.num_computed_tokens == 9 and b.page_ids[:2] == [2, 3]
    assert b.num_cached_tokens == 0  # reported hits are those of the first admission


def test_running_request_that_cannot_grow_preempts_itself_last():
    s = make(num_pages=2, budget=100, prefix=False)
    a = req("a", 8)
    s.add(a)
    assert run_step(s)[0] == [("a", 8)]
    sched, out = run_step(s)  # needs a 3rd page: a is the only one, so a itself is preempted
    assert sched == [] and out.preempted == [a] and s.kv.pool.num_used_pages == 0


def test_a_head_that_cannot_fit_with_nothing_running_releases_a_waiting_holder_from_the_tail():
    """A decode's committed PD request waits (max_num_seqs) holding its prompt's pages; the running
    request outgrows the pool and preempts itself. Nothing runs, and FIFO admission stops at the
    head, which needs the holder's pages: the scheduler releases the latest holder (a preemption, it
    keeps its place and its tokens) and admits the head, instead of both waiting for good."""
    s = make(num_pages=4, budget=100, max_seqs=1, prefix=False)
    a = req("a", 7)
    s.add(a)
    assert run_step(s)[0] == [("a", 7)] and a.page_ids == [0, 1]
    # b's 8-token prompt KV arrived from a prefill (as DecodeRole._commit queues it), with token 1.
    b, c = req("b", 8, start=50), req("c", 4, start=80)
    assert s.kv.allocate(b, 8)
    b.num_computed_tokens = 8
    b.append_output(2000)
    s.add_prefilled(b)
    s.add(c)
    assert b.page_ids == [2, 3] and [r.request_id for r in s.waiting] == ["b", "c"]
    assert run_step(s)[0] == [("a", 1)]  # a's 8th token fills its 2nd page
    sched, out = run_step(s)  # its 9th needs a 3rd page: none is free, so a preempts itself
    assert sched == [] and out.preempted == [a] and [r.request_id for r in s.waiting] == ["a", "b", "c"]
    sched, out = run_step(s)  # a needs 3 pages, 2 are free, nothing runs: b's are released
    assert sched == [("a", 9)] and a.page_ids == [0, 1, 2]
    assert b.page_ids == [] and b.num_computed_tokens == 0 and b.status == RequestStatus.WAITING
    assert b.num_preemptions == 1 and s.num_preemptions == 2 and b.output_token_ids == [2000]
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # b keeps its place
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    assert run_step(s)[0] == [("b", 9)]  # prompt + its token 1, recomputed


def test_a_head_that_cannot_fit_while_a_request_runs_waits_and_holders_keep_their_pages():
    s = make(num_pages=4, budget=100, max_seqs=2, prefix=False)
    a = req("a", 8)
    s.add(a)
    assert run_step(s)[0] == [("a", 8)]
    b = req("b", 4, start=50)
    assert s.kv.allocate(b, 4)
    b.num_computed_tokens = 4
    b.append_output(2000)
    s.add(req("big", 5, start=90))  # 2 pages; 1 is free
    s.add_prefilled(b)
    assert run_step(s)[0] == [("a", 1)]  # (a runs: it will free pages; b waits behind the head)
    assert b.page_ids == [2] and s.num_preemptions == 0


def test_finish_releases_pages_from_any_queue():
    s = make(budget=4)
    a, b = req("a", 10), req("b", 3, start=40)
    s.add(a)
    s.add(b)
    run_step(s)  # a partially computed; b waiting (budget spent)
    assert [r.request_id for r in s.running] == ["a"] and list(s.waiting) == [b]
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert not s.has_work() and s.kv.pool.num_used_pages == 0
    s.kv.check_integrity()


def test_compute_quota_caps_the_step_and_chunks_the_last_request_by_pages():
    # Cost: 1 ms overhead + 100 µs per new token (no attention term). Quota 2.3 ms -> 13 tokens fit,
    # so the first request (8 tokens, 1.8 ms) runs whole and the second gets whole pages: 4 tokens.
    kv = KVManager(32, 4, enable_prefix_caching=True)
    cfg = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=1000,
        max_model_len=256,
        prefill_quota_s=0.0023,
        prefill_overhead_s=0.001,
        prefill_us_per_token=100.0,
        prefill_ns_per_token_pair=0.0,
    )
    s = Scheduler(cfg, kv)
    s.add(req("a", 8))
    s.add(req("b", 20, start=100))
    assert run_step(s)[0] == [("a", 8), ("b", 4)]
    # Next step: a decodes (1 token, 0.1 ms); b's remaining 16 tokens: 1 + 0.1 + n·0.1 <= 2.3 -> 12.
    assert run_step(s)[0] == [("a", 1), ("b", 12)]
    # With an attention term the same quota admits fewer tokens of a long-context request.
    assert SchedulerConfig(prefill_ns_per_token_pair=5.0).prefill_cost_s(32_000, 100) > 0.02


def test_compute_quota_plans_a_waiting_request_after_its_prefix_hit():
    """A 4,000-token prompt whose first 2,000 tokens are cached: the quota is planned over the 2,000
    cached tokens its admission will share, so the step's cost stays within the quota. Planned from
    token 0, it got 2,000 new tokens costing 132 ms against a 115 ms quota (attention over the hit)."""
    kv = KVManager(1000, 16, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_batched_tokens=100_000, max_model_len=10_000, prefill_quota_s=0.115)
    s = Scheduler(cfg, kv)
    prompt = list(range(4000))
    warm = Request("warm", prompt[:2000], SamplingParams(max_tokens=1), 1)
    s.add(warm)
    while warm.num_computed_tokens < 2000:
        run_step(s)
    s.finish(warm, RequestStatus.FINISHED_LENGTH)
    b = Request("b", prompt, SamplingParams(max_tokens=1), 1)
    s.add(b)
    [(rid, num_new)], _ = run_step(s)
    assert rid == "b" and b.num_cached_tokens == 2000
    cost_s = cfg.prefill_overhead_s + cfg.prefill_cost_s(2000, num_new)
    assert cost_s <= cfg.prefill_quota_s
    assert cfg.prefill_overhead_s + cfg.prefill_cost_s(2000, num_new + kv.page_size) > cfg.prefill_quota_s
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    kv.check_integrity()


def test_same_prompt_at_once_waits_for_the_pages_in_flight_instead_of_recomputing():
    """Two requests with one 16-token prompt (4 pages of 4) and a third with another prompt, all
    waiting at once: b's first page is being computed by a, so b waits (c, behind it, goes ahead);
    next step b admits with a's 3 full pages as prefix hits and computes only its last page."""
    s = make(num_pages=16, page_size=4, budget=32, max_seqs=4)
    a, b, c = req("a", 16), req("b", 16), req("c", 4, start=500)
    for r in (a, b, c):
        s.add(r)
    assert run_step(s)[0] == [("a", 16), ("c", 4)]  # b put off: its first page is a's, in flight
    assert [r.request_id for r in s.waiting] == ["b"] and s.num_prefix_waits == 1
    assert run_step(s)[0] == [("a", 1), ("c", 1), ("b", 4)]  # b: 3 full pages hit, then its last page
    assert b.num_cached_tokens == 12 and b.page_ids[:3] == a.page_ids[:3]
    assert s.kv.num_hit_tokens == 12 and not s.waiting and s.num_prefix_waits == 1


def test_a_shared_prefix_waits_only_for_the_shared_pages():
    """b shares a's first 2 pages, then differs: once those two are computed it is admitted, and
    computes its own tokens (it never waits for a page it does not share)."""
    s = make(num_pages=32, page_size=4, budget=32, max_seqs=4)
    a = req("a", 24)
    b = Request("b", list(range(8)) + [900 + i for i in range(8)], SamplingParams(max_tokens=100), 100)
    s.add(a)
    s.add(b)
    assert run_step(s)[0] == [("a", 24)]  # a's 6 pages; b waits (its page 0 is in flight)
    assert run_step(s)[0] == [("a", 1), ("b", 8)]  # b: pages 0-1 hit, then its own 8 tokens
    assert b.num_cached_tokens == 8 and b.page_ids[:2] == a.page_ids[:2] and s.num_prefix_waits == 1


def test_no_prefix_caching_means_no_waiting():
    s = make(budget=100, prefix=False)
    a, b = req("a", 16), req("b", 16)
    s.add(a)
    s.add(b)
    assert run_step(s)[0] == [("a", 16), ("b", 16)] and s.num_prefix_waits == 0


def test_a_request_put_off_keeps_its_slot_from_those_behind_it():
    """max_num_seqs 2, queue [a, b (a's prompt), c]: b waits for a's pages but keeps its slot, so c
    does not take it (else b would wait for c's whole generation)."""
    s = make(num_pages=32, page_size=4, budget=64, max_seqs=2)
    a, b, c = req("a", 16), req("b", 16), req("c", 4, start=500)
    for r in (a, b, c):
        s.add(r)
    assert run_step(s)[0] == [("a", 16)]  # b put off; c may not take its slot
    assert run_step(s)[0] == [("a", 1), ("b", 4)]
    assert [r.request_id for r in s.waiting] == ["c"] and s.num_prefix_waits == 1


def test_a_request_put_off_keeps_the_pages_its_prompt_needs():
    """16 pages: a takes 4, b (a's prompt) waits and keeps the 4 pages its prompt needs, so c (40
    tokens = 10 pages) does not fit beside them and waits too; next step b shares a's 3 full pages
    and takes 1, and c fits."""
    s = make(num_pages=16, page_size=4, budget=64, max_seqs=4)
    a, b, c = req("a", 16), req("b", 16), req("c", 40, start=500)
    for r in (a, b, c):
        s.add(r)
    assert run_step(s)[0] == [("a", 16)]  # without b's reservation c took 10 of the 12 free pages
    assert run_step(s)[0] == [("a", 1), ("b", 4), ("c", 40)]
    assert s.kv.pool.num_free_pages == 0


def test_compute_quota_leaves_out_a_request_that_will_be_put_off():
    """The quota is planned without the request the admission loop puts off: its share would go to
    the one behind it, whose tokens cost more over a long cached context (the step ran ~2x over)."""
    kv = KVManager(4000, 16, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_batched_tokens=100_000, max_model_len=40_000, prefill_quota_s=0.115)
    s = Scheduler(cfg, kv)
    long_ctx = list(range(10_000, 40_000))
    warm = Request("warm", long_ctx[:29_000], SamplingParams(max_tokens=1), 1)
    s.add(warm)
    while warm.num_computed_tokens < len(warm.prompt_token_ids):
        run_step(s)
    s.finish(warm, RequestStatus.FINISHED_LENGTH)
    a = Request("a", list(range(2400)), SamplingParams(max_tokens=1), 1)
    s.add(a)
    run_step(s)
    assert 2000 < a.num_computed_tokens < 2400  # a is mid-prefill: its last pages are in flight
    b = Request("b", list(range(2400)) + list(range(5000, 5600)), SamplingParams(max_tokens=1), 1)
    c = Request("c", long_ctx, SamplingParams(max_tokens=1), 1)
    s.add(b)
    s.add(c)
    sched, out = run_step(s)
    assert "b" not in dict(sched)
    cost_s = cfg.prefill_overhead_s + sum(
        cfg.prefill_cost_s(r.num_computed_tokens - n, n)
        for r, n in zip(out.requests, out.num_new_tokens, strict=True)
    )
    assert cost_s <= cfg.prefill_quota_s


def _step_fake(s: Scheduler, out_token: int = 7):
    """One engine step without a model: every scheduled token computed, a finished prefill samples."""
    out = s.schedule()
    for r, n in zip(out.requests, out.num_new_tokens, strict=True):
        if r.prompt_logprobs is not None:  # (the engine adds one entry per computed prompt token)
            while len(r.prompt_logprobs) < min(r.num_computed_tokens + n, r.num_prompt_tokens):
                r.prompt_logprobs.append(None)
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(out_token)
        s.kv.cache_computed_pages(r)
    return out


def _committed(kv: KVManager, rid: str, prompt: list[int], max_tokens: int = 50) -> Request:
    """A PD decode's committed request: its prompt KV in its pages, its first token sampled."""
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens)
    assert kv.allocate(r, len(prompt))
    r.num_computed_tokens = len(prompt)
    r.append_output(1)
    kv.cache_computed_pages(r)
    return r


def test_a_lone_head_admitted_in_chunks_releases_a_waiting_holder_instead_of_preempting_itself_forever():
    """A preempted request whose recompute is longer than the step budget is admitted with a chunk
    (the chunk fits), grows into pages a waiting committed request keeps, preempts itself (nothing
    else runs) and is admitted again with a chunk: for ever (67 preemptions in 200 steps, the holder
    never ran; 10 of 800 random schedules hung so). Holders were released only for a head that could
    not be admitted at all; now also for a lone head of which only a chunk fits."""
    kv = KVManager(4, 4, enable_prefix_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64), kv)
    a = _committed(kv, "a", list(range(7)))
    s.add_prefilled(a)
    _step_fake(s)
    b = _committed(kv, "b", list(range(100, 107)))
    s.add_prefilled(b)
    for _ in range(200):
        _step_fake(s)
        kv.check_integrity()
        if b.status != RequestStatus.WAITING:
            break
    assert a.num_preemptions <= 1 and b.num_preemptions == 1  # (b released once, then recomputed)
    assert b.status == RequestStatus.RUNNING or a.status == RequestStatus.RUNNING


def test_a_preempted_request_with_every_prompt_logprob_reuses_its_whole_cached_context():
    """prompt_logprobs: a cached token has no logits, so hits stop before the first missing entry. The
    cap stayed once every entry existed: a request preempted 30 tokens into its output reused 1 of
    its 9 cached pages and recomputed all 30 output tokens."""
    kv = KVManager(64, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256), kv)
    r = Request("a", list(range(8)), SamplingParams(max_tokens=100, prompt_logprobs=0), 100)
    s.add(r)
    for _ in range(30):
        _step_fake(s, out_token=5)
    assert len(r.prompt_logprobs) == 8 and r.num_tokens == 38  # every prompt entry is there
    s.retract_all()
    assert len(s._prefix_hits(r)[0]) == (r.num_tokens - 1) // 4 == 9  # (was 1)
    # Part-way through the prompt the cap holds: of the 3 cached pages this prompt could hit, only
    # page 0 is used (entries for tokens 0..4 exist; token 5's needs token 4's logits, on page 1).
    q = Request("q", list(range(8)) + [5] * 8, SamplingParams(max_tokens=4, prompt_logprobs=0), 4)
    assert len(kv.match_prefix(q)[0]) == 3
    q.prompt_logprobs += [None] * 4
    assert len(s._prefix_hits(q)[0]) == 1


def test_engine_integrity_check_sees_a_page_published_before_its_tokens_are_computed(
    demo_model_dir, monkeypatch
):
    """An off-by-one put in on purpose (publishing the pages of `num_tokens`, which counts the sampled
    token whose KV is not computed yet) made later prompts reuse a page with a slot never written:
    their outputs diverged while every reference count still agreed, and `check_integrity` passed
    at every step (a review, 2026-12-05). It now names the request."""
    import pytest

    from pdserve import LLM

    llm = LLM(demo_model_dir, page_size=4, dtype="float32", num_pages=64, max_model_len=128)
    engine = llm.engine

    def off_by_one(self, req) -> None:
        from pdserve.kvcache.hashing import cached_keys

        num_full = req.num_tokens // self.page_size  # (the bug: not num_computed_tokens)
        start = len(req.page_keys)
        if num_full > start:
            keys = cached_keys(
                req.page_key_cache, req.all_token_ids, self.page_size, self.root_for(req), num_full
            )
            for i, key in enumerate(keys[start:], start=start):
                self.pool.register(req.page_ids[i], key)
                req.page_keys.append(key)

    monkeypatch.setattr(KVManager, "cache_computed_pages", off_by_one)
    engine.add_request(list(range(1, 8)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "r")
    with pytest.raises(AssertionError, match="r: published an uncomputed page"):
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
