"""The benchmark commands' edges (a review of the bench tools, 2026-12-02, fourth session; each test
failed before its fix): settings a run cannot use are one `error:` line before anything starts, the
serve bench's wall time ends at the last answer, the DualPath bench claims identical outputs only when
it compared two runs."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from pdserve.cli import main
from pdserve.demo import free_port


def _main(argv: list[str]) -> int:
    """The CLI's exit code; an exception escaping `main` (a traceback for the user) fails the test."""
    try:
        return main(argv)
    except SystemExit as e:  # argparse usage error
        return int(e.code)
    except Exception as e:  # noqa: BLE001
        pytest.fail(
            f"`pdserve {' '.join(argv)}` raised {type(e).__name__}: {e} (a traceback, not an error line)"
        )


# ---- bench offline ---------------------------------------------------------------------------------


def test_bench_offline_runs_with_a_single_request(demo_model_dir, capsys):
    """`--num-requests 1` passed the parser but the warm-up sent `prompts[:2]` (one prompt) with
    two SamplingParams: "error: 1 prompts but 2 sampling params", rc 2, nothing measured."""
    rc = _main(f"bench offline --model {demo_model_dir} --num-requests 1 --seed 200 --repeats 1".split())
    err = capsys.readouterr().err
    assert rc == 0, err


@pytest.mark.parametrize("flag", [["--dtype", "auto"], ["--device", "auto"]])
def test_bench_offline_auto_dtype_or_device_is_not_a_traceback(demo_model_dir, flag):
    """`bench offline` took any --dtype/--device string. "auto", the default of every other command
    and accepted by `LLM`, loaded pdserve's side and then crashed on the HF side:
    KeyError 'auto' (the dtype dict) / RuntimeError from `.to("auto")`."""
    rc = _main(
        f"bench offline --model {demo_model_dir} --num-requests 2 --seed 622 --repeats 1".split() + flag
    )
    assert rc == 0


def test_bench_offline_repeats_zero_is_an_error_line(demo_model_dir):
    """`--repeats 0` loaded both models, ran no timed pass, then failed with UnboundLocalError."""
    rc = _main(f"bench offline --model {demo_model_dir} --num-requests 2 --seed 622 --repeats 0".split())
    assert rc == 2


# ---- bench serve -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", ["0", "-2"])
def test_bench_serve_rate_must_be_positive(rate):
    """`--rate 0`: ZeroDivisionError in `random.expovariate` (a traceback; in the side-by-side mode
    after the PD cluster has started). `--rate -2`: negative gaps, every request is sent at once and the
    run is reported as a Poisson load."""
    url = f"http://127.0.0.1:{free_port()}"
    rc = _main(["bench", "serve", "--url", url, "--rate", rate, "--num-requests", "3"])
    assert rc == 2


def test_bench_serve_throughput_excludes_the_wait_after_the_last_arrival(monkeypatch, tmp_path):
    """`run_load` sleeps one more inter-arrival gap after sending the LAST request before it gathers
    the answers, and that sleep is inside the `wall_s` that divides `output_tok_s`. Here the one request
    is answered at once, yet wall_s is the whole 0.5 s gap that follows it."""
    from pdserve.bench import serve

    async def instant(client, url, model, body):
        return serve.Result(True, 0.001, 0.001, [], 10)

    monkeypatch.setattr(serve, "one", instant)
    rate = random.Random(1).expovariate(1.0) / 0.5  # seed 0 -> Random(1): the first gap is 0.5 s
    out = tmp_path / "serve.json"
    rc = _main(
        f"bench serve --url http://127.0.0.1:9 --served-model-name demo --num-requests 1 --rate {str(rate)} "
        f"--json {str(out)}".split()
    )
    assert rc == 0
    row = json.loads(out.read_text())["runs"][0]
    assert row["wall_s"] < 0.2, row  # the last answer came back in ~0 s


