"""`pdserve serve` as a new user meets it (a README walk-through, 2026-12-02, fourth session; each test
failed before its fix): a taken port is an error before anything loads, a max_model_len past the KV
pool is warned about, Ctrl-C ends a server with a stream in flight. Real `pdserve serve` processes
on 127.0.0.1, the demo checkpoint built in a tmp dir."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.demo import free_port, wait_healthy
from pdserve.model.demo import make_demo_model


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return str(make_demo_model(tmp_path_factory.mktemp("demo")))


def _serve_cmd(model_dir: str, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli", "serve", "--model", model_dir, "--port", str(port), *flags]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_serve_on_a_taken_port_does_not_announce_it_is_serving(demo_dir):
    """`pdserve serve --port P` with P taken prints the ready line `pdserve colocated: ...;
    http://127.0.0.1:P` (cli.py: the banner before `uvicorn.run`), and only then uvicorn's
    `ERROR: [Errno 98] ... address already in use` (exit 3). A user (or a script waiting for the
    banner) reads that the server is up; the model was also loaded for nothing. `pdserve launch`
    checks its port first ("error: router port 8000 is in use")."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        r = subprocess.run(_serve_cmd(demo_dir, port), capture_output=True, text=True, timeout=180)
    finally:
        holder.close()
    out = r.stdout + r.stderr
    assert r.returncode == 3 and "cannot listen" in r.stderr, out  # (3: `pdserve launch` retries it)
    assert f"http://127.0.0.1:{port}" not in r.stdout, (
        f"the ready banner was printed although the port was taken:\n{out}"
    )


def test_explicit_max_model_len_past_the_kv_pool_is_refused_or_warned(demo_dir, tmp_path):
    """`pdserve serve --num-pages 2 --max-model-len 4096` (a 32-token KV pool; a tiny
    `--kv-cache-gib` does the same) starts silently and `/v1/models` advertises max_model_len 4096;
    every request past 32 tokens is then a 400 "request needs more KV pages than this engine has in
    total". (Since bc9ae73 the *default* max_model_len is capped to the pool; an explicit one is
    not checked.) vLLM refuses to start here ("max seq len ... larger than the maximum number of
    tokens that can be stored in KV cache"). Refuse at startup naming --num-pages/--kv-cache-gib/
    --max-model-len, or at least warn and advertise what the pool holds."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    flags = ("--num-pages", "2", "--max-model-len", "4096")
    with open(log, "wb") as f:
        proc = subprocess.Popen(_serve_cmd(demo_dir, port, *flags), stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        text = log.read_text()
        if proc.poll() is not None:  # refused at startup: fine if it says why
            assert proc.returncode != 0
            assert "max_model_len" in text or "max-model-len" in text, text
            return
        advertised = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
        warned = "warning" in text.lower() and ("kv" in text.lower() or "page" in text.lower())
        assert advertised <= 2 * 16 or warned, (
            f"serving with a 32-token KV pool, /v1/models says max_model_len={advertised}, no warning:\n{text}"
        )
    finally:
        _stop(proc)


def test_ctrl_c_stops_a_colocated_server_with_a_stream_in_flight(demo_dir, tmp_path):
    """Ctrl-C (SIGINT) on `pdserve serve` while a long stream is in flight: the process goes on
    until the stream has produced all its tokens (cli.py: `uvicorn.run(...)` without
    `timeout_graceful_shutdown`; at the default --log-level warning uvicorn's "Waiting for
    connections to close. (CTRL+C to force quit)" is hidden, so the terminal shows nothing). Here
    ~20 s for 4,000 demo tokens; a real model's long answer holds it for minutes. A second Ctrl-C
    then prints a KeyboardInterrupt/CancelledError traceback. `pdserve launch` stops the same
    in-flight stream within ~4 s."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(_serve_cmd(demo_dir, port), stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, timeout_s=120)
        body = {"prompt": "a", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        client = httpx.Client(timeout=120)
        with client.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for line in lines:  # the first token is out: the request is in flight
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    break
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=8)
            except subprocess.TimeoutExpired:
                pass
            waited = time.monotonic() - t0
            alive = proc.poll() is None
        client.close()
        assert not alive, f"still running {waited:.1f}s after SIGINT (a stream was in flight)"
    finally:
        _stop(proc)
