"""The router's view of one engine (`Engine`: its health, what its /pd/info said, the requests it
has in flight) and how the router waits on an engine unless it is declared down meanwhile.

Who uses it: `router/app.py` (the `Router` keeps one `Engine` per engine URL; its health checks set
`healthy`, `stale` and `down`), `router/legs.py` (a relayed stream stops when its decode is declared
down), `router/control.py` (weight updates).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

NO_ANSWER = "stopped answering health checks"


@dataclass
class Engine:
    url: str
    role: str
    healthy: bool = False
    bootstrap_url: str = ""
    model: str = ""
    in_flight: int = 0
    misses: int = 0
    deadline_s: float = 0.0  # the engine's PD deadline per transfer state (from /pd/info)
    model_path: str = ""  # the weights it serves (from /pd/info)
    weights_id: str = ""  # ... and their identity (model, vocabulary, checkpoint digest; from /pd/info)
    kv_capacity_tokens: int = 0  # its KV pool in tokens (from /pd/info; 0: not reported)
    # Answers health checks but serves other weights than the cluster's last update (it was out of
    # service then, or restarted from the launch checkpoint): taken out of service like a dead engine,
    # so no pair of stale engines serves the old weights unnoticed; the next update includes it.
    stale: bool = False
    # Set when health checks declare the engine down: requests waiting on it give up (a frozen decode
    # would otherwise hold its clients forever). Replaced by a fresh event when it comes back.
    down: asyncio.Event = field(default_factory=asyncio.Event)
    down_reason: str = NO_ANSWER  # (what those requests are told; else what its health check answered)


def same_weights(a: Engine, b: Engine) -> bool:
    """Whether `a` and `b` serve one weights identity (as far as both reported one)."""
    return not a.weights_id or not b.weights_id or a.weights_id == b.weights_id


class NoEngine(Exception):
    pass


class EngineDown(Exception):
    pass


_END, _DOWN = object(), object()


async def chunks_unless_down(e: Engine, chunks):
    """Yield `chunks` (an async iterator) until they end; raise EngineDown once `e` is declared down.
    One reader task and one watcher per stream, not per chunk: this is the router's per-token path."""
    q: asyncio.Queue = asyncio.Queue()  # bounded by the response itself (max_tokens)

    async def read() -> None:
        try:
            async for chunk in chunks:
                q.put_nowait(chunk)
            q.put_nowait(_END)
        except Exception as exc:  # httpx errors reach the consumer as they would have directly
            q.put_nowait(exc)

    reader = asyncio.ensure_future(read())
    watcher = asyncio.ensure_future(e.down.wait())
    watcher.add_done_callback(lambda f: f.cancelled() or q.put_nowait(_DOWN))
    try:
        while (item := await q.get()) is not _END:
            if item is _DOWN:
                raise EngineDown(f"{e.role} {e.url} {e.down_reason}")
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        reader.cancel()
        watcher.cancel()


async def unless_down(e: Engine, awaitable):
    """`await awaitable`, unless engine `e` is declared down first (then EngineDown; it is cancelled)."""
    return await unless_set(e.down, awaitable, lambda: EngineDown(f"{e.role} {e.url} {e.down_reason}"))


async def unless_set(event: asyncio.Event, awaitable, error):
    """`await awaitable`, unless `event` is set first: then it is cancelled and `error()` raised."""
    if event.is_set():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        elif isinstance(awaitable, asyncio.Future):
            awaitable.cancel()
        raise error()
    task = asyncio.ensure_future(awaitable)
    flag = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, flag}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # (our caller's cancel, e.g. the client left: the awaitable's too,
        task.cancel()  # and its cleanup run -- a prefill wait closes the prefill's leg)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise
    finally:
        flag.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise error()
