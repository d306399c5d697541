"""The router's HTTP app: the OpenAI and SGLang routes over `Router.dispatch` (a request of `n` > 1
choices or a prompt list split into children, server/fanout.py), what any engine answers alike
(forwarded to one live engine), the router's own `/health`, `/version`, `/metrics` and `/pd/cluster`,
`/v1/loads`, `/get_server_info` and `/health_generate` for the cluster, and the control routes of
`router/control.py`.

Who calls it: `pdserve router` (cli.py) serves `build_router_app(router)` with uvicorn; tests drive
it in process (httpx's ASGI transport).
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.router.app import Router, Siblings, unavailable
from pdserve.router.control import control_routes
from pdserve.router.engines import NoEngine
from pdserve.router.legs import JSON
from pdserve.router.metrics import RequestMetrics, RouterCollector
from pdserve.server import fanout
from pdserve.server.auth import ApiKey
from pdserve.server.content_type import JsonBodies
from pdserve.server.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from pdserve.server.protocol import HEALTH_PROBE_PREFIX, error_body, http_error, now_iso


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="pdserve router")
    app.add_middleware(BodySizeLimit, max_bytes=DEFAULT_MAX_BODY_BYTES)
    app.add_middleware(JsonBodies)  # (a cross-site page's text/plain POST is never read as JSON)
    app.add_middleware(ApiKey, key=router.api_key)
    registry = CollectorRegistry()
    registry.register(RouterCollector(router))
    app.add_middleware(RequestMetrics, registry=registry)  # (last: outermost, so 401s and 413s count)

    app.add_exception_handler(StarletteHTTPException, http_error)  # (404, 405: OpenAI's shape)
    state: dict = {}

    @app.on_event("startup")
    async def _start() -> None:
        await router.check_health()
        state["tasks"] = [asyncio.ensure_future(router.health_loop())]
        if router.placement is not None:
            state["tasks"] += [
                asyncio.ensure_future(router.load_loop(e)) for e in router.prefills + router.decodes
            ]

    @app.on_event("shutdown")
    async def _stop() -> None:
        for task in state["tasks"]:
            task.cancel()
        await router.client.aclose()

    async def body_of(http: Request) -> dict | Response:
        raw = await http.body()
        try:  # msgspec: a 32k-token prompt decodes in ~0.7 ms, where json.loads took ~1.7 ms
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:  # what json.loads takes and msgspec does not (1e400, NaN, lone
            # surrogates): parsed as before; forwarded as json.dumps writes it, for the engines to refuse
            try:
                body = json.loads(raw)
            except ValueError:
                return JSONResponse(error_body("request body is not valid JSON", 400), 400)
            except RecursionError:
                return JSONResponse(error_body("request body is nested too deeply", 400), 400)
            http.state.stdlib_json = True  # forwarded as json.dumps writes it (msgspec: inf -> null)
        except RecursionError:  # (thousands of nested arrays: a 500 before)
            return JSONResponse(error_body("request body is nested too deeply", 400), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("request body must be a JSON object", 400), 400)
        if "pd" in body:
            return JSONResponse(error_body("'pd' is reserved for the router", 400, param="pd"), 400)
        if body.get("read_path", "none") not in ("none", "pe", "de", "auto"):
            return JSONResponse(
                error_body("read_path must be none, pe, de or auto", 400, param="read_path"), 400
            )
        return body

    async def split(path: str, http: Request) -> Response:
        """`n` > 1 or a prompt list: requests of one prompt and one choice, each dispatched on its
        own, merged (server/fanout.py)."""
        body = await body_of(http)
        if isinstance(body, Response):
            return body
        try:
            n = fanout.num_choices(body.get("n"))
        except ValueError as e:
            return JSONResponse(error_body(str(e), 400, param="n"), 400)
        try:
            prompts = fanout.batch_of(body.get("prompt")) if path == "/v1/completions" else None
            fanout.num_children(len(prompts or [None]), n)
        except ValueError as e:
            return JSONResponse(error_body(str(e), 400, param="prompt"), 400)
        if n == 1 and prompts is None:
            return await router.dispatch(path, body, http)
        options = body.get("stream_options")
        include = bool(body.get("stream") and isinstance(options, dict) and options.get("include_usage"))
        try:
            bodies = fanout.child_bodies(body, n, prompts, uuid.uuid4().hex)
        except ValueError as e:
            return JSONResponse(error_body(str(e), 400, param="request_id"), 400)
        return await fanout.merged(children(path, bodies, n, http), bool(body.get("stream")), include, n)

    def children(path: str, bodies: list[dict], n: int, http: Request) -> list:
        """The dispatches of a split request's children, p·n .. p·n + n - 1 being prompt p's choices."""
        out = []
        for prompt_start in range(0, len(bodies), n):  # a prompt's choices share a prefill (its cache)
            try:  # (DualPath placement: the first is placed, the others follow it: `Siblings`)
                prefill = router.pick_prefill(set()) if router.placement is None and n > 1 else None
            except NoEngine:
                prefill = None  # (each child then answers 503 as a single request would)
            siblings = Siblings(n) if router.placement is not None and n > 1 else None
            out += [
                router.dispatch(path, child, http, prefill, siblings, leader=i == 0)
                for i, child in enumerate(bodies[prompt_start : prompt_start + n])
            ]
        return out

    @app.post("/v1/completions")
    async def completions(http: Request):
        return await split("/v1/completions", http)

    @app.post("/generate")
    async def generate(http: Request):
        """SGLang's native endpoint over PD: one prompt and sample as a completion is; a batch or
        `sampling_params.n` > 1 split here (`fanout.generate_children`, as a colocated engine splits
        it), each child dispatched on its own, the answers a list in child order."""
        body = await body_of(http)
        if isinstance(body, Response):
            return body
        try:
            split = fanout.generate_children(body, f"gen-{uuid.uuid4().hex}")
        except fanout.BadSplit as e:
            return JSONResponse(error_body(str(e), 400, param=e.param), 400)
        if split is None:
            return await router.dispatch("/generate", body, http)
        n, bodies = split
        stream = body.get("stream") is True
        return await fanout.merged(children("/generate", bodies, n, http), stream, False, n, native=True)

    @app.post("/v1/chat/completions")
    async def chat(http: Request):
        return await split("/v1/chat/completions", http)

    async def to_an_engine(method: str, path: str, http: Request | None = None) -> Response:
        """What any engine answers alike (the model list, its tokenizer): a live one answers, decodes
        first; one that died since its last health check is a 503."""
        live = [e for e in router.decodes + router.prefills if e.healthy]
        if not live:
            return unavailable("no healthy engine")
        body = await http.body() if http is not None else None
        try:
            r = await router.client.request(method, live[0].url + path, content=body, headers=JSON)
        except httpx.HTTPError as e:
            return unavailable(f"{live[0].url} unreachable: {e!r}")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/v1/models")
    async def models():
        return await to_an_engine("GET", "/v1/models")

    @app.get("/get_model_info")
    async def get_model_info():
        return await to_an_engine("GET", "/get_model_info")

    @app.get("/get_weight_version")
    async def get_weight_version():
        return await to_an_engine("GET", "/get_weight_version")

    @app.post("/tokenize")
    async def tokenize(http: Request):
        return await to_an_engine("POST", "/tokenize", http)

    @app.post("/detokenize")
    async def detokenize(http: Request):
        return await to_an_engine("POST", "/detokenize", http)

    @app.get("/get_server_info")
    async def get_server_info():
        """An engine's (decodes first: the cluster's configuration is theirs alike), with the router's
        view of the cluster under `pd_cluster`."""
        answer = await to_an_engine("GET", "/get_server_info")
        if answer.status_code != 200:
            return answer
        cluster = {
            "prefill_urls": [e.url for e in router.prefills],
            "decode_urls": [e.url for e in router.decodes],
            "policy": router.policy,
            "is_paused": router.pause_mode is not None,
        }
        return json.loads(answer.body) | {"disaggregation_mode": "router", "pd_cluster": cluster}

    @app.get("/v1/loads")
    async def loads(http: Request):
        """SGLang's, for the cluster: each live engine's ranks (`include` passed on), numbered across
        the cluster (`dp_rank` picks one) and marked with the engine's `url` and `role`, then the
        router's own entry: the requests it dispatches or relays, and (`num_held_reqs`, counted in no
        total) those a pause or a weight update holds, which wait for it to end and run on no engine.
        A request counts on its prefill, its decode and the router: with nothing running, every
        request count is zero (slime's drain check sums the entries' totals)."""
        include = http.query_params.get("include")
        query = f"?include={include}" if include is not None else ""
        try:  # (ranks are numbered across the cluster here: each engine has rank 0)
            dp_rank = int(http.query_params["dp_rank"]) if "dp_rank" in http.query_params else None
        except ValueError:
            return JSONResponse(error_body("dp_rank must be an integer", 400, param="dp_rank"), 400)
        live = [e for e in router.prefills + router.decodes if e.healthy]

        async def one(e) -> tuple[int, object]:
            try:
                r = await router.client.get(e.url + "/v1/loads" + query, timeout=10.0)
                return r.status_code, r.json()
            except (httpx.HTTPError, ValueError) as err:
                return 502, repr(err)

        answers = await asyncio.gather(*(one(e) for e in live))
        entries, unreachable = [], []
        for e, (status, answer) in zip(live, answers, strict=True):
            if status == 400:  # (a bad query: every engine says why)
                return JSONResponse(answer, 400)
            if status != 200:
                unreachable.append(e.url)
                continue
            for entry in answer["loads"]:
                entries.append(entry | {"dp_rank": len(entries), "url": e.url, "role": e.role})
        from pdserve import __version__

        in_flight = router.num_in_flight()
        entries.append(
            {
                "dp_rank": len(entries),
                "role": "router",
                "timestamp": now_iso(),
                "num_running_reqs": in_flight,
                "num_waiting_reqs": 0,
                "num_total_reqs": in_flight,
                "num_held_reqs": router.num_held,
            }
        )
        if dp_rank is not None:
            entries = [e for e in entries if e["dp_rank"] == dp_rank]
            if not entries:
                message = f"dp_rank {dp_rank} does not exist"
                return JSONResponse(error_body(message, 404, "NotFound", "dp_rank"), 404)
        out = {"timestamp": now_iso(), "version": __version__, "loads": entries}
        if unreachable:
            out["unreachable"] = unreachable
        return out

    @app.get("/health_generate")
    async def health_generate(http: Request):
        """SGLang's: one token generated through a prefill and a decode (the whole PD path), 200; else
        503 (also at once while the cluster is paused or updates its weights: it generates nothing
        until then)."""
        if router.pause_mode is not None:
            return JSONResponse({"status": "paused"}, 503)
        if not router.open.is_set():  # (it would wait for the weight update to end)
            return JSONResponse({"status": "updating weights"}, 503)
        body = {
            "input_ids": [0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
            "rid": f"{HEALTH_PROBE_PREFIX}{uuid.uuid4().hex}",
        }
        answer = await router.dispatch("/generate", body, http)
        if answer.status_code == 200:
            return Response(status_code=200)
        return JSONResponse({"status": "unhealthy", "answer": answer.body.decode(errors="replace")}, 503)

    @app.get("/version")
    async def version():
        """vLLM's: the server's version (tooling checks it)."""
        from pdserve import __version__

        return {"version": __version__}

    @app.get("/health")
    async def health():
        ok = any(e.healthy for e in router.prefills) and any(e.healthy for e in router.decodes)
        engines = {
            e.url: {"role": e.role, "healthy": e.healthy, "in_flight": e.in_flight}
            for e in router.prefills + router.decodes
        }
        body = {"status": "ok" if ok else "degraded", "engines": engines, "num_retries": router.num_retries}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/pd/cluster")
    async def cluster():
        """Placement state and the engines' last load reports, by node (benchmarks sample this)."""
        if router.placement is None:
            return JSONResponse(error_body("the router runs no placement policy", 404, "NotFound"), 404)
        reports = router.placement.reports
        nodes: dict[str, dict] = {}
        for url, r in reports.items():
            n = nodes.setdefault(r["node"], {"engines": [], "snic_bytes_served": 0, "snic_bytes_per_s": 0.0})
            n["engines"].append(url)
            # The node's SNIC counters are node-wide (a shared link): take the freshest engine's view.
            if r["snic_bytes_served"] >= n["snic_bytes_served"]:
                n["snic_bytes_served"] = r["snic_bytes_served"]
                n["snic_read_bytes_served"] = r["snic_read_bytes_served"]
                n["read_queue_bytes"] = r["node_read_queue_bytes"]
            n["snic_bytes_per_s"] = r["snic_bytes_per_s"]
        return {"placement": router.placement.snapshot(), "nodes": nodes, "engines": reports}

    app.include_router(control_routes(router))
    return app
