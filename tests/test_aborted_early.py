"""Answers of requests aborted while they waited, before their prompt ran: nothing was computed for
them, and every answer must still be well formed (a review of the server layer, 2026-12-04: one was
a 500, one reported a length finish, one counted -1 completion tokens)."""

from __future__ import annotations

import asyncio

import httpx

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.server.api import build_app
from tests.conftest import until


def aborted_while_queued(demo_model_dir, path: str, body: dict) -> httpx.Response:
    """One long request fills the engine (max_num_seqs 1); `body` (rid or request_id "victim") waits in
    the scheduler's queue until /abort_request names it. Returns its answer."""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=128, max_model_len=1024, max_num_seqs=1))
    app = build_app(engine)

    async def scenario():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            hog_body = {
                "input_ids": [5] * 8,
                "rid": "hog",
                "sampling_params": {"max_new_tokens": 600, "ignore_eos": True},
            }
            hog = asyncio.create_task(c.post("/generate", json=hog_body))
            await until(lambda: len(engine.scheduler.running) == 1)
            victim = asyncio.create_task(c.post(path, json=body))
            await until(lambda: len(engine.scheduler.waiting) == 1)
            aborted = await c.post("/abort_request", json={"rid": "victim"})
            assert aborted.json()["num_requests_aborted"] == 1, aborted.text
            answer = await victim
            await c.post("/abort_request", json={"abort_all": True})
            await hog
            return answer

    try:
        return asyncio.run(scenario())
    finally:
        app.state.engine.shutdown()


def test_generate_input_logprobs_of_an_unrun_prompt_are_null(demo_model_dir):
    """`return_logprob` with `logprob_start_len` 0: the output's prompt logprobs hold only the first
    position's None, and every other position was indexed: IndexError, a 500 (streamed: cut without
    [DONE]). The positions never scored are now null, as the OpenAI routes pad them."""
    ids = [7] * 40
    r = aborted_while_queued(
        demo_model_dir,
        "/generate",
        {
            "input_ids": ids,
            "rid": "victim",
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 4},
        },
    )
    assert r.status_code == 200, r.text[:300]
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["input_token_logprobs"] == [[None, 7, None]] * len(ids)
    assert meta["input_top_logprobs"] == [None] * len(ids)


def test_generate_scoring_aborted_reports_the_abort(demo_model_dir):
    """`max_new_tokens` 0 (the prompt's logprobs alone): the answer always said finish_reason length."""
    r = aborted_while_queued(
        demo_model_dir,
        "/generate",
        {"input_ids": [7] * 40, "rid": "victim", "sampling_params": {"max_new_tokens": 0}},
    )
    assert r.status_code == 200, r.text[:300]
    assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert r.json()["meta_info"]["completion_tokens"] == 0


def test_echo_scoring_aborted_counts_no_completion_tokens(demo_model_dir):
    """`echo` with `max_tokens` 0 runs one token the answer drops; aborted before it ran, the usage
    counted -1 completion tokens."""
    r = aborted_while_queued(
        demo_model_dir,
        "/v1/completions",
        {"prompt": [7] * 40, "request_id": "victim", "echo": True, "logprobs": 1, "max_tokens": 0},
    )
    assert r.status_code == 200, r.text[:300]
    assert r.json()["choices"][0]["finish_reason"] == "abort"
    assert r.json()["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": 40,
        "completion_tokens": 0,
        "total_tokens": 40,
        "prompt_tokens_details": None,
    }


def test_echo_logprobs_of_an_unrun_prompt_are_null(demo_model_dir):
    """(the OpenAI route padded them already: kept as the reference for the two above)"""
    r = aborted_while_queued(
        demo_model_dir,
        "/v1/completions",
        {"prompt": [7] * 40, "request_id": "victim", "echo": True, "logprobs": 2, "max_tokens": 4},
    )
    assert r.status_code == 200, r.text[:300]
    lp = r.json()["choices"][0]["logprobs"]
    assert r.json()["choices"][0]["finish_reason"] == "abort"
    assert lp["token_logprobs"] == [None] * 40 and lp["top_logprobs"] == [None] * 40
