"""`pdserve router`: the OpenAI-compatible front of a PD cluster.

Per request: assign a fresh room, pick a prefill (round robin over healthy ones) and a decode (fewest
requests in flight), post the client's body to both — the prefill's copy marked to stop after token 1
and not stream, the decode's copy told where the prefill's bootstrap server is — and relay the
decode's response. The decode's bytes are held back until the prefill answered, so a prefill that
fails before any KV could have been sent is retried on another prefill (fresh room) without the
client noticing. A client that disconnects aborts both sides: while it streams, the engines' handlers
see their connections close; while the router waits for it (placement, the prefill's answer, a
non-streamed decode), the router polls the client's connection and closes both legs itself. An
`/abort_request` of everything also ends what the router still holds: a request that came before it
(waiting in placement, or not yet sent) is sent with `pd.aborted`, and both engines answer "abort".
One already sent but not yet taken in by an engine when it gets the abort ends too: each half carries
the router's id and abort count (`pd.router_id`, `pd.router_epoch`), so does the abort, and an
engine aborts a half of an earlier count on arrival (its role tells the peer, as for any abort).
An `/abort_request` of one `rid` ends what the router still holds of that name alike (`abort_named`),
and a half of it on its way: halves and the abort carry the router's count of named aborts
(`pd.router_named`).
Engines are health-checked in the background; a dead one gets no new requests. What any engine
answers alike (`/v1/models`, `/tokenize`, `/get_model_info`, `/get_weight_version`) goes to one live engine; what every engine
must do (`/abort_request`, `/flush_cache`, `/reset_prefix_cache`, `/update_weights_from_disk`) goes to
all of them (``router/control.py``; a weight update holds new requests at `Router.open` meanwhile).

Length (~860 lines): the dispatch protocol (hold the decode's bytes until the prefill answered, retry,
abort both on disconnect, hold during a weight update), which reads best in one place. Around it:
``router/engines.py`` (an engine as the router sees it), ``router/legs.py`` (an attempt's legs and
the relay), ``router/routes.py`` (the HTTP app), ``router/placement.py`` (DualPath placement),
``router/control.py`` (the control routes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from typing import NamedTuple

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.disagg.state import TRANSFER_FAILED, new_room
from pdserve.router.engines import (
    NO_ANSWER,
    Engine,
    EngineDown,
    NoEngine,
    same_weights,
    unless_down,
    unless_set,
)
from pdserve.router.legs import (
    ABORT_TIMEOUT_S,
    JSON,
    Leg,
    PrefillWaitAborted,
    Relay,
    engine_json,
    error_type,
    prefill_unless_decode_fails,
)
from pdserve.router.placement import Placement, PlacementAborted, PlacementError
from pdserve.router.prompts import (
    completion_view,
    prompt_pieces,
    prompt_shape,
    requested_max_tokens,
)
from pdserve.server.disconnect import ClientGone, unless_gone
from pdserve.server.protocol import PREFILL_UNREACHABLE, error_body, request_id_of

log = logging.getLogger(__name__)


# (a 503's reason when the engines are healthy but each one failed this request: e.g. its attempts'
# deadlines ran out waiting for pages under overload, which "no healthy prefill engine" alone misnamed)
_LEFT_TO_TRY = " left to try (each healthy one failed this request)"
KEEPALIVE_CONNECTIONS = 256  # idle connections to the engines kept for reuse (more are closed)
# An idle connection is dropped this long after its last use, well before an engine's server closes it
# (uvicorn: 5 s, cli.SERVER_KEEP_ALIVE_S: 15 s). At equal times (httpx's default is uvicorn's 5 s) a
# request could go out on a connection the engine was closing that instant: a ReadError, which the
# router reads as a dead decode (a 503 with one decode; seen in CI after a 120-child burst left many
# idle connections).
KEEPALIVE_EXPIRY_S = 2.0


STOPPING = "the router is shutting down"


class RouterStopping(Exception):
    pass


class Arrival(NamedTuple):
    """What a request's dispatch remembers of its arrival: the router's `abort_all` count (`epoch`),
    its count of named aborts, and the request's name (`client_name`)."""

    epoch: int
    named_at: int
    name: tuple[str, ...]


PREFILL_TIMEOUT_MARGIN_S = 5.0  # on top of a prefill's three state deadlines (see Router.prefill_timeout)
# The decode leg has no read timeout: a whole (non-streamed) answer's headers come after its last token,
# and one that took longer than the client's 600 s default was read as a failed decode, thrown away
# and run again from scratch, up to 3 times (a review, 2026-12-04: RL rollouts of 16-32k tokens). It
# ends when the answer does, when the engine is declared down (`unless_down`) or the client leaves.
DECODE_LEG_TIMEOUT = httpx.Timeout(None, connect=5.0)

MAX_NAMED_ABORTS = 4096  # named aborts remembered (a request held longer than that many is not matched)


