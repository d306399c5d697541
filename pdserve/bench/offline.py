"""`pdserve bench offline`: the same requests through pdserve and through HF `generate`, one run.

Workload: `num_requests` prompts of 64-1024 tokens (uniform, seeded) with max_tokens 16-256,
`ignore_eos` so both sides produce exactly the same number of tokens. HF runs them as one padded
batch (left padding, `max_new_tokens` = the largest max_tokens; tokens past a request's own
max_tokens are wasted work, as they are for any static batch). Both rates count only the tokens
each request asked for. Greedy, so the outputs can be compared too.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from pdserve.argtypes import make_parent


def make_workload(num_requests: int, seed: int, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        n = rng.randint(64, 1024)
        out.append(([rng.randrange(10, vocab_size) for _ in range(n)], rng.randint(16, 256)))
    return out


def hf_dtype_kw() -> str:
    """`from_pretrained`'s dtype keyword: `dtype` since transformers 4.56, `torch_dtype` before (where
    `dtype=` is silently ignored and the model loads in float32)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def run_offline_bench(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve import LLM, SamplingParams
    from pdserve.model.demo import make_demo_model

    model_dir = args.model
    if model_dir is None:
        model_dir = ".demo-model"
        if not (Path(model_dir) / "config.json").is_file():
            make_demo_model(model_dir)
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        max_model_len=2048,
        kv_cache_memory_gib=args.kv_cache_gib,
    )
    # Hugging Face runs on what pdserve resolved ("auto" included): the two sides on equal terms.
    device, dtype_name = llm.engine.config.device, llm.engine.config.dtype
    work = make_workload(args.num_requests, args.seed, llm.engine.config.model_config.vocab_size)
    num_out = sum(m for _, m in work)
    num_in = sum(len(p) for p, _ in work)
    print(
        f"{len(work)} requests, {num_in} prompt tokens, {num_out} output tokens "
        f"(device {device}, {dtype_name}, torch threads {torch.get_num_threads()})"
    )

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    warm = prompts[:2]
    llm.generate(warm, [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * len(warm))  # warm-up

    def run_ours():
        llm.engine.kv.pool.reset_prefix_cache()  # every repeat starts cold: no prefix hits
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - t, outs

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, **{hf_dtype_kw(): dtype}).to(device).eval()
    hf.generation_config.eos_token_id = None
    max_len = max(len(p) for p, _ in work)
    pad = 0
    ids = torch.tensor([[pad] * (max_len - len(p)) + p for p, _ in work], device=device)
    mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p, _ in work], device=device)
    with torch.no_grad():
        hf.generate(
            ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4, do_sample=False, pad_token_id=pad
        )

    def run_hf():
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(m for _, m in work),
                do_sample=False,
                pad_token_id=pad,
            )
        return time.perf_counter() - t, out

    # Alternate the two sides and keep each one's best time, so a burst of load from elsewhere on
    # the machine does not land on one side only.
    ours_s = hf_s = float("inf")
    for _ in range(args.repeats):
        dt, ours = run_ours()
        ours_s = min(ours_s, dt)
        dt, hf_out = run_hf()
        hf_s = min(hf_s, dt)
    assert sum(len(o.outputs[0].token_ids) for o in ours) == num_out
    hf_tokens = [hf_out[i, max_len : max_len + m].tolist() for i, (_, m) in enumerate(work)]
    same = sum(o.outputs[0].token_ids == h for o, h in zip(ours, hf_tokens, strict=True))

    ours_rate, hf_rate = num_out / ours_s, num_out / hf_s
    res = {
        "num_requests": len(work),
        "prompt_tokens": num_in,
        "output_tokens": num_out,
        "device": device,
        "dtype": dtype_name,
        "pdserve_s": round(ours_s, 3),
        "hf_s": round(hf_s, 3),
        "pdserve_tok_s": round(ours_rate, 1),
        "hf_tok_s": round(hf_rate, 1),
        "ratio": round(ours_rate / hf_rate, 2),
        "identical_outputs": same,
        "repeats": args.repeats,
    }
    print(f"pdserve       {ours_s:8.2f} s  {ours_rate:9.1f} output tok/s")
    print(f"transformers  {hf_s:8.2f} s  {hf_rate:9.1f} output tok/s  (one padded batch)")
    print(
        f"ratio pdserve/transformers: {ours_rate / hf_rate:.2f}x; identical greedy outputs: {same}/{len(work)}"
    )
    if args.json:
        Path(make_parent(args.json)).write_text(json.dumps(res, indent=2))
    return 0
