"""`pdserve` command line: serve | router | launch | make-demo-model | demo | bench | simulate.

(The parser's description is USAGE below; this docstring is for developers.)

Length (~730 lines): one argparse tree. Most of it is option declarations with their help (every
flag of `serve`, `router` and `launch` in one place, as vLLM's `--help` lists them) and the small
`cmd_*` functions that turn parsed options into frozen configs; each subcommand's work lives in its
own module (`launch.py`, `bench/`, `sim/cli.py`).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys

from pdserve import __version__
from pdserve.argtypes import DEVICES, DTYPES, count, engine_url, number, output_file, port, positive
from pdserve.server.auth import API_KEY_ENV
from pdserve.server.reasoning import PARSERS as REASONING_PARSERS
from pdserve.server.tool_calls import PARSERS as TOOL_CALL_PARSERS

# (a negative α or β was refused only inside the router's load poller, which swallowed it: the
# scheduler was never built and every request heard "retry shortly")
_tokens = number(int, 0, low_ok=True)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's default in its help, as vLLM's --help shows them; not where the help already
    says it, nor where there is none to show (None: computed or off; a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        shown = not (default is None or default is False or default is argparse.SUPPRESS)
        if action.option_strings and shown and "default" not in text:
            text += (" " if text else "") + "(default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """(sub-commands are made of the parser's own class: the formatter reaches every one)"""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def _log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level", default="warning", type=str.lower, choices=LOG_LEVELS, help="uvicorn's and pdserve's"
    )


def _api_key_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require `Authorization: Bearer KEY` on every route but /health, /metrics, /version and "
        f"/pd/... (else ${API_KEY_ENV}; default: none)",
    )


def _api_key(a: argparse.Namespace) -> str | None:
    return a.api_key or os.environ.get(API_KEY_ENV) or None


