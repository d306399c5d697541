"""Shared fixtures: tiny random HF checkpoints of each supported architecture, built with
`transformers` itself (a test dependency) so equivalence tests compare against the real thing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

# One torch (OpenMP) thread per test process, before torch is imported; engines the tests start inherit
# it. The suite runs two xdist workers on two cores, and most tests start engine processes besides:
# with torch's default of a thread per core, their spinning OpenMP threads oversubscribed the cores
# (the PD, store and equivalence modules took 245 s on two workers, 200 s with this). A user's
# setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The tests and parameters that need a CUDA GPU (CI has none; scripts/gpu_check.sh runs them on one).
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ARCHS = ("llama", "qwen2", "qwen3", "mistral")


# ---- the compiled simulator's cold build, and the quiet tests ------------------------------------
# tests/test_sim_accel.py compiles the simulator with mypyc (~30 s of one core on a 2-core machine;
# ~2.5 min, the suite's longest item by far, until the build stopped type-checking torch). Tests with
# tight deadlines or rate-limited links (QUIET_MODULES, marked `quiet`; also single tests marked so in
# their module, e.g. test_netem's wall-clock ones) need a quiet machine: on 2
# cores, a compiler beside them made a chaos burst miss deadlines. (The PD fault tests' deadlines are
# loose -- 8 s, 25 s leases -- and they passed beside the compiler.) `make test` therefore runs the suite in two parts: everything else on two
# xdist workers (in one process a core sat idle 36% of the run: most tests drive one engine thread),
# the build's file first, so the build overlaps the rest; then the quiet modules alone. Run in one
# process (plain `pytest`), the build starts right after collection beside the tests, and the quiet
# modules go last and wait for it to end.
ACCEL_TEST = "test_compiled_simulator_gives_identical_figures"
ACCEL_FILE = "test_sim_accel.py"
QUIET_MODULES = {"test_chaos.py", "test_dualpath_cluster.py"}
IN_XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
_early_build: dict = {}


def can_compile_simulator() -> bool:
    import sysconfig

    from pdserve.sim import accel

    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return (
        accel.mypyc_available() and headers.is_file() and shutil.which(os.environ.get("CC", "cc")) is not None
    )


def start_simulator_build() -> tuple[Path, subprocess.Popen]:
    """A cold build into a fresh cache directory, over a damaged build already sitting where it goes
    (the build must replace it, not trust its marker); returns (cache dir, the build process)."""
    cache = Path(tempfile.mkdtemp(prefix="pdserve-accel-"))
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache)}
    (cache / "tmp").mkdir()  # (the build's own scratch: removed with the cache even if it is killed)
    env["TMPDIR"] = str(cache / "tmp")
    where = subprocess.run(
        [sys.executable, "-c", "from pdserve.sim import accel; print(accel.build_dir())"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    damaged = Path(where.stdout.strip())
    damaged.mkdir(parents=True)
    (damaged / "BUILD_OK").write_text("damaged\n")
    # Niced: the tests beside it (chaos tests with deadlines among them) keep the CPU first. In a
    # session of its own, so that stopping it stops the compiler processes it starts too.
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    with open(cache / "build.log", "w") as log:  # (a file, not a pipe: nobody reads it until the end)
        proc = subprocess.Popen(
            [*nice, sys.executable, "-m", "pdserve.sim.accel", "build"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return cache, proc


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "quiet: needs a quiet machine (deadlines, rate-limited links)")


@pytest.hookimpl(tryfirst=True)  # (before `-m` deselects by the marker added here)
def pytest_collection_modifyitems(session, config, items) -> None:
    """Mark the quiet modules. With the build collected: on xdist workers its file first (the order
    is the same on every worker, as xdist requires); in one process the quiet modules last, each in
    its own order (in name order chaos, 5th, waited 74 s of a 7.5 min run for the build)."""
    for item in items:
        if item.path.name in QUIET_MODULES:
            item.add_marker(pytest.mark.quiet)
    if any(item.name == ACCEL_TEST for item in items):
        if IN_XDIST_WORKER:
            items.sort(key=lambda item: item.path.name != ACCEL_FILE)  # (stable: same order otherwise)
        else:
            items.sort(key=lambda item: item.path.name in QUIET_MODULES)


def pytest_collection_finish(session) -> None:
    # (on xdist workers, each of which collects every test, the test starts the build when it runs)
    if (
        not IN_XDIST_WORKER
        and any(item.name == ACCEL_TEST for item in session.items)
        and can_compile_simulator()
    ):
        try:
            _early_build["cache"], _early_build["proc"] = start_simulator_build()
        except (OSError, subprocess.SubprocessError):  # (the test then builds when it runs, and says why)
            _early_build.clear()


def pytest_runtest_setup(item) -> None:
    proc = _early_build.get("proc")
    if proc is not None and item.path.name in QUIET_MODULES:
        proc.wait()  # (a quiet machine for tests with deadlines; the build's result is read later)


def pytest_sessionfinish(session, exitstatus) -> None:
    proc = _early_build.get("proc")
    if proc is not None:
        if proc.poll() is None:  # (the run stopped before the test: -x, Ctrl-C)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # (the build and the compilers it started)
        proc.wait()
        shutil.rmtree(_early_build["cache"], ignore_errors=True)


@pytest.fixture
def simulator_build() -> tuple[Path, subprocess.Popen]:
    """(cache dir, build process) of the build started after collection (or started now)."""
    if "proc" not in _early_build:
        _early_build["cache"], _early_build["proc"] = start_simulator_build()
    return _early_build["cache"], _early_build["proc"]


def tiny_hf_model(arch: str, *, tie: bool = False, seed: int = 0, **overrides):
    import torch
    import transformers as tf

    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    kwargs = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        # A wide init spreads the logits so greedy argmaxes of a random model are not near-ties.
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs)).eval()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """arch -> (directory, HF model in float32). Built once per session."""
    out = {}
    for arch in ARCHS:
        model = tiny_hf_model(arch)
        path = tmp_path_factory.mktemp(f"hf-{arch}")
        model.save_pretrained(path)
        out[arch] = (str(path), model)
    return out


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    from pdserve.model.demo import make_demo_model

    return str(make_demo_model(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="session")
def demo_engine(demo_model_dir):
    """An in-process LLMEngine of the demo model (for routes built with `build_app` in process)."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.create(demo_model_dir, num_pages=128, max_model_len=1024))


