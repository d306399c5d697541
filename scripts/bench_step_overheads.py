"""Per-step overheads of the engine thread beside what they replaced, in one run.

    .venv/bin/python scripts/bench_step_overheads.py [--model .demo-model] [--requests 64] [--tokens 8000 32000]

1. Outputs: each of `--requests` running requests holds `--tokens` output tokens with logprobs
   (top-2), its text already decoded, as in an engine mid-generation; a "step" asks `output()` (O(1)
   views of the growing lists) for every request, beside the two list copies it used to make.
2. Decode page tables: `--requests` decodes with contexts of `--tokens` tokens; a step builds their
   page tables (`ModelRunner._decode_groups`, int64 rows kept across steps), beside the nested-list
   conversion it replaced.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import TokenLogprob


def per_step_ms(fn, reqs, repeats: int = 5) -> float:
    t = time.perf_counter()
    for _ in range(repeats):
        for r in reqs:
            fn(r)
    return (time.perf_counter() - t) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".demo-model")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[8000, 32000])
    a = p.parse_args()
    if not (Path(a.model) / "config.json").is_file():
        from pdserve.model.demo import make_demo_model

        make_demo_model(a.model)
    engine = LLMEngine(EngineConfig.create(a.model, num_pages=64, max_model_len=1024))
    source = "".join(f.read_text() for f in sorted(Path(__file__).parents[1].glob("pdserve/*/*.py")))
    ids = engine.tokenizer.encode(source, add_special_tokens=False)
    for n in a.tokens:
        reqs = []
        for i in range(a.requests):
            r = engine.make_request("x", SamplingParams(max_tokens=8, logprobs=2), f"r{i}")
            for t in ids[:n]:
                r.append_output(t)
                r.logprobs.append(TokenLogprob(t, -1.0, [(t, -1.0), (1, -2.0)]))
            engine.output(r)  # its text decoded up to here (the detokenizer settled)
            reqs.append(r)
        ours = per_step_ms(engine.output, reqs)
        copies = per_step_ms(lambda r: (list(r.output_token_ids), list(r.logprobs)), reqs)
        print(
            f"{a.requests} running requests x {len(ids[:n])} output tokens: output() {ours:6.2f} ms per step; "
            f"the two list copies it used to make: {copies:6.2f} ms per step"
        )
    runner, ps = engine.runner, engine.runner.page_size
    for n in a.tokens:
        decodes = [
            SimpleNamespace(
                request_id=f"d{i}",
                page_ids=list(range(i, i + n // ps)),
                num_computed_tokens=n - 1 - i,
                page_id_row=None,
            )
            for i in range(a.requests)
        ]
        rows = list(range(len(decodes)))

        def ours_step(decodes=decodes, rows=rows):
            for d in decodes:  # one more token each: the tables change every step
                d.num_computed_tokens += 1
            runner._decode_groups(decodes, rows)

        def old_step(
            decodes=decodes,
        ):  # what `_decode_group` did per row: pad the Python list, convert all of it
            max_pages = max(-(-(d.num_computed_tokens + 1) // ps) for d in decodes)
            torch.tensor(
                [d.page_ids[:max_pages] + [0] * (max_pages - len(d.page_ids[:max_pages])) for d in decodes],
                dtype=torch.int64,
            )

        ours_step()  # the rows are kept from the first step on
        print(
            f"{a.requests} decodes x {n} context tokens: page tables {per_step_ms(lambda _: ours_step(), [0]):6.2f} "
            f"ms per step (all of _decode_groups); the conversion it replaced {per_step_ms(lambda _: old_step(), [0]):6.2f} ms"
        )


if __name__ == "__main__":
    main()
