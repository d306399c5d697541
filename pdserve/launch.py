"""`pdserve launch`: router + N prefill + M decode engines on this machine (loopback).

Engines are separate processes started with subprocess (never fork: a NIXL agent does not survive a
fork), sharing a freshly generated cluster secret through the environment. Ctrl-C (or SIGTERM)
tears everything down; if any child dies, the launcher stops the rest and exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from pdserve.demo import free_port, wait_healthy
from pdserve.engine.pd_common import SECRET_ENV, PDConfig
from pdserve.server.auth import API_KEY_ENV
from pdserve.stop_signals import STOP, STOP_SIGNALS, Stopped, stops_armed, unstoppable

ENGINE_FLAGS = (
    "tool_call_parser",
    "reasoning_parser",
    "dtype",
    "device",
    "page_size",
    "num_pages",
    "kv_cache_gib",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "served_model_name",
    "seed",
    "prefill_quota_ms",
)


def cluster_args(model: str, **overrides) -> argparse.Namespace:
    """The arguments `pdserve launch` would parse (its defaults), for starting a cluster from code."""
    from pdserve.cli import build_parser

    args = build_parser().parse_args(["launch", "--model", model])
    for key, value in overrides.items():
        if not hasattr(args, key):
            raise TypeError(f"unknown cluster argument {key!r}")
        setattr(args, key, value)
    return args


_NODE_RE = re.compile(r"^([A-Za-z0-9_.-]+):(?:(\d+)p)?(?:(\d+)d)?$")


def parse_nodes(spec: str) -> list[tuple[str, int, int]]:
    """'p0:1p,d0:1d,d1:1d' -> [(node, num_prefill, num_decode), ...]; ValueError with the reason."""
    nodes: list[tuple[str, int, int]] = []
    for part in spec.split(","):
        m = _NODE_RE.match(part.strip())
        if not m or (m.group(2) is None and m.group(3) is None):
            raise ValueError(f"bad node {part!r} in --nodes: expected NAME:<k>p<m>d, e.g. p0:1p or n0:1p2d")
        nodes.append((m.group(1), int(m.group(2) or 0), int(m.group(3) or 0)))
    names = [n for n, _, _ in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate node names in --nodes: {spec!r}")
    if not sum(p for _, p, _ in nodes) or not sum(d for _, _, d in nodes):
        raise ValueError("--nodes needs at least one prefill and one decode engine")
    return nodes


class Cluster:
    """The child processes of one launch; `stop()` is idempotent."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.router_url = ""
        self.urls: dict[str, list[str]] = {}  # role -> engine base URLs, in start order
        self.node_dir: str | None = None  # emulated nodes' link files (removed by stop)
        self.commands: dict[str, tuple[list[str], dict]] = {}  # name -> (pdserve args, env), for restart

    def proc(self, name: str) -> subprocess.Popen:
        return dict(self.procs)[name]

    def url(self, name: str) -> str:
        """Base URL of an engine by process name ("prefill0", "decode1", ...)."""
        role, i = name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")) :])
        return self.urls[role][i]

    def start(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        """Start `pdserve <args>` as process `name`; replaces a process of that name in its place
        (its old process must have exited), else appends it."""
        proc = self._spawn(name, args, env)
        self.commands[name] = (list(args), dict(env))
        return proc

    def _spawn(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        # (a stop raised inside Popen, after the fork, left a child the launcher never knew of,
        # running on after `stop`: found by a test)
        with unstoppable():
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], env=env)
            if name in dict(self.procs):
                self.procs = [(n, proc if n == name else p) for n, p in self.procs]
            else:
                self.procs.append((name, proc))
        return proc

    def restart(self, name: str, extra_env: dict | None = None, wait: bool = True) -> subprocess.Popen:
        """Start process `name` again with the same command (same ports: its URL, and for a prefill its
        bootstrap URL, stay what the router and the decodes know) after it died or was killed; the others
        keep running. `extra_env` is added to its environment (e.g. $PDSERVE_FAULTS). Kills the old
        process first if it is still alive. With `wait`, returns once it is healthy."""
        from pdserve.demo import wait_healthy

        old = self.proc(name)
        if old.poll() is None:
            old.kill()
        old.wait()
        args, env = self.commands[name]
        for attempt in range(5):
            proc = self._spawn(name, args, env | (extra_env or {}))
            if not wait:
                return proc
            try:
                wait_healthy(self.router_url if name == "router" else self.url(name), proc)
                return proc
            except RuntimeError:
                # Exit code 3: uvicorn could not bind the port. Meanwhile the kernel may have lent the
                # freed port to an outgoing connection as its ephemeral source port; it comes back when
                # that connection closes.
                if proc.returncode != 3 or attempt == 4:
                    raise
                time.sleep(1.0)
        return proc

    def dead(self) -> list[str]:
        return [name for name, p in self.procs if p.poll() is not None]

    def stop(self, timeout_s: float = 15.0) -> None:
        # (a stop raised in here would leave the remaining children running)
        with unstoppable():
            self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout_s
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.node_dir:
            shutil.rmtree(self.node_dir, ignore_errors=True)
            self.node_dir = None


