"""Detokenizing a growing output: the engine's incremental detokenizer vs a full decode at every step.

    .venv/bin/python scripts/bench_detokenize.py [--model .demo-model] [--tokens 1500 8000]

One request's output grows one token at a time (the ids of real source text, so the characters are
ones a model writes) and its text is asked for after every token, as the engine does; both ways are
timed in one run and their texts compared. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pdserve.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".demo-model", help="a model dir with tokenizer.json")
    p.add_argument("--tokens", type=int, nargs="+", default=[1500, 8000], help="output lengths")
    a = p.parse_args()
    if not (Path(a.model) / "tokenizer.json").is_file():
        from pdserve.model.demo import make_demo_model

        make_demo_model(a.model)
    tok = Tokenizer(a.model)
    source = "".join(f.read_text() for f in sorted(Path(__file__).parents[1].glob("pdserve/engine/*.py")))
    ids = tok.encode(source, add_special_tokens=False)
    for n_out in a.tokens:
        out = ids[:n_out]
        t = time.perf_counter()
        for n in range(1, len(out) + 1):
            full_text = tok.decode(out[:n])
        full_s = time.perf_counter() - t
        t = time.perf_counter()
        inc, grown = tok.incremental(), []
        for token in out:  # the engine appends to the request's list and passes it whole
            grown.append(token)
            inc_text = inc.update(grown)
        inc_s = time.perf_counter() - t
        assert inc_text == full_text, "texts differ"
        print(
            f"{len(out):6d} output tokens: full decode per step {full_s * 1e3:8.1f} ms "
            f"({full_s / len(out) * 1e6:6.1f} us/step); incremental {inc_s * 1e3:7.1f} ms "
            f"({inc_s / len(out) * 1e6:5.1f} us/step); {full_s / inc_s:5.1f}x"
        )


if __name__ == "__main__":
    main()
