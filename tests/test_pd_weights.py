"""Weight updates on a PD cluster (an RL trainer's next checkpoint), real processes on loopback: the
router holds new requests, has every engine load the checkpoint, and lets them go; answers are then
exactly those of an engine loaded from the new weights, the KV store never serves blocks the old
weights computed, and a prefill and a decode of different weights refuse each other's requests
(clean 503s) instead of mixing KV."""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.model.demo import make_demo_model
from tests.conftest import wait_until
from tests.test_dualpath_e2e import wait_written_back
from tests.test_engine_status import num_requests
from tests.test_pd_e2e import wait_engine_idle

MAX_MODEL_LEN = 1024
GEN = 8
KW = dict(max_model_len=MAX_MODEL_LEN, num_pages=400, dtype="float32")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-ckpts")
    return str(make_demo_model(root / "a", seed=0)), str(make_demo_model(root / "b", seed=1))


@pytest.fixture(scope="module")
def cluster(checkpoints, tmp_path_factory):
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.launch import cluster_args, start_cluster

    a, _ = checkpoints
    args = cluster_args(
        a,
        num_pages=400,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=256,
        served_model_name="demo",
        no_prefix_caching=True,  # (a repeated prompt is then read from the store, not kept in HBM)
        pd_deadline_s=8.0,
        pd_abort_lease_s=25.0,
        kv_store=str(store_root := tmp_path_factory.mktemp("kvstore")),
        kv_block_size=64,
        enable_weight_updates=True,
        dtype="float32",
    )
    c = start_cluster(args, 1, 1)
    c.store_root = store_root
    yield c
    c.stop()


@pytest.fixture(scope="module")
def refs(checkpoints):
    """Greedy answers of engines loaded from each checkpoint."""
    out = {}
    for name, path in zip("ab", checkpoints, strict=True):
        llm = LLM(path, **KW)
        out[name] = llm
    return out


def greedy(llm: LLM, ids: list[int]) -> str:
    sp = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    return llm.generate({"prompt_token_ids": ids}, sp)[0].outputs[0].text


def complete(url: str, ids: list[int], **kw) -> httpx.Response:
    body = {"model": "demo", "prompt": ids, "max_tokens": GEN, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body | {"read_path": "pe"} | kw, timeout=120)


def update(url: str, path: str, **kw) -> httpx.Response:
    return httpx.post(url + "/update_weights_from_disk", json={"model_path": path} | kw, timeout=120)


def prompt(refs, tag: str) -> list[int]:
    return refs["a"].get_tokenizer().encode(f"# {tag}\n" + "total = total + item * weight\n" * 24)


def store_dirs(cluster) -> list[str]:
    """The store's per-weights directories (one per layout fingerprint: `KVBlockStore.dir`)."""
    return sorted(p.name for p in cluster.store_root.iterdir())


def test_the_cluster_serves_the_new_weights_exactly_and_never_their_old_kv(cluster, checkpoints, refs):
    """... and the old weights' store directory is removed (by both engines, which share it), while an
    update to the weights already served keeps it and its blocks."""
    a, b = checkpoints
    ids = prompt(refs, "store")
    first = complete(cluster.router_url, ids)
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == greedy(refs["a"], ids)
    wait_written_back(cluster)
    again = complete(cluster.router_url, ids)  # (the store serves the prompt's blocks: it works)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens_storage"] >= 128
    (dir_a,) = store_dirs(cluster)
    try:
        r = update(cluster.router_url, b)
        assert r.status_code == 200 and r.json()["success"], r.text
        (dir_b,) = store_dirs(cluster)
        assert dir_b != dir_a
        assert len(r.json()["engines"]) == 2
        assert all(e["num_weight_updates"] == 1 for e in r.json()["engines"].values())
        after = complete(cluster.router_url, ids)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["text"] == greedy(refs["b"], ids) != greedy(refs["a"], ids)
        details = after.json()["usage"]["prompt_tokens_details"]
        assert details == {"cached_tokens": 0, "cached_tokens_storage": 0}  # (nothing of the old weights)
        wait_written_back(cluster)
        stored = complete(cluster.router_url, ids)  # (the new weights' own blocks, read back)
        assert stored.json()["usage"]["prompt_tokens_details"]["cached_tokens_storage"] >= 128
        assert stored.json()["choices"][0]["text"] == greedy(refs["b"], ids)
        assert update(cluster.router_url, b).status_code == 200  # (the same weights again)
        kept = complete(cluster.router_url, ids)
        assert kept.json()["usage"]["prompt_tokens_details"]["cached_tokens_storage"] >= 128
        assert store_dirs(cluster) == [dir_b]
        info = httpx.get(cluster.router_url + "/get_model_info", timeout=10).json()
        assert info["model_path"] == b
    finally:
        assert update(cluster.router_url, a).status_code == 200
    assert complete(cluster.router_url, ids).json()["choices"][0]["text"] == greedy(refs["a"], ids)
    assert store_dirs(cluster) == [dir_a]  # (a fresh one: the first went with the update to b)


