"""`pdserve bench soak --minutes N`: drive a launched PD cluster at ~80% of its capacity for N minutes
and watch for drift — RSS of every process, KV pages held, latency — sampled every second.

Phases: (1) launch router + prefill + decode engines (`pdserve launch` defaults, a KV store so the
DualPath paths run too); (2) calibrate: a closed loop of `--concurrency` clients for `--calibrate-s`
measures the cluster's request throughput; (3) soak: Poisson arrivals at `--load-fraction` (0.8) of
it, mixed prompt lengths, some requests continuing an earlier conversation (store hits), some
streamed; every second a sample of each process's RSS (/proc), each engine's pages in use
(/metrics) and the latencies of the requests that finished in that second; (4) the report: drift =
last-window mean / first-window mean - 1, after `--warmup-s`, for RSS (per process), latency p50 and
pages held; plus the request outcome counts. After the load stops every engine must drain to zero
pages (checked and reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from pathlib import Path

import httpx

from pdserve.argtypes import count, make_parent, non_negative, number, output_file, plot_file, positive
from pdserve.bench import short_answer
from pdserve.server.auth import client_headers

_METRIC = re.compile(r"^pdserve_kv_pages_used(?:\{[^}]*\})? ([-+0-9.eE]+)$", re.M)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model dir (default: the demo checkpoint, built if missing)")
    p.add_argument("--minutes", type=positive, default=10.0, help="length of the loaded run")
    p.add_argument("--prefill", type=count, default=1, help="prefill engines")
    p.add_argument("--decode", type=count, default=1, help="decode engines")
    p.add_argument("--load-fraction", type=positive, default=0.8, help="of the calibrated throughput")
    p.add_argument("--concurrency", type=count, default=8, help="calibration clients")
    p.add_argument("--calibrate-s", type=positive, default=20.0, help="throughput calibration before the run")
    p.add_argument("--warmup-s", type=non_negative, default=30.0, help="excluded from the drift windows")
    p.add_argument(
        "--window-frac",
        type=number(float, 0, low_ok=False, high=0.5),
        default=0.1,
        help="drift compares first vs last window (each this share of the run)",
    )
    p.add_argument("--max-tokens", type=count, default=16, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrivals")
    p.add_argument("--json", type=output_file, default=None, help="write the figures and samples here")
    p.add_argument("--plot", type=plot_file, default=None, help="write a plot here (format by suffix)")


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Traffic:
    """Request bodies: token-id prompts of mixed lengths; a third continue an earlier conversation."""

    def __init__(self, seed: int, vocab_size: int, max_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.vocab_size, self.max_tokens = vocab_size, max_tokens
        self.conversations: list[list[int]] = []

    def body(self) -> dict:
        rng = self.rng
        fresh = [rng.randrange(10, self.vocab_size - 10) for _ in range(rng.choice((32, 96, 256, 600)))]
        if self.conversations and rng.random() < 0.33:
            prompt = rng.choice(self.conversations)[:1200] + fresh[:64]
        else:
            prompt = fresh
        if len(self.conversations) < 64:
            self.conversations.append(prompt)
        return {
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": rng.random() < 0.5,
            "stream_options": {"include_usage": True},  # (streamed answers' token counts)
        }


async def _send(client: httpx.AsyncClient, url: str, body: dict) -> tuple[bool, float, str]:
    t0 = time.perf_counter()
    try:
        if body["stream"]:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                text = (await r.aread()).decode(errors="replace")
                events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
                bad = [e for e in events if e.get("error")]
                ok = r.status_code == 200 and not bad and text.rstrip().endswith("[DONE]")
                err = (
                    ""
                    if ok
                    else f"HTTP {r.status_code}: " + (json.dumps(bad[0])[:200] if bad else text[-200:])
                )
                if ok:
                    reasons = [c.get("finish_reason") for e in events for c in e.get("choices") or ()]
                    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), {})
                    err = short_answer(
                        next((x for x in reversed(reasons) if x), None),
                        usage.get("completion_tokens", 0),
                        body["max_tokens"],
                    )
                    ok = not err
        else:
            r = await client.post(url + "/v1/completions", json=body)
            ok, err = r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
            if ok:  # (an aborted answer is a 200 too)
                answer = r.json()
                err = short_answer(
                    answer["choices"][0].get("finish_reason"),
                    answer.get("usage", {}).get("completion_tokens", 0),
                    body["max_tokens"],
                )
                ok = not err
    except httpx.HTTPError as e:
        ok, err = False, type(e).__name__
    return ok, time.perf_counter() - t0, "" if ok else err


async def _calibrate(url: str, traffic: Traffic, concurrency: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds
    # (the cluster it launched inherits $PDSERVE_API_KEY: every request was a 401 with it exported)
    async with httpx.AsyncClient(timeout=120, headers=client_headers()) as client:

        async def loop():
            nonlocal done
            while time.perf_counter() < stop:
                ok, _, _ = await _send(client, url, traffic.body())
                done += ok

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


async def _soak(url: str, traffic: Traffic, rate: float, seconds: float, pids, engine_urls, seed: int):
    rng = random.Random(seed + 1)
    samples: list[dict] = []
    finished: list[tuple[float, bool, float, str]] = []  # (end time, ok, latency, error)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=120, headers=client_headers()) as client:

        async def one(body):
            ok, lat, err = await _send(client, url, body)
            finished.append((time.perf_counter() - t0, ok, lat, err))

        async def sampler():
            while True:
                await asyncio.sleep(1.0)
                pages = {}
                for u in engine_urls:
                    try:
                        m = _METRIC.search((await client.get(u + "/metrics", timeout=5)).text)
                        pages[u] = float(m.group(1)) if m else -1.0
                    except httpx.HTTPError:
                        pages[u] = -1.0
                samples.append(
                    {
                        "t_s": time.perf_counter() - t0,
                        "rss": {name: rss_bytes(pid) for name, pid in pids.items()},
                        "pages": pages,
                    }
                )

        sampling = asyncio.ensure_future(sampler())
        tasks = []
        next_s = 0.0
        while next_s < seconds:
            await asyncio.sleep(max(0.0, next_s - (time.perf_counter() - t0)))
            tasks.append(asyncio.ensure_future(one(traffic.body())))
            next_s += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        sampling.cancel()
    return samples, finished


def _drift(series: list[tuple[float, float]], start_s: float, end_s: float, frac: float) -> float | None:
    """Mean of the last window / mean of the first window - 1 (windows `frac` of [start_s, end_s])."""
    w = (end_s - start_s) * frac
    first = [v for t, v in series if start_s <= t < start_s + w]
    last = [v for t, v in series if end_s - w <= t <= end_s]
    if not first or not last or statistics.mean(first) == 0:
        return None
    return statistics.mean(last) / statistics.mean(first) - 1.0


def run(a: argparse.Namespace) -> int:
    import tempfile

    from pdserve.bench.agentic import vocab_size_of
    from pdserve.demo import ensure_demo_model
    from pdserve.launch import cluster_args, start_cluster

    model_dir = a.model or ensure_demo_model(".demo-model")
    vocab = vocab_size_of(model_dir)
    seconds = a.minutes * 60.0
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-store-") as store:
        cluster = start_cluster(
            cluster_args(model_dir, kv_store=store, read_path="auto", max_model_len=2048), a.prefill, a.decode
        )
        try:
            pids = {name: p.pid for name, p in cluster.procs}
            engines = cluster.urls["prefill"] + cluster.urls["decode"]
            traffic = Traffic(a.seed, vocab, a.max_tokens)
            capacity = asyncio.run(_calibrate(cluster.router_url, traffic, a.concurrency, a.calibrate_s))
            rate = max(0.05, capacity * a.load_fraction)
            print(
                f"capacity {capacity:.2f} req/s; soaking at {rate:.2f} req/s for {a.minutes:g} min",
                flush=True,
            )
            samples, finished = asyncio.run(
                _soak(cluster.router_url, traffic, rate, seconds, pids, engines, a.seed)
            )
            time.sleep(2.0)
            drained = {
                u: float(m.group(1))
                if (m := _METRIC.search(httpx.get(u + "/metrics", timeout=10).text))
                else -1
                for u in engines
            }
        finally:
            cluster.stop()
    start, end = min(a.warmup_s, seconds / 2), seconds
    rss_drift = {
        name: _drift([(s["t_s"], s["rss"][name]) for s in samples], start, end, a.window_frac)
        for name in pids
    }
    lat = [(t, lat_s) for t, ok, lat_s, _ in finished if ok]
    lat_drift = _drift(lat, start, end, a.window_frac)
    pages = [(s["t_s"], sum(v for v in s["pages"].values() if v >= 0)) for s in samples]
    errors: dict[str, int] = {}
    for _, ok, _, err in finished:
        if not ok:
            errors[err] = errors.get(err, 0) + 1
    out = {
        "minutes": a.minutes,
        "capacity_req_per_s": capacity,
        "rate_req_per_s": rate,
        "requests": len(finished),
        "succeeded": sum(ok for _, ok, _, _ in finished),
        "errors": errors,
        "rss_drift": rss_drift,
        "rss_start_mib": {n: samples[0]["rss"][n] / 2**20 for n in pids} if samples else {},
        "rss_end_mib": {n: samples[-1]["rss"][n] / 2**20 for n in pids} if samples else {},
        "latency_p50_first_s": _window_p50(lat, start, start + (end - start) * a.window_frac),
        "latency_p50_last_s": _window_p50(lat, end - (end - start) * a.window_frac, end),
        "latency_mean_drift": lat_drift,
        "pages_mean_drift": _drift(pages, start, end, a.window_frac),
        "pages_after_drain": drained,
    }
    print(json.dumps(out, indent=2))
    if a.json:
        Path(make_parent(a.json)).write_text(json.dumps(out | {"samples": samples}, indent=2))
    if a.plot:
        _plot(samples, lat, make_parent(a.plot))
    leaked = any(v != 0 for v in drained.values())
    return 1 if leaked or out["succeeded"] < out["requests"] else 0


def _window_p50(lat, lo: float, hi: float) -> float | None:
    vals = [v for t, v in lat if lo <= t <= hi]
    return statistics.median(vals) if vals else None


def _plot(samples, lat, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 6))
    ax1, ax2, ax3 = fig.subplots(3, 1, sharex=True)
    for name in samples[0]["rss"] if samples else []:
        ax1.plot([s["t_s"] for s in samples], [s["rss"][name] / 2**20 for s in samples], label=name)
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend(fontsize=7)
    ax2.plot([s["t_s"] for s in samples], [sum(v for v in s["pages"].values() if v >= 0) for s in samples])
    ax2.set_ylabel("KV pages in use")
    ax3.plot([t for t, _ in lat], [v for _, v in lat], ".", markersize=2)
    ax3.set_ylabel("latency (s)")
    ax3.set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
