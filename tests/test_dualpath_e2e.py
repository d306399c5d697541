"""DualPath read paths end to end: multi-turn conversations through router -> prefill -> decode with a
persistent KV store. The decode writes every full block back; the next turn's prompt (previous
context + new tokens) then finds ≥ 90% of its KV in the store and reads it through the prefill
(`pe`), through the decode (`de`), or not at all (`none`). Greedy outputs must be identical for all
three and equal to a colocated engine recomputing everything. Prefix caching is off in the engines
so that the store is the only source of cached KV.
"""

from __future__ import annotations

import os

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.transfer.nixl_backend import nixl_available
from tests.chaos_helpers import set_faults, wait_until
from tests.conftest import requires_cuda
from tests.test_pd_e2e import metrics, wait_engine_idle

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

MAX_MODEL_LEN = 2048
GEN = 32


@pytest.fixture(
    scope="module",
    params=["cpu", pytest.param("cuda", marks=requires_cuda)],
)
def store_cluster(request, demo_model_dir, tmp_path_factory):
    """`cuda`: both engines keep KV and staging on the GPU (float32); the store's reads land in host
    buffers and are copied to the GPU layer by layer (PE path) or pulled from the decode's GPU (DE)."""
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.launch import cluster_args, start_cluster

    store_root = tmp_path_factory.mktemp("kvstore")
    args = cluster_args(
        demo_model_dir,
        num_pages=600,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=256,
        served_model_name="demo",
        no_prefix_caching=True,
        pd_deadline_s=15.0,
        pd_abort_lease_s=46.0,  # the safe minimum for 15 s deadlines (3 x 15 s + 1 s)
        kv_store=str(store_root),
        kv_block_size=64,
        enable_fault_injection=True,
        device=request.param,
        dtype="float32",
    )
    c = start_cluster(args, 1, 1)
    c.store_root, c.device = store_root, request.param
    yield c
    c.stop()


@pytest.fixture(scope="module")
def colocated(demo_model_dir, store_cluster):
    return LLM(
        demo_model_dir,
        max_model_len=MAX_MODEL_LEN,
        num_pages=600,
        enable_prefix_caching=False,
        device=store_cluster.device,
        dtype="float32",
    )