def test_abort_running_ends_the_requests_in_flight_then_updates(cluster, checkpoints, refs):
    a, b = checkpoints
    ids = prompt(refs, "abort")
    body = {"model": "demo", "prompt": ids, "max_tokens": 500, "temperature": 0, "ignore_eos": True}

    def stream() -> list[dict]:
        chunks = []
        url = cluster.router_url + "/v1/completions"
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        return chunks

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream)
            decode, deadline = cluster.urls["decode"][0], time.monotonic() + 60
            while not streaming.done() and time.monotonic() < deadline:  # (until it is decoding)
                if httpx.get(cluster.router_url + "/health", timeout=5).json()["engines"][decode][
                    "in_flight"
                ]:
                    break
                time.sleep(0.01)
            r = update(cluster.router_url, b, abort_running=True)
            chunks = streaming.result()
        assert r.status_code == 200 and r.json()["success"], r.text
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert complete(cluster.router_url, ids).json()["choices"][0]["text"] == greedy(refs["b"], ids)
    finally:
        assert update(cluster.router_url, a).status_code == 200


def test_a_prefill_and_a_decode_of_different_weights_refuse_each_others_requests(cluster, checkpoints, refs):
    """Only the prefill updated (its own endpoint): the decode's KV requests are refused (it
    registered under the old weights), a 503 for the client, never an answer computed from KV of
    other weights. Once the cluster is updated, the decode registers again and the pair serves."""
    a, b = checkpoints
    ids = prompt(refs, "mixed")
    try:  # (the decode is registered with the prefill, under the old weights)
        assert complete(cluster.router_url, ids).json()["choices"][0]["text"] == greedy(refs["a"], ids)
        assert update(cluster.urls["prefill"][0], b).status_code == 200
        mixed = complete(cluster.router_url, ids)
        # (refused by the prefill, or already kept from it by the router, whose health check sees it
        # serve other weights than the cluster's last update)
        assert mixed.status_code == 503, mixed.text
        assert "weights this prefill no longer serves" in mixed.text or "no healthy prefill" in mixed.text
        wait_engine_idle(cluster.urls["decode"][0])  # (the failed room's end reaches its engine thread)
        assert update(cluster.router_url, b).status_code == 200  # (the whole cluster: the decode too)
        served = complete(cluster.router_url, ids)
        assert served.status_code == 200 and served.json()["choices"][0]["text"] == greedy(refs["b"], ids)
    finally:
        assert update(cluster.router_url, a).status_code == 200


def until_decoding(cluster, answer: concurrent.futures.Future) -> None:
    """Until the cluster's decode runs a request (or `answer` is done): by the decode's own count, not
    the router's, which counts a request once it has sent it, before the decode has it."""
    decode, deadline = cluster.urls["decode"][0], time.monotonic() + 60
    while not answer.done() and time.monotonic() < deadline:
        load = httpx.get(decode + "/v1/loads", params={"include": "core"}, timeout=5).json()
        if load["loads"][0]["num_running_reqs"]:
            return
        time.sleep(0.01)


def test_a_paused_cluster_aborts_what_runs_holds_new_requests_across_an_update(cluster, checkpoints, refs):
    """AReaL's and slime's update: `/pause_generation` (abort), the update, `/continue_generation`.
    The request held meanwhile is answered by the new weights, exactly; the update does not end the
    pause. An engine of the cluster refuses to be paused on its own, and the router refuses the
    modes that would freeze a request's two halves."""
    a, b = checkpoints
    ids, url = prompt(refs, "pause"), cluster.router_url
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            long = pool.submit(complete, url, ids, max_tokens=500)
            until_decoding(cluster, long)
            paused = httpx.post(url + "/pause_generation", json={}, timeout=60)
            aborted = long.result()
            held = pool.submit(complete, url, ids)
            time.sleep(0.5)
            waiting = (held.done(), httpx.get(url + "/is_paused", timeout=5).json())
            alone = httpx.post(cluster.urls["decode"][0] + "/pause_generation", json={}, timeout=10)
            frozen = httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=10)
            keep = httpx.post(url + "/pause", params={"mode": "keep"}, timeout=10)
            updated = update(url, b)
            time.sleep(0.3)
            still = held.done()
            resumed = httpx.post(url + "/continue_generation", json={}, timeout=10)
            answer = held.result()
        assert paused.status_code == 200, paused.text
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        assert aborted.json()["choices"][0]["finish_reason"] == "abort"
        assert waiting == (False, {"is_paused": True})
        assert alone.status_code == 400 and "through its router" in alone.json()["error"]["message"]
        asleep = httpx.post(cluster.urls["decode"][0] + "/sleep", timeout=10)  # (its KV is registered)
        assert asleep.status_code == 400 and "keeps its memory" in asleep.text
        assert frozen.status_code == 400 and keep.status_code == 400 and "router" in frozen.text
        assert "'keep'" in keep.json()["error"]["message"]  # (the client's name for the mode)
        assert updated.status_code == 200 and updated.json()["success"], updated.text
        assert still is False and resumed.status_code == 200
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == greedy(refs["b"], ids)
        assert httpx.get(url + "/is_paused", timeout=5).json() == {"is_paused": False}
    finally:
        httpx.post(url + "/continue_generation", timeout=10)
        assert update(url, a).status_code == 200


