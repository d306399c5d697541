"""`pdserve bench agentic`: replay agent trajectories against an OpenAI-compatible router or engine.

Each agent is a chain of turns run one after another (one asyncio task per agent). Prompts are token
ids, so equal block hashes mean identical tokens: turn i's prompt = turn i-1's prompt + turn i-1's
output ids + ``append_i`` fresh ids from a seeded RNG. Outputs are greedy (``ignore_eos``) and streamed
with ``return_token_ids``; their sha256 (agent/turn order) compares runs under different policies.

Workloads come from :mod:`pdserve.bench.workloads` (Table 2 rows, Mooncake and weka_cc traces), scaled
down by ``length_scale`` and cut at ``max_context_tokens``. Offline mode: every agent starts at t=0
(JCT, agent completion times). Online mode: Poisson arrivals at ``aps`` agents/s (TTFT, TTST, TPOT
percentiles, goodput under a TTFT/TPOT SLO). When the router serves ``/pd/cluster`` its per-node SNIC
byte counters are sampled every ``sample_s`` and reduced to ``snic_max_over_avg``.

Length (~550 lines): one benchmark from plan to table and plot — agents' prompts, the streaming
client, the SNIC sampler, the summary; each piece is small and only this command uses them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from pdserve.argtypes import (
    count,
    engine_url,
    json_object,
    make_parent,
    non_negative,
    number,
    output_file,
    plot_file,
    positive,
    wide_console,
)
from pdserve.bench import served_model_card, time_per_output_token
from pdserve.bench.workloads import TABLE2, arrivals, load_workload
from pdserve.server.auth import client_headers

WORKLOADS = [*sorted(TABLE2), "mooncake", "mooncake-synthetic", "weka_cc"]
DEFAULT_APS = 1.0  # online: agent arrivals per second


@dataclass(frozen=True)
class WorkloadConfig:
    """What to replay, scaled so contexts fit a small model. ``aps`` None: all agents start at t=0."""

    workload: str = "32k"
    num_agents: int = 8
    max_turns: int = 16
    length_scale: float = 0.1  # multiplies appends and generated lengths
    max_context_tokens: int = 2048  # a turn is kept only if prompt + generated tokens fit
    vocab_size: int = 256
    seed: int = 0
    aps: float | None = None
    think_s: float = 0.0  # delay before each turn after the first (tool latency)
    data_dir: str | None = None
    token_seed: int | None = None  # seeds the token ids only (None: ``seed``); shapes stay the same


@dataclass(frozen=True)
class TurnPlan:
    append_ids: list[int]  # new prompt ids of this turn (the whole first prompt on turn 0)
    gen_tokens: int
    think_s: float  # wait after the previous turn ends


@dataclass(frozen=True)
class AgentPlan:
    agent: int
    start_s: float  # arrival, from the run's start (0 offline)
    turns: list[TurnPlan]

    def prompt_tokens(self, turn: int) -> int:
        """Prompt length of ``turn`` (outputs have exactly their requested length)."""
        t = self.turns
        return sum(len(x.append_ids) for x in t[: turn + 1]) + sum(x.gen_tokens for x in t[:turn])


def vocab_size_of(model_dir: str | Path) -> int:
    """The vocabulary size in a model directory's config.json (token ids are drawn below it)."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def build_agents(cfg: WorkloadConfig) -> list[AgentPlan]:
    """Scaled, cut, tokenized trajectories, deterministic in ``cfg``. Agent a's ids come from an RNG
    seeded by (token_seed, workload name, a): a new ``token_seed`` replays the same shapes against a
    server's warm prefix cache or store without hitting what an earlier run left there."""
    if cfg.max_context_tokens < 2:
        raise ValueError("max_context_tokens must be >= 2")
    if "@" in cfg.workload:  # (its arrival times were replaced by all-zero or Poisson ones, silently)
        raise ValueError(
            f"{cfg.workload}: the benches replay a trace's turns, not its timing (arrivals: --aps, think"
            f" time: --think-s); use {cfg.workload.partition('@')[0]}, or the simulator for the trace's timing"
        )
    data_dir = Path(cfg.data_dir) if cfg.data_dir else None
    wl = load_workload(cfg.workload, cfg.num_agents, cfg.seed, None, data_dir)
    start_s = arrivals(wl.num_agents, cfg.aps, cfg.seed)
    token_seed = cfg.seed if cfg.token_seed is None else cfg.token_seed
    lo, hi = (10, cfg.vocab_size - 10) if cfg.vocab_size > 20 else (0, cfg.vocab_size)
    agents = []
    for a in range(wl.num_agents):
        rng = np.random.default_rng([token_seed, zlib.crc32(cfg.workload.encode()), a])
        turns: list[TurnPlan] = []
        context = 0
        for i in list(wl.turns_of(a))[: cfg.max_turns]:
            trace_hit = int(wl.hit_override[i])
            if turns and trace_hit >= 0:
                # A trace's later turn (weka_cc): its prompt is hit + append, and the hit covers only
                # earlier *prompts*, so the previous output is inside its append already. Aim at the
                # trace's prompt length: adding the append to our prompt + output counted that output
                # twice a turn (a session's last prompt 1.8x the trace's: a review, 2026-12-05). A turn
                # after which the trace compacts its context (a shorter prompt) appends one token:
                # append-only prompts cannot shrink.
                target = round((int(wl.append[i]) + trace_hit) * cfg.length_scale)
                append = max(1, target - context)
            else:
                append = int(wl.append[i]) + (0 if turns else max(trace_hit, 0))
                append = max(1, round(append * cfg.length_scale))
            gen = max(1, round(int(wl.gen[i]) * cfg.length_scale))
            if not turns:  # clip the first turn instead of dropping the agent
                gen = min(gen, max(1, cfg.max_context_tokens // 4))
                append = min(append, cfg.max_context_tokens - gen)
            if context + append + gen > cfg.max_context_tokens:
                break
            if wl.prompt_blocks is not None and not turns:
                ids = _trace_block_ids(wl, a, cfg, token_seed, lo, hi)[:append]
                ids += rng.integers(lo, hi, append - len(ids)).tolist()  # (rounding: a few at most)
            else:
                ids = rng.integers(lo, hi, append).tolist()
            turns.append(TurnPlan(ids, gen, cfg.think_s if turns else 0.0))
            context += append + gen
        agents.append(AgentPlan(a, float(start_s[a]), turns))
    return agents


def _trace_block_ids(wl, agent: int, cfg: WorkloadConfig, token_seed: int, lo: int, hi: int) -> list[int]:
    """Agent `agent`'s first prompt made of the trace's blocks: each block's ids drawn from an RNG seeded
    by (token_seed, workload, block hash), so requests whose traces share blocks share those prompt
    tokens, and the real system sees the prefix hits the simulator counts (a Mooncake replay had none:
    every prompt was fresh, against the simulator's 37% hit ratio; a review, 2026-12-05). The hashes
    name whole prefixes (a block's hash is the same only after the same blocks), as the trace's are."""
    n = max(1, round(wl.prompt_block_tokens * cfg.length_scale))
    name_crc = zlib.crc32(cfg.workload.encode())
    ids: list[int] = []
    for h in wl.prompt_blocks[agent]:
        ids += np.random.default_rng([token_seed, name_crc, 1 << 32, h]).integers(lo, hi, n).tolist()
    return ids


def turn_prompts(plan: AgentPlan, outputs: list[list[int]]) -> list[list[int]]:
    """Prompt of every turn given the outputs of the turns before it (the replay rule)."""
    prompts: list[list[int]] = []
    for i, turn in enumerate(plan.turns[: len(outputs) + 1]):
        prev = prompts[-1] + outputs[i - 1] if i else []
        prompts.append(prev + turn.append_ids)
    return prompts


@dataclass
class TurnRecord:
    """One turn's measurements; times in seconds, ``start_s`` from the run's start."""

    agent: int
    turn: int
    prompt_tokens: int
    gen_tokens: int  # requested
    start_s: float = 0.0
    output_tokens: int = 0
    cached_tokens: int | None = None
    cached_tokens_storage: int | None = None
    ttft_s: float | None = None
    ttst_s: float | None = None  # time to second token
    tpot_s: float | None = None
    e2e_s: float | None = None
    ok: bool = False
    error: str = ""


@dataclass
class Result:
    mode: str
    records: list[TurnRecord] = field(default_factory=list)
    outputs: dict[int, list[list[int]]] = field(default_factory=dict)  # agent -> output ids per turn
    prompts: dict[int, list[list[int]]] = field(default_factory=dict)  # only with keep_prompts
    wall_s: float = 0.0
    snic: dict = field(default_factory=dict)

    def agent_sha256(self) -> dict[int, str]:
        return {a: _sha([(a, outs)]) for a, outs in sorted(self.outputs.items())}

    def outputs_sha256(self) -> str:
        return _sha(sorted(self.outputs.items()))


def _sha(items) -> str:
    h = hashlib.sha256()
    for agent, outs in items:
        for turn, ids in enumerate(outs):
            h.update(f"{agent}:{turn}:{','.join(map(str, ids))};".encode())
    return h.hexdigest()


async def _read_sse(r: httpx.Response, rec: TurnRecord, ids: list[int], stamps: list) -> None:
    """Collect output ids (and their arrival times) and usage from an SSE completion stream."""
    async for line in r.aiter_lines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            rec.error = str(chunk["error"].get("message", chunk["error"]))
            return
        if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
            ids += chunk["choices"][0]["token_ids"]
            stamps.append((time.perf_counter(), len(ids)))
        if chunk.get("usage"):
            details = chunk["usage"].get("prompt_tokens_details") or {}
            rec.cached_tokens = details.get("cached_tokens")
            rec.cached_tokens_storage = details.get("cached_tokens_storage")


async def _turn(client: httpx.AsyncClient, url: str, body: dict, t0: float, rec: TurnRecord) -> list[int]:
    """Stream one completion; fills ``rec`` and returns the output ids."""
    ids: list[int] = []
    stamps: list[tuple[float, int]] = []  # (arrival time, tokens so far)
    sent = time.perf_counter()
    rec.start_s = sent - t0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
            else:
                await _read_sse(r, rec, ids, stamps)
    except Exception as e:  # a failed turn is a data point, not a crash
        rec.error = rec.error or repr(e)
    rec.e2e_s = time.perf_counter() - sent
    rec.output_tokens = len(ids)
    if stamps:
        rec.ttft_s = stamps[0][0] - sent
        if len(ids) >= 2:
            rec.ttst_s = next(t for t, n in stamps if n >= 2) - sent
            rec.tpot_s = time_per_output_token(stamps)
    if not rec.error and len(ids) != rec.gen_tokens:
        rec.error = f"{len(ids)} of {rec.gen_tokens} tokens" + ("" if ids else " (no token_ids in stream)")
    rec.ok = not rec.error
    return ids


async def fetch_cluster(client: httpx.AsyncClient, url: str) -> dict:
    """``GET {url}/pd/cluster``; {} when the server has no such endpoint (404) or is unreachable."""
    try:
        r = await client.get(url + "/pd/cluster", timeout=5.0)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def sample_cluster(url: str, timeout_s: float = 5.0) -> dict:
    """Sync ``GET {url}/pd/cluster`` (``{"nodes": {name: {"snic_bytes_served": int, ...}}}``); {} if absent."""
    try:
        r = httpx.get(url.rstrip("/") + "/pd/cluster", timeout=timeout_s)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def _snic_bytes(snapshot: dict) -> dict[str, int]:
    nodes = snapshot.get("nodes") or {}
    return {n: int(v["snic_bytes_served"]) for n, v in nodes.items() if "snic_bytes_served" in v}


def snic_stats(samples: list[tuple[float, dict[str, int]]]) -> dict:
    """Per-window SNIC bytes per node and ``snic_max_over_avg`` = mean, over windows in which any SNIC
    moved bytes, of max/avg across the nodes sampled at both ends of the window (1.0 = balanced).
    Counters that go down (a restarted node) count 0. {} with fewer than 2 samples."""
    if len(samples) < 2:
        return {}
    nodes = sorted(set().union(*(s for _, s in samples)))
    windows, ratios = [], []
    for (_, a), (t1, b) in zip(samples, samples[1:], strict=False):
        live = {n: max(0, b[n] - a[n]) for n in nodes if n in a and n in b}  # nodes seen at both ends
        windows.append({"end_s": round(t1, 3), "bytes": {n: live.get(n, 0) for n in nodes}})
        if sum(live.values()) > 0:
            ratios.append(max(live.values()) / (sum(live.values()) / len(live)))
    return {
        "nodes": nodes,
        "bytes_total": {n: sum(w["bytes"][n] for w in windows) for n in nodes},
        "snic_max_over_avg": float(np.mean(ratios)) if ratios else None,
        "windows": windows,
    }


async def _sampler(client, url: str, period_s: float, t0: float, out: list) -> None:
    """Sample the cluster's SNIC counters every `period_s` until cancelled. A router without placement
    answers nothing from the start: stop. A fetch that fails later (a timeout under load) is skipped,
    not the end of sampling: the windows after it stay `period_s` wide."""
    while True:
        snapshot = await fetch_cluster(client, url)
        if snapshot:
            out.append((time.perf_counter() - t0, _snic_bytes(snapshot)))
        elif not out:
            return
        await asyncio.sleep(period_s)


async def run_agents(
    url: str,
    agents: list[AgentPlan],
    *,
    online: bool,
    model: str | None = None,
    extra_body: dict | None = None,
    timeout_s: float = 600.0,
    sample_s: float = 1.0,
    progress: bool = False,
    keep_prompts: bool = False,
) -> Result:
    """Run every agent to its end (or first failed turn). Online: agent a starts at ``start_s``."""
    from tqdm import tqdm

    url = url.rstrip("/")
    result = Result("online" if online else "offline")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=client_headers()) as client:
        t0 = time.perf_counter()
        samples: list = []
        sampler = asyncio.create_task(_sampler(client, url, sample_s, t0, samples)) if sample_s > 0 else None
        bar = tqdm(total=sum(len(a.turns) for a in agents), unit="turn", disable=not progress)

        async def agent(plan: AgentPlan) -> None:
            if online:
                await asyncio.sleep(max(0.0, plan.start_s - (time.perf_counter() - t0)))
            outs = result.outputs[plan.agent] = []
            prompt: list[int] = []
            for i, turn in enumerate(plan.turns):
                if i and turn.think_s > 0:
                    await asyncio.sleep(turn.think_s)
                prompt = prompt + (outs[-1] if i else []) + turn.append_ids  # == turn_prompts(...)[i]
                body = {
                    **({"model": model} if model else {}),
                    "prompt": prompt,
                    "max_tokens": turn.gen_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "return_token_ids": True,
                    "stream_options": {"include_usage": True},
                    **(extra_body or {}),
                }
                rec = TurnRecord(plan.agent, i, len(prompt), turn.gen_tokens)
                ids = await _turn(client, url, body, t0, rec)
                result.records.append(rec)
                if keep_prompts:
                    result.prompts.setdefault(plan.agent, []).append(prompt)
                bar.update(1)
                if not rec.ok:
                    return
                outs.append(ids)

        try:
            await asyncio.gather(*(agent(p) for p in agents))
        finally:
            bar.close()
            result.wall_s = time.perf_counter() - t0
            if sampler is not None:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
                if samples and (last := await fetch_cluster(client, url)):
                    samples.append((time.perf_counter() - t0, _snic_bytes(last)))
                result.snic = snic_stats(samples)
    result.records.sort(key=lambda r: (r.agent, r.turn))
    return result


async def run_offline(url: str, agents: list[AgentPlan], **kw) -> Result:
    """All agents start at t=0 (their ``start_s`` is ignored)."""
    return await run_agents(url, agents, online=False, **kw)


async def run_online(url: str, agents: list[AgentPlan], **kw) -> Result:
    """Agent a starts at its ``start_s`` (Poisson arrivals from ``build_agents`` with ``aps``)."""
    return await run_agents(url, agents, online=True, **kw)


def pct(values: list[float], q: float) -> float | None:
    """Percentile with linear interpolation (numpy's default); None when empty."""
    return float(np.percentile(values, q)) if values else None


def agent_times(
    records: list[TurnRecord], planned_turns: dict[int, int] | None = None
) -> dict[int, tuple[float, float]]:
    """agent -> (first send, last turn end), seconds from the run's start; with ``planned_turns``
    (agent -> its turns) only the agents that finished all their turns (as `summarize` counts them:
    a plot of the others drew cut-short agents that the summary leaves out)."""
    spans: dict[int, tuple[float, float]] = {}
    num_ok: dict[int, int] = {}
    for r in records:
        end = r.start_s + (r.e2e_s or 0.0)
        s0, s1 = spans.get(r.agent, (r.start_s, end))
        spans[r.agent] = (min(s0, r.start_s), max(s1, end))
        num_ok[r.agent] = num_ok.get(r.agent, 0) + bool(r.ok)
    if planned_turns is not None:
        spans = {a: span for a, span in spans.items() if num_ok[a] >= planned_turns.get(a, 0)}
    return spans


def summarize(
    records: list[TurnRecord],
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    planned_turns: dict[int, int] | None = None,
) -> dict:
    """Totals, JCT, agent completion times, TTFT/TTST/TPOT/E2E p50/p90/p99 (s) and goodput: the fraction
    of all turns that succeeded with TTFT <= ``slo_ttft_s`` and TPOT <= ``slo_tpot_s`` (None: no bound).

    ``planned_turns`` (agent -> its number of turns): an agent stops at its first failed turn, so its
    later turns are never sent. With it, goodput counts them as missed, agents that did not finish all
    their turns are left out of the agent times (and counted in ``agents_unfinished``), and the JCT is
    None unless every agent finished: a run that lost turns has no job completion time."""
    ok = [r for r in records if r.ok]
    spans = agent_times(records)
    num_ok = {a: 0 for a in spans}
    for r in ok:
        num_ok[r.agent] += 1
    unfinished = set()
    if planned_turns is not None:
        unfinished = {a for a, n in planned_turns.items() if num_ok.get(a, 0) < n}
    durations = [e - s for a, (s, e) in spans.items() if a not in unfinished]
    wall_s = max(e for _, e in spans.values()) - min(s for s, _ in spans.values()) if spans else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    num_planned = sum(planned_turns.values()) if planned_turns is not None else len(records)
    out = {
        "agents": len(spans),
        "agents_unfinished": len(unfinished),
        "turns": len(records),
        "turns_ok": len(ok),
        "turns_failed": len(records) - len(ok),
        "turns_not_sent": num_planned - len(records),
        "prompt_tokens": prompt,
        "output_tokens": sum(r.output_tokens for r in ok),
        "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "cache_hit_ratio": sum(r.cached_tokens or 0 for r in ok) / prompt if prompt else None,
        "jct_s": wall_s if not unfinished else None,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else None,
        "agent_time_mean_s": float(np.mean(durations)) if durations else None,
    }
    series = {"agent_time": durations}
    for name in ("ttft", "ttst", "tpot", "e2e"):
        series[name] = [v for r in ok if (v := getattr(r, f"{name}_s")) is not None]
    for name, vals in series.items():
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = pct(vals, q)

    def meets(r: TurnRecord) -> bool:
        ttft_ok = slo_ttft_s is None or (r.ttft_s is not None and r.ttft_s <= slo_ttft_s)
        return r.ok and ttft_ok and (slo_tpot_s is None or r.tpot_s is None or r.tpot_s <= slo_tpot_s)

    good = sum(meets(r) for r in records)
    out |= {"slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s}
    out["goodput"] = good / num_planned if num_planned else None
    out["goodput_turns_per_s"] = good / wall_s if wall_s > 0 else None
    return out


def print_table(mode: str, summary: dict) -> None:
    from rich.table import Table

    keys = ["agents", "turns_ok", "turns_failed", "output_tokens", "cache_hit_ratio", "output_tokens_per_s"]
    if mode == "offline":
        keys += ["jct_s", "agent_time_mean_s", "agent_time_p50_s", "agent_time_p90_s", "agent_time_p99_s"]
    else:
        keys += [f"{m}_p{q}_s" for m in ("ttft", "ttst", "tpot") for q in (50, 90, 99)] + ["goodput"]
    keys += [k for k in ("snic_max_over_avg",) if summary.get(k) is not None]
    table = Table(title=f"pdserve bench agentic ({mode})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in keys:
        v = summary.get(k)
        table.add_row(k, "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
    wide_console().print(table)


def plot(
    records: list[TurnRecord], path: str, title: str = "", planned_turns: dict[int, int] | None = None
) -> None:
    """CDF of agent completion times (of the agents that finished, given ``planned_turns``) and
    per-turn TTFT over time, as a PNG (Agg, no global backend)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), tight_layout=True)
    ax1, ax2 = fig.subplots(1, 2)
    durations = sorted(e - s for s, e in agent_times(records, planned_turns).values())
    cdf = np.arange(len(durations) + 1) / max(len(durations), 1)
    ax1.step([0.0, *durations], cdf, where="post")
    ax1.set(xlabel="agent completion time (s)", ylabel="CDF", ylim=(0, 1.02), title=title)
    ok = [r for r in records if r.ok and r.ttft_s is not None]
    ax2.scatter([r.start_s for r in ok], [r.ttft_s for r in ok], s=8, c=[r.turn for r in ok])
    ax2.set(xlabel="turn sent at (s)", ylabel="TTFT (s)", title="per-turn TTFT (colour: turn index)")
    fig.savefig(path, dpi=110)


def add_agentic_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", type=engine_url, default="http://127.0.0.1:8000", help="router or colocated engine base URL"
    )
    p.add_argument("--model", default=None, help="served model name (default: first of /v1/models)")
    p.add_argument("--model-dir", default=None, help="model dir; its config.json gives the vocab size")
    p.add_argument(
        "--vocab-size",
        type=number(int, 21, low_ok=True),
        default=None,
        help="ids drawn from [10, V-10) (default 256)",
    )
    p.add_argument("--workload", default="32k", choices=WORKLOADS, help="Table 2 row or a trace")
    p.add_argument("--data-dir", default=None, help="trace directory (default ../shared/data)")
    p.add_argument(
        "--mode",
        default="offline",
        choices=["offline", "online"],
        help="offline: every agent at t = 0; online: Poisson arrivals at --aps",
    )
    p.add_argument("--num-agents", type=count, default=8, help="agents (trajectories)")
    p.add_argument("--max-turns", type=count, default=16, help="turns per agent, at most")
    p.add_argument("--length-scale", type=positive, default=0.1, help="multiplies appends and gens")
    p.add_argument(
        "--max-context-tokens", type=count, default=None, help="per agent (default: max_model_len or 2048)"
    )
    p.add_argument(
        "--aps",
        type=positive,
        default=None,
        help=f"online: agent arrivals per second, Poisson (default: {DEFAULT_APS})",
    )
    p.add_argument(
        "--think-s",
        type=non_negative,
        default=0.0,
        help="tool latency between turns, every turn alike (a trace's own think times, e.g. "
        "weka_cc's, are not replayed: the bench scales lengths to run on small models, not timing)",
    )
    p.add_argument("--slo-ttft-s", type=positive, default=4.0, help="goodput: time to first token, at most")
    p.add_argument(
        "--slo-tpot-s", type=positive, default=0.05, help="goodput: time per output token, at most"
    )
    p.add_argument("--sample-s", type=non_negative, default=1.0, help="/pd/cluster sampling period (0: off)")
    p.add_argument(
        "--extra-body",
        type=json_object,
        default=None,
        help='JSON merged into every request, e.g. {"read_path":"pe"}',
    )
    p.add_argument("--timeout-s", type=positive, default=600.0, help="per request")
    p.add_argument("--seed", type=int, default=0, help="trajectories, arrivals and token ids")
    p.add_argument("--token-seed", type=int, default=None, help="token ids only (a cold-cache rerun)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--json", type=output_file, default=None, help="write config, summary and per-turn records here"
    )
    p.add_argument("--plot", type=plot_file, default=None, help="write a plot here (format by suffix)")


def run_agentic(args: argparse.Namespace) -> dict:
    """The CLI entry: build the workload, run it, print a table, write --json / --plot; returns the
    JSON payload (``summary["turns_failed"] == 0`` means every turn succeeded)."""
    online = args.mode == "online"
    if args.aps is not None and not online:  # (was ignored: an offline run the user took for online)
        raise ValueError(
            "--aps sets online arrivals: add --mode online (offline starts every agent at t = 0)"
        )
    url = args.url.rstrip("/")
    served = served_model_card(url)
    vocab = args.vocab_size
    if vocab is None and args.model_dir:
        vocab = vocab_size_of(args.model_dir)
    cfg = WorkloadConfig(
        workload=args.workload,
        num_agents=args.num_agents,
        max_turns=args.max_turns,
        length_scale=args.length_scale,
        max_context_tokens=args.max_context_tokens or served.get("max_model_len") or 2048,
        vocab_size=vocab or 256,
        seed=args.seed,
        aps=(args.aps or DEFAULT_APS) if online else None,
        think_s=args.think_s,
        data_dir=args.data_dir,
        token_seed=args.token_seed,
    )
    agents = build_agents(cfg)
    model = args.model or served["id"]
    extra_body = args.extra_body  # (a dict: parsed and checked by argparse)
    run = run_online if online else run_offline
    kw = dict(model=model, extra_body=extra_body, timeout_s=args.timeout_s, sample_s=args.sample_s)
    result = asyncio.run(run(url, agents, progress=not args.no_progress, **kw))
    planned = {a.agent: len(a.turns) for a in agents}
    summary = summarize(result.records, args.slo_ttft_s, args.slo_tpot_s, planned)
    summary["snic_max_over_avg"] = result.snic.get("snic_max_over_avg")
    payload = {
        "mode": result.mode,
        "config": {**asdict(cfg), "url": url, "model": model, "extra_body": extra_body},
        "summary": summary,
        "outputs_sha256": result.outputs_sha256(),
        "agent_outputs_sha256": {str(a): h for a, h in result.agent_sha256().items()},
        "snic": result.snic,
        "turns": [asdict(r) for r in result.records],
    }
    print_table(result.mode, summary)
    failed = [r for r in result.records if not r.ok]
    if failed:  # (a table of dashes said 2 turns failed, never why: e.g. a model the server lacks)
        first = failed[0]
        print(
            f"{len(failed)} turn(s) failed; the first (agent {first.agent}, turn {first.turn}): {first.error}",
            file=sys.stderr,
        )
    print(f"outputs_sha256 {payload['outputs_sha256']}")
    if args.json:
        Path(make_parent(args.json)).write_text(json.dumps(payload, indent=1))
    if args.plot:
        title = f"{cfg.workload}, {len(agents)} agents, {result.mode}"
        plot(result.records, make_parent(args.plot), title, planned)
    return payload
