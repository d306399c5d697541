"""The HTTP API's shapes against OpenAI's API reference and vLLM's OpenAI server (found by a review
with the openai SDK, 2026-12-02; each test failed before its fix): `stop_reason` on every choice,
`/version`, null meaning a field's default, vLLM fields that change the answer refused rather than
ignored, and the router's relay of a decode that breaks mid-answer."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.conftest import post_in_process, run_in_process

pytestmark = pytest.mark.timeout(300)

CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.model.demo import make_demo_model

    d = make_demo_model(tmp_path_factory.mktemp("demo"))
    return LLMEngine(EngineConfig.create(str(d), num_pages=128, max_model_len=1024))


def sse_events(text: str) -> list:
    """The `data:` payloads of an SSE body (JSON decoded, "[DONE]" kept as the string)."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- 1. vLLM's `stop_reason` is missing from every choice ------------------------------------------
def test_choices_carry_vllms_stop_reason(engine):
    """vLLM's CompletionResponseChoice / ChatCompletionResponseChoice and their stream choices have
    `stop_reason`: the stop string or stop token id that ended the answer, null otherwise (EOS, length).
    The engine knows it (CompletionOutput.stop_reason, used by /generate's meta_info) but the OpenAI
    routes drop it."""
    base = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    (first,) = post_in_process(engine, [("/v1/completions", base | {"return_token_ids": True})])
    ids = first.json()["choices"][0]["token_ids"]
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a token first sampled at k
    stop = {"stop_token_ids": [ids[k]]}
    plain, by_token, streamed, chat = post_in_process(
        engine,
        [
            ("/v1/completions", base),
            ("/v1/completions", base | stop),
            ("/v1/completions", base | stop | {"stream": True}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "temperature": 0}),
        ],
    )
    c = plain.json()["choices"][0]
    assert c["finish_reason"] == "length"
    assert "stop_reason" in c and c["stop_reason"] is None, c
    c = by_token.json()["choices"][0]
    assert c["finish_reason"] == "stop"
    assert c.get("stop_reason") == ids[k], c
    finish = [e for e in sse_events(streamed.text) if e != "[DONE]" and e["choices"][0]["finish_reason"]]
    assert finish and finish[-1]["choices"][0].get("stop_reason") == ids[k], finish
    assert "stop_reason" in chat.json()["choices"][0], chat.json()


# ---- 2. GET /version (vLLM's) is a 404, on engines and on the router ------------------------------
def test_engine_serves_version(engine):
    async def scenario(c):
        return await c.get("/version")

    r = run_in_process(engine, scenario)
    assert r.status_code == 200, (r.status_code, r.text)
    assert isinstance(r.json().get("version"), str)


def test_router_serves_version():
    from tests.test_router_app import Engines, client_of, started_router

    async def go():
        router = await started_router(Engines(blocking=()), "none")
        async with client_of(router) as c:
            return await c.get("/version")

    r = asyncio.run(go())
    assert r.status_code == 200, (r.status_code, r.text)


# ---- 3. OpenAI's nullable request fields are refused when null ------------------------------------
@pytest.mark.parametrize(
    "path,field",
    [
        ("/v1/completions", "temperature"),
        ("/v1/completions", "top_p"),
        ("/v1/completions", "stream"),
        ("/v1/chat/completions", "temperature"),
        ("/v1/chat/completions", "top_p"),
        ("/v1/chat/completions", "stream"),
        ("/v1/chat/completions", "logprobs"),
    ],
)
def test_openais_nullable_fields_accept_null(engine, path, field):
    """OpenAI's reference types these "number or null" / "boolean or null" (null: the default), vLLM
    declares them Optional; the openai SDK sends null for an explicit None (e.g. temperature=None, a
    common "use the server default"). pdserve's strict non-Optional fields answer 400."""
    body = {"max_tokens": 2, field: None}
    body |= {"prompt": "def f(x):"} if path == "/v1/completions" else {"messages": CHAT}
    (r,) = post_in_process(engine, [(path, body)])
    assert r.status_code == 200, r.text


def test_openai_sdk_temperature_none_is_answered(engine):
    async def scenario(c):
        oc = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=c, max_retries=0)
        return await oc.chat.completions.create(model=None, messages=CHAT, max_tokens=2, temperature=None)

    try:
        r = run_in_process(engine, scenario)
    except openai.BadRequestError as e:
        pytest.fail(f"openai SDK: {e}")
    assert r.choices[0].message.role == "assistant"


