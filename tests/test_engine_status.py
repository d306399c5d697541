"""What one engine reports about itself, under SGLang's names, through its app in process:
`/v1/loads` (slime's idle check after an abort: every count is zero once nothing runs),
`/get_server_info` and `/health_generate` (one token generated; 503 while paused)."""

from __future__ import annotations

import asyncio

import httpx

from tests.conftest import run_in_process, until

PROMPT = "def handler(request, context):\n    return process(request.body)\n" * 3


def num_requests(load: dict) -> int:
    """slime's reading of a load report: per rank, `num_total_reqs` if it is there, else running +
    waiting; plus (its newer versions) every positive count in the sections it asked for."""
    total = 0
    for rank in load["loads"]:
        total += rank.get("num_total_reqs", rank.get("num_running_reqs", 0) + rank.get("num_waiting_reqs", 0))
        for name in ("queues", "disaggregation"):
            total += sum(v for v in rank.get(name, {}).values() if isinstance(v, int) and v > 0)
    return total


def num_requests_on(url: str) -> int:
    """What a live engine or router at `url` counts in flight (a router: its own entry, the last): a
    request has reached it once this counts it."""
    loads = httpx.get(url + "/v1/loads", params={"include": "core"}, timeout=10).json()["loads"]
    return loads[-1]["num_total_reqs"]


def long_completion(c, n: int = 400):
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    return c.post("/v1/completions", json=body)


def test_loads_count_what_runs_and_fall_to_zero_after_an_abort(demo_engine):
    engine = demo_engine

    async def scenario(c):
        idle = (await c.get("/v1/loads")).json()
        long = asyncio.ensure_future(long_completion(c))
        await until(lambda: engine.scheduler.running and engine.requests)
        busy = (await c.get("/v1/loads", params={"include": "core,queues"})).json()
        await c.post("/pause_generation", json={"mode": "in_place"})
        paused = (await c.get("/v1/loads", params={"include": "queues"})).json()
        await c.post("/continue_generation")
        await c.post("/abort_request", json={"abort_all": True})
        await long
        after = (await c.get("/v1/loads", params={"include": "core,memory,queues,disagg"})).json()
        refused = [
            await c.get("/v1/loads", params={"include": "core,gpu"}),
            await c.get("/v1/loads", params={"dp_rank": 1}),
        ]
        one = (await c.get("/v1/loads", params={"dp_rank": 0, "include": "core"})).json()
        return idle, busy, paused, after, refused, one

    idle, busy, paused, after, refused, one = run_in_process(engine, scenario)
    (rank,) = idle["loads"]
    assert rank["dp_rank"] == 0 and idle["num_accelerators"] == 1 and idle["version"]
    assert rank["max_total_num_tokens"] == 128 * 16 and rank["max_running_requests"] == 64
    assert num_requests(idle) == 0 and rank["num_used_tokens"] == 0 and rank["token_usage"] == 0
    assert set(rank) >= {"memory", "queues", "cache_hit_rate", "gen_throughput", "utilization"}
    (rank,) = busy["loads"]
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_total_reqs"]) == (1, 0, 1)
    assert rank["num_used_tokens"] >= len(PROMPT) // 8 and 0 < rank["token_usage"] < 1
    assert rank["queues"] == {"waiting": 0, "paused": 0} and "memory" not in rank
    assert paused["loads"][0]["queues"] == {"waiting": 0, "paused": 1}
    assert "num_running_reqs" not in paused["loads"][0]  # (only the sections asked for)
    assert num_requests(after) == 0 and after["loads"][0]["num_used_tokens"] == 0
    assert after["loads"][0]["memory"]["num_used_pages"] == 0
    assert "disaggregation" not in after["loads"][0]  # (a colocated engine has none)
    assert refused[0].status_code == 400 and "gpu" in refused[0].json()["error"]["message"]
    assert refused[1].status_code == 404
    assert one["loads"][0]["num_total_reqs"] == 0


