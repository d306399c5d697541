"""The engine thread's idle integrity checks: at every idle while they are cheap, spaced out once
they are not (they walk every page: ~11 ms at 50k pages)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine import async_engine
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.llm_engine import LLMEngine
from tests.conftest import run_in_process, until


@pytest.mark.parametrize(("share", "expected"), [(1.0, 4), (0.001, 1)], ids=["cheap", "costly"])
def test_idle_checks_take_a_bounded_share_of_the_engine_thread(demo_model_dir, monkeypatch, share, expected):
    """A check that takes 50 ms of CPU: with a 100% share the next may run 50 ms later, so each of the
    four idles (0.2 s apart) gets one; with a 0.1% share the next waits 5 s (50 s, capped), so the
    later idles skip it."""
    monkeypatch.setattr(async_engine, "IDLE_CHECK_SHARE", share)
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=512))
    checks = []
    check = engine.check_integrity

    def costly_check():  # 50 ms of this thread's CPU (the cost is measured in thread time)
        start = time.thread_time()
        while time.thread_time() - start < 0.05:
            pass
        checks.append(1)
        check()

    monkeypatch.setattr(engine, "check_integrity", costly_check)
    aengine = AsyncEngine(engine)

    async def one(i: int) -> None:
        req, text = aengine.validate("def f(x):", SamplingParams(max_tokens=2), f"r{i}")
        async for _ in aengine.generate(req, text):
            pass

    async def run() -> None:
        for i in range(4):
            await one(i)
            await asyncio.sleep(0.2)  # idle long enough for a check that is due

    try:
        asyncio.run(run())
    finally:
        aengine.shutdown()
    assert len(checks) == expected


def test_an_output_reaches_its_stream_only_after_the_observers_counted_it(demo_model_dir):
    """A client that has its answer finds it in /metrics: the engine thread calls `on_step` before it
    hands the step's outputs to their streams. (It used to hand them over first: a finished-requests
    counter read right after an answer could lag it. The observer here is slow on purpose, which made
    the old order fail every time.)"""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=512))
    counted: list[tuple[str, int]] = []

    def slow_observer(_engine, outputs) -> None:
        time.sleep(0.05)
        counted.extend((o.request_id, len(o.outputs[0].token_ids)) for o in outputs)

    aengine = AsyncEngine(engine, on_step=slow_observer)

    async def run() -> list[bool]:
        req, text = aengine.validate("def f(x):", SamplingParams(max_tokens=3, ignore_eos=True), "r")
        seen = []
        async for out in aengine.generate(req, text):
            seen.append(("r", len(out.outputs[0].token_ids)) in counted)
        return seen

    try:
        seen = asyncio.run(run())
    finally:
        aengine.shutdown()
    assert seen == [True, True, True]


# ---- found by review: aborts lost before validation, a stream left open by shutdown ---------------
PROMPT_IDS = list(range(5, 45))
KW = dict(num_pages=128, max_model_len=1024, page_size=16)
LONG = 900  # tokens: far more than a test takes (an unaborted answer finishes "length")


def test_shutdown_ends_a_stream_in_flight(demo_model_dir):
    """`AsyncEngine.shutdown()` while a request streams: its caller must not wait forever (the engine
    thread's error path fails every waiter; a stop should too: an error or an "abort" final output)."""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)

    async def go():
        req, text = aengine.validate({"prompt_token_ids": PROMPT_IDS}, params, "r")
        outs: list = []

        async def consume():
            async for o in aengine.generate(req, text):
                outs.append(o)

        task = asyncio.create_task(consume())
        await until(lambda: len(outs) >= 1)
        await asyncio.to_thread(aengine.shutdown)
        assert not aengine._thread.is_alive()
        try:
            await asyncio.wait_for(task, 5)
        except EngineDeadError:
            return "ended with EngineDeadError"
        except TimeoutError:
            task.cancel()
            return "still waiting 5 s after shutdown"
        return f"ended: finished={outs[-1].finished}"

    try:
        result = asyncio.run(go())
    finally:
        aengine.shutdown()
    assert result != "still waiting 5 s after shutdown", result


def test_abort_all_during_chat_rendering_is_not_lost(demo_model_dir, monkeypatch):
    """A chat request is tokenized by `render_chat` (a worker thread) before `validate` reads the abort
    count. An `abort_all` that arrives meanwhile (the request is 'still being checked': tokenizing,
    architecture.md step 8) must end it with finish_reason "abort"."""
    from pdserve.server import api

    rendering, release = threading.Event(), threading.Event()
    real = api.render_chat

    def slow_render(*a, **kw):  # (a long chat: its template and tokenization take a while)
        out = real(*a, **kw)
        rendering.set()
        assert release.wait(30)
        return out

    monkeypatch.setattr(api, "render_chat", slow_render)
    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))

    async def scenario(c):
        body = {
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 40,
            "temperature": 0,
            "ignore_eos": True,
        }
        chat = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        await until(rendering.is_set)
        abort = await c.post("/abort_request", json={"abort_all": True})
        release.set()
        return abort.json(), (await chat).json()

    abort, chat = run_in_process(engine, scenario)
    assert abort["success"]
    assert chat["choices"][0]["finish_reason"] == "abort", (
        f"abort_all during chat rendering was lost: finish_reason={chat['choices'][0]['finish_reason']!r}, "
        f"{chat['usage']['completion_tokens']} tokens"
    )