def post_in_process(engine, requests: list[tuple[str, dict]], sampler=None, **app_kw) -> list:
    """POST each (path, JSON body) in turn to the HTTP app built on `engine` (`run_in_process`);
    returns the httpx responses. With `sampler`, the engine's sampler is that one meanwhile (a
    scripted answer)."""

    async def scenario(c):
        return [await c.post(path, json=body) for path, body in requests]

    real = engine.runner.sampler
    engine.runner.sampler = sampler or real
    try:
        return run_in_process(engine, scenario, **app_kw)
    finally:
        engine.runner.sampler = real


async def until(predicate, timeout_s: float = 30.0) -> None:
    """Until `predicate()` holds (checked every 10 ms on the event loop); AssertionError past the
    timeout. (For what an engine thread does after an answer: e.g. take the aborts it was sent.)"""
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def wait_until(pred, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Until `pred()` holds, polled from a test's thread (`until` is the event loop's); an HTTP error
    counts as not yet. AssertionError naming `what` past the timeout."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out ({timeout_s} s) waiting for {what}")
        time.sleep(interval_s)


def run_in_process(engine, scenario, **app_kw):
    """`await scenario(client)` against the HTTP app built on `engine` (`build_app(engine,
    **app_kw)`, in process: no server); returns what it returns. The engine thread stops after."""
    import asyncio

    import httpx

    from pdserve.server.api import build_app

    app = build_app(engine, **app_kw)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            return await scenario(c)

    try:
        return asyncio.run(go())
    finally:
        app.state.engine.shutdown()


def assert_clear_greedy(output, min_gap: float = 1e-3) -> None:
    """A greedy reference (a CompletionOutput asked with logprobs >= 2) has no near-tie: at every step
    its top logprob beats the runner-up by `min_gap`. Paths that must agree to the token (PD vs one
    engine, cached vs computed prefix) sum in different orders, so they can differ by ~1e-6 in a logit;
    a prompt that puts two tokens that close (seen once: 7e-6 at step 3) makes equality a coin toss.
    Fails on the reference, before the comparison, so a prompt or model change that brings one in is
    named for what it is."""
    assert output.logprobs and all(len(step.top) >= 2 for step in output.logprobs), (
        "ask the reference with logprobs >= 2"
    )
    gaps = [step.top[0][1] - step.top[1][1] for step in output.logprobs]
    near = [(i, gap) for i, gap in enumerate(gaps) if gap < min_gap]
    assert not near, f"greedy near-tie(s) (step, logprob gap) {near}: pick another prompt"


def serve_cmd(model_dir: str, port: int, *flags: str) -> list[str]:
    """The command line of a `pdserve serve` process on 127.0.0.1:`port`."""
    return [sys.executable, "-m", "pdserve.cli", "serve", "--model", model_dir, "--port", str(port), *flags]


@contextlib.contextmanager
def serve_subprocess(model_dir: str, log_dir, *flags: str):
    """A `pdserve serve` process on 127.0.0.1 (extra `flags` appended); yields (url, proc, log_path).
    Its log is printed if it fails to come up; it is terminated (then killed) on exit."""
    from pdserve.demo import free_port, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(log_dir) / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_cmd(model_dir, port, *flags), stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_healthy(url, proc, timeout_s=120)
        except Exception:
            print(log_path.read_text(errors="replace"))
            raise
        yield url, proc, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def fake_clock(monkeypatch):
    """The fake transfer backend's clock, advanced by hand (``fake_clock.now_s += 0.5``): a delayed
    write stays pending until the test says so, however slowly the test process runs."""
    from pdserve.transfer import fake_backend

    clock = SimpleNamespace(now_s=1000.0)
    monkeypatch.setattr(fake_backend, "time", SimpleNamespace(monotonic=lambda: clock.now_s))
    return clock
