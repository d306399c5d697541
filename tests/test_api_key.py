"""`--api-key`: the routes of engines and router need `Authorization: Bearer <key>` (all but health,
metrics, version and the read-only PD routes); the router sends it to its engines (a new user missed
it, 2026-12-02, fourth session; SGLang's routes and weight updates were left open, fifth)."""

from __future__ import annotations

import asyncio

import httpx

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.router.app import Router
from pdserve.router.routes import build_router_app
from pdserve.server.api import build_app

KEY = "sk-test-123"


def _calls(app, calls):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [
                await c.request(method, path, headers=headers, json=body)
                for method, path, headers, body in calls
            ]

    return asyncio.run(go())


def test_an_engine_with_a_key_refuses_v1_requests_without_it(demo_model_dir):
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=256))
    app = build_app(engine, api_key=KEY)
    body = {"prompt": "hi", "max_tokens": 2}
    try:
        none, wrong, right, models, health = _calls(
            app,
            [
                ("POST", "/v1/completions", {}, body),
                ("POST", "/v1/completions", {"Authorization": "Bearer nope"}, body),
                ("POST", "/v1/completions", {"Authorization": f"Bearer {KEY}"}, body),
                ("GET", "/v1/models", {"Authorization": f"Bearer {KEY}"}, None),
                ("GET", "/health", {}, None),  # (open, as vLLM's)
            ],
        )
    finally:
        app.state.engine.shutdown()
    for r in (none, wrong):
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", r.text
    assert right.status_code == 200 and len(right.json()["choices"][0]["text"]) >= 0
    assert models.status_code == 200 and health.status_code == 200
    assert not engine.has_unfinished()  # (the refused requests never reached it)


def test_the_sglang_and_admin_routes_need_the_key_too_and_monitoring_does_not(demo_model_dir):
    """Only /v1 was guarded (vLLM's rule): with a key set, anyone reaching the port could still
    generate through `/generate`, abort every request, or make the engine load another checkpoint (a
    review of the HTTP surface). Guarded now as SGLang guards them; what monitors and the router poll
    stays open."""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=256))
    app = build_app(engine, api_key=KEY, enable_weight_updates=True)
    guarded = [
        ("POST", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
        ("POST", "/update_weights_from_disk", {"model_path": demo_model_dir}),
        ("POST", "/abort_request", {"abort_all": True}),
        ("POST", "/flush_cache", None),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("GET", "/get_model_info", None),
    ]
    opened = ["/health", "/metrics", "/version", "/pd/info"]
    try:
        answers = _calls(
            app,
            [(m, p, {}, b) for m, p, b in guarded]
            + [("GET", p, {}, None) for p in opened]
            + [("POST", "/generate", {"Authorization": f"Bearer {KEY}"}, guarded[0][2])],
        )
    finally:
        app.state.engine.shutdown()
    refused, open_, keyed = answers[: len(guarded)], answers[len(guarded) : -1], answers[-1]
    assert [r.status_code for r in refused] == [401] * len(guarded)
    assert [r.status_code for r in open_] == [200] * len(opened)
    assert keyed.status_code == 200 and engine.num_weight_updates == 0


def test_a_router_with_a_key_refuses_clients_without_it_and_sends_it_to_its_engines():
    router = Router(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], api_key=KEY)
    assert router.client.headers["authorization"] == f"Bearer {KEY}"  # on every call to an engine
    (none,) = _calls(build_router_app(router), [("GET", "/v1/models", {}, None)])
    assert none.status_code == 401, none.text
    assert Router(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]).client.headers.get("authorization") is None


def test_launch_hands_the_key_to_every_process_in_the_environment(monkeypatch):
    from pdserve.cli import _api_key, build_parser

    a = build_parser().parse_args(["router", "--prefill", "http://p", "--decode", "http://d"])
    assert _api_key(a) is None
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    assert _api_key(a) == KEY  # (what `pdserve launch` sets for its engines and router)
