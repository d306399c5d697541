"""Cost of structured outputs (model/grammar.py), beside plain sampling, in one run.

    .venv/bin/python scripts/bench_structured.py [--vocab-size 151936] [--requests 64] [--steps 60]
        [--model .demo-model]

1. A vocabulary of Qwen2.5's size: a byte-level BPE trained here on the Python standard library's
   sources (no download; cached under /tmp), so llguidance sees a realistic token trie of that size.
   Timed: building llguidance's view of it, compiling a JSON schema (first time, then from the cache).
2. Sampler alone, per step, `--requests` rows of vocabulary-sized logits (temperature 1): plain vs
   every row under the JSON schema (mask computed for all rows, applied, sampled; each row's matcher
   advanced with its token and restarted when its document is complete).
3. End to end on the demo model: `--requests` prompts decoded with and without a JSON schema (compact
   whitespace), tokens per second of each, alternated twice.
Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sysconfig
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve import LLM, SamplingParams
from pdserve.model.grammar import GrammarBackend
from pdserve.model.sampler import Sampler
from pdserve.sampling_params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "recursive": {"type": "boolean"},
                "depth": {"type": "integer", "minimum": 0, "maximum": 10},
                "mode": {"enum": ["read", "write", "append"]},
            },
            "required": ["path", "recursive", "depth", "mode"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def _utf8(path: str) -> bool:
    try:
        open(path, encoding="utf-8").read()
        return True
    except (UnicodeDecodeError, OSError):
        return False


def big_tokenizer(vocab_size: int) -> str:
    path = f"/tmp/pdserve-bench-bpe-{vocab_size}.json"
    if not os.path.exists(path):
        files = [
            f
            for f in sorted(
                glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)
            )
            if _utf8(f)
        ]
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        t = time.perf_counter()
        tok.train(files, trainer)
        print(
            f"trained a {tok.get_vocab_size()}-token BPE on {len(files)} files in {time.perf_counter() - t:.0f} s"
        )
        tok.save(path)
    return open(path).read()


def sampler_steps(tokenizer_json: str, vocab: int, n: int, steps: int) -> None:
    t = time.perf_counter()
    backend = GrammarBackend(tokenizer_json, vocab, (0,))
    backend.tokenizer()
    print(f"llguidance tokenizer ({vocab} tokens): {time.perf_counter() - t:.2f} s, once per engine")
    spec = StructuredOutputs(json=SCHEMA, disable_any_whitespace=True)
    t = time.perf_counter()
    backend.grammar_for(spec)
    first = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    backend.grammar_for(spec)
    print(f"JSON schema: compile {first:.1f} ms, from the cache {(time.perf_counter() - t) * 1e3:.2f} ms")

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=g)
    sampler = Sampler("cpu", 0)
    params = [SamplingParams(temperature=1.0)] * n
    gens = [torch.Generator().manual_seed(i) for i in range(n)]

    class Row:
        def __init__(self) -> None:
            self.grammar = backend.grammar_for(spec)

    def run(constrained: bool) -> tuple[float, int]:
        rows = [Row() for _ in range(n)] if constrained else None
        done = 0
        t = time.perf_counter()
        for _ in range(steps):
            result = sampler(logits.clone(), params, gens, rows)
            if rows is not None:
                for row, token in zip(rows, result.token_ids, strict=True):
                    row.grammar.accept(token)
                    if row.grammar.terminated:
                        done += 1
                        row.grammar = backend.grammar_for(spec)
        return (time.perf_counter() - t) / steps * 1e3, done

    run(False)  # warm-up
    plain, _ = run(False)
    constrained, done = run(True)
    print(
        f"sampler, {n} rows x {vocab}: plain {plain:.1f} ms/step, JSON schema {constrained:.1f} ms/step "
        f"({constrained / plain:.2f}x; {done} documents completed in {steps} steps)"
    )


def end_to_end(model: str, n: int) -> None:
    llm = LLM(model, max_model_len=512, num_pages=1024)
    prompts = [f"# call {i}: list the files under src/ as JSON\n" for i in range(n)]
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    runs = {"plain": [], "json": []}
    for _ in range(2):
        for name in ("plain", "json"):
            kw = {"structured_outputs": spec} if name == "json" else {"ignore_eos": True}
            p = SamplingParams(temperature=1.0, seed=1, max_tokens=64, **kw)
            t = time.perf_counter()
            outs = llm.generate(prompts, p)
            dt = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            runs[name].append(tokens / dt)
            if name == "json":
                done = sum(o.outputs[0].finish_reason == "stop" for o in outs)
                valid = 0
                for o in outs:
                    try:
                        json.loads(o.outputs[0].text)
                        valid += 1
                    except ValueError:
                        pass
                print(f"  json run: {done}/{n} finished, {valid}/{n} parse, {tokens / n:.0f} tokens each")
    plain, js = max(runs["plain"]), max(runs["json"])
    print(f"engine, {n} requests: plain {plain:.0f} tok/s, JSON schema {js:.0f} tok/s ({js / plain:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model", default=".demo-model")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    tokenizer_json = big_tokenizer(args.vocab_size)
    vocab = Tokenizer.from_str(tokenizer_json).get_vocab_size()
    sampler_steps(tokenizer_json, vocab, args.requests, args.steps)
    end_to_end(args.model, args.requests)


if __name__ == "__main__":
    main()
