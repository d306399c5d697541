"""The simulator's command line and scenarios on input nobody had tried: a malformed or too-big HF
config, an APS grid out of order, a knee above the bisection's ceiling, a failing run that measured
nothing, a trace shorter than the agents asked for, `emulated`'s plot and JSON, and a bandwidth
check over no shape. Each test failed before its fix (a review of the simulator, 2026-12-02, sixth
session). The online tests replace the simulation run (`scenarios._online_run`) with a fake whose
mean TTFT is a known function of the APS, so only the search and the knee are exercised."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from pdserve.bench.workloads import load_workload
from pdserve.dualpath.cost_model import get_profile, hbm_kv_bytes
from pdserve.sim import scenarios
from pdserve.sim.cli import add_arguments, run
from pdserve.sim.scenarios import Overrides


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--accel", "off", *argv])


TINY = (
    "--agents",
    "2",
    "--prefill-nodes",
    "1",
    "--decode-nodes",
    "1",
    "--gpus-per-node",
    "1",
    "--policy",
    "basic",
    "--workload",
    "32k",
)


# ---------------------------------------------------------------- 1. malformed HF config.json


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
}


@pytest.mark.parametrize(
    "bad",
    [
        {"num_attention_heads": 0},  # ZeroDivisionError in profile_from_hf_config (hidden // heads)
        {"num_hidden_layers": 0},  # kv_bytes_per_token 0 -> ZeroDivisionError in ClusterSim.__init__
        {"hidden_size": 0},  # same
        {"num_hidden_layers": -32},  # negative costs -> OverflowError (int(inf)) for beta
    ],
)
def test_malformed_hf_config_is_a_usage_error_not_a_traceback(tmp_path, capsys, bad):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, **bad}))
    assert run(parse("--scenario", "ablation", "--model", str(cfg), *TINY)) == 2
    assert "error" in capsys.readouterr().err


# ---------------------------------------------------------------- 2. dense model too big for a GPU


def test_dense_hf_model_whose_weights_exceed_one_h200_is_an_error(tmp_path):
    """Llama-3-70B in bf16: ~141 GB of weights on the one GPU a dense model runs on. A MoE config whose
    weights do not fit gets a clear "leave no HBM for KV" error (hbm_kv_bytes); a dense one is silently
    given a 1 GB KV floor (profile_from_hf_config: free = max(..., 1e9)) and simulated as if it fit."""
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                **LLAMA,
                "hidden_size": 8192,
                "num_hidden_layers": 80,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "intermediate_size": 28672,
                "vocab_size": 128256,
                "torch_dtype": "bfloat16",
            }
        )
    )
    with pytest.raises(ValueError, match="weights"):
        p = get_profile(str(cfg))
        hbm_kv_bytes(p, True, p.decode_ep_gpus)


# ---------------------------------------------------------------- 3-5. online scenario knee search


def _fake_online(ttft_of):
    def fake(ov, cfg, wl_name, aps, horizon_s, warmup_s, progress=None):
        ttft = ttft_of(aps)
        return {
            "policy": cfg.mode,
            "aps": aps,
            "ttft_mean_s": ttft,
            "ttft_p50_s": ttft,
            "tpot_mean_s": None if ttft is None else 0.02,
            "jct_s": None,
        }

    return fake


def test_online_aps_grid_given_high_to_low_reports_the_highest_passing_aps(monkeypatch):
    """`--aps 2,0.8,0.5` (walking down from a guess): 2 fails, 0.8 and 0.5 pass (mean TTFT = 4 x APS,
    SLO 4 s). The loop sets best = aps at every pass, so max_aps ends as 0.5, not 0.8."""
    monkeypatch.setattr(scenarios, "_online_run", _fake_online(lambda aps: 4.0 * aps))
    res = scenarios.online(Overrides(aps=(2.0, 0.8, 0.5), policy=("dualpath",)), lambda s: None)
    assert {r["max_aps"] for r in res.runs} == {0.8}


def test_online_bisection_does_not_report_its_search_ceiling_as_the_max_aps(monkeypatch):
    """A cluster whose knee is above 3 APS (e.g. `--prefill-nodes 8 --decode-nodes 16`): mean TTFT =
    APS seconds, so the SLO holds up to 4.0 APS. The bisection is fixed to [0, 3.0] and never tests
    3.0, so every trial passes and max_aps / max_aps_interp are reported as 2.953 with no warning."""
    monkeypatch.setattr(scenarios, "_online_run", _fake_online(lambda aps: aps))
    res = scenarios.online(Overrides(policy=("dualpath",)), lambda s: None)
    knees = {r["max_aps_interp"] for r in res.runs}
    assert len(knees) == 1
    assert abs(knees.pop() - 4.0) < 0.25


def test_online_knee_survives_a_failing_run_that_measured_no_turn(monkeypatch):
    """A failing run with no turn measured after the warm-up has ttft_mean_s None (reproduced for real:
    `--scenario online --workload mooncake-synthetic --aps 1,2.5 --model ds-27b --prefill-nodes 1
    --decode-nodes 1 --policy dualpath`: the 3,993-row trace runs out before the warm-up ends).
    _interpolated_knee then compares None <= float: TypeError traceback."""
    monkeypatch.setattr(scenarios, "_online_run", _fake_online(lambda aps: 1.0 if aps <= 1 else None))
    res = scenarios.online(Overrides(aps=(1.0, 2.5), policy=("dualpath",)), lambda s: None)
    assert {r["max_aps"] for r in res.runs} == {1.0}


def test_online_ratio_is_a_bound_not_a_verdict_when_a_policy_never_failed(monkeypatch):
    """`--aps 0.5,1 --horizon-s 120`: every run of both policies met the SLO, and the check printed
    "[MISS] ... Basic 1.000, DualPath 1.000 -> 1.00x": no knee was found, so there is no ratio (found
    by a new-user review, 2026-12-04)."""

    def by_policy(basic_ttft, dualpath_ttft):
        def fake(ov, cfg, wl_name, aps, horizon_s, warmup_s, progress=None):
            ttft_of = basic_ttft if cfg.mode == "basic" else dualpath_ttft
            return _fake_online(ttft_of)(ov, cfg, wl_name, aps, horizon_s, warmup_s)

        return fake

    grid = Overrides(aps=(0.5, 1.0), policy=("basic", "dualpath"))
    monkeypatch.setattr(scenarios, "_online_run", by_policy(lambda aps: 1.0, lambda aps: 1.0))
    (check,) = scenarios.online(grid, lambda s: None).checks
    assert check == (
        "[INFO] basic and dualpath met the SLO at every APS tried (up to 1): no knee found, so no ratio;"
        " try higher --aps"
    )
    # Basic's knee at 0.667 APS (mean TTFT 2 -> 8 s), DualPath never fails: the ratio is at least 1/0.667.
    monkeypatch.setattr(
        scenarios, "_online_run", by_policy(lambda aps: 8 * aps if aps > 0.5 else 2.0, lambda a: 1.0)
    )
    (check,) = scenarios.online(grid, lambda s: None).checks
    assert (
        check.startswith("[INFO] dualpath met the SLO at every APS tried")
        and "DualPath/Basic ≥ 1.50x" in check
    )
    # Both fail above their best: the ratio is measured (a verdict).
    monkeypatch.setattr(scenarios, "_online_run", by_policy(lambda aps: 8 * aps, lambda aps: 6 * aps))
    (check,) = scenarios.online(grid, lambda s: None).checks
    assert check.startswith("[MISS] max APS under SLO (interpolated knee): Basic 0.500, DualPath 0.667")


def test_a_ratio_near_a_bound_is_printed_on_its_side_of_it():
    """ "[MISS] DualPath/Basic JCT max 2.20x (range 1.6-2.2)" for 2.201 (a new-user review)."""
    f = scenarios._in_range
    assert (f(2.201, 1.6, 2.2), f(1.5999, 1.6, 2.6), f(1.95, 1.6, 2.2), f(2.2, 1.6, 2.2)) == (
        "2.201",
        "1.5999",
        "1.95",
        "2.20",
    )


# ---------------------------------------------------------------- 6. trace shorter than the agents


def test_mooncake_trace_with_fewer_rows_than_agents_is_not_silently_truncated(tmp_path):
    """`mooncake` / `mooncake-synthetic` give `num_agents` requests (load_workload's docstring). With a
    trace shorter than that, the workload silently has fewer agents (mooncake_trace(limit=...)) while
    the scenario's JSON says agents=N; online, arrivals simply stop (a 3,993-row trace is used up
    before the warm-up at >= 2.2 APS over 3,600 s), so the measured window sees no load."""
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [i, 100 + i]} for i in range(3)
    ]
    (tmp_path / "conversation_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    try:
        wl = load_workload("mooncake", 5, 0, None, data_dir=tmp_path)
    except ValueError:
        return  # a clear refusal is a fix too
    assert wl.num_agents == 5


# ---------------------------------------------------------------- 7-8. emulated scenario output


def test_emulated_plot_is_written_or_refused(tmp_path):
    """`--plot` is silently ignored for `emulated` (ScenarioResult.plot is None there, and cli.run
    skips the plot without a word): exit 0 and no file."""
    png = tmp_path / "e.png"
    rc = run(parse("--scenario", "emulated", "--agents", "2", "--plot", str(png)))
    assert rc == 2 or png.is_file()


def test_emulated_json_records_the_workload(tmp_path):
    """Every other scenario's run object carries `workload`; emulated reads `--workload` (its agents
    change) but does not record it, so two different runs look alike in the JSON."""
    out = tmp_path / "e.json"
    assert run(parse("--scenario", "emulated", "--agents", "2", "--workload", "48k", "--json", str(out))) == 0
    for r in json.loads(out.read_text())["runs"]:
        assert r.get("workload") == "48k"


# ---------------------------------------------------------------- 9. bandwidth-model vacuous [OK]


def test_bandwidth_model_does_not_pass_a_check_over_no_shape():
    """With g = 2 GPUs per node the analytic bounds are empty (lo = 1 > hi = 0), so no shape is
    "inside"; `all([])` makes the check print "[OK] inside [1.000, 0.00]: bottleneck is the SNIC for
    every shape" though nothing was tested."""
    res = scenarios.bandwidth_model(
        Overrides(agents=(1,), prefill_nodes=1, decode_nodes=1, gpus_per_node=2), lambda s: None
    )
    assert not any(c.startswith("[OK] inside") for c in res.checks), res.checks


