"""The prefill engine's bootstrap server: an address book telling decode engines where its ranks'
control channels listen. It carries no KV and no request traffic.

Who uses it: a prefill engine starts one `BootstrapServer` (default port 8998 in the CLI) next to its
HTTP API; each of its ranks registers with `PUT /route` (or `register_local` in-process). A decode
engine calls `lookup(url, rank)` at most once a second per prefill (`PDContext` caches the answer for
`ADDR_TTL_S`, dropped on failure) from an asyncio task or helper thread, never from the scheduler loop, then sends `Register` to the returned control address.

Choice: a small FastAPI app served by its own uvicorn server on its own thread and event loop. It
shares nothing with the scheduler but the `RouteTable` (a lock around a dict), so a slow or hostile
client can never stall scheduling, and the engine's main API can restart or block independently.
`create_app(table)` is exposed for mounting it elsewhere instead.

Endpoints:
    PUT /route     JSON RankRoute; 200 {"ok": true}; 400 bad JSON or fields; 409 conflicts with the
                   ranks already registered (world size, layout); 401 when a secret is set and the
                   X-PDServe-Auth header (hex HMAC-SHA256 of the body) is missing or wrong; 413 more
                   than MAX_BODY_BYTES (declared, or streamed: never buffered past the limit). PD
                   engines always pass the cluster secret (server/pd_context.py); a server without
                   one (tests, `create_app(table)`) accepts unauthenticated writes
    GET  /route    all ranks: {"world_size", "layout_fingerprint", "page_size", "kv_dtype", "ranks":
                   [{"rank", "control_addr", "engine_name"}, ...]}; 503 until every rank registered
    GET  /route?rank=N  {"rank", "control_addr", "engine_name", "layout_fingerprint", "page_size",
                   "kv_dtype", "world_size"}; 400 bad N, 404 N >= world size, 503 not registered yet
    GET  /health   200 {"status": "ok", "registered": n, "world_size": w | null}
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import socket
import threading
import time
from typing import Annotated

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from msgspec import Meta

from pdserve.disagg.messages import TCP_ADDR

MAX_BODY_BYTES = 64 << 10
AUTH_HEADER = "X-PDServe-Auth"


class RankRoute(msgspec.Struct, forbid_unknown_fields=True):
    """What one prefill rank registers."""

    rank: Annotated[int, Meta(ge=0)]
    world_size: Annotated[int, Meta(ge=1, le=4096)]
    control_addr: Annotated[str, Meta(pattern=rf"^{TCP_ADDR}\Z", max_length=256)]
    layout_fingerprint: Annotated[str, Meta(min_length=1, max_length=256)]
    page_size: Annotated[int, Meta(ge=1)]
    kv_dtype: Annotated[str, Meta(min_length=1, max_length=32)]
    # The registering incarnation (its start time in ns): a rank's route is replaced only by one at
    # least as new, so a replayed old registration (the tag signs the body, not its time) cannot
    # point a restarted rank back at its dead address.
    epoch: Annotated[int, Meta(ge=0)]
    engine_name: Annotated[str, Meta(max_length=256)] = ""

    def __post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} >= world_size {self.world_size}")


class RouteConflict(ValueError):
    """A registration disagrees with the ranks already registered."""


class StaleRoute(RouteConflict):
    """A registration older than the one the rank already has (`RankRoute.epoch`)."""


class BootstrapError(RuntimeError):
    """`lookup` could not get an answer: unreachable, timed out, or a non-200 status (`status_code`)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class RouteTable:
    """rank -> RankRoute for one prefill engine. Thread-safe (HTTP thread writes, anyone reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[int, RankRoute] = {}

    def put(self, route: RankRoute) -> None:
        """Register or re-register a rank (a restarted rank may change its address). All ranks must
        agree on world size, layout fingerprint, page size and dtype; otherwise RouteConflict. A route
        older than the rank's registered one, or as old but different, is a StaleRoute."""
        with self._lock:
            current = self._ranks.get(route.rank)
            if current is not None and (
                route.epoch < current.epoch or (route.epoch == current.epoch and route != current)
            ):
                raise StaleRoute(
                    f"rank {route.rank}: registration of epoch {route.epoch} is not newer than the "
                    f"registered epoch {current.epoch} (a replay, or an old instance of a restarted rank)"
                )
            for other in self._ranks.values():
                if other.rank == route.rank:
                    continue
                for field in ("world_size", "layout_fingerprint", "page_size", "kv_dtype"):
                    if getattr(other, field) != getattr(route, field):
                        raise RouteConflict(
                            f"{field} {getattr(route, field)!r} differs from rank {other.rank}'s "
                            f"{getattr(other, field)!r}"
                        )
            self._ranks[route.rank] = route

    def snapshot(self) -> list[RankRoute]:
        with self._lock:
            return sorted(self._ranks.values(), key=lambda r: r.rank)

    def world_size(self) -> int | None:
        routes = self.snapshot()
        return routes[0].world_size if routes else None


def _json(status: int, body: dict) -> JSONResponse:
    return JSONResponse(status_code=status, content=body)


