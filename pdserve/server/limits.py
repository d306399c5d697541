"""Request body size limit for the HTTP servers (engine API and router): a pure ASGI middleware.

Who uses it: `server/api.py build_app` and `router/routes.py build_router_app` wrap their FastAPI app with
`app.add_middleware(BodySizeLimit, max_bytes=...)`; tests/test_security.py unit-tests it on a tiny app.

What it does, per HTTP request:
  - a Content-Length above `max_bytes` -> 413 at once, nothing read, the app never called;
  - otherwise the body is read as it streams in (chunked uploads have no Content-Length) and counted;
    past `max_bytes` -> 413, reading stops there (memory never holds more than `max_bytes`), the app is
    never called;
  - within the limit the app gets the whole body as one `http.request` message, and every later
    `receive()` goes to the server (so `Request.is_disconnected()` and streaming responses still see a
    client that leaves).
The 413 body is an OpenAI-style error, like every other error of these servers:
    {"error": {"message": ..., "type": "RequestTooLargeError", "param": null, "code": 413}}
Lifespan and websocket scopes pass through untouched. No app state changes for a refused request.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Default limit: a prompt at the longest context length pdserve serves, sent as JSON token ids or text
# (a few bytes to ~12 bytes per token when escaped), fits many times over.
DEFAULT_MAX_BODY_BYTES = 16 << 20


async def send_json(send: Send, status: int, body: dict, close: bool = False) -> None:
    """A middleware's whole answer: `body` as JSON with `status` (the app is never called). `close`: the
    request's body was not read, so the connection cannot be reused."""
    content = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content, "more_body": False})


def too_large_body(max_bytes: int) -> dict:
    return {
        "error": {
            "message": f"request body larger than {max_bytes} bytes",
            "type": "RequestTooLargeError",
            "param": None,
            "code": 413,
        }
    }


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a non-negative int, got {max_bytes!r}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-length" and value.strip().isdigit() and int(value) > self.max_bytes:
                await self._refuse(send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body arrived: nobody to answer
            if message["type"] != "http.request":
                continue
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if body:
                chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        # (the rest of the body is never read: the connection cannot be reused)
        await send_json(send, 413, too_large_body(self.max_bytes), close=True)
