"""The router's HTTP front alone: its app in process, the engines behind it answered by an
`httpx.MockTransport` that records every call. What is checked is the router's own work: what it
refuses before any engine sees a request, and that a client who leaves while the router waits for it
gets both engine legs closed and its placement withdrawn."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from pdserve.router.app import STOPPING, Router
from pdserve.router.prompts import completion_view, prompt_shape, requested_max_tokens
from pdserve.router.routes import build_router_app
from pdserve.server.protocol import PREFILL_UNREACHABLE
from tests.test_router_placement import BPT, report


class Engines:
    """One prefill (`pe`) and one decode (`de`) behind a mock transport; `posts` lists each POST's
    (host, path), `closed` the hosts whose completion the router cancelled (closed its connection).
    A completion of a host in `blocking` waits until `release` is set; the others answer at once.
    `intercept` (a test's own engine behaviour): an async function of each request, whose answer
    (a response, or an exception it raises) replaces the mock's; None lets the mock answer."""

    def __init__(self, blocking=("pe", "de")) -> None:
        self.intercept = None
        self.posts: list[tuple[str, str]] = []
        self.closed: list[str] = []
        self.blocking = set(blocking)
        self.release = asyncio.Event()
        self.model_paths: dict[str, str] = {}  # host -> the weights it serves (default "/ckpt/a")
        self.weights_ids: dict[str, str] = {}  # host -> their identity (default: none reported)
        self.statuses: dict[str, str] = {}  # host -> its /pd/info status (default "ok")
        self.capacities: dict[str, int] = {}  # host -> its KV pool in tokens (default: not reported)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.intercept is not None and (answer := await self.intercept(request)) is not None:
            return answer
        host, path = request.url.host, request.url.path
        role = "prefill" if host.startswith("pe") else "decode"
        if path == "/pd/info":
            info = {"role": role, "model": "m", "bootstrap_url": "http://pe:1"}
            info |= {
                "model_path": self.model_paths.get(host, "/ckpt/a"),
                "status": self.statuses.get(host, "ok"),
            }
            if host in self.weights_ids:
                info["weights_id"] = self.weights_ids[host]
            if host in self.capacities:
                info["kv_capacity_tokens"] = self.capacities[host]
            return httpx.Response(200, json=info)
        if path == "/pd/load":
            return httpx.Response(200, json=report(host, role))
        self.posts.append((host, path))
        if host in self.blocking:
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.closed.append(host)
                raise
        return httpx.Response(200, json={"choices": [{"text": "x"}]})


async def within(awaitable, timeout_s: float):
    """Its result, or None when it takes longer than `timeout_s` (a hang the test reports)."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        return None


async def queued(router: Router, num_requests: int = 1, timeout_s: float = 1.0) -> None:
    """Until `num_requests` wait in the router's placement queue (or `timeout_s`: the test's own
    assertions then say what is missing)."""
    for _ in range(int(timeout_s / 0.01)):
        if len(router.placement.queue) >= num_requests:
            return
        await asyncio.sleep(0.01)


def client_of(router: Router, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    """A client of the router's app, in process (`raise_app_exceptions=False`: an app error is its 500)."""
    transport = httpx.ASGITransport(app=build_router_app(router), raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://router")


def completion_scope(body: bytes, path: str = "/v1/completions") -> dict:
    """The ASGI scope of a client's POST `path` of `body` (driven by hand: the test plays the server,
    so it decides when the client disconnects)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }


async def started_router(
    engines: Engines, policy: str, prefills=("http://pe",), decodes=("http://de",)
) -> Router:
    router = Router(list(prefills), list(decodes), policy=policy)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(engines.handle))
    await router.check_health()
    if router.placement is not None:
        for e in router.prefills + router.decodes:
            router.placement.on_load(e, report(e.url.split("//")[1], e.role))
        assert router.placement.scheduler is not None
    return router


@pytest.mark.parametrize(
    "field",
    ['"max_tokens": "16"', '"max_tokens": [1]', '"max_tokens": 0', '"max_tokens": -5', '"max_tokens": 1e400',
     '"max_tokens": true', '"prompt": [1, 2, 9223372036854775808]', '"prompt": [[1, -1]]'],
)  # fmt: skip
def test_bad_numbers_are_400s_before_any_engine_is_asked(field):
    """These used to reach `int()` or the prefix hash inside placement: a plain-text 500."""

    async def go():
        engines = Engines()
        engines.release.set()  # a request that got through is answered, not left hanging
        router = await started_router(engines, "dualpath")
        body = '{"prompt": [1, 2, 3], "max_tokens": 4, ' + field + "}"  # the last of a repeated key wins
        async with client_of(router) as c:
            r = await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        return r, engines, router

    r, engines, router = asyncio.run(go())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and ("max_tokens" in err["message"] or "token ids" in err["message"])
    assert engines.posts == [] and list(router.placement.queue) == [] and router.placement.num_placed == 0


def test_a_body_nested_too_deeply_to_parse_is_a_400_before_any_engine_is_asked():
    """msgspec refuses it, and the standard library's parser, the fallback, raised RecursionError (a 500)."""

    async def go():
        engines = Engines()
        router = await started_router(engines, "none")
        raw = '{"prompt": "a", "foo": ' + "[" * 100_000 + "]" * 100_000 + "}"
        async with client_of(router) as c:
            r = await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        return r, engines

    r, engines = asyncio.run(go())
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert engines.posts == []


def test_the_routers_own_refusals_are_in_openais_error_shape():
    """404, 405 (FastAPI's own: they were {"detail": ...}) and a weight update's bad body (pydantic's
    text with its docs' links before), answered as an engine answers them."""

    async def go():
        router = await started_router(Engines(), "none")
        async with client_of(router) as c:
            return [
                await c.post("/no/such/path", json={}),
                await c.get("/v1/completions"),
                await c.post("/update_weights_from_disk", json={"model_path": "", "extra": 1}),
            ]

    missing, wrong_method, bad_update = asyncio.run(go())
    for r, status, err_type in ((missing, 404, "NotFoundError"), (wrong_method, 405, "MethodNotAllowed")):
        assert r.status_code == status and r.json()["error"]["code"] == status, r.text
        assert r.json()["error"]["type"] == err_type
    assert bad_update.status_code == 400
    message = bad_update.json()["error"]["message"]
    assert "model_path: String should have at least 1 character" in message and "extra:" in message
    assert "errors.pydantic.dev" not in message


def test_requested_max_tokens_reads_what_the_engines_read():
    chat, completion = "/v1/chat/completions", "/v1/completions"
    assert requested_max_tokens(chat, {"max_tokens": 9, "max_completion_tokens": 5}) == 5
    assert requested_max_tokens(chat, {"max_tokens": 9}) == 9
    assert requested_max_tokens(completion, {"max_tokens": 9, "max_completion_tokens": 5}) == 9
    assert requested_max_tokens(completion, {}) is None
    with pytest.raises(ValueError, match="max_completion_tokens"):
        requested_max_tokens(chat, {"max_completion_tokens": 0, "max_tokens": 9})
    # echo with max_tokens 0 (scoring: the prompt alone) is placed as the one token the engines run
    assert requested_max_tokens(completion, {"max_tokens": 0, "echo": True}) == 1
    for refused in ({"max_tokens": 0}, {"max_tokens": 0, "echo": 1}, {"max_tokens": False, "echo": True}):
        with pytest.raises(ValueError, match="max_tokens"):
            requested_max_tokens(completion, refused)
    with pytest.raises(ValueError, match="max_tokens"):
        requested_max_tokens(chat, {"max_tokens": 0, "echo": True})
    with pytest.raises(ValueError, match="token ids"):
        prompt_shape({"prompt": [-1]})


def test_placement_reads_a_generate_body_under_a_completions_names():
    body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 7, "max_tokens": 9}, "rid": "r"}
    assert completion_view("/generate", body) == {"prompt": [4, 5]}
    assert completion_view("/generate", {"text": "abc", "input_ids": None}) == {"prompt": "abc"}
    assert completion_view("/v1/completions", body) is body
    assert requested_max_tokens("/generate", body) == 7
    assert requested_max_tokens("/generate", {"sampling_params": {"max_tokens": 3}}) == 3
    assert requested_max_tokens("/generate", {"sampling_params": [{"max_tokens": 3}]}) is None
    assert requested_max_tokens("/generate", {"max_tokens": 3}) is None  # (not where /generate reads it)
    # SGLang's scoring form (the prompt's logprobs alone): the engines run one token; refused by a
    # placement policy alone before (a review, 2026-12-04)
    assert requested_max_tokens("/generate", {"sampling_params": {"max_new_tokens": 0}}) == 1
    with pytest.raises(ValueError, match="max_new_tokens"):
        requested_max_tokens("/generate", {"sampling_params": {"max_new_tokens": -1}})
    with pytest.raises(ValueError, match="max_tokens"):
        requested_max_tokens("/generate", {"sampling_params": {"max_tokens": 0}})


def test_a_generate_request_is_placed_by_dualpath_and_a_bad_limit_is_a_400_first():
    """/generate under the DualPath policy: placed from its token ids and max_new_tokens, both legs
    sent to /generate with the placement's read path; a bad max_new_tokens never reaches an engine."""
    sent: list[tuple[str, dict]] = []

    async def go():
        engines = Engines(blocking=())

        async def recording(request: httpx.Request) -> httpx.Response:
            if request.method == "POST":
                sent.append((request.url.host + request.url.path, json.loads(await request.aread())))

        engines.intercept = recording
        router = await started_router(engines, "dualpath")
        async with client_of(router, raise_app_exceptions=False) as c:
            bad = await c.post(
                "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "4"}}
            )
            num_sent_after_bad = len(sent)
            await c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
        return bad, num_sent_after_bad, router

    bad, num_sent_after_bad, router = asyncio.run(go())
    assert bad.status_code == 400 and "max_new_tokens must be a positive integer" in bad.text
    assert num_sent_after_bad == 0 and router.placement.num_placed == 1
    assert sorted(where for where, _ in sent) == ["de/generate", "pe/generate"]
    for _, leg in sent:
        assert leg["input_ids"] == [1, 2, 3] and leg["pd"]["read_path"] in ("pe", "de", "none")


@pytest.mark.parametrize("policy", ["none", "dualpath"])
@pytest.mark.parametrize("waiting_for", ["prefill", "decode", "placement"])
def test_a_non_streamed_client_that_leaves_closes_both_legs(policy, waiting_for):
    """The router waits on a non-streamed client's behalf: for placement (DualPath), for the prefill's
    answer, and for the decode, whose headers come only when generation ends. A client that leaves
    in any of them gets every engine leg opened for it closed (the engines abort), the decode's
    in-flight count back to 0 and its placement withdrawn. Before, the router waited to the end."""
    if waiting_for == "placement" and policy == "none":
        pytest.skip("plain PD routing has no placement queue")

    async def go():
        engines = Engines(blocking={"prefill": ("pe", "de"), "decode": ("de",), "placement": ()}[waiting_for])
        router = await started_router(engines, policy)
        if waiting_for == "placement":  # the decode has no free page: the request waits in the FIFO
            router.placement.on_load(router.decodes[0], report("de", "decode", num_free_pages=0))
        app = build_router_app(router)
        sent = json.dumps({"prompt": [1, 2, 3], "max_tokens": 400}).encode()
        messages = [{"type": "http.request", "body": sent, "more_body": False}]
        gone = asyncio.Event()

        async def receive():
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        replies: list[dict] = []

        async def send(message):
            replies.append(message)

        scope = completion_scope(sent)
        call = asyncio.ensure_future(app(scope, receive, send))
        expected_posts = {"prefill": 2, "decode": 2, "placement": 0}[waiting_for]
        for _ in range(100):  # until the router waits where the test wants it
            if len(engines.posts) == expected_posts and (expected_posts or router.placement.queue):
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert len(engines.posts) == expected_posts
        gone.set()  # the client hangs up
        try:
            await asyncio.wait_for(call, 5)  # the router notices within CLIENT_POLL_S
        finally:
            engines.release.set()  # a router that did not notice must not hang the test
        return replies, router, engines

    replies, router, engines = asyncio.run(go())
    assert replies[0]["status"] == 499
    assert router.decodes[0].in_flight == 0
    assert sorted(engines.closed) == {"prefill": ["de", "pe"], "decode": ["de"], "placement": []}[waiting_for]
    if router.placement is not None:
        assert list(router.placement.queue) == [] and router.placement.num_placed == int(
            waiting_for != "placement"
        )


@pytest.mark.parametrize(
    ("body", "forwarded"),
    [
        ('{"prompt": [1, 2, 3], "max_tokens": 4}', {"prompt": [1, 2, 3], "max_tokens": 4}),
        ('{"prompt": "x", "max_tokens": 1e400}', '"max_tokens": Infinity'),  # json.loads parses it
    ],
    ids=["msgspec", "stdlib"],
)
def test_the_router_forwards_the_clients_json(body, forwarded):
    """Bodies are decoded and re-encoded with msgspec (a 32k-token prompt: ~0.9 ms where the standard
    library and httpx took ~8 ms on the router's loop). What msgspec refuses and json.loads takes
    (non-finite numbers) is parsed as before and forwarded as json.dumps writes it, for the engines to
    refuse (httpx's `json=` raised on it after the decode's in-flight count was taken: a 500)."""
    seen = []

    async def go():
        engines = Engines(blocking=())

        async def recording(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.path == "/v1/completions":
                seen.append((request.url.host, request.headers["content-type"], await request.aread()))

        engines.intercept = recording
        router = await started_router(engines, "none")
        # (the mock's decode answer cannot be relayed as a stream: what matters is what was sent)
        async with client_of(router, raise_app_exceptions=False) as c:
            await c.post("/v1/completions", content=body, headers={"content-type": "application/json"})

    asyncio.run(go())
    assert sorted(h for h, _, _ in seen) == ["de", "pe"] and {t for _, t, _ in seen} == {"application/json"}
    for _, _, content in seen:
        if isinstance(forwarded, dict):
            sent = json.loads(content)
            assert {k: sent[k] for k in forwarded} == forwarded and "pd" in sent
        else:
            assert forwarded in content.decode()


@pytest.mark.parametrize("decode_status", [400, 503])
def test_a_decode_that_answers_first_with_an_error_ends_the_wait_for_its_prefill(decode_status):
    """A body only the decode refuses (`stream_options` without `stream`: the prefill's copy is not
    streamed): the prefill waits for a KVRequest that never comes. The router used to wait for the
    prefill's answer, a 503 at its Bootstrapping deadline 30 s later per attempt; now the decode's 400
    is the answer at once and the prefill's leg is closed. A decode's 5xx is a failed attempt: with
    no other prefill to retry on, a 503 that says why."""

    async def go():
        engines = Engines(blocking=("pe",))

        async def decode_refuses(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.host == "de":
                engines.posts.append(("de", request.url.path))
                body = {"error": {"message": "decode says no", "code": decode_status}}
                return httpx.Response(
                    decode_status, headers={"content-type": "application/json"}, stream=Once(body)
                )

        engines.intercept = decode_refuses
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            body = {"prompt": [1, 2], "max_tokens": 4, "stream_options": {"include_usage": True}}
            r = await asyncio.wait_for(c.post("/v1/completions", json=body), 10)
        return r, router, engines

    r, router, engines = asyncio.run(go())
    assert r.status_code == {400: 400, 503: 503}[decode_status], r.text
    assert "decode says no" in r.json()["error"]["message"]
    assert engines.closed == ["pe"] and router.decodes[0].in_flight == 0
    assert router.num_retries == 0  # (one decode: a 503 is not retried, nowhere else to go)


@pytest.mark.parametrize(
    ("capacities", "asked"),
    [
        ({"de": 64, "de2": 4096, "de3": 64}, ["de", "de2"]),  # the small refuses: the big one serves
        ({"de": 64, "de2": 4096, "de3": 8192}, ["de", "de3"]),  # (the biggest: tried once, no ladder)
        ({"de": 64, "de2": 64, "de3": 64}, ["de"]),  # the same pools: its 400 is the answer
        ({}, ["de"]),  # (pools not reported)
    ],
)
def test_a_request_a_smaller_decode_refuses_is_tried_on_the_biggest(capacities, asked):
    """Plain routing over decodes of unequal KV pools (`kv_capacity_tokens` in /pd/info): the decode
    picked (fewest in flight) refused a request that outgrew its pool with a 400, which the router
    handed to the client as the request's fault though a bigger decode could serve it. A decode's 400
    is now tried once more on the biggest live decode, if bigger; that one's answer stands."""
    seen: list[str] = []

    async def go():
        engines = Engines(blocking=())
        engines.capacities = capacities
        served = asyncio.Event()

        async def by_capacity(request: httpx.Request) -> httpx.Response | None:
            host = request.url.host
            if request.method != "POST":
                return None
            if host == "pe":  # (a prefill answers once its decode took the KV)
                await served.wait()
                return httpx.Response(200, json={"choices": [{"text": "x"}]})
            seen.append(host)
            if capacities.get(host, 64) < 1000:
                body = {"error": {"message": f"{host}: needs more KV pages", "code": 400}}
                return httpx.Response(400, headers={"content-type": "application/json"}, stream=Once(body))
            served.set()
            answer = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = by_capacity
        router = await started_router(engines, "none", decodes=("http://de", "http://de2", "http://de3"))
        async with client_of(router) as c:
            r = await asyncio.wait_for(
                c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}), 10
            )
        return r, router

    r, router = asyncio.run(go())
    assert seen == asked, seen
    if len(asked) == 1:
        assert r.status_code == 400 and "de: needs more KV pages" in r.json()["error"]["message"]
    else:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
    assert all(d.in_flight == 0 for d in router.decodes)


