"""Pausing generation around an RL weight update: SGLang's `/pause_generation` (modes abort,
in_place, retract) and `/continue_generation`, vLLM's `/pause` (abort, wait, keep), `/resume` and
`/is_paused`, through one engine's app in process. New requests wait while paused and never reach
the engine; requests in flight end as aborts, stay frozen with their pages, give their pages back and
are recomputed (by the new weights when an update came meanwhile: to the token), or finish first."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import RequestStatus
from pdserve.model.demo import make_demo_model
from tests.conftest import run_in_process, until

PROMPT = "def handler(request, context):\n    return process(request.body)\n" * 3
KW = dict(num_pages=128, max_model_len=1024, page_size=16)
HELD_S = 0.3  # how long a test watches that nothing moves while paused


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two checkpoints of one shape (the trainer's step before and after)."""
    root = tmp_path_factory.mktemp("pause_ckpts")
    return str(make_demo_model(root / "a", seed=0)), str(make_demo_model(root / "b", seed=1))


def engine_of(model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig.create(model_dir, dtype="float32", **KW))


def greedy_ids(model_dir: str, prompt, n: int) -> list[int]:
    llm = LLM(model_dir, dtype="float32", **KW)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return list(llm.generate(prompt, params)[0].outputs[0].token_ids)


def completion(c, n: int, prompt=PROMPT):
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return c.post("/v1/completions", json=body)


def ids_of(r) -> list[int]:
    return r.json()["choices"][0]["token_ids"]


def the_request(engine: LLMEngine):
    (req,) = engine.requests.values()
    return req


async def started(engine: LLMEngine, num_tokens: int = 3) -> None:
    """Until the engine's one request has generated `num_tokens`."""
    await until(lambda: len(engine.requests) == 1 and the_request(engine).num_output_tokens >= num_tokens)


def run(engine, scenario):
    return run_in_process(engine, scenario, enable_weight_updates=True)


def test_pause_abort_ends_what_runs_and_holds_new_requests_until_continue(checkpoints):
    a, _ = checkpoints
    engine = engine_of(a)

    async def scenario(c):
        long = asyncio.ensure_future(completion(c, 500))
        await started(engine)
        paused = await c.post("/pause_generation", json={})
        aborted = await long
        held = asyncio.ensure_future(completion(c, 8))
        await asyncio.sleep(HELD_S)
        waiting = (held.done(), len(engine.requests), (await c.get("/is_paused")).json())
        resumed = await c.post("/continue_generation", json={})
        return paused, aborted, waiting, resumed, await held, (await c.get("/is_paused")).json()

    paused, aborted, waiting, resumed, held, after = run(engine, scenario)
    assert paused.status_code == 200, paused.text
    assert paused.json() == {
        "message": "Generation paused successfully.",
        "status": "ok",
        "num_requests_aborted": 1,
    }
    choice = aborted.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 500
    assert waiting == (False, 0, {"is_paused": True})  # the new one never reached the engine
    assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
    assert ids_of(held) == greedy_ids(a, PROMPT, 8) and after == {"is_paused": False}
    assert engine.kv.pool.num_free_pages == engine.kv.pool.num_pages
    engine.check_integrity()


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_a_frozen_or_retracted_request_goes_on_to_the_same_tokens(checkpoints, mode):
    """Paused mid-answer, nothing moves; on continue the answer is the one an unpaused run gives (a
    retracted request was recomputed from its pages in the prefix cache)."""
    a, _ = checkpoints
    engine = engine_of(a)

    async def scenario(c):
        answer = asyncio.ensure_future(completion(c, 200))  # (room for the steps before the pause)
        await started(engine)
        paused = await c.post("/pause_generation", json={"mode": mode})
        req = the_request(engine)
        at_pause = (req.num_output_tokens, list(req.page_ids), req.status, req.num_preemptions)
        await asyncio.sleep(HELD_S)
        still = (req.num_output_tokens, list(req.page_ids), answer.done())
        engine.check_integrity()  # (the engine thread's idle checks run meanwhile too)
        await c.post("/continue_generation")
        return paused, at_pause, still, await answer

    paused, at_pause, still, answer = run(engine, scenario)
    num_tokens, pages, status, num_preemptions = at_pause
    assert paused.status_code == 200 and paused.json()["num_requests_retracted"] == (mode == "retract")
    assert 3 <= num_tokens < 200
    if mode == "in_place":  # frozen with its pages
        assert pages and status == RequestStatus.RUNNING and num_preemptions == 0
    else:  # its pages given back, queued again
        assert pages == [] and status == RequestStatus.WAITING and num_preemptions == 1
    assert still == (num_tokens, pages, False)
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert ids_of(answer) == greedy_ids(a, PROMPT, 200)
    engine.check_integrity()