@pytest.mark.timeout(120)
def test_bench_serve_against_a_server_asks_its_model_name_and_says_why_requests_failed(
    demo_model_dir, tmp_path, capsys
):
    """`bench serve --url` sent the model name "demo" whatever the server served: against the README's
    own `pdserve serve --model .demo-model` every request was a 404, reported as a table of 0 ok and
    nan latencies with no reason (a README walk-through). It asks /v1/models now, and prints the
    first failure of a setup whose requests failed."""
    from tests.conftest import serve_subprocess

    flags = ["--max-model-len", "1024", "--num-pages", "128", "--dtype", "float32", "--device", "cpu"]
    with serve_subprocess(demo_model_dir, tmp_path, *flags) as (url, _, _):
        base = ["bench", "serve", "--url", url, "--num-requests", "2", "--rate", "50", "--max-tokens", "4"]
        base += ["--short-words", "5", "--long-fraction", "0"]
        assert _main(base + ["--json", str(tmp_path / "ok.json")]) == 0
        assert json.loads((tmp_path / "ok.json").read_text())["runs"][0]["ok"] == 2
        capsys.readouterr()
        assert _main(base + ["--served-model-name", "no-such-model"]) == 1
        assert "given: 2 of 2 failed, the first: HTTP 404" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_bench_soak_sends_the_api_key_of_the_environment(demo_model_dir, tmp_path, monkeypatch):
    """Soak launches its own cluster, which inherits $PDSERVE_API_KEY; its requests sent no key, so
    with the variable exported every one was a 401 and calibration measured 0 requests/s (a review
    of this session's changes)."""
    import asyncio

    import httpx

    from pdserve.bench.soak import Traffic, _calibrate
    from tests.conftest import serve_subprocess

    monkeypatch.setenv("PDSERVE_API_KEY", "sk-soak")  # (the server reads it too, as launch's children)
    flags = ["--device", "cpu", "--dtype", "float32", "--num-pages", "256", "--max-model-len", "2048"]
    with serve_subprocess(demo_model_dir, tmp_path, *flags) as (url, _, _):
        assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 401
        assert asyncio.run(_calibrate(url, Traffic(0, 4096, 2), 1, 2.0)) > 0


# ---- bench transfer --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--page-kib", "1024", "--total-mib", "1"],  # 512 KiB per region < one page: 0 pages
        ["--page-kib", "4", "12", "--total-mib", "4"],  # 12 KiB does not divide the region
    ],
)
def test_bench_transfer_bad_page_sizes_are_an_error_line(args):
    """Page sizes the run cannot lay out are not checked up front. `--page-kib 4 12`: RuntimeError
    traceback from `Tensor.view` (after the receiver process and both NIXL agents started). `--page-kib
    1024 --total-mib 1`: the sender prints an `error:` line (StagingPool), but it exits without telling
    the spawned receiver, which dies on EOFError with a traceback and a C++ "terminate called without
    an active exception" (its NIXL agent never closed): the same happens on any error in the sender."""
    from pdserve.transfer.nixl_backend import nixl_available

    if not nixl_available():
        pytest.skip("NIXL not installed")
    p = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "transfer", *args, "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in out and "error:" in out, out[-1500:]


# ---- bench dualpath --------------------------------------------------------------------------------


def _fake_run(policy: str, sha: str, failed: int) -> dict:
    summary = {"jct_s": 10.0, "agent_time_mean_s": 5.0, "ttft_p50_s": 0.1, "tpot_p50_s": 0.01}
    summary |= {"goodput": 1.0, "turns_failed": failed}
    return {
        "policy": policy,
        "wall_s": 10.0,
        "summary": summary,
        "snic": {},
        "outputs_sha256": sha,
        "storage_hit_tokens": 0,
        "records": [],
    }


