"""Cost of prompt_logprobs beside a plain prefill of the same prompts, in one run.

    .venv/bin/python scripts/bench_prompt_logprobs.py [--model .demo-model] [--requests 16]
        [--prompt-tokens 2000] [--top 5]

The offline engine prefills `--requests` fresh prompts of `--prompt-tokens` tokens (max_tokens 1, no
prefix hits: every prompt is new, so both sides compute the same tokens) with and without
`prompt_logprobs` (0 and `--top`), alternated twice; prompt tokens per second of each (best of two).
Scoring a prompt adds, per position, one vocabulary-wide logits row, its log-softmax, a gather, a rank
and a top-k, plus a Python object per token. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=".demo-model")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--top", type=int, default=5)
    args = ap.parse_args()
    n, length = args.requests, args.prompt_tokens
    llm = LLM(args.model, max_model_len=length + 16, num_pages=(n * (length + 16)) // 16 + 64)
    vocab = llm.engine.config.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    kinds = {"plain": None, "prompt_logprobs=0": 0, f"prompt_logprobs={args.top}": args.top}
    best: dict[str, float] = {}
    for round_ in range(2):
        for name, k in kinds.items():
            prompts = [
                {"prompt_token_ids": torch.randint(3, vocab, (length,), generator=g).tolist()}
                for _ in range(n)
            ]
            p = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k)
            t = time.perf_counter()
            outs = llm.generate(prompts, p)
            dt = time.perf_counter() - t
            assert all(o.num_cached_tokens == 0 for o in outs)
            if k is not None:
                assert all(len(o.prompt_logprobs) == length for o in outs)
            best[name] = max(best.get(name, 0.0), n * length / dt)
            print(f"round {round_}: {name}: {n * length / dt:,.0f} prompt tok/s")
    plain = best["plain"]
    print(f"model vocabulary {vocab}; {n} prompts x {length} tokens; best of two:")
    for name, rate in best.items():
        print(f"  {name:>20}: {rate:10,.0f} prompt tok/s ({rate / plain:.2f}x plain)")


if __name__ == "__main__":
    main()
