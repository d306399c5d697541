"""`pdserve bench dualpath`: the same agentic workload on the same emulated cluster under each policy.

For every policy (default `round_robin` = Basic, then `dualpath`) it launches a fresh cluster from the
node spec (`pdserve launch --nodes ...`: engines on their nodes, the nodes' storage and compute NICs
rate-limited and shared through `pdserve.netem`), with an empty KV store, replays the agents with
`pdserve.bench.agentic`, and stops the cluster. One run prints the side-by-side table: offline JCT and
its ratio, storage-NIC balance (max/avg over `--sample-s` windows, 5 s by default), cache hits, and whether the greedy outputs
of the policies are identical (they must be: placement changes where KV is read, never the tokens; when
they differ, each agent's first differing token is judged on a colocated engine, and only a difference
that is not at a float near-tie fails the run: `bench/divergence.py`).
Online mode sweeps agent arrival rates and reports each policy's highest rate meeting the SLO.
Offline, `--repeats N` runs every policy N times in alternating order (A B, B A, A B, ...), so that
neither policy always runs first, on a machine that warms up or that another job starts to load; each
repeat's ratio is reported and the policies' median JCTs compared.

Engines run without a prefix cache (`--no-prefix-caching`): in the paper's setting thousands of
agents' contexts do not fit in HBM, so every turn reads its history from the store — the regime
DualPath is for. The decode engines still write every full block back to the store.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from pdserve.argtypes import (
    count,
    fraction,
    make_parent,
    name_list,
    number_list,
    output_file,
    plot_file,
    positive,
    wide_console,
)
from pdserve.bench.agentic import WorkloadConfig, build_agents, run_agents, summarize, vocab_size_of
from pdserve.router.placement import REAL_POLICIES

DEFAULT_NODES = "p0:1p,d0:1d,d1:1d"
DEFAULT_APS = [0.25, 0.35, 0.5, 0.7, 1.0, 1.4]  # online: agents/s


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model dir (default: the demo checkpoint, built if missing)")
    p.add_argument("--nodes", default=DEFAULT_NODES, help="node spec as for `pdserve launch --nodes`")
    p.add_argument("--snic-mbps", type=positive, default=8.0, help="storage NIC budget per node (MB/s)")
    p.add_argument("--cnic-mbps", type=positive, default=200.0, help="compute NIC budget per engine (MB/s)")
    p.add_argument(
        "--policies",
        type=name_list(("none", *REAL_POLICIES)),
        default="round_robin,dualpath",
        help="router placement policies, compared in this order (the first is the baseline)",
    )
    p.add_argument(
        "--mode",
        choices=["offline", "online"],
        default="offline",
        help="offline: JCT of every agent at t = 0; online: the highest --aps within the SLOs",
    )
    p.add_argument(
        "--aps",
        type=number_list(positive),
        default=None,
        help="online: arrival rates tried in ascending order until one misses the SLO, agents/s "
        f"(default: {','.join(map(str, DEFAULT_APS))})",
    )
    p.add_argument(
        "--repeats",
        type=count,
        default=1,
        help="offline: run every policy this many times, in alternating order (A B, B A, ...); the "
        "table shows each run, the summary each policy's median JCT",
    )
    p.add_argument("--slo-ttft-s", type=positive, default=4.0, help="online: time to first token, at most")
    p.add_argument(
        "--slo-tpot-s",
        type=positive,
        default=0.2,
        help="online: time per output token, at most (CPU engines decode slower than GPUs' 0.05 s)",
    )
    p.add_argument("--slo-goodput", type=fraction, default=0.9, help="online: fraction of turns within SLO")
    p.add_argument("--workload", default="32k", help="as for `pdserve bench agentic`")
    p.add_argument("--num-agents", type=count, default=16, help="agents (trajectories)")
    p.add_argument("--max-turns", type=count, default=12, help="turns per agent, at most")
    p.add_argument("--length-scale", type=positive, default=0.2, help="multiplies appends and gens")
    p.add_argument("--max-context-tokens", type=count, default=3500, help="per agent")
    p.add_argument("--seed", type=int, default=0, help="trajectories, arrivals and token ids")
    p.add_argument(
        "--sample-s",
        type=positive,
        default=5.0,
        help="SNIC balance window, 5 s unless given: ~10 reads per node per window with this bench's"
        " other settings left as they are (the paper's 50 GB/s SNICs move a 32K-token context in ~26 ms,"
        " so its windows hold dozens of reads)",
    )
    p.add_argument("--json", type=output_file, default=None, help="write every policy's figures here")
    p.add_argument("--plot", type=plot_file, default=None, help="write a plot here (format by suffix)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_policy(a, model_dir: str, policy: str, agents, online: bool) -> dict:
    """Launch the emulated cluster under `policy`, replay `agents`, stop it; the run's figures."""
    from pdserve.launch import cluster_args, start_cluster

    with tempfile.TemporaryDirectory(prefix="pdserve-store-") as store:
        args = cluster_args(
            model_dir,
            nodes=a.nodes,
            snic_mbps=a.snic_mbps,
            cnic_mbps=a.cnic_mbps,
            policy=policy,
            kv_store=store,
            no_prefix_caching=True,
            device="cpu",
            dtype="float32",
        )
        cluster = start_cluster(args, 0, 0)
        try:
            t0 = time.perf_counter()
            result = asyncio.run(
                run_agents(
                    cluster.router_url, agents, online=online, progress=not a.no_progress, sample_s=a.sample_s
                )
            )
            wall_s = time.perf_counter() - t0
        finally:
            cluster.stop()
    planned = {p.agent: len(p.turns) for p in agents}
    summary = summarize(result.records, a.slo_ttft_s, a.slo_tpot_s, planned)
    return {
        "policy": policy,
        "planned_turns": planned,
        "wall_s": wall_s,
        "summary": summary,
        "snic": result.snic,
        "outputs_sha256": result.outputs_sha256(),
        "storage_hit_tokens": sum(r.cached_tokens_storage or 0 for r in result.records if r.ok),
        "records": result.records,
        "outputs": result.outputs,
    }