def engine_flags(a) -> list[str]:
    out = ["--model", a.model]
    for flag in ENGINE_FLAGS:
        value = getattr(a, flag, None)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    if getattr(a, "no_prefix_caching", False):
        out.append("--no-prefix-caching")
    if getattr(a, "no_in_flight_prefix_sharing", False):
        out.append("--no-in-flight-prefix-sharing")
    if getattr(a, "enable_weight_updates", False):
        out.append("--enable-weight-updates")
    return out


def pd_flags(a) -> list[str]:
    """`pdserve serve` flags of a PD engine, from `pdserve launch`'s arguments."""
    out = [
        "--transfer-backend",
        a.transfer_backend,
        "--pd-deadline-s",
        str(a.pd_deadline_s),
        "--pd-abort-lease-s",
        str(a.pd_abort_lease_s),
        "--pd-store-read-timeout-s",
        str(a.pd_store_read_timeout_s),
        "--pd-peer-idle-s",
        str(a.pd_peer_idle_s),
        "--pd-staging-threshold",
        str(a.pd_staging_threshold),
    ]
    if a.kv_store:
        out += [
            "--kv-store",
            a.kv_store,
            "--kv-store-gib",
            str(a.kv_store_gib),
            "--kv-block-size",
            str(a.kv_block_size),
        ]
        if getattr(a, "kv_store_keep_old_weights", False):
            out.append("--kv-store-keep-old-weights")
    if getattr(a, "enable_fault_injection", False):
        out.append("--enable-fault-injection")
    if getattr(a, "snic_mbps", None):
        out += ["--snic-mbps", str(a.snic_mbps)]
    if getattr(a, "cnic_mbps", None):
        out += ["--cnic-mbps", str(a.cnic_mbps)]
    return out


def router_flags(a) -> list[str]:
    out = ["--read-path", a.read_path, "--policy", getattr(a, "policy", "none")]
    for flag in ("alpha_tokens", "beta_tokens", "load_interval_s"):
        value = getattr(a, flag, None)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out


def check_engine_flags(a, with_nodes: bool) -> None:
    """Refuse here, before anything starts, what every engine would refuse at its start (ValueError):
    the engines' own checks, run on the `pdserve serve` arguments they will get."""
    from pdserve.cli import _pd_config, build_parser, engine_config_from_args

    if (getattr(a, "snic_mbps", None) or getattr(a, "cnic_mbps", None)) and not with_nodes:
        # (the engines' own message named --node-dir, which `launch` does not have)
        raise ValueError("--snic-mbps / --cnic-mbps emulate nodes' NICs: they need --nodes")
    nodes = ["--node-dir", "(made at launch)"] if with_nodes else []
    argv = ["serve", *engine_flags(a), "--role", "decode", *pd_flags(a), *nodes]
    try:
        serve = build_parser().parse_args(argv)
    except SystemExit:  # argparse printed the reason; a caller of start_cluster gets an exception
        raise ValueError(f"invalid engine flags: {' '.join(argv[1:])}") from None
    _pd_config(serve, b"\0" * 32)  # (the secret is checked apart)
    engine_config_from_args(serve)


