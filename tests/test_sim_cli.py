"""The simulate CLI: --list, a tiny scenario end to end with --json and --plot, bad input."""

from __future__ import annotations

import argparse
import json

import pytest

from pdserve.sim.cli import add_arguments, run


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_list(capsys):
    assert run(parse("--list")) == 0
    out = capsys.readouterr().out
    for name in (
        "offline-660b",
        "ablation",
        "pd-ratio",
        "online",
        "nic-balance",
        "scale",
        "bandwidth-model",
        "submit-cost",
        "split",
        "emulated",
    ):
        assert name in out


def test_emulated_scenario_runs_both_policies(tmp_path):
    """The scenario lives in its own module (imported when run); it predicts the emulated CPU cluster
    of `pdserve bench dualpath`: layerwise round robin vs DualPath on the same agents."""
    out = tmp_path / "e.json"
    assert run(parse("--scenario", "emulated", "--json", str(out))) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["layerwise", "dualpath"]
    assert runs[1]["jct_s"] < runs[0]["jct_s"]


def test_tiny_ablation_json_and_plot(tmp_path):
    js, png = tmp_path / "new" / "a.json", tmp_path / "plots" / "a.png"  # (directories made when written)
    args = parse(
        "--scenario",
        "ablation",
        "--agents",
        "12",
        "--prefill-nodes",
        "1",
        "--decode-nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--workload",
        "32k",
        "--policy",
        "basic,dualpath",
        "--seed",
        "4",
        "--decode-ep-gpus",
        "1",
        "--json",
        str(js),
        "--plot",
        str(png),
    )
    assert run(args) == 0
    data = json.loads(js.read_text())
    assert data["scenario"] == "ablation"
    assert [r["policy"] for r in data["runs"]] == ["basic", "dualpath"]
    for r in data["runs"]:
        for k in (
            "policy",
            "agents",
            "prefill_nodes",
            "decode_nodes",
            "jct_s",
            "ttft_p50_s",
            "tpot_p50_s",
            "snic_max_over_avg",
            "pe_buffer_peak_gb",
            "de_buffer_peak_gb",
            "wall_s",
        ):
            assert k in r
        assert r["prefill_nodes"] == 1 and r["gpus_per_node"] == 2 and r["seed"] == 4
        # DS-660B's EP16 prefill group, cut to the two PE ranks this cluster has.
        assert r["prefill_ep_gpus"] == 2
        assert r["decode_ep_gpus"] == 1  # asked for: independent decode engines
        assert r["host_buffer_gb"] == 80.0  # DS-660B's, in GB
        assert 0 < r["pe_buffer_peak_gb"] <= 80.0
        # Every hardware and batching parameter of the setting, defaults included.
        assert (r["snic_gbps"], r["cnic_gbps"], r["dram_gbytes_per_s"]) == (400.0, 400.0, 500.0)
        assert (r["quota_ms"], r["submit_us_per_copy"], r["copies_per_submit"]) == (300.0, 1.0, 1)
    assert data["runs"][0]["jct_change_pct"] == 0.0
    assert png.stat().st_size > 1000


def test_bad_scenario_and_model(capsys):
    assert run(parse("--scenario", "nope")) == 2
    assert run(parse("--scenario", "ablation", "--model", "no-such-model", "--agents", "2")) == 2
    capsys.readouterr()
    # No --scenario: said, on stderr, with the list (it printed the list alone, on stdout).
    assert run(parse("--agents", "8")) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: --scenario NAME is required; the scenarios:\nofflin")


def _usage_error(capsys, *argv: str) -> str:
    """Parsing ``argv`` exits with argparse's usage error (status 2); returns its message."""
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_out_of_range_numbers_are_usage_errors(capsys):
    for argv, text in [
        (("--prefill-nodes", "0"), "0 must be > 0"),
        (("--decode-nodes", "-1"), "-1 must be > 0"),
        (("--snic-gbps", "0"), "0 must be ≥ 0.001 and ≤ 1e+07"),
        (("--cnic-gbps", "nan"), "nan must be ≥ 0.001 and ≤ 1e+07"),
        (("--dram-gbytes-per-s", "-5"), "-5 must be ≥ 0.001 and ≤ 1e+06"),
        (("--agents", "16,0"), "0 must be > 0"),
        (("--agents", ","), "empty list"),
        (("--gpus-per-node", "two"), "'two' is not an integer"),
        (("--submit-us", "-1"), "-1 must be ≥ 0"),
        (("--seed", "-3"), "-3 must be ≥ 0"),
        (("--snic-gbps", "inf"), "inf must be ≥ 0.001 and ≤ 1e+07"),
        (("--aps", "inf"), "inf must be > 0 and finite"),
        (("--submit-us", "inf"), "inf must be ≥ 0 and finite"),
    ]:
        assert text in _usage_error(capsys, *argv), argv
    # In range: an unbounded buffer, a zero submit cost, the alias of Basic's policy name.
    ns = parse("--host-buffer-gb", "inf", "--submit-us", "0,1.5", "--policy", "round_robin,dualpath")
    assert ns.host_buffer_gb == float("inf") and ns.submit_us == (0.0, 1.5)
    assert ns.policy == ("basic", "dualpath")


