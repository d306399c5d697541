"""A batch of prompts over HTTP three ways, in one run: one request with a prompt list (lm-eval's
batches), the same prompts as concurrent requests, and as sequential requests.

    .venv/bin/python scripts/bench_prompt_list.py [--model .demo-model] [--prompts 32]
        [--prompt-tokens 200] [--max-tokens 16] [--rounds 3]

A colocated `pdserve serve` on 127.0.0.1 (a subprocess); greedy, fresh prompts each round (no
prefix hits between ways). Reported per way: wall time (best of `--rounds`) and its ratio to the
prompt list, and how many texts equal the sequential way's (batched float32 sums may differ in the
last bits, so a near tie could flip a greedy token). A list should run as fast as concurrent requests
(it is split into them on the server) and far faster than sequential ones (one request at a time
leaves the engine's batch empty). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from pdserve.demo import free_port, start_server, wait_healthy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=".demo-model")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    port = free_port()
    proc = start_server(args.model, port, "--max-model-len", "1024", "--num-pages", "4096")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        asyncio.run(bench(url, args))
    finally:
        proc.terminate()
        proc.wait(30)


async def bench(url: str, args) -> None:
    rng = random.Random(0)
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        base = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}

        def fresh() -> list[list[int]]:
            return [[rng.randrange(3, 500) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]

        async def as_list(prompts):
            r = await c.post("/v1/completions", json=base | {"prompt": prompts})
            return [ch["text"] for ch in r.json()["choices"]]

        async def concurrent(prompts):
            rs = await asyncio.gather(
                *(c.post("/v1/completions", json=base | {"prompt": p}) for p in prompts)
            )
            return [r.json()["choices"][0]["text"] for r in rs]

        async def sequential(prompts):
            return [
                (await c.post("/v1/completions", json=base | {"prompt": p})).json()["choices"][0]["text"]
                for p in prompts
            ]

        ways = {"prompt list": as_list, "concurrent": concurrent, "sequential": sequential}
        await as_list(fresh()[:2])  # warm-up
        best = {name: float("inf") for name in ways}
        for round_ in range(args.rounds):
            prompts = fresh()
            texts = {}
            for name, way in ways.items():
                await c.post("/reset_prefix_cache")  # (each way computes every prompt)
                t = time.perf_counter()
                texts[name] = await way(prompts)
                dt = time.perf_counter() - t
                best[name] = min(best[name], dt)
                print(f"round {round_}: {name}: {dt:.2f} s")
            for name in ("prompt list", "concurrent"):
                same = sum(a == b for a, b in zip(texts[name], texts["sequential"], strict=True))
                print(f"round {round_}: {name}: {same}/{len(prompts)} texts equal the sequential ones")
    print(
        f"{args.prompts} prompts x {args.prompt_tokens} tokens, {args.max_tokens} new each; best of {args.rounds}:"
    )
    for name, dt in best.items():
        print(f"  {name:>12}: {dt:6.2f} s ({dt / best['prompt list']:.2f}x the prompt list)")


if __name__ == "__main__":
    main()