def complete(url: str, ids: list[int], read_path: str) -> dict:
    body = {
        "model": "demo",
        "prompt": ids,
        "max_tokens": GEN,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        "read_path": read_path,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def wait_written_back(cluster, timeout_s: float = 30.0) -> None:
    """Until every decode's write-back queue is empty: a response ends only after its request queued
    all its blocks, so then every block of the finished turns is on disk."""

    def drained() -> bool:
        return all(metrics(u)["pdserve_store_writes_pending"] == 0 for u in cluster.urls["decode"])

    wait_until(drained, timeout_s, "the decodes' write-back", interval_s=0.02)


@pytest.mark.parametrize("read_path", ["none", "pe", "de"])
def test_multi_turn_read_paths_equal_recompute(store_cluster, colocated, read_path):
    tok = colocated.get_tokenizer()
    seed_text = {"none": "alpha", "pe": "beta", "de": "gamma"}[read_path]  # one conversation per path
    context = tok.encode(
        f"# conversation {seed_text}\n" + "def step(state, action):\n    return state\n" * 74
    )
    assert 900 < len(context) < 1200
    url = store_cluster.router_url
    for turn in range(3):
        if turn:
            context = context + tok.encode(
                f"\n# turn {turn}: user says {seed_text} again\n", add_special_tokens=False
            )
        resp = complete(url, context, read_path)
        ref = colocated.generate(
            {"prompt_token_ids": context}, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
        )[0]
        assert resp["choices"][0]["text"] == ref.outputs[0].text, f"{read_path} turn {turn}"
        out_ids = ref.outputs[0].token_ids
        details = resp["usage"]["prompt_tokens_details"]
        if turn and read_path != "none":
            assert details["cached_tokens_storage"] >= 0.9 * len(context), (read_path, turn, details)
            assert details["cached_tokens"] >= details["cached_tokens_storage"]
        if read_path == "none":
            assert details["cached_tokens_storage"] == 0
        context = context + out_ids
        wait_written_back(store_cluster)  # the decode writes blocks back off the critical path
    for url in store_cluster.urls["prefill"] + store_cluster.urls["decode"]:
        wait_engine_idle(url)


def test_store_metrics_show_write_back_and_layerwise_prefills(store_cluster):
    m = metrics(store_cluster.urls["decode"][0])
    assert m["pdserve_store_blocks_written_total"] > 0
    # Turns 2 and 3 of the pe and de conversations ran the layerwise lane on the prefill.
    assert metrics(store_cluster.urls["prefill"][0])["pdserve_pd_layerwise_prefills_total"] == 4
    assert metrics(store_cluster.urls["prefill"][0])["pdserve_pd_layerwise_fallbacks_total"] == 0  # all fit


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_corrupt_stored_block_is_detected_and_recomputed(store_cluster, colocated, read_path):
    """A stored block with a flipped byte: the read path detects it (checksum), counts it, and the
    tokens from that block on are recomputed — the output is still exactly the recomputed one."""
    tok = colocated.get_tokenizer()
    store_dir = next(p for p in store_cluster.store_root.iterdir() if p.is_dir())

    def block_files():
        return {p for p in store_dir.rglob("*") if p.is_file()}

    before = block_files()
    context = tok.encode(f"# corrupt {read_path}\n" + "value = compute(value)\n" * 120)
    first = complete(store_cluster.router_url, context, read_path)
    wait_written_back(store_cluster)
    new_files = sorted(block_files() - before, key=lambda p: p.stat().st_mtime)
    assert len(new_files) >= 8
    victim = new_files[len(new_files) // 2]
    data = bytearray(victim.read_bytes())
    data[4096 + 1000] ^= 0xFF  # a payload byte (the header is the first 4 KiB)
    victim.write_bytes(bytes(data))
    engine_url = store_cluster.urls["prefill" if read_path == "pe" else "decode"][0]
    bad_before = metrics(engine_url)["pdserve_store_blocks_bad_total"]
    ref_first = colocated.generate(
        {"prompt_token_ids": context}, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    )[0]
    assert first["choices"][0]["text"] == ref_first.outputs[0].text
    context = context + ref_first.outputs[0].token_ids + tok.encode("\n# next\n", add_special_tokens=False)
    resp = complete(store_cluster.router_url, context, read_path)
    ref = colocated.generate(
        {"prompt_token_ids": context}, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    )[0]
    assert resp["choices"][0]["text"] == ref.outputs[0].text
    wait_engine_idle(engine_url)
    assert metrics(engine_url)["pdserve_store_blocks_bad_total"] == bad_before + 1
    assert resp["usage"]["prompt_tokens_details"]["cached_tokens_storage"] < 0.9 * len(context)


def test_write_back_backlog_is_visible_and_drains(store_cluster, colocated):
    """A slow disk: the response ends before its blocks are on disk; the backlog shows in
    pdserve_store_writes_pending and drains to 0 with every block written."""
    de = store_cluster.urls["decode"][0]
    set_faults(de, [{"point": "store.write", "action": "slow", "delay_s": 0.5}])
    try:
        context = colocated.get_tokenizer().encode("# backlog\n" + "total += step(total)\n" * 60)
        written = metrics(de)["pdserve_store_blocks_written_total"]
        complete(store_cluster.router_url, context, "none")
        num_blocks = (len(context) + GEN - 1) // 64  # full blocks of the turn's computed tokens
        assert num_blocks >= 4
        assert metrics(de)["pdserve_store_writes_pending"] >= 1  # 0.5 s a block, 6+ blocks: still writing
        wait_written_back(store_cluster)
        assert metrics(de)["pdserve_store_blocks_written_total"] == written + num_blocks
    finally:
        set_faults(de, [])


PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2, "min_tokens": 8}


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_penalties_through_the_layerwise_lane_equal_colocated(store_cluster, colocated, read_path):
    """Token 1 of a stored prompt is sampled by the layerwise lane, the rest by the decode: with the
    penalties (which read the prompt and the output so far) both must agree with one engine."""
    tok = colocated.get_tokenizer()
    context = tok.encode(f"# penalties via {read_path}\n" + "for item in items:\n    total += item\n" * 70)
    url = store_cluster.router_url
    params = SamplingParams(temperature=0, max_tokens=GEN, **PENALTIES)
    for turn in range(2):
        r = httpx.post(
            url + "/v1/completions",
            json={
                "model": "demo",
                "prompt": context,
                "max_tokens": GEN,
                "temperature": 0,
                "read_path": read_path,
            }
            | PENALTIES,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        ref = colocated.generate({"prompt_token_ids": context}, params)[0].outputs[0]
        assert r.json()["choices"][0]["text"] == ref.text, f"{read_path} turn {turn}"
        if turn:  # the second turn's prompt came from the store, so the layerwise lane sampled token 1
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens_storage"] >= 0.9 * len(context)
        context = context + ref.token_ids + tok.encode("\n# next\n", add_special_tokens=False)
        wait_written_back(store_cluster)
    plain = colocated.generate({"prompt_token_ids": context}, SamplingParams(temperature=0, max_tokens=GEN))
    penalised = colocated.generate({"prompt_token_ids": context}, params)
    assert plain[0].outputs[0].token_ids != penalised[0].outputs[0].token_ids  # the params mattered
