"""Cost of the token-dependent logits processors, beside plain sampling, in one run.

    .venv/bin/python scripts/bench_penalties.py [--model .demo-model] [--requests 64] [--prompt-tokens 2000]
        [--max-tokens 64]

1. Sampler alone: one step's `Sampler` call for `--requests` rows with vocabulary-sized logits, each
   row holding a `--prompt-tokens` prompt and `--max-tokens` output tokens: plain greedy vs
   repetition + frequency + presence penalties, min_tokens and a logit_bias (the repetition penalty's
   prompt ids are computed once per request, so the first step is timed apart).
2. End to end: the offline engine decodes `--requests` prompts for `--max-tokens` tokens, greedy,
   with and without those processors, alternated twice; tokens per second of each.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdserve import LLM, SamplingParams
from pdserve.model.sampler import Sampler

PROCESSED = dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=4)


@dataclass
class Row:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = (2,)
    prompt_unique_ids: np.ndarray | None = None


def sampler_ms(vocab: int, n: int, prompt_len: int, out_len: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=g)
    rows = [
        Row(
            torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
            torch.randint(0, vocab, (out_len,)).tolist(),
        )
        for _ in range(n)
    ]
    sampler = Sampler("cpu", 0)
    plain = [SamplingParams(temperature=0)] * n
    processed = [SamplingParams(temperature=0, logit_bias={5: 1.0}, **PROCESSED)] * n

    def timed(params, repeats=20) -> float:
        t = time.perf_counter()
        for _ in range(repeats):
            sampler(logits, params, [None] * n, rows)
        return (time.perf_counter() - t) / repeats * 1e3

    t0 = time.perf_counter()
    sampler(logits, processed, [None] * n, rows)
    first = (time.perf_counter() - t0) * 1e3
    a, b = timed(plain), timed(processed)
    print(f"sampler, {n} rows x vocab {vocab}, prompt {prompt_len} + output {out_len} tokens:")
    print(
        f"  plain greedy {a:.2f} ms/step   with processors {b:.2f} ms/step ({b / a:.1f}x)   first step {first:.1f} ms"
    )


def end_to_end(model: str, n: int, prompt_len: int, max_tokens: int) -> None:
    llm = LLM(model, dtype="float32", max_model_len=prompt_len + max_tokens + 64, num_pages=4096)
    tok = llm.get_tokenizer()
    base = tok.encode("def handler(request):\n    return process(request)\n" * (prompt_len // 12 + 1))
    prompts = [{"prompt_token_ids": [i + 3] + base[: prompt_len - 1]} for i in range(n)]
    runs = {
        "plain": SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        "processors": SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **PROCESSED),
    }
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    best: dict[str, float] = {}
    for _ in range(2):
        for name, params in runs.items():
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t
            num = sum(len(o.outputs[0].token_ids) for o in outs)
            best[name] = max(best.get(name, 0.0), num / dt)
    print(f"end to end, {n} requests x {prompt_len} prompt tokens x {max_tokens} output tokens (best of 2):")
    print(
        f"  plain {best['plain']:.0f} tok/s   with processors {best['processors']:.0f} tok/s "
        f"({best['processors'] / best['plain']:.2f}x)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".demo-model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary of the sampler-only part (Qwen2.5)")
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    sampler_ms(a.vocab, a.requests, a.prompt_tokens, a.max_tokens)
    end_to_end(a.model, a.requests, a.prompt_tokens, a.max_tokens)


if __name__ == "__main__":
    main()
