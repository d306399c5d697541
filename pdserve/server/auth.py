"""`--api-key`: requests must carry `Authorization: Bearer <key>`, else a 401 in OpenAI's error shape.
Open without it: what monitors and load balancers poll (`/health`, `/metrics`, `/version`) and the
read-only PD routes the router polls (`/pd/...`). vLLM guards only its `/v1` routes; pdserve also
serves SGLang's `/generate` and the admin routes (weight updates, aborts, cache resets), which an open
port must not expose, so it guards everything else as SGLang's `--api-key` does. The router sends the
same key to its engines."""

from __future__ import annotations

import hmac
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.server.limits import send_json
from pdserve.server.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
OPEN_PREFIX = "/pd/"  # (read-only: who an engine is, its load report, the router's placement state)
API_KEY_ENV = "PDSERVE_API_KEY"


def client_headers(key: str | None = None) -> dict[str, str]:
    """What a client of these servers sends (the bench tools): `Authorization: Bearer KEY` for `key`,
    else $PDSERVE_API_KEY, else nothing."""
    key = key or os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


class ApiKey:
    """ASGI middleware; `key` None or empty leaves every route open."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.expected is None
            or scope["type"] != "http"
            or scope["path"] in OPEN_PATHS
            or scope["path"].startswith(OPEN_PREFIX)
        ):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        if hmac.compare_digest(given.strip(), self.expected):  # (constant time: no key by timing)
            await self.app(scope, receive, send)
            return
        message = "missing or wrong API key (Authorization: Bearer ...)"
        await send_json(send, 401, error_body(message, 401, "AuthenticationError"))
