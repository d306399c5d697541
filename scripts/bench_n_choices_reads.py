"""The `n` choices of stored prompts under DualPath placement: storage blocks read, and read paths.

    .venv/bin/python scripts/bench_n_choices_reads.py [--model .demo-model] [--agents 3] [--turns 5] [--n 4]

An emulated 1P2D cluster (nodes p0:1p, d0:1d, d1:1d: three storage NICs), `--policy dualpath`, a
fresh store, no GPU prefix cache (every hit is read from the store). Each agent's first turn stores
its 512-token context; then `--turns` turns per agent each ask `--n` choices of the context plus 8
new tokens. Printed as JSON: the stored blocks each engine read over those turns, their sum, and the
read paths the router chose. A choice's read on the PE path joins the other choices' reads of the
same blocks on their prefill (one read); on the DE path each decode engine reads them itself.

Side by side with another version of the code (how docs/benchmarks.md compares before and after
`PendingRequest.num_choices`): `git worktree add /tmp/before REV`, then run this script with
`PYTHONPATH=/tmp/before` (the engines it starts inherit it).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """An engine's /metrics: (sample name, its labels sorted) -> value."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def blocks_read(url: str) -> float:
    return metrics(url).get(("pdserve_store_ops_total", (("op", "read_ok_blocks"),)), 0.0)


def settle(urls: list[str], timeout_s: float = 60.0) -> None:
    """Until every engine is idle and its write-back to the store is done."""
    deadline = time.monotonic() + timeout_s
    while True:
        ms = [metrics(u) for u in urls]
        running = sum(m[("pdserve_num_requests_running", ())] for m in ms)
        if running == 0 and sum(m.get(("pdserve_store_writes_pending", ()), 0) for m in ms) == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("the engines did not settle")
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=".demo-model")
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--n", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.launch import cluster_args, start_cluster
    from pdserve.model.demo import make_demo_model

    if not os.path.exists(os.path.join(args.model, "config.json")):
        make_demo_model(args.model)
    with tempfile.TemporaryDirectory(prefix="pdserve-nchoices-") as store:
        cluster = start_cluster(
            cluster_args(
                args.model,
                nodes="p0:1p,d0:1d,d1:1d",
                snic_mbps=80.0,
                cnic_mbps=800.0,
                policy="dualpath",
                kv_store=store,
                no_prefix_caching=True,
                max_model_len=2048,
                kv_cache_gib=0.2,
                served_model_name="demo",
            ),
            0,
            0,
        )
        try:
            urls = cluster.urls["prefill"] + cluster.urls["decode"]
            body = {"model": "demo", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            contexts = [[(7 * i + 13 * a) % 4000 + 5 for i in range(512)] for a in range(args.agents)]
            for context in contexts:  # (stores it: nothing to read yet)
                r = httpx.post(
                    cluster.router_url + "/v1/completions", json=body | {"prompt": context}, timeout=120
                )
                r.raise_for_status()
            settle(urls)
            before = {u: blocks_read(u) for u in urls}
            t = time.monotonic()
            for turn in range(1, args.turns + 1):
                for context in contexts:
                    several = body | {"prompt": context + [9 + turn] * 8, "n": args.n}
                    r = httpx.post(cluster.router_url + "/v1/completions", json=several, timeout=120)
                    r.raise_for_status()
                settle(urls)
            wall_s = time.monotonic() - t
            read = {u: blocks_read(u) - before[u] for u in urls}
            read_paths = httpx.get(cluster.router_url + "/pd/cluster").json()["placement"]["read_paths"]
        finally:
            cluster.stop()
    print(
        json.dumps(
            {
                "blocks_read_by_engine": read,
                "blocks_read": sum(read.values()),
                "read_paths": read_paths,
                "wall_s": round(wall_s, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