@pytest.mark.parametrize(
    "bad",
    [
        {"intermediate_size": -11008},  # prefill_s_per_new_token < 0: compute takes negative time
        {"n_routed_experts": 8, "num_experts_per_tok": -2},  # same, through the MoE branch
        {"vocab_size": -1},
    ],
)
def test_negative_sizes_in_an_hf_config_are_a_usage_error(tmp_path, bad):
    """The commit made zero/negative hidden_size, num_hidden_layers, num_attention_heads, head_dim and
    num_key_value_heads a usage error, but `profile_from_hf_config` still takes intermediate_size,
    moe_intermediate_size, num_experts_per_tok, vocab_size (and kv_lora_rank's sign) as they come:
    `pdserve simulate --model` exits 0 with a profile whose per-token prefill and decode costs are
    negative."""
    from pdserve.dualpath.cost_model import get_profile

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, **bad}))
    with pytest.raises(ValueError):
        p = get_profile(str(cfg))
        print(p.prefill_s_per_new_token, p.decode_s_per_seq)


def test_online_search_never_reports_a_max_below_an_aps_that_passed(monkeypatch):
    """When every trial passes up to the cap, `while trial(hi) and hi < MAX_ONLINE_APS` runs the
    trial at hi = 768 (it passes) and then leaves with lo = 384, hi = 768; the bisection that follows
    reports max_aps ~ 762 although the run at 768 APS met the SLO ("max_aps: highest APS tried that
    met the SLO"), and says nothing about the search having hit its cap."""
    from pdserve.sim import scenarios
    from pdserve.sim.scenarios import Overrides

    def fake(ov, cfg, wl_name, aps, horizon_s, warmup_s, progress=None):
        return {
            "policy": cfg.mode,
            "aps": aps,
            "ttft_mean_s": 0.1,
            "ttft_p50_s": 0.1,
            "tpot_mean_s": 0.02,
            "jct_s": None,
        }

    monkeypatch.setattr(scenarios, "_online_run", fake)
    res = scenarios.online(Overrides(policy=("dualpath",)), lambda s: None)
    passed = max(r["aps"] for r in res.runs if r["slo_ok"])
    assert {r["max_aps"] for r in res.runs} == {passed}, (passed, {r["max_aps"] for r in res.runs})