def test_vllm_pause_wait_lets_the_cluster_finish_what_runs(cluster, refs):
    ids, url = prompt(refs, "wait"), cluster.router_url
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(complete, url, ids, max_tokens=40)
            until_decoding(cluster, running)
            paused = httpx.post(url + "/pause", params={"mode": "wait"}, timeout=120)
            # (what ran has ended on every engine and in the router when the pause answers; not
            # `running.done()`: the client's thread may still be reading the answer the router sent)
            loads = httpx.get(url + "/v1/loads", timeout=10).json()
            held = pool.submit(complete, url, ids)
            time.sleep(0.5)
            waiting = held.done()
            resumed = httpx.post(url + "/resume", timeout=10)
            answer = held.result()
        assert paused.json() == {"status": "paused"} and num_requests(loads) == 0 and len(loads["loads"]) == 3
        assert running.result().json()["choices"][0]["finish_reason"] == "length"
        assert waiting is False and resumed.json() == {"status": "resumed"}
        assert answer.json()["choices"][0]["text"] == greedy(refs["a"], ids)
    finally:
        httpx.post(url + "/resume", timeout=10)


def test_the_router_reports_the_cluster_load_info_and_health(cluster, refs):
    """slime's view of a cluster through its router: `/health_generate` generates one token through a
    prefill and a decode; `/v1/loads` lists both engines and the router, counts a running request on
    each and falls to zero after an abort of everything; `/get_server_info` is an engine's, with the
    cluster's shape."""
    ids, url = prompt(refs, "loads"), cluster.router_url
    healthy = httpx.get(url + "/health_generate", timeout=60)
    assert healthy.status_code == 200, healthy.text
    info = httpx.get(url + "/get_server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "router" and info["max_total_num_tokens"] == 400 * 16
    assert info["pd_cluster"]["prefill_urls"] == cluster.urls["prefill"]
    idle = httpx.get(url + "/v1/loads", timeout=10).json()
    assert [e["role"] for e in idle["loads"]] == ["prefill", "decode", "router"]
    assert [e["dp_rank"] for e in idle["loads"]] == [0, 1, 2] and num_requests(idle) == 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(complete, url, ids, max_tokens=500)
        until_decoding(cluster, long)
        busy = httpx.get(url + "/v1/loads", params={"include": "core,disagg"}, timeout=10).json()
        httpx.post(url + "/abort_request", json={"abort_all": True}, timeout=30)
        assert long.result().json()["choices"][0]["finish_reason"] == "abort"
    decode, router_entry = busy["loads"][1], busy["loads"][2]
    assert decode["num_total_reqs"] == 1 and decode["disaggregation"]["mode"] == "decode"
    assert router_entry["num_total_reqs"] == 1
    wait_engine_idle(cluster.urls["prefill"][0])
    wait_engine_idle(cluster.urls["decode"][0])
    after = httpx.get(url + "/v1/loads", params={"include": "core,disagg,queues"}, timeout=10).json()
    assert num_requests(after) == 0, after
    bad = httpx.get(url + "/v1/loads", params={"include": "gpu"}, timeout=10)
    assert bad.status_code == 400
    one = httpx.get(url + "/v1/loads", params={"dp_rank": 1, "include": "core"}, timeout=10).json()
    assert [(e["dp_rank"], e["role"]) for e in one["loads"]] == [(1, "decode")]
    assert httpx.get(url + "/v1/loads", params={"dp_rank": 3}, timeout=10).status_code == 404
    try:
        assert httpx.post(url + "/pause_generation", json={}, timeout=60).status_code == 200
        paused = httpx.get(url + "/health_generate", timeout=10)
        assert paused.status_code == 503 and paused.json() == {"status": "paused"}
    finally:
        httpx.post(url + "/continue_generation", timeout=10)
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200


def test_a_resume_ends_a_router_pause_still_waiting_for_its_requests(cluster, refs):
    """vLLM's wait mode overtaken by a `/resume`: the pause answers 409 at once instead of waiting on
    (found by review: it waited for the cluster to drain, then answered "paused" while it was not)."""
    ids, url = prompt(refs, "resume"), cluster.router_url
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = pool.submit(complete, url, ids, max_tokens=500)
            until_decoding(cluster, running)
            pausing = pool.submit(httpx.post, url + "/pause", params={"mode": "wait"}, timeout=120)
            wait_until(  # (the pause holds new requests and waits for `running`)
                lambda: httpx.get(url + "/is_paused", timeout=5).json()["is_paused"], 30, "the pause", 0.01
            )
            resumed = httpx.post(url + "/resume", timeout=10)
            paused = pausing.result()
            finished = running.done()
            answer = running.result()
        assert resumed.json() == {"status": "resumed"}
        assert paused.status_code == 409 and not finished, paused.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(url + "/is_paused", timeout=5).json() == {"is_paused": False}
    finally:
        httpx.post(url + "/resume", timeout=10)
