"""Runs an `LLMEngine` on one dedicated thread and streams its outputs to asyncio callers.

Who calls what: HTTP handlers (event-loop thread) call `validate()` (read-only) and then iterate
`generate()`; only the engine thread ever mutates the engine. Commands cross over through `_inbox`;
outputs come back through per-request boxes (`OutputBox`, `call_soon_threadsafe`). When the engine goes
idle it runs `check_integrity()` (mini-sglang's habit), so a leak is caught right after it happens.
The check walks every page (~11 ms at 50k pages, 50 ms at 200k): the next one waits until the engine
has spent at most IDLE_CHECK_SHARE of its time on them, so a request arriving at an engine that goes
idle between an agent's turns rarely waits behind one (small pools still check at every idle).

Length (~650 lines): the thread, its inbox of commands (add, abort, a call run on the engine thread:
weight updates, cache resets, room aborts, a pause's hold of the steps) and the per-request streams
are one hand-off between two threads; split, each half would have to expose the other's locking
rules (a pause, for one, orders its hold and its release through the same inbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable

from pdserve.engine.llm_engine import DuplicateRequestId, LLMEngine
from pdserve.engine.request import Request
from pdserve.outputs import CompletionOutput, RequestOutput

log = logging.getLogger(__name__)

# `Request.abort_epoch` of a PD half the router aborted before it sent it (`pd.aborted`, after an
# `abort_all` reached the router while the request waited there): its peer's half is aborted alike.
ROUTER_ABORTED_EPOCH = -1
# ... of a PD half the router sent before an `abort_all` that reached this engine before the half did
# (`note_router_abort`): it is aborted as a half validated before an `abort_now()` is (its role ends the
# room on purpose and tells the peer, which may not have had the abort: it was sent to each engine).
ABORTED_IN_TRANSIT_EPOCH = -2
MAX_ROUTERS = 64  # routers whose last abort of everything an engine remembers (one per router start)
IDLE_CHECK_SHARE = 0.01  # idle integrity checks take at most this share of the engine thread's time
MAX_IDLE_CHECK_DEFER_S = 5.0  # ... and the next one waits no longer than this
MAX_ABORT_LOG = 4096  # `abort_now()` calls remembered for requests still being checked
MAX_NAMED_ABORTS_PER_ROUTER = 4096  # a router's named aborts remembered for its halves still in transit
# `pause()` modes: SGLang's /pause_generation (abort, in_place, retract) and vLLM's /pause (abort,
# wait, and keep = in_place). New requests wait in every mode until `resume()`; they differ in what
# happens to those in flight: ended now as aborts; frozen with their pages (in_place); their pages
# freed and put back in the queue, to be recomputed (mostly from the prefix cache) on resume
# (retract); or left to finish (wait).
PAUSE_MODES = ("abort", "in_place", "retract", "wait")


class EngineDeadError(RuntimeError):
    pass


class OutputBox:
    """One request's outputs on their way to its caller; `put` and `get` run on the caller's event loop
    (the engine thread posts with `call_soon_threadsafe`). Outputs are cumulative (each holds the whole
    answer so far), so an unread output that is not final is replaced by the next one: a caller that
    stops reading (a streaming client whose socket is full) holds one output, where a queue held one
    per step, each with the text so far (O(tokens^2) memory: 2.6 MB of text for a 1,000-token answer,
    GBs for long ones; found by a review). Errors and the final output are never replaced."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._ready = asyncio.Event()
        self.num_replaced = 0

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) and not last.finished:
            self._items[-1] = item
            self.num_replaced += 1
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


class PauseEnded(RuntimeError):
    """`AsyncEngine.pause` was overtaken by a `resume()` (or another pause) before it took effect."""


class RequestAborted(RuntimeError):
    """A role delivers this to a request's stream when its PD peer ended the room because the request
    was aborted on purpose (`/abort_request` reached the other engine first, or only it).
    `generate()` then ends the stream as an abort on this engine would: the output so far,
    finish_reason "abort". So the router neither retries the request nor relays an error for it."""