@pytest.mark.parametrize("policies", [",", "round_robin,dualpth"])
def test_bench_dualpath_checks_its_policies_before_any_cluster(demo_model_dir, monkeypatch, policies):
    """`--policies ","` (no policy) ends in IndexError (`rows[0]`). A typo ("dualpth") is found only
    when its router refuses to start, after the first policy's whole run (minutes): RuntimeError
    traceback, and the finished run's figures are lost (no JSON)."""
    from pdserve.bench import dualpath_compare

    calls = []

    def fake_run_policy(a, model_dir, policy, agents, online):
        calls.append(policy)
        return _fake_run(policy, "same", 0)

    monkeypatch.setattr(dualpath_compare, "run_policy", fake_run_policy)
    rc = _main(["bench", "dualpath", "--model", demo_model_dir, "--policies", policies, "--num-agents", "2"])
    assert rc == 2 and calls == [], calls


def test_bench_dualpath_outputs_identical_needs_two_comparable_runs(demo_model_dir, monkeypatch, tmp_path):
    """`outputs_identical` is `len(shas) == 1` over the runs WITHOUT failed turns: when one policy lost
    a turn, a single run is left and the JSON/table say "greedy outputs identical across policies:
    True" although nothing was compared (here the two runs' outputs even differ)."""
    from pdserve.bench import dualpath_compare

    runs = {"round_robin": _fake_run("round_robin", "aaa", 1), "dualpath": _fake_run("dualpath", "bbb", 0)}
    monkeypatch.setattr(dualpath_compare, "run_policy", lambda a, m, policy, agents, online: runs[policy])
    out = tmp_path / "dp.json"
    _main(["bench", "dualpath", "--model", demo_model_dir, "--num-agents", "2", "--json", str(out)])
    assert json.loads(out.read_text())["outputs_identical"] is not True


def test_bench_dualpath_repeats_alternate_the_policies_order_and_compare_medians(
    demo_model_dir, monkeypatch, tmp_path, capsys
):
    """Basic always ran first: on a machine that warms up (or that another job loads later) one policy
    always met it alone. `--repeats 3` runs A B, B A, A B; each repeat's speedup is against its own
    baseline run, and the medians are compared."""
    from pdserve.bench import dualpath_compare

    calls = []
    jct = {"round_robin": [30.0, 20.0, 22.0], "dualpath": [10.0, 11.0, 40.0]}  # per repeat

    def fake_run_policy(a, model_dir, policy, agents, online):
        calls.append(policy)
        run = _fake_run(policy, "same", 0)
        run["summary"] = run["summary"] | {"jct_s": jct[policy][calls.count(policy) - 1]}
        return run

    monkeypatch.setattr(dualpath_compare, "run_policy", fake_run_policy)
    monkeypatch.setattr(dualpath_compare, "_plot", lambda runs, path: None)
    out = tmp_path / "dp.json"
    args = ["bench", "dualpath", "--model", demo_model_dir, "--num-agents", "2", "--repeats", "3"]
    assert _main([*args, "--json", str(out)]) == 0
    assert calls == ["round_robin", "dualpath", "dualpath", "round_robin", "round_robin", "dualpath"]
    got = json.loads(out.read_text())
    rows = [(r["policy"], r["repeat"], r["jct_s"], r["jct_speedup_vs_first"]) for r in got["runs"]]
    assert rows == [
        ("round_robin", 0, 30.0, 1.0),
        ("dualpath", 0, 10.0, 3.0),
        ("dualpath", 1, 11.0, 20.0 / 11.0),
        ("round_robin", 1, 20.0, 1.0),
        ("round_robin", 2, 22.0, 1.0),
        ("dualpath", 2, 40.0, 22.0 / 40.0),
    ]
    assert got["median_jct_s"] == {"round_robin": 22.0, "dualpath": 11.0}
    assert got["median_jct_speedup_vs_first"] == {"round_robin": 1.0, "dualpath": 2.0}
    assert "dualpath: median JCT 11 s, 2x the first policy's median" in capsys.readouterr().out
    # online sweeps are not repeated (hours): refused before any cluster starts
    calls.clear()
    assert _main([*args, "--mode", "online"]) == 2 and calls == []


