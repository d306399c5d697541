"""`pdserve bench agentic`: trajectory building, summary statistics, SNIC windows (pure), and a replay of
3 agents x 3 turns against a real colocated `pdserve serve` on the demo checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi import FastAPI, Request  # module level: the fake router's annotations resolve here
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.agentic import (
    Result,
    TurnRecord,
    WorkloadConfig,
    add_agentic_args,
    build_agents,
    run_agentic,
    run_offline,
    run_online,
    sample_cluster,
    snic_stats,
    summarize,
    turn_prompts,
)
from pdserve.demo import free_port
from tests.conftest import serve_subprocess

CFG = WorkloadConfig(
    workload="32k", num_agents=6, max_turns=8, length_scale=0.05, max_context_tokens=4096, vocab_size=4096
)


# ---- trajectories ----------------------------------------------------------------------------------
def test_turn_prompts_are_prefixes_of_the_next_turn():
    for plan in build_agents(CFG):
        assert plan.turns, plan
        outputs = [[7] * t.gen_tokens for t in plan.turns]  # stand-in outputs of the requested lengths
        prompts = turn_prompts(plan, outputs[:-1])
        assert len(prompts) == len(plan.turns)
        for i, p in enumerate(prompts):
            assert len(p) == plan.prompt_tokens(i)
            assert all(10 <= x < 4096 - 10 for x in plan.turns[i].append_ids)
            if i:
                assert p == prompts[i - 1] + outputs[i - 1] + plan.turns[i].append_ids


def test_build_agents_is_seeded():
    a, b = build_agents(CFG), build_agents(CFG)
    assert a == b
    c = build_agents(replace(CFG, seed=1))
    assert [p.turns for p in a] != [p.turns for p in c]
    assert all(p.start_s == 0.0 for p in a)
    # token_seed changes the ids only; another workload name gives other ids.
    d = build_agents(replace(CFG, token_seed=5))
    assert [[(len(t.append_ids), t.gen_tokens) for t in p.turns] for p in d] == [
        [(len(t.append_ids), t.gen_tokens) for t in p.turns] for p in a
    ]
    assert d[0].turns[0].append_ids != a[0].turns[0].append_ids
    assert (
        build_agents(replace(CFG, workload="48k"))[0].turns[0].append_ids[:8] != a[0].turns[0].append_ids[:8]
    )
    online = build_agents(replace(CFG, aps=2.0))
    starts = [p.start_s for p in online]
    assert starts == sorted(starts) and starts[0] > 0 and [p.turns for p in online] == [p.turns for p in a]


def test_max_context_cut_and_scaling():
    small = replace(CFG, max_context_tokens=300, max_turns=50)
    full = build_agents(replace(small, max_context_tokens=10**6))
    cut = build_agents(small)
    assert any(len(c.turns) < len(f.turns) for c, f in zip(cut, full, strict=True))
    for c, f in zip(cut, full, strict=True):
        n = len(c.turns)
        assert n >= 1
        last = n - 1
        assert c.prompt_tokens(last) + c.turns[last].gen_tokens <= 300
        if n < len(f.turns):  # the next turn would not have fit
            nxt = f.prompt_tokens(n) + f.turns[n].gen_tokens
            assert nxt > 300
        if n > 1:  # the cut leaves turns after the first unchanged
            assert c.turns[1:] == f.turns[1:n]
    long = build_agents(replace(small, max_context_tokens=10**6, length_scale=0.5))
    assert sum(len(t.append_ids) for p in long for t in p.turns) > 5 * sum(
        len(t.append_ids) for p in full for t in p.turns
    )


def test_trace_workload_builds():
    if not (Path(__file__).resolve().parents[1].parent / "shared" / "data" / "weka_cc").is_dir():
        pytest.skip("trace data not present")
    agents = build_agents(replace(CFG, workload="weka_cc", num_agents=2, max_turns=4))
    assert len(agents) == 2 and all(1 <= len(p.turns) <= 4 for p in agents)


def test_a_trace_sessions_prompts_are_the_traces_prompt_lengths(tmp_path):
    """weka_cc: a turn's trace hit covers the earlier prompts only, so the previous output is inside its
    append. The bench appended it to prompt + output, counting that output twice a turn (a session's
    last prompt 1.8x the trace's: a review, 2026-12-05). Prompts: 200 -> 330 -> 460 as in the trace (it
    was 200, 388, 578)."""
    session = {
        "block_size": 64,
        "requests": [
            {"in": 200, "out": 50, "hash_ids": [1, 2, 3]},
            {"in": 330, "out": 50, "hash_ids": [1, 2, 3, 4, 5], "think_time": 1.0},
            {"in": 460, "out": 50, "hash_ids": [1, 2, 3, 4, 5, 6, 7], "think_time": 1.0},
        ],
    }
    (tmp_path / "weka_cc").mkdir()
    (tmp_path / "weka_cc" / "trace_0001.json").write_text(json.dumps(session))
    cfg = replace(CFG, workload="weka_cc", num_agents=1, length_scale=1.0, data_dir=str(tmp_path))
    (plan,) = build_agents(cfg)
    assert [plan.prompt_tokens(k) for k in range(3)] == [200, 330, 460]
    assert [t.gen_tokens for t in plan.turns] == [50, 50, 50]


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_mooncake_prompts_share_the_blocks_their_trace_shares(tmp_path, scale):
    """The simulator counts a Mooncake request's blocks shared with earlier requests as hits (37% of
    the conversation trace); the bench drew every prompt fresh, so the real system saw none (a review,
    2026-12-05). Blocks with equal hashes are now equal tokens, whatever the agent."""
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 1300, "output_length": 5, "hash_ids": [0, 1, 3]},
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [4, 5]},
    ]
    (tmp_path / "conversation_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = replace(
        CFG,
        workload="mooncake",
        num_agents=3,
        length_scale=scale,
        max_context_tokens=8192,
        data_dir=str(tmp_path),
    )
    plans = build_agents(cfg)
    a, b, c = (p.turns[0].append_ids for p in plans)
    block = round(512 * scale)
    assert [len(x) for x in (a, b, c)] == [round(n * scale) for n in (1100, 1300, 600)]
    shared = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
    assert shared == 2 * block  # the two blocks both traces hold, and no more
    assert a[0] != c[0] and build_agents(cfg)[1].turns[0].append_ids == b  # (and deterministic)
    fresh = build_agents(replace(cfg, token_seed=99))
    assert fresh[0].turns[0].append_ids[:block] != a[:block]  # a new token seed: a cold cache again


# ---- statistics ------------------------------------------------------------------------------------
def rec(agent, turn, start, e2e, ttft=0.1, tpot=0.01, ok=True, cached=0) -> TurnRecord:
    return TurnRecord(
        agent, turn, 100, 10, start_s=start, output_tokens=10 if ok else 0, cached_tokens=cached,
        ttft_s=ttft, ttst_s=ttft + tpot, tpot_s=tpot, e2e_s=e2e, ok=ok, error="" if ok else "x",
    )  # fmt: skip


def test_summary_percentiles_exact():
    records = [rec(0, i, float(i), 1.0, ttft=i / 100) for i in range(101)]
    s = summarize(records)
    assert s["ttft_p50_s"] == pytest.approx(0.50)
    assert s["ttft_p90_s"] == pytest.approx(0.90)
    assert s["ttft_p99_s"] == pytest.approx(0.99)
    assert s["tpot_p99_s"] == pytest.approx(0.01)
    assert s["turns"] == s["turns_ok"] == 101 and s["turns_failed"] == 0
    assert s["output_tokens"] == 1010 and s["prompt_tokens"] == 10100
    assert s["goodput"] == 1.0  # no SLO: every successful turn counts


def test_summary_jct_agent_times_and_goodput():
    records = [
        rec(0, 0, 0.0, 1.0, ttft=0.2, tpot=0.01, cached=0),  # meets both
        rec(0, 1, 1.0, 2.0, ttft=0.9, tpot=0.01, cached=64),  # TTFT too slow
        rec(1, 0, 0.5, 1.0, ttft=0.1, tpot=0.2, cached=0),  # TPOT too slow
        rec(1, 1, 2.0, 1.5, ttft=0.1, tpot=0.02, cached=96),  # meets both
        rec(2, 0, 1.0, 0.5, ok=False),  # failed
    ]
    s = summarize(records, slo_ttft_s=0.5, slo_tpot_s=0.05)
    assert s["agents"] == 3 and s["turns_failed"] == 1
    assert s["jct_s"] == pytest.approx(3.5)  # last end (2.0 + 1.5) - first start (0.0)
    assert s["agent_time_mean_s"] == pytest.approx((3.0 + 3.0 + 0.5) / 3)
    assert s["goodput"] == pytest.approx(2 / 5)
    assert s["goodput_turns_per_s"] == pytest.approx(2 / 3.5)
    assert s["cached_tokens"] == 160 and s["cache_hit_ratio"] == pytest.approx(160 / 400)
    assert summarize([])["goodput"] is None


def test_turns_never_sent_count_against_goodput_and_unfinished_agents_have_no_jct():
    """An agent stops at its first failed turn; its later turns are never sent. Goodput used to divide
    by the turns sent (0.99 where 0.9 of the planned turns succeeded) and the JCT and agent times
    counted the failed agent as done when it failed."""
    records = [rec(a, t, float(t), 1.0) for a in range(9) for t in range(16)]
    records.append(rec(9, 0, 0.0, 0.5, ok=False))  # agent 9 fails its first turn: 15 turns never sent
    planned = {a: 16 for a in range(10)}
    s = summarize(records, planned_turns=planned)
    assert s["goodput"] == pytest.approx(144 / 160)
    assert (s["turns_failed"], s["turns_not_sent"], s["agents_unfinished"]) == (1, 15, 1)
    assert s["jct_s"] is None
    assert s["agent_time_mean_s"] == pytest.approx(16.0)  # the 9 agents that finished
    complete = summarize(records[:-1], planned_turns={a: 16 for a in range(9)})
    assert complete["jct_s"] == pytest.approx(16.0) and complete["agents_unfinished"] == 0
    assert complete["goodput"] == 1.0 and complete["turns_not_sent"] == 0


def test_snic_windows_and_balance():
    samples = [
        (0.0, {"a": 0, "b": 0}),
        (1.0, {"a": 300, "b": 100}),  # max/avg = 300 / 200 = 1.5
        (2.0, {"a": 300, "b": 100}),  # idle: not averaged
        (3.0, {"a": 400, "b": 200, "c": 5}),  # c appears: no delta for it yet; 100/100 = 1.0
        (4.0, {"a": 400, "b": 200, "c": 35}),  # 30 / avg(0, 0, 30) = 3.0
    ]
    s = snic_stats(samples)
    assert s["nodes"] == ["a", "b", "c"]
    assert [w["bytes"] for w in s["windows"]][:2] == [{"a": 300, "b": 100, "c": 0}, {"a": 0, "b": 0, "c": 0}]
    assert s["bytes_total"] == {"a": 400, "b": 200, "c": 30}
    assert s["snic_max_over_avg"] == pytest.approx((1.5 + 1.0 + 3.0) / 3)
    assert snic_stats(samples[:1]) == {}


# ---- end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(demo_model_dir, tmp_path_factory):
    flags = ["--max-model-len", "1024", "--num-pages", "256", "--page-size", "16", "--dtype", "float32"]
    flags += ["--device", "cpu"]
    with serve_subprocess(demo_model_dir, tmp_path_factory.mktemp("agentic-log"), *flags) as (url, _, _):
        yield url


@pytest.mark.timeout(180)
def test_offline_replay_against_a_colocated_server(server, demo_model_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_agentic_args(parser)
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    args = parser.parse_args(
        ["--url", server, "--model-dir", demo_model_dir, "--num-agents", "3", "--max-turns", "3"]
        + ["--length-scale", "0.1", "--no-progress", "--sample-s", "0.2"]
        + ["--json", str(out_json), "--plot", str(out_png)]
    )
    payload = run_agentic(args)
    assert payload == json.loads(out_json.read_text())
    assert out_png.stat().st_size > 1000
    assert payload["config"]["vocab_size"] == 4096 and payload["config"]["max_context_tokens"] == 1024
    s = payload["summary"]
    assert s["turns"] == s["turns_ok"] == 9 and s["agents"] == 3, payload["turns"]
    assert s["jct_s"] > 0 and s["ttft_p50_s"] > 0
    assert payload["snic"] == {} and s["snic_max_over_avg"] is None  # a colocated engine: /pd/cluster 404
    assert sample_cluster(server) == {}

    # Same plan again through the library API, keeping the prompts sent.
    cfg = WorkloadConfig(
        **{k: v for k, v in payload["config"].items() if k in WorkloadConfig.__annotations__}
    )
    agents = build_agents(cfg)
    res = asyncio.run(run_offline(server, agents, sample_s=0, keep_prompts=True))
    assert res.outputs_sha256() == payload["outputs_sha256"]
    for plan in agents:
        outs, prompts = res.outputs[plan.agent], res.prompts[plan.agent]
        assert len(outs) == len(prompts) == len(plan.turns) == 3
        assert prompts == turn_prompts(plan, outs[:-1])
        for i, turn in enumerate(plan.turns):
            assert len(outs[i]) == turn.gen_tokens
            if i:
                assert prompts[i] == prompts[i - 1] + outs[i - 1] + turn.append_ids
    for r in res.records:
        assert r.ok and r.prompt_tokens == len(res.prompts[r.agent][r.turn])
        if r.turn:
            assert r.cached_tokens > 0, r
    # Plans and records agree with the first run turn by turn.
    first = [(t["agent"], t["turn"], t["prompt_tokens"], t["output_tokens"]) for t in payload["turns"]]
    assert first == [(r.agent, r.turn, r.prompt_tokens, r.output_tokens) for r in res.records]


@pytest.mark.timeout(120)
def test_online_replay_arrivals_and_same_outputs(server):
    """Poisson arrivals: each agent's first turn goes out no earlier than its arrival; greedy outputs do
    not depend on the arrival pattern (same sha256 as an offline run of the same plans)."""
    cfg = replace(CFG, num_agents=3, max_turns=2, max_context_tokens=1024, aps=10.0)
    agents = build_agents(cfg)
    online = asyncio.run(run_online(server, agents, sample_s=0))
    offline = asyncio.run(run_offline(server, agents, sample_s=0))
    assert online.mode == "online" and offline.mode == "offline"
    assert online.outputs_sha256() == offline.outputs_sha256()
    assert all(r.ok for r in online.records) and len(online.records) == sum(len(p.turns) for p in agents)
    for plan in agents:
        first = next(r for r in online.records if r.agent == plan.agent and r.turn == 0)
        assert first.start_s >= plan.start_s - 1e-3
    s = summarize(online.records, slo_ttft_s=60.0, slo_tpot_s=60.0)
    assert s["goodput"] == 1.0 and s["ttft_p99_s"] >= s["ttft_p50_s"] > 0
    assert summarize(online.records, slo_ttft_s=0.0)["goodput"] == 0.0


# ---- a fake router: /pd/cluster sampling and failed turns ------------------------------------------
@pytest.fixture(scope="module")
def fake_router():
    """Streams `max_tokens` token ids per completion (one chunk each) and serves `/pd/cluster` whose
    two SNIC counters grow 2:1 with every prompt token; `{"fail": true}` in a body answers HTTP 400."""
    import threading
    import time

    app, served = FastAPI(), {"a": 0, "b": 0}

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await http.json()
        if body.get("fail"):
            return JSONResponse({"error": {"message": "refused"}}, 400)
        prompt = body["prompt"]
        served["a"] += 2 * len(prompt)
        served["b"] += len(prompt)

        async def events():
            for k in range(body["max_tokens"]):
                choice = {"index": 0, "text": "x", "token_ids": [(sum(prompt) + k) % 97]}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": len(prompt), "prompt_tokens_details": {"cached_tokens": 16}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/pd/cluster")
    async def cluster():
        return {"nodes": {n: {"snic_bytes_served": v, "role": "decode"} for n, v in served.items()}}

    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(10)


def test_cluster_sampling_reports_snic_balance(fake_router):
    assert set(sample_cluster(fake_router)["nodes"]) == {"a", "b"}
    cfg = replace(CFG, num_agents=3, max_turns=4, think_s=0.05)
    agents = build_agents(cfg)
    res = asyncio.run(run_offline(fake_router, agents, sample_s=0.02))
    assert all(r.ok and r.cached_tokens == 16 for r in res.records)
    assert len(res.snic["windows"]) >= 2 and res.snic["nodes"] == ["a", "b"]
    assert res.snic["bytes_total"]["a"] == 2 * res.snic["bytes_total"]["b"] > 0
    assert res.snic["snic_max_over_avg"] == pytest.approx(2 / 1.5)  # 2:1 in every busy window


def test_failed_turn_stops_its_agent(fake_router):
    agents = build_agents(replace(CFG, num_agents=2, max_turns=3))
    res = asyncio.run(run_offline(fake_router, agents, sample_s=0, extra_body={"fail": True}))
    assert [(r.agent, r.turn, r.ok) for r in res.records] == [(0, 0, False), (1, 0, False)]
    assert "HTTP 400" in res.records[0].error and res.outputs_sha256() == Result("x").outputs_sha256()
    s = summarize(res.records)
    assert s["turns_failed"] == 2 and s["goodput"] == 0.0 and s["ttft_p50_s"] is None


def test_failed_turns_say_why(server, demo_model_dir, capsys):
    """`--model nosuch` printed a table of dashes with turns_failed 2 and never said why."""
    parser = argparse.ArgumentParser()
    add_agentic_args(parser)
    args = parser.parse_args(
        ["--url", server, "--model-dir", demo_model_dir, "--num-agents", "1", "--max-turns", "2"]
        + ["--length-scale", "0.1", "--no-progress", "--sample-s", "0", "--model", "nosuch"]
    )
    assert run_agentic(args)["summary"]["turns_ok"] == 0
    err = capsys.readouterr().err
    assert "turn(s) failed; the first (agent 0, turn 0): HTTP 4" in err and "nosuch" in err, err


@pytest.mark.timeout(120)
def test_the_bench_sends_the_api_key_of_the_environment(demo_model_dir, tmp_path, monkeypatch):
    """A server started with `--api-key` answered the bench's requests 401 (it sent no key; the bench
    then failed on a KeyError): it sends $PDSERVE_API_KEY, and says what the server answered."""
    flags = ["--max-model-len", "512", "--num-pages", "64", "--dtype", "float32", "--device", "cpu"]
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    with serve_subprocess(demo_model_dir, tmp_path, *flags, "--api-key", "sk-bench") as (url, _, _):
        parser = argparse.ArgumentParser()
        add_agentic_args(parser)
        args = parser.parse_args(
            ["--url", url, "--model-dir", demo_model_dir, "--num-agents", "1", "--max-turns", "2"]
            + ["--length-scale", "0.1", "--no-progress", "--sample-s", "0"]
        )
        with pytest.raises(ValueError, match="/v1/models answered 401"):
            run_agentic(args)
        monkeypatch.setenv("PDSERVE_API_KEY", "sk-bench")
        assert run_agentic(args)["summary"]["turns_ok"] == 2
