"""Security properties (issue 7, point 4), each checked where it is enforced:

1. Control messages are authenticated (HMAC) and versioned: unsigned, wrongly signed, tampered and
   replayed-under-another-key messages are dropped and counted by a real `ControlChannel`.
2. Bootstrap writes (`PUT /route`) need the cluster secret: 401 without it, nothing registered; PD
   engines always pass the secret; bodies are capped even when streamed.
3. Every server binds 127.0.0.1 unless told otherwise (CLI defaults, bootstrap, control, PD context).
4. Size limits: control messages (`MAX_MESSAGE_BYTES`, `OversizedMessage`) and HTTP bodies
   (`pdserve.server.limits.BodySizeLimit`, 413 with an OpenAI error body).
5. No pickle / marshal / shelve / eval / exec, no `torch.load` without `weights_only=True`, no
   `numpy.load(allow_pickle=True)`, no `yaml.load` without a safe loader, no `shell=True`, no
   unsandboxed jinja2 in the package (AST scan naming file and line).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import hmac
import inspect
import json
import struct
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

import pdserve
from pdserve.disagg import bootstrap
from pdserve.disagg import messages as m
from pdserve.disagg.bootstrap import AUTH_HEADER, BootstrapServer, auth_tag
from pdserve.disagg.control import ControlChannel, curve_client
from pdserve.disagg.messages import Abort, KVRequest, Status
from pdserve.server.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimit

SECRET = b"security-test-cluster-secret-01"
PACKAGE = Path(pdserve.__file__).parent


# ---- 1. control messages: authenticated and versioned --------------------------------------------
def test_every_message_is_signed_and_versioned():
    bodies = [
        KVRequest([1, 2], 0, 0),
        Status(state=4),
        Abort(reason="x"),
        m.AbortAck(),
        m.RegisterAck(ok=True),
    ]
    for body in bodies:
        header, content, mac = m.encode(body, 7, "peer", SECRET)
        assert msgspec.msgpack.decode(header)[0] == m.PROTOCOL_VERSION
        h = hmac.new(SECRET, b"pdserve-control\x00", hashlib.sha256)
        for frame in (header, content):
            h.update(struct.pack(">I", len(frame)) + frame)
        assert hmac.compare_digest(mac, h.digest())  # HMAC-SHA256 over both frames and their lengths


@pytest.fixture
def receiver():
    rx = ControlChannel("127.0.0.1", SECRET, "rx")
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    curve_client(raw, SECRET)  # past the transport's handshake: these tests are about the messages
    raw.connect(rx.address)
    yield rx, raw
    raw.close(0)
    rx.close()


def _deliver(rx: ControlChannel, raw: zmq.Socket, frames: list[bytes], marker_room: int) -> list:
    """Send `frames`, then a valid marker; return what arrived before the marker (ZMQ keeps order)."""
    raw.send_multipart(frames)
    raw.send_multipart(m.encode(Status(state=4), marker_room, "marker", SECRET))
    got: list = []
    deadline = time.monotonic() + 10
    while not any(e.room == marker_room and e.sender == "marker" for e in got):
        assert time.monotonic() < deadline
        got += rx.poll(timeout_s=0.05)
    return got[:-1]


def test_unsigned_wrongly_signed_and_foreign_messages_are_dropped(receiver):
    rx, raw = receiver
    valid = m.encode(Abort(reason="stop"), 42, "decode-1", SECRET)
    captured_elsewhere = m.encode(Abort(reason="stop"), 42, "decode-1", b"another cluster's secret")
    cases = {
        "unsigned": (valid[:2], "num_forged"),  # header + body, no MAC
        "zero MAC": ([*valid[:2], b"\x00" * 32], "num_forged"),
        "MAC of another key": (m.seal(valid[:2], b"wrong key"), "num_forged"),
        "replayed under another key": (captured_elsewhere, "num_forged"),
        "MAC of other content": (
            [valid[0], msgspec.msgpack.encode(KVRequest([0], 0, 0)), valid[2]],
            "num_forged",
        ),
        "truncated MAC": ([*valid[:2], valid[2][:16]], "num_forged"),
        "header only": (valid[:1], "num_malformed"),
        "extra frame": ([*valid, b""], "num_malformed"),
        "authentic, a newer version": (
            m.seal([msgspec.msgpack.encode([m.PROTOCOL_VERSION + 1, "abort", 42, "d"]), valid[1]], SECRET),
            "num_wrong_version",
        ),
        "authentic, version 0": (
            m.seal([msgspec.msgpack.encode([0, "abort", 42, "d"]), valid[1]], SECRET),
            "num_wrong_version",
        ),
    }
    for i, (name, (frames, counter)) in enumerate(cases.items(), start=1):
        before = rx.stats()
        assert _deliver(rx, raw, frames, marker_room=1000 + i) == [], name
        after = rx.stats()
        changed = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        assert changed == {counter: 1, "num_received": 1}, (name, changed)  # +1 received: the marker
    # The genuine message still goes through (and, as documented, HMAC alone does not stop a replay
    # of it: rooms are random and ignored once finished).
    got = _deliver(rx, raw, valid, marker_room=2000)
    assert [(e.kind, e.room, e.sender) for e in got] == [("abort", 42, "decode-1")]
    assert rx.alive and rx.num_errors == 0


def test_channels_of_different_clusters_cannot_talk():
    """Their CURVE keys derive from different secrets: the handshake fails, nothing arrives (not even
    as a forgery to count), and the channel keeps serving its own cluster."""
    a = ControlChannel("127.0.0.1", SECRET, "a")
    b = ControlChannel("127.0.0.1", b"other cluster", "b")
    c = ControlChannel("127.0.0.1", b"other cluster", "c")
    try:
        a.send(b.address, Abort(reason="x"), room=5)
        c.send(b.address, Abort(reason="y"), room=6)
        got, deadline = [], time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got += b.poll(timeout_s=0.1)
        time.sleep(0.5)  # a's message, were it to arrive, has had time
        got += b.poll(timeout_s=0.1)
        assert [e.room for e in got] == [6]
        assert (b.num_forged, b.num_malformed, b.num_received) == (0, 0, 1)
    finally:
        c.close()
        a.close()
        b.close()


def test_pd_roles_refuse_to_run_without_a_secret(monkeypatch):
    from pdserve.engine.pd_common import SECRET_ENV, PDConfig

    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError):
        PDConfig.secret_from(None)
    with pytest.raises(ValueError):
        PDConfig.secret_from("")
    with pytest.raises(ValueError):
        ControlChannel("127.0.0.1", b"", "x")
    with pytest.raises(ValueError):
        m.encode(Abort("x"), 1, "d", b"")


# ---- 2. bootstrap writes need the secret ---------------------------------------------------------
def _route(rank: int = 0) -> bytes:
    return json.dumps(
        {
            "rank": rank,
            "world_size": 1,
            "control_addr": "tcp://127.0.0.1:7000",
            "layout_fingerprint": "fp",
            "page_size": 16,
            "kv_dtype": "float32",
            "engine_name": "prefill-0",
            "epoch": 1,
        }
    ).encode()


def test_bootstrap_put_needs_the_secret_and_changes_nothing_without_it():
    server = BootstrapServer("127.0.0.1", 0, secret=SECRET)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c:
            body = _route()
            other_body = _route().replace(b"7000", b"6666")
            refused = [
                {},  # no header
                {AUTH_HEADER: ""},
                {AUTH_HEADER: "00" * 32},
                {AUTH_HEADER: auth_tag(b"wrong secret", body)},
                {AUTH_HEADER: auth_tag(SECRET, other_body)},  # a valid tag replayed on another body
                {AUTH_HEADER: auth_tag(SECRET, body)[:-2]},
                {AUTH_HEADER: auth_tag(SECRET, body).upper()},
                {AUTH_HEADER: "\u00e9".encode("latin-1") * 64},  # non-ASCII bytes
            ]
            for headers in refused:
                r = c.put("/route", content=body, headers={"content-type": "application/json", **headers})
                assert r.status_code == 401, (headers, r.text)
                assert c.get("/health").json()["registered"] == 0
                assert (
                    c.get("/route").status_code == 503
                    and c.get("/route", params={"rank": 0}).status_code == 503
                )
            # A huge body is refused (413) before the secret is even checked; nothing stored either.
            r = c.put("/route", content=b"{" * (bootstrap.MAX_BODY_BYTES + 1), headers={AUTH_HEADER: "x"})
            assert r.status_code == 413 and c.get("/health").json()["registered"] == 0
            # With the secret: registered.
            r = c.put("/route", content=body, headers={AUTH_HEADER: auth_tag(SECRET, body)})
            assert r.status_code == 200 and c.get("/health").json()["registered"] == 1
            assert c.get("/route", params={"rank": 0}).json()["control_addr"] == "tcp://127.0.0.1:7000"
            # A later unauthenticated re-registration cannot move the rank.
            assert c.put("/route", content=other_body).status_code == 401
            assert c.get("/route", params={"rank": 0}).json()["control_addr"] == "tcp://127.0.0.1:7000"
    finally:
        server.stop()


async def _asgi_put(app, chunks: int, chunk_bytes: int, headers: list) -> tuple[int, int]:
    """PUT /route with a body streamed in `chunks` pieces straight into the ASGI app; returns (status,
    pieces the app pulled)."""
    pulled = 0
    sent = []

    async def receive():
        nonlocal pulled
        if pulled < chunks:
            pulled += 1
            return {"type": "http.request", "body": b"x" * chunk_bytes, "more_body": pulled < chunks}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "PUT",
        "scheme": "http",
        "path": "/route",
        "raw_path": b"/route",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await asyncio.wait_for(app(scope, receive, send), 10)
    return next(x["status"] for x in sent if x["type"] == "http.response.start"), pulled


def test_bootstrap_streamed_body_is_never_buffered_past_the_limit():
    table = bootstrap.RouteTable()
    app = bootstrap.create_app(table, SECRET)
    status, pulled = asyncio.run(_asgi_put(app, chunks=10_000, chunk_bytes=16 << 10, headers=[]))
    assert status == 413
    assert pulled <= bootstrap.MAX_BODY_BYTES // (16 << 10) + 1  # stopped at the limit, not 160 MB later
    assert table.snapshot() == []


def _calls_bootstrap_server_with_secret(tree: ast.AST) -> list[ast.Call]:
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name == "BootstrapServer":
                calls.append(node)
    return calls


def test_pd_engines_start_their_bootstrap_server_with_the_cluster_secret():
    """The one production construction site passes `secret=config.cluster_secret` (a PD config
    cannot exist without one: `PDConfig.secret_from`)."""
    src = (PACKAGE / "server" / "pd_context.py").read_text()
    calls = _calls_bootstrap_server_with_secret(ast.parse(src))
    assert calls, "PDContext no longer builds a BootstrapServer: update this test"
    for call in calls:
        kw = {k.arg: k.value for k in call.keywords}
        assert "secret" in kw, f"pd_context.py:{call.lineno}: BootstrapServer without secret="
        assert ast.unparse(kw["secret"]) == "config.cluster_secret", ast.unparse(kw["secret"])
    # Nowhere else in the package builds one (a second, unauthenticated server would bypass this).
    others = [
        f"{p.relative_to(PACKAGE)}:{c.lineno}"
        for p in PACKAGE.rglob("*.py")
        if p.name not in ("pd_context.py", "bootstrap.py")
        for c in _calls_bootstrap_server_with_secret(ast.parse(p.read_text()))
    ]
    assert others == []


# ---- 3. loopback by default ----------------------------------------------------------------------
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _all_parsers(parser: argparse.ArgumentParser, path: str = "pdserve"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{path} {name}")


def test_cli_binds_loopback_by_default():
    from pdserve.cli import build_parser

    seen = []
    for path, parser in _all_parsers(build_parser()):
        for action in parser._actions:
            names = " ".join(action.option_strings) + " " + (action.dest or "")
            if action.type in (int, float) or getattr(action.type, "is_number", False):
                continue  # a number is never an address (e.g. `simulate --host-buffer-gb`)
            if any(w in names for w in ("host", "bind", "listen", "address")) and "url" not in names:
                seen.append(path)
                assert action.default in LOOPBACK, (
                    f"`{path} {action.option_strings}` defaults to {action.default!r}"
                )
    assert {"pdserve serve", "pdserve router"} <= set(seen)
    # `launch` has no --host: every process it starts gets serve/router's loopback default.
    src = (PACKAGE / "launch.py").read_text()
    assert "--host" not in src and "0.0.0.0" not in src


def test_library_servers_bind_loopback_by_default():
    from pdserve.server.pd_context import PDContext

    assert inspect.signature(BootstrapServer).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(PDContext).parameters["host"].default == "127.0.0.1"
    s = BootstrapServer()
    try:
        assert s.url.startswith("http://127.0.0.1:") and s._sock.getsockname()[0] == "127.0.0.1"
    finally:
        s.stop()
    ch = ControlChannel("127.0.0.1", SECRET, "x")
    try:
        assert ch.address.startswith("tcp://127.0.0.1:")
    finally:
        ch.close()


def test_no_wildcard_bind_in_the_package():
    """No call passes a wildcard address ("0.0.0.0", "::", "*", "") as a host/bind argument."""
    wild = {"0.0.0.0", "::", "*", ""}
    bad = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                if kw.arg in ("host", "bind_host", "bind") and isinstance(kw.value, ast.Constant):
                    if kw.value.value in wild:
                        bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            for arg in node.args:
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and arg.value.startswith(("tcp://0.0.0.0", "tcp://*", "0.0.0.0"))
                ):
                    bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert bad == []


# ---- 4. size limits ------------------------------------------------------------------------------
def test_control_message_size_limit():
    assert m.MAX_MESSAGE_BYTES > 0 and issubclass(m.OversizedMessage, m.BadMessage)
    assert issubclass(m.OversizedMessage, m.MessageRejected)
    frames = m.encode(KVRequest(list(range(1000)), 0, 0), 1, "d", SECRET)
    size = sum(map(len, frames))
    with pytest.raises(m.OversizedMessage):
        m.decode(frames, SECRET, max_bytes=size - 1)
    assert m.decode(frames, SECRET, max_bytes=size).body.dst_page_ids == list(range(1000))
    # The channel applies its own max_msg_bytes to whole messages (each frame is capped by ZMQ).
    assert "max_msg_bytes" in inspect.signature(ControlChannel).parameters


def _tiny_app(max_bytes: int) -> tuple[FastAPI, dict]:
    calls = {"n": 0}
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        calls["n"] += 1
        body = await request.body()
        return {"len": len(body), "disconnected": await request.is_disconnected()}

    @app.get("/stream")
    async def stream():
        async def gen():
            for i in range(3):
                yield f"data: {i}\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    app.add_middleware(BodySizeLimit, max_bytes=max_bytes)
    return app, calls


def _assert_413(r: httpx.Response, max_bytes: int) -> None:
    assert r.status_code == 413, r.text
    assert r.json() == {
        "error": {
            "message": f"request body larger than {max_bytes} bytes",
            "type": "RequestTooLargeError",
            "param": None,
            "code": 413,
        }
    }


def test_body_size_limit_middleware():
    app, calls = _tiny_app(1000)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.post("/echo", content=b"x" * 1000)  # exactly the limit
            assert r.status_code == 200 and r.json() == {"len": 1000, "disconnected": False}
            assert (await c.post("/echo", content=b"")).json()["len"] == 0
            _assert_413(await c.post("/echo", content=b"x" * 1001), 1000)  # declared too big
            assert calls["n"] == 2

            async def chunked(n: int):
                for _ in range(n):
                    yield b"y" * 300

            r = await c.post("/echo", content=chunked(3))  # no Content-Length, 900 bytes
            assert (
                r.status_code == 200 and r.json()["len"] == 900 and "content-length" not in r.request.headers
            )
            _assert_413(await c.post("/echo", content=chunked(4)), 1000)  # streamed past the limit
            assert calls["n"] == 3
            r = await c.get("/stream")
            assert r.status_code == 200 and r.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"

    asyncio.run(run())


CSRF_BODY = b'{"model_path": "/tmp/attacker-ckpt", "abort_running": true}'


def test_a_cross_site_post_is_never_read_as_json_by_the_router():
    """A web page the operator has open can POST to the router on 127.0.0.1 without a CORS preflight
    if the request is "simple" (text/plain, or a typeless Blob: no Content-Type). The router read any
    body as JSON and forwarded it to every engine as JSON: such a page could make the whole cluster
    abort its requests and load a checkpoint of its choosing (a review of weight updates; the engines
    alone refused it, by FastAPI's rule). Now a declared non-JSON type is a 415 everywhere, and a
    body without a type is a 415 on the control routes; nothing reaches an engine."""
    from pdserve.router.app import Router
    from pdserve.router.routes import build_router_app

    asked: list[tuple[str, str]] = []

    async def engines(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/pd/info":
            role = "prefill" if request.url.host == "pe" else "decode"
            return httpx.Response(200, json={"role": role, "model": "m", "bootstrap_url": "http://pe:1"})
        asked.append((request.url.host, request.url.path))
        return httpx.Response(200, json={"success": True})

    async def go():
        router = Router(["http://pe"], ["http://de"])
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(engines))
        await router.check_health()
        transport = httpx.ASGITransport(app=build_router_app(router))
        out = []
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            for path, body, content_type in [
                ("/update_weights_from_disk", CSRF_BODY, "text/plain"),
                ("/update_weights_from_disk", CSRF_BODY, None),  # (a typeless Blob)
                ("/abort_request", b'{"abort_all": true}', "text/plain;charset=UTF-8"),
                ("/abort_request", b'{"abort_all": true}', None),
                (
                    "/v1/completions",
                    b'{"prompt": "hi", "max_tokens": 2}',
                    "application/x-www-form-urlencoded",
                ),
                ("/tokenize", b'{"prompt": "hi"}', "multipart/form-data; boundary=x"),
            ]:
                headers = {"content-type": content_type} if content_type else {}
                request = c.build_request("POST", path, content=body, headers=headers)
                assert ("content-type" in request.headers) == (content_type is not None)
                out.append((await c.send(request)).status_code)
            ok = await c.post("/abort_request", json={"abort_all": True})  # a JSON client: as before
            flushed = await c.post("/flush_cache")  # (SGLang's clients: no body, no type)
        return out, ok, flushed

    refused, ok, flushed = asyncio.run(go())
    assert refused == [415] * 6
    assert ok.status_code == 200 and flushed.status_code == 200
    assert asked == [
        ("pe", "/abort_request"),
        ("de", "/abort_request"),
        ("pe", "/flush_cache"),
        ("de", "/flush_cache"),
    ]


def test_the_fault_injection_route_does_not_read_a_typeless_cross_site_body(demo_model_dir):
    """`POST /debug/faults` (chaos clusters) replaces the fault rules from a raw body: a typeless
    cross-site POST armed faults (a review of this session's changes). It is a control route now."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from tests.conftest import run_in_process

    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=256))

    async def scenario(c):
        request = c.build_request("POST", "/debug/faults", content=b'{"rules": [], "seed": 7}')
        assert "content-type" not in request.headers
        typeless = await c.send(request)
        return typeless, await c.post("/debug/faults", json={"rules": [], "seed": 7})

    typeless, as_json = run_in_process(engine, scenario, enable_fault_injection=True)
    assert typeless.status_code == 415 and as_json.status_code == 200


