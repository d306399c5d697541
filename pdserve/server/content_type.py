"""Request bodies must be JSON: a pure ASGI middleware against cross-site requests (CSRF).

A web page the operator has open can POST to http://127.0.0.1:<port> without a CORS preflight as
long as the request is "simple": Content-Type text/plain, form-urlencoded or multipart, or none at
all (a typeless Blob). Its answer is hidden from the page, but the request still runs, so the routes
that change state (load a checkpoint, abort every request) must never read such a body as JSON.
FastAPI's own rule covers the engine's pydantic bodies (CVE-2021-32677: a declared non-JSON type is
not parsed), but the router reads raw bodies and forwarded them to its engines as JSON.

Who uses it: `server/api.py build_app` and `router/routes.py build_router_app` (`app.add_middleware`).

Per HTTP request with a body-carrying method (POST, PUT, PATCH):
  - sent by a browser from another origin (`Sec-Fetch-Site` other than same-origin or none, or an
    `Origin` whose host is not the request's `Host`) -> 403. Browsers send these headers on every
    cross-origin POST and a page cannot forge them; HTTP clients (openai, requests, curl) send neither.
    This is what stops a body-less cross-site POST (`fetch(url, {method: "POST"})`): /pause_generation
    aborting every request, /sleep freeing the KV cache (found by a review). Those routes take no body
    from vLLM's clients (`POST /sleep?level=1`), so a rule on the body alone cannot cover them. No
    browser app on another origin can use this API anyway: it answers no CORS preflight;
  - a declared Content-Type that is not JSON (`application/json`, `application/*+json`) -> 415;
  - no Content-Type: read as JSON (FastAPI's rule, which clients rely on), except on the state
    changing control routes (`CONTROL_PATHS`) when a body comes (Content-Length > 0 or chunked): 415
    there (a body-less POST /flush_cache, as SGLang's clients send it, still passes).
The refusal is an OpenAI-style error, nothing read, the app never called.
"""

from __future__ import annotations

from email.message import Message
from urllib.parse import urlsplit

from pdserve.server.limits import ASGIApp, Receive, Scope, Send, send_json
from pdserve.server.protocol import error_body

CONTROL_PATHS = frozenset(
    {"/update_weights_from_disk", "/abort_request", "/reset_prefix_cache", "/flush_cache", "/debug/faults"}
)
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def is_json(content_type: str) -> bool:
    """`application/json` or `application/<anything>+json`, parameters (charset) ignored."""
    m = Message()
    m["content-type"] = content_type
    return m.get_content_maintype() == "application" and (
        m.get_content_subtype() == "json" or m.get_content_subtype().endswith("+json")
    )


class JsonBodies:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope.get("headers", ())}
        if is_cross_origin(headers):
            await send_json(
                send,
                403,
                error_body("cross-origin requests from a browser are refused", 403, "ForbiddenError"),
            )
            return
        content_type = headers.get(b"content-type")
        if content_type is not None:
            ok = is_json(content_type.decode("latin-1"))
        else:
            length = headers.get(b"content-length", b"0").strip()
            has_body = b"transfer-encoding" in headers or not length.isdigit() or int(length) > 0
            ok = not (has_body and scope["path"] in CONTROL_PATHS)
        if ok:
            await self.app(scope, receive, send)
            return
        message = "request body must be JSON (Content-Type: application/json)"
        await send_json(send, 415, error_body(message, 415, "UnsupportedMediaTypeError"))


def is_cross_origin(headers: dict[bytes, bytes]) -> bool:
    """A browser's request from a page of another origin (lower-cased header names)."""
    fetch_site = headers.get(b"sec-fetch-site")
    if fetch_site is not None:
        return fetch_site.strip().lower() not in (b"same-origin", b"none")
    origin = headers.get(b"origin")
    if origin is None:
        return False
    host = headers.get(b"host", b"").strip().lower()
    return urlsplit(origin.decode("latin-1").strip()).netloc.lower() != host.decode("latin-1")