def create_app(table: RouteTable, secret: bytes | None = None) -> FastAPI:
    app = FastAPI(title="pdserve bootstrap", docs_url=None, redoc_url=None, openapi_url=None)
    decoder = msgspec.json.Decoder(RankRoute)

    @app.put("/route")
    async def put_route(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return _json(413, {"error": f"body larger than {MAX_BODY_BYTES} bytes"})
        # Read incrementally: a chunked body (no Content-Length) is refused once past the limit, never
        # buffered whole.
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return _json(413, {"error": f"body larger than {MAX_BODY_BYTES} bytes"})
            chunks.append(chunk)
        body = b"".join(chunks)
        if secret is not None:
            given = request.headers.get(AUTH_HEADER, "")
            if not hmac.compare_digest(given.encode(), auth_tag(secret, body).encode()):
                return _json(401, {"error": f"missing or invalid {AUTH_HEADER}"})
        try:
            route = decoder.decode(body)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            return _json(400, {"error": f"bad route: {e}"})
        try:
            table.put(route)
        except RouteConflict as e:
            return _json(409, {"error": str(e)})
        return _json(200, {"ok": True})

    @app.get("/route")
    async def get_route(request: Request) -> JSONResponse:
        routes = table.snapshot()
        world = routes[0].world_size if routes else None
        rank_arg = request.query_params.get("rank")
        if rank_arg is not None:
            try:
                rank = int(rank_arg)
            except ValueError:
                return _json(400, {"error": f"rank must be an integer: {rank_arg!r}"})
            if rank < 0:
                return _json(400, {"error": "rank must be >= 0"})
            if world is not None and rank >= world:
                return _json(404, {"error": f"rank {rank} >= world_size {world}"})
            found = next((r for r in routes if r.rank == rank), None)
            if found is None:
                return _json(503, {"error": f"rank {rank} not registered yet"})
            return _json(200, msgspec.to_builtins(found))
        if world is None or len(routes) < world:
            return _json(503, {"error": f"{len(routes)} of {world or '?'} ranks registered"})
        first = routes[0]
        return _json(
            200,
            {
                "world_size": world,
                "layout_fingerprint": first.layout_fingerprint,
                "page_size": first.page_size,
                "kv_dtype": first.kv_dtype,
                "ranks": [
                    {"rank": r.rank, "control_addr": r.control_addr, "engine_name": r.engine_name}
                    for r in routes
                ],
            },
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        return _json(
            200, {"status": "ok", "registered": len(table.snapshot()), "world_size": table.world_size()}
        )

    return app


def auth_tag(secret: bytes, body: bytes) -> str:
    """Hex HMAC-SHA256 a PUT /route body must carry in X-PDServe-Auth when the server has a secret."""
    return hmac.new(secret, b"pdserve-bootstrap\x00" + body, hashlib.sha256).hexdigest()


class BootstrapServer:
    """Serves `create_app` on host:port (port 0: any free port) from a daemon thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None) -> None:
        self.host = host
        self.table = RouteTable()
        self.app = create_app(self.table, secret)
        self._sock = socket.create_server(
            (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
        )
        self.port: int = self._sock.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def register_local(self, route: RankRoute) -> None:
        """In-process registration for a rank living in the server's own process (raises RouteConflict)."""
        self.table.put(route)

    def start(self, timeout_s: float = 10.0) -> None:
        """Start serving; returns once the server accepts connections (RuntimeError on failure)."""
        if self._thread is not None:
            return
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[self._sock])),
            name=f"bootstrap-{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline_s = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline_s:
            time.sleep(0.005)
        if not self._server.started:
            self.stop()
            raise RuntimeError(f"bootstrap server on {self.url} did not start")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._sock.close()


async def lookup(
    url: str, rank: int | None = 0, timeout_s: float = 5.0, client: httpx.AsyncClient | None = None
) -> dict:
    """GET {url}/route?rank=N (rank=None: the whole topology). Raises BootstrapError on a connection
    failure, a timeout, a non-200 status (503: not registered yet; retry later) or a non-JSON answer.
    For the decode's asyncio side or a helper thread; never call it from the scheduler loop.

    `client`: a long-lived client of the caller's event loop. Pass one on a request path: building a
    client loads the CA bundle, ~20 ms of CPU that stalls the whole event loop."""
    params = {} if rank is None else {"rank": str(rank)}
    try:
        if client is not None:
            resp = await client.get(f"{url.rstrip('/')}/route", params=params, timeout=timeout_s)
        else:
            async with httpx.AsyncClient(timeout=timeout_s) as own:
                resp = await own.get(f"{url.rstrip('/')}/route", params=params)
    except httpx.HTTPError as e:
        raise BootstrapError(f"bootstrap {url} unreachable: {e!r}") from None
    if resp.status_code != 200:
        raise BootstrapError(f"bootstrap {url}: HTTP {resp.status_code}: {resp.text[:200]}", resp.status_code)
    try:
        return resp.json()
    except ValueError:
        raise BootstrapError(f"bootstrap {url}: answer is not JSON") from None


async def register(url: str, route: RankRoute, secret: bytes | None = None, timeout_s: float = 5.0) -> None:
    """PUT {url}/route for a rank in another process. Raises BootstrapError on failure."""
    body = msgspec.json.encode(route)
    headers = {"content-type": "application/json"}
    if secret is not None:
        headers[AUTH_HEADER] = auth_tag(secret, body)
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            resp = await client.put(f"{url.rstrip('/')}/route", content=body, headers=headers)
    except httpx.HTTPError as e:
        raise BootstrapError(f"bootstrap {url} unreachable: {e!r}") from None
    if resp.status_code != 200:
        raise BootstrapError(f"bootstrap {url}: HTTP {resp.status_code}: {resp.text[:200]}", resp.status_code)