def test_json_content_types_are_recognised():
    from pdserve.server.content_type import is_json

    for ok in (
        "application/json",
        "application/json; charset=utf-8",
        "Application/JSON",
        "application/vnd.x+json",
    ):
        assert is_json(ok), ok
    for bad in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "text/json", ""):
        assert not is_json(bad), bad


def test_body_size_limit_stops_reading_at_the_limit():
    app, calls = _tiny_app(64 << 10)
    status, pulled = asyncio.run(
        _asgi_put(BodySizeLimit(app.router, 64 << 10), chunks=10_000, chunk_bytes=16 << 10, headers=[])
    )
    assert status == 413 and pulled == 5 and calls["n"] == 0  # 5 x 16 KiB > 64 KiB: stop there
    status, pulled = asyncio.run(
        _asgi_put(
            BodySizeLimit(app.router, 64 << 10),
            chunks=1,
            chunk_bytes=1,
            headers=[(b"content-length", b"70000")],
        )
    )
    assert status == 413 and pulled == 0  # declared: refused before reading anything


def test_body_size_limit_over_real_http():
    """Through uvicorn: a declared and a chunked oversized body get 413, and the server keeps serving."""
    import socket
    import threading

    import uvicorn

    app, calls = _tiny_app(100_000)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        _assert_413(httpx.post(url + "/echo", content=b"x" * 100_001, timeout=10), 100_000)

        def chunks():
            for _ in range(64):
                yield b"z" * 65536  # 4 MiB in all, streamed

        try:
            _assert_413(httpx.post(url + "/echo", content=chunks(), timeout=10), 100_000)
        except httpx.WriteError:
            pass  # the server answered and closed while the client was still sending: also a refusal
        assert httpx.post(url + "/echo", content=b"ok", timeout=10).json()["len"] == 2
        assert calls["n"] == 1
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_body_size_limit_arguments():
    assert DEFAULT_MAX_BODY_BYTES >= 1 << 20
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(ValueError):
            BodySizeLimit(FastAPI(), bad)


