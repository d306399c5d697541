"""`pdserve bench serve`: latency of a running server (router or engine) under a Poisson load, and a
side-by-side run of 1 prefill + 1 decode against 2 colocated engines (same number of engine
processes, same requests, same arrival times).

Metrics per request (streamed): TTFT (send -> first token), TPOT (time after the first chunk over
the tokens after it: `bench.time_per_output_token`; each chunk's token count from the usage that
`continuous_usage_stats` puts in every chunk, one per chunk from a server that leaves it out), ITL
(every gap between streamed chunks, as vLLM's `benchmark_serving` reports it: a gap before a chunk of
several tokens is one gap). The workload mixes long prompts (prefill-heavy) with short
ones, the case where PD disaggregation keeps long prefills from stalling running decodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from pdserve.argtypes import DEVICES, DTYPES, count, make_parent, number, output_file, positive
from pdserve.bench import served_model_card, short_answer, time_per_output_token


@dataclass
class Result:
    ok: bool
    ttft_s: float = 0.0
    tpot_s: float | None = None  # None for an answer of one token (no time per output token)
    itl_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    error: str = ""


def make_requests(
    num: int, long_fraction: float, long_words: int, short_words: int, max_tokens: int, seed: int
) -> list[dict]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "parser", "scheduler", "token", "cache", "page", "room"]
    out = []
    for i in range(num):
        n = long_words if rng.random() < long_fraction else short_words
        text = f"request {i}: " + " ".join(rng.choice(words) for _ in range(n))
        out.append(
            {
                "prompt": text,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
        )
    return out


async def one(client, url: str, model: str, body: dict) -> Result:
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []  # (arrival time, tokens so far) per chunk with text
    num_tokens = 0
    counted = True  # every text chunk carried the usage so far (else its tokens are not known)
    finish_reason = None
    try:
        async with client.stream("POST", url + "/v1/completions", json={"model": model, **body}) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    finish_reason = choice.get("finish_reason") or finish_reason
                    if choice.get("text"):
                        counted = counted and bool(chunk.get("usage"))
                        so_far = num_tokens if chunk.get("usage") else (stamps[-1][1] if stamps else 0) + 1
                        stamps.append((time.perf_counter(), so_far))
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        return Result(False, error=repr(e))
    if not stamps:
        return Result(False, error="no tokens")
    if why := short_answer(finish_reason, num_tokens, body["max_tokens"]):
        return Result(False, error=why)
    gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:], strict=False)]
    if not counted and len(stamps) > 1:
        # A server that leaves the usage out of its chunks (no `continuous_usage_stats`): a chunk's
        # tokens are not known, and one per chunk made TPOT a time per chunk (4x too long with 4-token
        # chunks). The first chunk is taken as one token, the rest from the final usage: the old
        # (last - first) / (tokens - 1), which understates only a coalesced first chunk.
        stamps = [stamps[0], (stamps[-1][0], max(num_tokens, stamps[-1][1]))]
    return Result(True, stamps[0][0] - t0, time_per_output_token(stamps), gaps, num_tokens)


async def run_load(
    urls: list[str], model: str, requests: list[dict], rate_per_s: float, seed: int
) -> list[Result]:
    """Send `requests` with Poisson arrivals at `rate_per_s`, round robin over `urls`."""
    import httpx

    rng = random.Random(seed + 1)
    from pdserve.server.auth import client_headers

    async with httpx.AsyncClient(timeout=600, headers=client_headers()) as client:
        tasks = []
        for i, body in enumerate(requests):
            if i:  # (no wait after the last one: the run's wall time would count it)
                await asyncio.sleep(rng.expovariate(rate_per_s))
            tasks.append(asyncio.ensure_future(one(client, urls[i % len(urls)], model, body)))
        return await asyncio.gather(*tasks)


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, interpolated between ranks as numpy's (and `bench agentic`'s); None with
    no values (JSON has no NaN). Read at rank int(q/100 * n), p50 of [10, 20] was 20 and p99 of a
    hundred values their maximum."""
    if not values:
        return None
    return float(np.percentile(values, q))


def _ms(value_s: float | None) -> float | None:
    return None if value_s is None else round(value_s * 1000, 1)


