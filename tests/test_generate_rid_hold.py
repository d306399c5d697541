"""A `/generate` rid is held from its checks until its stream takes it over (an audit of duplicate rids,
2026-12-03). The route let the id go before a streamed answer's body started -- after a PD half looked
up its peer, while its headers went out -- so a twin with the same rid could take it in that gap; the
stream, already a 200, then failed in-band, and under PD its prefill waited out its deadline for a KV
request never sent (the client got a 503 "no healthy prefill" after 30 s instead of a 409). The twin
here is sent while the first stream's headers go out (raw ASGI, in process); before the fix it was a
200. A stream whose body never starts lets the id go too."""

from __future__ import annotations

import asyncio
import json

from pdserve.server.api import StreamThen, build_app
from tests.test_router_app import completion_scope


async def _call(app, body: dict, on_start=None) -> tuple[int, bytes]:
    """POST /generate to the ASGI app; `on_start` is awaited when the response's headers go out (it
    may raise: the client left then). Returns (status, body)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.sleep(3600)  # (the client stays connected)
        return {"type": "http.disconnect"}

    status, chunks = 0, []

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            if on_start is not None:
                await on_start()
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(completion_scope(json.dumps(body).encode(), "/generate"), receive, send)
    return status, b"".join(chunks)


def _body(rid: str, stream: bool) -> dict:
    return {"input_ids": [5, 6, 7, 8], "rid": rid, "stream": stream, "sampling_params": {"max_new_tokens": 3}}


def test_a_twin_sent_while_the_streams_headers_go_out_is_refused(demo_engine):
    app = build_app(demo_engine)
    twin: list = []

    async def scenario():
        async def send_twin():
            twin.append(await _call(app, _body("twin-rid", stream=False)))

        first = await _call(app, _body("twin-rid", stream=True), on_start=send_twin)
        again = await _call(app, _body("twin-rid", stream=False))  # (ended: the id is free)
        return first, again

    try:
        (status, text), again = asyncio.run(scenario())
    finally:
        app.state.engine.shutdown()
    assert status == 200 and text.rstrip().endswith(b"data: [DONE]"), text
    assert b'"error"' not in text, text
    ((twin_status, twin_text),) = twin
    assert twin_status == 409, (twin_status, twin_text)  # (was a 200: the id was let go at the headers)
    assert again[0] == 200, again


def test_a_stream_whose_body_never_starts_lets_the_id_go(demo_engine):
    app = build_app(demo_engine)

    async def client_left():
        raise OSError("the client left")

    async def scenario():
        try:
            await _call(app, _body("left-rid", stream=True), on_start=client_left)
        except OSError:
            pass
        return await _call(app, _body("left-rid", stream=False))

    try:
        status, text = asyncio.run(scenario())
    finally:
        app.state.engine.shutdown()
    assert status == 200, text  # (not a 409 for good: the id was held by a stream that never ran)


def test_a_merged_stream_whose_body_never_starts_lets_every_childs_id_go(demo_engine):
    """`n` > 1 (or a batch) streamed: the merged stream was a plain StreamingResponse, so when its body
    never started its children were never closed and their reserved ids (`left_0`, `left_1`) stayed
    held: every later request with that rid a 409 (a review, 2026-12-04)."""
    app = build_app(demo_engine)
    body = {
        "input_ids": [5, 6, 7, 8],
        "rid": "left",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3, "n": 2},
    }

    async def client_left():
        raise OSError("the client left")

    async def scenario():
        try:
            await _call(app, body, on_start=client_left)
        except OSError:
            pass
        reserved = sorted(app.state.engine._reserved)
        return reserved, await _call(app, body | {"stream": False})

    try:
        reserved, (status, text) = asyncio.run(scenario())
    finally:
        app.state.engine.shutdown()
    assert reserved == []
    assert status == 200, text


def test_a_stream_closed_unread_calls_then():
    """A merged request (server/fanout.py) closes its children's bodies unread when one fails."""
    calls = []

    async def body():
        calls.append("started")
        yield "x"

    async def scenario():
        r = StreamThen(body(), lambda: calls.append("then"))
        await r.body_iterator.aclose()

    asyncio.run(scenario())
    assert calls == ["then"]
