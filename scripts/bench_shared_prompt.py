"""One prompt sent n times at once (n choices, an RL group): in-flight prefix sharing on vs off, in one run.

    .venv/bin/python scripts/bench_shared_prompt.py [--model .demo-model] [--n 8] [--prompt-tokens 2000]
        [--max-tokens 16] [--groups 2]

`--groups` prompts, each sent `--n` times at once, greedy, through the offline engine: with the
scheduler putting off a request whose next prompt page another request is computing
(`share_in_flight_prefixes`, the default) and without (every copy prefills the whole prompt).
Reported per mode: wall time, prompt tokens computed, prefix-cache hit tokens; outputs must match.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

from pdserve import LLM, SamplingParams


def run(
    model: str, share: bool, prompts: list[dict], n: int, max_tokens: int
) -> tuple[float, int, int, list]:
    llm = LLM(
        model,
        dtype="float32",
        max_model_len=4096,
        num_pages=4096,
        max_num_batched_tokens=2048,
        share_in_flight_prefixes=share,
    )
    llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    kv = llm.engine.kv
    q0, h0 = kv.num_query_tokens, kv.num_hit_tokens
    batch = [p for p in prompts for _ in range(n)]
    t = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - t
    hits = kv.num_hit_tokens - h0
    return wall, (kv.num_query_tokens - q0) - hits, hits, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".demo-model")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--groups", type=int, default=2)
    a = p.parse_args()
    body = list(range(100, 100 + a.prompt_tokens))
    prompts = [{"prompt_token_ids": [g + 1] + body[: a.prompt_tokens - 1]} for g in range(a.groups)]
    results = {}
    for share in (False, True, False, True):  # alternated; the second of each is reported
        results[share] = run(a.model, share, prompts, a.n, a.max_tokens)
    (w0, c0, h0, o0), (w1, c1, h1, o1) = results[False], results[True]
    assert o0 == o1, "outputs differ between the modes"
    print(
        f"{a.groups} prompts x n={a.n}, {a.prompt_tokens} prompt tokens, {a.max_tokens} output tokens each:"
    )
    print(f"  every copy prefills:   {w0:6.2f} s, prompt tokens computed {c0:,}, prefix hits {h0:,}")
    print(f"  in-flight sharing:     {w1:6.2f} s, prompt tokens computed {c1:,}, prefix hits {h1:,}")
    print(f"  speed-up {w0 / w1:.2f}x; prompt compute {c0 / max(c1, 1):.1f}x less; outputs identical")


if __name__ == "__main__":
    main()