def test_retract_then_update_recomputes_with_the_new_weights_exactly(checkpoints):
    """SGLang's retract + update: the request's tokens so far are kept, its KV is recomputed by the
    new weights, which generate the rest -- the tokens of the new model given that text."""
    a, b = checkpoints
    engine = engine_of(a)

    async def scenario(c):
        answer = asyncio.ensure_future(completion(c, 200))  # (room for the steps before the pause)
        await started(engine, 5)
        await c.post("/pause_generation", json={"mode": "retract"})
        so_far = list(the_request(engine).output_token_ids)
        updated = await c.post("/update_weights_from_disk", json={"model_path": b, "keep_pause": True})
        await asyncio.sleep(HELD_S)  # (keep_pause: still retracted after the update)
        kept = (the_request(engine).num_output_tokens, answer.done())
        await c.post("/continue_generation")
        done = await answer
        same = done.json()["choices"][0]["prompt_token_ids"] + ids_of(done)
        again = await c.post("/v1/completions", json={"prompt": same, "max_tokens": 1, "temperature": 0})
        return so_far, updated, kept, done, again

    so_far, updated, kept, answer, again = run(engine, scenario)
    assert updated.status_code == 200, updated.text
    assert updated.json()["num_paused_requests"] == 1 and updated.json()["num_requests_aborted"] == 0
    assert kept == (len(so_far), False)
    assert so_far == greedy_ids(a, PROMPT, len(so_far))
    prompt_ids = LLM(a, dtype="float32", **KW).get_tokenizer().encode(PROMPT)
    rest = greedy_ids(b, {"prompt_token_ids": prompt_ids + so_far}, 200 - len(so_far))
    assert ids_of(answer) == so_far + rest
    # Recomputed by the new weights alone, its pages are the new weights' cache (keyed from their root)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    engine.check_integrity()


def test_in_place_update_goes_on_and_never_offers_its_mixed_pages(checkpoints):
    """SGLang's in-place update: the frozen request keeps the pages the old weights computed and
    goes on under the new ones (without keep_pause: at once, while new requests still wait). The
    pages it completes then mix both weights' KV: no other request may hit them."""
    a, b = checkpoints
    # Pages of 128 tokens: the request's first page is completed only after the update (it is paused
    # within its first tokens), so nothing but `publish_pages` keeps it from the new weights' cache.
    engine = LLMEngine(
        EngineConfig.create(a, dtype="float32", num_pages=64, max_model_len=1024, page_size=128)
    )
    short = "x = 1"

    async def scenario(c):
        answer = asyncio.ensure_future(completion(c, 200, short))
        await started(engine, 1)
        await c.post("/pause_generation", json={"mode": "in_place"})
        at_pause = the_request(engine).num_output_tokens
        updated = await c.post("/update_weights_from_disk", json={"model_path": b})
        done = await answer  # (no keep_pause: it finishes before /continue_generation)
        held = asyncio.ensure_future(completion(c, 4))
        await asyncio.sleep(HELD_S)
        waiting = held.done()
        await c.post("/continue_generation")
        await held
        same = done.json()["choices"][0]["prompt_token_ids"] + ids_of(done)
        again = await c.post("/v1/completions", json={"prompt": same, "max_tokens": 1, "temperature": 0})
        return at_pause, updated, done, waiting, again

    at_pause, updated, done, waiting, again = run(engine, scenario)
    num_prompt_tokens = len(done.json()["choices"][0]["prompt_token_ids"])
    assert num_prompt_tokens + at_pause < 128  # (its first page was completed after the update)
    assert updated.status_code == 200 and updated.json()["num_paused_requests"] == 1
    assert done.json()["choices"][0]["finish_reason"] == "length"
    assert waiting is False
    assert again.json()["usage"]["prompt_tokens"] == num_prompt_tokens + 200
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    engine.check_integrity()


