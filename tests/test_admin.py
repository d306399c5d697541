"""The control endpoints (server/admin.py), through the app in process: `/abort_request` ends exactly
the requests it names (each answer with its tokens so far and finish_reason "abort", its pages freed),
`abort_all` ends every one, bad bodies are 400s that abort nothing; `/flush_cache` and
`/get_model_info` answer as SGLang's do."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.conftest import run_in_process, until

PROMPT_IDS = list(range(5, 45))
KW = dict(num_pages=128, max_model_len=1024, page_size=16)
LONG = 900  # tokens: far more than the test takes to abort (an unaborted answer would finish "length")


def run(engine: LLMEngine, scenario):
    return run_in_process(engine, scenario)


def generate(c: httpx.AsyncClient, rid: str):
    sp = {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True}
    return c.post("/generate", json={"input_ids": PROMPT_IDS, "sampling_params": sp, "rid": rid})


async def streamed(c: httpx.AsyncClient) -> list[dict]:
    body = {"prompt": PROMPT_IDS, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = []
    async with c.stream("POST", "/v1/completions", json=body) as r:  # (ASGITransport: read at the end)
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


def test_abort_request_ends_the_named_request_then_abort_all_the_rest(demo_model_dir):
    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))

    async def scenario(c):
        first = asyncio.ensure_future(generate(c, "rollout-1"))
        second = asyncio.ensure_future(generate(c, "rollout-2"))
        stream = asyncio.ensure_future(streamed(c))
        reqs = engine.requests
        await until(lambda: len(reqs) == 3 and all(r.num_output_tokens >= 3 for r in list(reqs.values())))
        bad = [
            await c.post("/abort_request", json=body)
            for body in (
                {}, {"rid": "x", "abort_all": True}, {"rid": 5}, {"abort_all": "yes"},
                {"rid": "x", "room": -1}, {"rid": "x", "room": 5, "router_id": "r"},
            )
        ]  # fmt: skip
        # (a room names one PD half, exactly: a colocated engine has none, and ends nothing)
        roomed = await c.post("/abort_request", json={"rid": "rollout-2", "room": 7})
        unknown = await c.post("/abort_request", json={"rid": "no-such-request", "abort_message": "x"})
        one = await c.post("/abort_request", json={"rid": "rollout-1"})
        first_answer = await first
        still_running = set(engine.requests)
        rest = await c.post("/abort_request", json={"abort_all": True})
        return bad, roomed, unknown, one, first_answer, still_running, rest, await second, await stream

    bad, roomed, unknown, one, first, still_running, rest, second, chunks = run(engine, scenario)
    assert [r.status_code for r in bad] == [400] * 6, [r.text for r in bad]
    assert "room comes with a rid" in bad[5].json()["error"]["message"]
    assert roomed.json() == {"success": True, "num_requests_aborted": 0}
    assert "rid or abort_all" in bad[0].json()["error"]["message"]
    assert unknown.json() == {"success": True, "num_requests_aborted": 0}
    assert one.json() == {"success": True, "num_requests_aborted": 1}
    assert "rollout-2" in still_running and "rollout-1" not in still_running and len(still_running) == 2
    assert rest.json()["num_requests_aborted"] == 2
    full = LLM(demo_model_dir, dtype="float32", **KW).generate(
        {"prompt_token_ids": PROMPT_IDS}, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    )[0]
    for answer in (first.json(), second.json()):
        assert answer["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted"}
        ids = answer["output_ids"]
        assert 0 < len(ids) < LONG and ids[:60] == list(full.outputs[0].token_ids)[: len(ids)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert engine.kv.pool.num_used_pages == 0 and not engine.requests
    engine.check_integrity()


def test_the_ids_clients_see_abort_their_requests(demo_model_dir):
    """A chat's `chatcmpl-` id, a client's own `request_id` as it chose it (two requests sharing it:
    both; it matched nothing, only "cmpl-" + it did, found by a README walk-through), and the merged
    id of an n = 3 request (its children are `<id>_<i>`) each abort what they name, every
    choice included; engine ids stay unique underneath."""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))
    long = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    msgs = [{"role": "user", "content": "hi"}]
    mine = long | {"prompt": PROMPT_IDS, "request_id": "job-7"}

    async def scenario(c):
        chat = asyncio.ensure_future(c.post("/v1/chat/completions", json=long | {"messages": msgs}))
        mine_twice = [asyncio.ensure_future(c.post("/v1/completions", json=mine)) for _ in range(2)]
        three = asyncio.ensure_future(c.post("/v1/completions", json=long | {"prompt": PROMPT_IDS, "n": 3}))
        reqs = engine.requests
        await until(lambda: len(reqs) == 6 and all(r.num_output_tokens >= 2 for r in list(reqs.values())))
        clients = {rid: r.client_id for rid, r in list(reqs.items())}
        (chat_rid,) = [rid for rid, client_id in clients.items() if client_id is None]
        parent = next(c for c in clients.values() if c and c.endswith("_0"))[:-2]
        answers = [
            await c.post("/abort_request", json={"rid": "chatcmpl-" + chat_rid.removeprefix("cmpl-")}),
            await c.post("/abort_request", json={"rid": "job-7"}),  # (the client's own id: "cmpl-" + it too)
            await c.post("/abort_request", json={"rid": parent}),
        ]
        return clients, answers, await chat, [await m for m in mine_twice], await three, parent

    clients, answers, chat, mine_twice, three, parent = run(engine, scenario)
    expected = ["cmpl-job-7"] * 2 + [f"{parent}_{i}" for i in range(3)]
    assert sorted(c for c in clients.values() if c) == sorted(expected)
    assert [a.json()["num_requests_aborted"] for a in answers] == [1, 2, 3]
    assert chat.json()["choices"][0]["finish_reason"] == "abort"
    for m in mine_twice:
        assert m.json()["id"] == "cmpl-job-7" and m.json()["choices"][0]["finish_reason"] == "abort"
    assert three.json()["id"] == parent
    assert [ch["finish_reason"] for ch in three.json()["choices"]] == ["abort"] * 3
    assert engine.kv.pool.num_used_pages == 0 and not engine.requests
    engine.check_integrity()


def test_an_abort_names_a_request_by_its_engine_id_its_answers_id_or_the_id_its_client_chose():
    """`_named` (what `/abort_request {"rid"}` matches): the engine's id, the answer's id, the id the
    client chose (the answer's is "cmpl-" + it; one that itself starts with "cmpl-" matched nothing),
    and a split request's children by prefix."""
    from types import SimpleNamespace

    from pdserve.engine.async_engine import _named

    chosen = SimpleNamespace(request_id="cmpl-0af3", client_id="cmpl-cmpl-job")
    assert all(_named(chosen, n) for n in ("cmpl-0af3", "cmpl-cmpl-job", "cmpl-job"))
    assert not any(_named(chosen, n) for n in ("job", "cmpl-jo", "0af3"))
    child = SimpleNamespace(request_id="cmpl-9b_1", client_id="cmpl-run_1")
    assert _named(child, "run") and _named(child, "cmpl-run") and not _named(child, "ru")
    plain = SimpleNamespace(request_id="gen-7", client_id=None)  # (a /generate rid)
    assert _named(plain, "gen-7") and not _named(plain, "gen")


def test_abort_all_also_ends_a_request_still_being_checked(demo_model_dir):
    """A request validated before an abort of everything but streamed after it (it was tokenizing,
    or waiting at a split request's start gate) ends at once with finish_reason "abort", no token
    computed; one validated after the abort runs."""
    from pdserve.engine.async_engine import AsyncEngine

    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def go():
        before, text = aengine.validate({"prompt_token_ids": PROMPT_IDS}, params, "before")
        assert await aengine.abort_now() == 0  # (nothing streamed yet)
        after, text2 = aengine.validate({"prompt_token_ids": PROMPT_IDS}, params, "after")
        return [o async for o in aengine.generate(before, text)], [
            o async for o in aengine.generate(after, text2)
        ]

    try:
        aborted, ran = asyncio.run(go())
    finally:
        aengine.shutdown()
    (only,) = aborted
    assert (
        only.finished and only.outputs[0].finish_reason == "abort" and list(only.outputs[0].token_ids) == []
    )
    assert ran[-1].outputs[0].finish_reason == "length" and len(ran[-1].outputs[0].token_ids) == 3
    assert engine.kv.pool.num_used_pages == 0 and not engine.requests


@pytest.mark.parametrize("before", ["both", "prefill", "decode"])
def test_pd_abort_all_ends_the_halves_of_a_request_still_being_checked(demo_model_dir, before):
    """PD: an abort of everything on both engines while `before` half (or both) of a request was
    still being checked (a prefill half tokenizing, a decode half looking up its prefill). Both halves
    answer "abort", also a half validated after the abort: the aborted half ends its room on purpose
    and tells the peer. No token is computed, no room expires, nothing stays held. Before, a PD half
    validated before the abort ran as if there had been none."""
    import dataclasses

    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.engine.pd_common import PDConfig
    from pdserve.server.pd_context import PDContext

    config = PDConfig(cluster_secret=b"admin-test-secret", transfer_backend="fake", bootstrap_port=0)
    roles = ("prefill", "decode")
    engines = {r: LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW)) for r in roles}
    ctx = {r: PDContext(engines[r], r, config) for r in roles}
    aengines = {r: AsyncEngine(engines[r], role=ctx[r].role) for r in roles}
    params = SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
    room = 4242

    def half(role: str):  # (as the engines' handlers make the router's two requests)
        req, text = aengines[role].validate({"prompt_token_ids": PROMPT_IDS}, params, f"{role}-half")
        if role == "prefill":
            req.sampling_params, req.max_tokens = dataclasses.replace(params, max_tokens=1), 1
            req.pd = room
        else:
            req.pd = (room, ctx["prefill"].control.address)
        return req, text

    def settled(role: str) -> bool:
        held = ctx[role].role.by_room if role == "prefill" else ctx[role].role.releasing
        return not len(ctx[role].role.rooms) and not held and not engines[role].requests

    async def go():
        halves = {r: half(r) for r in roles if before in (r, "both")}
        for a in aengines.values():
            assert await a.abort_now() == 0  # (nothing streamed yet)
        halves |= {r: half(r) for r in roles if r not in halves}

        async def answer(role: str) -> list:
            return [o async for o in aengines[role].generate(*halves[role])]

        outs = await asyncio.gather(*(answer(r) for r in roles))
        for r in roles:
            await until(lambda r=r: settled(r))
        return outs

    try:
        outs = asyncio.run(go())
    finally:
        for r in roles:
            aengines[r].shutdown()
            ctx[r].close()
    for out in outs:
        assert [(o.finished, o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in out] == [
            (True, "abort", [])
        ]
    for r in roles:
        assert ctx[r].role.rooms.num_expired == 0, r
        assert engines[r].kv.pool.num_used_pages == 0
        engines[r].check_integrity()


def test_a_named_abort_also_ends_a_request_still_being_checked(demo_model_dir):
    """/abort_request by id while the request is still being checked (a child of a batch at its
    start gate, a long prompt tokenizing): it ends at once with finish_reason "abort" when streamed.
    One with another id, or validated after the abort, runs."""
    from pdserve.engine.async_engine import AsyncEngine

    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))
    aengine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT_IDS}

    async def go():
        named, t1 = aengine.validate(prompt, params, "job_0")
        other, t2 = aengine.validate(prompt, params, "jobless")
        assert await aengine.abort_now("job") == 0  # (nothing streamed yet)
        again, t3 = aengine.validate(prompt, params, "job_1")
        return [[o async for o in aengine.generate(r, t)] for r, t in ((named, t1), (other, t2), (again, t3))]

    try:
        named, other, again = asyncio.run(go())
    finally:
        aengine.shutdown()
    assert [o.outputs[0].finish_reason for o in named] == ["abort"] and list(
        named[0].outputs[0].token_ids
    ) == []
    assert other[-1].outputs[0].finish_reason == "length" and again[-1].outputs[0].finish_reason == "length"
    assert engine.kv.pool.num_used_pages == 0 and not engine.requests


def test_flush_cache_and_model_info(demo_model_dir):
    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))

    async def scenario(c):
        body = {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0}
        await c.post("/v1/completions", json=body)
        flushed = await c.post("/flush_cache")
        again = await c.get("/flush_cache")
        return flushed, again, await c.get("/get_model_info")

    flushed, again, info = run(engine, scenario)
    assert flushed.json()["num_cached_pages_dropped"] == len(PROMPT_IDS) // KW["page_size"]
    assert again.json() == {"num_cached_pages_dropped": 0}
    assert info.json() == {
        "model_path": demo_model_dir,
        "tokenizer_path": demo_model_dir,
        "served_model_name": engine.config.model_name,
        "is_generation": True,
        "max_model_len": 1024,
        "num_weight_updates": 0,
        "weight_version": "default",
    }


@pytest.mark.parametrize("method", ["GET", "PUT"])
def test_abort_request_is_a_post(demo_model_dir, method):
    engine = LLMEngine(EngineConfig.create(demo_model_dir, dtype="float32", **KW))

    async def scenario(c):
        return await c.request(method, "/abort_request")

    assert run(engine, scenario).status_code == 405
