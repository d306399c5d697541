"""Multi-turn cache hits through a PD cluster with a KV store (a review of multi-turn hits, 2026-12-02,
fourth session; the DE case failed before its fix). Real processes on 127.0.0.1 (router + 1 prefill +
1 decode, NIXL), the demo checkpoint."""

from __future__ import annotations

import os
import random
import time

import httpx
import pytest

from pdserve.transfer.nixl_backend import nixl_available
from tests.test_pd_e2e import cluster_args, metrics

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

BLOCK = 64  # the store's default block size (tokens)


def _wait_write_back(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metrics(url).get("pdserve_store_writes_pending", 0) != 0:
        assert time.monotonic() < deadline, "write-back never drained"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def store_cluster(demo_model_dir, tmp_path_factory):
    """1 prefill + 1 decode sharing a KV store, prefix caching on (the default), no DualPath policy:
    each request names its read path."""
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.launch import start_cluster

    store = str(tmp_path_factory.mktemp("kvstore"))
    c = start_cluster(cluster_args(demo_model_dir, kv_store=store, max_model_len=2048), 1, 1)
    yield c
    c.stop()


def _turn(
    c, prompt: list[int], read_path: str, max_tokens: int, router_url: str = "", **extra
) -> tuple[list[int], dict]:
    r = httpx.post(
        (router_url or c.router_url) + "/v1/completions",
        json={
            "model": "demo",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "read_path": read_path,
            **extra,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_next_turn_reads_the_previous_turns_whole_context_from_the_store(store_cluster, read_path):
    """An agent's turn 2 = turn 1's prompt + its 200 generated ids + 30 new ids. The decode wrote
    turn 1's prompt and generated blocks back (`(301 + 200 - 1) // 64` = 7 blocks, 448 tokens), so
    turn 2 must not recompute them, whichever read path it takes.

    PE: cached 448, storage 448. DE was: cached 288, storage 0 -- the decode's own prefix cache holds
    turn 1's pages (496 tokens >= 448 stored), so `DecodeRole._plan_pages` takes the prefix-cache
    plan (no store read) and `_request_kv` sent no `hit_page_ids`: the prefill computed every token
    its own prefix cache lacked (here turn 1's 200 generated tokens and the partial page; with a cold
    prefill, e.g. another one of several, the whole context), while the decode's pages and the store
    both had them."""
    c = store_cluster
    rng = random.Random(7 if read_path == "pe" else 8)  # (two conversations: nothing shared)
    prompt = [rng.randrange(10, 4000) for _ in range(301)]
    gen, _ = _turn(c, prompt, read_path, 200)
    assert len(gen) == 200
    _wait_write_back(c.urls["decode"][0])
    prompt2 = prompt + gen + [rng.randrange(10, 4000) for _ in range(30)]
    stored = (len(prompt) + len(gen) - 1) // BLOCK * BLOCK  # 448
    _, details = _turn(c, prompt2, read_path, 8)
    assert details["cached_tokens"] >= stored, (read_path, details, stored)
    if read_path == "de":  # the decode's own pages (16 tokens each), pulled by the prefill: no store read
        own = (len(prompt) + len(gen) - 1) // 16 * 16  # 496
        assert (details["cached_tokens"], details["cached_tokens_storage"]) == (own, 0), details
    else:
        assert details["cached_tokens_storage"] == stored, details


def test_another_salts_turn_reads_nothing_of_the_store_or_either_engines_cache(store_cluster):
    """`cache_salt` (vLLM's) through the router, both engines and the store: turn 2 of a conversation
    under another salt finds none of turn 1's KV -- not in the prefill's or the decode's prefix cache,
    not in the store (its block keys are salted) -- while the same salt reads it all from the store.
    Before the fix the salt was ignored and the other tenant's turn read turn 1's 448 stored tokens."""
    c = store_cluster
    rng = random.Random(9)
    prompt = [rng.randrange(10, 4000) for _ in range(301)]
    gen, _ = _turn(c, prompt, "pe", 200, cache_salt="alice")
    _wait_write_back(c.urls["decode"][0])
    prompt2 = prompt + gen + [rng.randrange(10, 4000) for _ in range(30)]
    stored = (len(prompt) + len(gen) - 1) // BLOCK * BLOCK  # 448
    _, other = _turn(c, prompt2, "pe", 8, cache_salt="bob")
    assert (other["cached_tokens"], other["cached_tokens_storage"]) == (0, 0), other
    _, same = _turn(c, prompt2, "pe", 8, cache_salt="alice")
    assert same["cached_tokens"] >= stored and same["cached_tokens_storage"] == stored, same


@pytest.fixture(scope="module")
def two_decode_cluster(demo_model_dir, tmp_path_factory):
    """1 prefill + 2 decodes sharing a KV store, and a router for each decode (`c.via[url]`), so a
    test says which decode a turn runs on."""
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.demo import free_port, wait_healthy
    from pdserve.launch import router_flags, start_cluster

    store = str(tmp_path_factory.mktemp("kvstore2"))
    a = cluster_args(demo_model_dir, kv_store=store, max_model_len=2048)
    c = start_cluster(a, 1, 2)
    try:
        c.via = {}
        for i, decode in enumerate(c.urls["decode"]):
            port = free_port()
            args = ["router", "--port", str(port), "--prefill", *c.urls["prefill"], "--decode", decode]
            proc = c.start(f"router_to_decode{i}", args + router_flags(a), c.commands["router"][1])
            c.via[decode] = f"http://127.0.0.1:{port}"
            wait_healthy(c.via[decode], proc)
        yield c
    finally:
        c.stop()


def _finished(url: str) -> float:
    return sum(v for k, v in metrics(url).items() if k.startswith("pdserve_requests_finished_total"))


@pytest.mark.parametrize("read_path", ["pe", "de"])
def test_next_turn_on_another_decode_reads_the_store_and_equals_one_engine(
    two_decode_cluster, demo_model_dir, read_path
):
    """Turn 1 runs on decode A, turn 2 on decode B, which holds none of the conversation's pages: the
    blocks A wrote back come from the store, through the prefill (pe) or into B itself (de), and
    both turns' tokens equal one colocated engine's."""
    from pdserve import LLM, SamplingParams

    c = two_decode_cluster
    decode_a, decode_b = c.urls["decode"]
    rng = random.Random(11 if read_path == "pe" else 12)
    prompt = [rng.randrange(10, 4000) for _ in range(301)]
    before = {u: _finished(u) for u in (decode_a, decode_b)}
    gen, _ = _turn(c, prompt, read_path, 200, c.via[decode_a])
    _wait_write_back(decode_a)
    prompt2 = prompt + gen + [rng.randrange(10, 4000) for _ in range(30)]
    stored = (len(prompt) + len(gen) - 1) // BLOCK * BLOCK  # 448
    ids2, details = _turn(c, prompt2, read_path, 24, c.via[decode_b])
    assert [_finished(u) - before[u] for u in (decode_a, decode_b)] == [1, 1]
    assert details["cached_tokens"] >= stored and details["cached_tokens_storage"] == stored, details

    ref = LLM(demo_model_dir, max_model_len=2048, num_pages=400, max_num_batched_tokens=128, dtype="float32")
    expected = ref.generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt2}],
        [
            SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        ],
    )
    assert gen == list(expected[0].outputs[0].token_ids)
    assert ids2 == list(expected[1].outputs[0].token_ids)
