"""`make demo`: launch a router + 1 prefill + 1 decode on the demo checkpoint, talk to it with the `openai`
client, check that PD gives the colocated greedy output, print what came back with timings, stop the
cluster; then the DualPath comparison on an emulated cluster (`demo-dualpath.json` / `.png`)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# A stand-in for an agent's growing context: the 4th demo prompt appends to it, so its whole pages
# are served from the prefix cache (`cached_tokens` in the usage block).
AGENT_CONTEXT = (
    "You are a coding agent. The repository has a parser module, a scheduler module and tests.\n"
    "Turn 1: read parser.py and list its public functions.\n"
    "Observation: parse_args(argv), build_parser(), main(argv=None).\n"
    "Turn 2: run the tests and report failures.\n"
    "Observation: 2 failed: test_empty_prompt, test_stop_strings; 41 passed.\n"
    "Turn 3: open the failing tests and explain the first failure.\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0, name: str = "server") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{name} at {url} not healthy after {timeout_s}s")


def start_server(model_dir: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model",
        model_dir,
        "--role",
        "colocated",
        "--port",
        str(port),
        *extra,
    ]
    return subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def ensure_demo_model(model_dir: str) -> str:
    """Build the demo checkpoint in `model_dir` unless it is there; returns the directory."""
    from pdserve.model.demo import make_demo_model

    # (config.json is written last; the weights too, for a directory an older build left half-written)
    if not all((Path(model_dir) / f).is_file() for f in ("config.json", "model.safetensors")):
        t = time.perf_counter()
        make_demo_model(model_dir)
        print(f"built demo checkpoint in {model_dir} ({time.perf_counter() - t:.1f}s)")
    return model_dir


def run_demo(model_dir: str, port: int = 0) -> int:
    """Launch router + 1 prefill + 1 decode (NIXL between them) on the demo checkpoint and talk to the
    router with the `openai` client; compare with a colocated engine's greedy output; tear down."""
    from openai import OpenAI

    from pdserve import LLM, SamplingParams
    from pdserve.launch import cluster_args, start_cluster

    ensure_demo_model(model_dir)
    args = cluster_args(
        model_dir, kv_cache_gib=0.25, max_model_len=2048, max_num_batched_tokens=256, served_model_name="demo"
    )
    t = time.perf_counter()
    cluster = start_cluster(args, 1, 1, router_port=port)
    try:
        print(
            f"cluster up in {time.perf_counter() - t:.1f}s: router {cluster.router_url}, "
            f"prefill {cluster.urls['prefill'][0]}, decode {cluster.urls['decode'][0]} (KV over NIXL)"
        )
        from pdserve.server.auth import API_KEY_ENV

        # (the cluster inherits $PDSERVE_API_KEY: the demo sends it too, else any placeholder)
        client = OpenAI(base_url=cluster.router_url + "/v1", api_key=os.environ.get(API_KEY_ENV) or "unused")
        model = client.models.list().data[0].id
        # The 4th prompt extends the 2nd: its whole pages are prefix-cache hits.
        prompts = [
            "def fibonacci(n):",
            AGENT_CONTEXT,
            "import argparse\n\nparser =",
            AGENT_CONTEXT + "\nIn summary,",
        ]
        texts = []
        for p in prompts:
            t = time.perf_counter()
            r = client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0)
            dt = time.perf_counter() - t
            u = r.usage
            texts.append(r.choices[0].text)
            shown = p if len(p) < 60 else p[:25] + " ... " + p[-25:]
            print(
                f"\n[completion {dt * 1000:.0f} ms, {u.prompt_tokens} prompt tokens "
                f"({u.prompt_tokens_details.cached_tokens} cached), {u.completion_tokens} generated] "
                f"{shown!r} -> {r.choices[0].text!r}"
            )
        t = time.perf_counter()
        first = None
        text = ""
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=32,
            temperature=0.8,
            seed=1,
            stream=True,
        )
        for ev in stream:
            if ev.choices and ev.choices[0].delta.content:
                first = first or time.perf_counter() - t
                text += ev.choices[0].delta.content
        print(
            f"\n[chat, streamed: TTFT {first * 1000:.0f} ms, total {(time.perf_counter() - t) * 1000:.0f} ms] "
            f"{text!r}"
        )
        for role in ("prefill", "decode"):
            lines = [
                ln
                for ln in httpx.get(cluster.urls[role][0] + "/metrics").text.splitlines()
                if ln.startswith(
                    (
                        "pdserve_kv_pages_used",
                        "pdserve_prefix_cache_hit_rate",
                        "pdserve_pd_pages_sent_total",
                        "pdserve_pd_rooms_held",
                        'pdserve_pd_transfer_total{counter="bytes_done"}',
                    )
                )
            ]
            print(f"\n{role} engine metrics:\n  " + "\n  ".join(lines))
        ref = LLM(model_dir, max_model_len=2048).generate(
            prompts, SamplingParams(max_tokens=24, temperature=0)
        )
        same = sum(o.outputs[0].text == t for o, t in zip(ref, texts, strict=True))
        print(f"\nPD output == colocated engine output (greedy): {same}/{len(prompts)}")
        print("(the demo checkpoint has random weights: its text is noise, its plumbing is real)")
    finally:
        cluster.stop()
    rc = run_dualpath_demo(model_dir)
    return 0 if same == len(prompts) and rc == 0 else 1


def run_dualpath_demo(model_dir: str, out_prefix: str = "demo-dualpath") -> int:
    """The DualPath comparison: 1 prefill node + 2 decode nodes with emulated storage NICs, a small
    agentic workload replayed under Basic (round_robin) and dualpath; table, JSON and plot."""
    from pdserve.bench.dualpath_compare import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--model", model_dir, "--num-agents", "8", "--max-turns", "8", "--sample-s", "2"]
        + ["--json", out_prefix + ".json", "--plot", out_prefix + ".png"]
    )
    print(
        f"\nDualPath: the same agentic workload ({args.num_agents} agents, up to {args.max_turns} turns) on "
        f"nodes {args.nodes} with {args.snic_mbps:g} MB/s storage NICs, under Basic and DualPath placement"
    )
    rc = run(args)
    print(f"wrote {out_prefix}.json and {out_prefix}.png")
    return rc
