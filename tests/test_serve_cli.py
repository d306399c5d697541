"""`pdserve serve` as a new user meets it (a README walk-through, 2026-12-02, fourth session; each test
failed before its fix): a taken port is an error before anything loads, a max_model_len past the KV
pool is warned about, Ctrl-C ends a server with a stream in flight. Real `pdserve serve` processes
on 127.0.0.1 (tests/conftest.py's `serve_cmd` / `serve_subprocess`), the demo checkpoint."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import httpx

from tests.conftest import serve_cmd, serve_subprocess, wait_until
from tests.test_engine_status import num_requests_on


def test_serve_on_a_taken_port_does_not_announce_it_is_serving(demo_model_dir):
    """With its port taken, `pdserve serve` loaded the model, printed its ready line `pdserve
    colocated: ...; http://127.0.0.1:P`, and only then failed on uvicorn's bind (exit 3): a user (or a
    script waiting for the banner) read that the server was up. `pdserve launch` checks its port
    first ("error: router port 8000 is in use")."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        r = subprocess.run(serve_cmd(demo_model_dir, port), capture_output=True, text=True, timeout=180)
    finally:
        holder.close()
    out = r.stdout + r.stderr
    assert r.returncode == 3 and "cannot listen" in r.stderr, out  # (3: `pdserve launch` retries it)
    assert f"http://127.0.0.1:{port}" not in r.stdout, (
        f"the ready banner was printed although the port was taken:\n{out}"
    )


def test_explicit_max_model_len_past_the_kv_pool_is_warned(demo_model_dir, tmp_path):
    """`pdserve serve --num-pages 2 --max-model-len 4096` (a 32-token KV pool; a tiny
    `--kv-cache-gib` does the same) started silently and `/v1/models` advertised max_model_len 4096;
    every request past 32 tokens was then a 400 "request needs more KV pages than this engine has in
    total". (The *default* max_model_len is capped to the pool.) vLLM refuses to start here; we
    warn at start."""
    flags = ("--num-pages", "2", "--max-model-len", "4096")
    with serve_subprocess(demo_model_dir, tmp_path, *flags) as (url, _, log_path):
        text = log_path.read_text()
        advertised = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    warned = "warning" in text.lower() and ("kv" in text.lower() or "page" in text.lower())
    assert advertised <= 2 * 16 or warned, (
        f"serving with a 32-token KV pool, /v1/models says max_model_len={advertised}, no warning:\n{text}"
    )


def test_ctrl_c_stops_a_colocated_server_with_a_stream_in_flight(demo_model_dir, tmp_path):
    """Ctrl-C (SIGINT) on `pdserve serve` while a long stream was in flight: the process went on until
    the stream had produced all its tokens (uvicorn without `timeout_graceful_shutdown`; at the
    default --log-level warning its "Waiting for connections to close" is hidden, so the terminal
    showed nothing): ~20 s for 4,000 demo tokens, minutes for a real model's long answer. `pdserve
    launch` stops the same in-flight stream within ~4 s."""
    with serve_subprocess(demo_model_dir, tmp_path) as (url, proc, _):
        body = {"prompt": "a", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url + "/v1/completions", json=body) as resp,
        ):
            for line in resp.iter_lines():  # the first token is out: the request is in flight
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    break
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=12)
            except subprocess.TimeoutExpired:
                pass
            waited = time.monotonic() - t0
            alive = proc.poll() is None
        assert not alive, f"still running {waited:.1f}s after SIGINT (a stream was in flight)"


def requests_in_flight(url: str, stop, model: str | None = None) -> dict:
    """Send a long non-streamed and a long streamed completion to `url` (an engine or a router), call
    `stop()` (a Ctrl-C) once `url` counts both in flight and the stream has had two chunks, and wait
    for both answers: {"whole": the response, "lines": the stream's data lines}."""
    import threading

    answers: dict = {}
    streaming = threading.Event()
    base = {"max_tokens": 4000, "ignore_eos": True} | ({"model": model} if model else {})

    def whole() -> None:
        answers["whole"] = httpx.post(url + "/v1/completions", json=base | {"prompt": "a"}, timeout=120)

    def streamed() -> None:
        body = base | {"prompt": "b", "stream": True}
        answers["lines"] = lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        streaming.set()

    threads = [threading.Thread(target=f) for f in (whole, streamed)]
    for t in threads:
        t.start()
    # (a fixed sleep raced a loaded machine: neither was in flight yet)
    wait_until(lambda: streaming.is_set() and num_requests_on(url) == 2, 60, "both requests in flight", 0.02)
    stop()
    for t in threads:
        t.join(timeout=60)
    return answers


def stop_with_requests_in_flight(url: str, stop, model: str | None = None) -> None:
    """`requests_in_flight`, and check each ended with its tokens so far and finish_reason "abort"
    (the stream with its last chunk and [DONE])."""
    answers = requests_in_flight(url, stop, model)
    assert answers["whole"].status_code == 200, answers["whole"].text[:300]
    assert answers["whole"].json()["choices"][0]["finish_reason"] == "abort"
    lines = answers["lines"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort", lines[-2][:300]


def test_ctrl_c_ends_the_requests_in_flight_as_aborts(demo_model_dir, tmp_path):
    """Past the 5 s Ctrl-C grace, uvicorn cancelled the handlers: a non-streamed request got a
    plain-text 500 (which the OpenAI client retries against a server going away), a stream broke
    without its last chunk or [DONE], and the log held a CancelledError traceback (a README
    walk-through). The engine now aborts what still runs a second before: each answer ends with its
    tokens so far and finish_reason "abort"."""
    with serve_subprocess(demo_model_dir, tmp_path) as (url, proc, log_path):
        stop_with_requests_in_flight(url, lambda: proc.send_signal(signal.SIGINT))
        assert proc.wait(timeout=30) in (0, -signal.SIGINT)  # (uvicorn re-raises the signal it caught)
    assert "Traceback" not in open(log_path).read()