def test_an_output_file_that_cannot_be_written_is_a_usage_error_before_any_run(capsys, tmp_path):
    """`--plot x.txt` ran the scenario, then died in savefig with a traceback."""
    assert "the file's suffix names its format" in _usage_error(capsys, "--plot", str(tmp_path / "x.txt"))
    assert "names a directory" in _usage_error(capsys, "--json", str(tmp_path))


def test_an_ep_size_cut_to_divide_the_gpus_is_said_not_silent(capsys, tmp_path):
    """`--prefill-ep-gpus 3` on 16 prefill GPUs ran as independent engines (gcd 1) and said nothing in
    the table; the JSON has the size as run, and stderr now says so."""
    out = tmp_path / "a.json"
    argv = ("--scenario", "ablation", "--agents", "4", "--policy", "basic", "--json", str(out))
    assert run(parse(*argv, "--prefill-ep-gpus", "3", "--decode-ep-gpus", "64")) == 0
    err = capsys.readouterr().err
    assert "--prefill-ep-gpus 3 ran as 1 on 2 prefill nodes (16 GPUs)" in err and "gcd(3, 16)" in err
    assert "--decode-ep-gpus 64 ran as 32 on 4 decode nodes (32 GPUs)" in err
    (r,) = json.loads(out.read_text())["runs"]
    assert (r["prefill_ep_gpus"], r["decode_ep_gpus"]) == (1, 32)
    assert run(parse(*argv, "--prefill-ep-gpus", "8")) == 0  # divides: no note
    assert "ran as" not in capsys.readouterr().err


def test_a_run_reports_its_simulated_clock_and_turns_to_the_bar(capsys):
    """The bar stood still through a run (the 48P96D one takes a minute or more): each run now ticks
    every 5 simulated seconds with its turns done, in order, ending at all of them."""
    from pdserve.bench.workloads import load_workload
    from pdserve.sim.scenarios import Overrides, _config, _model, run_one

    class Recorder:
        def __init__(self):
            self.ticks = []

        def __call__(self, label):
            pass

        def tick(self, t_s, num_turns_done, num_turns):
            self.ticks.append((t_s, num_turns_done, num_turns))

    ov = Overrides()
    cfg = _config(ov, 1, 1, _model(ov, "ds-660b"), "dualpath")
    rec = Recorder()
    res = run_one(cfg, "32k", 6, progress=rec)
    num_turns = load_workload("32k", 6, 0).num_turns
    assert len(rec.ticks) >= 10 and {n for _t, _d, n in rec.ticks} == {num_turns}
    times, done = [t for t, _d, _n in rec.ticks], [d for _t, d, _n in rec.ticks]
    assert times == sorted(times) and done == sorted(done) and done[-1] <= res.num_turns_done == num_turns
    assert all(b - a >= 5.0 for a, b in zip(times, times[1:], strict=False))
    # Through the CLI: the bar's postfix carries the tick.
    assert run(parse("--scenario", "ablation", "--agents", "4", "--policy", "basic")) == 0
    assert "basic: t=0 s, 0/" in capsys.readouterr().err


def test_a_run_too_large_for_free_memory_is_refused_before_it_starts(capsys, monkeypatch):
    """`--agents 1000000` on the scale scenario (~50 GB) ran until the kernel killed it."""
    from pdserve.sim import scenarios

    free = scenarios.available_memory_bytes()
    assert free is None or free > 0  # (Linux: MemAvailable, capped by a cgroup limit)
    monkeypatch.setattr(scenarios, "available_memory_bytes", lambda: 10_000_000)  # 10 MB free
    argv = ("--scenario", "ablation", "--policy", "basic")
    assert run(parse(*argv, "--agents", "1000")) == 2
    assert (  # (refused before the workload is drawn: from Table 2's mean turns per agent)
        "error: ~157,000 turns (1,000 agents of 64k) need ~0.06 GB of memory to simulate; 0.01 GB is free"
        in capsys.readouterr().err
    )
    assert run(parse(*argv, "--agents", "100")) == 0  # ~15 K turns: ~6 MB fits