def test_bench_dualpath_repeats_compare_the_whole_repeats_and_keep_the_finished_ones(
    demo_model_dir, monkeypatch, tmp_path, capsys
):
    """A repeat in which a policy lost turns (no JCT) voided every median; a cluster that failed to start
    in a later repeat lost the earlier repeats' figures (no JSON)."""
    from pdserve.bench import dualpath_compare

    calls = []
    jct = {"round_robin": [30.0, None, 20.0], "dualpath": [10.0, 11.0, 12.0]}

    def fake_run_policy(a, model_dir, policy, agents, online):
        calls.append(policy)
        n = calls.count(policy) - 1
        if n >= len(jct[policy]):
            raise RuntimeError("the prefill engine did not start")
        run = _fake_run(policy, "same", 0 if jct[policy][n] else 2)
        run["summary"] = run["summary"] | {"jct_s": jct[policy][n]}
        return run

    monkeypatch.setattr(dualpath_compare, "run_policy", fake_run_policy)
    monkeypatch.setattr(dualpath_compare, "_plot", lambda runs, path: None)
    out = tmp_path / "dp.json"
    args = ["bench", "dualpath", "--model", demo_model_dir, "--num-agents", "2", "--json", str(out)]
    assert _main([*args, "--repeats", "3"]) == 1  # (a repeat lost turns: the run fails, as before)
    got = json.loads(out.read_text())
    assert got["repeats_compared"] == 2  # repeats 0 and 2; repeat 1's round_robin lost turns
    assert got["median_jct_s"] == {"round_robin": 25.0, "dualpath": 11.0}
    assert got["median_jct_speedup_vs_first"]["dualpath"] == pytest.approx(25.0 / 11.0)
    calls.clear()
    # the 4th repeat (dualpath first) does not start its cluster: the three before it are kept
    assert _main([*args, "--repeats", "4"]) == 1
    partial = json.loads(out.read_text())
    assert "RuntimeError: the prefill engine did not start" in partial["incomplete"]
    assert [r["repeat"] for r in partial["runs"]] == [0, 0, 1, 1, 2, 2]


def test_first_divergences_name_each_agents_first_differing_token():
    from pdserve.bench.agentic import AgentPlan, TurnPlan
    from pdserve.bench.divergence import first_divergences

    plans = [AgentPlan(a, 0.0, [TurnPlan([a, 1], 3, 0.0), TurnPlan([2], 3, 0.0)]) for a in range(3)]
    a = {0: [[5, 6, 7], [8, 9, 10]], 1: [[5, 6, 7], [8, 9, 10]], 2: [[5, 6, 7], [8, 9]]}
    b = {0: [[5, 6, 7], [8, 4, 11]], 1: [[5, 6, 7], [8, 9, 10]], 2: [[5, 6, 7], [8, 9, 3]]}
    got = [
        (d.agent, d.turn, d.token_index, d.token_a, d.token_b, d.prompt_ids)
        for d in first_divergences(plans, a, b)
    ]
    # (agent 0: turn 1's prompt is turn 0's prompt + its output + turn 1's append, then A's [8])
    assert got == [(0, 1, 1, 9, 4, (0, 1, 5, 6, 7, 2, 8)), (2, 1, 2, -1, 3, (2, 1, 5, 6, 7, 2, 8, 9))]


def test_a_divergence_is_judged_a_near_tie_only_at_one(demo_model_dir):
    """The demo model's first greedy token after this prompt is 3265, 6e-5 in logprob above 1670 (the
    smallest gap at a first step in a search over 4,000 prompts like it): a flip there is rounding.
    Elsewhere, or to a token that is not the runner-up, it is a real mismatch."""
    from pdserve import LLM
    from pdserve.bench.divergence import NEAR_TIE_LOGPROB, Divergence, judge
    from tests.test_pd_e2e import warm_prompts

    llm = LLM(demo_model_dir, dtype="float32", device="cpu", max_model_len=1024)
    ids = llm.engine.tokenizer.encode(warm_prompts()[2] + "    cleanquem")
    tie = judge(llm, Divergence(0, 0, 0, 3265, 1670, tuple(ids)))
    assert tie.near_tie and tie.gap < NEAR_TIE_LOGPROB
    assert not judge(llm, Divergence(0, 0, 0, 3265, 7, tuple(ids))).near_tie  # (not the runner-up)
    clear = judge(llm, Divergence(0, 0, 1, 243, 2582, (*ids, 3265)))  # (its gap: 0.013)
    assert not clear.near_tie and clear.gap > 10 * NEAR_TIE_LOGPROB


