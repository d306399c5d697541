"""Agentic workloads: synthetic trajectories fitted to DualPath Table 2, and replay of real traces.

Who uses it: the simulator (``pdserve.sim``) and the real benchmark client. A workload is a list of
agents; each agent is a trajectory of turns that run one after another (turn i+1 is submitted when
turn i's last token is out, plus the turn's think time). Torch-free; numpy for generation speed.

Replay semantics (paper §7 / notes): the prompt of turn i+1 is the whole previous context (prompt +
generated tokens of turn i) plus A_{i+1} new tokens; hits occur only within a trajectory; the store
holds only *full* blocks, so the hit of turn i+1 is the previous context rounded down to
``block_tokens`` (64). Tool latency is zero for synthetic trajectories.

Table 2 fit. The columns do not multiply out (157 turns x (429 + 176) ≠ 55,958), which means long
trajectories have short appends: we draw per trajectory a first prompt P0, a target number of turns,
and per-trajectory append / generation scales, then stop the trajectory when the next turn would pass
the row's max context. Statistics are defined per trajectory and then averaged over trajectories:
``turns``; ``append`` = mean append of turns 2..n; ``gen`` = mean generated tokens; ``total`` = final
context; ``context`` = mean prompt length. ``FITS`` holds the parameters, found by a coarse grid search
(``fit_report`` prints how close each row is; ``tests/test_workloads.py`` holds them within 15%).

Offline mode: all agents start at t=0. Online mode: agents arrive as a Poisson process at ``aps``
agents per second (seeded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 64  # store block (DESIGN.md glossary)
MOONCAKE_BLOCK_TOKENS = 512  # the Mooncake traces' `hash_ids` blocks


class TraceExhausted(ValueError):
    """A trace workload was asked for more requests than its file holds (an online run: APS x horizon)."""


@dataclass(frozen=True)
class Table2Row:
    """One row of the paper's Table 2 (means over 500 trajectories)."""

    max_context_tokens: int
    turns: float
    append: float
    gen: float
    total: float
    context: float


TABLE2: dict[str, Table2Row] = {
    "32k": Table2Row(32_768, 60, 608, 148, 28_639, 17_183),
    "48k": Table2Row(49_152, 106, 474, 172, 42_607, 25_120),
    "64k": Table2Row(65_536, 157, 429, 176, 55_958, 32_721),
}


@dataclass(frozen=True)
class TrajectoryFit:
    """Generator parameters (means of lognormals, sigmas of their logs)."""

    first_prompt_mean: float
    first_prompt_sigma: float
    turns_mean: float
    turns_sigma: float
    append_mean: float
    append_traj_sigma: float
    gen_mean: float
    turn_sigma: float = 0.5  # per-turn spread around the trajectory's scale


FITS: dict[str, TrajectoryFit] = {
    "32k": TrajectoryFit(4915, 0.5, 180, 1.0, 608, 1.1, 148),
    "48k": TrajectoryFit(7373, 0.5, 318, 1.0, 474, 1.4, 172),
    "64k": TrajectoryFit(9830, 0.5, 280, 0.5, 429, 1.4, 176),
}


@dataclass(frozen=True)
class Workload:
    """Agents as flat int arrays (compact enough for 48K agents x 60 turns).

    Turn t of agent a is index ``offsets[a] + t``; ``append[i]`` new prompt tokens, ``gen[i]`` generated
    tokens, ``think_s[i]`` delay before the turn is submitted (after the previous turn ends), and
    ``hit_override[i]`` the hit tokens when known from a trace (-1: derive from the previous context).
    ``start_s[a]`` is when the agent's first turn is submitted. ``prompt_blocks[a]`` (Mooncake: one-turn
    agents) the trace's block hashes of agent a's prompt, ``prompt_block_tokens`` tokens each: equal
    hashes are equal prompt blocks, so the real benchmark's prompts share the prefixes the simulator
    counts as hits (None: no trace blocks).
    """

    name: str
    offsets: np.ndarray
    append: np.ndarray
    gen: np.ndarray
    think_s: np.ndarray
    hit_override: np.ndarray
    start_s: np.ndarray
    prompt_blocks: tuple[tuple[int, ...], ...] | None = None
    prompt_block_tokens: int = 0

    @property
    def num_agents(self) -> int:
        return len(self.start_s)

    @property
    def num_turns(self) -> int:
        return int(self.offsets[-1])

    def turns_of(self, agent: int) -> range:
        return range(int(self.offsets[agent]), int(self.offsets[agent + 1]))


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size=None) -> np.ndarray:
    """Lognormal with the given *mean* (not median)."""
    mu = np.log(mean) - sigma * sigma / 2.0
    return rng.lognormal(mu, sigma, size)


