"""DualPath on a cluster of real engine processes: 1 prefill node and 2 decode nodes whose storage NICs
are emulated (pdserve.netem, rate-limited, shared through link files), the router placing requests with
pdserve.dualpath.scheduler. The same agentic workload runs under Basic (`round_robin`: every store read
on the prefill node) and `dualpath` (reads spread over all three nodes); greedy outputs must be
identical and every engine must end idle with no page and no room held."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import httpx
import pytest

from pdserve.bench.agentic import WorkloadConfig, build_agents, run_agents
from pdserve.transfer.nixl_backend import nixl_available
from tests.test_pd_e2e import wait_engine_idle

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

NODES = "p0:1p,d0:1d,d1:1d"


def run_cluster(model_dir: str, policy: str, agents) -> tuple:
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.launch import cluster_args, start_cluster

    with tempfile.TemporaryDirectory(prefix="pdserve-store-") as store:
        args = cluster_args(
            model_dir,
            nodes=NODES,
            snic_mbps=40.0,
            cnic_mbps=400.0,
            policy=policy,
            kv_store=store,
            no_prefix_caching=True,
            max_model_len=1024,
            kv_cache_gib=0.1,
        )
        cluster = start_cluster(args, 0, 0)
        try:
            result = asyncio.run(run_agents(cluster.router_url, agents, online=False, sample_s=0.2))
            state = httpx.get(cluster.router_url + "/pd/cluster", timeout=5).json()
            for url in cluster.urls["prefill"] + cluster.urls["decode"]:
                wait_engine_idle(url)
            engines = {
                url: httpx.get(url + "/pd/info", timeout=5).json()["node"]
                for url in cluster.urls["prefill"] + cluster.urls["decode"]
            }
        finally:
            cluster.stop()
    return result, state, engines


def test_round_robin_and_dualpath_same_tokens_reads_spread(demo_model_dir):
    agents = build_agents(
        WorkloadConfig(
            workload="32k",
            num_agents=4,
            max_turns=3,
            length_scale=0.2,
            max_context_tokens=900,
            vocab_size=4096,
            seed=3,
            # Tool latency between turns: the decode writes a turn's blocks back asynchronously
            # (through the node's emulated storage NIC), and a turn sent before its history is on
            # disk recomputes it, correctly but without a store read (seen once under load).
            think_s=0.3,
        )
    )
    basic, basic_state, engines = run_cluster(demo_model_dir, "round_robin", agents)
    dual, dual_state, _ = run_cluster(demo_model_dir, "dualpath", agents)

    assert sorted(engines.values()) == ["d0", "d1", "p0"]  # every engine sits on its --nodes node
    for res in (basic, dual):
        assert all(r.ok for r in res.records), [r.error for r in res.records if not r.ok]
        assert len(res.records) == sum(len(a.turns) for a in agents)
    assert basic.outputs_sha256() == dual.outputs_sha256()  # placement never changes tokens

    # Every turn after the first reads the agent's history from the store (no prefix cache).
    for res in (basic, dual):
        later = [r for r in res.records if r.turn > 0]
        assert later and all(r.cached_tokens_storage > 0 for r in later)

    reads = {
        name: {n: v["snic_read_bytes_served"] for n, v in st["nodes"].items()}
        for name, st in (("basic", basic_state), ("dual", dual_state))
    }
    # Basic reads only through the prefill node's storage NIC ...
    assert basic_state["placement"]["read_paths"]["de"] == 0
    assert reads["basic"]["p0"] > 0 and reads["basic"]["d0"] == reads["basic"]["d1"] == 0
    # ... DualPath also through the decode nodes'.
    assert dual_state["placement"]["read_paths"]["de"] > 0
    assert reads["dual"]["d0"] + reads["dual"]["d1"] > 0
    assert basic_state["placement"]["queue_len"] == dual_state["placement"]["queue_len"] == 0


def test_dualpath_placement_sends_the_choices_of_one_prompt_to_one_prefill(demo_model_dir):
    """Two prefills, one decode, `--policy dualpath`; n = 3 seeded: the three choices equal a colocated
    engine's (seed + i each), and one prefill took all three, computing their shared prompt once (the
    other two shared its pages: prefix waits, hits). Placed one by one they went to both prefills."""
    from pdserve.entrypoints.llm import LLM
    from pdserve.launch import cluster_args, start_cluster
    from pdserve.sampling_params import SamplingParams
    from tests.test_pd_e2e import metrics

    os.environ.setdefault("UCX_MODULES", "^ib*")
    args = cluster_args(demo_model_dir, policy="dualpath", num_pages=400, served_model_name="demo")
    prompt = list(range(5, 5 + 200))  # (many pages: the siblings arrive while it is computed)
    body = {"model": "demo", "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}
    cluster = start_cluster(args, 2, 1)
    try:
        r = httpx.post(cluster.router_url + "/v1/completions", json=body | {"ignore_eos": True}, timeout=120)
        for url in cluster.urls["prefill"] + cluster.urls["decode"]:
            wait_engine_idle(url)
        prompt_tokens = [metrics(u)["pdserve_prompt_tokens_total"] for u in cluster.urls["prefill"]]
        shared = [
            metrics(u)["pdserve_prefix_cache_hit_tokens_total"] + metrics(u)["pdserve_prefix_waits_total"]
            for u in cluster.urls["prefill"]
        ]
    finally:
        cluster.stop()
    assert r.status_code == 200, r.text
    llm = LLM(demo_model_dir, num_pages=400)
    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6, ignore_eos=True) for i in range(3)]
    refs = [llm.generate([{"prompt_token_ids": prompt}], p)[0].outputs[0].token_ids for p in params]
    texts = [llm.get_tokenizer().decode(ids) for ids in refs]
    assert [c["text"] for c in r.json()["choices"]] == texts
    assert sorted(prompt_tokens) == [0, 3 * len(prompt)], prompt_tokens  # (one prefill took all three)
    assert max(shared) > 0, shared


def test_the_choices_of_one_stored_prompt_read_it_once_through_the_prefill_nodes_storage_nic(demo_model_dir):
    """1P1D, Basic (every read on the prefill's side), a store behind an emulated 2 MB/s storage
    NIC. A first turn stores its context; the next turn asks n = 4 choices of it: the four children
    reach the prefill together and read the context's blocks once (three join the first's read),
    not four times; the greedy choices are the same answer. (At 40 MB/s the 2.4 MB read took ~60 ms,
    and on a loaded machine a child once came after it had ended: 2 reads, 2 joins; it takes ~1.2 s
    now.)"""
    from pdserve.launch import cluster_args, start_cluster
    from tests.test_pd_e2e import metrics

    os.environ.setdefault("UCX_MODULES", "^ib*")
    with tempfile.TemporaryDirectory(prefix="pdserve-store-") as store:
        args = cluster_args(
            demo_model_dir,
            nodes="p0:1p,d0:1d",
            snic_mbps=2.0,
            cnic_mbps=400.0,
            policy="round_robin",
            kv_store=store,
            no_prefix_caching=True,
            max_model_len=1024,
            kv_cache_gib=0.1,
            served_model_name="demo",
        )
        cluster = start_cluster(args, 0, 0)
        try:
            (pe,), (de,) = cluster.urls["prefill"], cluster.urls["decode"]
            context = [(7 * i) % 4000 + 5 for i in range(600)]
            body = {"model": "demo", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            first = httpx.post(
                cluster.router_url + "/v1/completions", json=body | {"prompt": context}, timeout=120
            )
            assert first.status_code == 200, first.text
            wait_engine_idle(de)
            deadline = time.monotonic() + 30
            while metrics(de)["pdserve_store_writes_pending"] > 0:  # (the decode's write-back)
                assert time.monotonic() < deadline, "the first turn's blocks were never written back"
                time.sleep(0.1)
            before = metrics(pe)
            turn = body | {"prompt": context + list(range(9, 29)), "n": 4}
            r = httpx.post(cluster.router_url + "/v1/completions", json=turn, timeout=120)
            after = wait_engine_idle(pe)
            wait_engine_idle(de)
        finally:
            cluster.stop()
    assert r.status_code == 200, r.text
    assert len({c["text"] for c in r.json()["choices"]}) == 1  # (greedy: four equal choices)
    read = 'pdserve_store_ops_total{op="read_ok_blocks"}'
    num_blocks = after[read] - before[read]
    joined = after["pdserve_store_blocks_read_joined_total"] - before.get(
        "pdserve_store_blocks_read_joined_total", 0
    )
    assert num_blocks >= 600 // 64 - 1 and joined == 3 * num_blocks, (num_blocks, joined)
    # (usage counts the prompt once for its n choices, as OpenAI's does)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens_storage"] == num_blocks * 64