@pytest.mark.parametrize("num_decodes", [1, 2])
def test_a_decode_that_died_since_its_last_health_check_is_left_for_another_at_once(num_decodes):
    """A decode killed a moment ago still counts as healthy; its leg fails to connect. The router used
    to wait for the prefill's answer (which waits for that decode's KVRequest) until its Bootstrapping
    deadline, 30 s, then blamed the prefill ("no healthy prefill engine") and retried the same decode.
    Now the attempt ends at once and goes to another decode with the same prefill; with none left, a
    503 that names the decode."""

    async def go():
        engines = Engines(blocking=("pe",))

        async def de_is_dead(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.host == "de":
                raise httpx.ConnectError("connection refused", request=request)
            if request.method == "POST" and request.url.host == "de2":
                engines.posts.append(("de2", request.url.path))
                engines.release.set()  # (the prefill answers once its decode asked for the KV)
                answer = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
                return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = de_is_dead
        decodes = ("http://de", "http://de2")[:num_decodes]
        router = await started_router(engines, "none", decodes=decodes)
        async with client_of(router) as c:
            r = await asyncio.wait_for(
                c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}), 10
            )
        return r, router, engines

    r, router, engines = asyncio.run(go())
    # (a retry counts only when another attempt went out: with one decode there was none)
    assert router.num_retries == num_decodes - 1 and all(d.in_flight == 0 for d in router.decodes)
    if num_decodes == 2:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok", r.text
        assert engines.closed == ["pe"]  # (the first attempt's prefill leg, closed at once)
        assert sorted(engines.posts) == [("de2", "/v1/completions")] + [("pe", "/v1/completions")] * 2
    else:
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "no healthy decode engine" in message and "decode http://de: ConnectError" in message
        # (the decode was in service, and failed this request: not "no healthy" alone, which named an
        # outage when engines were up, e.g. attempts that waited out their deadlines under overload)
        assert "left to try (each healthy one failed this request)" in message, message


def _scrape(text: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_router_serves_its_own_metrics_requests_retries_latency_and_engines():
    """`GET /metrics` on the router (it had none: an operator saw only the engines'): requests by
    route and code (401s and unknown paths too, the latter as "other"), retries by the side that
    failed, first-byte and whole-answer latency, requests in flight, each engine's health."""

    async def go():
        engines = Engines(blocking=("pe",))
        dead = {"de"}

        async def answer(request: httpx.Request) -> httpx.Response | None:
            if request.method == "POST" and request.url.host in dead:
                raise httpx.ConnectError("connection refused", request=request)
            if request.method == "POST" and request.url.host == "de2":
                engines.release.set()
                answer = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
                return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))
            return None

        engines.intercept = answer
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        router.api_key = "sk-test"
        async with client_of(router) as c:
            unauthorized = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
            assert unauthorized.status_code == 401
            c.headers["Authorization"] = "Bearer sk-test"
            ok = await asyncio.wait_for(
                c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}), 10
            )
            bad = await c.post("/v1/completions", content=b"{not json")
            await c.get("/no/such/path")
            text = (await c.get("/metrics")).text
        return ok, bad, _scrape(text)

    ok, bad, m = asyncio.run(go())
    assert ok.status_code == 200 and bad.status_code == 400
    completions = ("route", "/v1/completions")
    assert m[("pdserve_router_requests_total", (("code", "200"), completions))] == 1
    assert m[("pdserve_router_requests_total", (("code", "400"), completions))] == 1
    assert m[("pdserve_router_requests_total", (("code", "401"), completions))] == 1
    assert m[("pdserve_router_requests_total", (("code", "404"), ("route", "other")))] == 1
    assert m[("pdserve_router_retries_total", (("side", "decode"),))] == 1
    assert m[("pdserve_router_retries_total", (("side", "prefill"),))] == 0
    assert m[("pdserve_router_request_duration_seconds_count", (completions,))] == 3
    assert m[("pdserve_router_first_byte_seconds_count", (completions,))] == 3
    assert m[("pdserve_router_requests_in_flight", ())] == 0
    healthy = {labels: v for (name, labels), v in m.items() if name == "pdserve_router_engine_healthy"}
    assert healthy == {
        (("role", "prefill"), ("url", "http://pe")): 1.0,
        (("role", "decode"), ("url", "http://de")): 1.0,  # (until its health checks fail)
        (("role", "decode"), ("url", "http://de2")): 1.0,
    }


def test_the_routers_metrics_count_a_route_that_raised_as_500_and_its_refused_update_body_as_sglangs():
    """A route that raised was counted 499 ("the client left"): Starlette answers the 500 outside the
    metrics wrapper, so operators alerting on 5xx saw none. The router's own refusal of an update body
    lacked SGLang's `success: false` the engines give (a review of this session's changes)."""

    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, "none")

        async def broken(*args, **kwargs):
            raise RuntimeError("a bug in a route")

        router.dispatch = broken
        async with client_of(router, raise_app_exceptions=False) as c:
            failed = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            refused = await c.post(
                "/update_weights_from_disk", json={"model_path": "/x", "load_format": "pt"}
            )
            text = (await c.get("/metrics")).text
        return failed, refused, _scrape(text)

    failed, refused, m = asyncio.run(go())
    assert failed.status_code == 500
    assert m[("pdserve_router_requests_total", (("code", "500"), ("route", "/v1/completions")))] == 1
    assert not any(
        name == "pdserve_router_requests_total" and ("code", "499") in labels for name, labels in m
    )
    assert refused.status_code == 400 and refused.json()["success"] is False


def test_n_choices_one_child_refused_closes_the_others_decode_leg():
    """n = 2 where the prefill refuses child 1 (seed + 1) after child 0 got its decode stream: the
    client gets the refusal, and child 0's decode leg, opened but never read, is closed with its
    in-flight count dropped (an unstarted relay used to keep both)."""

    async def go():
        engines = Engines(blocking=())

        async def refuse_seed_1(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.host == "pe":
                sent = json.loads(await request.aread())
                if sent.get("seed") == 1:
                    await asyncio.sleep(0.2)  # child 0 is through by then
                    return httpx.Response(400, json={"error": {"message": "refused", "code": 400}})

        engines.intercept = refuse_seed_1
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "n": 2, "seed": 0})
        return r, router, engines

    r, router, engines = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["message"] == "refused"
    # (the refused prefill call is not recorded: the wrapper answers it)
    assert sorted(engines.posts) == [("de", "/v1/completions")] * 2 + [("pe", "/v1/completions")]
    assert router.decodes[0].in_flight == 0


def test_n_choices_stream_client_leaving_closes_every_decode_leg():
    """A streamed n = 2 request whose client leaves mid-stream: Starlette cancels the merged stream
    (and again at each await of its cleanup); both decode legs must still be closed to the end and
    their in-flight counts dropped. Each decode body's close suspends (as a real connection's does)."""
    closed: list[str] = []

    async def go():
        engines = Engines(blocking=())

        async def streaming_decode(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.host == "de":
                engines.posts.append(("de", request.url.path))
                seed = json.loads(await request.aread())["seed"]

                class Body(httpx.AsyncByteStream):
                    async def __aiter__(self):
                        for k in range(1000):
                            chunk = {"id": "c", "choices": [{"index": 0, "text": f"{seed}.{k} "}]}
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                            await asyncio.sleep(0.01)

                    async def aclose(self) -> None:
                        await asyncio.sleep(0.05)  # a close that takes a while, as a connection's
                        closed.append(f"de{seed}")

                return httpx.Response(200, stream=Body(), headers={"content-type": "text/event-stream"})

        engines.intercept = streaming_decode
        router = await started_router(engines, "none")
        app = build_router_app(router)
        sent = json.dumps({"prompt": [1, 2], "max_tokens": 1000, "n": 2, "seed": 0, "stream": True}).encode()
        messages = [{"type": "http.request", "body": sent, "more_body": False}]
        gone = asyncio.Event()
        chunks: list[bytes] = []

        async def receive():
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if len(chunks) >= 6:
                    gone.set()  # the client hangs up after a few chunks

        scope = completion_scope(sent)
        await asyncio.wait_for(app(scope, receive, send), 10)
        await asyncio.sleep(0.2)
        return router, chunks

    router, chunks = asyncio.run(go())
    assert len(chunks) >= 6
    assert router.decodes[0].in_flight == 0
    assert sorted(closed) == ["de0", "de1"]


def test_n_choices_go_to_one_prefill_that_computes_their_prompt_once():
    """Plain routing over two prefills: the three children of an n = 3 request all go to the same
    prefill (round robin would spread them, and each prefill would compute the shared prompt); the
    next request goes on round robin to the other."""

    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2"))
        async with client_of(router, raise_app_exceptions=False) as c:
            # (the mock's decode answers cannot be relayed: what matters is where the legs went)
            await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "n": 3})
            first = [h for h, _ in engines.posts if h.startswith("pe")]
            await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
        return first, [h for h, _ in engines.posts if h.startswith("pe")]

    first, all_prefill_posts = asyncio.run(go())
    assert len(first) == 3 and len(set(first)) == 1
    assert all_prefill_posts[3] != first[0]


def test_a_prompt_list_is_one_child_per_prompt_and_choice_each_prompts_on_one_prefill():
    """A prompt list [p0, p1] with n = 2 over two prefills: four children, each forwarding one prompt
    with seed + j (choice j); a prompt's two choices share a prefill, the prompts take turns. Mixed or
    too long lists are a 400 from the router, with nothing sent to an engine."""
    sent: list[tuple[str, dict]] = []

    async def go():
        engines = Engines(blocking=())

        async def recording(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.host.startswith("pe"):
                sent.append((request.url.host, json.loads(await request.aread())))

        engines.intercept = recording
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2"))
        async with client_of(router, raise_app_exceptions=False) as c:
            # (the mock's decode answers cannot be relayed: what matters is what the legs carried)
            body = {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 4, "n": 2, "seed": 7}
            await c.post("/v1/completions", json=body)
            num_sent = len(sent)
            bad = [
                await c.post("/v1/completions", json={"prompt": ["a", [1]], "max_tokens": 4}),
                await c.post("/v1/completions", json={"prompt": ["a"] * 1025}),
                await c.post("/v1/completions", json={"prompt": ["a"] * 20, "n": 60}),
                await c.post("/v1/completions", json={"prompt": [1], "n": 2, "request_id": "x" * 252}),
            ]
        return num_sent, bad

    num_sent, bad = asyncio.run(go())
    assert num_sent == 4 and len(sent) == 4
    legs = sorted((b["prompt"], b["seed"], b["n"], host) for host, b in sent)
    assert [leg[:3] for leg in legs] == [([1, 2], 7, 1), ([1, 2], 8, 1), ([3, 4, 5], 7, 1), ([3, 4, 5], 8, 1)]
    assert legs[0][3] == legs[1][3] and legs[2][3] == legs[3][3] and legs[0][3] != legs[2][3]
    ids = sorted(b["request_id"] for _, b in sent)  # one base, child i = prompt p's choice j: p*2 + j
    base = ids[0][:-2]
    assert ids == [f"{base}_{i}" for i in range(4)]
    assert {(tuple(b["prompt"]), b["seed"]): b["request_id"][-1] for _, b in sent} == {
        ((1, 2), 7): "0", ((1, 2), 8): "1", ((3, 4, 5), 7): "2", ((3, 4, 5), 8): "3"
    }  # fmt: skip
    messages = [r.json()["error"]["message"] for r in bad]
    assert [r.status_code for r in bad] == [400] * 4 and "request_id" in messages[3]
    assert "every prompt of a list must be a string" in messages[0]
    assert (
        "1025 prompts: more than 1024" in messages[1] and "20 prompts x n=60: more than 1024" in messages[2]
    )


class Once(httpx.AsyncByteStream):
    """A body the router can relay (a mock's `json=` body is already read)."""

    def __init__(self, obj: dict) -> None:
        self.data = json.dumps(obj).encode()

    async def __aiter__(self):
        yield self.data


def decode_answer(finish: str = "length", output_ids: tuple | list = (1,), text: str = "x") -> httpx.Response:
    """A decode's whole /generate answer (SGLang's shape), as a body the router can relay."""
    answer = {"output_ids": list(output_ids), "text": text, "meta_info": {"finish_reason": {"type": finish}}}
    return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))


def prefill_answer() -> httpx.Response:
    """A prefill's answer to its half of a /generate (token 1; the decode answers the client)."""
    return httpx.Response(200, json={"output_ids": [1], "text": "x", "meta_info": {}})


async def generate_or_abort(request: httpx.Request) -> tuple[str, str, int | None] | None:
    """(host, path, room) of a POST /generate (its half's room) or /abort_request (the room it ends,
    if any); None for anything else (the mock answers it)."""
    if request.method != "POST" or request.url.path not in ("/generate", "/abort_request"):
        return None
    sent = json.loads(await request.aread())
    return request.url.host, request.url.path, sent["pd"]["room"] if "pd" in sent else sent.get("room")


def answering_as_marked(legs: list[tuple[str, dict]]):
    """A mock engine's /generate and /abort_request (an `Engines.intercept`): each /generate half's
    (host, pd) appended to `legs`; the decode answers "abort" for a half sent marked aborted (as the
    engines do), else "length"; the prefill its token 1; an abort says it worked."""

    async def answer(request: httpx.Request) -> httpx.Response | None:
        if request.url.path == "/abort_request":
            return httpx.Response(200, json={"success": True, "num_requests_aborted": 0})
        if request.url.path != "/generate":
            return None
        pd = json.loads(await request.aread())["pd"]
        legs.append((request.url.host, pd))
        if request.url.host == "de":
            return decode_answer("abort" if pd.get("aborted") else "length")
        return prefill_answer()

    return answer


