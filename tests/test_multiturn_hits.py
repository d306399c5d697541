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


def _turn(c, prompt: list[int], read_path: str, max_tokens: int) -> tuple[list[int], dict]:
    r = httpx.post(
        c.router_url + "/v1/completions",
        json={
            "model": "demo",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "read_path": read_path,
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
