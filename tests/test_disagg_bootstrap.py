"""Bootstrap server over real HTTP on 127.0.0.1: registration, topology, 503/400/404/409/401, lookup."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest

from pdserve.disagg.bootstrap import (
    AUTH_HEADER,
    BootstrapError,
    BootstrapServer,
    RankRoute,
    auth_tag,
    lookup,
    register,
)


def _route(rank: int, world: int = 2, **kw) -> dict:
    return {
        "rank": rank,
        "world_size": world,
        "control_addr": f"tcp://127.0.0.1:{7000 + rank}",
        "layout_fingerprint": "llama/bf16/p16/L2",
        "page_size": 16,
        "kv_dtype": "bfloat16",
        "engine_name": f"prefill-r{rank}",
        "epoch": 1,
        **kw,
    }


@pytest.fixture
def server():
    s = BootstrapServer("127.0.0.1", 0)
    s.start()
    yield s
    s.stop()


def test_health_and_503_before_registration(server):
    assert server.url == f"http://127.0.0.1:{server.port}" and server.port > 0
    with httpx.Client(base_url=server.url, timeout=5) as c:
        r = c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "registered": 0, "world_size": None}
        assert c.get("/route").status_code == 503
        assert c.get("/route", params={"rank": 0}).status_code == 503


def test_put_get_topology(server):
    with httpx.Client(base_url=server.url, timeout=5) as c:
        assert c.put("/route", json=_route(1)).json() == {"ok": True}
        assert c.get("/route").status_code == 503  # 1 of 2 ranks
        assert c.get("/route", params={"rank": 0}).status_code == 503
        r1 = c.get("/route", params={"rank": 1})
        assert r1.status_code == 200 and r1.json() == _route(1)
        assert c.put("/route", json=_route(0)).status_code == 200
        topo = c.get("/route")
        assert topo.status_code == 200
        assert topo.json() == {
            "world_size": 2,
            "layout_fingerprint": "llama/bf16/p16/L2",
            "page_size": 16,
            "kv_dtype": "bfloat16",
            "ranks": [
                {"rank": 0, "control_addr": "tcp://127.0.0.1:7000", "engine_name": "prefill-r0"},
                {"rank": 1, "control_addr": "tcp://127.0.0.1:7001", "engine_name": "prefill-r1"},
            ],
        }
        # A restarted rank (a newer epoch) re-registers with a new address; the same registration again
        # is harmless; the old incarnation's (a replay: the tag signs the body, not its time) is a 409.
        restarted = _route(0, control_addr="tcp://127.0.0.1:9999", epoch=2)
        assert c.put("/route", json=restarted).status_code == 200
        assert c.put("/route", json=restarted).status_code == 200
        for stale in (_route(0), _route(0, epoch=2, control_addr="tcp://127.0.0.1:9998")):
            r = c.put("/route", json=stale)
            assert r.status_code == 409 and "not newer" in r.json()["error"]
        assert c.get("/route", params={"rank": 0}).json()["control_addr"] == "tcp://127.0.0.1:9999"
        assert c.get("/health").json() == {"status": "ok", "registered": 2, "world_size": 2}
        assert c.get("/route", params={"rank": 2}).status_code == 404
        assert c.get("/route", params={"rank": "x"}).status_code == 400
        assert c.get("/route", params={"rank": -1}).status_code == 400


def test_bad_input(server):
    with httpx.Client(base_url=server.url, timeout=5) as c:
        for content in (b"{not json", b"", b"[]", b"null", json.dumps({"rank": 0}).encode()):
            r = c.put("/route", content=content, headers={"content-type": "application/json"})
            assert r.status_code == 400, content
            assert "error" in r.json()
        for bad in (
            {"rank": -1},
            {"rank": 2},  # >= world_size
            {"world_size": 0},
            {"page_size": 0},
            {"control_addr": "http://127.0.0.1:1"},
            {"control_addr": "tcp://127.0.0.1"},
            {"layout_fingerprint": ""},
            {"rank": "0"},
            {"unexpected": 1},
        ):
            r = c.put("/route", json={**_route(0), **bad})
            assert r.status_code == 400, bad
        assert c.put("/route", content=b"x" * (65 << 10)).status_code == 413
        assert c.get("/health").json()["registered"] == 0  # nothing was stored
        # Conflicts with what is registered: 409 and no change.
        assert c.put("/route", json=_route(0)).status_code == 200
        for bad in (
            {"world_size": 4},
            {"layout_fingerprint": "qwen"},
            {"page_size": 32},
            {"kv_dtype": "float16"},
        ):
            assert c.put("/route", json=_route(1, **bad)).status_code == 409, bad
        assert c.get("/health").json()["registered"] == 1


def test_lookup_helper(server):
    async def scenario() -> None:
        with pytest.raises(BootstrapError) as e:
            await lookup(server.url, rank=0)
        assert e.value.status_code == 503
        await register(server.url, msgspec.convert(_route(0, world=1), RankRoute))
        assert await lookup(server.url, rank=0) == _route(0, world=1)
        topo = await lookup(server.url, rank=None)
        assert topo["world_size"] == 1 and topo["ranks"][0]["control_addr"] == "tcp://127.0.0.1:7000"
        with pytest.raises(BootstrapError) as e:
            await lookup(server.url, rank=5)
        assert e.value.status_code == 404

    asyncio.run(scenario())


def test_lookup_unreachable_times_out_quickly():
    s = BootstrapServer("127.0.0.1", 0)
    url = s.url
    s.stop()  # never started; the port is released

    async def scenario() -> None:
        with pytest.raises(BootstrapError) as e:
            await lookup(url, rank=0, timeout_s=1.0)
        assert e.value.status_code is None

    asyncio.run(scenario())


def test_register_local_and_secret():
    secret = b"bootstrap-secret"
    s = BootstrapServer("127.0.0.1", 0, secret=secret)
    s.start()
    try:
        s.register_local(msgspec.convert(_route(0, world=2), RankRoute))
        with httpx.Client(base_url=s.url, timeout=5) as c:
            body = json.dumps(_route(1)).encode()
            assert c.put("/route", content=body).status_code == 401
            assert c.put("/route", content=body, headers={AUTH_HEADER: "00" * 32}).status_code == 401
            assert (
                c.put("/route", content=body, headers={AUTH_HEADER: auth_tag(secret, body)}).status_code
                == 200
            )
            assert c.get("/route").status_code == 200  # reads need no secret
        asyncio.run(register(s.url, msgspec.convert(_route(1), RankRoute), secret=secret))
        with pytest.raises(BootstrapError) as e:
            asyncio.run(register(s.url, msgspec.convert(_route(1), RankRoute), secret=b"wrong"))
        assert e.value.status_code == 401
    finally:
        s.stop()
        s.stop()  # idempotent


def test_the_decodes_lookups_reuse_one_client(server, monkeypatch):
    """The decode asks a prefill's bootstrap server for its control address once a second (the cache's
    TTL), on the request path. Each lookup built its own httpx client, and building one loads the CA
    bundle: ~20 ms of CPU that stalled the decode's event loop (every stream it serves) once a second
    per prefill. The lookups now share one client, built once."""
    from types import SimpleNamespace

    from pdserve.server import pd_context
    from pdserve.server.pd_context import PDContext

    with httpx.Client(base_url=server.url, timeout=5) as c:
        assert c.put("/route", json=_route(0, world=1)).json() == {"ok": True}
    built = []
    real = httpx.AsyncClient
    monkeypatch.setattr(pd_context.httpx, "AsyncClient", lambda *a, **kw: built.append(1) or real(*a, **kw))
    ctx = SimpleNamespace(_addr_cache={}, _http=None, ADDR_TTL_S=0.0)  # every call looks up again

    async def three_lookups():
        addrs = [await PDContext.control_address_of(ctx, server.url) for _ in range(3)]
        await ctx._http.aclose()
        return addrs

    assert asyncio.run(three_lookups()) == [_route(0)["control_addr"]] * 3
    assert built == [1]
