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
import statistics
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
    p.add_argument("--repeats", type=int, default=5, help="runs of each mode, alternated (median reported)")
    a = p.parse_args()
    body = list(range(100, 100 + a.prompt_tokens))
    prompts = [{"prompt_token_ids": [g + 1] + body[: a.prompt_tokens - 1]} for g in range(a.groups)]
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(a.repeats):  # alternated, so that a noisy moment does not favour one mode
        for share in (False, True):
            runs[share].append(run(a.model, share, prompts, a.n, a.max_tokens))
    (_, c0, h0, o0), (_, c1, h1, o1) = runs[False][0], runs[True][0]
    assert o0 == o1, "outputs differ between the modes"
    w0, w1 = (statistics.median(r[0] for r in runs[m]) for m in (False, True))
    walls = {m: ", ".join(f"{r[0]:.2f}" for r in runs[m]) for m in runs}
    print(
        f"{a.groups} prompts x n={a.n}, {a.prompt_tokens} prompt tokens, {a.max_tokens} output tokens each:"
    )
    print(
        f"  every copy prefills: median {w0:.2f} s ({walls[False]}); prompt tokens computed {c0:,}, hits {h0:,}"
    )
    print(
        f"  in-flight sharing:   median {w1:.2f} s ({walls[True]}); prompt tokens computed {c1:,}, hits {h1:,}"
    )
    print(
        f"  speed-up {w0 / w1:.2f}x (medians); prompt compute {c0 / max(c1, 1):.1f}x less; outputs identical"
    )


if __name__ == "__main__":
    main()
