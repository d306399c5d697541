"""`start_cluster` survives a port taken between picking it and binding it (the free-port race)."""

from __future__ import annotations

import socket

import httpx
import pytest

import pdserve.launch as launch


@pytest.mark.parametrize("which", ["http", "bootstrap"])
def test_engine_port_taken_after_it_was_picked_gets_a_new_one(demo_model_dir, monkeypatch, which):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real_free_port = launch.free_port
    calls = []

    victim = 1 if which == "http" else 2  # prefill0 asks for its HTTP port, then its bootstrap port

    def racy_free_port() -> int:
        # That port is grabbed by someone else before the engine binds it: what free_port() cannot
        # rule out.
        calls.append(1)
        return taken if len(calls) == victim else real_free_port()

    monkeypatch.setattr(launch, "free_port", racy_free_port)
    args = launch.cluster_args(demo_model_dir, num_pages=64, max_model_len=256, served_model_name="demo")
    cluster = launch.start_cluster(args, 1, 1)
    try:
        url = cluster.url("prefill0")
        args = cluster.commands["prefill0"][0]
        ports = {int(args[args.index(flag) + 1]) for flag in ("--port", "--bootstrap-port")}
        assert taken not in ports  # it was started again on fresh ports
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert cluster.proc("prefill0").poll() is None and not cluster.dead()
        body = {"model": "demo", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        r = httpx.post(cluster.router_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop()
        squatter.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--role", "prefill", "--snic-mbps", "100"], "need --node-dir"),
        (["--role", "decode", "--kv-store", "STORE", "--kv-block-size", "24"], "multiple of --page-size"),
        (["--role", "prefill", "--pd-deadline-s", "10", "--pd-abort-lease-s", "5"], "below the safe minimum"),
        (["--role", "colocated", "--max-model-len", "100000"], "exceeds the model's 4096 positions"),
    ],
)
def test_serve_refuses_flags_that_cannot_work_before_loading_the_model(
    demo_model_dir, tmp_path, capsys, monkeypatch, flags, message
):
    """Each used to be accepted and ignored (the NIC budgets without emulated nodes), or to fail with a
    traceback after the model was loaded (a block size the pages cannot tile), or to serve positions the
    model was never trained for."""
    from pdserve.cli import main

    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "test-secret-0123456789")
    flags = [str(tmp_path / "store") if f == "STORE" else f for f in flags]
    assert main(["serve", "--model", demo_model_dir, "--port", "0", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(snic_mbps=100.0), "--nodes"),
        (dict(pd_deadline_s=10.0, pd_abort_lease_s=5.0), "below the safe minimum"),
        (dict(kv_store="STORE", kv_block_size=24), "multiple of --page-size"),
        (dict(max_model_len=100000), "exceeds the model's 4096 positions"),
        (dict(pd_abort_lease_s=None), "invalid engine flags"),  # argparse's own refusal, not an exit
        (dict(pd_peer_idle_s=float("inf")), "--pd-peer-idle-s: inf must be"),
    ],
)
def test_launch_refuses_what_its_engines_would_before_starting_any(
    demo_model_dir, tmp_path, capsys, flags, message
):
    """Each engine used to print the reason and exit 2, and launch then raised a RuntimeError."""
    flags = {k: str(tmp_path / "store") if v == "STORE" else v for k, v in flags.items()}
    args = launch.cluster_args(demo_model_dir, **flags)
    args.prefill, args.decode, args.port = 1, 1, 0
    assert launch.launch(args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_ctrl_c_of_launch_ends_the_requests_in_flight_as_aborts(demo_model_dir, tmp_path):
    """Ctrl-C in a terminal signals launch and every child. The engines end what still runs as
    "abort" a second before their grace ends, but behind the router they never got to: an engine's
    port closes as its shutdown starts, two refused health checks declared it down, and the router cut
    its requests with a 503 the OpenAI client retries (a review of this session's changes). A refused
    port now takes an engine out of service without cutting what it still runs."""
    import os
    import signal
    import subprocess
    import sys

    from pdserve.demo import free_port, wait_healthy
    from tests.test_serve_cli import stop_with_requests_in_flight

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve.cli", "launch", "--model", demo_model_dir, "--device", "cpu"]
    cmd += ["--dtype", "float32", "--num-pages", "512", "--max-model-len", "4096", "--port", str(port)]
    with open(tmp_path / "launch.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, timeout_s=180)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        # (a terminal's Ctrl-C: launch and every child)
        stop_with_requests_in_flight(url, lambda: os.killpg(proc.pid, signal.SIGINT), model)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(300)
def test_ctrl_c_of_the_router_alone_ends_what_it_relays_with_a_503_and_the_engines_abort_it(demo_model_dir):
    """The router's own Ctrl-C (its engines run on, serving other routers): what it still relayed past
    uvicorn's grace was cancelled, a whole answer as a plain-text 500 (which the OpenAI client
    retries) and a stream cut without [DONE]. It now ends each with a 503 naming the shutdown (the
    stream with an error event and [DONE]) and closes its decode legs, so the engines abort them."""
    import json
    import signal

    from pdserve.router.app import STOPPING
    from tests.test_pd_e2e import wait_engine_idle
    from tests.test_serve_cli import requests_in_flight

    args = launch.cluster_args(demo_model_dir, num_pages=512, max_model_len=4096, served_model_name="demo")
    cluster = launch.start_cluster(args, 1, 1)
    try:
        router = cluster.proc("router")
        answers = requests_in_flight(cluster.router_url, lambda: router.send_signal(signal.SIGINT), "demo")
        assert answers["whole"].status_code == 503, answers["whole"].text[:300]
        assert STOPPING in answers["whole"].json()["error"]["message"]
        lines = answers["lines"]
        assert len(lines) > 3 and lines[-1] == "data: [DONE]", lines[-3:]
        assert STOPPING in json.loads(lines[-2][6:])["error"]["message"], lines[-2][:300]
        assert router.wait(timeout=30) in (0, -signal.SIGINT)
        for engine_url in (cluster.url("prefill0"), cluster.url("decode0")):
            wait_engine_idle(engine_url)  # (both requests aborted there; the engines serve on)
    finally:
        cluster.stop()


def test_launch_passes_the_pd_peer_idle_time_to_its_engines(demo_model_dir):
    """`--pd-peer-idle-s` reaches each engine's PDConfig through the flags launch starts it with."""
    from pdserve.cli import _pd_config, build_parser

    args = launch.cluster_args(demo_model_dir, pd_peer_idle_s=30.0)
    assert launch.cluster_args(demo_model_dir).pd_peer_idle_s == 600.0  # (the default)
    engine = build_parser().parse_args(["serve", "--model", "m", "--role", "decode", *launch.pd_flags(args)])
    assert _pd_config(engine, b"test-secret-0123456789").peer_idle_s == 30.0