def _row(run: dict) -> dict:
    s, snic = run["summary"], run["snic"] or {}
    return {
        "policy": run["policy"],
        "jct_s": s.get("jct_s"),
        "agent_time_mean_s": s.get("agent_time_mean_s"),
        "ttft_p50_s": s.get("ttft_p50_s"),
        "tpot_p50_s": s.get("tpot_p50_s"),
        "goodput": s.get("goodput"),
        "turns_failed": s.get("turns_failed"),
        "storage_hit_tokens": run["storage_hit_tokens"],
        "snic_max_over_avg": snic.get("snic_max_over_avg"),
        "snic_bytes_by_node": snic.get("bytes_total"),
        "snic_windows": snic.get("windows"),
        "outputs_sha256": run["outputs_sha256"],
        **{key: run[key] for key in ("repeat", "aps") if key in run},  # (which run of a sweep)
    }


def run(a: argparse.Namespace) -> int:
    from pdserve.demo import ensure_demo_model

    if a.aps is not None and a.mode != "online":  # (was ignored: an offline run taken for a sweep)
        raise ValueError("--aps sets the online sweep's rates: add --mode online")
    if a.repeats > 1 and a.mode != "offline":  # (an online sweep per repeat: hours; not offered)
        raise ValueError("--repeats is for --mode offline")
    model_dir = a.model or ensure_demo_model(".demo-model")
    policies = a.policies
    cfg = dict(
        workload=a.workload,
        num_agents=a.num_agents,
        max_turns=a.max_turns,
        length_scale=a.length_scale,
        max_context_tokens=a.max_context_tokens,
        vocab_size=vocab_size_of(model_dir),
        seed=a.seed,
    )
    out: dict = {"mode": a.mode, "nodes": a.nodes, "snic_mbps": a.snic_mbps, "cnic_mbps": a.cnic_mbps}
    out["workload"] = cfg
    runs: list[dict] = []
    if a.mode == "offline":
        agents = build_agents(WorkloadConfig(**cfg))
        rows = []
        try:
            for repeat in range(a.repeats):
                # Alternating order: a policy that always ran first (or last) met the machine's warm-up
                # (or a load that grew) alone. Each repeat's speedup is against its first policy's run.
                for policy in policies if repeat % 2 == 0 else policies[::-1]:
                    runs.append(run_policy(a, model_dir, policy, agents, online=False))
                    if a.repeats > 1:
                        runs[-1]["repeat"] = repeat
                    rows.append(_row(runs[-1]))
                mine = rows[-len(policies) :]
                base = next(r["jct_s"] for r in mine if r["policy"] == policies[0])
                for r in mine:  # (None: lost turns)
                    r["jct_speedup_vs_first"] = base / r["jct_s"] if base and r["jct_s"] else None
        except Exception as e:  # (a cluster that failed to start in a later repeat lost the earlier ones)
            if a.json and rows:
                partial = out | {"runs": rows, "incomplete": f"{type(e).__name__}: {e}"}
                Path(make_parent(a.json)).write_text(json.dumps(partial, indent=2, default=str))
            raise
        out["runs"] = rows
        if a.repeats > 1:
            out |= _medians(rows, policies)
    else:
        rows = []
        rates = a.aps or DEFAULT_APS
        for policy in policies:
            best, missed = 0.0, False
            for aps in sorted(rates):  # ascending; the first rate missing the SLO ends the sweep
                agents = build_agents(WorkloadConfig(**cfg, aps=aps))
                run_ = run_policy(a, model_dir, policy, agents, online=True) | {"aps": aps}
                row = _row(run_)
                row["meets_slo"] = (row["goodput"] or 0.0) >= a.slo_goodput and not row["turns_failed"]
                rows.append(row)
                runs.append(run_)
                if not row["meets_slo"]:
                    missed = True
                    break
                best = aps
            # (met at every rate tried: its true maximum is at least that, not that)
            rows.append({"policy": policy, "max_aps": best, "max_aps_is_lower_bound": not missed})
        maxima = [r for r in rows if "max_aps" in r]
        if len(maxima) >= 2 and maxima[0]["max_aps"] > 0:
            first, last = maxima[0], maxima[-1]
            out["max_aps_ratio_last_vs_first"] = last["max_aps"] / first["max_aps"]
            # The ratio is exact only when both sweeps ended at a miss; a bound, or nothing, otherwise.
            out["max_aps_ratio_bound"] = {
                (False, False): "exact",
                (True, False): "lower",  # (the last policy's maximum is a floor)
                (False, True): "upper",
                (True, True): "none",
            }[(last["max_aps_is_lower_bound"], first["max_aps_is_lower_bound"])]
        out["runs"] = rows
    # Greedy outputs compared over the runs that lost no turn; None when fewer than two are left.
    comparable = [r for r in runs if not r["summary"].get("turns_failed")]
    shas = {r["outputs_sha256"] for r in comparable}
    # (online too: every rate replays the same prompts, only their arrival times differ)
    out["outputs_identical"] = len(shas) == 1 if len(comparable) >= 2 else None
    mismatch = out["outputs_identical"] is False
    if mismatch:  # (where, and whether only float rounding at near-ties: see bench/divergence.py)
        divergences = out["outputs_divergences"] = _divergences(model_dir, agents, comparable, a)
        mismatch = not divergences or not all(d["near_tie"] for d in divergences)  # (none found: unexplained)
    _print(out)
    if a.json:
        Path(make_parent(a.json)).write_text(json.dumps(out, indent=2, default=str))
    if a.plot:
        _plot(runs, make_parent(a.plot))
    failed = any(r["summary"].get("turns_failed") for r in runs)
    return 1 if failed or mismatch else 0