def test_ctrl_c_during_a_run_ends_it_with_130_and_no_traceback(tmp_path):
    """Ctrl-C printed a traceback from inside the event loop and wrote nothing, without saying so."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "never.json"
    argv = [sys.executable, "-m", "pdserve.sim.cli", "--scenario", "ablation", "--accel", "off"]
    proc = subprocess.Popen(
        [*argv, "--json", str(out)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = b""
    deadline = time.monotonic() + 60
    while b" turns" not in seen and time.monotonic() < deadline:  # a run is under way
        seen += proc.stderr.read1(4096)
    proc.send_signal(signal.SIGINT)
    err = seen + proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err[-2000:]
    assert b"interrupted: nothing written" in err and b"Traceback" not in err
    assert not out.exists()


def test_a_cluster_too_small_for_a_named_profiles_weights_is_said(capsys, tmp_path):
    """DS-660B on two GPUs (EP1) ran without a word, where its HF config.json is refused: the named
    profile's fixed KV budget assumes its EP group. A run below the profile's smallest EP group that
    holds the weights now says so (stderr and the JSON row); a default cluster does not."""
    out = tmp_path / "o.json"
    tiny = ("--prefill-nodes", "1", "--decode-nodes", "1", "--gpus-per-node", "1")
    argv = ("--scenario", "offline-660b", "--agents", "4", "--policy", "basic", "--json", str(out))
    assert run(parse(*argv, *tiny)) == 0
    note = "ds-660b needs an EP group of >= 8 GPUs to hold its weights; this cluster runs prefill EP1 and decode EP1"
    assert f"note: {note}" in capsys.readouterr().err
    assert json.loads(out.read_text())["runs"][0]["weights_do_not_fit"].startswith(note)
    assert run(parse(*argv)) == 0  # 2P4D: EP16 and EP32
    assert "weights" not in capsys.readouterr().err
    assert "weights_do_not_fit" not in json.loads(out.read_text())["runs"][0]


def test_the_offline_plot_is_titled_with_the_model_and_shape_run(tmp_path):
    """It said "offline DS-660B 2P4D" whatever --model and node counts were given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pdserve.sim.scenarios import Overrides, offline_660b

    cfg = tmp_path / "llama8b" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(_LLAMA_8B))
    for model, title in [(None, "offline DS-660B 1P2D"), (str(cfg), "offline llama8b 1P2D")]:
        ov = Overrides(model=model, prefill_nodes=1, decode_nodes=2, agents=(4,), policy=("basic",))
        res = offline_660b(ov, lambda label: None)
        fig = res.plot(res.runs, plt)
        assert fig.axes[0].get_title() == title
        plt.close(fig)


_LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
}


def test_a_trace_replay_given_an_arrival_rate_says_where_it_belongs():
    """`online --workload mooncake@trace` said "an APS does not apply" though no --aps was given."""
    from pdserve.bench.workloads import load_workload

    with pytest.raises(
        ValueError, match="use it in an offline run, or mooncake where agents arrive at a given APS"
    ):
        load_workload("mooncake@trace", 4, 0, 0.5)


def test_a_host_buffer_smaller_than_one_request_is_noted(capsys):
    """`--host-buffer-gb 0.01` ran with 2.6 GB buffer peaks and no word (a new-user review): an empty
    buffer takes one request whatever its size. A buffer that bounds the run gets no note."""
    argv = ("--scenario", "offline-660b", "--agents", "4", "--policy", "basic")
    assert run(parse(*argv, "--host-buffer-gb", "0.01")) == 0
    assert "note: host buffers of 0.01 GB held up to" in capsys.readouterr().err
    assert run(parse(*argv)) == 0
    assert "note: host buffers" not in capsys.readouterr().err


def test_a_baseline_left_out_is_refused_not_mislabelled(capsys):
    """The ablation's changes are against Basic and submit-cost's ratios against 0 µs: a sweep without
    its baseline would put another run in its place."""
    assert run(parse("--scenario", "ablation", "--policy", "layerwise,dualpath", "--agents", "4")) == 2
    assert "include it in --policy" in capsys.readouterr().err
    assert run(parse("--scenario", "submit-cost", "--submit-us", "1,2", "--agents", "4")) == 2
    assert "include 0 in --submit-us" in capsys.readouterr().err
    # The bandwidth model's analytic bounds need g·B > s·B (else a division by zero).
    assert run(parse("--scenario", "bandwidth-model", "--snic-gbps", "800", "--cnic-gbps", "100")) == 2
    assert "CNICs to outrun its SNIC" in capsys.readouterr().err