def test_a_prompt_lists_answers_merge_in_order_counting_each_prompt_once():
    """The decodes' answers to [p0, p1] with n = 2, merged by the router: choice p*2 + j is prompt p's
    answer; usage adds each prompt's tokens once (and its cached tokens), every completion's tokens."""

    async def go():
        engines = Engines(blocking=())

        async def decode_answers(request: httpx.Request) -> httpx.Response:
            if request.url.host == "de" and request.url.path == "/v1/completions":
                sent = json.loads(await request.aread())
                n = len(sent["prompt"])
                usage = {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2}
                answer = {
                    "id": f"cmpl-{sent['pd']['room']}",
                    "choices": [
                        {"index": 0, "text": f"{sent['prompt']}/{sent['seed']}", "finish_reason": "length"}
                    ],
                    "usage": usage | {"prompt_tokens_details": {"cached_tokens": n - 1}},
                }
                return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = decode_answers
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            body = {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2, "n": 2, "seed": 0}
            return await c.post("/v1/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    data = r.json()
    assert [(c["index"], c["text"]) for c in data["choices"]] == [
        (0, "[1, 2]/0"), (1, "[1, 2]/1"), (2, "[3, 4, 5]/0"), (3, "[3, 4, 5]/1")
    ]  # fmt: skip
    assert data["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 8,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_under_dualpath_placement_the_choices_of_one_prompt_share_its_prefill(path):
    """DualPath placement, two prefills and two decodes, [p0, p1] with n = 3: each prompt's first
    choice is placed, the other two follow it to its prefill and read path (which computes their shared
    prompt once) and each takes a decode of its own. Placed one by one they went to both prefills
    (each computing the whole prompt), and the router's prefix index took the first's prompt as the
    others' stored hits."""
    legs: list[tuple[str, list, str]] = []

    async def go():
        engines = Engines(blocking=())

        async def answers(request: httpx.Request) -> httpx.Response | None:
            host = request.url.host
            if request.method != "POST" or request.url.path != path:
                return None
            sent = json.loads(await request.aread())
            prompt = sent["prompt"] if path == "/v1/completions" else sent["input_ids"]
            legs.append((host, prompt, sent["pd"]["read_path"]))
            if host.startswith("pe"):
                return httpx.Response(200, json={"choices": [{"text": "x"}]})
            if path == "/generate":
                answer = {"text": "y", "meta_info": {"id": sent["rid"], "finish_reason": {"type": "length"}}}
            else:
                answer = {"choices": [{"index": 0, "text": "y", "finish_reason": "length"}]}
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = answers
        router = await started_router(
            engines, "dualpath", prefills=("http://pe", "http://pe2"), decodes=("http://de", "http://de2")
        )
        index = router.placement.index
        async with client_of(router) as c:
            if path == "/generate":
                body = {"input_ids": [[1, 2, 3, 4, 5], [6, 7, 8]], "sampling_params": {"n": 3}}
            else:
                body = {"prompt": [[1, 2, 3, 4, 5], [6, 7, 8]], "max_tokens": 2, "n": 3}
            r = await c.post(path, json=body)
        return r, router, index

    r, router, index = asyncio.run(go())
    assert r.status_code == 200, r.text
    assert router.placement.num_placed == 2  # (one per prompt)
    for prompt in ([1, 2, 3, 4, 5], [6, 7, 8]):
        prefills = {(host, read_path) for host, p, read_path in legs if p == prompt and host.startswith("pe")}
        decodes = sorted(host for host, p, _ in legs if p == prompt and host.startswith("de"))
        assert len(prefills) == 1, legs  # (all three on one prefill, with one read path)
        assert decodes in (["de", "de", "de2"], ["de", "de2", "de2"]), legs  # (spread)
    assert all(d.in_flight == 0 for d in router.decodes)


def test_a_prompt_the_engines_refuse_is_no_hit_for_the_next_one_and_a_taken_one_is():
    """The router's hit estimates count a prompt once an engine has taken it. It recorded every
    prompt at placement, so one the engines refused (a 400: nothing computed, nothing stored) made
    the next request with that prefix read 128 "hit" tokens that no store held."""
    prompt = list(range(1, 150))  # two whole 64-token blocks and a tail

    async def go():
        engines = Engines(blocking=())

        async def answers(request: httpx.Request) -> httpx.Response | None:
            if request.method != "POST" or request.url.path != "/v1/completions":
                return None
            sent = json.loads(await request.aread())
            if sent.get("temperature") == -1:  # (what the engines refuse; the router does not look)
                return httpx.Response(400, json={"error": {"message": "temperature must be >= 0"}})
            if request.url.host.startswith("pe"):
                return httpx.Response(200, json={"choices": [{"text": "x"}]})
            answer = {"choices": [{"index": 0, "text": "y", "finish_reason": "length"}]}
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = answers
        router = await started_router(engines, "dualpath")
        index = router.placement.index
        got = []
        async with client_of(router) as c:
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": -1})
            got.append((r.status_code, index.hit_tokens(prompt + [7])))
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            got.append((r.status_code, index.hit_tokens(prompt + [7])))
        return got, router

    got, router = asyncio.run(go())
    assert got == [(400, 0), (200, 128)]
    assert router.placement.num_placed == 2 and all(d.in_flight == 0 for d in router.decodes)


def test_abort_and_cache_resets_go_to_every_engine_with_the_clients_body():
    """/abort_request, /flush_cache and /reset_prefix_cache reach every live engine with the body as
    sent (an abort of a rid with the router's id and count of named aborts added); the answer maps each
    engine's reply; a dead engine is skipped, an unreachable one is a 502."""
    sent: list[tuple[str, str, bytes]] = []

    async def go():
        engines = Engines(blocking=())

        async def recording(request: httpx.Request) -> httpx.Response:
            if request.url.path in ("/abort_request", "/flush_cache", "/reset_prefix_cache"):
                sent.append((request.url.host, request.url.path, await request.aread()))
                if request.url.host == "pe2":
                    raise httpx.ConnectError("refused")
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 1})

        engines.intercept = recording
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2"))
        async with client_of(router, raise_app_exceptions=False) as c:
            router.prefills[1].healthy = False
            abort = await c.post("/abort_request", json={"rid": "cmpl-1"})
            flush = await c.get("/flush_cache")
            router.prefills[1].healthy = True
            reset = await c.post("/reset_prefix_cache")
        return abort, flush, reset, router.router_id

    abort, flush, reset, router_id = asyncio.run(go())
    assert abort.status_code == 200 and abort.json() == {
        "success": True,
        "engines": {u: {"success": True, "num_requests_aborted": 1} for u in ("http://pe", "http://de")},
        "unhealthy": ["http://pe2"],  # (out of service: not asked)
    }
    assert sorted((h, p) for h, p, _ in sent[:2]) == [("de", "/abort_request"), ("pe", "/abort_request")]
    named = {"rid": "cmpl-1", "router_id": router_id, "router_named": 1}
    assert [json.loads(b) for _, _, b in sent[:2]] == [named, named]
    assert flush.status_code == 200 and sorted(h for h, p, _ in sent if p == "/flush_cache") == ["de", "pe"]
    assert reset.status_code == 502 and not reset.json()["success"]
    assert "unreachable" in reset.json()["engines"]["http://pe2"]["error"]


def test_an_abort_does_not_wait_for_or_fail_on_an_engine_out_of_reach():
    """An RL rollout manager's /abort_request while one engine is paused or just died: the router
    waited 30 s for it, then answered 502 "success": false though the abort worked everywhere else (a
    review). It waits ABORT_TIMEOUT_S at most, lists that engine as unreachable and says success; an
    abort no engine could take is still a 502, and a cache reset still fails on it."""
    from pdserve.router import control

    async def go():
        engines = Engines(blocking=())
        reachable = {"pe", "de"}

        async def answering(request: httpx.Request) -> httpx.Response:
            if request.url.path in ("/abort_request", "/reset_prefix_cache"):
                if request.url.host not in reachable:
                    raise httpx.ReadTimeout("paused")  # (as after ABORT_TIMEOUT_S)
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 1})

        engines.intercept = answering
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2"))
        async with client_of(router) as c:
            abort = await c.post("/abort_request", json={"rid": "r"})
            reset = await c.post("/reset_prefix_cache")
            reachable.clear()
            none = await c.post("/abort_request", json={"abort_all": True})
        return abort, reset, none

    assert control.ABORT_TIMEOUT_S <= 5.0 < control.CONTROL_TIMEOUT_S
    abort, reset, none = asyncio.run(go())
    assert abort.status_code == 200 and abort.json()["success"] is True, abort.text
    assert abort.json()["unreachable"] == ["http://pe2"]
    assert reset.status_code == 502 and "unreachable" not in reset.json()
    assert none.status_code == 502 and none.json()["success"] is False


def test_abort_all_ends_the_requests_waiting_in_placement_through_their_engines():
    """DualPath: a request waits in placement (no decode has a free page) when an /abort_request of
    everything comes. It stops waiting and goes to the engines marked `pd.aborted` (both answer
    "abort" with nothing computed, in the client's format); a request that comes after the abort is
    placed and sent as usual. Before, a waiting request ran once pages freed, as if never aborted.
    Every half carries the router's id and its abort count when the request came in, and the abort
    its new count (for halves sent before it that reach an engine after it)."""
    legs: list[tuple[str, dict]] = []
    aborts: list[tuple[str, dict]] = []

    async def go():
        engines = Engines(blocking=())

        async def recording(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/abort_request":
                aborts.append((request.url.host, json.loads(await request.aread())))
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 0})
            if request.url.path == "/v1/completions":
                pd = json.loads(await request.aread())["pd"]
                legs.append((request.url.host, pd))
                if request.url.host == "de":  # (as an engine answers: server/api.py, async_engine.py)
                    finish = "abort" if pd.get("aborted") else "length"
                    answer = {"choices": [{"index": 0, "text": "", "finish_reason": finish}]}
                    return httpx.Response(
                        200, headers={"content-type": "application/json"}, stream=Once(answer)
                    )

        engines.intercept = recording
        router = await started_router(engines, "dualpath")
        router.placement.on_load(router.decodes[0], report("de", "decode", num_free_pages=0))
        async with client_of(router) as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 4}
            waiting = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await queued(router)
            assert len(router.placement.queue) == 1 and legs == []
            for refused in ({"abort_all": True, "rid": None}, {"abort_all": "yes"}):  # (engines: 400)
                await c.post("/abort_request", json=refused)
            assert len(router.placement.queue) == 1 and router.abort_epoch == 0  # (aborted nothing)
            aborted = await c.post("/abort_request", json={"abort_all": True})
            answer = await asyncio.wait_for(waiting, 5)
            router.placement.on_load(router.decodes[0], report("de", "decode"))
            later = await c.post("/v1/completions", json=body)
        return aborted, answer, later, router

    aborted, answer, later, router = asyncio.run(go())
    assert aborted.status_code == 200 and answer.status_code == 200 and later.status_code == 200
    assert answer.json()["choices"][0]["finish_reason"] == "abort"
    assert later.json()["choices"][0]["finish_reason"] == "length"
    assert [(host, pd.get("aborted")) for host, pd in legs] == [
        ("de", True), ("pe", True), ("de", None), ("pe", None)
    ]  # fmt: skip
    assert [(pd["router_id"], pd["router_epoch"]) for _, pd in legs] == [(router.router_id, 0)] * 2 + [
        (router.router_id, 1)
    ] * 2
    assert len(router.router_id) == 32 and router.abort_epoch == 1
    everything = {"abort_all": True, "router_id": router.router_id, "router_epoch": 1}
    assert sorted(aborts[-2:], key=lambda a: a[0]) == [("de", everything), ("pe", everything)]
    assert all("router_id" not in body for _, body in aborts[:-2])  # (the refused ones: as sent)
    assert router.placement.num_placed == 1 and not router.placement.queue  # (only the later one)
    assert router.decodes[0].in_flight == 0


def test_a_weight_update_waits_for_the_requests_in_flight_and_holds_new_ones_until_it_is_done():
    """Request 1 is in flight when /update_weights_from_disk comes: the engines are asked only once
    it has ended; request 2, sent meanwhile, is held and sent only after every engine loaded the new
    weights (so no request runs across engines of different weights). An engine that answers 409
    (still finishing a room) is asked again."""
    calls: list[tuple[str, str]] = []

    async def go():
        engines = Engines(blocking=())
        busy_once = {"pe"}

        async def recording(request: httpx.Request) -> httpx.Response:
            host, path = request.url.host, request.url.path
            if path == "/update_weights_from_disk":
                calls.append((host, path))
                if host in busy_once:
                    busy_once.discard(host)
                    return httpx.Response(409, json={"error": {"message": "busy"}})
                engines.model_paths[host] = json.loads(await request.aread())["model_path"]
                return httpx.Response(200, json={"success": True, "num_weight_updates": 1})
            if path == "/v1/completions":
                calls.append((host, path))
                if host == "de":  # (its answer comes when the test releases it, relayable)
                    await engines.release.wait()
                    answer = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
                    return httpx.Response(
                        200, headers={"content-type": "application/json"}, stream=Once(answer)
                    )

        engines.intercept = recording
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 4}
            first = asyncio.ensure_future(c.post("/v1/completions", json=body))
            while len(calls) < 2:
                await asyncio.sleep(0.01)
            updating = asyncio.ensure_future(
                c.post("/update_weights_from_disk", json={"model_path": "/ckpt/b"})
            )
            while router.open.is_set():  # (until the update holds new requests)
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.1)
            held = list(calls)  # (the update waits for request 1; request 2 waits for the update)
            engines.release.set()
            answers = await asyncio.gather(first, updating, second)
        return held, answers, router

    held, (first, updating, second), router = asyncio.run(go())
    assert sorted(held) == [("de", "/v1/completions"), ("pe", "/v1/completions")]
    assert first.status_code == 200 and second.status_code == 200
    assert updating.status_code == 200 and updating.json()["success"], updating.text
    assert updating.json()["engines"] == {
        u: {"success": True, "num_weight_updates": 1} for u in ("http://pe", "http://de")
    }
    after = calls[2:]
    updates = [c for c in after if c[1] == "/update_weights_from_disk"]
    assert sorted(updates) == [("de", "/update_weights_from_disk"), ("pe", "/update_weights_from_disk"), ("pe", "/update_weights_from_disk")]  # fmt: skip
    assert after.index(("pe", "/v1/completions")) > max(i for i, c in enumerate(after) if c in updates)
    assert router.num_in_flight() == 0 and router.open.is_set()


@pytest.mark.parametrize("abort", ["client_abort_all", "update_abort_running"])
def test_a_clients_abort_all_ends_the_requests_a_weight_update_holds_its_own_abort_running_does_not(abort):
    """Request 1 runs; a weight update holds request 2. A client's /abort_request of everything,
    sent while request 2 is held, ends it too (its halves go with `pd.aborted` once the update lets
    it go: the engines answer "abort" with nothing computed). Before, it was sent as new when the
    update ended and ran under the new weights. The update's own `abort_running` ends request 1
    only: request 2 goes on under the new weights (SGLang's: the held requests are not running)."""
    legs: list[dict] = []

    async def go():
        engines = Engines(blocking=())
        release, loaded = asyncio.Event(), asyncio.Event()

        async def answering(request: httpx.Request) -> httpx.Response:
            host, path = request.url.host, request.url.path
            if path == "/update_weights_from_disk":
                await loaded.wait()
                engines.model_paths[host] = json.loads(await request.aread())["model_path"]
                return httpx.Response(200, json={"success": True})
            if path == "/abort_request":
                release.set()  # (request 1 ends: aborted)
                return httpx.Response(200, json={"success": True})
            if path == "/v1/completions":
                pd = json.loads(await request.aread())["pd"]
                legs.append(pd | {"host": host})
                if host == "de":
                    await release.wait()
                    finish = "abort" if pd.get("aborted") else "length"
                    answer = {"choices": [{"index": 0, "text": "", "finish_reason": finish}]}
                    return httpx.Response(
                        200, headers={"content-type": "application/json"}, stream=Once(answer)
                    )

        engines.intercept = answering
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            body = {"prompt": [1, 2, 3], "max_tokens": 4}
            first = asyncio.ensure_future(c.post("/v1/completions", json=body))
            while len(legs) < 2:
                await asyncio.sleep(0.01)
            update = {"model_path": "/ckpt/b", "abort_running": abort == "update_abort_running"}
            updating = asyncio.ensure_future(c.post("/update_weights_from_disk", json=update))
            while router.open.is_set():
                await asyncio.sleep(0.01)
            second = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await asyncio.sleep(0.05)
            assert len(legs) == 2  # (held)
            if abort == "client_abort_all":
                assert (await c.post("/abort_request", json={"abort_all": True})).status_code == 200
            loaded.set()
            answers = await asyncio.wait_for(asyncio.gather(first, updating, second), 10)
        return [a.json() for a in answers], router

    (first, updating, second), router = asyncio.run(go())
    assert updating["success"], updating
    assert [leg["router_epoch"] for leg in legs[2:]] == ([0, 0] if abort == "client_abort_all" else [1, 1])
    assert router.abort_epoch == 1 and router.num_in_flight() == 0
    expected = "abort" if abort == "client_abort_all" else "length"
    assert second["choices"][0]["finish_reason"] == expected
    assert all(leg.get("aborted") for leg in legs[2:]) == (abort == "client_abort_all")