def _divergences(model_dir: str, agents, runs: list[dict], a: argparse.Namespace) -> list[dict]:
    """Each agent's first token where a run's greedy outputs differ from the first run's, judged on a
    colocated engine."""
    from pdserve import LLM
    from pdserve.bench.divergence import first_divergences, judge

    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=max(4096, a.max_context_tokens + 16))
    found = []
    for other in runs[1:]:
        for d in first_divergences(agents, runs[0]["outputs"], other["outputs"]):
            found.append(judge(llm, d).summary() | {"policies": [runs[0]["policy"], other["policy"]]})
    return found


def _print(out: dict) -> None:
    from rich.table import Table

    t = Table(title=f"DualPath on {out['nodes']} (SNIC {out['snic_mbps']} MB/s per node), {out['mode']}")
    cols = ["policy", "repeat", "aps", "max_aps", "jct_s", "jct_speedup_vs_first", "ttft_p50_s", "tpot_p50_s"]
    cols += ["goodput", "snic_max_over_avg", "storage_hit_tokens"]
    cols = [c for c in cols if any(c in r for r in out["runs"])]
    for c in cols:
        t.add_column(c)
    for r in out["runs"]:
        t.add_row(*(_fmt(r.get(c)) for c in cols))
    wide_console().print(t)
    if out.get("max_aps_ratio_last_vs_first"):
        ratio, bound = out["max_aps_ratio_last_vs_first"], out.get("max_aps_ratio_bound", "exact")
        shown = {"exact": f"{ratio:.2f}x", "lower": f">= {ratio:.2f}x", "upper": f"<= {ratio:.2f}x"}.get(
            bound, f"unknown (both met the SLO at every rate tried; {ratio:.2f}x of the rates)"
        )
        print(f"max APS under the SLO, last policy / first: {shown}")
    if "repeats_compared" in out:
        print(
            f"medians over the {out['repeats_compared']} repeats in which every policy finished all its turns:"
        )
    for policy, speedup in (out.get("median_jct_speedup_vs_first") or {}).items():
        jct = out["median_jct_s"][policy]
        print(f"{policy}: median JCT {_fmt(jct)} s, {_fmt(speedup)}x the first policy's median")
    if out.get("outputs_identical") is not None:
        across = "policies" if out["mode"] == "offline" else "policies and rates"
        print(f"greedy outputs identical across {across}: {out['outputs_identical']}")
    for d in out.get("outputs_divergences") or []:
        what = "a float near-tie (rounding)" if d["near_tie"] else "NOT a near-tie: a real mismatch"
        print(
            f"  agent {d['agent']} turn {d['turn']} token {d['token_index']}: {d['token_a']} vs {d['token_b']}"
            f" ({' vs '.join(d['policies'])}); colocated top-two gap {d['gap']:.2g}: {what}"
        )