def test_a_list_where_a_scenario_runs_one_setting_is_refused(capsys):
    assert run(parse("--scenario", "ablation", "--agents", "8,16")) == 2
    assert "ablation runs one --agents setting; got 8, 16" in capsys.readouterr().err
    assert run(parse("--scenario", "submit-cost", "--policy", "basic,dualpath", "--agents", "4")) == 2
    assert run(parse("--scenario", "online", "--agents", "8")) == 2
    assert "--agents does not apply" in capsys.readouterr().err


def test_scale_honours_the_cluster_shape_and_every_policy(tmp_path):
    out = tmp_path / "scale.json"
    argv = ["--scenario", "scale", "--prefill-nodes", "1", "--decode-nodes", "1", "--gpus-per-node", "1"]
    argv += ["--agents", "2", "--policy", "basic,dualpath", "--workload", "32k", "--json", str(out)]
    assert run(parse(*argv)) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["shape"], r["agents"]) for r in runs] == [
        ("basic", "1P1D", 2),
        ("basic", "24P24D", 48),
        ("dualpath", "1P1D", 2),
        ("dualpath", "24P24D", 48),
    ]


def test_an_hf_moe_config_runs(tmp_path):
    """DeepSeek-V3's config.json: its experts spread over an EP group, so its KV fits and the run ends
    (before, all 1.4 TB of weights counted on one GPU, no turn fitted and the run stalled)."""
    from tests.test_cost_model import DEEPSEEK_V3

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(DEEPSEEK_V3))
    out = tmp_path / "o.json"
    argv = ("--scenario", "offline-660b", "--model", str(cfg), "--agents", "4", "--json", str(out))
    assert run(parse(*argv, "--policy", "dualpath", "--workload", "32k")) == 0
    (r,) = json.loads(out.read_text())["runs"]
    assert r["turns_done"] > 4 and (r["prefill_ep_gpus"], r["decode_ep_gpus"]) == (16, 32)


def test_a_turn_no_decode_engine_can_hold_is_a_clear_error(capsys):
    from dataclasses import replace

    from pdserve.bench.workloads import table2_workload
    from pdserve.dualpath.cost_model import DS_27B
    from pdserve.sim.cluster import ClusterSim
    from pdserve.sim.config import SimConfig
    from pdserve.sim.errors import TurnDoesNotFit

    tiny = replace(DS_27B, decode_hbm_kv_bytes=1000 * DS_27B.kv_bytes_per_token)  # 1,000 tokens
    cfg = SimConfig(num_prefill_nodes=1, num_decode_nodes=1, model=tiny, mode="dualpath")
    with pytest.raises(TurnDoesNotFit, match="holds 992"):  # 62 pages of 16 tokens
        ClusterSim(cfg, table2_workload("32k", 2, seed=0)).run()


def test_light_load_and_missing_baselines_do_not_crash(tmp_path, capsys):
    # Too few agents for any SNIC to reach 20% in a window: max/avg is undefined, said so.
    assert run(parse("--scenario", "nic-balance", "--agents", "2", "--gpus-per-node", "1")) == 0
    assert "max/avg undefined" in capsys.readouterr().out
    # No dualpath run: no speedup check, but the runs are still written.
    out = tmp_path / "o.json"
    argv = ("--scenario", "offline-660b", "--policy", "basic,oracle", "--agents", "2", "--json", str(out))
    assert run(parse(*argv)) == 0
    assert [r["policy"] for r in json.loads(out.read_text())["runs"]] == ["basic", "oracle"]
    # An SLO no policy meets: no ratio, no division by zero.
    argv = ("--scenario", "online", "--aps", "3", "--horizon-s", "60", "--snic-gbps", "1")
    assert run(parse(*argv)) == 0
    assert "basic met the SLO at no APS tried" in capsys.readouterr().out


def test_hardware_must_be_positive():
    from pdserve.sim.config import HardwareConfig

    for kw in (
        {"snic_gbps": 0},
        {"cnic_gbps": -1.0},
        {"dram_gbytes_per_s": float("nan")},
        {"gpus_per_node": 0},
        {"snic_gbps": float("inf")},  # an infinite rate has no meaning (and broke α's token count)
    ):
        with pytest.raises(ValueError, match="must be"):
            HardwareConfig(**kw)


