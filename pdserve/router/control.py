"""The router's control routes: what every engine of the cluster must do (server/admin.py's
endpoints, for a whole cluster).

Who calls them: an RL trainer's rollout manager and operators, as they would call one engine. Mounted by
`router/routes.build_router_app`.

* `POST /abort_request` (SGLang's): to every engine, and what the router still holds of it
  (`Router.abort_all`, `Router.abort_named`: its placement queue, requests not yet sent) and what it
  sent that has not yet reached an engine (the abort carries the router's id and its count of such
  aborts to the engines).
* `POST /update_weights_from_disk` (SGLang's): the cluster's next checkpoint. New requests are held
  (`Router.open`), those in flight finish (or end now with `abort_running`), every engine loads the
  checkpoint, then the held ones go: no request runs across a prefill and a decode of different
  weights (the engines' fingerprints would refuse it anyway: a 503). An engine that serves other
  weights than the last update's (it missed it) is out of service (`Engine.stale`) until one reaches it.
* `POST /reset_prefix_cache`, `GET|POST /flush_cache`: to every engine.
* `POST /pause_generation` (SGLang's) and `POST /pause` (vLLM's), `POST /continue_generation`,
  `POST /resume`, `GET /is_paused`: an RL trainer pauses the cluster around a weight update. New
  requests are held here (`Router.open`, as during an update, which no longer ends the pause) until
  the pause ends; those in flight end as aborts on every engine ("abort"), or finish first (vLLM's
  "wait"). Freezing requests in place or retracting them is refused through the router: a frozen
  request's prefill and decode halves would each wait on the other past their deadlines.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pdserve.router.app import Router, client_gone
from pdserve.router.engines import Engine
from pdserve.router.legs import ABORT_TIMEOUT_S, JSON
from pdserve.server.disconnect import ClientGone, unless_gone
from pdserve.server.protocol import (
    AbortRequest,
    PauseGenerationRequest,
    UpdateWeightsRequest,
    describe_errors,
    error_body,
    sglang_failure,
)

CONTROL_TIMEOUT_S = 30.0  # an engine's answer to a cache reset (its engine thread takes ms)
WEIGHTS_TIMEOUT_S = 600.0  # an engine's answer to /update_weights_from_disk (it reads a checkpoint)
BUSY_RETRY_S = 0.05  # an engine that answered 409 is asked again this often


def control_routes(router: Router) -> APIRouter:
    routes = APIRouter()

    async def ask_every_engine(
        path: str, content: bytes, timeout_s: float, busy_wait_s: float, include_stale: bool
    ) -> tuple[list[Engine], dict[str, tuple[int, object]]]:
        """POST `content` to each live engine at once: (those asked, each one's (status, JSON answer) by
        URL). An engine that answers 409 (busy) is asked again for up to `busy_wait_s`.
        `include_stale`: also those out of service only because they serve other weights."""
        live = [e for e in router.prefills + router.decodes if e.healthy or (include_stale and e.stale)]

        async def one(engine: Engine) -> tuple[int, object]:
            try:
                r = await router.client.post(
                    engine.url + path, content=content, headers=JSON, timeout=timeout_s
                )
            except httpx.HTTPError as e:
                return 502, {"error": f"{engine.url} unreachable: {e!r}", "unreachable": True}
            try:
                return r.status_code, r.json()
            except ValueError:
                return 502, {"error": f"{engine.url} answered {r.status_code}: {r.text[:200]}"}

        answers: dict[str, tuple[int, object]] = {}
        asking, until_s = live, time.monotonic() + busy_wait_s
        while asking:
            for e, answer in zip(asking, await asyncio.gather(*(one(e) for e in asking)), strict=True):
                answers[e.url] = answer
            asking = [e for e in asking if answers[e.url][0] == 409]
            if not asking or time.monotonic() >= until_s:
                break
            await asyncio.sleep(BUSY_RETRY_S)  # (e.g. a prefill's room awaiting the decode's last ack)
        return live, answers

    def summary(
        live: list[Engine], answers: dict[str, tuple[int, object]], every_engine: bool, unreachable_ok=False
    ) -> Response:
        """200 with each engine's answer by URL, or 502 (the same map) when any engine failed or
        refused (a bad body is refused by all alike: that engine's answer, as is). Engines out of
        service are listed as `unhealthy` (not asked: they may not answer); with `every_engine` they
        fail it too (a weight update they missed would leave them serving the old weights). With
        `unreachable_ok` (aborts), engines that could not be reached are listed as `unreachable` and
        do not fail it: a dead one runs nothing, a paused one's rooms end by their deadlines (the
        abort of the others worked: it was a 502 "success": false)."""
        if not live:
            return JSONResponse(error_body("no healthy engine", 503, "ServiceUnavailable"), 503)
        down = [e.url for e in router.prefills + router.decodes if e not in live]
        unreachable = [url for url, (_, a) in answers.items() if isinstance(a, dict) and a.get("unreachable")]
        counted = {
            url: status for url, (status, _) in answers.items() if not (unreachable_ok and url in unreachable)
        }
        statuses = set(counted.values())
        if statuses == {400}:  # (the body itself is bad: every engine says why)
            return JSONResponse(answers[next(iter(counted))][1], 400)
        ok = bool(counted) and statuses <= {200} and not (every_engine and down)
        out = {"success": ok, "engines": {url: a for url, (_, a) in answers.items()}}
        if down:
            out["unhealthy"] = down
        if unreachable_ok and unreachable:
            out["unreachable"] = unreachable
        return JSONResponse(out, 200 if ok else 502)

    async def to_every_engine(
        path: str, http: Request, body: dict | None = None, timeout_s=CONTROL_TIMEOUT_S, unreachable_ok=False
    ) -> Response:
        """What every engine must do (drop cached pages, abort requests): the client's body (or
        `body`) to each live engine, answered as `summary` says."""
        content = await http.body() if body is None else json.dumps(body).encode()
        live, answers = await ask_every_engine(path, content, timeout_s, 0.0, include_stale=False)
        return summary(live, answers, every_engine=False, unreachable_ok=unreachable_ok)

    async def abort_on_every_engine(http: Request, body: dict | None = None) -> Response:
        """`/abort_request` on every live engine: one out of reach is waited for ABORT_TIMEOUT_S at
        most and listed, not a failure."""
        return await to_every_engine("/abort_request", http, body, ABORT_TIMEOUT_S, unreachable_ok=True)

    @routes.post("/abort_request")
    async def abort_request(http: Request):
        """SGLang's: abort `rid` (the id the client saw: the decode's) or every request, on every engine
        (and, for every request, those the router still holds)."""
        raw = await http.body()
        try:  # (the engines' own check: a body they refuse aborts nothing here either)
            parsed = AbortRequest.model_validate_json(raw)
        except ValueError:
            parsed = None  # (the engines say why)
        if parsed is not None and parsed.room:  # (before anything is aborted: a refusal changes nothing)
            message = "room is set by the router, for its own retries: abort by rid"
            return JSONResponse(error_body(message, 400, param="room") | sglang_failure(message), 400)
        if parsed is not None and parsed.abort_all:
            return await abort_on_every_engine(http, json.loads(raw) | router.abort_all())
        if parsed is not None and isinstance(parsed.rid, str) and parsed.rid:
            # (what the router still holds of it, and the halves of it still on their way)
            return await abort_on_every_engine(http, json.loads(raw) | router.abort_named(parsed.rid))
        return await abort_on_every_engine(http)

    @routes.post("/update_weights_from_disk")
    async def update_weights_from_disk(http: Request):
        """SGLang's, for the whole cluster (an RL trainer's next checkpoint): new requests are held;
        those in flight finish first, or with `abort_running` end now with finish_reason "abort";
        then every live engine loads the checkpoint (each checks it; the engines need
        `--enable-weight-updates`), and the held requests go on under the new weights. The answer
        maps each engine's (502 when any failed: pairs whose weights differ then refuse each other's
        requests, 503s, until an update succeeds everywhere)."""
        try:
            body = UpdateWeightsRequest.model_validate_json(await http.body())
        except ValidationError as e:  # (as an engine refuses it, with SGLang's `success` and `message`)
            message = f"invalid body: {describe_errors(e.errors())}"
            return JSONResponse(error_body(message, 400) | sglang_failure(message), 400)
        async with router.update_lock:
            router.open.clear()
            try:
                if body.abort_running:
                    everything = {"abort_all": True} | router.abort_all(held_too=False)
                    aborted = await abort_on_every_engine(http, everything)
                    if aborted.status_code != 200:
                        return aborted
                drain_s = CONTROL_TIMEOUT_S if body.abort_running else WEIGHTS_TIMEOUT_S
                try:
                    await unless_gone(http, asyncio.wait_for(router.drained(), drain_s))
                except ClientGone:
                    return client_gone()
                except TimeoutError:
                    if not body.abort_running:
                        message = (
                            f"{router.num_in_flight()} requests still in flight after {drain_s:.0f} s "
                            "(abort_running: true ends them)"
                        )
                        return JSONResponse(error_body(message, 409, "Conflict"), 409)
                    # (aborted, but a client has stopped reading its stream: its engines ended it)
                live, answers = await ask_every_engine(
                    "/update_weights_from_disk",
                    await http.body(),
                    WEIGHTS_TIMEOUT_S,
                    CONTROL_TIMEOUT_S,
                    include_stale=True,  # (an update is what brings them back)
                )
                loaded = [a for status, a in answers.values() if status == 200]
                if loaded:
                    # The cluster's weights now: an engine that did not load them is out of service
                    # (stale) until an update reaches it too (told by identity where engines report one).
                    router.weights_path = body.model_path
                    router.weights_id = next((a["weights_id"] for a in loaded if a.get("weights_id")), None)
                    await router.check_health()
                return summary(live, answers, every_engine=True)
            finally:
                router.reopen(update_ending=True)  # (unless paused: then `/continue_generation` does)

    @routes.post("/reset_prefix_cache")
    async def reset_prefix_cache(http: Request):
        return await to_every_engine("/reset_prefix_cache", http)

    @routes.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(http: Request):
        return await to_every_engine("/flush_cache", http)

    async def pause(http: Request, mode: str, clear_cache: bool = False) -> Response | None:
        """Hold new requests; end those in flight ("abort") or wait for them ("wait"). None when done,
        else the answer that says what failed (the cluster stays paused: new requests wait, until
        `/continue_generation`), or a 409 when the pause was ended before it took effect."""
        if mode not in ("abort", "wait"):
            message = (
                f"mode {mode!r} is not available through the PD router (a frozen request's prefill "
                "and decode halves would wait on each other past their deadlines): use abort, or "
                "vLLM's /pause?mode=wait"
            )
            return JSONResponse(error_body(message, 400, param="mode"), 400)
        router.pause_mode = mode
        router.pause_seq += 1
        seq = router.pause_seq
        router.open.clear()
        if mode == "abort":  # (not those held here: they came after the pause, and wait for its end)
            everything = {"abort_all": True} | router.abort_all(held_too=False)
            aborted = await abort_on_every_engine(http, everything)
            if aborted.status_code != 200:
                return aborted

        async def drained() -> None:  # (or the pause ended: a `/resume` while it waits)
            while router.num_in_flight() and router.pause_seq == seq:
                await asyncio.sleep(0.01)

        try:
            drain_s = CONTROL_TIMEOUT_S if mode == "abort" else None
            await unless_gone(http, asyncio.wait_for(drained(), drain_s))
        except ClientGone:
            return client_gone()
        except TimeoutError:  # (a client that stopped reading its aborted stream: its engines ended it)
            pass
        if router.pause_seq != seq:
            message = "the pause was ended (or replaced) before it took effect"
            return JSONResponse(error_body(message, 409, "Conflict"), 409)
        if clear_cache:
            cleared = await to_every_engine("/reset_prefix_cache", http, {})
            if cleared.status_code != 200:
                return cleared
        return None

    @routes.post("/pause_generation")
    async def pause_generation(http: Request):
        """SGLang's, for the whole cluster: `mode` "abort" (its default); "in_place" and "retract" are
        refused (module docstring)."""
        try:
            body = PauseGenerationRequest.parse(await http.body())
        except ValueError as e:
            return JSONResponse(error_body(str(e), 400, param="mode"), 400)
        failed = await pause(http, body.mode)
        return failed or {"message": "Generation paused successfully.", "status": "ok"}

    @routes.post("/pause")
    async def pause_vllm(http: Request, mode: str = "abort", clear_cache: bool = True):
        """vLLM's: `mode` "abort" (its default) or "wait"; "keep" is refused; `clear_cache` drops every
        engine's prefix cache once nothing runs."""
        if mode not in ("abort", "wait", "keep"):
            message = f"mode must be abort, wait or keep, not {mode!r}"
            return JSONResponse(error_body(message, 400, param="mode"), 400)
        failed = await pause(http, mode, clear_cache)
        return failed or {"status": "paused"}

    @routes.post("/continue_generation")
    async def continue_generation():
        router.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @routes.post("/resume")
    async def resume():
        router.resume()
        return {"status": "resumed"}

    @routes.get("/is_paused")
    async def is_paused():
        return {"is_paused": router.pause_mode is not None}

    return routes