class Siblings:
    """The choices of one prompt of an `n` > 1 request under DualPath placement. The first is placed
    (`leader`); the others wait for it and follow it to its prefill and read path, which then computes
    their shared prompt once (the engine scheduler's in-flight prefix sharing), each to a decode of
    its own. Placed one by one, they went to different prefills (the scheduler's least-loaded one
    after each), each computing the whole prompt, and the router's prefix index counted the first's
    prompt as the others' stored hits. `placed`: (prefill, read path), or None when the first was not
    placed (each other is then placed on its own). `num_choices`: how many there are (the first's
    placement reads the stored prompt on the PE side, once for all: `PendingRequest.num_choices`)."""

    def __init__(self, num_choices: int) -> None:
        self.num_choices = num_choices
        self.placed: asyncio.Future = asyncio.get_running_loop().create_future()

    def settle(self, placed: tuple | None) -> None:
        if not self.placed.done():
            self.placed.set_result(placed)


def client_name(path: str, body: dict) -> tuple[str, ...]:
    """The names a client may abort a request by before any engine answered: the `rid` it gave a
    `/generate`, or the `request_id` it gave an OpenAI route and the answer's id it makes, "cmpl-" +
    it (as the engines' `async_engine._named`)."""
    name = body.get("rid") if path == "/generate" else body.get("request_id")
    if not isinstance(name, str) or not name:
        return ()
    return (name,) if path == "/generate" else (name, f"cmpl-{name}")


def names_match(names: tuple[str, ...], aborted: str) -> bool:
    """As the engines match an abort's rid: a name itself, or a child of it (`<name>_...`), a chat
    answer's id ("chatcmpl-<x>") naming its request ("cmpl-<x>", `request_id_of`)."""
    aborted = request_id_of(aborted)
    return any(n == aborted or n.startswith(aborted + "_") for n in names)


def unavailable(message: str) -> JSONResponse:
    """A 503 in OpenAI's error shape: the client's to retry (no engine, or the router stopping)."""
    return JSONResponse(error_body(message, 503, "ServiceUnavailable"), 503)


def client_gone() -> JSONResponse:
    """What a handler returns for a client that left (nobody reads it; logs and metrics do)."""
    return JSONResponse(error_body("client disconnected", 499, "ClientClosedRequest"), 499)


