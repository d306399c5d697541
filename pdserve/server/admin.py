"""Control endpoints of one engine, for RL loops and operators (SGLang's and vLLM's names).

Who calls them: an RL trainer's rollout manager between (or at the end of) rollout steps, and
operators; the PD router forwards `/abort_request` and the cache resets to every engine
(router/app.py). `server/api.py` mounts `admin_routes` on every engine's app.

* `POST /abort_request` `{"rid": ...}` or `{"abort_all": true}` (SGLang's): end requests now, e.g.
  the over-sampled rollouts a step no longer needs. `rid` is the id the client saw: a `/generate`
  rid, or a completion's or chat's `id` (with `n` > 1 or a prompt list: all of its choices). Each
  one's answer (stream or whole) ends with the tokens so far and finish_reason "abort", its pages
  freed; an unknown or finished id is no error (it may have just finished). Answers how many were
  aborted. It also ends the requests it names (or, with `abort_all`, every one) still being checked
  (tokenized, or waiting for the other choices of their request) or waiting for a pause to end: each
  answers "abort" as soon as it would start (those are not in the count). (SGLang's pause gate sits
  before its abort's reach, so there they would run after the pause; here an abort of everything means
  everything sent before it, as the router's does for the requests it holds.)
  A PD engine tells the peer of each aborted request that it was aborted on purpose, so the peer's
  half answers "abort" too, also when it registers only after the abort (pd_prefill's tombstones).
  Through the router, `abort_all` also ends the requests the router still holds (placement queue),
  and those it sent before but that reach an engine after the abort (it carries the router's id and
  abort count, each half `pd.router_epoch`: a lower one is aborted on arrival).
* `POST /reset_prefix_cache` (vLLM's) and `GET|POST /flush_cache` (SGLang's): forget every cached page
  no request holds.
* `POST /update_weights_from_disk` (SGLang's; needs `--enable-weight-updates`): load a new checkpoint
  of the same model in place, between rollouts. On a PD engine the role's layout fingerprint and KV
  store follow the new weights (`PDContext.on_new_weights`), and `abort_running` ends its rooms as
  aborts on both halves; the router updates every engine of a cluster at once.
* `GET /get_model_info` (SGLang's): the served checkpoint (after weight updates: the latest one).
* `POST /pause_generation` `{"mode": "abort" | "in_place" | "retract"}` and `POST
  /continue_generation` (SGLang's), `POST /pause?mode=abort|wait|keep&clear_cache=` , `POST /resume`
  and `GET /is_paused` (vLLM's): an RL trainer pauses generation around a weight update. New requests
  wait until the pause ends; those in flight end as aborts, freeze with their pages, give their pages
  back to be recomputed, or (vLLM's "wait") finish first (AsyncEngine.pause). A weight update while
  requests are frozen or retracted keeps them (they go on under the new weights; `keep_pause`).
  A PD engine refuses them: a cluster is paused through its router (router/control.py).
* `POST /sleep?level=1|2`, `POST /wake_up[?tags=weights&tags=kv_cache]`, `GET /is_sleeping` (vLLM's
  sleep mode) and `POST /release_memory_occupation`, `POST /resume_memory_occupation` `{"tags": [...]}`
  (SGLang's): an idle engine gives its memory back while a trainer colocated with it trains
  (`LLMEngine.release_memory`): its KV buffers (the prefix cache goes with them) and its weights
  (level 1 keeps them in host memory; level 2 and SGLang's release free them, and they are loaded
  again from the last checkpoint served). Requests meanwhile are a 503; 409 while requests are in
  flight. A PD engine refuses (its KV buffers are registered with NIXL and its peers).
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Request

from pdserve.engine.async_engine import AsyncEngine, EngineDeadError, PauseEnded
from pdserve.engine.llm_engine import MEMORY_TAGS, EngineBusy, InvalidRequest, LLMEngine, WeightsLost
from pdserve.model.loader import CheckpointError
from pdserve.server.pd_context import model_identity
from pdserve.server.protocol import (
    AbortRequest,
    APIError,
    PauseGenerationRequest,
    UpdateWeightsRequest,
    request_id_of,
    sglang_failure,
)


def admin_routes(aengine: AsyncEngine, engine: LLMEngine, enable_weight_updates: bool, pd=None) -> APIRouter:
    """`pd`: the PDContext of a prefill or decode engine (None: colocated)."""
    router = APIRouter()

    @router.post("/abort_request")
    async def abort_request(body: AbortRequest):
        if body.room:  # (the router ends one PD half it retries elsewhere: that room's, that id's)
            try:
                return {
                    "success": True,
                    "num_requests_aborted": await aengine.abort_room(body.room, body.rid),
                }
            except EngineDeadError as e:
                raise APIError(str(e), 503, "ServiceUnavailable") from None
        # (first: a router's half checked from now on is aborted on arrival)
        if body.router_id and body.abort_all:
            aengine.note_router_abort(body.router_id, body.router_epoch)
        elif body.router_id:
            aengine.note_router_named_abort(body.router_id, body.router_named, request_id_of(body.rid))
        try:  # (the id the client saw: a chat's says "chatcmpl-" for "cmpl-")
            num_aborted = await aengine.abort_now(None if body.abort_all else request_id_of(body.rid))
        except EngineDeadError as e:
            raise APIError(str(e), 503, "ServiceUnavailable") from None
        return {"success": True, "num_requests_aborted": num_aborted}

    async def reset_prefix_cache() -> dict:
        try:
            return {"num_cached_pages_dropped": await aengine.run(engine.kv.pool.reset_prefix_cache)}
        except EngineDeadError as e:
            raise APIError(str(e), 503, "ServiceUnavailable") from None

    router.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    router.add_api_route("/flush_cache", reset_prefix_cache, methods=["GET", "POST"])

    @router.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": engine.weights_dir,
            "tokenizer_path": engine.config.model,
            "served_model_name": engine.config.model_name,
            "is_generation": True,
            "max_model_len": engine.config.scheduler.max_model_len,
            "num_weight_updates": engine.num_weight_updates,
            "weight_version": engine.weight_version,
        }

    @router.get("/get_weight_version")
    async def get_weight_version():
        """SGLang's: the label the last update gave the weights ("default" until one does)."""
        return {"weight_version": engine.weight_version}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsRequest):
        """409 while requests are in flight, unless `abort_running` (each then ends with "abort") or a
        pause froze or retracted them (they are kept: `num_paused_requests`, the requests the pause
        held across the update; without `keep_pause` they go on at once).
        Errors carry SGLang's `success: false` and `message` beside OpenAI's `error`."""

        def failed(message: str, status: int = 400, err_type: str = "BadRequestError", param=None):
            return APIError(message, status, err_type, param, sglang_failure(message))

        if not enable_weight_updates:
            raise failed(
                "weight updates are off: start the engine with --enable-weight-updates", 403, "Forbidden"
            )
        aborted: list = []  # final outputs of the requests the update aborted
        kept: list[int] = []  # ... and how many requests a pause holds across it
        rooms_ended: list[str] = []  # ... and the PD requests it ended through their role

        def update() -> int:  # (engine thread)
            def ended(out) -> None:  # an aborted request's stream ends with finish_reason "abort"
                aborted.append(out)
                aengine.finish_aborted(out)

            if pd is None:  # (a pause in place or a retract keeps its requests: they go on later)
                keep = aengine.pause_mode in ("in_place", "retract") and not body.abort_running
                dropped = engine.update_weights(body.model_path, body.abort_running, ended, keep_running=keep)
                kept.append(len(engine.requests))
                return loaded(dropped)

            def end(rid: str):  # a PD request ends through its role: its room fails on purpose, and
                out = pd.role.abort(rid, True)  # its peer's half answers "abort" too
                if out is None:
                    rooms_ended.append(rid)  # (its stream ends as the role says: no output here)
                return out

            try:  # (what the role and the store will name the new weights by, read before they load)
                identity = model_identity(engine, body.model_path)
            except (OSError, ValueError) as e:
                raise InvalidRequest(f"cannot read {body.model_path}: {e}") from None
            dropped = engine.update_weights(body.model_path, body.abort_running, ended, abort=end)
            try:
                pd.on_new_weights(identity)
            except Exception as e:  # the weights changed but the role would still name the old ones
                engine.weights_lost = f"weights loaded, but the PD role could not follow them: {e!r}"
                raise WeightsLost(engine.weights_lost) from e
            return loaded(dropped)

        def loaded(dropped: int) -> int:  # (engine thread)
            # The new label with the new weights, on the engine thread before any step runs on them:
            # set once the route resumed, a request held by a pause (or arriving during the load)
            # reported the old label for tokens of the new weights (a review, 2026-12-05).
            if body.weight_version is not None:
                engine.weight_version = body.weight_version
            return dropped

        pause_seq = aengine.pause_seq  # (a pause that comes during the update is not ended by it)
        try:
            dropped = await aengine.run(update)
        except EngineBusy as e:
            raise failed(str(e), 409, "Conflict") from None
        except (InvalidRequest, CheckpointError) as e:
            raise failed(f"cannot load {body.model_path!r}: {e}", param="model_path") from None
        except (WeightsLost, EngineDeadError) as e:
            raise failed(str(e), 503, "ServiceUnavailable") from None
        if not body.keep_pause:  # (SGLang's: the requests a pause froze go on; new ones still wait)
            aengine.release_held(since=pause_seq)
        return {
            "success": True,
            "message": f"serving the weights of {body.model_path}",
            "num_cached_pages_dropped": dropped,
            "num_requests_aborted": len(aborted) + len(rooms_ended),
            "num_paused_requests": kept[0] if kept and aengine.pause_mode is not None else 0,
            "num_weight_updates": engine.num_weight_updates,
            "weight_version": engine.weight_version,
        } | ({"weights_id": pd.identity} if pd is not None else {})

    async def pause(mode: str) -> int:
        if pd is not None:
            raise APIError(
                f"a {pd.role_name} engine is paused through its router (its /pause_generation "
                "pauses the whole cluster)",
                400,
                param="mode",
            )
        try:
            return await aengine.pause(mode)
        except PauseEnded as e:
            raise APIError(str(e), 409, "Conflict") from None
        except EngineDeadError as e:
            raise APIError(str(e), 503, "ServiceUnavailable") from None

    @router.post("/pause_generation")
    async def pause_generation(http: Request):
        """SGLang's: `mode` "abort" (its default), "in_place" or "retract" (module docstring)."""
        try:
            body = PauseGenerationRequest.parse(await http.body())
        except ValueError as e:
            raise APIError(str(e), param="mode") from None
        num = await pause(body.mode)
        out = {"message": "Generation paused successfully.", "status": "ok"}
        return out | {"num_requests_aborted" if body.mode == "abort" else "num_requests_retracted": num}

    @router.post("/continue_generation")
    async def continue_generation():
        """SGLang's (its body, `{}`, says nothing): the pause ends."""
        aengine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @router.post("/pause")
    async def pause_vllm(mode: str = "abort", clear_cache: bool = True):
        """vLLM's: `mode` "abort" (its default), "wait" (those in flight finish first) or "keep" (frozen
        in place); `clear_cache` (vLLM's default true) drops the prefix cache once nothing runs
        (not with "keep": frozen requests hold their pages)."""
        ours = {"abort": "abort", "wait": "wait", "keep": "in_place"}.get(mode)
        if ours is None:
            raise APIError(f"mode must be abort, wait or keep, not {mode!r}", param="mode")
        await pause(ours)
        if clear_cache and ours != "in_place":
            await reset_prefix_cache()
        return {"status": "paused"}

    @router.post("/resume")
    async def resume():
        aengine.resume()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused():
        return {"is_paused": aengine.pause_mode is not None}

    async def release(tags: tuple[str, ...], keep_weights_on_host: bool) -> int:
        if pd is not None:
            raise APIError(
                f"a {pd.role_name} engine keeps its memory (its KV buffers are registered with its peers)",
                400,
            )
        try:
            return await aengine.run(lambda: engine.release_memory(tags, keep_weights_on_host))
        except EngineBusy as e:
            raise APIError(str(e), 409, "Conflict") from None
        except InvalidRequest as e:
            raise APIError(str(e), param="tags") from None
        except EngineDeadError as e:
            raise APIError(str(e), 503, "ServiceUnavailable") from None

    async def resume_memory(tags: tuple[str, ...]) -> str | None:
        """None, or why the weights could not be loaded again. The memory is back either way: SGLang's
        and vLLM's resumes give memory back and an RL loop then updates the weights, and a trainer that
        keeps only its newest checkpoint has deleted the one served (the resume was a 503, which slime
        takes as fatal; a review, 2026-12-04). The engine refuses requests until an update succeeds."""
        try:
            await aengine.run(lambda: engine.resume_memory(tags))
        except InvalidRequest as e:
            raise APIError(str(e), param="tags") from None
        except WeightsLost as e:
            return f"{e}; requests are refused until /update_weights_from_disk loads weights"
        except EngineDeadError as e:
            raise APIError(str(e), 503, "ServiceUnavailable") from None
        return None

    def tags_of(raw) -> tuple[str, ...]:
        """The tags asked for (None: all); SGLang's "cuda_graph" left out (no graphs here)."""
        if raw is None:
            return MEMORY_TAGS
        if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
            raise APIError("tags must be a list of strings", param="tags")
        return tuple(t for t in raw if t != "cuda_graph")

    @router.post("/sleep")
    async def sleep(level: int = 1):
        """vLLM's: level 1 frees the KV buffers and keeps the weights in host memory; level 2 frees both."""
        if level not in (1, 2):
            raise APIError(f"level must be 1 or 2, not {level}", param="level")
        await release(MEMORY_TAGS, keep_weights_on_host=level == 1)
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(http: Request):
        """vLLM's: `tags` (repeated query parameter; default both) says what comes back."""
        lost = await resume_memory(tags_of(http.query_params.getlist("tags") or None))
        out = {
            "status": "awake" if not engine.released else "partly awake",
            "released": sorted(engine.released),
        }
        return out if lost is None else out | {"weights": lost}

    @router.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(engine.released)}

    async def sglang_body(http: Request) -> dict:
        raw = await http.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise APIError("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object")
        return body

    @router.post("/release_memory_occupation")
    async def release_memory_occupation(http: Request):
        """SGLang's: `tags` (null: all) freed; weights are loaded again from disk when resumed."""
        tags = tags_of((await sglang_body(http)).get("tags"))
        await release(tags, keep_weights_on_host=False)
        return {"success": True, "message": f"released {', '.join(sorted(engine.released)) or 'nothing'}"}

    @router.post("/resume_memory_occupation")
    async def resume_memory_occupation(http: Request):
        tags = tags_of((await sglang_body(http)).get("tags"))
        lost = await resume_memory(tags)
        return {"success": True, "message": "resumed" if lost is None else f"resumed; {lost}"}

    return router
