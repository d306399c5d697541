"""PD under failure: killed peers, forged control messages, duplicate rooms, client disconnects.

Each test that kills or freezes an engine starts its own small cluster (real processes, loopback,
NIXL); the others share one 1P+1D cluster (`shared`), each leaving it idle. All have short deadlines
(8 s) and the shortest abort lease the engines accept for them (25 s: the prefill's three deadlines +
1 s), and end by checking that every surviving engine is idle with zero pages and zero rooms held and
still passes its integrity checks.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
import zmq

from pdserve.disagg import messages
from pdserve.disagg.control import curve_client
from pdserve.transfer.nixl_backend import nixl_available
from tests.chaos_helpers import fired, set_faults, wait_until
from tests.test_pd_e2e import cluster_args, metrics, wait_engine_idle

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"),
]

SECRET = "test-secret-0123456789"
DEADLINE_S = 8.0
LEASE_S = 3 * DEADLINE_S + 1.0  # >= state.min_lease_s (PDConfig refuses less)
# ~810 tokens; with a 16-token step budget the prefill takes ~50 steps: a wide "mid-transfer" window.
LONG_PROMPT = "def handler(request, context):\n    result = process(request.body, context.user)\n" * 30


def start(model_dir: str, num_prefill: int, num_decode: int):
    os.environ.setdefault("UCX_MODULES", "^ib*")
    from pdserve.launch import start_cluster

    kw = {
        "max_num_batched_tokens": 16,
        "enable_fault_injection": True,
        "pd_deadline_s": DEADLINE_S,
        "pd_abort_lease_s": LEASE_S,
    }
    return start_cluster(cluster_args(model_dir, **kw), num_prefill, num_decode, secret=SECRET)


@pytest.fixture
def make_cluster(demo_model_dir):
    started = []

    def make(num_prefill: int, num_decode: int):
        started.append(start(demo_model_dir, num_prefill, num_decode))
        return started[-1]

    yield make
    for c in started:
        c.stop()


@pytest.fixture(scope="module")
def shared(demo_model_dir):
    """One 1P+1D cluster for the tests that leave every engine alive (and idle)."""
    c = start(demo_model_dir, 1, 1)
    yield c
    c.stop()


def body(**kw) -> dict:
    return {
        "model": "demo",
        "prompt": LONG_PROMPT,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
    } | kw


def post_in_background(url: str, payload: dict) -> dict:
    """Run a completion in a thread; the dict gets 'status'/'text' or 'error', and 'elapsed_s'."""
    out: dict = {}

    def run():
        t = time.monotonic()
        try:
            r = httpx.post(url + "/v1/completions", json=payload, timeout=120)
            out["status"], out["text"] = r.status_code, r.text
        except httpx.HTTPError as e:
            out["error"] = repr(e)
        out["elapsed_s"] = time.monotonic() - t

    th = threading.Thread(target=run, daemon=True)
    th.start()
    out["thread"] = th
    return out


def busy(url: str) -> bool:
    return metrics(url)["pdserve_pd_rooms_held"] > 0


def hold_mid_transfer(prefill_url: str) -> None:
    """The prefill's first page write goes over the wire; every later one stalls (never completes), so
    the room stays mid-transfer until the test kills a peer. Without it the kill races the transfer
    (~0.5 s on a quiet machine) and a loaded machine can finish the request first."""
    set_faults(prefill_url, [{"point": "transfer.submit", "action": "stall", "skip": 1}])


def wait_mid_transfer(prefill_url: str) -> None:
    """Until a page write went out and a later one stalled: the room is mid-transfer, and stays so."""
    wait_until(lambda: metrics(prefill_url)["pdserve_pd_pages_sent_total"] > 0, 30, "pages on the wire")
    wait_until(lambda: fired(prefill_url)[0] > 0, 30, "a later page write to stall")  # after the skip


def test_kill_decode_mid_transfer_frees_prefill_and_keeps_serving(make_cluster):
    c = make_cluster(1, 2)
    pe = c.urls["prefill"][0]
    hold_mid_transfer(pe)
    res = post_in_background(c.router_url, body())
    wait_mid_transfer(pe)
    victim = next(i for i, u in enumerate(c.urls["decode"]) if busy(u))
    c.proc(f"decode{victim}").send_signal(signal.SIGKILL)
    set_faults(pe, [])  # writes stalled so far stay stalled
    res["thread"].join(60)
    assert not res["thread"].is_alive(), "the client hung"
    # A non-streamed request has no answer out yet when its decode dies: the router closes the
    # prefill's leg (its room is aborted) and tries again with the other decode at once (it used to
    # wait for the prefill's deadline, then answer an error).
    assert res.get("status") == 200 and '"error"' not in res["text"], res
    assert httpx.get(c.router_url + "/health").json()["num_retries"] >= 1
    # The prefill frees every page of the first room (its writes aborted) and of the second.
    m = wait_engine_idle(pe, timeout_s=25)
    assert m["pdserve_kv_pages_used"] == 0
    # ... and keeps serving through the surviving decode once the router saw the death.
    survivor = c.urls["decode"][1 - victim]
    wait_until(
        lambda: (
            not httpx.get(c.router_url + "/health").json()["engines"][c.urls["decode"][victim]]["healthy"]
        ),
        10,
        "the router to mark the dead decode",
    )
    r = httpx.post(c.router_url + "/v1/completions", json=body(max_tokens=8, prompt="x = 1"), timeout=60)
    assert r.status_code == 200, r.text
    wait_engine_idle(pe)
    wait_engine_idle(survivor)


def test_kill_decode_after_its_prefill_answered_retries_a_generate_under_the_clients_rid(make_cluster):
    """The prefill computes on while its writes stall and answers its token 1; then the decode dies.
    The router used to wait on that decode alone: a broken leg was the client's 502 (seen once under
    load in the test above). Nothing has reached the client yet, so it is one more attempt, on the
    other decode; with the client's rid on `/generate` the prefill holds that id until the dead
    room's writes end, so the router first ends that half by its room, and the retry runs there."""
    c = make_cluster(1, 2)
    pe = c.urls["prefill"][0]
    hold_mid_transfer(pe)
    out: dict = {}
    payload = {
        "text": LONG_PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "rid": "client-rid-7",
    }

    def run():
        r = httpx.post(c.router_url + "/generate", json=payload, timeout=120)
        out["status"], out["text"] = r.status_code, r.text

    th = threading.Thread(target=run, daemon=True)
    th.start()
    wait_mid_transfer(pe)
    wait_until(lambda: metrics(pe)["pdserve_generation_tokens_total"] >= 1, 60, "the prefill's token 1")
    victim = next(i for i, u in enumerate(c.urls["decode"]) if busy(u))
    c.proc(f"decode{victim}").send_signal(signal.SIGKILL)
    set_faults(pe, [])  # (the retry's writes go; the first room's stay stalled until it is ended)
    th.join(90)
    assert not th.is_alive(), "the client hung"
    assert out.get("status") == 200, out
    answer = json.loads(out["text"])
    assert answer["meta_info"]["id"] == "client-rid-7" and len(answer["output_ids"]) == 8, answer
    health = httpx.get(c.router_url + "/health").json()
    assert health["num_retries"] >= 1
    failures = {k: v for k, v in metrics(pe).items() if k.startswith("pdserve_pd_failures_total")}
    assert failures.get('pdserve_pd_failures_total{reason="aborted by its router"}') == 1, failures
    m = wait_engine_idle(pe, timeout_s=25)
    assert m["pdserve_kv_pages_used"] == 0 and m["pdserve_pd_rooms_held"] == 0
    wait_engine_idle(c.urls["decode"][1 - victim])