def test_a_weight_update_that_misses_an_engine_out_of_service_fails_and_it_serves_nothing_until_updated():
    """An engine out of service is not asked (it may not answer), so it keeps the old weights when it
    comes back: the update is a 502 that names it, and once back the engine is out of service
    (stale) until the next update, which includes it."""

    async def go():
        engines = Engines(blocking=())

        async def answering(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/update_weights_from_disk":
                engines.model_paths[request.url.host] = json.loads(await request.aread())["model_path"]
                return httpx.Response(200, json={"success": True})

        engines.intercept = answering
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2"))
        router.prefills[1].healthy = False
        async with client_of(router) as c:
            missed = await c.post("/update_weights_from_disk", json={"model_path": "/ckpt/b"})
            stale = (router.prefills[1].healthy, router.prefills[1].stale)  # (back, with the old weights)
            picks = {router.pick_prefill(set()).url for _ in range(4)}
            again = await c.post("/update_weights_from_disk", json={"model_path": "/ckpt/b"})
            return missed, stale, picks, again, router.prefills[1].healthy

    missed, stale, picks, again, healthy_after = asyncio.run(go())
    assert missed.status_code == 502 and not missed.json()["success"]
    assert missed.json()["unhealthy"] == ["http://pe2"] and sorted(missed.json()["engines"]) == [
        "http://de",
        "http://pe",
    ]
    assert stale == (False, True) and picks == {"http://pe"}  # (no request goes to the old weights)
    assert again.status_code == 200 and sorted(again.json()["engines"]) == [
        "http://de",
        "http://pe",
        "http://pe2",
    ]
    assert healthy_after


def test_an_engine_that_missed_an_update_to_the_same_directory_is_told_by_its_weights_identity():
    """A trainer that writes every step over one directory sends the same model_path each time: an
    engine out of service during the update came back with the same path, so it was taken back into
    service with the previous step's weights (a review of weight updates). Engines report the identity
    of the weights they serve (`weights_id`: model, vocabulary, checkpoint digest); the router keeps
    the one the update's engines reported and takes out an engine reporting another."""

    async def go():
        engines = Engines(blocking=())
        engines.weights_ids = {"pe": "w0", "pe2": "w0", "de": "w0"}
        step = {"id": "w0"}

        async def answering(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/update_weights_from_disk":
                engines.weights_ids[request.url.host] = step["id"]
                return httpx.Response(200, json={"success": True, "weights_id": step["id"]})

        engines.intercept = answering
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2"))
        router.prefills[1].healthy = False  # (out of service during the update: not asked)
        async with client_of(router) as c:
            step["id"] = "w1"  # the trainer rewrote /ckpt/a
            missed = await c.post("/update_weights_from_disk", json={"model_path": "/ckpt/a"})
            await router.check_health()
            stale = (router.prefills[1].healthy, router.prefills[1].stale)
            picks = {router.pick_prefill(set()).url for _ in range(4)}
            step["id"] = "w2"
            again = await c.post("/update_weights_from_disk", json={"model_path": "/ckpt/a"})
            return missed, stale, picks, again, router.prefills[1].healthy, router.weights_id

    missed, stale, picks, again, healthy_after, weights_id = asyncio.run(go())
    assert missed.status_code == 502 and missed.json()["unhealthy"] == ["http://pe2"]
    assert stale == (False, True) and picks == {"http://pe"}  # (same path, other weights: out)
    assert again.status_code == 200 and len(again.json()["engines"]) == 3
    assert healthy_after and weights_id == "w2"


def test_an_engine_whose_weights_were_lost_or_thread_died_is_out_of_service():
    """The router judged engines by `/pd/info` answering, which an engine with lost weights or a dead
    engine thread still does: both stayed in service and the router's /health said "ok" while every
    request was a 503 (a review of weight updates). `/pd/info` now carries the engine's status: the
    weights-lost one is out of service and stale (the next update includes it: it is what brings it
    back), the dead one out of service, and the router's /health says "degraded"."""

    async def go():
        engines = Engines(blocking=())

        async def answering(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/update_weights_from_disk":
                engines.statuses.pop(request.url.host, None)
                return httpx.Response(200, json={"success": True})

        engines.intercept = answering
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2"))
        engines.statuses = {"pe": "weights lost", "de": "dead"}
        await router.check_health()
        await router.check_health()  # (two misses: out of service)
        states = [(e.healthy, e.stale) for e in router.prefills + router.decodes]
        async with client_of(router) as c:
            health = await c.get("/health")
            update = await c.post("/update_weights_from_disk", json={"model_path": "/ckpt/a"})
        return states, health, update

    states, health, update = asyncio.run(go())
    assert states == [(False, True), (True, False), (False, False)]
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    assert sorted(update.json()["engines"]) == ["http://pe", "http://pe2"]  # (the dead one: not asked)


def test_an_engine_whose_port_is_refused_is_out_of_service_without_cutting_what_it_runs():
    """An engine in its graceful shutdown (Ctrl-C) closes its port first and ends its own requests
    ("abort"); the router cut them at two refused health checks, with a 503 the client retries (a
    review of this session's changes). Refused: out of service, `down` not set. One that accepts but
    does not answer (paused): `down`, which cuts its requests as before."""

    async def go():
        engines = Engines(blocking=())
        failing = {}

        async def health(request: httpx.Request) -> httpx.Response | None:
            if request.url.path == "/pd/info" and request.url.host in failing:
                raise failing[request.url.host]("no answer", request=request)
            return None

        engines.intercept = health
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        failing["de"] = httpx.ConnectError
        for _ in range(3):
            await router.check_health()
        refused = (router.decodes[0].healthy, router.decodes[0].down.is_set())
        failing["de2"] = httpx.ReadTimeout
        for _ in range(2):
            await router.check_health()
        paused = (router.decodes[1].healthy, router.decodes[1].down.is_set())
        return refused, paused

    refused, paused = asyncio.run(go())
    assert refused == (False, False) and paused == (False, True)


def test_tokenize_goes_to_a_live_decode_as_is_and_an_unreachable_one_is_a_503():
    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, "none")
        async with client_of(router, raise_app_exceptions=False) as c:
            ok = await c.post("/tokenize", json={"prompt": "hi"})
            posts = list(engines.posts)

            def refuse(request: httpx.Request) -> httpx.Response:
                raise httpx.ConnectError("connection refused", request=request)

            router.client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
            down = await c.post("/detokenize", json={"tokens": [1]})
        return ok, posts, down

    ok, posts, down = asyncio.run(go())
    assert ok.status_code == 200 and posts == [("de", "/tokenize")]
    assert down.status_code == 503 and "unreachable" in down.json()["error"]["message"]


class Breaks(httpx.AsyncByteStream):
    """A decode error body whose connection drops half way (the decode died while answering)."""

    async def __aiter__(self):
        yield b'{"error": {"message": "decode ov'
        raise httpx.ReadError("connection reset by peer")


def test_n_choices_one_child_refused_at_once_answers_without_waiting_for_the_others():
    """A router child refused by its engine cancels the others (found by review: the refusal, a
    Response, not an exception, was held until every sibling had generated its whole answer). n = 2:
    the prefill refuses child 1 at once while child 0 is still computing: the 400 comes at once, and
    child 0's legs are closed (its engines abort it)."""

    async def go():
        engines = Engines(blocking=())

        async def engine(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.path == "/v1/completions":
                sent = json.loads(await request.aread())
                if request.url.host == "pe" and sent.get("seed") == 1:
                    return httpx.Response(400, json={"error": {"message": "refused", "code": 400}})
                engines.posts.append((request.url.host, sent["seed"]))
                try:
                    await engines.release.wait()  # child 0: a long generation
                except asyncio.CancelledError:
                    engines.closed.append(f"{request.url.host}{sent['seed']}")
                    raise
                return httpx.Response(
                    200,
                    headers={"content-type": "application/json"},
                    stream=Once({"choices": [{"index": 0, "text": "x"}]}),
                )

        engines.intercept = engine
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            body = {"prompt": [1, 2], "max_tokens": 4000, "n": 2, "seed": 0}
            try:
                r = await asyncio.wait_for(c.post("/v1/completions", json=body), 3)
            except TimeoutError:
                r = None
            finally:
                engines.release.set()
        return r, router, engines

    r, router, engines = asyncio.run(go())
    assert r is not None, "the router held the 400 until the sibling child finished generating"
    assert r.status_code == 400 and r.json()["error"]["message"] == "refused"
    assert sorted(engines.closed) == ["de0", "de1", "pe0"] and router.decodes[0].in_flight == 0


@pytest.mark.parametrize("sibling_waits_for", ["prefill", "decode"])
def test_a_cancelled_child_closes_its_decode_leg_and_drops_its_in_flight_count(sibling_waits_for):
    """n = 2, not streamed: child 1's decode fails first (a 503 whose body breaks), and merged()
    cancels child 0 while it waits for its prefill (or for its non-streamed decode's headers). A
    cancelled dispatch left child 0's decode leg open (the engine never aborted it) and its in-flight
    count at 1 for good, so every later weight update waited 600 s to drain (found by review)."""

    async def go():
        engines = Engines(blocking=())

        async def engine(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.path == "/v1/completions":
                sent = json.loads(await request.aread())
                host, seed = request.url.host, sent.get("seed")
                engines.posts.append((host, seed))
                if seed == 1:
                    if host == "de":
                        await asyncio.sleep(0.3)  # after child 0 is where the test wants it
                        return httpx.Response(
                            503, headers={"content-type": "application/json"}, stream=Breaks()
                        )
                    await asyncio.sleep(30)  # child 1's prefill waits for a KVRequest that never comes
                if host == "pe" and sibling_waits_for == "decode":  # child 0's prefill answers token 1
                    return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
                try:
                    await asyncio.sleep(3600)  # child 0's prefill or non-streamed decode: still working
                except asyncio.CancelledError:
                    engines.closed.append(f"{host}{seed}")
                    raise

        engines.intercept = engine
        router = await started_router(engines, "none")
        async with client_of(router, raise_app_exceptions=False) as c:
            body = {"prompt": [1, 2], "max_tokens": 4, "n": 2, "seed": 0}
            r = await asyncio.wait_for(c.post("/v1/completions", json=body), 10)
        await asyncio.sleep(0.5)
        return r, router, list(engines.closed)  # (before asyncio.run cancels what is left)

    r, router, closed = asyncio.run(go())
    assert r.status_code in (502, 503) and r.json()["error"]["code"] == r.status_code, r.text
    assert router.decodes[0].in_flight == 0 and router.num_in_flight() == 0
    assert "de0" in closed, "child 0's decode leg was never closed (the engine never aborts it)"


def test_a_decode_error_body_that_breaks_is_an_openai_error_not_a_plain_500():
    """The decode answers 503 first and its connection drops while the router reads that body: the
    read raised out of the dispatch, a plain-text 500 (found by review). Now a failed attempt: with
    no other decode, a 503 in OpenAI's shape that says why."""

    async def go():
        engines = Engines(blocking=())

        async def engine(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.path == "/v1/completions":
                if request.url.host == "de":
                    return httpx.Response(503, headers={"content-type": "application/json"}, stream=Breaks())
                await asyncio.sleep(30)

        engines.intercept = engine
        router = await started_router(engines, "none")
        async with client_of(router, raise_app_exceptions=False) as c:
            r = await asyncio.wait_for(
                c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}), 10
            )
        return r, router

    r, router = asyncio.run(go())
    assert r.headers.get("content-type", "").startswith("application/json"), r.text
    assert r.status_code == 503 and "its answer broke" in r.json()["error"]["message"]
    assert router.decodes[0].in_flight == 0


def test_a_decode_declared_down_while_its_prefill_worked_has_its_leg_closed():
    """The decode is declared down (missed health checks) while the router waits for the prefill,
    which then answers token 1: the client gets a 503, and the decode's leg is closed (found by
    review: it stayed open, so a decode that was only frozen generated the answer for nobody)."""

    async def go():
        engines = Engines(blocking=())
        prefill_may_answer = asyncio.Event()

        async def engine(request: httpx.Request) -> httpx.Response:
            if request.method == "POST" and request.url.path == "/v1/completions":
                engines.posts.append((request.url.host, request.url.path))
                if request.url.host == "pe":
                    await prefill_may_answer.wait()
                    return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
                try:
                    await asyncio.sleep(3600)  # a decode frozen for a while (e.g. a long GC / swap)
                except asyncio.CancelledError:
                    engines.closed.append("de")
                    raise

        engines.intercept = engine
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}))
            while len(engines.posts) < 2:
                await asyncio.sleep(0.01)
            de = router.decodes[0]
            de.healthy = False  # (what check_health does after two misses)
            de.down.set()
            prefill_may_answer.set()
            r = await asyncio.wait_for(call, 5)
        await asyncio.sleep(0.3)
        return r, router, list(engines.closed)

    r, router, closed = asyncio.run(go())
    assert r.status_code == 503 and router.decodes[0].in_flight == 0
    assert closed == ["de"], "the decode's leg was never closed: the engine never aborts the request"


def test_the_router_drops_idle_engine_connections_before_an_engine_closes_them():
    """An idle connection reused the instant an engine's server closed it was a ReadError, which the
    router read as a dead decode (a 503 in a CI run after a 120-child burst left many idle
    connections; httpx's default idle expiry equals uvicorn's keep-alive, 5 s). The router's expiry
    is below the engines' keep-alive, with a margin larger than a health-check period."""
    from pdserve import cli
    from pdserve.router import app

    assert app.KEEPALIVE_EXPIRY_S + 1.0 < 5.0 < cli.SERVER_KEEP_ALIVE_S


@pytest.mark.parametrize("policy", ["none", "dualpath"])
def test_shut_down_ends_every_relayed_request_with_a_503_and_closes_its_engine_legs(policy):
    """The router's Ctrl-C: uvicorn cancelled the handlers still running after its grace, so a whole
    answer was a plain-text 500 (which the OpenAI client retries) and a stream broke without [DONE].
    `Router.shut_down` (a second before that cancel) ends each as the router means to: a request
    waiting for its prefill, one waiting for the decode's whole answer, and a stream mid-relay get a
    503 (the stream an error event and [DONE]); every decode leg is closed, so the engines abort them,
    and no health check brings an engine back."""

    async def go():
        engines = Engines(blocking=())
        prefill_answers = asyncio.Event()  # (never set: the prefill of "wait_pe" works on)

        async def engine(request: httpx.Request) -> httpx.Response | None:
            if request.method != "POST" or request.url.path != "/v1/completions":
                return None
            body = json.loads(await request.aread())
            host, case = request.url.host, body["user"]
            engines.posts.append((host, case))
            if host == "pe":
                if case == "wait_pe":
                    await prefill_answers.wait()
                return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
            if case == "stream":

                class Body(httpx.AsyncByteStream):
                    async def __aiter__(self):
                        for k in range(100000):
                            chunk = {"id": "c", "choices": [{"index": 0, "text": f"{k} "}]}
                            yield f"data: {json.dumps(chunk)}\n\n".encode()
                            await asyncio.sleep(0.01)

                    async def aclose(self) -> None:
                        engines.closed.append(case)

                return httpx.Response(200, stream=Body(), headers={"content-type": "text/event-stream"})
            try:
                await asyncio.sleep(3600)  # a long decode, or one waiting for its prefill's KV
            except asyncio.CancelledError:
                engines.closed.append(case)
                raise

        engines.intercept = engine
        router = await started_router(engines, policy)
        app = build_router_app(router)
        chunks: list[bytes] = []
        status: list[int] = []

        async def stream() -> int:  # (driven by hand: httpx's ASGI transport reads a body whole)
            sent = json.dumps({"prompt": [1, 2], "max_tokens": 500, "stream": True, "user": "stream"})
            messages = [{"type": "http.request", "body": sent.encode(), "more_body": False}]

            async def receive():
                if messages:
                    return messages.pop(0)
                await asyncio.Event().wait()  # (the client stays)

            async def send(message):
                if message["type"] == "http.response.start":
                    status.append(message["status"])
                elif message["type"] == "http.response.body":
                    chunks.append(message.get("body", b""))

            await app(completion_scope(sent.encode()), receive, send)
            return status[0]

        def lines() -> list[str]:
            return [x for x in b"".join(chunks).decode().split("\n") if x.startswith("data: ")]

        async with client_of(router) as c:
            calls = {
                case: asyncio.ensure_future(
                    c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 8, "user": case})
                )
                for case in ("wait_pe", "wait_de")
            }
            calls["stream"] = asyncio.ensure_future(stream())
            for _ in range(300):
                if len(lines()) >= 3 and len(engines.posts) >= 6:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"not all relayed: {engines.posts} {lines()[-2:]} {status}")
            await router.shut_down()
            answers = {case: await asyncio.wait_for(call, 5) for case, call in calls.items()}
            late = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 8, "user": "late"})
        await router.check_health()  # (as the health loop would: nothing comes back)
        await asyncio.sleep(0.3)
        return router, answers, late, lines(), sorted(engines.closed)

    router, answers, late, lines, closed = asyncio.run(go())
    for case in ("wait_pe", "wait_de"):
        assert answers[case].status_code == 503, (case, answers[case].text)
        assert STOPPING in answers[case].json()["error"]["message"], case
    assert answers["stream"] == 200 and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 503 and STOPPING in error["message"], error
    assert late.status_code == 503 and STOPPING in late.json()["error"]["message"], late.text
    assert closed == ["stream", "wait_de", "wait_pe"]  # every decode leg closed: each engine aborts
    assert all(not e.healthy for e in router.prefills + router.decodes)
    assert router.decodes[0].in_flight == 0 and router.num_in_flight() == 0