def start_cluster(
    a, num_prefill: int, num_decode: int, router_port: int = 0, secret: str | None = None
) -> Cluster:
    """Start engines and router, wait until all are healthy. Raises (after cleanup) on failure.

    With `a.nodes` (see `parse_nodes`) the engine counts come from the node spec, every engine gets
    `--node NAME --node-dir DIR` (a fresh directory of shared link files) and the NIC budgets."""
    nodes = parse_nodes(a.nodes) if getattr(a, "nodes", None) else None
    check_engine_flags(a, with_nodes=nodes is not None)  # e.g. NIC budgets need --nodes
    if nodes is None:
        placement = [("prefill", "node0")] * num_prefill + [("decode", "node0")] * num_decode
    else:
        placement = [("prefill", n) for n, p, _ in nodes for _ in range(p)]
        placement += [("decode", n) for n, _, d in nodes for _ in range(d)]
    env = {
        **os.environ,
        SECRET_ENV: secret or PDConfig.generate_secret(),
        "PYTHONUNBUFFERED": "1",
        "UCX_MODULES": os.environ.get("UCX_MODULES", "^ib*"),
    }
    if getattr(a, "api_key", None):  # (every engine and the router; in the environment, not in `ps`)
        env[API_KEY_ENV] = a.api_key
    cluster = Cluster()
    handed_out: set[int] = {router_port} if router_port else set()  # (an engine never gets the router's)

    def fresh_port() -> int:
        """A free port not yet given to another process of this launch."""
        while (port := free_port()) in handed_out:
            pass
        handed_out.add(port)
        return port

    def engine_args(role: str, node: str) -> tuple[list[str], str]:
        port = fresh_port()
        extra = ["--bootstrap-port", str(fresh_port())] if role == "prefill" else []
        if cluster.node_dir:
            extra += ["--node", node, "--node-dir", cluster.node_dir]
        args = ["serve", *engine_flags(a), "--role", role, "--port", str(port), *pd_flags(a), *extra]
        return args, f"http://127.0.0.1:{port}"

    try:
        if nodes is not None:
            cluster.node_dir = tempfile.mkdtemp(prefix="pdserve-nodes-")
        urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        for role, node in placement:
            args, url = engine_args(role, node)
            cluster.start(f"{role}{len(urls[role])}", args, env)
            urls[role].append(url)
        cluster.urls = urls
        for (name, _), (role, node) in zip(list(cluster.procs), placement, strict=True):
            for attempt in range(5):
                proc = cluster.proc(name)
                try:
                    wait_healthy(cluster.url(name), proc, name=name)
                    break
                except RuntimeError:
                    # Exit code 3: uvicorn could not bind. free_port() only finds a port that was free a
                    # moment ago; another process can take it before the engine binds. Take new ports.
                    if proc.returncode != 3 or attempt == 4:
                        raise
                    args, url = engine_args(role, node)
                    cluster.start(name, args, env)
                    i = int(name[len(role) :])
                    urls[role][i] = url
        router_port = router_port or fresh_port()
        proc = cluster.start(
            "router",
            [
                "router",
                "--port",
                str(router_port),
                "--prefill",
                *urls["prefill"],
                "--decode",
                *urls["decode"],
                *router_flags(a),
            ],
            env,
        )
        cluster.router_url = f"http://127.0.0.1:{router_port}"
        wait_healthy(cluster.router_url, proc, name="router")
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds: TIME_WAIT is free)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _stopped_while_starting(signum: int) -> int:
    print(f"pdserve launch: {signal.Signals(signum).name} while starting; stopped", file=sys.stderr)
    return 128 + signum


def launch(a) -> int:
    # Before anything starts: a SIGTERM while the engines load (systemd, docker stop, a CI timeout)
    # killed the launcher by default and left its engines running without a parent.
    if a.port and not _port_free(a.port):  # (before the engines load: the router would fail last)
        print(f"error: router port {a.port} is in use", file=sys.stderr)
        return 2
    try:
        with stops_armed():
            cluster = start_cluster(a, a.prefill, a.decode, a.port)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        return _stopped_while_starting(e.args[0])
    except (RuntimeError, TimeoutError, OSError) as e:  # a process that failed to start (said why above)
        print(f"error: the cluster did not start: {e}", file=sys.stderr)
        return 1
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    if STOP.signum is not None:  # (one that came as start_cluster returned: recorded, not raised)
        cluster.stop()
        return _stopped_while_starting(STOP.signum)
    n_p, n_d = len(cluster.urls["prefill"]), len(cluster.urls["decode"])
    print(
        f"pdserve cluster up: router {cluster.router_url} ({n_p} prefill, {n_d} decode); Ctrl-C stops it",
        flush=True,
    )
    try:
        while not stopping:
            dead = cluster.dead()
            if dead:
                codes = ", ".join(f"{name} (exit code {cluster.proc(name).returncode})" for name in dead)
                print(f"pdserve launch: {codes} exited; stopping the cluster", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        cluster.stop()