def test_online_tpot_is_measured_over_the_same_turns_as_ttft():
    """After warm-up only: a run's TPOT figures are those of the turns submitted after the warm-up."""
    from dataclasses import replace

    import numpy as np

    from pdserve.bench.workloads import load_workload
    from pdserve.dualpath.cost_model import DS_27B
    from pdserve.sim.cluster import ClusterSim
    from pdserve.sim.config import HardwareConfig
    from pdserve.sim.scenarios import Overrides, _agents_until, _config, _online_run

    ov = Overrides(gpus_per_node=2)
    cfg = _config(ov, 1, 1, DS_27B, "dualpath")
    assert cfg.hw == HardwareConfig(gpus_per_node=2)
    row = _online_run(ov, cfg, "32k", 0.5, 120.0, 60.0)
    # The same run by hand (``_online_run`` draws the agents arriving before the horizon, and one more).
    res = ClusterSim(
        replace(cfg, horizon_s=120.0), load_workload("32k", _agents_until(0.5, 120.0, 0), 0, 0.5)
    ).run()
    late = res.tpot_s[res.tpot_submit_s >= 60.0]
    assert 0 < len(late) < len(res.tpot_s)  # the warm-up's turns are left out
    assert row["tpot_mean_s"] == pytest.approx(float(np.mean(late)), abs=1e-4)
    assert row["tpot_mean_s"] != pytest.approx(float(np.mean(res.tpot_s)), abs=1e-4)


def test_online_runs_have_no_jct(tmp_path):
    """Agents arrive until the horizon, so no job completes as a whole: the JSON says so (null) rather
    than report the horizon-truncated makespan."""
    out = tmp_path / "o.json"
    argv = ("--scenario", "online", "--aps", "0.2", "--horizon-s", "40", "--policy", "dualpath")
    assert run(parse(*argv, "--prefill-nodes", "1", "--decode-nodes", "1", "--json", str(out))) == 0
    (r,) = json.loads(out.read_text())["runs"]
    assert r["jct_s"] is None and r["jct_mean_s"] is None
    assert r["ttft_mean_s"] is not None and r["horizon_s"] == 40.0 and r["aps"] == 0.2


def test_an_unknown_policy_is_a_usage_error_before_any_run(capsys):
    """A bad name in a --policy list was found only when its turn came: `--policy basic,nosuch` ran
    the whole Basic simulation first."""
    assert "unknown policy 'nosuch'" in _usage_error(capsys, "--policy", "basic,nosuch")


def _reads(path: str, fn: str, scenarios_tree) -> set[str]:
    """The `ov.<field>` a scenario function reads, with the module functions it calls (static)."""
    import ast
    from pathlib import Path

    import pdserve

    tree = ast.parse((Path(pdserve.__file__).parent / path).read_text())
    funcs = {n.name: n for t in (tree, scenarios_tree) for n in t.body if isinstance(n, ast.FunctionDef)}
    out: set[str] = set()
    todo, seen = [fn], {fn}
    while todo:
        for node in ast.walk(funcs[todo.pop()]):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ov":
                out.add(node.attr)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in funcs and node.func.id not in seen:
                    seen.add(node.func.id)
                    todo.append(node.func.id)
    return out


def test_each_scenario_refuses_exactly_the_overrides_its_code_does_not_read(capsys):
    """`simulate --scenario ablation --submit-us 8 --aps 3` ran at 1 µs per copy, offline, and said
    nothing. Each scenario declares what it ignores (refused before anything runs); this compares the
    declarations with what each scenario's code reads (`ov.<field>`, through the helpers it calls)."""
    import ast
    import dataclasses
    from pathlib import Path

    import pdserve
    from pdserve.sim.scenarios import SCENARIOS, Overrides

    scenarios_tree = ast.parse((Path(pdserve.__file__).parent / "sim/scenarios.py").read_text())
    every = {f.name for f in dataclasses.fields(Overrides)}
    for sc in SCENARIOS.values():
        path, fn = (
            ("sim/emulated.py", "emulated") if sc.name == "emulated" else ("sim/scenarios.py", sc.fn.__name__)
        )
        assert sc.ignores == every - _reads(path, fn, scenarios_tree), sc.name
    for name, flag, value in [("ablation", "--submit-us", "8"), ("ablation", "--aps", "3"),
                              ("scale", "--horizon-s", "5"), ("submit-cost", "--aps", "1"),
                              ("online", "--submit-us", "1"), ("emulated", "--model", "ds-27b")]:  # fmt: skip
        assert run(parse("--accel", "off", "--scenario", name, flag, value)) == 2
        err = capsys.readouterr().err
        assert f"{name} does not use {flag}" in err and "simulator:" not in err, err