# ---------------------------------------------------------------- a review of the simulator (2026-12-04)


def test_a_run_past_a_hundred_thousand_simulated_seconds_ends():
    """Past ~1.3e5 s a decode step's time is below `now`'s resolution: the group's token clock stayed a
    rounding short of its head's finish, and the tick set itself again at the same `now` for ever (the
    run hung, its bar frozen). 0.001 Gbit/s SNICs stretch 4 agents' run to ~3e5 s."""
    import threading

    from pdserve.sim.cluster import ClusterSim
    from pdserve.sim.config import HardwareConfig, SimConfig

    result = []
    sim = ClusterSim(SimConfig(hw=HardwareConfig(snic_gbps=0.001), mode="basic"), load_workload("32k", 4, 0))
    t = threading.Thread(target=lambda: result.append(sim.run()), daemon=True)
    t.start()
    t.join(60)
    assert result, "the simulation was still running after 60 s"
    assert result[0].jct_s > 1.3e5


def test_an_online_search_past_a_traces_requests_keeps_its_runs(monkeypatch):
    """The doubling search asked a trace for more requests than it holds (APS x horizon): the
    ValueError ended the scenario, every run before it was lost and no JSON written. The search stops
    there; its max is reported as a lower bound."""

    def fake(ov, cfg, wl_name, aps, horizon_s, warmup_s, progress=None):
        if aps * horizon_s + 1 > 12_031:
            raise scenarios.TraceExhausted(f"{wl_name}: the trace has 12031 requests")
        return {"policy": cfg.mode, "aps": aps, "ttft_mean_s": 0.1, "ttft_p50_s": 0.1, "tpot_mean_s": 0.02}

    monkeypatch.setattr(scenarios, "_online_run", fake)
    res = scenarios.online(
        Overrides(workload="mooncake", horizon_s=2000.0, policy=("dualpath",)), lambda s: None
    )
    assert res.runs and all(r["slo_ok"] for r in res.runs)
    assert {r["max_aps"] for r in res.runs} == {max(r["aps"] for r in res.runs)}
    assert any("search stopped" in c and "lower bound" in c for c in res.checks)