# ---- found by a review of the router (2026-12-02, sixth session) -----------------------------------
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 4}


async def _fail_health(router, engines: Engines, hosts: set[str]) -> None:
    """`hosts` stop answering (connection refused); two health rounds take them out of service."""
    previous = engines.intercept

    async def dead(request: httpx.Request):
        if request.url.host in hosts:
            raise httpx.ConnectError("connection refused", request=request)
        return await previous(request) if previous is not None else None

    engines.intercept = dead
    await router.check_health()
    await router.check_health()
    assert not any(e.healthy for e in router.prefills + router.decodes if e.url.split("//")[1] in hosts)


# ---- 1. placement policies: no live prefill -> the request waits in the FIFO for 10 minutes -----------
@pytest.mark.parametrize("policy", ["round_robin", "dualpath"])
def test_placement_with_no_live_prefill_answers_503_at_once(policy):
    """Plain routing answers 503 "no healthy prefill engine" at once. Under a placement policy the
    scheduler never assigns a dead prefill (round_robin skips it, dualpath reports it at beta + 1
    tokens), and `Placement.place` only checks the *decodes* before queueing, so the request sits in
    the FIFO until `queue_timeout_s` (600 s): a non-streamed client sees nothing for 10 minutes."""

    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, policy)
        await _fail_health(router, engines, {"pe"})
        async with client_of(router) as c:
            return await within(c.post("/v1/completions", json=COMPLETION), 3)

    r = asyncio.run(go())
    assert r is not None, "the request hung in the placement queue with no live prefill (600 s timeout)"
    assert r.status_code == 503, r.text
    assert "left to try" not in r.text, r.text  # (an outage: none was in service to fail it)


@pytest.mark.parametrize("policy", ["round_robin", "dualpath"])
@pytest.mark.parametrize("dies", ["pe", "de"])
def test_requests_waiting_in_placement_when_the_last_engine_of_a_role_dies_are_refused(policy, dies):
    """A request is queued (the decode has no free page yet); then the only prefill / decode goes down.
    `Placement.on_health` re-pumps the queue but never refuses what can no longer be placed, so the
    request waits to the 600 s queue timeout instead of the 503 a new request would get."""

    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, policy)
        router.placement.on_load(router.decodes[0], report("de", "decode", num_free_pages=0))
        async with client_of(router) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", json=COMPLETION))
            await queued(router)
            assert router.placement.queue, "the request should be waiting in placement"
            await _fail_health(router, engines, {dies})
            return await within(call, 3)

    r = asyncio.run(go())
    assert r is not None, "a request queued in placement hangs after the last engine of a role died"
    assert r.status_code == 503, r.text


@pytest.mark.parametrize("policy", ["round_robin", "dualpath"])
def test_placement_with_every_decode_down_is_a_503_not_a_400(policy):
    """With every decode out of service, `Placement.place` computes `biggest` = 0 pages and raises
    PlacementError("... the largest decode engine has 0"), which `_dispatch_placed` answers 400
    BadRequest (only messages containing "retry" become 503): a client error, not retried by
    OpenAI clients, for an outage. Plain routing answers 503 "no healthy decode engine"."""

    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, policy)
        await _fail_health(router, engines, {"de"})
        async with client_of(router) as c:
            return await asyncio.wait_for(c.post("/v1/completions", json=COMPLETION), 10)

    r = asyncio.run(go())
    assert r.status_code == 503, r.text


class _BrokenStream(httpx.AsyncByteStream):
    """A streamed decode answer whose connection is gone (the decode process died after its headers)."""

    async def __aiter__(self):
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        yield b""  # pragma: no cover


def _sse_ok() -> httpx.AsyncByteStream:
    chunk = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}

    class S(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()

    return S()


@pytest.mark.parametrize("failure", ["streamed decode died after its headers", "decode declared down"])
def test_a_decode_that_fails_after_accepting_is_left_for_another_decode_without_blaming_the_prefill(failure):
    """1 prefill, 2 decodes. The first decode accepts the request, then dies (a streamed request: its
    200 headers came at once, then the connection broke) or freezes and is declared down by the
    health checks. `prefill_unless_decode_fails` (router/legs.py) only looks at the decode's task
    while it is *pending*: once the streamed headers came, and for a decode declared down, it waits
    for the prefill alone, which waits for the dead decode's KVRequest until its Bootstrapping
    deadline (30 s by default; 1.5 s here) and answers 503. The router then blames the prefill
    (`tried.add`, a "prefill" retry), and with one prefill the client gets 503 "no healthy prefill
    engine" although a healthy pair (pe, de2) was there all along. The prefill's failure is now laid
    on its decode when that decode is out of service by then."""
    stream = failure.startswith("streamed")

    async def go():
        engines = Engines(blocking=())
        de2_asked = asyncio.Event()

        async def engine(request: httpx.Request):
            if request.method != "POST" or request.url.path != "/v1/completions":
                return None
            host = request.url.host
            if host == "de":
                body = _BrokenStream() if stream else None
                if body is None:
                    await asyncio.sleep(3600)  # frozen: no headers ever
                return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)
            if host == "de2":
                de2_asked.set()
                if stream:
                    return httpx.Response(
                        200, headers={"content-type": "text/event-stream"}, stream=_sse_ok()
                    )
                answer = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
                return httpx.Response(200, json=answer)
            try:  # the prefill: token 1 once a decode asked for the KV, else its Bootstrapping deadline
                await asyncio.wait_for(de2_asked.wait(), 1.5)
            except TimeoutError:
                return httpx.Response(
                    503, json={"error": {"message": "room timed out in Bootstrapping", "code": 503}}
                )
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})

        engines.intercept = engine
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        async with client_of(router) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", json=COMPLETION | {"stream": stream}))
            await asyncio.sleep(0.2)
            de = router.decodes[0]
            de.healthy = False  # what check_health does after two missed checks (its port refused when
            if not stream:  # it died; no answer when frozen, which cuts what it runs too)
                de.down.set()
            r = await asyncio.wait_for(call, 10)
        return r, router

    r, router = asyncio.run(go())
    assert r.status_code == 200 and "ok" in r.text, r.text
    assert router.retries_by_side == {"prefill": 0, "decode": 1}


@pytest.mark.parametrize(
    "failure",
    ["died before its headers", "streamed, died before its headers", "its whole answer broke midway",
     "answered 503 (its room failed)", "declared down before its headers"],
)  # fmt: skip
def test_a_decode_that_fails_after_the_prefill_answered_is_retried_before_the_client_sees_anything(failure):
    """1 prefill, 2 decodes. The prefill answers its token 1; the first decode then fails before any
    of its answer can have reached the client. The router waited for that decode alone and answered
    the client a 502 (or the decode's 503, or a 503 for one declared down): seen once in
    test_pd_faults, where the killed decode's prefill had answered first. It is now one more attempt,
    on the other decode (the prefill tried again: not its fault), the first leg closed."""
    stream = failure.startswith("streamed")
    posts: list[str] = []

    async def go():
        engines = Engines(blocking=())
        answered = asyncio.Event()  # the prefill's first answer is out

        async def engine(request: httpx.Request):
            if request.method != "POST" or request.url.path != "/v1/completions":
                return None
            host = request.url.host
            posts.append(host)
            if host == "pe":
                answered.set()
                return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
            if host == "de2":
                if stream:
                    return httpx.Response(
                        200, headers={"content-type": "text/event-stream"}, stream=_sse_ok()
                    )
                answer = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
                return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))
            await answered.wait()
            await asyncio.sleep(0.05)  # (after the router read the prefill's answer)
            if failure == "declared down before its headers":
                await asyncio.sleep(3600)  # frozen
            if failure == "its whole answer broke midway":
                return httpx.Response(
                    200, headers={"content-type": "application/json"}, stream=_BrokenStream()
                )
            if failure.startswith("answered 503"):
                error = {"error": {"message": "prefill failed: transfer", "code": 503}}
                return httpx.Response(503, headers={"content-type": "application/json"}, stream=Once(error))
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

        engines.intercept = engine
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        async with client_of(router) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", json=COMPLETION | {"stream": stream}))
            if failure == "declared down before its headers":
                await answered.wait()
                await asyncio.sleep(0.1)
                router.decodes[0].healthy = False  # (check_health after two missed checks)
                router.decodes[0].down.set()
            r = await asyncio.wait_for(call, 10)
        return r, router

    r, router = asyncio.run(go())
    assert r.status_code == 200 and '"ok"' in r.text and "error" not in r.text, r.text
    assert sorted(posts) == ["de", "de2", "pe", "pe"], posts  # (the prefill asked again)
    assert router.retries_by_side == {"prefill": 0, "decode": 1}
    assert [e.in_flight for e in router.decodes] == [0, 0] and router.num_relaying == 0


def test_a_generate_retried_after_its_prefill_answered_first_aborts_its_rid_there():
    """The same with the client's rid on /generate and one prefill: that prefill holds the rid until
    the failed room's writes end or fail (it sees a dead decode late), so the retry there was refused
    as a duplicate id. The router ends that half first, named by its room: the abort, then the retry."""
    calls: list[tuple[str, str, object]] = []
    rooms: list[int] = []  # each call's room (an abort's names the first attempt's)

    async def go():
        engines = Engines(blocking=())
        answered = asyncio.Event()

        async def engine(request: httpx.Request):
            if request.method != "POST" or request.url.path not in ("/generate", "/abort_request"):
                return None
            host, sent = request.url.host, json.loads(await request.aread())
            calls.append((host, request.url.path, sent.get("rid")))
            rooms.append(sent["pd"]["room"] if "pd" in sent else sent.get("room"))
            if request.url.path == "/abort_request":
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 1})
            if host == "pe":
                answered.set()
                return prefill_answer()
            if host == "de2":
                return decode_answer("length", [1, 2], "ok")
            await answered.wait()
            await asyncio.sleep(0.05)
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

        engines.intercept = engine
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "client-rid"}
        async with client_of(router) as c:
            return await c.post("/generate", json=body)

    r = asyncio.run(go())
    assert r.status_code == 200 and r.json()["text"] == "ok", r.text
    on_pe = [(path, rid) for host, path, rid in calls if host == "pe"]
    assert on_pe == [
        ("/generate", "client-rid"),
        ("/abort_request", "client-rid"),
        ("/generate", "client-rid"),
    ]
    on_pe_rooms = [room for (host, _, _), room in zip(calls, rooms, strict=True) if host == "pe"]
    assert on_pe_rooms[1] == on_pe_rooms[0] != on_pe_rooms[2]  # (only the failed attempt's half)


def test_a_generate_whose_decode_failed_first_ends_its_prefills_half_before_the_retry():
    """The decode's 500 reaches the router before the prefill's answer (the router closes the prefill's
    leg): had the prefill finished token 1 meanwhile, its half holds the client's rid until its writes
    settle, and the retry there was refused as a duplicate (a review: a window of ~1 ms). The router
    ends that half by its room before it retries, as when the prefill answered first."""
    calls: list[tuple[str, str, object]] = []

    async def go():
        engines = Engines(blocking=())

        async def engine(request: httpx.Request):
            if (call := await generate_or_abort(request)) is None:
                return None
            calls.append(call)
            host = call[0]
            if request.url.path == "/abort_request":
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 1})
            if host == "pe" and len([c for c in calls if c[:2] == ("pe", "/generate")]) == 1:
                await asyncio.sleep(5)  # (the first prefill leg: the decode fails before it answers)
            if host == "pe":
                return prefill_answer()
            if host == "de":
                return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
            return decode_answer("length", [1, 2], "ok")

        engines.intercept = engine
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "client-rid"}
        async with client_of(router) as c:
            return await c.post("/generate", json=body)

    r = asyncio.run(go())
    assert r.status_code == 200 and r.json()["text"] == "ok", r.text
    on_pe = [(path, room) for host, path, room in calls if host == "pe"]
    assert [path for path, _ in on_pe] == ["/generate", "/abort_request", "/generate"]
    assert on_pe[1][1] == on_pe[0][1] != on_pe[2][1]  # (the failed attempt's half only)


def test_a_retry_on_another_prefill_does_not_wait_for_the_failed_half_to_end():
    """The failed attempt's half is ended before a retry on its prefill (above); a retry on another
    prefill does not wait for it (a review: a paused prefill held every such retry up to 5 s). Here the
    first prefill never answers the abort until the client has its answer."""
    calls: list[tuple[str, str, object]] = []

    async def go():
        engines = Engines(blocking=())
        released = asyncio.Event()

        async def engine(request: httpx.Request):
            if (call := await generate_or_abort(request)) is None:
                return None
            calls.append(call)
            host = call[0]
            if request.url.path == "/abort_request":
                await released.wait()  # (a paused engine)
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 1})
            if host.startswith("pe") and len(calls) <= 2:
                await asyncio.sleep(5)  # (the first attempt's prefill: the decode fails before it)
            if host.startswith("pe"):
                return prefill_answer()
            if host == "de":
                return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
            return decode_answer("length", [1, 2], "ok")

        engines.intercept = engine
        router = await started_router(
            engines, "none", prefills=("http://pe", "http://pe2"), decodes=("http://de", "http://de2")
        )
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "client-rid"}
        async with client_of(router) as c:
            answer = await asyncio.wait_for(c.post("/generate", json=body), 10)
            pending = len(router._background)
            released.set()
            await asyncio.wait_for(asyncio.gather(*router._background), 10)
        return answer, pending

    answer, pending = asyncio.run(go())
    assert answer.status_code == 200 and answer.json()["text"] == "ok", answer.text
    first_pe, first_room = next((h, r) for h, path, r in calls if path == "/generate" and h.startswith("pe"))
    retry = [(h, r) for h, path, r in calls if path == "/generate" and h.startswith("pe")][1]
    assert retry[0] != first_pe and pending == 1  # (the abort still waited when the client had its answer)
    assert (first_pe, "/abort_request", first_room) in calls


def test_a_retry_back_on_a_prefill_waits_for_the_end_of_any_earlier_half_of_its_rid_there():
    """Attempt 1 fails on its decode with its half on pe (the abort goes out in the background, and
    pe takes a while to act on it), attempt 2 on pe2 fails too, attempt 3 goes back to pe: only the
    last attempt's half was compared with the retry's prefill, so attempt 3 reached pe before pe had
    ended attempt 1's half, and the client heard 409 about its own rid (a review). Each (prefill, rid)
    being ended is waited for by any request of that rid sent there."""
    calls: list[tuple[str, str, object]] = []

    async def go():
        engines = Engines(blocking=())
        held: dict[str, int] = {}  # prefill -> the room whose half holds "client-rid"

        async def engine(request: httpx.Request):
            if (call := await generate_or_abort(request)) is None:
                return None
            calls.append(call)
            host, _, room = call
            if request.url.path == "/abort_request":
                if host == "pe":
                    await asyncio.sleep(0.3)  # (slow to act on it)
                if held.get(host) == room:
                    del held[host]
                calls.append((host, "ended", room))
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 1})
            if host.startswith("pe"):
                if host in held:  # (as an engine's DuplicateRequestId)
                    error = {"message": "request id 'client-rid' is already active", "code": 409}
                    return httpx.Response(409, json={"error": error})
                held[host] = room
                return prefill_answer()
            if host in ("de", "de2"):
                return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
            return decode_answer("length", [1, 2], "ok")

        engines.intercept = engine
        router = await started_router(
            engines,
            "none",
            prefills=("http://pe", "http://pe2"),
            decodes=("http://de", "http://de2", "http://de3"),
        )
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "client-rid"}
        async with client_of(router) as c:
            answer = await asyncio.wait_for(c.post("/generate", json=body), 10)
            await asyncio.wait_for(asyncio.gather(*router._background), 10)
        return answer

    answer = asyncio.run(go())
    assert answer.status_code == 200 and answer.json()["text"] == "ok", (answer.text, calls)
    on_pe = [(path, room) for host, path, room in calls if host == "pe"]
    assert [path for path, _ in on_pe] == ["/generate", "/abort_request", "ended", "/generate"], calls
    assert on_pe[0][1] == on_pe[1][1] == on_pe[2][1] != on_pe[3][1]