def test_a_seed_that_would_change_nothing_is_refused(capsys):
    """`--workload mooncake --seed 3` in an offline scenario replays the trace as recorded: every seed
    gave the same figures, silently. A seed draws Table 2 trajectories and online arrival times;
    with a trace (Mooncake, weka_cc) it is refused offline, and with `@trace` timing."""
    from pdserve.sim.scenarios import SCENARIOS, Overrides

    def refused(scenario: str, workload: str) -> bool:
        return any(
            u.startswith("--seed") for u in SCENARIOS[scenario].unused(Overrides(workload=workload, seed=3))
        )

    assert refused("ablation", "mooncake") and refused("offline-660b", "mooncake-synthetic")
    assert refused("online", "mooncake@trace")
    assert not refused("online", "mooncake")  # (arrivals are drawn)
    assert refused("ablation", "weka_cc")  # (its sessions are taken in order, not drawn)
    assert not refused("ablation", "64k") and not refused("online", "weka_cc")
    assert SCENARIOS["ablation"].unused(Overrides(workload="mooncake")) == []  # (no seed given)
    assert (
        run(parse("--accel", "off", "--scenario", "ablation", "--workload", "mooncake", "--seed", "3")) == 2
    )
    err = capsys.readouterr().err
    assert "ablation does not use --seed (with --workload mooncake" in err and "simulator:" not in err, err


def test_a_missing_trace_file_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    from pdserve.bench import workloads

    monkeypatch.setattr(workloads, "default_data_dir", lambda: tmp_path)
    for workload, missing in [("mooncake", "conversation_trace.jsonl"), ("weka_cc", "trace_*.json")]:
        assert (
            run(parse("--accel", "off", "--scenario", "ablation", "--agents", "2", "--workload", workload))
            == 2
        )
        err = capsys.readouterr().err
        assert missing in err and "Traceback" not in err, err