# ---- 5. no unsafe deserialisation or code execution ----------------------------------------------
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle"}


def unsafe_calls(source: str, filename: str = "<src>") -> list[str]:
    """`file:line: what` for every banned construct in `source`."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> dotted origin (import numpy as np -> np: numpy)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[(a.asname or a.name).split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.split(".")[0] in BANNED_MODULES:
                    found.append(f"{filename}:{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            if root in BANNED_MODULES:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(expr: ast.expr) -> str:
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id, expr.id)
        if isinstance(expr, ast.Attribute):
            return f"{dotted(expr.value)}.{expr.attr}"
        return "?"

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        kw = {k.arg: k.value for k in node.keywords if k.arg}

        def const(key: str, _kw=kw):
            v = _kw.get(key)
            return v.value if isinstance(v, ast.Constant) else ("<expr>" if v is not None else None)

        where = f"{filename}:{node.lineno}"
        if isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec") and name in ("eval", "exec"):
            found.append(f"{where}: {node.func.id}()")
        elif name in ("builtins.eval", "builtins.exec"):
            found.append(f"{where}: {name}()")
        elif name == "torch.load" and const("weights_only") is not True:
            found.append(f"{where}: torch.load without weights_only=True")
        elif name in ("numpy.load", "numpy.lib.npyio.load") and const("allow_pickle") not in (None, False):
            found.append(f"{where}: numpy.load with allow_pickle")
        elif name == "yaml.load":
            loader = kw.get("Loader", node.args[1] if len(node.args) > 1 else None)
            if loader is None or not dotted(loader).endswith(("SafeLoader", "CSafeLoader")):
                found.append(f"{where}: yaml.load without SafeLoader")
        elif name in ("yaml.unsafe_load", "yaml.full_load", "pandas.read_pickle"):
            found.append(f"{where}: {name}")
        elif const("shell") not in (None, False):
            found.append(f"{where}: shell=True")
        elif name in ("os.system", "os.popen"):
            found.append(f"{where}: {name}")
        elif name in ("jinja2.Environment", "jinja2.Template", "jinja2.environment.Environment"):
            found.append(f"{where}: unsandboxed {name} (use jinja2.sandbox)")
    return found


def test_scanner_catches_every_banned_construct():
    src = """