def summarize(name: str, results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    itl = [g for r in ok for g in r.itl_s]
    out = {
        "setup": name,
        "requests": len(results),
        "ok": len(ok),
        "wall_s": round(wall_s, 2),
        "output_tok_s": round(sum(r.num_tokens for r in ok) / wall_s, 1),
    }
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    for label, vals in (("ttft", [r.ttft_s for r in ok]), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            out[f"{label}_p{q}_ms"] = _ms(pct(vals, q))
        out[f"{label}_mean_ms"] = _ms(statistics.fmean(vals)) if vals else None
    failed = [r.error for r in results if not r.ok]
    if failed:  # (why they failed: a table of 0 ok and nan latencies said nothing)
        out["first_error"] = failed[0]
    return out


def print_table(rows: list[dict]) -> None:
    cols = [
        "setup",
        "ok",
        "output_tok_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
    ]
    print(" | ".join(f"{c:>13}" for c in cols))
    for r in rows:
        print(" | ".join(f"{'-' if r[c] is None else r[c]!s:>13}" for c in cols))
    for r in rows:
        if "first_error" in r:
            print(
                f"{r['setup']}: {r['requests'] - r['ok']} of {r['requests']} failed, the first: {r['first_error']}"
            )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url", nargs="*", default=None, help="server(s) to load; omit for the PD vs colocated run"
    )
    p.add_argument(
        "--model", default=None, help="model dir for the side-by-side run (default: demo checkpoint)"
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model name sent (default: the first one --url's /v1/models lists; the side-by-side "
        "run serves 'demo')",
    )
    p.add_argument("--num-requests", type=count, default=48, help="requests per setup")
    p.add_argument("--rate", type=positive, default=3.0, help="requests per second (Poisson)")
    p.add_argument(
        "--long-fraction",
        type=number(float, 0, low_ok=True, high=1),
        default=0.25,
        help="share of long prompts",
    )
    p.add_argument("--long-words", type=count, default=700, help="~tokens of a long prompt")
    p.add_argument("--short-words", type=count, default=30, help="~tokens of a short prompt")
    p.add_argument("--max-tokens", type=count, default=64, help="output tokens per request")
    p.add_argument("--max-num-batched-tokens", type=count, default=256, help="engine step budget")
    p.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals")
    p.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="engines' device (both setups: compared on equal hardware)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="engines' dtype (both setups)")
    p.add_argument("--json", type=output_file, default=None, help="write the figures to this file")


def run(a: argparse.Namespace) -> int:
    requests = make_requests(
        a.num_requests, a.long_fraction, a.long_words, a.short_words, a.max_tokens, a.seed
    )
    rows = []
    if a.url and a.served_model_name is None:  # (a fixed "demo" was a 404 on every request elsewhere)
        a.served_model_name = served_model_card(a.url[0])["id"]
    a.served_model_name = a.served_model_name or "demo"
    if a.url:
        t = time.perf_counter()
        res = asyncio.run(run_load(a.url, a.served_model_name, requests, a.rate, a.seed))
        rows.append(summarize("given", res, time.perf_counter() - t))
    else:
        rows = side_by_side(a, requests)
    print_table(rows)
    if a.json:
        with open(make_parent(a.json), "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "fn"}, "runs": rows}, f, indent=2)
    return 0 if all(r["ok"] == r["requests"] for r in rows) else 1


def side_by_side(a: argparse.Namespace, requests: list[dict]) -> list[dict]:
    """The same requests and arrival times against 1P+1D (router) and 2 colocated engines."""
    from pathlib import Path

    from pdserve.demo import free_port, start_server, wait_healthy
    from pdserve.launch import cluster_args, start_cluster
    from pdserve.model.demo import make_demo_model

    model = a.model or ".demo-model"
    if not (Path(model) / "config.json").is_file():
        if a.model is not None:  # (a typo was filled with a random demo checkpoint and benchmarked)
            raise ValueError(
                f"--model {a.model}: no config.json there (omit --model for the demo checkpoint)"
            )
        make_demo_model(model)
    eng = cluster_args(
        model,
        kv_cache_gib=0.25,
        max_model_len=2048,
        max_num_batched_tokens=a.max_num_batched_tokens,
        served_model_name=a.served_model_name,
        no_prefix_caching=True,
        pd_deadline_s=60.0,
        device=a.device,
        dtype=a.dtype,
    )
    rows = []
    cluster = start_cluster(eng, 1, 1)
    try:
        warm = make_requests(2, 0.0, 5, 5, 4, a.seed + 99)
        asyncio.run(run_load([cluster.router_url], a.served_model_name, warm, 100.0, a.seed))
        t = time.perf_counter()
        res = asyncio.run(run_load([cluster.router_url], a.served_model_name, requests, a.rate, a.seed))
        rows.append(summarize("1P+1D (PD)", res, time.perf_counter() - t))
    finally:
        cluster.stop()
    flags = [
        "--dtype",
        a.dtype,
        "--device",
        a.device,
        "--kv-cache-gib",
        "0.25",
        "--max-model-len",
        "2048",
        "--max-num-batched-tokens",
        str(a.max_num_batched_tokens),
        "--served-model-name",
        a.served_model_name,
        "--no-prefix-caching",
    ]
    ports = [free_port(), free_port()]
    procs = [start_server(model, p, *flags) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for u, p in zip(urls, procs, strict=True):
            wait_healthy(u, p)
        warm = make_requests(2, 0.0, 5, 5, 4, a.seed + 99)
        asyncio.run(run_load(urls, a.served_model_name, warm, 100.0, a.seed))
        t = time.perf_counter()
        res = asyncio.run(run_load(urls, a.served_model_name, requests, a.rate, a.seed))
        rows.append(summarize("2 colocated", res, time.perf_counter() - t))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
    return rows