def test_the_trace_exhausted_error_comes_from_the_workload(tmp_path):
    """(the workload raises TraceExhausted, which the online search catches)"""
    trace = tmp_path / "conversation_trace.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i, "input_length": 100, "output_length": 10,
                                           "hash_ids": [i]}) for i in range(3)))  # fmt: skip
    with pytest.raises(ValueError, match="the trace has 3 requests"):
        load_workload("mooncake", 5, 0, 1.0, data_dir=tmp_path)


@pytest.mark.parametrize("gbps", ["1e308", "1e-300", "1e8", "0.0001"])
def test_a_link_rate_the_arithmetic_cannot_hold_is_a_usage_error(capsys, gbps):
    """1e308 overflowed to an infinite int, 1e-300 to windows past an index's size: tracebacks."""
    with pytest.raises(SystemExit) as e:
        parse(*TINY, "--snic-gbps", gbps)
    assert e.value.code == 2 and "must be ≥ 0.001 and ≤ 1e+07" in capsys.readouterr().err


@pytest.mark.parametrize("gbytes", ["1e-300", "1e7"])
def test_a_dram_rate_the_arithmetic_cannot_hold_is_a_usage_error(capsys, gbytes):
    """`--dram-gbytes-per-s 1e-300` ran into an OverflowError traceback (the link rates had a range)."""
    with pytest.raises(SystemExit) as e:
        parse(*TINY, "--dram-gbytes-per-s", gbytes)
    assert e.value.code == 2 and "must be ≥ 0.001 and ≤ 1e+06" in capsys.readouterr().err


