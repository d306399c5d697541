"""`start_cluster` survives a port taken between picking it and binding it (the free-port race)."""

from __future__ import annotations

import socket

import httpx

import pdserve.launch as launch


def test_engine_port_taken_after_it_was_picked_gets_a_new_one(demo_model_dir, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real_free_port = launch.free_port
    calls = []

    def racy_free_port() -> int:
        # The first port handed out (prefill0's HTTP port) is grabbed by someone else before the
        # engine binds it: what free_port() cannot rule out.
        calls.append(1)
        return taken if len(calls) == 1 else real_free_port()

    monkeypatch.setattr(launch, "free_port", racy_free_port)
    args = launch.cluster_args(demo_model_dir, num_pages=64, max_model_len=256, served_model_name="demo")
    cluster = launch.start_cluster(args, 1, 1)
    try:
        url = cluster.url("prefill0")
        assert not url.endswith(f":{taken}")  # it was given a fresh port
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert cluster.proc("prefill0").poll() is None and not cluster.dead()
        body = {"model": "demo", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop()
        squatter.close()