class Silent(httpx.AsyncByteStream):
    """A stream whose headers came and whose body never does (a decode killed mid-transfer)."""

    async def __aiter__(self):
        await asyncio.Event().wait()
        yield b""


def test_a_decode_killed_mid_transfer_of_a_stream_is_the_decodes_failure_not_the_prefills():
    """1P2D, streamed: the decode answered its stream's headers, then died while the prefill wrote to
    it; the prefill's 5xx says its transfer failed, before the health loop has seen the decode go.
    The attempt was laid on the prefill, which left no prefill to try: a 503 though a live decode was
    left (an end-to-end review). A transfer failure now looks at the decode at once: it does not
    answer, so the prefill is tried again with the other decode."""
    posts: list[str] = []

    async def go():
        engines = Engines(blocking=())
        dead: set[str] = set()

        async def engine(request: httpx.Request):
            host, path = request.url.host, request.url.path
            if path == "/pd/info" and host in dead:
                raise httpx.ConnectError("refused")
            if path != "/v1/completions":
                return None
            posts.append(host)
            if host == "de" and not dead:
                dead.add("de")
                return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Silent())
            if host == "pe" and len(posts) <= 2:
                await asyncio.sleep(0.05)
                error = {
                    "message": "prefill failed: transfer failed",
                    "type": "ServiceUnavailable",
                    "code": 503,
                }
                return httpx.Response(503, json={"error": error})
            if host == "pe":
                return httpx.Response(200, json={"choices": [{"text": "x", "index": 0}]})
            chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
            chunk["choices"] = [{"text": "y", "index": 0, "finish_reason": "length"}]
            sse = Once({})
            sse.data = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=sse)

        engines.intercept = engine
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        router.decodes[0].in_flight = -1  # (the first attempt takes "de")
        async with client_of(router) as c:
            body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
            return await asyncio.wait_for(c.post("/v1/completions", json=body), 10)

    r = asyncio.run(go())
    assert r.status_code == 200 and '"text": "y"' in r.text and "[DONE]" in r.text, r.text
    assert sorted(posts) == ["de", "de2", "pe", "pe"], posts


@pytest.mark.parametrize("error_type", [PREFILL_UNREACHABLE, "ServiceUnavailable"])
def test_a_decode_that_cannot_reach_a_dead_prefill_first_is_the_prefills_failure(error_type):
    """2 prefills, 1 decode; the first prefill is dead. The decode's bootstrap lookup of that prefill
    fails fast, and its 503 may reach the router before the prefill's own connection error (seen
    once in test_pd_faults under load): the router blamed the decode and, with no other decode,
    answered the client 503. The decode's 503 says PrefillUnreachable: the attempt is the prefill's,
    retried on the other prefill with the same decode. Any other 503 of the decode is still the
    decode's failure (with one decode: the 503 it was)."""
    posts: list[str] = []

    async def go():
        engines = Engines(blocking=())
        first_decode_asked = asyncio.Event()

        async def engine(request: httpx.Request):
            if request.method != "POST" or request.url.path != "/v1/completions":
                return None
            host = request.url.host
            posts.append(host)
            if host == "pe":  # dead: its connection error comes after the decode's answer
                await first_decode_asked.wait()
                await asyncio.sleep(0.3)
                raise httpx.ConnectError("All connection attempts failed")
            if host == "pe2":
                return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
            if not first_decode_asked.is_set():
                first_decode_asked.set()
                error = {
                    "error": {"message": "prefill bootstrap unreachable", "type": error_type, "code": 503}
                }
                return httpx.Response(503, headers={"content-type": "application/json"}, stream=Once(error))
            answer = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = engine
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2"))
        async with client_of(router) as c:
            r = await asyncio.wait_for(c.post("/v1/completions", json=COMPLETION), 10)
        return r, router

    r, router = asyncio.run(go())
    if error_type == PREFILL_UNREACHABLE:
        assert r.status_code == 200 and '"ok"' in r.text, r.text
        assert posts == ["de", "pe", "de", "pe2"] or posts == ["pe", "de", "de", "pe2"], posts
        assert router.retries_by_side == {"prefill": 1, "decode": 0}
    else:
        assert r.status_code == 503 and "unreachable" in r.text, r.text
        assert router.retries_by_side == {"prefill": 0, "decode": 0}
    assert [e.in_flight for e in router.prefills + router.decodes] == [0, 0, 0]


@pytest.mark.parametrize("policy", ["none", "dualpath"])
def test_a_router_that_knows_no_update_pairs_engines_of_one_weights(policy):
    """A (re)started router knows of no weight update, so it keeps no engine out for its weights; its
    engines may still disagree (one restarted on its launch checkpoint). A prefill and a decode of
    different weights refuse each other (each such attempt a 503). Whatever placement or round
    robin chose, the decode is now one of the prefill's weights; a prefill with no such decode is
    left while another has one; with no such pair at all, a 503 that says so."""
    pairs: list[tuple[str, str]] = []

    async def go(weights: dict[str, str], num_requests: int):
        engines = Engines(blocking=())
        engines.weights_ids = weights
        rooms: dict[int, list[str]] = {}

        async def engine(request: httpx.Request):
            if request.method != "POST" or request.url.path != "/v1/completions":
                return None
            sent = json.loads(await request.aread())
            rooms.setdefault(sent["pd"]["room"], []).append(request.url.host)
            return httpx.Response(
                200, json={"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
            )

        engines.intercept = engine
        router = await started_router(
            engines,
            policy,
            prefills=("http://pe", "http://pe2", "http://pe3"),
            decodes=("http://de", "http://de2"),
        )
        async with client_of(router) as c:
            answers = [await c.post("/v1/completions", json=COMPLETION) for _ in range(num_requests)]
        for hosts in rooms.values():
            pairs.append((min(hosts), max(hosts)))  # ("de*", "pe*")
        return answers

    # pe and de2 on the new weights, pe2 and de on the old ones, pe3 on weights no decode serves
    answers = asyncio.run(go({"pe": "new", "de2": "new", "pe2": "old", "de": "old", "pe3": "other"}, 12))
    assert [a.status_code for a in answers] == [200] * 12, [a.text for a in answers]
    assert set(pairs) == {("de2", "pe"), ("de", "pe2")}, pairs  # (pe3 never: no decode of its weights)
    pairs.clear()
    answers = asyncio.run(go({"pe": "a", "pe2": "a", "pe3": "a", "de": "b", "de2": "b"}, 1))
    assert answers[0].status_code == 503 and pairs == [], answers[0].text
    assert "serves the weights of prefill" in answers[0].json()["error"]["message"]


def test_the_n_choices_follow_their_leader_to_the_prefill_of_its_weights_pair():
    """DualPath placement puts the leader of an n = 4 request on pe0, whose weights (A) no decode
    serves. The leader moves to a prefill of the decodes' weights, but had already told its siblings
    "pe0": each moved again on its own, by round robin, over pe1 and pe2 (the prompt computed or read
    once per prefill; a review). The leader now settles where it goes: one prefill for all four."""
    prefill_hosts: list[str] = []

    async def go():
        engines = Engines(blocking=())
        engines.weights_ids = {"pe0": "A", "pe1": "B", "pe2": "B", "de0": "B", "de1": "B"}

        async def engine(request: httpx.Request):
            if request.url.path == "/v1/completions":
                if request.url.host.startswith("pe"):
                    prefill_hosts.append(request.url.host)
                    return httpx.Response(200, json={"choices": [{"text": "x", "index": 0}]})
                answer = {
                    "id": "c",
                    "object": "text_completion",
                    "created": 0,
                    "model": "m",
                    "choices": [{"text": "y", "index": 0, "finish_reason": "length"}],
                }
                return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = engine
        router = await started_router(
            engines,
            "dualpath",
            prefills=("http://pe0", "http://pe1", "http://pe2"),
            decodes=("http://de0", "http://de1"),
        )
        for e in router.prefills[1:]:  # (busier: placement's least loaded prefill is pe0)
            router.placement.on_load(e, report(e.url.split("//")[1], "prefill", num_seqs=4, num_tokens=4000))
        async with client_of(router) as c:
            return await c.post("/v1/completions", json={"prompt": [1] * 200, "max_tokens": 2, "n": 4})

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    assert len(prefill_hosts) == 4 and len(set(prefill_hosts)) == 1 and prefill_hosts[0] != "pe0", (
        prefill_hosts
    )


def test_a_retry_after_a_decode_failure_goes_to_a_pair_of_other_weights_not_a_503():
    """pe, pe2 and de on weights "a"; pe3 and de2 on "b" (a router that knows no update). The first
    attempt (pe, de) fails on its decode, a 500 before the prefill answered. Attempt 2's
    `pick_prefill` counts pe2 as paired (de is healthy, though in `failed_decodes`), then
    `pick_decode({de}, like=pe2)` raises NoEngine, which `_attempts` answers with a 503 at once,
    with attempts left and pe3 + de2 able to serve (found by a review). Now `pick_prefill` leaves
    out the decodes that failed this request: pe3 + de2 serve it."""

    async def go():
        engines = Engines(blocking=())
        engines.weights_ids = {"pe": "a", "pe2": "a", "de": "a", "pe3": "b", "de2": "b"}
        served = asyncio.Event()

        async def engine(request: httpx.Request):
            if request.method != "POST" or request.url.path != "/v1/completions":
                return None
            host = request.url.host
            if host.startswith("pe"):  # (a prefill answers once its decode took the KV)
                await served.wait()
                return httpx.Response(200, json={"choices": [{"text": "x"}]})
            if host == "de":
                err = {"error": {"message": "de: transfer failed", "code": 500}}
                return httpx.Response(500, headers={"content-type": "application/json"}, stream=Once(err))
            served.set()
            answer = {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = engine
        router = await started_router(
            engines,
            "none",
            prefills=("http://pe", "http://pe2", "http://pe3"),
            decodes=("http://de", "http://de2"),
        )
        async with client_of(router) as c:
            r = await asyncio.wait_for(c.post("/v1/completions", json=COMPLETION), 10)
        return r, engines

    r, engines = asyncio.run(go())
    assert r.status_code == 200, (r.text, engines.posts)


def test_a_400_no_bigger_decode_of_its_weights_could_take_is_the_clients_400():
    """pe and de (64-token pool) on weights "a"; de2 (4096 tokens) on "b". de refuses the request
    with a 400 (outgrew its pool). `_biggest_decodes` ignores weights: it offers de2, so de's 400 is
    not the answer; every decode but de2 goes into `failed_decodes`, and the retry's
    `pick_decode(.., like=pe)` finds none: the client gets a 503 (the OpenAI client retries it)
    for a request no decode of its prefill's weights can take, instead of de's 400 (found by a
    review). Now only decodes of the prefill's weights are offered: de's 400 is the answer."""

    async def go():
        engines = Engines(blocking=())
        engines.weights_ids = {"pe": "a", "de": "a", "de2": "b"}
        engines.capacities = {"de": 64, "de2": 4096}

        async def engine(request: httpx.Request):
            if request.method != "POST" or request.url.path != "/v1/completions":
                return None
            host = request.url.host
            if host == "pe":
                await asyncio.Event().wait()  # (waits for a decode's KVRequest: the decode decides)
            body = {"error": {"message": f"{host}: needs more KV pages", "code": 400}}
            return httpx.Response(400, headers={"content-type": "application/json"}, stream=Once(body))

        engines.intercept = engine
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        async with client_of(router) as c:
            r = await asyncio.wait_for(
                c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4}), 10
            )
        return r

    r = asyncio.run(go())
    assert r.status_code == 400 and "de: needs more KV pages" in r.text, r.text


def test_an_engine_that_failed_a_weight_update_is_out_of_service_when_the_update_answers():
    """After an update the router calls `check_health` so that an engine that did not load the new
    weights is out of service (stale) before the held requests go. But the health state machine's
    hysteresis (`e.healthy = ok or (e.healthy and e.misses < 2)`) also applies to an engine that
    *answered* and said it serves other weights: it stays healthy (and is picked first) until the
    next health round, so the requests released at `open.set()` go to a decode of the old weights."""

    async def go():
        engines = Engines(blocking=())

        async def answering(request: httpx.Request):
            if request.url.path == "/update_weights_from_disk":
                if request.url.host == "de":
                    return httpx.Response(400, json={"success": False, "message": "load failed"})
                engines.model_paths[request.url.host] = json.loads(await request.aread())["model_path"]
                return httpx.Response(200, json={"success": True})

        engines.intercept = answering
        router = await started_router(engines, "none", decodes=("http://de", "http://de2"))
        async with client_of(router) as c:
            r = await c.post("/update_weights_from_disk", json={"model_path": "/ckpt/b"})
        de = router.decodes[0]
        return r, de.stale, de.healthy, router.pick_decode().url

    r, stale, healthy, picked = asyncio.run(go())
    assert r.status_code == 502 and stale
    assert not healthy and picked == "http://de2", "a decode on the old weights is still picked"


def test_requests_in_flight_gauge_counts_one_request_once():
    """`Router.num_in_flight()` = `num_dispatching` + the decodes' in-flight counts, but a request inside
    `dispatch` also holds its decode leg's count (`Leg.__init__`): one request waiting for its
    prefill shows as 2 in `pdserve_router_requests_in_flight` (and in the weight update's
    "N requests still in flight")."""

    async def go():
        engines = Engines(blocking=("pe", "de"))
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", json=COMPLETION))
            while len(engines.posts) < 2:
                await asyncio.sleep(0.01)
            m = _scrape((await c.get("/metrics")).text)
            engines.release.set()
            await asyncio.wait_for(call, 5)
        return m

    m = asyncio.run(go())
    assert m[("pdserve_router_requests_in_flight", ())] == 1


def test_retries_count_only_attempts_that_were_retried():
    """3 prefills, each answering 500: 3 attempts, i.e. 2 retries. `_attempts` increments
    `retries_by_side` (pdserve_router_retries_total) after every failed attempt, the last one too, when
    attempts have run out and nothing is retried (it also logs "retrying on another prefill" then)."""

    async def go():
        engines = Engines(blocking=())

        async def fail(request: httpx.Request):
            if request.method == "POST" and request.url.host.startswith("pe"):
                return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})

        engines.intercept = fail
        router = await started_router(engines, "none", prefills=("http://pe", "http://pe2", "http://pe3"))
        async with client_of(router) as c:
            r = await asyncio.wait_for(c.post("/v1/completions", json=COMPLETION), 10)
        return r, router

    r, router = asyncio.run(go())
    assert r.status_code == 502
    assert router.retries_by_side["prefill"] == 2


# ---- found by a second review of this session's changes -------------------------------------------
def test_in_flight_counts_a_non_streamed_request_once_while_its_answer_is_read():
    """`_attempts` builds the `Relay` (num_relaying += 1) and then, for a whole answer, reads the
    decode's body inside `dispatch` (num_dispatching still 1): one request is 2 in
    pdserve_router_requests_in_flight and in a weight update's "N requests still in flight" for its
    whole generation."""

    async def go():
        engines = Engines(blocking=())
        body_gate = asyncio.Event()

        class SlowJson(httpx.AsyncByteStream):
            async def __aiter__(self):
                await body_gate.wait()  # (a long non-streamed generation)
                yield json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode()

        async def engine(request: httpx.Request):
            if request.method == "POST" and request.url.host == "de":
                engines.posts.append(("de", request.url.path))
                return httpx.Response(200, headers={"content-type": "application/json"}, stream=SlowJson())
            return None

        engines.intercept = engine
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", json=COMPLETION))
            for _ in range(200):
                if router.num_relaying:
                    break
                await asyncio.sleep(0.01)
            counted = router.num_in_flight()
            body_gate.set()
            r = await asyncio.wait_for(call, 5)
        return counted, r

    counted, r = asyncio.run(go())
    assert r.status_code == 200
    assert counted == 1, f"one non-streamed request counted {counted} times"


def test_a_retry_is_not_counted_when_no_other_prefill_is_there_to_retry_on():
    """One prefill answering 500: attempt 0 fails, `_count_retry` counts a "prefill" retry because
    attempts remain, then attempt 1 finds no untried prefill (NoEngine) and answers 503. No retry
    followed, yet pdserve_router_retries_total counts one and the log says "retrying on another
    prefill" (the commit's claim: "retries count only when one follows")."""

    async def go():
        engines = Engines(blocking=())

        async def fail(request: httpx.Request):
            if request.method == "POST" and request.url.host == "pe":
                return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})

        engines.intercept = fail
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            r = await asyncio.wait_for(c.post("/v1/completions", json=COMPLETION), 10)
        return r, router

    r, router = asyncio.run(go())
    assert r.status_code == 503, r.text
    assert router.retries_by_side == {"prefill": 0, "decode": 0}, router.retries_by_side


