"""Where `pdserve bench offline`'s generate spends its time: GPU busy time against wall, top ops, top
Python functions.

    python scripts/profile_offline.py [--device cuda] [--dtype bfloat16] [--out DIR]

The bench's requests (32, ~18k prompt tokens, ~4k output tokens) on the demo checkpoint, after a
warm-up: on a GPU, plain runs with SDPA's default backends and with cuDNN's attention left out; one
run under torch.profiler (CPU and CUDA activities: the sum of kernel times is the GPU's
busy time; wall minus it is time the GPU waited on the host), one under cProfile. Writes the tables
to DIR (default /tmp) and prints the summary.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

from pdserve import LLM, SamplingParams
from pdserve.bench.offline import make_workload
from pdserve.model.demo import make_demo_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model", default=".demo-model")
    p.add_argument("--out", default="/tmp")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (Path(args.model) / "config.json").is_file():
        make_demo_model(args.model)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=2048, kv_cache_memory_gib=4)
    work = make_workload(32, 0, llm.engine.config.model_config.vocab_size)
    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work]
    num_out = sum(m for _, m in work)

    def run() -> float:
        llm.engine.kv.pool.reset_prefix_cache()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run()
    plain_s = run()
    if args.device == "cuda":
        # Which attention kernels SDPA may pick: the default lets it take cuDNN's, whose host cost per
        # call was 67 us on the H200 (the engine makes one call per prefill chunk and decode group per
        # layer); the same requests with cuDNN's left out, alternated with the default, best of 2.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        no_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        times: dict[str, float] = {"default": plain_s, "without cuDNN attention": float("inf")}
        for _ in range(2):
            with sdpa_kernel(no_cudnn):
                times["without cuDNN attention"] = min(times["without cuDNN attention"], run())
            times["default"] = min(times["default"], run())
        for name, t in times.items():
            print(f"SDPA backends {name}: {t:.2f} s ({num_out / t:.0f} output tok/s)")
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        prof_s = run()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    launches = sum(
        e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
    )
    print(f"plain run {plain_s:.2f} s ({num_out / plain_s:.0f} output tok/s); profiled run {prof_s:.2f} s")
    print(
        f"GPU busy (sum of kernel times) {kernel_us / 1e6:.2f} s = {kernel_us / 1e6 / prof_s:.0%} of the "
        f"profiled wall; kernel launches {launches}"
    )
    table_cpu = events.table(sort_by="self_cpu_time_total", row_limit=25)
    (out / "ops_by_cpu.txt").write_text(table_cpu)
    if args.device == "cuda":
        (out / "ops_by_cuda.txt").write_text(events.table(sort_by="self_cuda_time_total", row_limit=25))
    print("\n".join(table_cpu.splitlines()[:18]))

    pr = cProfile.Profile()
    pr.enable()
    cp_s = run()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    (out / "cprofile.txt").write_text(s.getvalue())
    print(f"cProfile run {cp_s:.2f} s; top functions by own time:")
    lines = [ln for ln in s.getvalue().splitlines() if ln.strip()]
    start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
    print("\n".join(lines[start : start + 21]))


if __name__ == "__main__":
    main()