GRACEFUL_SHUTDOWN_S = 5.0  # after Ctrl-C / SIGTERM, in-flight requests get this long, then are cancelled
# An engine aborts what still runs this long before the cancel: each answer ends with its tokens so far
# and finish_reason "abort" (a cancelled handler answered a plain-text 500, which the OpenAI client
# retried against a server going away, and logged a CancelledError traceback; a stream just broke).
ABORT_BEFORE_CANCEL_S = 1.0
# The router ends what it still relays (a 503) later than that: when `launch` is stopped, every engine's
# "abort" has reached the client through it first; when the router alone is, nothing else would.
ROUTER_SHUTDOWN_BEFORE_CANCEL_S = 0.25
# Idle keep-alive connections are kept this long (uvicorn's default is 5 s): longer than the router's
# own expiry of its idle connections to the engines (router/app.py KEEPALIVE_EXPIRY_S), so the router
# always drops one before the engine does.
SERVER_KEEP_ALIVE_S = 15


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen before anything loads, so a taken port is one error line (not a model loaded
    for nothing and a banner for a server that never answers) and the banner tells the truth."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn's own bind)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def _listen_or_exit_code(host: str, port: int) -> socket.socket | int:
    """`_listen`, or the exit code after one error line: 3 for a port in use (uvicorn's code for a
    failed bind, which `pdserve launch` retries on fresh ports), 2 otherwise."""
    try:
        return _listen(host, port)
    except OSError as e:
        print(f"error: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 3 if e.errno == errno.EADDRINUSE else 2


def _serve_http(
    app,
    sock: socket.socket,
    log_level: str,
    before_cancel=None,
    before_cancel_s: float = ABORT_BEFORE_CANCEL_S,
) -> int:
    """Serve `app` on the bound socket until Ctrl-C / SIGTERM (open streams are cancelled after
    GRACEFUL_SHUTDOWN_S: they held the process for as long as they ran); 3 if it did not start.
    `before_cancel` (a coroutine function): awaited `before_cancel_s` before that cancel, to end
    what still runs as the application means to (an engine: its requests' "abort"; the router: a 503
    for what it relays, its decode legs closed)."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            async def at_deadline() -> None:
                await asyncio.sleep(max(0.0, GRACEFUL_SHUTDOWN_S - before_cancel_s))
                await before_cancel()

            timer = asyncio.ensure_future(at_deadline()) if before_cancel is not None else None
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
    )
    server = Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # (uvicorn raises the Ctrl-C it caught again once shut down: no traceback)
        pass
    return 0 if server.started else 3


def _configure_logging(level: str) -> None:
    """pdserve's own loggers at `--log-level` (uvicorn's are set by uvicorn): their warnings reached
    stderr as bare text through Python's last-resort handler, and info/debug never showed."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("pdserve")
    log.handlers[:] = [handler]
    log.setLevel(logging.DEBUG if level == "trace" else getattr(logging, level.upper()))
    log.propagate = False


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local HF model directory")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights and KV cache (auto: float32 on the CPU; on a GPU the checkpoint's half type, else bfloat16)",
    )
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when there is one")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--num-pages", type=int, default=None, help="KV pool size (default: from --kv-cache-gib)")
    p.add_argument("--kv-cache-gib", type=positive, default=0.5, help="KV pool size in GiB")
    p.add_argument(
        "--max-model-len",
        type=count,
        default=None,
        help="prompt + output tokens of one request (default: the model's positions, as far as the KV pool holds them)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="recompute every prompt (no reuse of cached pages)"
    )
    p.add_argument(
        "--no-in-flight-prefix-sharing",
        action="store_true",
        help="admit copies of a prompt being prefilled at once (each computes it) instead of waiting "
        "for its pages to reach the prefix cache",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model's name in the API (default: --model as given)"
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_CALL_PARSERS),
        help="let chat requests carry `tools` and parse the model's calls this way (hermes: "
        "<tool_call>{json}</tool_call>, Qwen2.5/Qwen3/Hermes); default: tools are refused",
    )
    p.add_argument(
        "--enable-weight-updates",
        action="store_true",
        help="serve POST /update_weights_from_disk (an RL trainer's new checkpoint, loaded in place)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="move a thinking model's <think>...</think> to reasoning_content in chat answers",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the shared sampler (requests without a seed of their own)",
    )
    p.add_argument(
        "--prefill-quota-ms",
        type=float,
        default=None,
        help="DualPath compute quota per step (predicted by the prefill cost model); default off. "
        "Meant for prefill engines: it prices decodes too, so on a colocated or decode engine running "
        "decodes that fill it keep new requests waiting",
    )


def _pd_args(p: argparse.ArgumentParser) -> None:
    """Flags of prefill/decode engines, shared by `serve` and `launch` (which passes them on)."""
    # (the in-process fake backend reaches only peers in its own process: tests build it in code)
    p.add_argument("--transfer-backend", default="nixl", choices=["nixl"], help="how KV pages move")
    p.add_argument("--pd-deadline-s", type=float, default=30.0, help="deadline of every PD transfer state")
    p.add_argument(
        "--pd-abort-lease-s",
        type=float,
        default=0.0,
        help="how long a decode holds aborted pages without the prefill's ack; 0 (default): 3 x "
        "--pd-deadline-s + 10 s (a lease below 3 x the deadline + 1 s is refused)",
    )
    p.add_argument(
        "--pd-store-read-timeout-s",
        type=float,
        default=0.0,
        help="a KV store read still in flight after this long is left behind and its prompt computed "
        "instead (a stuck disk costs time, not the request); 0 (default): half --pd-deadline-s",
    )
    p.add_argument(
        "--pd-peer-idle-s",
        type=positive,
        default=600.0,
        help="forget a PD peer unused this long (a restarted engine's old registration and transfer "
        "agent entry); a decode renews its registration with a prefill after a quarter of the "
        "lesser of both engines' values",
    )
    p.add_argument(
        "--pd-staging-threshold",
        type=float,
        default=0.5,
        help="stage a request's KV when its decode pages have more than this many runs per page "
        "(negative: always)",
    )
    p.add_argument("--kv-store", default=None, help="DualPath persistent KV store directory (PD roles)")
    p.add_argument("--kv-store-gib", type=positive, default=8.0, help="store capacity (LRU eviction beyond)")
    p.add_argument("--kv-block-size", type=int, default=64, help="tokens per stored block")
    p.add_argument(
        "--kv-store-keep-old-weights",
        action="store_true",
        help="after a weight update keep the previous weights' store directory (default: removed)",
    )
    p.add_argument(
        "--snic-mbps", type=positive, default=None, help="emulated storage NIC budget per node, MB/s"
    )
    p.add_argument(
        "--cnic-mbps", type=positive, default=None, help="emulated compute NIC budget per engine, MB/s"
    )