class Router:
    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        health_interval_s: float = 1.0,
        max_prefill_attempts: int = 3,
        read_path: str = "none",
        policy: str = "none",
        load_interval_s: float = 0.05,
        alpha_tokens: int | None = None,
        beta_tokens: int | None = None,
        api_key: str | None = None,
    ) -> None:
        self.api_key = api_key  # clients must send it (server/auth.py); we send it to the engines
        self.prefills = [Engine(u.rstrip("/"), "prefill") for u in prefill_urls]
        self.decodes = [Engine(u.rstrip("/"), "decode") for u in decode_urls]
        # DualPath: with a policy, the scheduler of pdserve.dualpath picks (PE, DE, read path) per
        # request from the engines' load reports; "none" keeps the plain PD choice below.
        self.policy = policy
        self.load_interval_s = load_interval_s
        self.placement = (
            None
            if policy == "none"
            else Placement(policy, self.prefills, self.decodes, alpha_tokens, beta_tokens)
        )
        self.health_interval_s = health_interval_s
        self.max_prefill_attempts = max_prefill_attempts
        self._health_lock = asyncio.Lock()
        self._rr = itertools.count()
        # No cap on connections to the engines: each request holds its decode's stream open, and a
        # split request's children hold theirs until every child has started (fanout.merged), so
        # httpx's default pool of 100 deadlocked a streamed list of 120 prompts, and the health checks
        # queued behind it marked every engine down (a review of n > 1 and prompt lists). Requests
        # are bounded by the clients and the engines' own queues, not by this pool.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0, connect=5.0),
            limits=httpx.Limits(
                max_connections=None,
                max_keepalive_connections=KEEPALIVE_CONNECTIONS,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        )
        self.retries_by_side = {"prefill": 0, "decode": 0}  # attempts retried, by the side that failed
        self._background: set[asyncio.Task] = set()  # (fire-and-forget calls, referenced till they end)
        # (prefill url, client rid) -> the abort ending a failed half there that may hold that rid: a
        # request with the rid waits for it before it is sent to that prefill (else a duplicate id)
        self._halves_ending: dict[tuple[str, str], asyncio.Task] = {}
        self.read_path = read_path  # DualPath: none | pe | de | auto (per request, by reads in flight)
        self.reads_in_flight = {"pe": 0, "de": 0}
        self.abort_epoch = 0  # `abort_all`s so far: a request that came in before the last one is aborted
        self.num_held_aborts = 0  # the clients' `abort_all`s: they also end requests a weight update holds
        # Aborts of one request by its name (`abort_named`), numbered, the last MAX_NAMED_ABORTS: a request
        # remembers how many there were when it came in, and one that named it since is sent aborted.
        self.num_named_aborts = 0
        self._named_aborts: deque[tuple[int, str]] = deque(maxlen=MAX_NAMED_ABORTS)
        # The attempts waiting for their prefill's answer: each one's event is set by an abort that
        # names it, which ends that wait (a paused prefill would answer only at its timeout).
        self._abort_watch: dict[asyncio.Event, Arrival] = {}
        self.router_id = uuid.uuid4().hex  # (new at each start: the engines keep each router's count)
        self.num_dispatching = 0  # requests inside `dispatch` (placement, the prefill's answer, ...)
        self.num_relaying = 0  # ... and past it: the decode's answer being relayed (`Relay`)
        self.num_held = 0  # ... and before it: held while a weight update or a pause is on
        self.open = asyncio.Event()  # cleared while a weight update or a pause holds new requests
        self.open.set()
        self.pause_mode: str | None = None  # a client's pause (router/control.py), until it ends it
        self.pause_seq = 0  # pauses and resumes so far (a pause overtaken by a resume says so)
        self.stopping = asyncio.Event()  # set by `shut_down` (Ctrl-C): everything still relayed ends
        self.update_lock = asyncio.Lock()  # one weight update at a time
        self.weights_path: str | None = None  # the checkpoint of the last update (None: as launched)
        # ... and the identity its engines reported (a trainer that rewrites one directory every step
        # keeps the path: an engine that missed an update is told by this)
        self.weights_id: str | None = None

    def resume(self) -> None:
        """A client ends its pause (`/continue_generation`, `/resume`): held requests go, unless a
        weight update still holds them (it lets them go when it ends)."""
        self.pause_mode = None
        self.pause_seq += 1
        self.reopen()

    def reopen(self, update_ending: bool = False) -> None:
        """Let held requests go: at the end of a weight update (`update_ending`; unless the cluster is
        paused), or of a pause (unless an update is still on: it reopens when it ends)."""
        if self.pause_mode is None and (update_ending or not self.update_lock.locked()):
            self.open.set()

    @property
    def num_retries(self) -> int:
        return sum(self.retries_by_side.values())

    def num_in_flight(self) -> int:
        """Requests this router has taken in and not yet answered to the end."""
        # (not the decodes' in-flight counts: a request in `dispatch` holds its leg's count too, so each
        # was counted twice in the gauge and in a weight update's "N requests still in flight")
        return self.num_dispatching + self.num_relaying

    async def drained(self) -> None:
        """Until every request in flight has ended (new ones are held: `open` is clear)."""
        while self.num_in_flight():
            await asyncio.sleep(0.01)

    def abort_all(self, held_too: bool = True) -> dict:
        """An `/abort_request` of everything: the requests this router holds end too. Each one that
        came in before it is sent to its engines marked `pd.aborted` (they answer "abort", in the
        client's format, with nothing computed): those waiting in placement at once, those a weight
        update holds when it lets them go (unless `held_too` is False: the update's own
        `abort_running` ends only what runs). Returns the fields the abort takes to the engines
        (this router's id and new abort count), for the halves it sent earlier that reach an
        engine after the abort."""
        self.abort_epoch += 1
        self.num_held_aborts += held_too
        for event in self._abort_watch:
            event.set()
        if self.placement is not None:
            self.placement.abort_waiting()
        return {"router_id": self.router_id, "router_epoch": self.abort_epoch}

    def abort_named(self, name: str) -> dict:
        """An `/abort_request` of one `rid`: the requests of that name this router still holds end too
        -- those waiting in placement at once, those a weight update holds when it lets them go, and
        one between two attempts -- each sent to its engines marked `pd.aborted`, which answer "abort".
        The engines only abort what they already run: a request held here was sent later, unmarked,
        and ran to the end as if never aborted. (A name ends a split request's children too: theirs
        start with it and "_", as the engines match them.) Returns the fields the abort takes to the
        engines (this router's id and new count of named aborts), for a half it sent earlier that
        reaches an engine after the abort (each half carries the count when it was sent)."""
        self.num_named_aborts += 1
        self._named_aborts.append((self.num_named_aborts, name))
        for event, arrival in self._abort_watch.items():
            if names_match(arrival.name, name):
                event.set()
        if self.placement is not None:
            self.placement.abort_waiting(lambda waiting_name: names_match(waiting_name, name))
        return {"router_id": self.router_id, "router_named": self.num_named_aborts}

    def named_abort_since(self, arrival: Arrival) -> bool:
        """Whether an `abort_named` since the request came in named it."""
        if not arrival.name or arrival.named_at == self.num_named_aborts:
            return False
        return any(n > arrival.named_at and names_match(arrival.name, a) for n, a in self._named_aborts)

    async def shut_down(self) -> None:
        """The router's Ctrl-C or SIGTERM (cli: awaited shortly before the server cancels what still
        runs, after the engines' own aborts): every request it still relays ends as the router means
        it to -- a stream with a 503 error event and [DONE], a whole answer, or one waiting for its
        prefill or its placement, with a 503 body -- instead of the cancel's plain-text 500 (which the
        OpenAI client retries) and a stream cut without [DONE]. Each one's decode leg is closed,
        which aborts it there; the engines keep serving other routers' requests (an `/abort_request`
        of everything would end those too)."""
        self.stopping.set()
        for e in self.prefills + self.decodes:
            e.healthy = False
            e.down_reason = f"is out of reach: {STOPPING}"
            e.down.set()
        if self.placement is not None:
            self.placement.abort_waiting()  # (then no engine is healthy: a 503)

    async def check_health(self) -> None:
        if self.stopping.is_set():  # (shut_down took every engine out of service for good)
            return

        async def one(e: Engine) -> None:
            refused = False  # (its port closed: it stopped listening, shutting down or dead)
            answered = False  # (it answered, and said it cannot serve: out at once, no second chance)
            why = NO_ANSWER
            try:
                r = await self.client.get(e.url + "/pd/info", timeout=2.0)
                info = r.json()
                if not isinstance(info, dict):
                    raise ValueError("not a JSON object")  # (a proxy's page; it killed the health loop)
                ok = r.status_code == 200 and info.get("role") == e.role
                answered = r.status_code == 200 and not ok
                if ok:
                    e.bootstrap_url, e.model = info.get("bootstrap_url", ""), info.get("model", "")
                    e.deadline_s = float(info.get("deadline_s") or 0.0)
                    e.model_path = str(info.get("model_path", ""))
                    e.weights_id = str(info.get("weights_id", ""))
                    capacity = info.get("kv_capacity_tokens")
                    e.kv_capacity_tokens = capacity if type(capacity) is int and capacity > 0 else 0
                    # (an engine whose thread died or whose weights were lost answers, saying so; the
                    # latter is stale: the next update is what brings it back)
                    status = info.get("status", "ok")
                    if status == "weights lost":
                        e.stale = True
                    elif self.weights_id and e.weights_id:
                        e.stale = e.weights_id != self.weights_id
                    else:
                        e.stale = self.weights_path is not None and e.model_path != self.weights_path
                    ok = not e.stale and status == "ok"
                    answered = not ok
                    if status != "ok":
                        why = f"reports status {status!r}"
                    elif e.stale:
                        why = "serves other weights than the cluster's last update"
                elif r.status_code != 200:
                    why = f"answered its health check with HTTP {r.status_code}"
                else:
                    why = f"answers as a {info.get('role')!r} engine, not a {e.role}"
            except httpx.ConnectError:
                ok, refused = False, True
            except (httpx.HTTPError, ValueError):
                ok = False
            except Exception as ex:  # noqa: BLE001 - a malformed answer (a field of the wrong type)
                # is a missed check, not the end of the health loop: it died silently on one, and no
                # engine was ever marked down or back up again (a review, 2026-12-04)
                ok = False
                why = f"answered its health check with a malformed body: {ex!r}"
                if e.misses == 0:
                    log.warning("router: %s %s", e.url, why)
            if self.stopping.is_set():  # (shut_down ran while this check waited: it stays out)
                return
            e.misses = 0 if ok else e.misses + 1
            was = e.healthy
            # Two missed checks (no answer) before it is out: one lost check is no outage. An engine
            # that answers it serves other weights, lost them, died inside or has another role is out
            # at once: after a weight update it failed, the held requests went to it otherwise.
            e.healthy = ok or (e.healthy and e.misses < 2 and not answered)
            # Out of service: no new requests. What it still runs is cut (`down`) unless its port was
            # refused: an engine in its graceful shutdown closes its port first and ends its requests
            # itself (a Ctrl-C'd engine answers them "abort"; they were cut with a 503 the client
            # retries), and a dead one's connections break on their own. One that accepts but does not
            # answer (paused, wedged) or says it cannot serve is cut.
            if not e.healthy and not refused and not e.down.is_set():
                e.down_reason = why
                e.down.set()
            elif e.healthy and e.down.is_set():
                e.down = asyncio.Event()
            if was != e.healthy and self.placement is not None:
                self.placement.on_health(e)

        # One check at a time: the loop's and a weight update's (`control.py`) ran at once, and an
        # engine's two missed checks, counted together, took it out on a single blip.
        async with self._health_lock:
            await asyncio.gather(*(one(e) for e in self.prefills + self.decodes))

    async def health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # (a bug in one round must not end the checks for good)
                log.exception("router: health check round failed")
            await asyncio.sleep(self.health_interval_s)

    async def load_loop(self, e: Engine) -> None:
        """Poll one engine's load report for the placement (pulled: engines need no router address)."""
        failing = False
        while True:
            try:
                r = await self.client.get(e.url + "/pd/load", timeout=1.0)
                if r.status_code == 200:
                    report = r.json()
                    if not isinstance(report, dict):
                        raise ValueError(f"a load report must be a JSON object, not {type(report).__name__}")
                    self.placement.on_load(e, report)
                failing = False
            except httpx.HTTPError:
                pass
            except Exception as ex:  # noqa: BLE001 - a malformed report is skipped: the loop goes on
                if not failing:  # (it died on one before, freezing that engine's load in placement)
                    log.warning("router: %s: bad load report: %r", e.url, ex)
                failing = True
            await asyncio.sleep(self.load_interval_s)

    def prefill_timeout(self, pe: Engine) -> httpx.Timeout:
        """How long to wait for a prefill's answer. A live prefill answers (token 1, or the room's
        failure) within its three state deadlines (Bootstrapping, WaitingForInput, Transferring), each
        enforced on the engine; one that does not is paused or wedged, and without a bound of our own
        its clients waited until it came back (found by the chaos suite: SIGSTOP of a prefill). Past
        the bound the attempt counts as a prefill failure before any KV: retried on another prefill,
        the decode leg closed (which aborts its room)."""
        if pe.deadline_s <= 0:  # an engine that does not report its deadline: the client's default
            return self.client.timeout
        return httpx.Timeout(600.0, connect=5.0, read=3 * pe.deadline_s + PREFILL_TIMEOUT_MARGIN_S)

    # Pairs serve one weights identity. Engines on other weights than the cluster's last update are
    # out of service (`Engine.stale`), but a router that (re)started since knows of no update: its
    # engines may disagree (one restarted on its launch checkpoint), and a prefill and a decode of
    # different weights refuse each other's registration (each such attempt a 503). Placement and
    # plain picks choose as ever; the decode is then one of the prefill's weights (`like`), and a
    # prefill without such a decode is taken only if no prefill has one.
    def pick_prefill(self, exclude: set[str], decodes_left_out: set[str] = frozenset()) -> Engine:
        """Round robin over the live prefills not in `exclude`, those with a live decode of their
        weights not in `decodes_left_out` (that failed this request) first."""
        live = [e for e in self.prefills if e.healthy and e.url not in exclude]
        if not live:
            raise NoEngine("no healthy prefill engine" + _LEFT_TO_TRY * any(e.healthy for e in self.prefills))
        paired = [
            pe
            for pe in live
            if any(d.healthy and d.url not in decodes_left_out and same_weights(pe, d) for d in self.decodes)
        ]
        live = paired or live
        return live[next(self._rr) % len(live)]

    def pick_decode(self, exclude: set[str] = frozenset(), like: Engine | None = None) -> Engine:
        """The live decode with the fewest requests in flight, not in `exclude`, of `like`'s weights."""
        live = [e for e in self.decodes if e.healthy and e.url not in exclude]
        if not live:
            raise NoEngine("no healthy decode engine" + _LEFT_TO_TRY * any(e.healthy for e in self.decodes))
        if like is not None:
            live = [e for e in live if same_weights(like, e)]
            if not live:
                raise NoEngine(f"no healthy decode engine serves the weights of prefill {like.url}")
        return min(live, key=lambda e: e.in_flight)

    def _paired(self, pe: Engine, de: Engine | None) -> tuple[Engine, Engine]:
        """`pe` and `de` if they serve one weights identity; else `pe` with a decode of its weights; with
        none, another prefill that has one (`pick_prefill`) and a decode of its weights. NoEngine when
        there is no such pair."""
        if de is not None and same_weights(pe, de):
            return pe, de
        try:
            return pe, self.pick_decode(like=pe)
        except NoEngine:
            pe = self.pick_prefill(set())
            return pe, self.pick_decode(like=pe)

    def _biggest_decodes(self, de: Engine, pe: Engine) -> list[Engine]:
        """The live decodes of `pe`'s weights with the biggest KV pool (as reported), if bigger than
        `de`'s; else none."""
        live = [e for e in self.decodes if e.healthy and e.kv_capacity_tokens and same_weights(pe, e)]
        most = max((e.kv_capacity_tokens for e in live), default=0)
        if not de.kv_capacity_tokens or most <= de.kv_capacity_tokens:
            return []
        return [e for e in live if e.kv_capacity_tokens == most]

    def choose_read_path(self, requested: str | None) -> str:
        """The request's own `read_path` wins; `auto` takes the side with fewer store reads in flight
        (DualPath's read-path rule, with this router's own count standing in for the node read queues)."""
        choice = requested or self.read_path
        if choice == "auto":
            choice = "pe" if self.reads_in_flight["pe"] <= self.reads_in_flight["de"] else "de"
        return choice

    async def dispatch(
        self,
        path: str,
        body: dict,
        http: Request,
        prefill: Engine | None = None,
        siblings: Siblings | None = None,
        leader: bool = False,
    ):
        """`prefill`: the prefill to try first (plain routing; the children of one `n` > 1 request all
        go to one, which then computes their shared prompt once: see the scheduler's in-flight prefix
        sharing). Decodes are still picked per request, to spread the n generations. `siblings`,
        `leader`: the same under DualPath placement (`Siblings`)."""
        epoch, held_aborts, named_at = self.abort_epoch, self.num_held_aborts, self.num_named_aborts
        while not self.open.is_set():  # a weight update or a pause is on: wait for its end (again, if
            self.num_held += 1  # another update closed the door before this request woke up)
            try:
                await unless_gone(http, unless_set(self.stopping, self.open.wait(), RouterStopping))
            except ClientGone:
                return client_gone()
            except RouterStopping:
                return unavailable(STOPPING)
            finally:
                self.num_held -= 1
        if self.num_held_aborts == held_aborts:
            # (held through an update's own `abort_running` at most: it ends the requests running,
            # not those it held, which go on under the new weights)
            epoch = self.abort_epoch
        arrival = Arrival(epoch, named_at, client_name(path, body))
        self.num_dispatching += 1  # (in the same step as the check: a drain that starts now counts it)
        try:
            if self.placement is not None:
                if leader and siblings is not None:
                    try:
                        return await self._dispatch_placed(path, body, http, arrival, siblings)
                    finally:
                        siblings.settle(None)  # (not placed: the others are placed on their own)
                return await self._dispatch_placed(path, body, http, arrival, follow=siblings)
            read_path = self.choose_read_path(body.pop("read_path", None))
            if read_path in self.reads_in_flight:
                self.reads_in_flight[read_path] += 1
            try:
                first = (prefill, None) if prefill is not None else None
                return await self._dispatch(path, body, http, read_path, arrival, first=first)
            finally:
                if read_path in self.reads_in_flight:
                    self.reads_in_flight[read_path] -= 1
        finally:
            self.num_dispatching -= 1

    async def _dispatch_placed(
        self,
        path: str,
        body: dict,
        http: Request,
        arrival: Arrival,
        lead: Siblings | None = None,
        follow: Siblings | None = None,
    ):
        """DualPath placement: wait in the scheduler's FIFO for (PE, DE, read path), then dispatch.
        `lead`: tell these siblings where this request was placed; `follow`: go where their leader was
        placed, to a decode of its own (`Siblings`)."""
        if body.pop("read_path", None) not in (None, "auto"):
            return JSONResponse(
                error_body(
                    f"read_path is chosen by the router's {self.policy} policy", 400, param="read_path"
                ),
                400,
            )
        view = completion_view(path, body)
        try:
            prompt_ids, prompt_len = prompt_shape(view)
            max_tokens = requested_max_tokens(path, body)
        except ValueError as e:  # what the engines would refuse too, but placement needs the numbers first
            return JSONResponse(error_body(str(e), 400), 400)
        if follow is not None:
            try:
                placed = await unless_gone(http, asyncio.shield(follow.placed))
            except ClientGone:
                return client_gone()
            if placed is not None and placed[0].healthy:
                try:
                    de = self.pick_decode(like=placed[0])
                except NoEngine:
                    de = None  # (`_attempts` pairs it, or says why not)
                return await self._dispatch(path, body, http, placed[1], arrival, first=(placed[0], de))
            if arrival.epoch < self.abort_epoch or self.named_abort_since(arrival):
                # (its leader's wait in placement was aborted, which names it too: it answers "abort"
                # at once, as its leader did, not after a wait of its own in the queue)
                return await self._dispatch(path, body, http, "none", arrival)
        try:
            pieces = prompt_pieces(view) if prompt_ids is None else None
            num_choices = lead.num_choices if lead is not None else 1
            salt = body.get("cache_salt")  # (a bad one is the engines' 400)
            placing = self.placement.place(
                prompt_ids,
                prompt_len,
                max_tokens,
                pieces,
                arrival.name,
                num_choices,
                salt if isinstance(salt, str) else None,
            )
            assigned = await unless_gone(http, placing)
            a = assigned.assignment
        except ClientGone:
            return client_gone()
        except PlacementAborted:  # an abort named it (or all) while it waited: any live engines answer
            # its "abort" (with none live, the 503 any request gets then)
            return await self._dispatch(path, body, http, "none", arrival)
        except PlacementError as e:
            if e.status == 503:
                return unavailable(STOPPING if self.stopping.is_set() else str(e))
            return JSONResponse(error_body(str(e), e.status), e.status)
        except TimeoutError:
            return unavailable("timed out waiting for placement")
        pe, de = self.prefills[a.prefill_engine], self.decodes[a.decode_engine]
        if not de.healthy:  # round robin ignores health: take a live decode instead
            try:
                de = self.pick_decode()
            except NoEngine as e:
                return unavailable(str(e))
        try:  # (before its siblings follow it: to the prefill it will really use)
            pe, de = self._paired(pe, de)
        except NoEngine as e:
            return unavailable(STOPPING if self.stopping.is_set() else str(e))
        if lead is not None:
            lead.settle((pe, a.read_path))
        response = await self._dispatch(path, body, http, a.read_path, arrival, first=(pe, de))
        if response.status_code < 400:  # (taken: its prompt is a hit for the next ones from now on)
            self.placement.record(assigned)
        return response

    async def _dispatch(
        self,
        path: str,
        body: dict,
        http: Request,
        read_path: str,
        arrival: Arrival,
        first: tuple | None = None,
    ):
        """`arrival`: the router's abort counts when the request came in (see `abort_all`,
        `abort_named`), and its name. Each attempt's
        decode leg is a `Leg`: closed (the decode aborts) and its in-flight count dropped exactly once,
        on every way out that does not hand it to the relay, cancellation included (a merged request
        cancels its other children when one fails)."""
        legs: list[Leg] = []
        try:
            return await self._attempts(path, body, http, read_path, arrival, first, legs)
        finally:
            for leg in legs:
                if not leg.done:
                    with anyio.CancelScope(shield=True):
                        await leg.close()

    async def _attempts(self, path, body, http, read_path, arrival, first, legs: list[Leg]):
        """(`_dispatch`'s attempts: up to `max_prefill_attempts`, each leg appended to `legs`)"""
        tried: set[str] = set()  # prefills that failed an attempt
        failed_decodes: set[str] = set()  # decodes that did (the prefill is then tried again)
        last_error = "no attempt"
        # (the side the last attempt failed on: a retry, counted and logged once the next attempt has
        # its engines -- with none left to try, or no attempt left, nothing was retried)
        failed_side: str | None = None
        de_before = ""  # the last attempt's decode
        # (a /generate under the client's own rid: a failed attempt's half may hold that rid on its
        # prefill until it is ended there, by its room)
        client_rid: str | None = body["rid"] if path == "/generate" and arrival.name else None
        for attempt in range(self.max_prefill_attempts):
            try:
                if attempt == 0 and first is not None and first[0] is not None and first[0].healthy:
                    pe, de = self._paired(first[0], first[1])
                else:
                    pe = self.pick_prefill(tried, failed_decodes)
                    de = first[1] if first is not None and first[1] is not None else None
                    # (a /generate with the client's rid: the last attempt's decode may hold that rid
                    # until its abort lease ends (its room waits for the dead prefill's ack), so a
                    # retry there was a 409 about the client's own request: another decode if any)
                    keep_apart = failed_decodes | ({de_before} if client_rid is not None else set())
                    if de is None or de.url in keep_apart or not same_weights(pe, de):
                        try:
                            de = self.pick_decode(keep_apart, like=pe)
                        except NoEngine:
                            de = self.pick_decode(failed_decodes, like=pe)
            except NoEngine as e:
                why = STOPPING if self.stopping.is_set() else f"{e} ({last_error})"
                return unavailable(why)
            if client_rid is not None:
                # A half of this rid still being ended there (this request's earlier attempt, or an
                # earlier request's): it ends first. Elsewhere nothing waits for it (a paused prefill
                # held every retry up to 5 s).
                ending = self._halves_ending.get((pe.url, client_rid))
                if ending is not None:
                    await asyncio.shield(ending)
            if failed_side is not None:
                self.retries_by_side[failed_side] += 1
                log.warning("retrying on another %s: %s", failed_side, last_error)
            tried.add(pe.url)
            de_before = de.url
            room = new_room()
            epoch = arrival.epoch
            pd = {
                "room": room,
                "read_path": read_path,
                "router_id": self.router_id,
                "router_epoch": epoch,
                "router_named": self.num_named_aborts,  # (the ones before this are checked just below)
            }
            if epoch < self.abort_epoch or self.named_abort_since(arrival):
                pd["aborted"] = True
            pe_body = {**body, "stream": False, "pd": pd}
            pe_body.pop("stream_options", None)
            de_body = {**body, "pd": {**pd, "bootstrap_url": pe.bootstrap_url}}
            de_req = self.client.build_request(
                "POST",
                de.url + path,
                content=engine_json(de_body, http),
                headers=JSON,
                timeout=DECODE_LEG_TIMEOUT,
            )
            leg = Leg(de, asyncio.ensure_future(self.client.send(de_req, stream=True)))
            legs.append(leg)
            pe_call = self.client.post(
                pe.url + path,
                content=engine_json(pe_body, http),
                headers=JSON,
                timeout=self.prefill_timeout(pe),
            )
            decode_failed = aborted = False
            abort_named = asyncio.Event()  # (sent aborted: its decode answers at once; the prefill may not)
            if pd.get("aborted"):
                abort_named.set()
            self._abort_watch[abort_named] = arrival
            try:
                waiting = prefill_unless_decode_fails(pe_call, leg.task, abort_named, self._in_background)
                pe_resp = await unless_gone(http, unless_set(self.stopping, waiting, RouterStopping))
                decode_failed = pe_resp is None
            except ClientGone:  # the prefill's connection is closed (it aborts); close the decode's too
                return client_gone()
            except RouterStopping:  # (both legs are closed on the way out: each engine aborts)
                return unavailable(STOPPING)
            except PrefillWaitAborted:  # (its prefill's call ends in the background)
                pe_resp, aborted = None, True
                if client_rid is not None and not pd.get("aborted"):  # (sent aborted, it holds nothing)
                    self._end_half_later(pe, client_rid, room)  # (it may hold the client's rid, as below)
            except httpx.HTTPError as e:
                pe_resp, last_error = None, f"prefill {pe.url}: {e!r}"
            finally:
                del self._abort_watch[abort_named]
            if decode_failed:  # the decode failed first (the prefill's leg is closed): try another
                if leg.task.exception() is not None:  # unreachable (e.g. it died since its last check)
                    last_error = f"decode {de.url}: {leg.task.exception()!r}"
                else:
                    de_resp = leg.task.result()
                    try:
                        content = await de_resp.aread()
                    except httpx.HTTPError as e:  # (it died while answering)
                        content = f"(its answer broke: {e!r})".encode()
                    error = content[:200].decode(errors="replace")
                    last_error = f"decode {de.url}: HTTP {de_resp.status_code} {error}"
                    if de_resp.status_code == 503 and error_type(content) == PREFILL_UNREACHABLE:
                        # The decode could not reach this prefill (it is down, before the prefill's own
                        # connection error reached us): the prefill's failure; the decode may serve the
                        # retry (with one decode it used to be a 503: no decode left to try).
                        await leg.close()
                        failed_side = "prefill"
                        continue
                    biggest = self._biggest_decodes(de, pe) if de_resp.status_code == 400 else []
                    if 400 <= de_resp.status_code < 500 and not biggest:
                        return Response(content, de_resp.status_code, media_type="application/json")
                    if biggest:
                        # A request only the decode refuses is the client's, unless a decode with a
                        # bigger KV pool may take it (pools differ: the smaller refuses what outgrows
                        # it). The biggest is tried, once: it refuses alike anything else wrong.
                        failed_decodes.update(e.url for e in self.decodes if e not in biggest)
                await leg.close()
                tried.discard(pe.url)  # (not the prefill's fault)
                failed_decodes.add(de.url)
                failed_side = "decode"
                if client_rid is not None:
                    # Its prefill may have finished token 1 as we closed its leg (its answer on the
                    # way): its half then holds the client's rid, and a retry there is a duplicate.
                    self._end_half_later(pe, client_rid, room)
                continue
            if aborted or (pe_resp is not None and pe_resp.status_code == 200):
                # Aborted before its prefill answered (one paused, or wedged, would answer at its
                # timeout: the client got its abort that late, or a 503): the decode, told of the abort
                # too, answers "abort" without it.
                answer = await self._decode_answer(http, de, leg)
                if not isinstance(answer, str):
                    return answer
                # The decode failed before any of its answer could reach the client (no headers of a
                # stream; no byte of a whole answer): another attempt, as before the prefill answered
                # (it used to be the client's 502 when the decode died after the prefill's token 1).
                # (the prefill may be tried again: a room failed by either side answers a 5xx there)
                last_error = answer
                await leg.close()
                tried.discard(pe.url)
                failed_decodes.add(de.url)
                failed_side = "decode"
                if client_rid is not None and not aborted:  # (an aborted one's is being ended)
                    self._end_half_later(pe, client_rid, room)
                continue
            if pe_resp is not None and 400 <= pe_resp.status_code < 500:
                # The request itself is bad (both engines validate the same way): no retry.
                return Response(pe_resp.content, pe_resp.status_code, media_type="application/json")
            if pe_resp is not None:
                last_error = f"prefill {pe.url}: HTTP {pe_resp.status_code} {pe_resp.text[:200]}"
            await leg.close()  # closing the decode's stream aborts its room
            # The decode died meanwhile: its prefill waited out a deadline for it, or its writes there
            # failed (a decode killed mid-transfer, before the health check saw it: the prefill was
            # blamed, and with one prefill the client got a 503 though a live decode was left).
            transfer_failed = (
                pe_resp is not None and f"prefill failed: {TRANSFER_FAILED}".encode() in pe_resp.content
            )
            if not de.healthy or (transfer_failed and not await self._answers(de)):
                tried.discard(pe.url)
                failed_decodes.add(de.url)
                failed_side = "decode"
            else:
                failed_side = "prefill"
        return JSONResponse(error_body(f"all prefill attempts failed: {last_error}", 502, "BadGateway"), 502)

    async def _decode_answer(self, http: Request, de: Engine, leg: Leg) -> Response | str:
        """The client's answer, from the decode of an attempt whose prefill answered; or why the
        attempt failed (a str) while nothing of the decode's answer can have reached the client: its
        connection broke, or it was declared down, before the headers of a stream or the whole body of
        an answer; or that answer is a 5xx (the room failed: its transfer, or the prefill lost). Past
        a stream's headers, an error is the relay's (in-band)."""
        try:
            de_resp = await unless_gone(http, unless_down(de, leg.task))
        except ClientGone:
            return client_gone()
        except (httpx.HTTPError, EngineDown) as e:
            return f"decode {de.url}: {e!r}"
        leg.done = True  # (the relay owns the leg and its count from here)
        media = de_resp.headers.get("content-type", "application/json")
        if media.startswith("text/event-stream"):  # (past `dispatch`: counted as relayed from here)
            relay = Relay(de, de_resp, self)
            return StreamingResponse(relay, status_code=de_resp.status_code, media_type=media)
        relay = Relay(de, de_resp)  # (read inside `dispatch`, which counts it)
        # A whole answer (one JSON body) is read before the client gets a status: relayed as it came,
        # one that broke midway was a 200 whose body was half an answer and an SSE error event.
        try:
            content = await unless_gone(http, unless_down(de, de_resp.aread()))
        except ClientGone:
            return client_gone()
        except (httpx.HTTPError, EngineDown) as e:
            return f"decode {de.url}: its answer broke: {e!r}"
        finally:
            await relay.aclose()
        if de_resp.status_code >= 500:
            error = content[:200].decode(errors="replace")
            return f"decode {de.url}: HTTP {de_resp.status_code} {error}"
        return Response(content, de_resp.status_code, media_type=media)

    async def _answers(self, e: Engine) -> bool:
        """Whether `e` answers its health route now (1 s at most): a quick look at an engine an
        attempt's failure may be about, before the health loop's next round."""
        try:
            return (await self.client.get(e.url + "/pd/info", timeout=1.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def _in_background(self, call) -> asyncio.Task:
        """`call` run to its end in the background (referenced until then)."""
        task = asyncio.ensure_future(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _end_half_later(self, pe: Engine, rid: str, room: int) -> None:
        """`_abort_answered_half` in the background; a request of `rid` sent to `pe` meanwhile waits
        for it (`_halves_ending`)."""
        task = self._in_background(self._abort_answered_half(pe, rid, room))
        key = (pe.url, rid)
        self._halves_ending[key] = task  # (an earlier one for the key has ended: the rid was sent since)

        def done(t: asyncio.Task) -> None:
            if self._halves_ending.get(key) is t:
                del self._halves_ending[key]

        task.add_done_callback(done)

    async def _abort_answered_half(self, pe: Engine, rid: str, room: int) -> None:
        """Before a `/generate` with the client's rid is tried again: end the failed attempt's half on
        its prefill, which holds the rid until that room's writes end or fail (a dead decode is seen
        late: at its writes' errors, or its lease); the retry there was refused meanwhile (duplicate
        id). Named by its room: only that half ends (a plain abort of the rid would find no request
        streaming, and end others named `<rid>_...`), and its id is free at once (pd_prefill
        `abort_room`)."""
        with contextlib.suppress(httpx.HTTPError, RuntimeError):  # (RuntimeError: the client closed)
            await self.client.post(
                pe.url + "/abort_request", json={"rid": rid, "room": room}, timeout=ABORT_TIMEOUT_S
            )
