"""An idle engine gives its memory back while a trainer colocated with it trains: vLLM's `/sleep`,
`/wake_up`, `/is_sleeping` and SGLang's `/release_memory_occupation`, `/resume_memory_occupation`,
through one engine's app in process. The buffers are really freed; requests meanwhile are a 503
that says why; once woken the engine answers to the token as before (weights freed are loaded again
from the checkpoint served, or the trainer's next one)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.demo import make_demo_model
from tests.conftest import run_in_process, until
from tests.test_pause import KW, PROMPT, completion, engine_of, greedy_ids, ids_of


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sleep_ckpts")
    return str(make_demo_model(root / "a", seed=0)), str(make_demo_model(root / "b", seed=1))


def num_param_elements(engine: LLMEngine) -> int:
    return sum(p.numel() for p in engine.runner.model.parameters())


def run(engine, scenario):
    return run_in_process(engine, scenario, enable_weight_updates=True)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_refuses_requests_and_wakes_to_the_same_answers(checkpoints, level):
    a, _ = checkpoints
    engine = engine_of(a)
    full = num_param_elements(engine)

    async def scenario(c):
        before = await completion(c, 8)
        slept = await c.post("/sleep", params={"level": level})
        state = (
            (await c.get("/is_sleeping")).json(),
            engine.runner.kv_cache.k == [],
            num_param_elements(engine),
            engine.kv.pool.num_cached_pages,
        )
        refused = await completion(c, 8)
        health = await c.get("/health_generate")
        woken = await c.post("/wake_up")
        after = await completion(c, 8)
        return before, slept, state, refused, health, woken, after, (await c.get("/is_sleeping")).json()

    before, slept, state, refused, health, woken, after, awake = run(engine, scenario)
    assert slept.json() == {"status": "sleeping", "level": level}
    is_sleeping, kv_freed, num_elements, num_cached = state
    assert is_sleeping == {"is_sleeping": True} and kv_freed and num_cached == 0
    # level 1 keeps the weights in host memory, where a CPU engine's are already; level 2 frees them
    assert num_elements == (full if level == 1 else 0)
    assert refused.status_code == 503 and "/wake_up" in refused.json()["error"]["message"]
    assert health.status_code == 503
    assert woken.json()["status"] == "awake" and awake == {"is_sleeping": False}
    assert ids_of(after) == ids_of(before) == greedy_ids(a, PROMPT, 8)
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # (the cache went)
    assert num_param_elements(engine) == full
    engine.check_integrity()


def test_sglang_release_then_update_then_resume_serves_the_new_weights(checkpoints):
    """slime's colocated step: release everything, train, resume the weights, push the new
    checkpoint, resume the KV cache. An update while the weights are released is refused."""
    a, b = checkpoints
    engine = engine_of(a)

    async def scenario(c):
        released = await c.post("/release_memory_occupation", json={"tags": None})
        too_soon = await c.post("/update_weights_from_disk", json={"model_path": b})
        weights = await c.post("/resume_memory_occupation", json={"tags": ["weights"]})
        updated = await c.post("/update_weights_from_disk", json={"model_path": b})
        still = await completion(c, 8)
        kv = await c.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]})
        return released, too_soon, weights, updated, still, kv, await completion(c, 8)

    released, too_soon, weights, updated, still, kv, after = run(engine, scenario)
    assert released.json()["success"] and "kv_cache, weights" in released.json()["message"]
    assert too_soon.status_code == 409 and "released" in too_soon.text
    assert weights.json()["success"] and updated.status_code == 200, updated.text
    assert still.status_code == 503  # (the KV cache is still released)
    assert kv.json()["success"] and ids_of(after) == greedy_ids(b, PROMPT, 8)
    engine.check_integrity()


def test_a_busy_engine_keeps_its_memory_and_bad_input_changes_nothing(checkpoints):
    a, _ = checkpoints
    engine = engine_of(a)

    async def scenario(c):
        answer = asyncio.ensure_future(completion(c, 200))
        await until(lambda: engine.requests)
        busy = await c.post("/sleep")
        bad = [
            await c.post("/sleep", params={"level": 3}),
            await c.post("/release_memory_occupation", json={"tags": ["gpu"]}),
            await c.post("/release_memory_occupation", json={"tags": "weights"}),
            await c.post("/wake_up", params={"tags": "everything"}),
        ]
        await c.post("/abort_request", json={"abort_all": True})
        await answer
        return busy, bad, engine.released, engine.runner.kv_cache.k != []

    busy, bad, released, kv_kept = run(engine, scenario)
    assert busy.status_code == 409 and "in flight" in busy.json()["error"]["message"]
    assert [r.status_code for r in bad] == [400] * 4
    assert released == set() and kv_kept


def test_a_weights_release_drops_the_prefix_cache_of_a_checkpoint_rewritten_in_place(tmp_path):
    """A trainer that rewrites one checkpoint directory every step, releasing the weights meanwhile:
    they come back from disk as the new checkpoint, and no prefix page the old weights computed is
    served under them (found by review: the cache and its keys outlived the release)."""
    import shutil

    path = make_demo_model(tmp_path / "step", seed=0)
    engine = engine_of(str(path))
    nxt = make_demo_model(tmp_path / "next", seed=1)

    async def scenario(c):
        await completion(c, 8)  # (the prompt's pages cached under the first weights)
        released = await c.post("/release_memory_occupation", json={"tags": ["weights"]})
        for f in nxt.iterdir():  # (the trainer's next step, written over the same directory)
            shutil.copy(f, path / f.name)
        await c.post("/resume_memory_occupation", json={"tags": ["weights"]})
        return released, await completion(c, 8)

    released, after = run(engine, scenario)
    assert released.json()["success"]
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert ids_of(after) == greedy_ids(str(nxt), PROMPT, 8)


def test_offline_llm_sleeps_and_wakes_as_vllms(checkpoints):
    from pdserve import LLM, SamplingParams
    from pdserve.engine.llm_engine import EngineAsleep

    a, _ = checkpoints
    llm = LLM(a, dtype="float32", **KW)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    before = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    llm.sleep(level=2)
    with pytest.raises(EngineAsleep):
        llm.generate(PROMPT, params)
    llm.wake_up(["weights"])
    llm.wake_up()
    assert llm.generate(PROMPT, params)[0].outputs[0].token_ids == before


def test_a_resume_whose_checkpoint_is_gone_gives_the_memory_back_and_waits_for_an_update(
    checkpoints, tmp_path
):
    """slime keeps only its newest checkpoint: release everything, the trainer deletes the served
    step, resume the weights -- the reload from disk fails. That resume was a 503, which slime takes
    as fatal, though SGLang's resume only gives memory back (the next update loads the weights). Now
    it answers success, says why, and the engine refuses requests until the update (a review,
    2026-12-04)."""
    import shutil

    a, b = checkpoints
    served = shutil.copytree(a, tmp_path / "step1")
    engine = engine_of(str(served))

    async def scenario(c):
        await c.post("/release_memory_occupation", json={})
        shutil.rmtree(served)
        weights = await c.post("/resume_memory_occupation", json={"tags": ["weights"]})
        kv = await c.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
        refused = await completion(c, 4)
        updated = await c.post("/update_weights_from_disk", json={"model_path": b})
        return weights, kv, refused, updated, await completion(c, 8)

    weights, kv, refused, updated, after = run(engine, scenario)
    assert weights.status_code == 200 and weights.json()["success"]
    assert "requests are refused until /update_weights_from_disk" in weights.json()["message"]
    assert kv.status_code == 200 and refused.status_code == 503
    assert updated.status_code == 200 and ids_of(after) == greedy_ids(b, PROMPT, 8)
    engine.check_integrity()
