"""Waiting on a client's behalf, and giving up as soon as it hangs up.

Who calls it: HTTP handlers that await something long before their response starts — an engine's
non-streamed completion (`server/api.py`), the router's placement, a prefill's answer and a
non-streamed decode (`router/app.py`). Starlette tells a handler about a disconnect only when asked,
so the wait polls; without it a client that left kept engines generating to max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")

CLIENT_POLL_S = 0.5  # how often a waiting handler checks that its client is still there


class ClientGone(Exception):
    """The client closed its connection while the handler waited on its behalf."""


async def unless_gone(http: Request, awaitable: Awaitable[T]) -> T:
    """`await awaitable`, unless the client disconnects first: then the awaitable is cancelled (and
    awaited, so its cleanup has run: an engine stream's `finally` aborts the request) and ClientGone
    is raised. The handler's own cancellation propagates as usual."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=CLIENT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