def _cnic_shares(**config) -> tuple[float, float]:
    """The KV share of the first prefill and the first decode GPU's CNIC."""
    from pdserve.sim.cluster import ClusterSim
    from pdserve.sim.config import SimConfig

    sim = ClusterSim(SimConfig(**config), load_workload("32k", 1, 0))
    first_de = sim.num_pe
    return (
        sim.cnic_rd[0].rate / sim.cnic_rd[0].capacity,
        sim.cnic_rd[first_de].rate / sim.cnic_rd[first_de].capacity,
    )


def test_an_ep_group_inside_one_node_reserves_no_cnic_share_for_its_all_to_all():
    """The all-to-all of an EP group inside one node stays on NVLink. `--prefill-ep-gpus 1` (no
    all-to-all at all) still reserved 10% of each prefill CNIC, DS-27B's EP8 on 8-GPU nodes 8%."""
    from pdserve.dualpath.cost_model import DS_27B, DS_660B
    from pdserve.sim.config import HardwareConfig

    pe, de = _cnic_shares(model=DS_660B, num_prefill_nodes=2, num_decode_nodes=4)  # EP16, EP32
    assert pe == pytest.approx(0.898, abs=1e-3) and de == pytest.approx(0.9626, abs=1e-4)
    one = _cnic_shares(model=DS_660B, num_prefill_nodes=2, num_decode_nodes=4, prefill_ep_gpus=1)
    assert one == (1.0, de)
    assert _cnic_shares(model=DS_27B, num_prefill_nodes=1, num_decode_nodes=1) == (1.0, 1.0)
    # on 4-GPU nodes DS-27B's EP8 spans two: reserved
    pe4, de4 = _cnic_shares(model=DS_27B, num_prefill_nodes=2, num_decode_nodes=2, hw=HardwareConfig(4))
    assert pe4 < 0.95 and de4 < 1.0


def test_a_cnic_too_slow_for_the_all_to_all_is_an_error_not_a_link_above_capacity(capsys):
    """Below ~41 Gbit/s a DS-660B prefill CNIC's reservation passed 99%: KV kept its 1% floor on top,
    model + KV above the link's capacity, and JCT jumped 19x between 50 and 40 Gbit/s."""
    from pdserve.dualpath.cost_model import DS_660B
    from pdserve.sim.config import HardwareConfig

    assert _cnic_shares(model=DS_660B, num_prefill_nodes=2, hw=HardwareConfig(cnic_gbps=50.0))[0] > 0.1
    with pytest.raises(ValueError, match=r"prefill EP16 all-to-all needs \d+ Gbit/s .* --cnic-gbps 40"):
        _cnic_shares(model=DS_660B, num_prefill_nodes=2, hw=HardwareConfig(cnic_gbps=40.0))
    args = ["--scenario", "ablation", "--agents", "2", "--policy", "basic", "--cnic-gbps", "40"]
    assert run(parse(*args)) == 2
    assert "error: ds-660b: the prefill EP16 all-to-all needs" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"num_experts": -4}, "experts must be >= 0"),  # ran, with negative routed weights
        ({"num_hidden_layers": 1e400}, "model config"),  # OverflowError (JSON Infinity)
        ({"num_key_value_heads": 0}, "num_key_value_heads 0 must be >= 1"),  # was read as MHA
    ],
    ids=["negative-experts", "infinite-layers", "zero-kv-heads"],
)
def test_more_bad_hf_config_values_are_value_errors(tmp_path, extra, match):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**LLAMA, **extra}))
    with pytest.raises(ValueError, match=match):
        get_profile(str(cfg))