def test_shut_down_ends_requests_held_by_a_weight_update_with_a_503():
    """`Router.shut_down` ends requests waiting on their prefill, placement or decode, but one held at
    `Router.open` (a weight update is loading) waits in `dispatch` on `open.wait()` only, which
    shut_down does not touch: uvicorn's cancel a second later answers it with a plain-text 500 (the
    case the commit set out to remove)."""

    async def go():
        engines = Engines(blocking=())
        loading = asyncio.Event()

        async def slow_update(request: httpx.Request):
            if request.url.path == "/update_weights_from_disk":
                loading.set()
                await asyncio.sleep(3600)  # an engine reading a big checkpoint
            return None

        engines.intercept = slow_update
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            update = asyncio.ensure_future(
                c.post("/update_weights_from_disk", json={"model_path": "/ckpt/b"})
            )
            await asyncio.wait_for(loading.wait(), 5)
            held = asyncio.ensure_future(c.post("/v1/completions", json=COMPLETION))
            await asyncio.sleep(0.2)
            assert not held.done()
            await router.shut_down()
            r = await within(held, 2)
            update.cancel()
        return r

    r = asyncio.run(go())
    assert r is not None, "a request held by a weight update still waits after shut_down (uvicorn's 500 next)"
    assert r.status_code == 503 and STOPPING in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("policy", ["round_robin", "dualpath"])
def test_a_request_only_a_down_decode_can_hold_is_a_503_not_a_400(policy):
    """`Placement.place` sizes a request against the *live* decodes only: with the big decode out of
    service for a moment, a request it holds is answered 400 "... the largest decode engine has N"
    (BadRequestError: clients do not retry it), the same blame of the client for an outage the commit
    removed for "no live decode" (`_check_live`). It should be NotPlaceableNow (503) when a decode
    that is down could hold it."""

    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, policy, decodes=("http://de", "http://de2"))
        router.placement.on_load(
            router.decodes[1], report("de2", "decode", num_free_pages=100000, num_total_pages=100000)
        )
        await _fail_health(router, engines, {"de2"})
        body = {"prompt": [1, 2, 3], "max_tokens": 1000 * 16 + 100}  # > de's 1000 pages, < de2's
        async with client_of(router) as c:
            return await asyncio.wait_for(c.post("/v1/completions", json=body), 10)

    r = asyncio.run(go())
    assert r.status_code == 503, r.text


@pytest.mark.parametrize("policy", ["round_robin", "dualpath"])
def test_a_queued_request_only_a_decode_that_died_could_hold_is_refused(policy):
    """The same rule at `Placement.on_health`: it refuses what waits only when a role's *last* engine
    dies; a queued request too big for every decode still live (only the one that died could hold it)
    waits to the 600 s queue timeout, as the commit's case did."""

    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, policy, decodes=("http://de", "http://de2"))
        big = report("de2", "decode", num_free_pages=0, num_total_pages=100000)  # (busy for now)
        router.placement.on_load(router.decodes[1], big)
        body = {"prompt": [1, 2, 3], "max_tokens": 1000 * 16 + 100}  # > de's 1000 pages, < de2's
        async with client_of(router) as c:
            call = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await queued(router)
            assert router.placement.queue, "the request should wait for de2's pages"
            await _fail_health(router, engines, {"de2"})
            return await within(call, 3)

    r = asyncio.run(go())
    assert r is not None, "queued for the decode that died: waits to the 600 s queue timeout"
    assert r.status_code == 503, r.text


def test_requests_cut_from_an_engine_that_answered_it_cannot_serve_are_not_told_it_stopped_answering():
    """The commit takes an engine out at once when its health check answers that it cannot serve
    (status "dead" / "weights lost", other weights, another role) and cuts what it runs (`down`), but
    `Engine.down_reason` is only ever set by `shut_down`: those requests are told "decode ... stopped
    answering health checks", which sends an operator after a network problem that is not there."""
    from pdserve.router.routes import build_router_app
    from tests.test_router_app import completion_scope

    async def go():
        engines = Engines(blocking=())

        class Endless(httpx.AsyncByteStream):
            async def __aiter__(self):
                for k in range(100000):
                    yield f'data: {{"choices": [{{"index": 0, "text": "{k}"}}]}}\n\n'.encode()
                    await asyncio.sleep(0.01)

        async def engine(request: httpx.Request):
            if request.method == "POST" and request.url.host == "de":
                return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Endless())
            return None

        engines.intercept = engine
        router = await started_router(engines, "none")
        app = build_router_app(router)
        chunks: list[bytes] = []
        sent = json.dumps(COMPLETION | {"stream": True}).encode()
        messages = [{"type": "http.request", "body": sent, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()

        async def send(message):
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        def lines():
            return [x for x in b"".join(chunks).decode().split("\n") if x.startswith("data: ")]

        call = asyncio.ensure_future(app(completion_scope(sent), receive, send))
        for _ in range(300):
            if len(lines()) >= 3:
                break
            await asyncio.sleep(0.01)
        engines.statuses["de"] = "dead"  # its engine thread died; its /pd/info says so
        await router.check_health()
        await asyncio.wait_for(call, 5)
        return lines()

    lines = asyncio.run(go())
    assert lines[-1] == "data: [DONE]"
    message = json.loads(lines[-2][6:])["error"]["message"]
    assert "stopped answering health checks" not in message, message


def test_a_health_check_in_flight_at_shut_down_does_not_bring_the_engines_back():
    """`check_health` returns early once `stopping` is set, but only at its start: a round already
    awaiting the engines' /pd/info when `shut_down` runs resumes, sets `healthy = True` and replaces
    the `down` event shut_down set with a fresh one. New requests in the last second of the grace are
    then dispatched to the engines (and cut by uvicorn's cancel: the plain 500 shut_down exists to
    avoid), and their legs are not closed by shut_down."""

    async def go():
        engines = Engines(blocking=())
        gate = asyncio.Event()
        asked = asyncio.Event()

        async def slow_info(request: httpx.Request):
            if request.url.path == "/pd/info" and not gate.is_set():
                asked.set()
                await gate.wait()  # (a health check that takes a moment: a busy engine, a slow link)
            return None

        router = await started_router(engines, "none")
        engines.intercept = slow_info
        round_ = asyncio.ensure_future(router.check_health())
        await asyncio.wait_for(asked.wait(), 5)
        await router.shut_down()
        gate.set()
        await asyncio.wait_for(round_, 5)
        healthy = [e.url for e in router.prefills + router.decodes if e.healthy]
        async with client_of(router) as c:
            late = await asyncio.wait_for(c.post("/v1/completions", json=COMPLETION), 5)
        return healthy, late

    healthy, late = asyncio.run(go())
    assert healthy == [], f"back in service after shut_down: {healthy}"
    assert late.status_code == 503 and STOPPING in late.text, late.text


def test_an_aborted_n_request_waiting_in_placement_ends_all_its_choices_at_once():
    """DualPath: a /generate with n = 3 waits in placement (its leader in the queue, the other two
    waiting for the leader's place) when an abort of its rid comes. The leader answered "abort" at
    once; the other two then queued on their own and answered only when pages freed (an end-to-end
    review: 3.4 s behind other requests). All three now answer "abort" at once, pages or not."""
    legs: list[tuple[str, dict]] = []

    async def go():
        engines = Engines(blocking=())
        engines.intercept = answering_as_marked(legs)
        router = await started_router(engines, "dualpath")
        router.placement.on_load(router.decodes[0], report("de", "decode", num_free_pages=0))
        async with client_of(router) as c:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "n": 3}, "rid": "grp"}
            waiting = asyncio.ensure_future(c.post("/generate", json=body))
            await queued(router, 1)
            aborted = await c.post("/abort_request", json={"rid": "grp"})
            answer = await asyncio.wait_for(waiting, 5)  # (no page ever frees)
        return aborted, answer

    aborted, answer = asyncio.run(go())
    assert aborted.status_code == 200 and answer.status_code == 200, answer.text
    assert [a["meta_info"]["finish_reason"]["type"] for a in answer.json()] == ["abort"] * 3
    assert len(legs) == 6 and all(pd.get("aborted") for _, pd in legs)


def test_abort_of_one_rid_ends_the_request_waiting_in_placement():
    """An RL rollout manager aborts one request by its `rid` (SGLang's /abort_request) while the router
    holds it in the DualPath placement FIFO (no decode page free yet). The router forwards the abort
    to the engines, which do not have the request yet (it says success), and `abort_request`
    (router/control.py) only ends what the router holds for `abort_all`: once pages free, the request
    is placed and sent unmarked and runs to completion, as if never aborted (the very bug the
    abort_all path fixed, see test_abort_all_ends_the_requests_waiting_in_placement_through_their_engines)."""
    legs: list[tuple[str, dict]] = []

    async def go():
        engines = Engines(blocking=())
        engines.intercept = answering_as_marked(legs)
        router = await started_router(engines, "dualpath")
        router.placement.on_load(router.decodes[0], report("de", "decode", num_free_pages=0))
        async with client_of(router) as c:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
            waiting = {
                rid: asyncio.ensure_future(c.post("/generate", json=body | {"rid": rid}))
                for rid in ("victim", "victim_1", "victimless")  # (a child of it; another request)
            }
            await queued(router, 3)
            assert len(router.placement.queue) == 3
            aborted = await c.post("/abort_request", json={"rid": "victim"})
            left = [w.name for w in router.placement.queue]  # (its names)
            router.placement.on_load(router.decodes[0], report("de", "decode"))  # pages free up
            answers = {rid: await asyncio.wait_for(call, 5) for rid, call in waiting.items()}
        return aborted, answers, left

    aborted, answers, left = asyncio.run(go())
    assert aborted.status_code == 200 and left == [("victimless",)]  # (the two it names end at once)
    finish = {rid: a.json()["meta_info"]["finish_reason"]["type"] for rid, a in answers.items()}
    assert finish == {"victim": "abort", "victim_1": "abort", "victimless": "length"}, (finish, legs)
    assert sum(bool(pd.get("aborted")) for _, pd in legs) == 4  # (both halves of the two it names)


def test_a_clients_abort_with_a_room_is_refused_before_anything_is_aborted():
    """`room` in /abort_request is the router's own (it ends one PD half it retries elsewhere). A
    client's body with one passed the router's check, so the router ended what it held of the rid,
    then the engines refused the body it forwarded (a room with router fields): the client heard 400
    and its request was aborted all the same (a review). Now a 400 naming `room`, nothing forwarded,
    and the request runs to its end."""
    forwarded: list[dict] = []

    async def go():
        engines = Engines(blocking=())

        async def recording(request: httpx.Request):
            if request.url.path == "/abort_request":
                forwarded.append(json.loads(await request.aread()))
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 0})
            if request.url.path == "/generate":
                pd = json.loads(await request.aread())["pd"]
                if request.url.host == "de":
                    finish = "abort" if pd.get("aborted") else "length"
                    return decode_answer(finish)
                return prefill_answer()

        engines.intercept = recording
        router = await started_router(engines, "dualpath")
        router.placement.on_load(router.decodes[0], report("de", "decode", num_free_pages=0))
        async with client_of(router) as c:
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "victim"}
            waiting = asyncio.ensure_future(c.post("/generate", json=body))
            await queued(router, 1)
            refused = await c.post("/abort_request", json={"rid": "victim", "room": 7})
            left = [w.name for w in router.placement.queue]
            router.placement.on_load(router.decodes[0], report("de", "decode"))  # pages free up
            answer = await asyncio.wait_for(waiting, 5)
        return refused, left, answer

    refused, left, answer = asyncio.run(go())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "room", refused.text
    assert refused.json()["success"] is False and "abort by rid" in refused.json()["message"]
    assert left == [("victim",)] and forwarded == []
    assert answer.json()["meta_info"]["finish_reason"]["type"] == "length"


def test_an_abort_of_one_request_id_ends_it_while_a_weight_update_holds_it():
    """Plain routing: a weight update holds two requests, each with the client's `request_id`; an
    /abort_request of one's id ends that one when the update lets them go (sent with `pd.aborted`:
    the engines answer "abort"); the other runs under the new weights. The abort reaches the engines
    with the router's id and count of named aborts, and each half with the count when it was sent
    (an engine aborts a half that it names and that was sent before it)."""
    legs: list[dict] = []
    aborts: list[tuple[str, dict]] = []

    async def go():
        engines = Engines(blocking=())
        loaded = asyncio.Event()

        async def answering(request: httpx.Request) -> httpx.Response | None:
            host, path = request.url.host, request.url.path
            if path == "/update_weights_from_disk":
                await loaded.wait()
                engines.model_paths[host] = json.loads(await request.aread())["model_path"]
                return httpx.Response(200, json={"success": True})
            if path == "/abort_request":
                aborts.append((host, json.loads(await request.aread())))
                return httpx.Response(200, json={"success": True})
            if path == "/v1/completions":
                sent = json.loads(await request.aread())
                legs.append(sent["pd"] | {"host": host, "request_id": sent["request_id"]})
                if host == "de":
                    finish = "abort" if sent["pd"].get("aborted") else "length"
                    answer = {"choices": [{"index": 0, "text": "", "finish_reason": finish}]}
                    return httpx.Response(
                        200, headers={"content-type": "application/json"}, stream=Once(answer)
                    )
                return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}]})
            return None

        engines.intercept = answering
        router = await started_router(engines, "none")
        async with client_of(router) as c:
            updating = asyncio.ensure_future(
                c.post("/update_weights_from_disk", json={"model_path": "/ckpt/b"})
            )
            while router.open.is_set():
                await asyncio.sleep(0.01)
            body = {"prompt": [1, 2, 3], "max_tokens": 4}
            held = {
                rid: asyncio.ensure_future(c.post("/v1/completions", json=body | {"request_id": rid}))
                for rid in ("mine", "yours")
            }
            await asyncio.sleep(0.05)
            assert legs == []  # (held)
            assert (await c.post("/abort_request", json={"rid": "mine"})).status_code == 200
            loaded.set()
            answers = {rid: (await asyncio.wait_for(call, 10)).json() for rid, call in held.items()}
            await asyncio.wait_for(updating, 10)
            before = {leg["router_named"] for leg in legs}
            assert (await c.post("/v1/completions", json=body | {"request_id": "next"})).status_code == 200
        named = {"rid": "mine", "router_id": router.router_id, "router_named": 1}
        assert sorted(aborts, key=lambda a: a[0]) == [("de", named), ("pe", named)]
        assert before == {1} and [leg["router_named"] for leg in legs[-2:]] == [1, 1]
        return answers

    answers = asyncio.run(go())
    assert {rid: a["choices"][0]["finish_reason"] for rid, a in answers.items()} == {
        "mine": "abort",
        "yours": "length",
    }
    assert sorted((leg["request_id"], bool(leg.get("aborted"))) for leg in legs) == [
        ("mine", True),
        ("mine", True),
        ("next", False),
        ("next", False),
        ("yours", False),
        ("yours", False),
    ]


@pytest.mark.parametrize(
    ("path", "body", "abort", "named"),
    [
        ("/v1/completions", {"request_id": "X"}, "X", True),
        ("/v1/completions", {"request_id": "X"}, "cmpl-X", True),  # (the answer's id: the engines' too)
        ("/v1/completions", {"request_id": "base_1"}, "cmpl-base", True),  # (a split request's child)
        ("/v1/completions", {"request_id": "Xy"}, "X", False),
        ("/generate", {"rid": "r_0"}, "r", True),
        ("/generate", {"rid": "r"}, "cmpl-r", False),  # (a /generate answer's id is its rid)
        ("/v1/completions", {}, "X", False),
        # (a chat answer's id, "chatcmpl-X", names the request "cmpl-X" for the engines, request_id_of:
        # a chat held in placement ran to its end when aborted by it, a review)
        ("/v1/chat/completions", {"request_id": "X"}, "chatcmpl-X", True),
        ("/v1/chat/completions", {"request_id": "X_2"}, "chatcmpl-X", True),
        ("/v1/chat/completions", {"request_id": "X"}, "chatcmpl-Y", False),
    ],
)
def test_a_named_abort_matches_a_held_request_as_the_engines_match_what_they_run(path, body, abort, named):
    """The router's match of a held request (`client_name`, `names_match`) is the engines' `_named`:
    an abort of "cmpl-X" (the id the client saw) ended what the engines ran but not the router's held
    copy (a review of this session's changes)."""
    from pdserve.router.app import Arrival, client_name

    router = Router(["http://pe"], ["http://de"])
    held = Arrival(0, router.num_named_aborts, client_name(path, body))
    router.abort_named(abort)
    assert router.named_abort_since(held) is named
    later = Arrival(0, router.num_named_aborts, client_name(path, body))
    assert not router.named_abort_since(later)  # (a request that came after the abort is not its)