def _policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy",
        default="none",
        choices=["none", "round_robin", "round_robin_dual", "dualpath"],
        help="DualPath placement in the router: round_robin (Basic: PE reads only), round_robin_dual "
        "(ablation: alternate read paths), dualpath (scheduler); none: plain PD routing",
    )
    p.add_argument(
        "--alpha-tokens", type=_tokens, default=None, help="dualpath α (default: 3 s of SNIC reads)"
    )
    p.add_argument("--beta-tokens", type=_tokens, default=None, help="dualpath β (default: unlimited)")
    p.add_argument("--load-interval-s", type=positive, default=0.05, help="engine load report poll period")


def _read_path_arg(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("--read-path", default="none", choices=["none", "pe", "de", "auto"], help=help_text)


def engine_config_from_args(a: argparse.Namespace):
    from pdserve.config import EngineConfig

    return EngineConfig.create(
        a.model,
        dtype=a.dtype,
        device=a.device,
        page_size=a.page_size,
        num_pages=a.num_pages,
        kv_cache_memory_gib=a.kv_cache_gib,
        enable_prefix_caching=not a.no_prefix_caching,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        seed=a.seed,
        served_model_name=a.served_model_name,
        prefill_quota_s=a.prefill_quota_ms / 1e3 if getattr(a, "prefill_quota_ms", None) else None,
        share_in_flight_prefixes=not getattr(a, "no_in_flight_prefix_sharing", False),
    )


def _pd_flags_given(a: argparse.Namespace) -> list[str]:
    """The PD-only flags (`_pd_args`) set to anything but their defaults, as `--flag` names."""
    defaults = argparse.ArgumentParser(add_help=False)
    _pd_args(defaults)
    return [
        action.option_strings[0]
        for action in defaults._actions
        if action.option_strings and getattr(a, action.dest, action.default) != action.default
    ]


def _pd_config(a: argparse.Namespace, secret: bytes):
    """The PD engine's config from its flags; ValueError for a combination that cannot work."""
    from pdserve.engine.pd_common import PDConfig

    if (a.snic_mbps or a.cnic_mbps) and not a.node_dir:
        raise ValueError(
            "--snic-mbps / --cnic-mbps emulate a node's NICs: they need --node-dir "
            "(or `pdserve launch --nodes`, which makes one)"
        )
    if a.kv_store and (a.kv_block_size <= 0 or a.kv_block_size % a.page_size):
        raise ValueError(
            f"--kv-block-size {a.kv_block_size} must be a positive multiple of --page-size {a.page_size}"
        )
    return PDConfig(
        cluster_secret=secret,
        transfer_backend=a.transfer_backend,
        bootstrap_port=a.bootstrap_port,
        deadline_s=a.pd_deadline_s,
        abort_lease_s=a.pd_abort_lease_s or None,  # 0: derived from the deadline
        store_read_timeout_s=a.pd_store_read_timeout_s or None,  # 0: half the deadline
        peer_idle_s=a.pd_peer_idle_s,
        staging_threshold=a.pd_staging_threshold,
        kv_store_dir=a.kv_store,
        kv_store_gib=a.kv_store_gib,
        kv_store_keep_old_weights=a.kv_store_keep_old_weights,
        kv_block_size=a.kv_block_size,
        node=a.node,
        node_dir=a.node_dir,
        snic_bytes_per_s=a.snic_mbps * 1e6 if a.snic_mbps else float("inf"),
        cnic_bytes_per_s=a.cnic_mbps * 1e6 if a.cnic_mbps else float("inf"),
    )


def cmd_serve(a: argparse.Namespace) -> int:

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.server.api import build_app

    _configure_logging(a.log_level)
    if a.role == "colocated" and (given := _pd_flags_given(a)):
        # (a colocated engine started without them and said nothing: `--kv-store` asked for a store
        # it never made; a review, 2026-12-05)
        print(
            f"error: {', '.join(given)}: only for --role prefill or decode (a colocated engine has no"
            " PD transfer, KV store or NIC emulation)",
            file=sys.stderr,
        )
        return 2
    sock = _listen_or_exit_code(a.host, a.port)
    if isinstance(sock, int):
        return sock
    pd_config = None
    if a.role != "colocated":
        from pdserve.engine.pd_common import PDConfig

        try:
            secret = PDConfig.secret_from(a.cluster_secret)
            pd_config = _pd_config(a, secret)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        engine_config = engine_config_from_args(a)
    except ValueError as e:  # ConfigError: a bad or inconsistent engine setting
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(engine_config)
    except Exception as e:  # noqa: BLE001 - no weights, a broken tokenizer, no CUDA: one line, not a traceback
        print(f"error: the engine did not start: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    pd = None
    if pd_config is not None:
        from pdserve.server.pd_context import PDContext

        try:
            pd = PDContext(engine, a.role, pd_config, host=a.host)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                print(f"error: the PD context did not start: {e}", file=sys.stderr, flush=True)
                os._exit(2)
            # Same exit code as uvicorn's failed bind: `pdserve launch` retries on fresh ports. The
            # engine's threads are already running, hence the hard exit.
            print(f"error: bootstrap port {a.bootstrap_port} is in use ({e})", file=sys.stderr, flush=True)
            os._exit(3)
        except Exception as e:  # noqa: BLE001 - e.g. NIXL not installed: one line (threads run: hard exit)
            hint = " (pip install 'pdserve[nixl]')" if "nixl" in str(e).lower() else ""
            print(f"error: the PD context did not start: {e}{hint}", file=sys.stderr, flush=True)
            os._exit(2)
    app = build_app(
        engine,
        pd,
        enable_fault_injection=a.enable_fault_injection,
        tool_call_parser=a.tool_call_parser,
        reasoning_parser=a.reasoning_parser,
        enable_weight_updates=a.enable_weight_updates,
        api_key=_api_key(a),
    )
    if engine.tokenizer is None:  # (token-id prompts only: every text request is a 400)
        print(f"warning: no tokenizer in {a.model}: only token-id prompts are served", flush=True)
    pool_tokens = engine.kv.pool.num_pages * engine.kv.page_size
    if engine.config.scheduler.max_model_len > pool_tokens:  # (only when given: the default is capped)
        print(
            f"warning: --max-model-len {engine.config.scheduler.max_model_len} is more than the KV pool holds "
            f"({pool_tokens} tokens): a request past that is a 400 (raise --kv-cache-gib or --num-pages)",
            flush=True,
        )
    print(
        f"pdserve {a.role}: {engine.config.model_name} ({engine.config.dtype}, {engine.config.device}), "
        f"{engine.kv.pool.num_pages} KV pages of {engine.kv.page_size} tokens; "
        f"http://{a.host}:{sock.getsockname()[1]}",
        flush=True,
    )
    return _serve_http(app, sock, a.log_level, before_cancel=app.state.engine.abort_now)


def cmd_router(a: argparse.Namespace) -> int:
    from pdserve.router.app import Router
    from pdserve.router.routes import build_router_app

    _configure_logging(a.log_level)
    sock = _listen_or_exit_code(a.host, a.port)
    if isinstance(sock, int):
        return sock
    try:
        router = Router(
            a.prefill,
            a.decode,
            health_interval_s=a.health_interval_s,
            read_path=a.read_path,
            policy=a.policy,
            load_interval_s=a.load_interval_s,
            alpha_tokens=a.alpha_tokens,
            beta_tokens=a.beta_tokens,
            api_key=_api_key(a),
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sock.close()
        return 2
    print(
        f"pdserve router: {len(a.prefill)} prefill, {len(a.decode)} decode; "
        f"http://{a.host}:{sock.getsockname()[1]}",
        flush=True,
    )
    return _serve_http(
        build_router_app(router),
        sock,
        a.log_level,
        before_cancel=router.shut_down,
        before_cancel_s=ROUTER_SHUTDOWN_BEFORE_CANCEL_S,
    )


def cmd_launch(a: argparse.Namespace) -> int:
    from pdserve.launch import launch

    return launch(a)


def cmd_make_demo_model(a: argparse.Namespace) -> int:
    from pdserve.model.demo import make_demo_model

    if not a.dir.strip() or os.path.exists(a.dir) and not os.path.isdir(a.dir):
        # ("" wrote the checkpoint into the current directory; a file was a FileExistsError traceback)
        print(f"error: {a.dir!r} is not a directory to write the checkpoint into", file=sys.stderr)
        return 2
    try:
        out = make_demo_model(a.dir, seed=a.seed)
    except OSError as e:
        print(f"error: cannot write the checkpoint: {e}", file=sys.stderr)
        return 2
    print(f"demo checkpoint written to {out}")
    return 0


def _interrupted_code(signum: int | None) -> int:
    return 128 + (signum or 2)  # (Ctrl-C: 130, SIGTERM: 143)


def cmd_demo(a: argparse.Namespace) -> int:
    from pdserve.demo import run_demo
    from pdserve.launch import _port_free
    from pdserve.stop_signals import Stopped, stop_signals_stop_clusters

    if a.port and not _port_free(a.port):  # (before the engines load: the router would fail last)
        print(f"error: router port {a.port} is in use", file=sys.stderr)
        return 2
    with stop_signals_stop_clusters() as stop:
        try:
            return run_demo(a.model_dir, port=a.port)
        except (KeyboardInterrupt, Stopped):
            print("interrupted: the cluster was stopped", file=sys.stderr)
            return _interrupted_code(stop.signum)
        except (RuntimeError, TimeoutError, OSError) as e:  # a process that failed to start (said why)
            print(f"error: the demo cluster did not start: {e}", file=sys.stderr)
            return 1


def cmd_bench(a: argparse.Namespace) -> int:
    """One benchmark; a bad setting or an unreachable server is one `error:` line, not a traceback."""
    import httpx

    from pdserve.stop_signals import Stopped, stop_signals_stop_clusters

    with stop_signals_stop_clusters() as stop:
        try:
            if getattr(a, "device", None) == "cuda":
                import torch

                if not torch.cuda.is_available():  # (an AssertionError traceback from deep in torch)
                    raise ValueError("--device cuda: no CUDA device here (this torch build or machine)")
            return _bench(a)
        except (ValueError, OSError) as e:  # (ConfigError, a missing model, a bad size)
            print(f"error: {e}", file=sys.stderr)
            return 2
        except httpx.TransportError as e:
            print(f"error: {type(e).__name__}: {e} (is the server up at the URL given?)", file=sys.stderr)
            return 1
        except (RuntimeError, TimeoutError) as e:  # e.g. a cluster process that failed to start (said why)
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        except (KeyboardInterrupt, Stopped):  # Ctrl-C or a stop signal: its clusters were stopped
            print("interrupted: nothing written", file=sys.stderr)
            return _interrupted_code(stop.signum)


def _bench(a: argparse.Namespace) -> int:
    if a.what == "offline":
        from pdserve.bench.offline import run_offline_bench

        return run_offline_bench(a)
    if a.what == "transfer":
        from pdserve.bench.transfer import run

        return run(a)
    if a.what == "store":
        from pdserve.bench.store import run as run_store

        return run_store(a)
    if a.what == "serve":
        from pdserve.bench.serve import run as run_serve

        return run_serve(a)
    if a.what == "soak":
        from pdserve.bench.soak import run as run_soak

        return run_soak(a)
    if a.what == "dualpath":
        from pdserve.bench.dualpath_compare import run as run_dualpath

        return run_dualpath(a)
    if a.what == "agentic":
        from pdserve.bench.agentic import run_agentic

        return 0 if run_agentic(a)["summary"]["turns_failed"] == 0 else 1
    print(f"unknown benchmark {a.what!r}", file=sys.stderr)
    return 2


USAGE = (
    "Serve LLMs with prefill and decode on separate engines (PD disaggregation), loading the KV cache "
    "of long agentic contexts from a persistent store through two read paths (DualPath); benchmark "
    "them, and simulate such clusters at scale."
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pdserve", description=USAGE)
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="run an engine with an OpenAI-compatible HTTP API")
    _engine_args(s)
    s.add_argument(
        "--role",
        default="colocated",
        choices=["colocated", "prefill", "decode"],
        help="colocated: a whole engine; prefill/decode: a half behind `pdserve router`",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=port, default=8000, help="HTTP port")
    _log_level_arg(s)
    _api_key_arg(s)
    s.add_argument("--cluster-secret", default=None, help="PD roles: HMAC key (else $PDSERVE_CLUSTER_SECRET)")
    s.add_argument(
        "--bootstrap-port", type=port, default=8998, help="prefill: bootstrap server port (0 = any)"
    )
    s.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="serve POST /debug/faults (pdserve.faults; chaos tests only, never in production)",
    )
    s.add_argument("--node", default="node0", help="PD: the node this engine belongs to (DualPath)")
    s.add_argument("--node-dir", default=None, help="PD: directory of the nodes' emulated NIC link files")
    _pd_args(s)
    s.set_defaults(fn=cmd_serve)

    r = sub.add_parser("router", help="OpenAI-compatible router in front of prefill and decode engines")
    r.add_argument("--prefill", nargs="+", type=engine_url, required=True, help="prefill engine base URLs")
    r.add_argument("--decode", nargs="+", type=engine_url, required=True, help="decode engine base URLs")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on")
    r.add_argument("--port", type=port, default=8000, help="HTTP port")
    r.add_argument("--health-interval-s", type=positive, default=1.0, help="engine health poll period")
    _api_key_arg(r)
    _read_path_arg(
        r,
        "DualPath read path per request (a request body's read_path wins under --policy none; under a"
        " placement policy the policy chooses, and a body's read_path is a 400)",
    )
    _policy_args(r)
    _log_level_arg(r)
    r.set_defaults(fn=cmd_router)

    la = sub.add_parser("launch", help="start router + prefill + decode engines on this machine")
    _engine_args(la)
    la.add_argument("--prefill", type=count, default=1, help="number of prefill engines")
    la.add_argument("--decode", type=count, default=1, help="number of decode engines")
    la.add_argument("--port", type=port, default=8000, help="router port")
    _api_key_arg(la)
    _pd_args(la)
    _read_path_arg(la, "DualPath read path the router asks for (auto: the side with fewer reads in flight)")
    _policy_args(la)
    la.add_argument(
        "--enable-fault-injection", action="store_true", help="engines serve POST /debug/faults (chaos tests)"
    )
    la.add_argument(
        "--nodes",
        default=None,
        help="emulated nodes, e.g. 'p0:1p,d0:1d,d1:1d' (name:<k>p<m>d each; overrides --prefill/--decode); "
        "with --snic-mbps/--cnic-mbps their NICs are rate-limited and shared by the node's engines",
    )
    la.set_defaults(fn=cmd_launch)

    m = sub.add_parser("make-demo-model", help="write the small offline demo checkpoint")
    m.add_argument("dir", help="directory to write (config.json, model.safetensors, tokenizer)")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    m.set_defaults(fn=cmd_make_demo_model)

    d = sub.add_parser("demo", help="build the demo checkpoint if needed, serve it, send a few requests")
    d.add_argument("--model-dir", default=".demo-model", help="the demo checkpoint's directory")
    d.add_argument("--port", type=port, default=0, help="0 = pick a free port")
    d.set_defaults(fn=cmd_demo)

    b = sub.add_parser("bench", help="benchmarks that measure a ratio side by side in one run")
    bsub = b.add_subparsers(dest="what", required=True)
    bo = bsub.add_parser("offline", help="pdserve vs transformers generate, same requests")
    bo.add_argument(
        "--model", default=None, help="model dir (default: the demo checkpoint, built if missing)"
    )
    bo.add_argument("--num-requests", type=count, default=32, help="requests, each side the same")
    bo.add_argument("--seed", type=int, default=0, help="seed of the prompts and their lengths")
    bo.add_argument("--dtype", default="float32", choices=DTYPES, help="both sides (auto: pdserve's choice)")
    bo.add_argument("--device", default="cpu", choices=DEVICES, help="both sides (auto: pdserve's choice)")
    bo.add_argument("--json", type=output_file, default=None, help="write the figures to this file")
    bo.add_argument("--repeats", type=count, default=2, help="alternating runs per side; best time kept")
    bo.add_argument("--kv-cache-gib", type=positive, default=1.0, help="pdserve's KV pool (GiB)")
    bo.set_defaults(fn=cmd_bench)
    bt = bsub.add_parser("transfer", help="NIXL between two processes vs an in-process torch copy")
    from pdserve.bench.transfer import add_arguments as add_transfer_arguments

    add_transfer_arguments(bt)
    bt.set_defaults(fn=cmd_bench)
    bs = bsub.add_parser("serve", help="TTFT/TPOT/ITL under load; 1P+1D vs 2 colocated engines")
    from pdserve.bench.serve import add_arguments as add_serve_arguments

    add_serve_arguments(bs)
    bs.set_defaults(fn=cmd_bench)
    bst = bsub.add_parser("store", help="KV store reads into host buffers vs a raw read of the same files")
    from pdserve.bench.store import add_arguments as add_store_arguments

    add_store_arguments(bst)
    bst.set_defaults(fn=cmd_bench)

    ba = bsub.add_parser(
        "agentic",
        help="agentic multi-turn replay against a router or engine: JCT, TTFT/TPOT, goodput, SNIC balance",
    )
    from pdserve.bench.agentic import add_agentic_args

    add_agentic_args(ba)
    ba.set_defaults(fn=cmd_bench)

    bd = bsub.add_parser(
        "dualpath", help="one agentic workload on an emulated cluster under each policy (Basic vs DualPath)"
    )
    from pdserve.bench.dualpath_compare import add_arguments as add_dualpath_arguments

    add_dualpath_arguments(bd)
    bd.set_defaults(fn=cmd_bench)

    bso = bsub.add_parser(
        "soak", help="a launched cluster at ~80%% of capacity for N minutes: RSS/page/latency drift"
    )
    from pdserve.bench.soak import add_arguments as add_soak_arguments

    add_soak_arguments(bso)
    bso.set_defaults(fn=cmd_bench)

    sim = sub.add_parser("simulate", help="DualPath cluster simulator")
    try:
        from pdserve.sim.cli import add_arguments, run
    except ImportError:
        sim.set_defaults(fn=lambda _a: print("simulator not available", file=sys.stderr) or 2)
    else:
        add_arguments(sim)
        sim.set_defaults(fn=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["simulate"]:
        # Before the full parser: building it imports the bench modules, which import the DualPath
        # scheduler as Python, and the compiled simulator (`make sim-accel`) can load only before any
        # of its modules is. `pdserve simulate` then ran pure Python without saying why.
        from pdserve.sim.cli import main as simulate

        return int(simulate(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