def test_an_abort_while_the_prefill_is_paused_ends_the_request_at_once_and_frees_everything(make_cluster):
    """A client aborts a request (SGLang's /abort_request by rid) while its prefill is paused mid-
    transfer. The decode ends its half and answers "abort"; the router used to wait for the paused
    prefill's answer up to its timeout (3 x 8 s + 5 s here), then count a prefill failure (the
    end-to-end review's F4). The client gets its abort at once; once the prefill runs again both
    engines end the room and hold nothing."""
    c = make_cluster(1, 1)
    pe, de = c.urls["prefill"][0], c.urls["decode"][0]
    hold_mid_transfer(pe)
    payload = {
        "text": LONG_PROMPT,
        "sampling_params": {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True},
        "rid": "paused-rid",
    }
    out: dict = {}

    def run():
        r = httpx.post(c.router_url + "/generate", json=payload, timeout=120)
        out["status"], out["text"], out["done_at"] = r.status_code, r.text, time.monotonic()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    wait_mid_transfer(pe)
    prefill = c.proc("prefill0")
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        aborted_at = time.monotonic()
        aborted = httpx.post(c.router_url + "/abort_request", json={"rid": "paused-rid"}, timeout=30)
        th.join(20)
        assert not th.is_alive(), "the client waited for the paused prefill"
    finally:
        os.kill(prefill.pid, signal.SIGCONT)
    assert aborted.status_code == 200, aborted.text
    assert out["status"] == 200, out
    assert json.loads(out["text"])["meta_info"]["finish_reason"]["type"] == "abort", out
    assert out["done_at"] - aborted_at < 10, out["done_at"] - aborted_at  # (the prefill's timeout: 29 s)
    set_faults(pe, [])
    for url in (pe, de):
        m = wait_engine_idle(url, timeout_s=LEASE_S + 20)
        assert m["pdserve_kv_pages_used"] == 0 and m["pdserve_pd_rooms_held"] == 0