def test_server_info_and_health_generate(demo_engine):
    engine = demo_engine

    async def scenario(c):
        info = await c.get("/get_server_info")
        again = await c.get("/server_info")
        before = engine.num_generated_tokens
        healthy = await c.get("/health_generate")
        generated = engine.num_generated_tokens - before
        await c.post("/pause_generation", json={})
        paused = await c.get("/health_generate")
        await c.post("/continue_generation")
        back = await c.get("/health_generate")
        return info, again, healthy, generated, paused, back

    info, again, healthy, generated, paused, back = run_in_process(engine, scenario)
    body = info.json()
    assert info.status_code == 200 and again.json()["model_path"] == body["model_path"]
    assert body["context_length"] == 1024 and body["page_size"] == 16
    assert body["max_total_num_tokens"] == 128 * 16 and body["disaggregation_mode"] == "null"
    assert body["weight_version"] == "default" and body["version"]
    assert body["internal_states"][0]["is_paused"] is False
    assert healthy.status_code == 200 and generated == 1  # (it generated its one token)
    assert paused.status_code == 503 and paused.json() == {"status": "paused"}
    assert back.status_code == 200
    assert not engine.requests and engine.kv.pool.num_used_pages == 0
    engine.check_integrity()


def test_requests_held_by_a_pause_count_in_no_total(demo_engine):
    """A request waiting for the pause to end runs nowhere: `num_held_reqs`, not the totals a drain
    check sums (an RL client resubmitting its aborted requests would keep that check from ending).
    SGLang's other section names (`inflight`, `spec`, `lora`) are taken."""

    async def scenario(c):
        await c.post("/pause_generation", json={})
        held = asyncio.ensure_future(long_completion(c, 2))
        for _ in range(500):  # (until the request waits at the pause)
            query = {"include": "core,queues,inflight,spec,lora"}
            load = (await c.get("/v1/loads", params=query)).json()
            if load["loads"][0]["num_held_reqs"]:
                break
            await asyncio.sleep(0.01)
        await c.post("/continue_generation")
        return load, await held

    load, held = run_in_process(demo_engine, scenario)
    (rank,) = load["loads"]
    assert rank["num_held_reqs"] == 1 and num_requests(load) == 0
    assert held.json()["choices"][0]["finish_reason"] == "length"


def test_health_generate_is_healthy_while_a_full_batch_generates(demo_model_dir, monkeypatch):
    """Every slot taken by long requests: the probe's own request waits for a slot, and a busy, healthy
    engine answered 503 at the timeout while it generated hundreds of tokens (a review, 2026-12-05;
    slime's fault monitor restarts an engine on that). Any output since the probe came is health, as
    SGLang counts it; the probe's request is aborted, not left queued."""
    import pdserve.server.engine_status as engine_status
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(engine_status, "HEALTH_GENERATE_TIMEOUT_S", 1.0)
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=256, max_model_len=1024, max_num_seqs=2))

    async def scenario(c):
        longs = [asyncio.ensure_future(long_completion(c, 600)) for _ in range(2)]
        await until(lambda: engine.num_generated_tokens > 0 and len(engine.scheduler.running) == 2)
        health = await c.get("/health_generate")
        # (the probe's request is aborted, not left queued behind the batch)
        await until(lambda: not any(rid.startswith("HEALTH_CHECK_") for rid in list(engine.requests)), 5.0)
        running = len(engine.scheduler.running)
        await c.post("/abort_request", json={"abort_all": True})
        await asyncio.gather(*longs)
        return health, running

    health, running = run_in_process(engine, scenario)
    assert health.status_code == 200 and running == 2


def test_health_probes_are_not_counted_as_traffic(demo_engine):
    """Three `/health_generate` probes added 3 to the finished requests, the generated and prompt
    tokens and the latency histograms: a dashboard of an idle engine showed traffic (a review,
    2026-12-05; SGLang sends its probe with log_metrics=False)."""

    def counted(text: str) -> list[float]:
        names = (
            "pdserve_requests_finished_total",
            "pdserve_generation_tokens_total",
            "pdserve_prompt_tokens_total",
        )
        return [sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(n)) for n in names]

    async def scenario(c):
        before = counted((await c.get("/metrics")).text)
        probes = [(await c.get("/health_generate")).status_code for _ in range(3)]
        await asyncio.sleep(0.1)
        return before, probes, counted((await c.get("/metrics")).text)

    before, probes, after = run_in_process(demo_engine, scenario)
    assert probes == [200] * 3 and after == before
