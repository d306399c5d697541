"""The simulate CLI: --list, a tiny scenario end to end with --json and --plot, bad input."""

from __future__ import annotations

import argparse
import json

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
    ):
        assert name in out


def test_tiny_ablation_json_and_plot(tmp_path):
    js, png = tmp_path / "a.json", tmp_path / "a.png"
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
    assert data["runs"][0]["jct_change_pct"] == 0.0
    assert png.stat().st_size > 1000


def test_bad_scenario_and_model():
    assert run(parse("--scenario", "nope")) == 2
    assert run(parse("--scenario", "ablation", "--model", "no-such-model", "--agents", "2")) == 2