def test_a_config_saved_with_dtype_not_torch_dtype_is_read(tmp_path):
    """Newer transformers save "dtype": an fp8 model's KV was costed as bf16."""
    fp8, bf16 = tmp_path / "fp8.json", tmp_path / "bf16.json"
    fp8.write_text(json.dumps({**LLAMA, "dtype": "float8_e4m3fn"}))
    bf16.write_text(json.dumps({**LLAMA, "dtype": "bfloat16"}))
    assert get_profile(str(fp8)).kv_bytes_per_token * 2 == get_profile(str(bf16)).kv_bytes_per_token


def test_json_and_plot_to_one_file_or_an_unwritable_one_are_errors_not_tracebacks(tmp_path, capsys):
    same = str(tmp_path / "out.png")
    assert run(parse("--scenario", "ablation", *TINY, "--json", same, "--plot", same)) == 2
    assert "name the same file" in capsys.readouterr().err
    if os.access("/proc", os.W_OK):  # (as root the parse-time check passes /proc: the write fails)
        assert run(parse("--scenario", "ablation", *TINY, "--json", "/proc/pdserve-sim.json")) == 2
        assert "error: cannot write /proc/pdserve-sim.json" in capsys.readouterr().err


def test_too_many_agents_are_refused_before_the_workload_is_drawn(monkeypatch):
    """Drawing 3 M agents of 64k took more memory than the machine had: the check after the draw came
    too late. Now the Table 2 row's mean turns per agent are checked first."""
    monkeypatch.setattr(scenarios, "available_memory_bytes", lambda: 1 << 30)
    drawn = []
    monkeypatch.setattr(scenarios, "load_workload", lambda *a, **k: drawn.append(a))
    from pdserve.sim.config import SimConfig
    from pdserve.sim.errors import SimulationTooLarge

    with pytest.raises(SimulationTooLarge, match="agents of 64k"):
        scenarios.run_one(SimConfig(), "64k", 3_000_000)
    assert not drawn


def test_a_traces_hits_are_cut_to_the_runs_block_size():
    """Trace hits are in 64-token store blocks; a run with 256-token blocks used them as given (reads of
    partial blocks). They are cut to whole blocks of the run, the rest computed: the prompt is the same
    (a review, 2026-12-05)."""
    import numpy as np

    from pdserve.bench.workloads import _assemble
    from pdserve.sim.cluster import ClusterSim
    from pdserve.sim.config import SimConfig
    from tests.test_sim_invariants import DS27_ONE_RANK, HW2

    wl = _assemble(
        "trace", [np.array([500, 100])], [np.array([10, 10])], np.zeros(1), hits=[np.array([0, 448])]
    )
    for bt, want in ((64, (448, 100)), (256, (256, 292))):
        cfg = SimConfig(num_prefill_nodes=1, num_decode_nodes=1, hw=HW2, model=DS27_ONE_RANK, block_tokens=bt)
        reqs = ClusterSim(cfg, wl, keep_requests=True).run().reqs
        assert [(r.hit, r.new) for r in reqs] == [(0, 500), want]


@pytest.mark.parametrize("aps", [0.1, 0.4])
def test_online_arrivals_go_on_to_the_horizon(aps):
    """An online run drew aps x horizon agents: the last of them arrived 141 s before a 3,600 s horizon
    at 0.1 APS on seed 0, and nothing after, inside the measured window (a review, 2026-12-05). Every
    arrival inside the horizon is drawn, and one past it."""
    from pdserve.bench.workloads import arrivals
    from pdserve.sim.scenarios import _agents_until

    n = _agents_until(aps, 3600.0, seed=0)
    times = arrivals(n, aps, 0)
    assert times[-2] <= 3600.0 < times[-1]
    assert n > int(aps * 3600) + 1 if aps == 0.1 else True  # (seed 0 at 0.1 APS: 372 arrive in time)