import pickle
import numpy as np, torch, yaml, os, subprocess
from marshal import loads
from torch import load as tload
import jinja2
eval("1")
exec("x = 1")
torch.load("f")
torch.load("f", weights_only=False)
tload("f")
np.load("f", allow_pickle=True)
yaml.load(s)
yaml.load(s, Loader=yaml.Loader)
subprocess.run("ls", shell=True)
os.system("ls")
jinja2.Environment()
model.eval()
torch.load("f", weights_only=True)
np.load("f")
yaml.load(s, Loader=yaml.SafeLoader)
yaml.safe_load(s)
"""
    found = unsafe_calls(src)
    lines = sorted(int(f.split(":")[1]) for f in found)
    assert lines == [2, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], found


def test_no_pickle_or_eval_in_the_package():
    found = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50
    for path in files:
        found += unsafe_calls(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == [], "unsafe constructs:\n" + "\n".join(found)


def test_a_browsers_cross_origin_post_is_refused_even_without_a_body(demo_model_dir):
    """A page on another origin can send a body-less POST without a preflight (`fetch(url, {method:
    "POST", mode: "no-cors"})`): /pause_generation aborted every request and held new ones, /sleep
    freed the KV cache (a review, 2026-12-04; vLLM's clients send those without a body, so the JSON
    rule cannot cover them). A browser marks such a request (Sec-Fetch-Site, Origin) and a page
    cannot forge the marks: 403, nothing changed. HTTP clients, and the same origin, pass."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from tests.conftest import run_in_process

    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=256))

    async def scenario(c):
        refused = [
            (await c.post("/pause_generation", headers=h)).status_code
            for h in (
                {"sec-fetch-site": "cross-site"},
                {"sec-fetch-site": "same-site"},  # (another port of 127.0.0.1 is another origin)
                {"origin": "http://evil.example"},
                {"origin": "null"},  # (a sandboxed frame, a file:// page)
                {"origin": "http://t:1"},  # (base_url http://t: another port)
            )
        ]
        slept = await c.post("/sleep", headers={"origin": "http://evil.example"})
        paused = (await c.get("/is_paused")).json()
        same_origin = await c.post("/pause", params={"mode": "abort"}, headers={"origin": "http://t"})
        resumed = await c.post("/resume", headers={"sec-fetch-site": "same-origin"})
        curl = await c.post("/pause", params={"mode": "abort"})  # (no marks: not a browser)
        await c.post("/resume")
        return refused, slept, paused, same_origin, resumed, curl

    refused, slept, paused, same_origin, resumed, curl = run_in_process(engine, scenario)
    assert refused == [403] * 5
    assert slept.status_code == 403 and slept.json()["error"]["type"] == "ForbiddenError"
    assert paused == {"is_paused": False}
    assert same_origin.status_code == resumed.status_code == curl.status_code == 200


def test_cross_origin_marks():
    from pdserve.server.content_type import is_cross_origin

    def cross(**h: str) -> bool:
        return is_cross_origin({k.replace("_", "-").encode(): v.encode() for k, v in h.items()})

    assert not cross() and not cross(host="127.0.0.1:8000")
    assert not cross(host="127.0.0.1:8000", origin="http://127.0.0.1:8000")
    assert cross(host="127.0.0.1:8000", origin="http://127.0.0.1:3000")
    assert cross(host="127.0.0.1:8000", origin="null")
    assert not cross(sec_fetch_site="none") and not cross(sec_fetch_site="same-origin", origin="http://x")
    assert cross(sec_fetch_site="cross-site", host="a", origin="http://a")  # (the browser's word wins)