def test_bench_dualpath_fails_on_a_real_mismatch_and_names_it(demo_model_dir, monkeypatch, tmp_path):
    """Outputs that differ between policies: the first differing token of each agent is judged on a
    colocated engine; a difference that is not at a near-tie fails the run (exit 1) and is named in the
    JSON (a real mismatch: wrong KV somewhere). `make demo` once reported "not identical" with nothing
    to tell rounding from a bug."""
    from pdserve.bench import dualpath_compare

    def fake(a, model_dir, policy, agents, online):
        outputs = {p.agent: [[7] * t.gen_tokens for t in p.turns] for p in agents}
        if policy == "dualpath":
            outputs[agents[0].agent][0] = [7, 9] + [7] * (agents[0].turns[0].gen_tokens - 2)
        return _fake_run(policy, policy, 0) | {"outputs": outputs}

    monkeypatch.setattr(dualpath_compare, "run_policy", fake)
    out = tmp_path / "dp.json"
    rc = _main(["bench", "dualpath", "--model", demo_model_dir, "--num-agents", "2", "--json", str(out)])
    got = json.loads(out.read_text())
    assert rc == 1 and got["outputs_identical"] is False
    [d] = got["outputs_divergences"]
    assert (d["agent"], d["turn"], d["token_index"], d["token_a"], d["token_b"]) == (0, 0, 1, 7, 9)
    assert d["near_tie"] is False and d["policies"] == ["round_robin", "dualpath"]


# ---- bench soak ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [["--prefill", "0"], ["--decode", "0"]])
def test_bench_soak_engine_counts_are_checked_before_anything_starts(demo_model_dir, monkeypatch, flag):
    """`bench soak --prefill 0` (or `--decode 0`) is accepted (plain `type=int`, where `launch` uses
    `_count`): the cluster starts its engines, then the router refuses an empty `--prefill` list and the
    user gets `RuntimeError: router exited with code 2` as a traceback."""
    import pdserve.launch

    started = []

    def fake_start_cluster(args, num_prefill, num_decode, *rest, **kw):
        started.append((num_prefill, num_decode))
        raise RuntimeError("router exited with code 2")  # what the real one ends in

    monkeypatch.setattr(pdserve.launch, "start_cluster", fake_start_cluster)
    rc = _main(["bench", "soak", "--model", demo_model_dir, "--minutes", "0.01", *flag])
    assert rc == 2 and started == [], started


def test_a_results_table_in_a_log_keeps_its_headers_and_policy_names(capsys):
    """Piped or logged, rich drew 80 columns: "jct_sp…", "round_…" (a new-user review, 2026-12-04)."""
    from pdserve.bench.dualpath_compare import _print

    row = {"jct_s": 2.315, "jct_speedup_vs_first": 1.0, "ttft_p50_s": 0.5, "tpot_p50_s": 0.02}
    row |= {"goodput": 1.0, "snic_max_over_avg": 3.0, "storage_hit_tokens": 50944}
    runs = [{"policy": "round_robin", **row}, {"policy": "dualpath", **row}]
    _print({"nodes": "p0:1p,d0:1d,d1:1d", "snic_mbps": 8.0, "mode": "offline", "runs": runs})
    out = capsys.readouterr().out
    for name in (
        "round_robin",
        "dualpath",
        "jct_speedup_vs_first",
        "snic_max_over_avg",
        "storage_hit_tokens",
    ):
        assert name in out, out