# ---- 4. vLLM fields that change the answer are silently ignored -----------------------------------
def test_chat_return_token_ids_is_honoured_or_refused(engine):
    """vLLM takes `return_token_ids` on chat too (choice.token_ids, top-level prompt_token_ids); pdserve
    implements it on /v1/completions only and ignores it on chat (an agent that builds its next turn
    from the ids gets none). Its own policy (protocol.UNSUPPORTED_FIELDS) is to refuse what it does
    not implement."""
    (r,) = post_in_process(
        engine, [("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "return_token_ids": True})]
    )
    if r.status_code == 400:
        return
    body = r.json()
    assert "token_ids" in body["choices"][0] and "prompt_token_ids" in body, body


@pytest.mark.parametrize(
    "field", ["allowed_token_ids", "truncate_prompt_tokens", "chat_template", "bad_words"]
)
def test_vllm_fields_that_change_the_answer_are_honoured_or_refused(engine, field):
    """vLLM's allowed_token_ids / truncate_prompt_tokens / chat_template / bad_words change what is
    generated or what the prompt is; pdserve accepts them as unknown extras and answers as if they
    were absent (a 200 with a different answer than vLLM's)."""
    (ref,) = post_in_process(
        engine,
        [("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True})],
    )
    ref = ref.json()
    value = {
        "allowed_token_ids": [7],
        "truncate_prompt_tokens": 2,
        "chat_template": "X{{ messages[0]['content'] }}",
        "bad_words": [ref["choices"][0]["message"]["content"].strip()[:3] or "a"],
    }[field]
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, field: value}
    (r,) = post_in_process(engine, [("/v1/chat/completions", body)])
    if r.status_code == 400:
        return  # refused: acceptable
    got = r.json()
    same = (got["choices"], got["usage"]) == (ref["choices"], ref["usage"])
    if field == "bad_words" and value[0] not in ref["choices"][0]["message"]["content"]:
        pytest.skip("the banned word is not in the reference answer: no effect to see")
    assert not same, f"{field}={value!r} was ignored: 200 with the same choices and usage as without it"


class _BreaksAfter(httpx.AsyncByteStream):
    def __init__(self, first: bytes) -> None:
        self.first = first

    async def __aiter__(self):
        yield self.first
        raise httpx.ReadError("connection reset by peer")


def _router_answer(decode_body: bytes, content_type: str, client_body: dict) -> httpx.Response:
    from tests.test_router_app import Engines, client_of, started_router

    async def go():
        engines = Engines(blocking=())

        async def engine(request: httpx.Request):
            if request.method == "POST" and request.url.host == "de":
                return httpx.Response(
                    200, headers={"content-type": content_type}, stream=_BreaksAfter(decode_body)
                )
            if request.method == "POST" and request.url.host == "pe":
                return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
            return None

        engines.intercept = engine
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            return await asyncio.wait_for(c.post("/v1/completions", json=client_body), 10)

    return asyncio.run(go())


def test_router_stream_broken_mid_way_ends_with_done():
    """An engine's in-band error is followed by `data: [DONE]` (api.py's `stream`, as vLLM's); the
    router's relay (router/legs.py `Relay._relay`) ends after its error event without it."""
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}]}  # fmt: skip
    r = _router_answer(
        f"data: {json.dumps(chunk)}\n\n".encode(), "text/event-stream", {"prompt": [1, 2], "stream": True}
    )
    events = sse_events(r.text)
    assert any(isinstance(e, dict) and "error" in e for e in events), r.text
    assert events[-1] == "[DONE]", r.text


def test_router_non_streamed_answer_broken_mid_way_is_an_openai_error():
    """A non-streamed decode answer whose connection drops half way: the router has already sent 200
    and the first bytes, then appends an SSE `data: {"error": ...}` line to the JSON: the client gets a
    200 whose body is not JSON (the openai SDK raises a decode error instead of an APIError)."""
    r = _router_answer(b'{"id": "cmpl-1", "object": "text_comp', "application/json", {"prompt": [1, 2]})
    try:
        body = r.json()
    except ValueError:
        pytest.fail(f"HTTP {r.status_code} with a body that is not JSON: {r.text!r}")
    assert r.status_code >= 500 and "error" in body, (r.status_code, body)