class EngineRole:
    """A PD role (prefill or decode side) plugged into the engine thread's loop.

    Every method runs on the engine thread, except `attach` (called by `AsyncEngine.__init__` before
    that thread starts) and the read-only helpers the HTTP thread's load report reads
    (`pd_load.load_report`, e.g. `DecodeRole._reserved_pages`). `add`/`abort` replace the engine's own handling of those
    commands; `tick` runs once per loop turn (poll control messages, transfer completions, deadlines)
    and returns True while it has work in flight, so the loop polls again soon instead of sleeping.
    """

    def attach(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine

    def add(self, req: Request, prompt_text: str | None) -> None:
        raise NotImplementedError

    def abort(self, request_id: str, client_abort: bool = False) -> RequestOutput | None:
        """End a request: its caller stopped iterating, or (`client_abort`) `/abort_request` named it,
        which the role tells its peer, so the peer's half ends as an abort too, not as a failure."""
        raise NotImplementedError

    def tick(self) -> bool:
        return False

    def check_integrity(self) -> None:
        pass


# How long a router's retry of a `/generate` with a client rid waits for its earlier attempt to end
# on this engine (AsyncEngine.earlier_attempt_ended): a few of the handlers' disconnect polls.
RETRY_ID_WAIT_S = 2.0
# An id whose caller left is kept from reuse until the engine thread has ended its request and holds
# nothing under the id, or this long after the abort was handled (a role that keeps it longer).
ENDING_ID_MAX_S = 10.0


def _room(pd) -> int | None:
    """The room of a PD half's `Request.pd` (a prefill's room, or a decode's (room, prefill address))."""
    return pd[0] if isinstance(pd, tuple) else pd


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
        on_abort: Callable[[RequestOutput], None] | None = None,
        check_integrity_when_idle: bool = True,
        role: EngineRole | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
        on_failed: Callable[[str], None] | None = None,
    ) -> None:
        """Observers (metrics), all called on the engine thread: `on_step` (engine, the step's
        outputs: one generated token each), `on_abort` (an aborted request's last output),
        `on_output` (an output whose token this engine did not generate: a PD decode's handed-over
        first token), `on_failed` (the finish reason of a request that ended without an output,
        e.g. its PD transfer failed)."""
        self.engine = engine
        self._on_step = on_step
        self._on_abort = on_abort
        self._on_output = on_output
        self._on_failed = on_failed
        self.role = role
        if role is not None:
            role.attach(self)
        self._check_idle = check_integrity_when_idle
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Event()
        # request id -> (its caller's loop, its OutputBox, the request): what is being streamed
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, Request]] = {}
        self._aborting: set[str] = set()  # streamed ids `abort_now` ended (event-loop thread)
        # Ids whose caller stopped iterating, aborted but maybe not yet ended on the engine thread
        # (event-loop thread). A retry under the id while the step already running still held the
        # old request was handed the old request's outputs, and its own request ran on with nobody
        # reading it (a review, 2026-12-05): the id stays active (no new stream can take it) until
        # the engine thread says the old one is gone (`_settle_ending`).
        self._ending: set[str] = set()
        self.last_output_s = 0.0  # (monotonic) when a step last produced outputs (/health_generate)
        self._ending_engine: list[tuple[str, asyncio.AbstractEventLoop, float]] = []  # (engine thread)
        # Every `abort_now()` so far, numbered: (number, the id it named or None for everything), the
        # last MAX_ABORT_LOG. A request remembers how many there were when it arrived (`abort_epoch`):
        # one that named it (or everything) since ends it as soon as it is streamed.
        self.num_aborts = 0
        self._abort_log: deque[tuple[int, str | None]] = deque(maxlen=MAX_ABORT_LOG)
        self._reserved: dict[str, Request] = {}  # ids held by requests waiting to start (`reserve`)
        # router id -> the abort count of its last abort of everything (`note_router_abort`), the last
        # MAX_ROUTERS routers (a router's id is new each time it starts: its counts start at 0 again)
        self._router_aborts: OrderedDict[str, int] = OrderedDict()
        # router id -> its latest named aborts, (its named-abort count, the name), oldest first
        # (`note_router_named_abort`), for the same MAX_ROUTERS routers at most
        self._router_named: OrderedDict[str, deque[tuple[int, str]]] = OrderedDict()
        # Pausing (`pause`, `resume`; event-loop thread): the mode, or None; and the event new requests
        # wait on meanwhile (set by `resume`).
        self.pause_mode: str | None = None
        self._resumed: asyncio.Event | None = None
        self._hold_steps = False  # (engine thread's: no step while set; in_place, retract)
        self._pause_seq = 0  # pauses and resumes so far: a hold sent by a pause since ended is skipped
        self.num_held = 0  # requests waiting in `generate()` for the pause to end
        self._stopped = False
        self._calls: set = set()  # (loop, future) of `run` calls not yet answered
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def num_streams(self) -> int:
        """Requests being streamed to their callers now (their engine has them)."""
        return len(self._streams)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def validate(
        self,
        prompt,
        params,
        request_id: str | None = None,
        default_max_tokens: int | None = None,
        epoch: int | None = None,
    ) -> tuple[Request, str | None]:
        """Any thread: the request, checked (read-only; `LLMEngine.make_request`). It remembers how
        many `abort_now()`s there were when it arrived (`epoch`: `num_aborts` as the caller read it on
        the event loop when the request came in; else now), so one that names it (or everything) while
        it is still being checked (a chat rendered, waiting for a worker thread, tokenized, held at a
        split request's start gate, or a PD half looking up its prefill) ends it as soon as it is
        streamed."""
        epoch = self.num_aborts if epoch is None else epoch
        tokenized = self.engine.tokenize_prompt(prompt)
        req = self.engine.make_request(prompt, params, request_id, tokenized, default_max_tokens)
        req.abort_epoch = epoch
        return req, tokenized[0]

    async def generate(self, req: Request, prompt_text: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as tokens arrive; abort it if the caller stops iterating.
        While the engine is paused (`pause`) the request waits here, before the engine sees it."""
        while self.pause_mode is not None and self.alive:
            self.num_held += 1
            try:  # (woken at least every second: an engine that died or stopped meanwhile ends it)
                await asyncio.wait_for(self._resumed.wait(), 1.0)
            except TimeoutError:
                pass
            except BaseException:  # (its caller left while it waited: nobody takes its id over now)
                self.unreserve(req)
                raise
            finally:
                self.num_held -= 1
            if self._aborted_since(req):
                # Aborted while held (`/abort_request`, or a server shutting down, which aborts
                # everything): it answers "abort" now. It saw the abort only once the pause ended,
                # which at shutdown never comes: its client got no answer at all when the grace period
                # ran out (a review, 2026-12-05).
                break
        if not self.alive:
            raise EngineDeadError("engine is not running")
        rid = req.request_id
        if rid in self._streams or rid in self._ending or self._reserved.get(rid, req) is not req:
            # Refused before touching the other stream: replacing its queue (and aborting the id on the
            # way out) would cut off the caller that owns it.
            raise DuplicateRequestId(f"request id {req.request_id!r} is already active")
        aborted = self._aborted_since(req)  # named (or everything was) while it was being checked
        if aborted and (self.role is None or req.abort_epoch == ROUTER_ABORTED_EPOCH):
            # Nothing to tell anyone: no token computed, no page taken (and a router-aborted PD half's
            # peer half is aborted alike). Counted, as every answered abort is (it was not).
            self.unreserve(req)
            if self._on_failed:
                on_failed = self._on_failed
                self._send(("call", lambda: on_failed("abort")))
            yield _aborted_output(req, None)
            return
        box = OutputBox()
        self._streams[req.request_id] = (asyncio.get_running_loop(), box, req)
        self.unreserve(req)
        self._send(("add", req, prompt_text))
        if not self.alive:  # stopped or died meanwhile (its handler may have run before we registered)
            self._deliver(EngineDeadError("engine is not running"), req.request_id)
        if aborted:
            # A PD half: its peer's half may have been registered before the abort, or come after it.
            # The role ends the room on purpose, which tells the peer (whose half then answers "abort"
            # at once, not after a deadline); this half answers "abort" when the role says so.
            self._send(("abort", req.request_id, True))
        finished, last = False, None
        try:
            while True:
                item = await box.get()
                if isinstance(item, BaseException):
                    # `abort_now` ended it inside a PD transfer, or the peer's half was aborted.
                    if req.request_id in self._aborting or isinstance(item, RequestAborted):
                        finished = True
                        yield _aborted_output(req, last)
                        return
                    raise item
                finished, last = item.finished, item
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(req.request_id, None)
            self._aborting.discard(req.request_id)
            if not finished:
                self._ending.add(req.request_id)
                self._send(("abort", req.request_id, False, asyncio.get_running_loop()))

    async def pause(self, mode: str = "abort") -> int:
        """Event-loop thread (the pause routes of server/admin.py, for an RL trainer's weight update):
        from now on new requests wait in `generate()` until `resume()`; those in flight, by `mode`
        (PAUSE_MODES): "abort" ends each now (finish_reason "abort", as `abort_now()` does, also those
        still being checked when the engine was first paused); "in_place" stops the steps, so each
        keeps its pages and goes on where it was on resume; "retract" stops them too and frees each
        running request's pages, putting it back at the head of the queue with its tokens so far
        (recomputed on resume; weights loaded meanwhile compute it); "wait" returns once the engine has
        finished every one (not once their callers have read them). Pausing a paused engine applies the
        new mode to what is in flight (not to the requests waiting for the pause to end). Returns how
        many were aborted or retracted. PauseEnded if `resume()` came first (in "wait": before the
        requests finished)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, not {mode!r}")
        first = self.pause_mode is None
        if first:
            self._resumed = asyncio.Event()
        self.pause_mode = mode
        self._pause_seq += 1
        seq = self._pause_seq

        def hold(on: bool, retract: bool = False) -> int:
            # (engine thread, in inbox order, between two steps: no step runs after `pause` returns; a
            # hold queued before a `resume()` -- which bumped the sequence -- is stale, and skipped)
            if self._pause_seq != seq:
                return 0
            self._hold_steps = on
            return self.engine.retract_running() if retract else 0

        if mode == "wait":  # (one paused in place before lets its requests run to their end)
            await self.run(lambda: hold(False))
            while self._pause_seq == seq and await self.run(self.engine.has_unfinished):
                await asyncio.sleep(0.01)
            num = 0
        elif mode == "abort":
            # (a second pause logs no abort of everything: requests checked meanwhile wait for its end)
            num = await self.abort_now(None, log=first)
            await self.run(lambda: hold(True))
        else:
            num = await self.run(lambda: hold(True, mode == "retract"))
        if self._pause_seq != seq:
            raise PauseEnded("the pause was ended (or replaced) before it took effect")
        return num

    def resume(self) -> None:
        """Event-loop thread: end a pause; the requests it held go on, the waiting ones start."""
        if self.pause_mode is None:
            return
        self.pause_mode = None
        self._pause_seq += 1
        self.release_held()
        self._resumed.set()

    @property
    def pause_seq(self) -> int:
        """Pauses and resumes so far (a caller's `release_held(since=...)`)."""
        return self._pause_seq

    def release_held(self, since: int | None = None) -> None:
        """Event-loop thread (`resume`, and a weight update without SGLang's `keep_pause`): the requests
        a pause froze or retracted go on (new ones still wait for `resume()`). Queued behind any hold a
        pause sent the engine thread before, so it runs after it. `since` (a `pause_seq`): skipped if
        a pause or resume came after it -- an update's release, queued once the update ended, undid a
        pause that arrived during the update (a review, 2026-12-04)."""

        def release() -> None:
            if since is None or self._pause_seq == since:
                self._hold_steps = False

        self.call_soon(release)

    def is_active(self, request_id: str) -> bool:
        """Event-loop thread: whether a caller is iterating `generate()` for this id, or holds it
        while it waits to start (`reserve`)."""
        return request_id in self._streams or request_id in self._reserved or request_id in self._ending

    async def earlier_attempt_ended(self, rid: str, req: Request, timeout_s: float = RETRY_ID_WAIT_S) -> bool:
        """Event-loop thread: whether the request active under `rid` (`req`'s `/generate` rid) was an
        earlier attempt of this one -- a PD half of the same router in another room: the router
        retries a failed attempt with the client's body, rid included, after closing its connections
        -- and has ended within `timeout_s` (its handler notices the closed connection within
        CLIENT_POLL_S). The retry was refused as a duplicate id before, and the client got a 409
        about its own request."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while rid in self._ending and rid not in self._streams and rid not in self._reserved:
            if loop.time() > until:  # (an attempt whose caller left: its request ends on the engine thread)
                return False
            await asyncio.sleep(0.01)
        active = self._streams.get(rid) or self._reserved.get(rid)
        if active is None:
            return True
        other = active[2] if isinstance(active, tuple) else active
        if not (req.pd_router_id and other.pd_router_id == req.pd_router_id and other.pd is not None):
            return False
        if _room(other.pd) == _room(req.pd):
            return False  # (the same half twice: a real duplicate)
        while self.is_active(rid):
            if asyncio.get_running_loop().time() > until:
                return False
            await asyncio.sleep(0.01)
        return True

    def reserve(self, req: Request) -> None:
        """Event-loop thread: hold `req.request_id` for `req` until it is streamed (or `unreserve`), so
        that another request with that id is refused meanwhile (e.g. while the children of a batch wait
        for their siblings' checks). The caller checked `is_active` first."""
        self._reserved[req.request_id] = req

    def unreserve(self, req: Request) -> None:
        if self._reserved.get(req.request_id) is req:
            del self._reserved[req.request_id]

    def note_router_abort(self, router_id: str, router_epoch: int) -> None:
        """Event-loop thread (`/abort_request`, before `abort_now()`): router `router_id` aborts
        everything for the `router_epoch`-th time. Its requests sent before then reach the engine over
        separate connections, maybe after the abort: `aborted_in_transit` tells them."""
        self._router_aborts[router_id] = max(router_epoch, self._router_aborts.pop(router_id, 0))
        while len(self._router_aborts) > MAX_ROUTERS:
            self._router_aborts.popitem(last=False)

    def aborted_in_transit(self, router_id: str, router_epoch: int) -> bool:
        """Whether a PD half that router sent at its abort count `router_epoch` came after one of its
        aborts of everything (the route then marks it ABORTED_IN_TRANSIT_EPOCH)."""
        return router_epoch < self._router_aborts.get(router_id, 0)

    def note_router_named_abort(self, router_id: str, router_named: int, name: str) -> None:
        """Event-loop thread (`/abort_request` of one rid, before `abort_now()`): router `router_id`
        aborts `name`, its `router_named`-th named abort. Its halves of that request sent before then
        (`pd.router_named` lower) may reach this engine only after the abort: `_aborted_since` tells
        them, by the names they end up with (a `/generate` rid is set after validation)."""
        log = self._router_named.pop(router_id, None) or deque(maxlen=MAX_NAMED_ABORTS_PER_ROUTER)
        if len(log) == log.maxlen:
            log.popleft()
        # Kept in count order (`_named_by_router_since` stops at the first older one): the router sends
        # its aborts over separate connections, so one may overtake another.
        at = len(log)
        while at and log[at - 1][0] > router_named:
            at -= 1
        log.insert(at, (router_named, name))
        self._router_named[router_id] = log
        while len(self._router_named) > MAX_ROUTERS:
            self._router_named.popitem(last=False)

    def _named_by_router_since(self, req: Request) -> bool:
        """Whether the router that sent PD half `req` aborted it by name after sending it. (Per request:
        only the aborts since it was sent are read, newest first -- a router's counts only grow -- not
        the whole log, up to MAX_NAMED_ABORTS_PER_ROUTER names, an RL manager aborting many rids.)"""
        for number, name in reversed(self._router_named.get(req.pd_router_id, ())):
            if number <= req.pd_router_named:
                break
            if _named(req, name):
                return True
        return False

    def _aborted_since(self, req: Request) -> bool:
        """Whether an `abort_now()` since `req` arrived named it or everything (or the router aborted
        it: ROUTER_ABORTED_EPOCH, ABORTED_IN_TRANSIT_EPOCH, or by name after it sent it)."""
        if req.abort_epoch in (ROUTER_ABORTED_EPOCH, ABORTED_IN_TRANSIT_EPOCH):
            return True
        if self._named_by_router_since(req):
            return True
        for number, name in reversed(self._abort_log):
            if number <= req.abort_epoch:
                break
            if name is None or _named(req, name):
                return True
        return False

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id, False))

    async def abort_now(self, request_id: str | None = None, log: bool = True) -> int:
        """Event-loop thread: end the requests whose id or client id is `request_id` or starts with
        `<request_id>_` (the choices and prompts of one request, server/fanout.py; SGLang matches
        by prefix too), or with None every request being streamed, on behalf of someone other than
        their callers (SGLang's /abort_request). Each caller's stream ends with the output so far and
        finish_reason "abort" (a PD request still in transfer too: the role's failure reads as the
        abort), and its pages are freed. Returns how many there were. Without `log`, only those being
        streamed now: the requests still being checked go on (a second pause's abort, `pause`)."""

        if log:  # (a request still being checked that it names ends when it is streamed)
            self.num_aborts += 1
            self._abort_log.append((self.num_aborts, request_id))
        ids = [
            rid for rid, (_, _, req) in self._streams.items() if request_id is None or _named(req, request_id)
        ]
        self._aborting.update(ids)

        def abort() -> None:  # (engine thread)
            for rid in ids:
                if self.role is not None:
                    out = self.role.abort(rid, client_abort=True)
                else:
                    out = self.engine.abort(rid)
                if out is not None:
                    self.finish_aborted(out)

        if ids:
            await self.run(abort)
        return len(ids)

    async def abort_room(self, room: int, request_id: str) -> int:
        """Event-loop thread: end the PD half of `room` if it is this engine's request `request_id`
        (the router's, of an attempt it retries elsewhere: `role.abort_room`); 1 if there was one."""
        abort_room = getattr(self.role, "abort_room", None)
        if abort_room is None:
            return 0
        return await self.run(lambda: abort_room(room, request_id))

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread (the only thread that may touch engine state)."""
        self._send(("call", fn))

    async def run(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the engine thread between steps and return its result (or raise its error).
        EngineDeadError if the engine thread dies or stops before running it."""
        if not self.alive:
            raise EngineDeadError("engine is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        waiter = (loop, done)

        def call() -> None:
            try:
                result, error = fn(), None
            except Exception as e:  # noqa: BLE001 - handed to the caller
                result, error = None, e
            self._calls.discard(waiter)
            loop.call_soon_threadsafe(_settle, done, result, error)

        self._calls.add(waiter)
        self.call_soon(call)
        if not self.alive:  # died meanwhile (its handler may have run before we registered)
            self._fail_calls(EngineDeadError("engine is not running"))
        return await done

    def finish_aborted(self, out: RequestOutput) -> None:
        """Engine thread: a request the engine aborted on its own (e.g. for a weight update) ends its
        stream and counts as aborted, as a client's abort would."""
        # (observers before the stream, here and below: a client that has its answer finds it counted)
        if self._on_abort:
            self._on_abort(out)
        self._deliver(out, out.request_id)

    def _fail_calls(self, error: BaseException) -> None:
        for loop, done in list(self._calls):
            self._calls.discard((loop, done))
            loop.call_soon_threadsafe(_settle, done, None, error)

    def deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        """Engine thread only: push an output (or an error) to the request's stream."""
        self._deliver(out, request_id)

    def deliver_output(self, out: RequestOutput) -> None:
        """Engine thread only: an output whose token another engine generated (a PD decode's first
        token, handed over by the prefill) reaches its stream and `on_output` (a request that ended
        there was counted nowhere: it never passed through a step)."""
        if self._on_output:
            self._on_output(out)
        self._deliver(out, out.request_id)

    def deliver_failed(self, error: BaseException, request_id: str, finish_reason: str) -> None:
        """Engine thread only: the request ends with `error` instead of an output; `on_failed` counts it
        (`finish_reason` "abort" or "error")."""
        if self._on_failed:
            self._on_failed(finish_reason)
        self._deliver(error, request_id)

    def deliver_step_output(self, out: RequestOutput) -> None:
        """Engine thread only: an output computed outside `engine.step` (the prefill's layerwise lane)
        reaches the step observer (metrics) and its stream as a step's output would."""
        if self._on_step:
            self._on_step(self.engine, [out])
        self._deliver(out, out.request_id)

    def shutdown(self) -> None:
        """Stop the engine thread; every stream still open and every pending `run()` ends with
        EngineDeadError (they waited for good before)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        for rid in list(self._streams):
            self._deliver(EngineDeadError("engine stopped"), rid)
        self._fail_calls(EngineDeadError("engine stopped"))

    def _send(self, cmd: tuple) -> None:
        self._inbox.append(cmd)
        self._wake.set()

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, box, _ = target
            with contextlib.suppress(RuntimeError):  # (its loop closed: nobody is left to read it)
                loop.call_soon_threadsafe(box.put, out)

    def _settle_ending(self) -> None:
        """Engine thread: ids whose caller left and whose request the engine no longer holds (or held
        past ENDING_ID_MAX_S) are free for reuse again. (A PD role's own bookkeeping of an ended room
        already tells a retry's request apart: `by_request` is checked against the room.)"""
        now = time.monotonic()
        keep = []
        for rid, loop, until_s in self._ending_engine:
            if rid in self.engine.requests and now < until_s:
                keep.append((rid, loop, until_s))
                continue
            with contextlib.suppress(RuntimeError):  # (its loop closed: nobody is left to retry)
                loop.call_soon_threadsafe(self._ending.discard, rid)
        self._ending_engine = keep

    def _loop(self) -> None:
        engine, role = self.engine, self.role
        idle_checked = True
        last_report = 0.0
        next_check_s = 0.0  # monotonic time before which the next idle check waits
        idle_wait_s = 0.05 if role is not None else 0.5  # an idle loop's wait (a role polls its peers)
        try:
            while not self._stopped:
                while self._inbox:
                    cmd = self._inbox.popleft()
                    # (a command may end requests without a step, e.g. aborts while paused: the idle
                    # path below then refreshes the gauges and checks the pool again)
                    idle_checked = False
                    if cmd[0] == "add":
                        _, req, text = cmd
                        try:
                            if role is not None:
                                role.add(req, text)
                            else:
                                engine.add(req, text)
                        except Exception as e:  # duplicate id / room: report to that caller only
                            self._deliver(e, req.request_id)
                    elif cmd[0] == "abort":  # ("abort", request id, whether /abort_request named it
                        # [, the loop of a caller that left: told when nothing of the id is left])
                        rid, client_abort = cmd[1], cmd[2]
                        if len(cmd) > 3:
                            self._ending_engine.append((rid, cmd[3], time.monotonic() + ENDING_ID_MAX_S))
                        if role is not None:
                            aborted = role.abort(rid, client_abort=client_abort)
                        else:
                            aborted = engine.abort(rid)
                        if aborted is not None and self._on_abort:
                            self._on_abort(aborted)
                    elif cmd[0] == "call":  # run a function on the engine thread (role plumbing)
                        cmd[1]()
                role_busy = role.tick() if role is not None else False
                if self._ending_engine:
                    self._settle_ending()
                if engine.has_unfinished() and not self._hold_steps:
                    outputs = engine.step()
                    if outputs:
                        self.last_output_s = time.monotonic()
                    if self._on_step:  # (first: a client that has its answer finds it counted)
                        self._on_step(engine, outputs)
                    for out in outputs:
                        self._deliver(out, out.request_id)
                    idle_checked = False
                    continue
                if role_busy:  # transfers in flight: poll again soon, but do not spin
                    now = time.monotonic()
                    if self._on_step and now - last_report >= 0.05:  # keep gauges fresh, cheaply
                        self._on_step(engine, [])
                        last_report = now
                    self._wake.wait(timeout=0.001)
                    self._wake.clear()
                    idle_checked = False
                    continue
                if not idle_checked:
                    now = time.monotonic()
                    if self._check_idle and now < next_check_s:  # the last check was recent: later
                        if self._on_step:
                            self._on_step(engine, [])  # (gauges show the idle engine meanwhile)
                        # No longer than the idle loop's usual wait: a role's control messages (an
                        # abort's ack, a KVRequest ahead of its request) arrive without waking us.
                        self._wake.wait(timeout=min(next_check_s - now, idle_wait_s))
                        self._wake.clear()
                        continue
                    if self._check_idle:
                        # Its cost in this thread's CPU time: a check slowed by other threads holding
                        # the GIL, or a stopped process, must not push the next one far out.
                        cpu_s = time.thread_time()
                        engine.check_integrity()
                        if role is not None:
                            role.check_integrity()
                        cost_s = time.thread_time() - cpu_s
                        next_check_s = now + min(MAX_IDLE_CHECK_DEFER_S, cost_s / IDLE_CHECK_SHARE)
                    if self._on_step:
                        self._on_step(engine, [])
                    idle_checked = True
                self._wake.wait(timeout=idle_wait_s)
                self._wake.clear()
        except BaseException as e:  # the engine is broken: fail every waiter, never hang them
            log.exception("engine thread died")
            self.error = e
            for rid in list(self._streams):
                self._deliver(EngineDeadError(f"engine failed: {e!r}"), rid)
            self._fail_calls(EngineDeadError(f"engine failed: {e!r}"))


def _named(req: Request, name: str) -> bool:
    """Whether `/abort_request` of `name` means `req`: its id or its client's id is `name` or starts
    with `<name>_` (the choices and prompts of one request, server/fanout.py; SGLang matches by
    prefix too). A client's own `request_id` names it too: the answer's id is "cmpl-" + it (an abort
    by the id the client chose found nothing and still said success)."""

    def names(x: str, n: str) -> bool:
        return x == n or x.startswith(f"{n}_")

    client_id = req.client_id or req.request_id
    # (also for a chosen id that starts with "cmpl-" itself: its answer's id is "cmpl-cmpl-...")
    return names(req.request_id, name) or names(client_id, name) or names(client_id, f"cmpl-{name}")


def _settle(done: asyncio.Future, result, error) -> None:
    """(event-loop thread) Answer a `run` caller once."""
    if not done.done():
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)


def _aborted_output(req: Request, last: RequestOutput | None) -> RequestOutput:
    """The final output of a request `abort_now` ended while its PD role held it, or whose PD peer
    ended its room on purpose (RequestAborted; no engine output says so): what it had produced,
    finish_reason "abort"."""
    o = last.outputs[0] if last is not None else None
    if o is not None and o.logprobs is not None:
        logprobs = list(o.logprobs)
    else:  # (none produced yet: an empty list when they were asked for)
        logprobs = [] if req.sampling_params.logprobs is not None else None
    return RequestOutput(
        request_id=req.request_id,
        prompt=None,
        prompt_token_ids=list(req.prompt_token_ids),
        outputs=[
            CompletionOutput(
                index=0,
                text=o.text if o else "",
                token_ids=list(o.token_ids) if o else [],
                logprobs=logprobs,
                finish_reason="abort",
                stop_reason="aborted",
            )
        ],
        finished=True,
        num_cached_tokens=last.num_cached_tokens if last is not None else 0,
    )
