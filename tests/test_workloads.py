"""Workload generators: Table 2 fit, determinism, online arrivals, and trace replay (skips if absent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.bench.workloads import (
    TABLE2,
    arrivals,
    fit_report,
    load_workload,
    mooncake_trace,
    table2_workload,
    weka_workload,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.mark.parametrize("row", sorted(TABLE2))
def test_table2_fit_within_15_percent(row):
    for stat, (got, paper) in fit_report(row, num_agents=500, seed=0).items():
        assert abs(got / paper - 1) <= 0.15, (row, stat, got, paper)


def test_trajectories_respect_max_context_and_are_seeded():
    a = table2_workload("48k", 50, seed=1)
    b = table2_workload("48k", 50, seed=1)
    c = table2_workload("48k", 50, seed=2)
    assert np.array_equal(a.append, b.append) and np.array_equal(a.gen, b.gen)
    assert not np.array_equal(a.append[:50], c.append[:50])
    for agent in range(a.num_agents):
        t = a.turns_of(agent)
        total = int(a.append[t.start : t.stop].sum() + a.gen[t.start : t.stop].sum())
        assert total <= TABLE2["48k"].max_context_tokens or len(t) == 1
    assert (a.start_s == 0).all() and (a.hit_override == -1).all()


def test_online_arrivals_are_poisson_at_aps():
    t = arrivals(20_000, aps=0.5, seed=0)
    gaps = np.diff(t)
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(2.0, rel=0.05)
    assert gaps.std() == pytest.approx(2.0, rel=0.1)  # exponential: std == mean
    assert (arrivals(5, None, 0) == 0).all()
    with pytest.raises(ValueError):
        arrivals(5, 0.0, 0)


def test_unknown_workload_raises():
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope", 1, 0)


def _need(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path


def test_mooncake_replay_hit_ratio_matches_readme():
    for name, ratio in (("conversation_trace.jsonl", 0.374), ("synthetic_trace.jsonl", 0.651)):
        w = mooncake_trace(_need(DATA / name))
        hit = w.hit_override.sum()
        prompt = (w.hit_override + w.append).sum()
        # README: infinite-cache prefix hit ratio 37.4% / 65.1%; ours rounds hits down to 64-token blocks.
        assert hit / prompt == pytest.approx(ratio, abs=0.01)
        assert (w.hit_override % 64 == 0).all() and (w.append >= 1).all()
        assert np.all(np.diff(w.start_s) >= 0)


def test_weka_sessions_reuse_their_prefix():
    paths = sorted(_need(DATA / "weka_cc").glob("trace_*.json"))
    w = weka_workload(paths, num_agents=4, seed=0)
    assert w.num_agents == 4
    first = w.offsets[:-1]
    assert (w.hit_override[first] == 0).all()  # a session's first request has nothing to hit
    later = np.ones(w.num_turns, bool)
    later[first] = False
    ratio = w.hit_override[later].sum() / (w.hit_override[later] + w.append[later]).sum()
    assert ratio > 0.9  # README: consecutive turns share ~96% of their prefix
    assert (w.think_s[first] == 0).all() and (w.think_s >= 0).all()


def test_mooncake_follows_offline_and_online_like_every_workload(tmp_path):
    """Offline: every request at t=0; online: Poisson at the APS (the same draw as ``arrivals``);
    ``@trace``: the trace's own timestamps (ms), with which an APS is an error."""
    import json

    rows = [
        {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 4]},
        {"timestamp": 4000, "input_length": 700, "output_length": 5, "hash_ids": [5, 6]},
    ]
    (tmp_path / "conversation_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    offline = load_workload("mooncake", 3, seed=0, data_dir=tmp_path)
    assert (offline.start_s == 0).all()
    online = load_workload("mooncake", 3, seed=4, aps=2.0, data_dir=tmp_path)
    assert np.array_equal(online.start_s, arrivals(3, 2.0, 4))
    timed = load_workload("mooncake@trace", 3, seed=0, data_dir=tmp_path)
    assert timed.start_s.tolist() == [0.0, 1.5, 4.0]
    # The replay itself is the same in every timing: request 1 hits request 0's first two 512-token
    # blocks (1,024 tokens, a multiple of 64), request 2 nothing.
    for w in (offline, online, timed):
        assert w.hit_override.tolist() == [0, 1024, 0] and w.append.tolist() == [1200, 76, 700]
    with pytest.raises(ValueError, match="own arrival times"):
        load_workload("mooncake@trace", 3, seed=0, aps=1.0, data_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("mooncake@later", 3, seed=0, data_dir=tmp_path)


def test_an_empty_weka_session_is_no_agent_and_shifts_no_think_time(tmp_path):
    """A session with no requests gave 0 turns but one think time: every later agent's think times
    moved by one turn (agent 2's first turn took the previous session's last think time)."""
    import json

    from pdserve.bench.workloads import weka_workload

    def session(path, thinks):
        reqs = [{"in": 64 * (i + 1), "out": 4, "hash_ids": list(range(i + 1)), "think_time": t}
                for i, t in enumerate(thinks)]  # fmt: skip
        path.write_text(json.dumps({"requests": reqs, "block_size": 64}))

    (tmp_path / "trace_0000.json").write_text(json.dumps({"requests": []}))
    session(tmp_path / "trace_0001.json", [0, 12.0, 8.0])
    session(tmp_path / "trace_0002.json", [0, 170.0])
    wl = weka_workload(sorted(tmp_path.glob("trace_*.json")), 2, seed=0)
    assert wl.num_agents == 2 and list(wl.offsets) == [0, 3, 5]
    assert wl.think_s.tolist() == [0.0, 12.0, 8.0, 0.0, 170.0]
