"""The router's retry of a failed attempt, against real engine processes: a `/generate` with the
client's own `rid`, retried on another decode, goes to the same prefill with the same rid while that
prefill still holds the failed attempt under it (found by a review of the router, 2026-12-02, sixth
session: the client got a 409 about its own request)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import httpx
import pytest


def _fake_decode(port: int):
    """An engine posing as a decode that fails every attempt with a 503 after 0.3 s (what a real decode
    answers when its transfer fails, its weights are lost, ...)."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/pd/info")
    async def info():
        return {"role": "decode", "model": "demo", "bootstrap_url": "", "status": "ok", "deadline_s": 8.0}

    @app.post("/generate")
    async def generate():
        await asyncio.sleep(0.3)
        return JSONResponse({"error": {"message": "transient failure", "code": 503}}, 503)

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    return server


@pytest.mark.timeout(180)
def test_generate_with_a_client_rid_retried_on_another_decode_is_not_a_409_about_itself(demo_model_dir):
    """Real prefill and decode processes, plus a decode that fails the first attempt with a 503. The
    router retries on the other decode with the *same prefill* and the same body, so the same `rid`:
    the prefill still holds that rid for the failed attempt (its non-streamed handler notices the
    closed connection only at its next CLIENT_POLL_S = 0.5 s poll), so the retry is refused "request id
    'client-rid-1' is already active" and the router hands that 409 to the client. The same request
    without a rid succeeds through the retry. (Mirror case: a prefill failure retried on the same decode.)"""
    from pdserve.demo import free_port, wait_healthy
    from pdserve.launch import start_cluster
    from tests.test_pd_e2e import cluster_args

    os.environ.setdefault("UCX_MODULES", "^ib*")
    model = demo_model_dir
    cluster = start_cluster(cluster_args(model, pd_deadline_s=8.0, pd_abort_lease_s=25.0), 1, 1)
    fake_port, router_port = free_port(), free_port()
    fake = _fake_decode(fake_port)
    router = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "router", "--port", str(router_port),
         "--prefill", cluster.urls["prefill"][0],
         "--decode", f"http://127.0.0.1:{fake_port}", cluster.urls["decode"][0]],
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{router_port}"
        wait_healthy(url, router)
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        without_rid = httpx.post(url + "/generate", json=body, timeout=60)
        with_rid = httpx.post(url + "/generate", json=body | {"rid": "client-rid-1"}, timeout=60)
    finally:
        router.terminate()
        router.wait(15)
        cluster.stop()
        fake.should_exit = True
    assert without_rid.status_code == 200, without_rid.text
    assert with_rid.status_code == 200, with_rid.text


def _slow_engine(port: int, role: str, delay_s: float, posts: list):
    """An engine posing as `role` whose completions answer whole after `delay_s`."""
    import time

    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/pd/info")
    async def info():
        return {"role": role, "model": "m", "bootstrap_url": "http://x", "status": "ok", "deadline_s": 8.0}

    @app.post("/v1/completions")
    async def completions():
        posts.append(role)
        await asyncio.sleep(delay_s)
        return {"id": "c", "choices": [{"index": 0, "text": "a long answer", "finish_reason": "length"}]}

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(250):
        if server.started:
            break
        time.sleep(0.02)
    return server


def test_a_whole_answer_slower_than_the_clients_read_timeout_is_not_retried():
    """A non-streamed answer's headers come after its last token. The decode leg used the router
    client's read timeout (600 s), so a longer answer (an RL rollout of 16-32k tokens on a busy decode)
    was read as a failed decode: thrown away and run again from scratch on another, up to 3 times (a
    review, 2026-12-04). Here the client's timeout is 1 s, standing for 600, and a decode takes 1.5 s."""
    from pdserve.demo import free_port
    from pdserve.router.app import Router
    from pdserve.router.routes import build_router_app

    posts: list[str] = []
    pe_port, de_port, de2_port = free_port(), free_port(), free_port()
    servers = [
        _slow_engine(pe_port, "prefill", 0.0, posts),
        _slow_engine(de_port, "decode", 1.5, posts),
        _slow_engine(de2_port, "decode", 1.5, posts),
    ]

    async def go():
        decodes = [f"http://127.0.0.1:{p}" for p in (de_port, de2_port)]
        router = Router([f"http://127.0.0.1:{pe_port}"], decodes)
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(1.0, connect=5.0))
        await router.check_health()
        transport = httpx.ASGITransport(app=build_router_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=60) as c:
            r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 8})
        return r, dict(router.retries_by_side)

    try:
        r, retries = asyncio.run(go())
    finally:
        for s in servers:
            s.should_exit = True
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "a long answer"
    assert sorted(posts) == ["decode", "prefill"] and not any(retries.values())