def test_vllm_pause_wait_lets_running_requests_finish_then_holds_new_ones(checkpoints):
    a, _ = checkpoints
    engine = engine_of(a)

    async def scenario(c):
        answer = asyncio.ensure_future(completion(c, 40))
        await started(engine)
        paused = await c.post("/pause", params={"mode": "wait"})
        # (the engine has finished it when the pause answers: not `answer.done()`, which waits for
        # the client's reading of the answer too, as AsyncEngine.pause says)
        finished_first = (len(engine.requests), engine.has_unfinished())
        held = asyncio.ensure_future(completion(c, 8))
        await asyncio.sleep(HELD_S)
        waiting = (held.done(), (await c.get("/is_paused")).json())
        keep = await c.post("/pause", params={"mode": "keep"})  # (pausing a paused engine)
        resumed = await c.post("/resume")
        return paused, finished_first, await answer, waiting, keep, resumed, await held

    paused, finished_first, answer, waiting, keep, resumed, held = run(engine, scenario)
    assert paused.json() == {"status": "paused"} and finished_first == (0, False)
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert ids_of(answer) == greedy_ids(a, PROMPT, 40)
    assert waiting == (False, {"is_paused": True})
    assert keep.json() == {"status": "paused"} and resumed.json() == {"status": "resumed"}
    assert ids_of(held) == greedy_ids(a, PROMPT, 8)


def test_bad_pause_bodies_are_refused_and_change_nothing(demo_engine):
    async def scenario(c):
        out = [
            await c.post("/pause_generation", json={"mode": "sideways"}),
            await c.post("/pause_generation", json={"mode": "abort", "extra": 1}),
            await c.post(
                "/pause_generation", content=b"{not json", headers={"content-type": "application/json"}
            ),
            await c.post("/pause", params={"mode": "freeze"}),
        ]
        return out, (await c.get("/is_paused")).json(), await completion(c, 2)

    refused, paused, answer = run_in_process(demo_engine, scenario)
    assert [r.status_code for r in refused] == [400] * 4
    assert (
        "mode" in refused[0].json()["error"]["message"] and "extra" in refused[1].json()["error"]["message"]
    )
    assert "abort, wait or keep" in refused[3].json()["error"]["message"]
    assert paused == {"is_paused": False} and answer.status_code == 200


def test_a_request_that_leaves_while_paused_releases_its_id(demo_engine):
    """Its caller gone while it waits at the pause: the id it held is free again, nothing reached
    the engine."""
    from pdserve.engine.async_engine import AsyncEngine

    aengine = AsyncEngine(demo_engine)

    async def scenario():
        await aengine.pause("abort")
        req, text = aengine.validate("hello", SamplingParams(max_tokens=2), request_id="rid-1")
        aengine.reserve(req)

        async def consume():
            async for _ in aengine.generate(req, text):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        held = aengine.is_active("rid-1")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return held, aengine.is_active("rid-1"), len(demo_engine.requests)

    try:
        assert asyncio.run(scenario()) == (True, False, 0)
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_continue_sent_before_the_pause_answered_never_leaves_the_engine_frozen(checkpoints, mode):
    """A trainer's continue overtaking its own pause (found by review: the pause's hold, queued for
    the engine thread, ran after the continue and froze the engine for good)."""
    a, _ = checkpoints
    engine = engine_of(a)

    async def scenario(c):
        answer = asyncio.ensure_future(completion(c, 60))
        await started(engine)
        pausing = asyncio.ensure_future(c.post("/pause_generation", json={"mode": mode}))
        for _ in range(3):
            await asyncio.sleep(0)
        resumed = await c.post("/continue_generation")
        paused = await pausing
        done = await asyncio.wait_for(answer, 30)
        later = await asyncio.wait_for(completion(c, 4), 30)
        return resumed, paused, done, later, (await c.get("/is_paused")).json()

    resumed, paused, done, later, is_paused = run(engine, scenario)
    assert resumed.status_code == 200 and paused.status_code in (200, 409), paused.text
    assert done.json()["choices"][0]["finish_reason"] == ("abort" if mode == "abort" else "length")
    assert later.json()["choices"][0]["finish_reason"] == "length" and is_paused == {"is_paused": False}
    engine.check_integrity()


def test_a_second_abort_pause_spares_the_requests_waiting_for_the_pause(checkpoints):
    """Pausing a paused engine again (mode abort) ends what runs, not the requests that came during
    the pause and wait for its end (found by review: those ended "abort" with no token)."""
    a, _ = checkpoints
    engine = engine_of(a)

    async def scenario(c):
        await c.post("/pause_generation", json={})
        held = asyncio.ensure_future(completion(c, 8))
        await asyncio.sleep(HELD_S)
        again = await c.post("/pause_generation", json={"mode": "abort"})
        vllm = await c.post("/pause", params={"mode": "abort", "clear_cache": "false"})
        await c.post("/continue_generation")
        return again, vllm, await held

    again, vllm, held = run(engine, scenario)
    assert again.json()["num_requests_aborted"] == 0 and vllm.status_code == 200
    assert held.json()["choices"][0]["finish_reason"] == "length"
    assert ids_of(held) == greedy_ids(a, PROMPT, 8)