def test_pdserve_simulate_reaches_the_simulator_before_any_of_its_modules_is_imported():
    """`pdserve simulate` (the entry point, not `python -m pdserve.sim.cli`): the compiled build can
    load only if none of its modules was imported as Python first. Building the full parser imported
    the DualPath scheduler (through the bench modules), so `pdserve simulate` always fell back to pure
    Python, silently under the default `--accel auto` (found measuring the scale scenario). Every
    compiled module is checked, also after the options checked as they are parsed (`--policy`'s
    check imports the simulator's config: a compiled cost model was imported there, 2026-12-04)."""
    import subprocess
    import sys

    for argv in (
        ["simulate", "--list"],
        ["simulate", "--scenario", "ablation", "--policy", "basic,dualpath", "--model", "ds-27b"]
        + ["--workload", "mooncake", "--agents", "4", "--seed", "1", "--snic-gbps", "800"],
    ):
        code = (
            "import sys; import pdserve.sim.cli as c; "
            "from pdserve.sim.accel import MODULE_NAMES as m; "
            "c.run = lambda a: print([n for n in m if n in sys.modules] or 'clean'); "
            f"from pdserve.cli import main; main({argv!r})"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "clean", argv


def test_ablation_checks_print_the_change_on_the_side_of_the_band_they_decide():
    """A check printed its change from the JSON's 2-decimal rounding (-7.354% -> -7.35 -> "-7.3%")
    beside a verdict on the band -27.21..-7.21%. Now the verdict and the text both come from the
    unrounded change, with as many decimals as keep the text on the verdict's side."""
    import re

    from pdserve.sim.scenarios import Overrides, _step_check, ablation

    assert _step_check("layerwise", -7.354, -17.21, -5.0).startswith("[OK] +layerwise: -7.4% mean JCT")
    assert _step_check("layerwise", -7.2049, -17.21, -5.0).startswith("[MISS] +layerwise: -7.2% mean")
    assert _step_check("layerwise", -7.2149, -17.21, -5.0).startswith("[OK] +layerwise: -7.215% mean")
    assert _step_check("layerwise", -7.2051, -17.21, -5.0).startswith("[MISS] +layerwise: -7.2% mean")
    assert _step_check("layerwise", 1.04, -17.21, 2.0).startswith("[MISS] +layerwise: +1.0% mean")

    ov = Overrides(prefill_nodes=1, decode_nodes=1, gpus_per_node=2, agents=(24,), seed=4)
    res = ablation(ov, lambda label: None)
    paper = {"layerwise": -17.21, "dual_path": -38.19, "dualpath": -45.62}
    base = next(r for r in res.runs if r["policy"] == "basic")["jct_mean_s"]
    assert len(res.checks) == 3
    for check in res.checks:
        m = re.match(r"\[(OK|MISS)\] \+(\w+): ([+-][0-9.]+)% mean JCT", check)
        assert m, check
        verdict, policy, shown = m.group(1), m.group(2), float(m.group(3))
        run = next(r for r in res.runs if r["policy"] == policy)
        change = 100 * (run["jct_mean_s"] / base - 1)
        inside = abs(change - paper[policy]) <= 10
        assert (verdict == "OK") == inside, check
        assert (abs(shown - paper[policy]) <= 10) == inside, check  # the text agrees with the verdict
        assert abs(shown - change) < 0.051, check


def test_online_slo_and_warm_up_are_overrides_recorded_in_each_run(tmp_path):
    """The SLO (4 s, 50 ms) and the warm-up (half the horizon) were fixed in code."""
    out = tmp_path / "o.json"
    base = ("--scenario", "online", "--policy", "basic", "--aps", "0.05", "--horizon-s", "120")
    assert run(parse(*base, "--warmup-s", "30", "--slo-ttft-s", "0.001", "--json", str(out))) == 0
    (row,) = json.loads(out.read_text())["runs"]
    assert (row["warmup_s"], row["slo_ttft_s"], row["slo_tpot_ms"], row["slo_ok"]) == (
        30.0,
        0.001,
        50.0,
        False,
    )
    assert row["ttft_mean_s"] > 0.001
    assert run(parse(*base, "--slo-ttft-s", "1000", "--slo-tpot-ms", "1e6", "--json", str(out))) == 0
    (row,) = json.loads(out.read_text())["runs"]
    assert (row["warmup_s"], row["slo_ok"]) == (60.0, True)


def test_scale_factor_and_shapes_are_overrides(tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ("--scenario", "scale", "--agents", "8", "--prefill-nodes", "1", "--decode-nodes", "1")
    assert run(parse(*argv, "--scale-factor", "2", "--gpus-per-node", "1", "--json", str(out))) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["shape"], r["agents"]) for r in runs] == [("1P1D", 8), ("2P2D", 16)]
    argv = ("--scenario", "pd-ratio", "--agents", "8", "--gpus-per-node", "1", "--shapes", "1P1D,3p2d")
    assert run(parse(*argv, "--json", str(out))) == 0
    shapes = {r["shape"] for r in json.loads(out.read_text())["runs"]}
    assert shapes == {"1P1D", "3P2D"}
    capsys.readouterr()
    assert run(parse(*argv, "--prefill-nodes", "2")) == 2
    assert "give it or --prefill-nodes/--decode-nodes, not both" in capsys.readouterr().err
    assert "is not a shape like 2P1D" in _usage_error(capsys, "--shapes", "2X1")
    assert "is not a shape like 2P1D" in _usage_error(capsys, "--shapes", "0P1D")
    # (a scenario without a P/D sweep refuses it, as every override it does not read)
    assert run(parse("--scenario", "ablation", "--shapes", "1P1D")) == 2
    assert "ablation does not use --shapes" in capsys.readouterr().err


def test_balance_window_and_scheduler_knobs_are_overrides(tmp_path, capsys):
    """The SNIC balance window (10 s) and busy threshold (20%), and the scheduler's α, β and Z."""
    out = tmp_path / "n.json"
    argv = ("--scenario", "nic-balance", "--agents", "64", "--gpus-per-node", "2", "--json", str(out))
    assert run(parse(*argv)) == 0
    default = json.loads(out.read_text())["runs"]
    knobs = ("--window-s", "2", "--balance-min-util", "0", "--alpha-read-s", "0.5", "--beta-compute-s", "1")
    assert run(parse(*argv, *knobs, "--z-factor", "1.5")) == 0
    changed = json.loads(out.read_text())["runs"]
    for d, c in zip(default, changed, strict=True):
        assert (d["window_s"], d["balance_min_util"], d["alpha_read_s"], d["z_factor"]) == (
            10.0,
            0.2,
            3.0,
            1.05,
        )
        assert (c["window_s"], c["balance_min_util"], c["alpha_read_s"], c["beta_compute_s"], c["z_factor"]) == (
            2.0, 0.0, 0.5, 1.0, 1.5,
        )  # fmt: skip
        # too little load for a window at 20% (undefined); every window with reads counts at 0
        assert d["snic_max_over_avg"] is None and c["snic_max_over_avg"] >= 1.0
    assert "must be ≥ 1" in _usage_error(capsys, "--z-factor", "0.5")
    assert "must be ≥ 0 and ≤ 1" in _usage_error(capsys, "--balance-min-util", "1.5")