def test_abort_all_while_validation_waits_for_a_worker_is_not_lost(demo_model_dir):
    """`validate` runs through `asyncio.to_thread`: while the default executor's workers are busy
    (other requests tokenizing long prompts), the request's check waits in the executor's queue
    and has not read the abort count yet. An `abort_all` then is lost: the request runs to the end."""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))
    release = threading.Event()

    async def scenario(c):
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        loop.set_default_executor(pool)
        busy = loop.run_in_executor(None, release.wait, 30)  # (another request's long tokenization)
        body = {"prompt": PROMPT_IDS, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        comp = asyncio.create_task(c.post("/v1/completions", json=body))
        await until(lambda: pool._work_queue.qsize() >= 1)  # (the handler queued its check behind `busy`)
        abort = await c.post("/abort_request", json={"abort_all": True})
        release.set()
        await busy
        return abort.json(), (await comp).json()

    abort, comp = run_in_process(engine, scenario)
    assert abort["success"]
    assert comp["choices"][0]["finish_reason"] == "abort", (
        f"abort_all while the check was queued was lost: finish_reason={comp['choices'][0]['finish_reason']!r}"
    )


def test_a_reserved_id_is_released_when_its_request_was_aborted_while_checked(demo_model_dir):
    """`reserve` holds an id "until it is streamed (or unreserve)". `generate()` of a request an
    abort named while it was checked answers "abort" at once, but returns before `unreserve`: the id
    stays active, and every later request with it is refused. (server/api.py's generate_one unreserves
    itself before `generate`, so the HTTP routes are not affected; direct callers are.)"""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def go():
        req, text = aengine.validate({"prompt_token_ids": PROMPT_IDS}, params, "rid-x")
        aengine.reserve(req)
        await aengine.abort_now("rid-x")
        outs = [o async for o in aengine.generate(req, text)]
        return outs, aengine.is_active("rid-x")

    try:
        outs, still_active = asyncio.run(go())
    finally:
        aengine.shutdown()
    assert outs[-1].outputs[0].finish_reason == "abort"
    assert not still_active, "the aborted request's id is still reserved after its stream ended"


def test_a_caller_that_stops_reading_holds_one_output_not_one_per_step(demo_model_dir):
    """Outputs are cumulative (each holds the whole text so far). A streaming client that stops reading
    (its socket full: uvicorn's send waits) left every step's output queued: O(tokens^2) memory,
    2.6 MB of text for a 1,000-token answer (a review, 2026-12-04). An unread output that is not final
    is now replaced by the next one; the reader then gets the newest, and the final one, in order."""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=256, max_model_len=1024))
    aengine = AsyncEngine(engine)

    async def run():
        req, text = aengine.validate(
            [5, 6, 7], SamplingParams(max_tokens=300, ignore_eos=True), "slow-reader"
        )
        stream = aengine.generate(req, text)
        first = await stream.__anext__()
        await until(lambda: not engine.requests)  # the engine finished while nobody read
        box = aengine._streams["slow-reader"][1]
        held, replaced = len(box), box.num_replaced
        rest = [out async for out in stream]
        return first, held, replaced, rest

    try:
        first, held, replaced, rest = asyncio.run(run())
    finally:
        aengine.shutdown()
    assert len(first.outputs[0].token_ids) < 300
    assert held == 1 and replaced > 200  # (the final output alone: it replaced every unread one)
    assert len(rest) == 1 and rest[0].finished and len(rest[0].outputs[0].token_ids) == 300


def test_an_output_box_never_replaces_an_error_or_the_final_output():
    from pdserve.engine.async_engine import OutputBox
    from pdserve.outputs import CompletionOutput, RequestOutput

    def out(n: int, finished: bool = False) -> RequestOutput:
        completion = CompletionOutput(0, "x" * n, [2] * n, None, "length" if finished else None)
        return RequestOutput("r", None, [1], [completion], finished, 0)

    async def run():
        box = OutputBox()
        error = RuntimeError("peer gone")
        for item in (out(1), out(2), error, out(3), out(4, finished=True), out(5)):
            box.put(item)
        return [await box.get() for _ in range(len(box))]

    got = asyncio.run(run())
    assert [
        type(g).__name__ if isinstance(g, BaseException) else len(g.outputs[0].token_ids) for g in got
    ] == [
        2,
        "RuntimeError",
        4,
        5,
    ]


def test_an_id_whose_caller_left_is_not_reused_before_its_request_ended(demo_model_dir, monkeypatch):
    """A `/generate` whose client left mid-stream, retried at once under its rid: the id was free as
    soon as the stream was dropped, while the step already running still held the old request, so
    the retry's stream got the old request's outputs (its prompt, its tokens) and its own request ran
    on unread (14 of 15 trials on a busy server: a review, 2026-12-05). The id stays active until the
    engine thread has ended the old request; a retry that waits for it gets its own answer."""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=128, max_model_len=512))
    real_step = engine.step

    def slow_step():
        time.sleep(0.05)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    aengine = AsyncEngine(engine)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def answer(prompt: str, rid: str):
        req, text = aengine.validate(prompt, greedy, rid)
        return [out async for out in aengine.generate(req, text)][-1]

    async def run():
        want = await answer("import os\n", "ref")
        old, text = aengine.validate(
            "def f(x):", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), "R"
        )
        stream = aengine.generate(old, text)
        for _ in range(2):
            await anext(stream)
        await stream.aclose()  # the client left (the engine is mid-step)
        assert aengine.is_active("R")
        retry, text = aengine.validate("import os\n", greedy, "R")
        assert await aengine.earlier_attempt_ended("R", retry)
        assert not aengine.is_active("R")
        outs = [out async for out in aengine.generate(retry, text)]
        return want, outs

    try:
        want, outs = asyncio.run(run())
    finally:
        aengine.shutdown()
    assert all(o.prompt_token_ids == want.prompt_token_ids for o in outs)
    assert outs[-1].outputs[0].token_ids == want.outputs[0].token_ids and outs[-1].finished
    assert not engine.requests