def test_kill_prefill_mid_transfer_errors_client_and_frees_decode(make_cluster):
    c = make_cluster(1, 1)
    de = c.urls["decode"][0]
    hold_mid_transfer(c.urls["prefill"][0])
    res = post_in_background(c.router_url, body())
    wait_mid_transfer(c.urls["prefill"][0])
    c.proc("prefill0").send_signal(signal.SIGKILL)
    res["thread"].join(60)
    assert not res["thread"].is_alive(), "the client hung"
    assert "error" in res or res["status"] != 200 or '"error"' in res["text"], res
    assert res["elapsed_s"] < 40
    # The decode fails the room (deadline or lost peer), waits out the abort lease, frees everything.
    m = wait_engine_idle(de, timeout_s=LEASE_S + 20)
    assert m["pdserve_kv_pages_used"] == 0 and m["pdserve_pd_rooms_held"] == 0


def test_prefill_failure_before_kv_is_retried_on_another_prefill(make_cluster):
    c = make_cluster(2, 1)
    c.proc("prefill0").send_signal(signal.SIGKILL)  # the router has not noticed yet
    payloads = [body(prompt=f"import mod{i}", max_tokens=6) for i in range(4)]
    results = [httpx.post(c.router_url + "/v1/completions", json=p, timeout=60) for p in payloads]
    assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
    assert httpx.get(c.router_url + "/health").json()["num_retries"] >= 1
    wait_engine_idle(c.urls["decode"][0])
    wait_engine_idle(c.urls["prefill"][1])