TINY_SHAPE = ("--prefill-nodes", "1", "--decode-nodes", "1", "--gpus-per-node", "1")


@pytest.mark.parametrize(
    ("scenario", "argv", "figures"),
    [
        ("offline-660b", ("--agents", "4", *TINY_SHAPE, "--policy", "basic,dualpath"), ("jct_s", "snic_max_over_avg")),
        ("ablation", ("--agents", "4", *TINY_SHAPE), ("jct_s", "jct_mean_s", "snic_max_over_avg")),
        ("pd-ratio", ("--agents", "4", "--gpus-per-node", "1", "--shapes", "1P1D"), ("jct_s", "snic_max_over_avg")),
        ("online", ("--aps", "0.5", "--horizon-s", "60", *TINY_SHAPE, "--policy", "basic"), ("max_aps",)),
        ("nic-balance", ("--agents", "4", *TINY_SHAPE), ("jct_s", "snic_max_over_avg")),
        ("scale", ("--agents", "4", "--scale-factor", "2", *TINY_SHAPE), ("jct_s",)),
        ("bandwidth-model", ("--agents", "2", "--shapes", "1P1D"), ("jct_s",)),
        ("submit-cost", ("--agents", "4", *TINY_SHAPE, "--submit-us", "0,1"), ("jct_s",)),
        ("split", ("--agents", "4", "--gpus-per-node", "1", "--shapes", "1P1D"), ("jct_s", "snic_max_over_avg")),
        ("emulated", ("--agents", "2",), ("jct_s", "snic_max_over_avg")),
    ],
)  # fmt: skip
def test_every_scenarios_json_holds_the_policy_the_setting_and_its_figures(tmp_path, scenario, argv, figures):
    """The issue's `--json` contract, per scenario (it was checked for the ablation only): one object per
    (policy, setting) with the policy, the setting's parameters and the figures that apply."""
    out = tmp_path / "s.json"
    assert run(parse("--scenario", scenario, *argv, "--json", str(out))) == 0
    data = json.loads(out.read_text())
    assert data["scenario"] == scenario and data["runs"]
    setting = ("prefill_nodes", "decode_nodes", "gpus_per_node", "model", "seed", "snic_gbps", "cnic_gbps")
    for r in data["runs"]:
        for key in ("policy", *setting, "ttft_p50_s", "tpot_p50_s", "wall_s", *figures):
            assert key in r, (scenario, key)
        assert r["ttft_p50_s"] is not None and r["wall_s"] >= 0
        assert ("aps" in r) == (scenario == "online") and ("agents" in r) == (scenario != "online")


def test_a_sweep_refuses_a_setting_it_cannot_run_before_its_first_run(capsys, monkeypatch):
    """A compute NIC too slow for DS-660B's all-to-all on 2P1D (EP16 spans the prefill nodes) but not on
    1P1D (EP8 inside one): found at 2P1D's own run, it ended the sweep and the 1P1D runs were lost."""
    from pdserve.sim import scenarios

    runs = []
    real = scenarios.run_one
    monkeypatch.setattr(scenarios, "run_one", lambda *a, **k: runs.append(a) or real(*a, **k))
    argv = ("--scenario", "split", "--agents", "4", "--cnic-gbps", "30", "--shapes", "1P1D,2P1D")
    assert run(parse(*argv)) == 2
    assert runs == [] and "the prefill EP16 all-to-all needs" in capsys.readouterr().err
    argv = ("--scenario", "scale", "--agents", "4", "--cnic-gbps", "30", "--prefill-nodes", "1")
    assert run(parse(*argv, "--decode-nodes", "1")) == 2 and runs == []  # (1P1D runs; 24P24D cannot)


def test_more_sweep_and_window_refusals(capsys):
    from pdserve.sim.config import SimConfig

    argv = ("--scenario", "split", "--agents", "4", "--shapes", "1P1D,1p1d")
    assert run(parse(*argv)) == 2
    assert "--shapes names a shape twice: 1P1D, 1P1D" in capsys.readouterr().err
    # each link keeps one byte count per window: 1e-6 s windows took GBs
    assert "must be ≥ 0.1" in _usage_error(capsys, "--window-s", "1e-6")
    with pytest.raises(ValueError, match="max_fetch must be ≥ 1"):
        SimConfig(max_fetch=0)  # (it fetched nothing, every 10 ms, for ever)