def synthetic_trajectories(row: str, num_agents: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per agent (append, gen) arrays for a Table 2 row; turn 1's append is the first prompt."""
    if row not in TABLE2:
        raise ValueError(f"unknown workload row {row!r}; known: {sorted(TABLE2)}")
    t2, fit = TABLE2[row], FITS[row]
    rng = np.random.default_rng(seed)
    max_ctx = t2.max_context_tokens
    appends: list[np.ndarray] = []
    gens: list[np.ndarray] = []
    n_target = np.maximum(1, _lognormal(rng, fit.turns_mean, fit.turns_sigma, num_agents).astype(np.int64))
    p0 = np.minimum(_lognormal(rng, fit.first_prompt_mean, fit.first_prompt_sigma, num_agents), max_ctx / 2)
    a_scale = _lognormal(rng, fit.append_mean, fit.append_traj_sigma, num_agents)
    g_scale = _lognormal(rng, fit.gen_mean, fit.append_traj_sigma / 2, num_agents)
    for j in range(num_agents):
        n = int(n_target[j])
        a = np.maximum(1, _lognormal(rng, a_scale[j], fit.turn_sigma, n)).astype(np.int64)
        g = np.maximum(1, _lognormal(rng, g_scale[j], fit.turn_sigma, n)).astype(np.int64)
        a[0] = max(1, int(p0[j]))
        ctx = np.cumsum(a + g)
        keep = max(1, int(np.searchsorted(ctx, max_ctx, side="right")))
        appends.append(a[:keep])
        gens.append(g[:keep])
    return appends, gens


def _assemble(
    name: str,
    appends: list[np.ndarray],
    gens: list[np.ndarray],
    start_s: np.ndarray,
    think: list[np.ndarray] | None = None,
    hits: list[np.ndarray] | None = None,
) -> Workload:
    lens = np.array([len(a) for a in appends], dtype=np.int64)
    for per_turn in (gens, think, hits):  # (one agent's arrays of unequal lengths shifted the next's)
        if per_turn is not None and [len(x) for x in per_turn] != lens.tolist():
            raise ValueError(f"{name}: per-turn arrays of unequal lengths")
    offsets = np.zeros(len(appends) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    total = int(offsets[-1])
    return Workload(
        name=name,
        offsets=offsets,
        append=np.concatenate(appends).astype(np.int64) if total else np.zeros(0, np.int64),
        gen=np.concatenate(gens).astype(np.int64) if total else np.zeros(0, np.int64),
        think_s=np.concatenate(think).astype(np.float64) if think else np.zeros(total),
        hit_override=np.concatenate(hits).astype(np.int64) if hits else np.full(total, -1, np.int64),
        start_s=np.asarray(start_s, dtype=np.float64),
    )


def arrivals(num_agents: int, aps: float | None, seed: int) -> np.ndarray:
    """Agent start times: all 0 (offline, ``aps`` None) or Poisson at ``aps`` agents/s (online)."""
    if aps is None:
        return np.zeros(num_agents)
    if aps <= 0:
        raise ValueError("aps must be > 0")
    rng = np.random.default_rng(seed + 7919)  # independent of the trajectory stream
    return np.cumsum(rng.exponential(1.0 / aps, num_agents))


def table2_workload(row: str, num_agents: int, seed: int, aps: float | None = None) -> Workload:
    appends, gens = synthetic_trajectories(row, num_agents, seed)
    return _assemble(f"table2-{row}", appends, gens, arrivals(num_agents, aps, seed))


def trajectory_stats(appends: list[np.ndarray], gens: list[np.ndarray]) -> dict[str, float]:
    """Table 2 statistics (per trajectory, then averaged; see module docstring)."""
    turns, app, gen, total, ctx = [], [], [], [], []
    for a, g in zip(appends, gens, strict=True):
        turns.append(len(a))
        if len(a) > 1:
            app.append(float(a[1:].mean()))
        gen.append(float(g.mean()))
        after = np.cumsum(a + g)
        total.append(float(after[-1]))
        prompts = after - g
        ctx.append(float(prompts.mean()))
    return {
        "turns": float(np.mean(turns)),
        "append": float(np.mean(app)) if app else 0.0,
        "gen": float(np.mean(gen)),
        "total": float(np.mean(total)),
        "context": float(np.mean(ctx)),
    }


def fit_report(row: str, num_agents: int = 500, seed: int = 0) -> dict[str, tuple[float, float]]:
    """{stat: (generated, paper)} for one Table 2 row."""
    a, g = synthetic_trajectories(row, num_agents, seed)
    stats = trajectory_stats(a, g)
    t2 = TABLE2[row]
    return {k: (v, float(getattr(t2, k))) for k, v in stats.items()}


# ---- trace replay ----


def _prefix_hits(hash_lists: list[list[int]], block_tokens: int, input_lens: list[int]) -> list[int]:
    """Hit tokens of each request = longest prefix of its block hashes seen in an earlier request.

    Infinite store; a prefix counts only if every block before it was also seen (chained hashes).
    The hit is capped below the input length so at least one token is computed.
    """
    # Trie of chained keys: (parent node, block hash) -> node; O(total blocks), no builtin hash().
    trie: dict[tuple[int, int], int] = {}
    hits = []
    for ids, n_in in zip(hash_lists, input_lens, strict=True):
        node, k = 0, 0
        while k < len(ids) and (node, ids[k]) in trie:
            node = trie[(node, ids[k])]
            k += 1
        hits.append(min(k * block_tokens, max(n_in - 1, 0)))
        for i in range(k, len(ids)):
            child = len(trie) + 1
            trie[(node, ids[i])] = child
            node = child
    return hits


def mooncake_trace(path: str | Path, limit: int | None = None) -> Workload:
    """Mooncake FAST'25 trace: each request is a one-turn agent arriving at its timestamp (ms).

    ``hash_ids`` are 512-token block hashes shared across requests, so hits come from the global prefix
    set (infinite cache). Hit tokens are rounded down to whole 64-token store blocks.
    """
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    hits = _prefix_hits(
        [r["hash_ids"] for r in rows], MOONCAKE_BLOCK_TOKENS, [r["input_length"] for r in rows]
    )
    appends = [np.array([max(1, r["input_length"] - h)]) for r, h in zip(rows, hits, strict=True)]
    gens = [np.array([max(1, r["output_length"])]) for r in rows]
    hit_arr = [np.array([h // BLOCK_TOKENS * BLOCK_TOKENS]) for h in hits]
    # Fix appends so prompt = hit + append equals the trace's input length after block rounding.
    appends = [np.array([r["input_length"] - int(h[0])]) for r, h in zip(rows, hit_arr, strict=True)]
    start = np.array([r["timestamp"] / 1000.0 for r in rows])
    wl = _assemble(Path(path).stem, appends, gens, start, hits=hit_arr)
    blocks = tuple(tuple(int(h) for h in r["hash_ids"]) for r in rows)
    return replace(wl, prompt_blocks=blocks, prompt_block_tokens=MOONCAKE_BLOCK_TOKENS)


def weka_trace(
    path: str | Path, start_s: float = 0.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One coding-agent session: per turn (append, gen, think_s, hit) from its 64-token block hashes."""
    d = json.loads(Path(path).read_text())
    reqs = d["requests"]
    if not reqs:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0), empty
    block = int(d.get("block_size", BLOCK_TOKENS))
    hits = _prefix_hits([r["hash_ids"] for r in reqs], block, [r["in"] for r in reqs])
    hits = [h // BLOCK_TOKENS * BLOCK_TOKENS for h in hits]
    append = np.array([max(1, r["in"] - h) for r, h in zip(reqs, hits, strict=True)])
    gen = np.array([max(1, r["out"]) for r in reqs])
    # think_time is the client-side delay before the request; the first request starts at start_s.
    think = np.array([0.0] + [float(r.get("think_time", 0.0)) for r in reqs[1:]])
    return append, gen, think, np.array(hits)


def weka_workload(paths: list[str | Path], num_agents: int, seed: int, aps: float | None = None) -> Workload:
    """``num_agents`` agents, each replaying one of the coding-agent sessions (round robin over files)."""
    # (a session with no requests is no agent: kept, its one think time shifted every later agent's)
    sessions = [s for s in (weka_trace(p) for p in sorted(paths)) if len(s[0])]
    if not sessions:
        raise ValueError("no weka_cc trace with a request given")
    picks = [sessions[i % len(sessions)] for i in range(num_agents)]
    return _assemble(
        "weka_cc",
        [s[0] for s in picks],
        [s[1] for s in picks],
        arrivals(num_agents, aps, seed),
        think=[s[2] for s in picks],
        hits=[s[3] for s in picks],
    )


def default_data_dir() -> Path:
    """``../shared/data`` relative to the project root (this file is pdserve/bench/workloads.py)."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def load_workload(
    name: str, num_agents: int, seed: int, aps: float | None = None, data_dir: Path | None = None
) -> Workload:
    """By name: ``32k``/``48k``/``64k`` (Table 2), ``mooncake`` / ``mooncake-synthetic`` (trace files,
    ``num_agents`` requests), ``weka_cc`` (coding-agent sessions). Every workload follows ``aps``: all
    agents at t=0 when None (offline), Poisson arrivals at ``aps`` agents/s otherwise (online); a
    Mooncake name with ``@trace`` (``mooncake@trace``) keeps the trace's own arrival times instead."""
    data_dir = data_dir or default_data_dir()
    if name in TABLE2:
        return table2_workload(name, num_agents, seed, aps)
    base, _, timing = name.partition("@")
    if base in ("mooncake", "mooncake-synthetic") and timing in ("", "trace"):
        fname = "conversation_trace.jsonl" if base == "mooncake" else "synthetic_trace.jsonl"
        if timing == "trace" and aps is not None:
            raise ValueError(
                f"{name} replays the trace's own arrival times, so it takes no arrival rate (APS): use it"
                f" in an offline run, or {base} where agents arrive at a given APS (the online scenario)"
            )
        if not (data_dir / fname).is_file():
            raise ValueError(f"{name}: no trace file {data_dir / fname} (the repository's ../shared/data)")
        wl = mooncake_trace(data_dir / fname, limit=num_agents)
        if wl.num_agents < num_agents:  # (it had fewer agents than asked and said nothing: an online
            raise TraceExhausted(  # run's arrivals just stopped, and its measured window saw no load)
                f"{name}: the trace has {wl.num_agents} requests, {num_agents} asked for (online: "
                "APS x horizon); ask for fewer, or a lower --aps or --horizon-s"
            )
        return wl if timing == "trace" else replace(wl, start_s=arrivals(wl.num_agents, aps, seed))
    if name == "weka_cc":
        paths = sorted((data_dir / "weka_cc").glob("trace_*.json"))
        if not paths:
            raise ValueError(
                f"{name}: no trace_*.json in {data_dir / 'weka_cc'} (the repository's ../shared/data)"
            )
        return weka_workload(paths, num_agents, seed, aps)
    raise ValueError(
        f"unknown workload {name!r}; known: {sorted(TABLE2)} + mooncake, mooncake-synthetic (either"
        " with @trace for the trace's arrival times), weka_cc"
    )