@pytest.mark.parametrize("rid", [None, "client-rid"])
def test_a_generate_with_the_clients_rid_is_retried_on_another_decode_after_a_prefill_failure(rid):
    """The last attempt's decode may hold the client's rid for its whole abort lease (its room waits
    for the failed prefill's ack): a retry there was a 409 about the client's own request (a review of
    this session's changes). With a rid the retry takes another decode; without one, any."""
    posts: list[tuple[str, str]] = []

    async def go():
        engines = Engines(blocking=())

        async def answering(request: httpx.Request) -> httpx.Response | None:
            host = request.url.host
            if request.url.path != "/generate":
                return None
            posts.append((host, json.loads(await request.aread())["pd"]["room"]))
            if host == "pe":
                return httpx.Response(500, json={"error": {"message": "died mid-transfer", "code": 500}})
            if host.startswith("de"):
                return decode_answer()
            return prefill_answer()

        engines.intercept = answering
        router = await started_router(
            engines, "none", prefills=("http://pe", "http://pe2"), decodes=("http://de", "http://de2")
        )
        router._rr = iter([0, 0, 0])  # (round robin starts at "pe", the one that fails)
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
        async with client_of(router) as c:
            r = await c.post("/generate", json=body | ({"rid": rid} if rid else {}))
        return r

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    decodes = [host for host, _ in posts if host.startswith("de")]
    assert len(decodes) == 2
    if rid:
        assert decodes[0] != decodes[1], posts


class _AbortedStream(httpx.AsyncByteStream):
    """A decode's SSE stream that sends nothing until `aborted` is set, then its "abort" chunk."""

    def __init__(self, aborted: asyncio.Event) -> None:
        self.aborted = aborted

    async def __aiter__(self):
        await self.aborted.wait()
        yield b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "abort"}]}\n\ndata: [DONE]\n\n'


@pytest.mark.parametrize("abort", [{"rid": "client-rid"}, {"abort_all": True}])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_an_aborted_request_whose_prefill_is_paused_ends_with_the_decodes_abort_at_once(
    path, abort, monkeypatch
):
    """A client aborts a request whose prefill is paused (SIGSTOP, a long stall): the decode ends its
    half and answers "abort", the prefill answers nothing. The router waited for the prefill up to its
    timeout (3 x its deadline + 5 s), then counted a prefill failure: the client got its abort late, or
    a 503 (the end-to-end review's F4). An abort that names a request while its prefill has not
    answered ends that wait: the client gets the decode's answer at once. The prefill's leg is left
    to answer for ABORT_TIMEOUT_S, then closed (a live prefill whose leg closes fails the room, which
    the decode could hear before the client's abort); a /generate's half there is also ended by its
    room in the background, as after any failed attempt that may hold the client's rid."""
    from pdserve.router import legs

    monkeypatch.setattr(legs, "ABORT_TIMEOUT_S", 0.3)
    calls: list[tuple[str, str, int | None]] = []

    async def go():
        engines = Engines(blocking=())
        decode_aborted = asyncio.Event()
        prefill_closed = asyncio.Event()

        async def engine(request: httpx.Request):
            host = request.url.host
            if request.url.path == "/v1/completions":
                calls.append((host, request.url.path, json.loads(await request.aread())["pd"]["room"]))
            elif (seen := await generate_or_abort(request)) is not None:
                calls.append(seen)
            else:
                return None
            if request.url.path == "/abort_request":
                if host == "pe":
                    raise httpx.ReadTimeout("paused")  # (as after ABORT_TIMEOUT_S)
                decode_aborted.set()
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 1})
            if host == "pe":  # paused: no answer, until the router closes the connection
                try:
                    await asyncio.Event().wait()
                finally:
                    prefill_closed.set()
            if path == "/v1/completions":
                return httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, stream=_AbortedStream(decode_aborted)
                )
            await decode_aborted.wait()
            return decode_answer("abort", [], "")

        engines.intercept = engine
        router = await started_router(engines, "none")
        router.prefills[0].deadline_s = 30.0  # (the prefill's answer would be waited for 95 s)
        if path == "/generate":
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "client-rid"}
        else:
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True, "request_id": "client-rid"}
        async with client_of(router) as c:
            request = asyncio.ensure_future(c.post(path, json=body))
            for _ in range(100):  # (both halves sent)
                if len(calls) == 2:
                    break
                await asyncio.sleep(0.01)
            aborted = await c.post("/abort_request", json=abort)
            answer = await within(request, 5.0)
            open_at_answer = not prefill_closed.is_set()
            closed = await within(prefill_closed.wait(), 2.0)
        return aborted, answer, open_at_answer, closed, router

    aborted, answer, open_at_answer, closed, router = asyncio.run(go())
    assert aborted.status_code == 200 and aborted.json()["unreachable"] == ["http://pe"], aborted.text
    assert answer is not None, "the client waited for the paused prefill"
    assert answer.status_code == 200, answer.text
    if path == "/generate":
        assert answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
    else:
        assert '"finish_reason": "abort"' in answer.text and answer.text.endswith("data: [DONE]\n\n")
    assert open_at_answer and closed is not None, (open_at_answer, closed)
    room = calls[0][2]
    sent = sorted(calls[:2])
    assert sent == sorted([("pe", path, room), ("de", path, room)])
    by_room = [c for c in calls[2:] if c[2] is not None]  # (the aborts the client asked for carry none)
    assert by_room == ([("pe", "/abort_request", room)] if path == "/generate" else [])
    assert router.decodes[0].in_flight == 0 and router.num_in_flight() == 0


def test_a_request_aborted_in_placement_does_not_wait_for_a_paused_prefills_answer(monkeypatch):
    """The same for a request an abort ends while it waits in DualPath placement: it is sent to its
    engines marked aborted, each answers "abort" at once with nothing computed, but a paused prefill
    answers nothing, and the client waited for it up to its timeout. The decode's answer is the
    client's; the prefill's leg is closed ABORT_TIMEOUT_S later."""
    from pdserve.router import legs

    monkeypatch.setattr(legs, "ABORT_TIMEOUT_S", 0.3)
    sent: list[tuple[str, bool]] = []

    async def go():
        engines = Engines(blocking=())
        prefill_closed = asyncio.Event()

        async def engine(request: httpx.Request):
            if request.url.path == "/abort_request":
                if request.url.host == "pe":
                    raise httpx.ReadTimeout("paused")  # (as after ABORT_TIMEOUT_S)
                return httpx.Response(200, json={"success": True, "num_requests_aborted": 0})
            if request.url.path != "/generate":
                return None
            sent.append((request.url.host, json.loads(await request.aread())["pd"].get("aborted", False)))
            if request.url.host == "pe":
                try:
                    await asyncio.Event().wait()
                finally:
                    prefill_closed.set()
            return decode_answer("abort", [], "")

        engines.intercept = engine
        router = await started_router(engines, "dualpath")
        router.prefills[0].deadline_s = 30.0
        router.placement.on_load(router.decodes[0], report("de", "decode", num_free_pages=0))
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "rid": "client-rid"}
        async with client_of(router) as c:
            request = asyncio.ensure_future(c.post("/generate", json=body))
            await queued(router)
            aborted = await c.post("/abort_request", json={"rid": "client-rid"})
            answer = await within(request, 5.0)
            closed = await within(prefill_closed.wait(), 2.0)
        return aborted, answer, closed, router

    aborted, answer, closed, router = asyncio.run(go())
    assert aborted.status_code == 200, aborted.text
    assert answer is not None, "the client waited for the paused prefill"
    assert answer.status_code == 200 and answer.json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert sorted(sent) == [("de", True), ("pe", True)] and closed is not None
    assert router.decodes[0].in_flight == 0 and router.num_in_flight() == 0


def test_an_aborted_wait_cancelled_in_the_same_step_still_ends_its_prefills_call(monkeypatch):
    """The abort ends the wait for a paused prefill's answer while the request's handler is cancelled
    (its client left, a merged request's sibling failed, the server stops) in the same event-loop step:
    the cancel's cleanup drops the wait's exception, and the prefill's call, handed over with it, was
    left open until the prefill's timeout (a review). The wait hands the call to the background
    itself: it is closed ABORT_TIMEOUT_S later, whatever happens to the exception."""
    from pdserve.router import legs
    from pdserve.router.app import RouterStopping
    from pdserve.router.engines import unless_set

    monkeypatch.setattr(legs, "ABORT_TIMEOUT_S", 0.1)
    out: dict = {}

    async def go():
        closed = asyncio.Event()
        background: set[asyncio.Task] = set()

        async def paused_prefill():
            try:
                await asyncio.Event().wait()
            finally:
                closed.set()

        decode = asyncio.get_running_loop().create_future()
        decode.set_result(httpx.Response(200))  # (a stream's headers: the decode answered)
        aborted = asyncio.Event()
        wait = legs.prefill_unless_decode_fails(
            paused_prefill(), decode, aborted, lambda call: background.add(asyncio.ensure_future(call))
        )
        handler = asyncio.ensure_future(unless_set(asyncio.Event(), wait, RouterStopping))
        for _ in range(5):
            await asyncio.sleep(0)
        aborted.set()
        for _ in range(3):  # (the wait raises; its handler has not resumed yet)
            await asyncio.sleep(0)
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handler
        out["closed"] = await within(closed.wait(), 2.0) is not None
        await asyncio.gather(*background)
        out["pending"] = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    asyncio.run(go())
    assert out == {"closed": True, "pending": []}, out


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_the_choices_of_a_stored_prompt_read_it_once_on_the_prefills_side(path):
    """DualPath placement, the prefill node's storage NIC a little busier (300 tokens queued): one
    request of a stored prompt (192 hit tokens) reads it on the decode's side, the shorter queue. Its
    n = 3 choices went there too, each to a decode of its own, and each decode read the whole hit from
    its own store: three reads of one prompt over the storage NICs, the resource DualPath balances.
    Sent to one prefill on the PE path, their reads of the same blocks join there: one read (300 + 192
    tokens queued there against 3 x 192 on the decode side). So the first choice is placed with
    `num_choices` = 3 and all three go with the PE path, counted once in the placement's read queues."""
    legs: list[tuple[str, str]] = []

    async def go():
        engines = Engines(blocking=())

        async def answers(request: httpx.Request) -> httpx.Response | None:
            if request.method != "POST" or request.url.path != path:
                return None
            sent = json.loads(await request.aread())
            legs.append((request.url.host, sent["pd"]["read_path"]))
            if request.url.host == "pe":
                return prefill_answer() if path == "/generate" else httpx.Response(200, json={"choices": []})
            if path == "/generate":
                return decode_answer()
            answer = {"choices": [{"index": 0, "text": "y", "finish_reason": "length"}]}
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=Once(answer))

        engines.intercept = answers
        router = await started_router(engines, "dualpath", decodes=("http://de", "http://de2"))
        placement = router.placement
        stored = list(range(1, 257))  # (four 64-token blocks, recorded by the first request)
        if path == "/generate":
            body = {"input_ids": stored, "sampling_params": {"max_new_tokens": 2}}
        else:
            body = {"prompt": stored, "max_tokens": 2}
        async with client_of(router) as c:
            assert (await c.post(path, json=body)).status_code == 200
            placement.on_load(router.prefills[0], report("pe", "prefill", node_read_queue_bytes=300 * BPT))
            legs.clear()
            one = await c.post(path, json=body)
            single = list(legs)
            legs.clear()
            queued_before = dict(placement.snapshot()["read_queue_tokens"])
            if path == "/generate":
                several = body | {"sampling_params": {"max_new_tokens": 2, "n": 3}}
            else:
                several = body | {"n": 3}
            three = await c.post(path, json=several)
            queued_after = placement.snapshot()["read_queue_tokens"]
        return one, single, three, list(legs), queued_before, queued_after

    one, single, three, legs_of_three, before, after = asyncio.run(go())
    assert one.status_code == 200 and three.status_code == 200, (one.text, three.text)
    assert {read_path for _, read_path in single} == {"de"} and len(single) == 2, single  # (one choice)
    hosts = sorted(host for host, _ in legs_of_three)
    assert hosts[3:] == ["pe"] * 3 and hosts[:3] in (["de", "de", "de2"], ["de", "de2", "de2"]), hosts
    assert {read_path for _, read_path in legs_of_three} == {"pe"}, legs_of_three
    # (three whole blocks, read once: the prompt's last token is computed, never a hit)
    assert after["pe"] - before["pe"] == 192 and after["de"] == before["de"] and after["de2"] == before["de2"]


@pytest.mark.parametrize("policy", ["none", "dualpath"])
def test_a_request_without_max_tokens_is_placed_by_what_the_engines_would_do(policy):
    """No max_tokens: the engines' default (16 for a completion), lowered to the room the prompt leaves.
    Placement took 256 for it, and refused a prompt that fits with the engines' default as "prompt +
    max_tokens = 16156 tokens" -- a max_tokens the client never sent; `none` passed it (a review,
    2026-12-04). Now only a prompt that does not fit is refused. And a request that fills a decode's
    pool exactly (prompt + max_tokens - 1 slots, as the engines count) waited to the queue timeout:
    the scheduler counted one slot more."""

    async def post(body: dict) -> httpx.Response:  # (a router each: no load report frees pages here)
        engines = Engines(blocking=())
        router = await started_router(engines, policy)  # decodes: 1,000 pages of 16 tokens
        if router.placement is not None:
            router.placement.queue_timeout_s = 5.0
        async with client_of(router) as c:
            return await c.post("/v1/completions", json=body)

    fits = asyncio.run(post({"prompt": list(range(1, 15_901))}))
    exact = asyncio.run(post({"prompt": list(range(1, 15_986)), "max_tokens": 16}))  # 16,000 slots
    too_long = asyncio.run(post({"prompt": list(range(1, 16_002))}))
    assert fits.status_code == 200, fits.text
    assert exact.status_code == 200, exact.text
    if policy == "dualpath":  # (`none` leaves it to the engine, which the fake one is not)
        assert too_long.status_code == 400 and "prompt = 16001 tokens needs 1001 KV pages" in too_long.text


@pytest.mark.parametrize("policy", ["none", "dualpath"])
def test_generate_scoring_passes_the_router_under_every_policy(policy):
    async def go():
        engines = Engines(blocking=())
        router = await started_router(engines, policy)
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        async with client_of(router) as c:
            return await c.post("/generate", json=body)

    r = asyncio.run(go())
    assert r.status_code == 200, r.text


def test_a_malformed_health_answer_is_a_missed_check_not_the_end_of_the_health_loop():
    """`deadline_s` a list: a TypeError, which the check did not catch; it ended the health loop's task
    (nobody awaits it), so no engine was ever marked down or back up again (a review, 2026-12-04). The
    engine that answers so misses its checks and goes out of service; the loop goes on."""

    async def go():
        bad = {"on": False}

        async def handle(request: httpx.Request) -> httpx.Response:
            role = "prefill" if request.url.host == "pe" else "decode"
            info = {"role": role, "model": "m", "bootstrap_url": "http://pe:1", "status": "ok"}
            if bad["on"] and role == "decode":
                info["deadline_s"] = [8]
            return httpx.Response(200, json=info)

        router = Router(["http://pe"], ["http://de"], health_interval_s=0.01)
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        loop_task = asyncio.ensure_future(router.health_loop())
        await asyncio.sleep(0.1)
        healthy_before = router.decodes[0].healthy
        bad["on"] = True
        await asyncio.sleep(0.2)
        healthy_bad = router.decodes[0].healthy
        bad["on"] = False
        await asyncio.sleep(0.2)
        alive = not loop_task.done()
        loop_task.cancel()
        return healthy_before, healthy_bad, router.decodes[0].healthy, alive

    healthy_before, healthy_bad, healthy_after, alive = asyncio.run(go())
    assert alive and healthy_before and not healthy_bad and healthy_after
