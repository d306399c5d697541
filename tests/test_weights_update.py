"""`POST /update_weights_from_disk` (an RL trainer's new checkpoint into a running engine) and
`POST /reset_prefix_cache`, through the app in process: outputs switch to the new weights exactly
(the same tokens as an engine loaded from them), the prefix cache computed with the old weights is
dropped, a checkpoint of another shape is refused with nothing changed, and requests in flight either
block the update (409) or are aborted by it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.demo import make_demo_model
from pdserve.server.api import build_app

PROMPT = "def handler(request, context):\n    return process(request.body)\n" * 3
KW = dict(num_pages=128, max_model_len=1024, page_size=16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Same shape, other weights (seed 1): the trainer's next checkpoint; and a different shape."""
    root = tmp_path_factory.mktemp("ckpts")
    a = make_demo_model(root / "a", seed=0)
    b = make_demo_model(root / "b", seed=1)
    wide = make_demo_model(root / "wide", seed=0, hidden_size=320)
    return str(a), str(b), str(wide)


def greedy_ref(model_dir: str, n: int = 12) -> str:
    llm = LLM(model_dir, dtype="float32", **KW)
    return (
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].text
    )


def completion(c: httpx.AsyncClient, n: int = 12, **kw):
    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True} | kw
    return c.post("/v1/completions", json=body)


def run(engine: LLMEngine, scenario):
    app = build_app(engine)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return await scenario(c)

    try:
        return asyncio.run(go())
    finally:
        app.state.engine.shutdown()


def test_new_weights_serve_exactly_what_an_engine_loaded_from_them_does(checkpoints):
    a, b, wide = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        before = (await completion(c)).json()["choices"][0]["text"]
        refused = await c.post("/update_weights_from_disk", json={"model_path": wide})
        unchanged = (await completion(c)).json()["choices"][0]["text"]
        missing = await c.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
        extra = await c.post("/update_weights_from_disk", json={"model_path": b, "flush": 1})
        updated = await c.post("/update_weights_from_disk", json={"model_path": b})
        after = (await completion(c)).json()["choices"][0]["text"]
        reset = await c.post("/reset_prefix_cache")
        return before, refused, unchanged, missing, extra, updated, after, reset

    before, refused, unchanged, missing, extra, updated, after, reset = run(engine, scenario)
    assert before == greedy_ref(a)
    assert refused.status_code == 400 and "shape" in refused.json()["error"]["message"]
    assert unchanged == before  # a refused checkpoint changed nothing
    assert missing.status_code == 400 and extra.status_code == 400
    assert updated.status_code == 200, updated.text
    info = updated.json()
    assert info["success"] and info["num_weight_updates"] == 1
    assert info["num_cached_pages_dropped"] > 0  # the old weights' prompt pages went
    assert after == greedy_ref(b) and after != before
    assert reset.status_code == 200 and reset.json()["num_cached_pages_dropped"] > 0
    engine.check_integrity()
    assert engine.kv.pool.num_used_pages == 0


def test_requests_in_flight_block_the_update_or_are_aborted_by_it(checkpoints):
    a, b, _ = checkpoints
    engine = LLMEngine(EngineConfig.create(a, dtype="float32", **KW))

    async def scenario(c):
        long = asyncio.ensure_future(completion(c, n=600))
        for _ in range(500):  # until the engine holds it
            if engine.requests:
                break
            await asyncio.sleep(0.01)
        busy = await c.post("/update_weights_from_disk", json={"model_path": b})
        forced = await c.post("/update_weights_from_disk", json={"model_path": b, "abort_running": True})
        return busy, forced, await long

    busy, forced, long = run(engine, scenario)
    assert busy.status_code == 409 and "in flight" in busy.json()["error"]["message"]
    assert forced.status_code == 200 and forced.json()["num_requests_aborted"] == 1
    assert long.status_code == 200 and long.json()["choices"][0]["finish_reason"] == "abort"
    assert engine.kv.pool.num_used_pages == 0 and not engine.requests
    engine.check_integrity()