def test_pause_wait_returns_once_the_engine_has_finished_not_its_readers(demo_engine):
    """A caller that stopped reading its stream (a slow SSE client) does not hold up a "wait" pause:
    the engine finished its request (found by review: the pause waited for the reader)."""
    from pdserve.engine.async_engine import AsyncEngine

    aengine = AsyncEngine(demo_engine)

    async def scenario():
        req, text = aengine.validate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))
        stream = aengine.generate(req, text)
        await stream.__anext__()  # (one output read, then the reader stalls)
        num = await asyncio.wait_for(aengine.pause("wait"), 30)
        finished = not demo_engine.requests
        aengine.resume()
        await stream.aclose()
        return num, finished

    try:
        assert asyncio.run(scenario()) == (0, True)
    finally:
        aengine.shutdown()


def test_a_request_waiting_for_the_pause_ends_when_the_engine_stops(demo_engine):
    from pdserve.engine.async_engine import AsyncEngine, EngineDeadError

    aengine = AsyncEngine(demo_engine)

    async def scenario():
        await aengine.pause("abort")
        req, text = aengine.validate("hello", SamplingParams(max_tokens=2))

        async def consume():
            async for _ in aengine.generate(req, text):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        aengine.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 5)

    asyncio.run(scenario())


def test_gauges_follow_an_abort_while_paused(checkpoints):
    """Requests a pause froze, then aborted: the engine's gauges show them gone while it is still
    paused (found by a live audit: they kept showing the frozen requests and their pages until the
    next request, since no step ran to refresh them)."""
    a, _ = checkpoints
    engine = engine_of(a)

    def gauge(text: str, name: str) -> float:
        (line,) = [x for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name + "{")]
        return float(line.rsplit(" ", 1)[1])

    async def scenario(c):
        answer = asyncio.ensure_future(completion(c, 300))
        await started(engine)
        await c.post("/pause_generation", json={"mode": "in_place"})
        frozen = (await c.get("/metrics")).text
        await c.post("/abort_request", json={"abort_all": True})
        await answer
        for _ in range(200):
            text = (await c.get("/metrics")).text
            if gauge(text, "pdserve_kv_pages_used") == 0:
                break
            await asyncio.sleep(0.01)
        await c.post("/continue_generation")
        return frozen, text

    frozen, after = run(engine, scenario)
    assert gauge(frozen, "pdserve_num_requests_running") == 1 and gauge(frozen, "pdserve_kv_pages_used") > 0
    assert gauge(after, "pdserve_num_requests_running") == 0 and gauge(after, "pdserve_kv_pages_used") == 0


def test_a_request_held_by_a_pause_answers_an_abort_at_once_and_is_counted(checkpoints):
    """Paused; a request waits for the pause's end; everything is aborted (as a server shutting down
    does). The held request saw the abort only once the pause ended: at shutdown, never, and its
    client got no answer when the grace period ran out; nor was its abort counted in /metrics (a
    review, 2026-12-05). It answers "abort" now, counted once."""
    a = checkpoints[0]
    engine = engine_of(a)

    def aborts(text: str) -> float:
        line = next(
            (
                x
                for x in text.splitlines()
                if x.startswith('pdserve_requests_finished_total{finish_reason="abort"')
            ),
            None,
        )
        return float(line.split()[-1]) if line else 0.0

    async def scenario(c):
        before = aborts((await c.get("/metrics")).text)
        assert (await c.post("/pause_generation", json={})).status_code == 200
        held = asyncio.ensure_future(completion(c, 8))
        await until(lambda: c._transport.app.state.engine.num_held == 1)
        assert (await c.post("/abort_request", json={"abort_all": True})).status_code == 200
        answer = await asyncio.wait_for(held, 5.0)  # (still paused)
        still_paused = (await c.get("/is_paused")).json()
        await asyncio.sleep(0.1)  # (counted on the engine thread)
        after = aborts((await c.get("/metrics")).text)
        await c.post("/continue_generation", json={})
        return answer, still_paused, after - before

    answer, still_paused, counted = run(engine, scenario)
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "abort"
    assert still_paused == {"is_paused": True} and counted == 1