def test_forged_malformed_and_wrong_version_messages_are_dropped(shared):
    c = shared
    pe = c.urls["prefill"][0]
    addr = httpx.get(pe + "/pd/info").json()["control_addr"]
    before = metrics(pe)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    curve_client(sock, SECRET.encode())  # past the transport's handshake (without: nothing connects)
    sock.connect(addr)
    abort = messages.Abort(reason="evil")
    sock.send_multipart(messages.encode(abort, 12345, "mallory", b"wrong-secret"))  # forged
    sock.send_multipart([b"\x00garbage"])  # malformed
    header = messages._encoder.encode(messages._Header(99, "abort", 12345, "mallory"))
    sock.send_multipart(messages.seal([header, messages._encoder.encode(abort)], SECRET.encode()))  # version
    sock.close()

    def counted():
        m = metrics(pe)
        return all(
            m[f'pdserve_pd_control_dropped_total{{why="{w}"}}']
            > before[f'pdserve_pd_control_dropped_total{{why="{w}"}}']
            for w in ("forged", "malformed", "wrong_version")
        )

    wait_until(counted, 10, "the drops to be counted")
    m = metrics(pe)
    assert m["pdserve_pd_rooms_held"] == before["pdserve_pd_rooms_held"] == 0
    r = httpx.post(c.router_url + "/v1/completions", json=body(max_tokens=4, prompt="ok"), timeout=60)
    assert r.status_code == 200
    wait_engine_idle(pe)


def test_duplicate_room_is_rejected(shared):
    pe = shared.urls["prefill"][0]
    payload = body(max_tokens=4, prompt="dup", pd={"room": 777})
    first = post_in_background(pe, payload)  # waits for a KVRequest that never comes
    wait_until(lambda: busy(pe), 10, "the first room")
    r = httpx.post(pe + "/v1/completions", json=payload, timeout=30)
    assert r.status_code == 400 and "already active" in r.json()["error"]["message"]
    first["thread"].join(30)
    assert first["status"] == 503  # its Bootstrapping deadline (8 s) expired
    wait_engine_idle(pe)


def test_client_disconnect_mid_stream_frees_both_sides(shared):
    c = shared
    before = metrics(c.urls["decode"][0])["pdserve_generation_tokens_total"]
    with httpx.Client(timeout=60) as client:
        with client.stream(
            "POST",
            c.router_url + "/v1/completions",
            json=body(prompt="stream me", max_tokens=400, stream=True),
        ) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert "error" not in json.loads(line[6:])
                    n += 1
                if n >= 3:
                    break
    for url in c.urls["prefill"] + c.urls["decode"]:
        wait_engine_idle(url, timeout_s=15)
    assert metrics(c.urls["decode"][0])["pdserve_generation_tokens_total"] - before < 400


def test_frozen_decode_errors_its_clients_and_frees_everything_after_resume(shared):
    """SIGSTOP a decode mid-stream: once health checks declare it down (2 missed checks) the router
    ends the stream with an in-band 503 and refuses new requests (503) instead of holding clients
    forever; after SIGCONT it is routed to again, and the aborted request's pages are freed."""
    c = shared  # (last of its tests: it leaves the decode resumed, routed to again and idle)
    decode = c.proc("decode0")
    t0 = time.monotonic()
    errors = []
    with httpx.stream(
        "POST",
        c.router_url + "/v1/completions",
        json=body(prompt="freeze", max_tokens=400, stream=True),
        timeout=60,
    ) as r:
        for n, line in enumerate(r.iter_lines()):
            if n == 3:
                os.kill(decode.pid, signal.SIGSTOP)
                stopped = time.monotonic()
            if line.startswith("data: {") and "error" in json.loads(line[6:]):
                errors.append((json.loads(line[6:])["error"]["code"], time.monotonic() - stopped))
                break
    try:
        assert errors and errors[0][0] == 503 and errors[0][1] < 15, errors
        r = httpx.post(c.router_url + "/v1/completions", json=body(max_tokens=4), timeout=30)
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
    finally:
        os.kill(decode.pid, signal.SIGCONT)
    wait_until(lambda: httpx.get(c.router_url + "/health").status_code == 200, 15, "decode back")
    assert (
        httpx.post(c.router_url + "/v1/completions", json=body(max_tokens=4), timeout=30).status_code == 200
    )
    for url in c.urls["prefill"] + c.urls["decode"]:
        wait_engine_idle(url, timeout_s=15)
    assert time.monotonic() - t0 < 60