def _medians(rows: list[dict], policies: list[str]) -> dict:
    """Each policy's median JCT over the repeats in which every policy finished all its turns (the
    same repeats for all, so one that lost turns does not void the others), and their ratios."""
    import statistics

    repeats = sorted({r["repeat"] for r in rows})
    whole = [n for n in repeats if all(r["jct_s"] for r in rows if r["repeat"] == n)]
    median = {
        p: statistics.median([r["jct_s"] for r in rows if r["policy"] == p and r["repeat"] in whole])
        if whole
        else None
        for p in policies
    }
    first = median[policies[0]]
    return {
        "repeats_compared": len(whole),
        "median_jct_s": median,
        "median_jct_speedup_vs_first": {p: first / m if first and m else None for p, m in median.items()},
    }


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def done_times(records, planned_turns: dict[int, int] | None = None) -> list[float]:
    """When each agent finished, in seconds after the run's first send, ascending: the last is the
    summary's ``jct_s`` (counted from the run's start, the plotted curve ended ~25 ms past it). With
    ``planned_turns`` only the agents that finished all their turns (the summary's)."""
    from pdserve.bench.agentic import agent_times

    first = min((start for start, _ in agent_times(records).values()), default=0.0)
    return sorted(end - first for _, end in agent_times(records, planned_turns).values())


def _plot(runs: list[dict], path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    ax1, ax2 = fig.subplots(1, 2)
    # Online: each policy's curve per rate, and its storage reads at the highest rate it ran (the bars
    # of every rate drew on one spot)
    last_rate = {r["policy"]: r.get("aps") for r in runs}
    for run_ in runs:
        label = run_["policy"] if run_.get("aps") is None else f"{run_['policy']} {run_['aps']:g} APS"
        if run_.get("repeat") is not None:
            label += f" #{run_['repeat']}"
        ends = done_times(run_["records"], run_.get("planned_turns"))
        ax1.step(ends, [(i + 1) / len(ends) for i in range(len(ends))], where="post", label=label)
        snic = run_["snic"] or {}
        per_node = snic.get("bytes_total") or {}
        if per_node and run_.get("aps") == last_rate[run_["policy"]]:
            names = sorted(per_node)
            ax2.bar([f"{label}\n{n}" for n in names], [per_node[n] / 1e6 for n in names], label=label)
    ax1.set_xlabel("agent done, s after the first send (the last: jct_s)")
    ax1.set_ylabel("fraction of agents")
    ax1.legend()
    ax2.set_ylabel("storage reads per node (MB)")
    ax2.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