def test_the_plotted_completion_times_end_at_the_summarys_jct():
    """The plot counted from the run's start and the JCT from its first send: the curve ended ~25 ms
    past the JSON's `jct_s` (a new-user review, 2026-12-04)."""
    from pdserve.bench.agentic import TurnRecord, summarize
    from pdserve.bench.dualpath_compare import done_times

    records = [
        TurnRecord(agent=0, turn=0, prompt_tokens=8, gen_tokens=2, start_s=0.025, e2e_s=1.0, ok=True),
        TurnRecord(agent=0, turn=1, prompt_tokens=9, gen_tokens=2, start_s=1.1, e2e_s=1.2, ok=True),
        TurnRecord(agent=1, turn=0, prompt_tokens=8, gen_tokens=2, start_s=0.03, e2e_s=0.5, ok=True),
    ]
    assert done_times(records) == pytest.approx([0.505, 2.275])
    assert done_times(records)[-1] == pytest.approx(summarize(records)["jct_s"])


# ---- answers the server cut short (a review of the bench tools, 2026-12-04 late) --------------------


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _stream_answer(text_chunks: int, finish_reason: str, completion_tokens: int) -> bytes:
    chunks = [{"choices": [{"index": 0, "text": "x", "finish_reason": None}]} for _ in range(text_chunks)]
    chunks[-1]["choices"][0]["finish_reason"] = finish_reason
    chunks.append({"choices": [], "usage": {"completion_tokens": completion_tokens}})
    return _sse(*chunks)


@pytest.mark.parametrize(
    ("finish_reason", "num_tokens", "ok"),
    [("length", 8, True), ("abort", 3, False), ("length", 3, False), (None, 8, False)],
)
def test_bench_serve_and_soak_count_an_aborted_or_short_answer_as_failed(finish_reason, num_tokens, ok):
    """An `/abort_request` (or a weight update, or a shutdown) ends a request with a 200 and
    `finish_reason` "abort": `bench serve` counted 6 of 6 such answers "ok" (895 of 2,400 tokens) and
    exited 0, and `bench soak` counted them as successes, latencies and all. The benches send
    `ignore_eos`: an answer counts only when it is finished with all its tokens."""
    import asyncio

    import httpx

    from pdserve.bench.serve import one
    from pdserve.bench.soak import _send

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("stream"):
            content = _stream_answer(max(num_tokens, 1), finish_reason, num_tokens)
            return httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})
        answer = {"choices": [{"index": 0, "text": "x" * num_tokens, "finish_reason": finish_reason}],
                  "usage": {"completion_tokens": num_tokens}}  # fmt: skip
        return httpx.Response(200, json=answer)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            served = await one(client, "http://s", "m", {"prompt": "p", "max_tokens": 8, "stream": True})
            soaked = [
                await _send(client, "http://s", {"prompt": [1], "max_tokens": 8, "stream": stream})
                for stream in (True, False)
            ]
            return served, soaked

    served, soaked = asyncio.run(go())
    assert served.ok is ok, served
    assert [s[0] for s in soaked] == [ok, ok], soaked
    if finish_reason == "abort":
        assert "aborted by the server after 3 of 8 tokens" in served.error


