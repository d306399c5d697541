"""The engine thread's idle integrity checks: at every idle while they are cheap, spaced out once
they are not (they walk every page: ~11 ms at 50k pages)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine import async_engine
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine


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
