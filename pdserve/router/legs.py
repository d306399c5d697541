"""One attempt's legs to its engines: the decode's request (`Leg`, its in-flight count), the wait for
the prefill's answer that ends early when the decode fails first (`prefill_unless_decode_fails`),
and the decode's answer relayed to the client (`Relay`).

Who uses it: `router/app.py` (`Router._attempts` builds both legs of each attempt; `_decode_answer`
hands the decode's response to a `Relay`), `router/control.py` (`JSON`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

import httpx
import msgspec
from fastapi import Request

from pdserve.router.engines import Engine, EngineDown, chunks_unless_down
from pdserve.server.protocol import error_body

if TYPE_CHECKING:
    from pdserve.router.app import Router


def error_type(content: bytes) -> str | None:
    """An engine's error body's `error.type`, or None (not such a body)."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("type") if isinstance(error, dict) else None


class Leg:
    """One attempt's decode leg: the task sending the decode's request (its response once headers
    came) and the decode's in-flight count taken for it. `close()`: drop the count, then close the
    connection (the decode aborts the request); idempotent, so every way out can call it."""

    def __init__(self, de: Engine, task: asyncio.Future) -> None:
        self.de, self.task, self.done = de, task, False
        de.in_flight += 1

    async def close(self) -> None:
        if not self.done:
            self.done = True
            self.de.in_flight -= 1  # (first: a cancelled close below must not leave it counted)
            await cancel_request(self.task)


class Relay:
    """The decode's response body, relayed. Its leg is closed (which aborts the request there) and
    the decode's in-flight count dropped exactly once: when the relay ends, is cancelled (Starlette
    cancels it when the client leaves or a send fails), or is closed unread (`aclose`: a merged
    `n` > 1 request whose other child failed never starts reading this one; see server/fanout.py)."""

    def __init__(self, de: Engine, de_resp: httpx.Response, router: Router | None = None) -> None:
        """`router`: counts this relay in its `num_relaying` while it runs (a stream, past `dispatch`)."""
        self.de, self.de_resp, self.done, self.router = de, de_resp, False, router
        if router is not None:
            router.num_relaying += 1

    def __aiter__(self):
        return self._relay()

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.de.in_flight -= 1  # (first: a cancelled close below must not leave it counted)
            if self.router is not None:
                self.router.num_relaying -= 1
            await self.de_resp.aclose()

    async def _relay(self):
        try:
            async with contextlib.aclosing(chunks_unless_down(self.de, self.de_resp.aiter_raw())) as chunks:
                # No disconnect check per chunk (~23 us each): Starlette's StreamingResponse
                # cancels this generator when the client leaves (or its next send fails), and
                # the `finally` below closes the decode's leg, which aborts the request there.
                async for chunk in chunks:
                    yield chunk
        except httpx.HTTPError as e:  # (an in-band error, then [DONE], as an engine ends its streams)
            yield f"data: {json.dumps(error_body(f'decode stream broke: {e!r}', 502, 'BadGateway'))}\n\n"
            yield "data: [DONE]\n\n"
        except EngineDown as e:
            yield f"data: {json.dumps(error_body(str(e), 503, 'ServiceUnavailable'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await self.aclose()


JSON = {"content-type": "application/json"}


def engine_json(body: dict, http: Request) -> bytes:
    """A body for an engine, encoded by msgspec (~0.15 ms for a 32k-token prompt; httpx's `json=`
    took ~2.1 ms, once per leg, on the router's event loop); by the standard library if that is what
    parsed the client's body (non-finite numbers stay what they were, for the engine to refuse; httpx's
    `json=` refused them itself, after the decode's in-flight count was taken: a 500 and a leak)."""
    if getattr(http.state, "stdlib_json", False):
        return json.dumps(body).encode()
    return msgspec.json.encode(body)


# How long an engine that does not answer an abort is waited for: the router's `/abort_request` on
# every engine (one that does not answer by then, paused or dying, is listed as unreachable: an RL
# rollout manager's abort call hung 30 s, a review), and the prefill call of an aborted attempt.
ABORT_TIMEOUT_S = 5.0


class PrefillWaitAborted(Exception):
    """An abort named the request while its attempt waited for the prefill's answer."""


async def end_prefill_call_later(call: asyncio.Future) -> None:
    """An aborted attempt's prefill call: its answer (the abort, from a live prefill) is waited for
    ABORT_TIMEOUT_S at most, then its connection is closed (a paused prefill ends its half when it
    runs again). Not closed at once: a live prefill whose leg closes fails the room, and the decode
    could hear that before the client's abort: the client's "abort" would have been an error."""
    with contextlib.suppress(Exception):  # (its error, or the timeout: the call is closed either way)
        response = await asyncio.wait_for(call, ABORT_TIMEOUT_S)
        await response.aclose()


async def prefill_unless_decode_fails(
    pe_call,
    de_task: asyncio.Future,
    aborted: asyncio.Event | None = None,
    background: Callable[[Coroutine], object] | None = None,
) -> httpx.Response | None:
    """The prefill's response; None when the decode fails first, answering an error status or not
    reachable at all (the prefill's leg is then closed, which aborts it there). A prefill waits for
    the decode's KVRequest, so with a decode that refused the request (e.g. `stream_options` without
    `stream`: the prefill's copy is not streamed, so only the decode sees the conflict) it would wait
    to its Bootstrapping deadline, and the client would get a 503 after 30 s per attempt instead of
    the decode's 400.

    `aborted` (set by an abort that names the request, or before the attempt for one sent aborted):
    once it is set and the decode has answered (its headers, or its whole "abort"), the prefill's
    answer is not waited for: PrefillWaitAborted is raised, and the prefill's call is handed to
    `background` (`end_prefill_call_later`; closed at once without one) before the exception leaves,
    so that it ends even when a caller's wrapper drops the exception (the client left, or a cancel,
    in the same step). A paused or wedged prefill answers only at its timeout (3 x its deadline +
    5 s): the client got its abort that late, or a 503 once the attempt counted as the prefill's
    failure."""
    pe_task = asyncio.ensure_future(pe_call)
    flag = asyncio.ensure_future(aborted.wait()) if aborted is not None else None
    waits: set[asyncio.Future] = {pe_task, de_task} | ({flag} if flag is not None else set())
    handed_over = False
    try:
        while not pe_task.done():
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if pe_task.done():
                break
            if de_task.done() and de_task in waits:
                if not de_task.cancelled() and (de_task.exception() or de_task.result().status_code != 200):
                    # (an error, or no connection at all: a decode that just died)
                    await cancel_request(pe_task)
                    return None
                waits.discard(de_task)  # (the decode's stream started: the prefill's answer decides ...)
            if flag is not None and flag.done():
                waits.discard(flag)
                if de_task.done():  # (... unless the request was aborted)
                    if background is not None:
                        background(end_prefill_call_later(pe_task))
                        handed_over = True
                    raise PrefillWaitAborted
                waits.add(de_task)  # (aborted before the decode answered: wait for its answer too)
        return pe_task.result()
    finally:
        if flag is not None:
            flag.cancel()
        if not pe_task.done() and not handed_over:  # (cancelled: the client left)
            pe_task.cancel()


async def cancel_request(task: asyncio.Future) -> None:
    if task.done():
        if not task.cancelled() and task.exception() is None:
            await task.result().aclose()
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, httpx.HTTPError):
        pass