def test_bench_serve_percentiles_interpolate_and_a_one_token_answer_has_no_tpot():
    """`pct` read rank int(q/100 * n): p50 of [10, 20] was 20, p99 of 1..100 the maximum; one-token
    answers gave TPOT 0.0 (it is undefined) and no answers a JSON file with bare NaN."""
    from pdserve.bench.serve import Result, pct, summarize

    assert pct([10.0, 20.0], 50) == 15.0
    assert pct([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)
    assert pct([], 50) is None
    row = summarize("x", [Result(True, 0.1, None, [], 1), Result(False, error="e")], 1.0)
    assert row["tpot_p50_ms"] is None and row["ttft_p50_ms"] == 100.0
    json.dumps(row, allow_nan=False)  # (strict JSON: no NaN)
    json.dumps(summarize("y", [Result(False, error="e")], 1.0), allow_nan=False)


def test_bench_serve_model_that_is_not_a_checkpoint_is_an_error_not_a_demo_model(tmp_path):
    """A typo in `--model` was filled with a random-weight demo checkpoint (config, weights, tokenizer
    written into that directory) and benchmarked, rc 0."""
    typo = tmp_path / "no-such-model"
    assert _main(["bench", "serve", "--model", str(typo), "--num-requests", "1"]) == 2
    assert not typo.exists()


def test_bench_dualpath_online_marks_a_censored_max_aps_and_compares_outputs_across_rates(
    demo_model_dir, monkeypatch, tmp_path, capsys
):
    """Online: a policy that met the SLO at every rate tried has a maximum of at least the top rate,
    not that rate; the ratio was printed as exact ("5.00x") where it is a floor. And every rate
    replays the same prompts, yet outputs were compared only offline (an online mismatch exited 0)."""
    from pdserve.bench import dualpath_compare

    def fake(a, model_dir, policy, agents, online):
        calls[policy].append(len(calls[policy]))
        n = len(calls[policy])  # (this policy's n-th rate, ascending)
        # round_robin meets the SLO at its first rate only; dualpath at every rate, but its second
        # rate's greedy outputs differ from all the others'
        goodput = 1.0 if policy == "dualpath" or n == 1 else 0.5
        sha = "y" if policy == "dualpath" and n == 2 else "x"
        run = _fake_run(policy, sha, 0)
        return run | {"summary": run["summary"] | {"goodput": goodput}}

    calls = {"round_robin": [], "dualpath": []}
    monkeypatch.setattr(dualpath_compare, "run_policy", fake)
    monkeypatch.setattr(dualpath_compare, "_divergences", lambda *a: [])  # (none found: unexplained)
    out = tmp_path / "dp.json"
    argv = ["bench", "dualpath", "--model", demo_model_dir, "--num-agents", "2", "--mode", "online"]
    rc = _main([*argv, "--aps", "0.5,1,2", "--json", str(out)])
    got = json.loads(out.read_text())
    maxima = [r for r in got["runs"] if "max_aps" in r]
    assert [(r["max_aps"], r["max_aps_is_lower_bound"]) for r in maxima] == [(0.5, False), (2.0, True)]
    assert got["max_aps_ratio_last_vs_first"] == 4.0 and got["max_aps_ratio_bound"] == "lower"
    printed = capsys.readouterr().out
    assert "last policy / first: >= 4.00x" in printed
    assert got["outputs_identical"] is False and rc == 1  # (dualpath's second rate answered otherwise)
    assert "identical across policies and rates: False" in printed


def test_the_plotted_completion_times_leave_out_agents_that_did_not_finish():
    """The summary leaves agents that lost a turn out of the agent times (and has no JCT); the plots
    drew their cut-short times, a CDF reaching 1.0 over agents the summary says did not finish."""
    from pdserve.bench.agentic import TurnRecord, agent_times, summarize
    from pdserve.bench.dualpath_compare import done_times

    records = [
        TurnRecord(agent=0, turn=0, prompt_tokens=8, gen_tokens=2, start_s=0.0, e2e_s=1.0, ok=True),
        TurnRecord(agent=0, turn=1, prompt_tokens=9, gen_tokens=2, start_s=1.1, e2e_s=1.2, ok=True),
        TurnRecord(agent=1, turn=0, prompt_tokens=8, gen_tokens=2, start_s=0.0, e2e_s=0.5, ok=False),
    ]
    planned = {0: 2, 1: 2}
    assert summarize(records, planned_turns=planned)["agents_unfinished"] == 1
    assert list(agent_times(records, planned)) == [0]
    assert done_times(records, planned) == pytest.approx([2.3])


def test_the_benches_refuse_a_trace_timed_workload_whose_timing_they_would_not_replay():
    """`mooncake@trace` keeps the trace's arrival times in the simulator; the benches replaced them by
    all-zero (offline) or Poisson (online) ones without a word."""
    from pdserve.bench.agentic import WorkloadConfig, build_agents

    with pytest.raises(ValueError, match="not its timing"):
        build_agents(WorkloadConfig(workload="mooncake@trace", num_agents=2, vocab_size=100))


def test_time_per_output_token_counts_only_the_tokens_after_the_first_chunk():
    """A stream whose chunks carry several tokens (the server coalesces the steps its client has not
    read yet): TPOT was (last - first) / (tokens - 1), so a first chunk of 3 tokens of 6 gave 0.06 s
    for tokens that came 0.1 s apart."""
    from pdserve.bench import time_per_output_token

    assert time_per_output_token([(1.0, 3), (1.1, 4), (1.3, 6)]) == pytest.approx(0.1)
    assert time_per_output_token([(1.0, 1), (1.1, 2), (1.2, 3)]) == pytest.approx(0.1)
    assert time_per_output_token([(1.0, 4)]) is None  # (every token in the first chunk)
    assert time_per_output_token([]) is None


class _Clock:
    """`time` for a bench module under test: `perf_counter` returns the given instants in turn."""

    def __init__(self, *instants: float) -> None:
        self._instants = iter(instants)

    def perf_counter(self) -> float:
        return next(self._instants)


@pytest.mark.parametrize("continuous_usage", [True, False])
def test_bench_serve_tpot_uses_each_chunks_token_count(monkeypatch, continuous_usage):
    """`bench serve` asks for the usage in every chunk (vLLM's `continuous_usage_stats`) and counts a
    chunk's tokens from it. From a server that leaves it out a chunk's tokens are not known: the first
    is taken as one and the rest from the final usage (one token per chunk made TPOT a time per chunk:
    0.15 s here, 4x too long with 4-token chunks)."""
    import asyncio

    import httpx

    from pdserve.bench import serve

    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen["stream_options"] = body["stream_options"]  # (as `make_requests` builds it)
        chunks = []
        for so_far in (3, 4, 6):  # tokens received after each chunk
            chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            if continuous_usage:
                chunk["usage"] = {"completion_tokens": so_far}
            chunks.append(chunk)
        chunks[-1]["choices"][0]["finish_reason"] = "length"
        chunks.append({"choices": [], "usage": {"completion_tokens": 6}})
        return httpx.Response(200, content=_sse(*chunks), headers={"content-type": "text/event-stream"})

    monkeypatch.setattr(serve, "time", _Clock(0.0, 1.0, 1.1, 1.3))  # sent, then one per chunk

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            body = serve.make_requests(1, 0.0, 8, 8, max_tokens=6, seed=0)[0]
            return await serve.one(client, "http://s", "m", body)

    result = asyncio.run(go())
    assert seen["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert result.ok and result.num_tokens == 6
    assert result.ttft_s == pytest.approx(1.0)
    assert result.itl_s == pytest.approx([0.1, 0.2])
    # 0.3 s over the 3 tokens after the first chunk; without the usage, over 6 - 1 tokens
    assert result.tpot_s == pytest.approx(0.1 if continuous_usage else 0.06)


def test_bench_agentic_tpot_counts_the_token_ids_of_each_chunk(monkeypatch):
    import asyncio

    import httpx

    from pdserve.bench import agentic

    def handler(request: httpx.Request) -> httpx.Response:
        chunks = [
            {"choices": [{"index": 0, "text": "x", "token_ids": ids}]} for ids in ([5, 6, 7], [8], [9, 10])
        ]
        chunks.append({"choices": [], "usage": {"completion_tokens": 6}})
        return httpx.Response(200, content=_sse(*chunks), headers={"content-type": "text/event-stream"})

    monkeypatch.setattr(agentic, "time", _Clock(0.0, 1.0, 1.1, 1.3, 1.4))  # sent, chunks, end

    async def go():
        rec = agentic.TurnRecord(agent=0, turn=0, prompt_tokens=4, gen_tokens=6)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            ids = await agentic._turn(client, "http://s", {"prompt": [1, 2, 3, 4]}, 0.0, rec)
        return rec, ids

    rec, ids = asyncio.run(go())
    assert ids == [5, 6, 7, 8, 9, 10] and rec.ok, rec
    assert rec.ttft_s == pytest.approx(1.0)
    assert rec.ttst_s == pytest.approx(1.0)  # (the second token came in the first chunk)
    assert rec.tpot_s == pytest.approx(0.1)  # was 0.3 / 5 = 0.06
    assert rec.e2e_s == pytest.approx(1.4)
