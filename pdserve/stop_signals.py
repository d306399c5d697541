"""Stop signals while clusters start and run: `pdserve launch` and the commands that start clusters of
their own (`pdserve demo`, the benches).

Who uses it: `launch.py` (`launch`, and `Cluster`'s spawns and stops as `unstoppable` sections),
`cli.py` (`stop_signals_stop_clusters` around `demo` and `bench`). Kept apart from `launch.py`,
which imports the engine (and torch): a bench against a running server needs none of it.
"""

from __future__ import annotations

import contextlib
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal while clusters were starting or running under `stop_signals_stop_clusters`
    (start_cluster stops what it started; the callers' `finally` blocks stop the rest)."""


class _StopState:
    """`launch`'s stop signal while the cluster starts. Python runs a signal's handler at the next
    bytecode of the main thread, wherever that is (inside Popen after its fork, inside the teardown):
    there it only records the signal, and the stop is raised when the section ends. Raised once:
    the stops that follow it run to their end."""

    armed = False  # launch is starting the cluster: a stop signal raises Stopped
    signum: int | None = None
    depth = 0  # inside `unstoppable` sections


STOP = _StopState()


@contextlib.contextmanager
def unstoppable():
    STOP.depth += 1
    try:
        yield
    finally:
        STOP.depth -= 1
    if STOP.armed and STOP.depth == 0 and STOP.signum is not None:
        STOP.armed = False
        raise Stopped(STOP.signum)


def stop_starting(signum, _frame) -> None:
    for sig in STOP_SIGNALS:  # (one is enough)
        signal.signal(sig, signal.SIG_IGN)
    STOP.signum = signum
    if STOP.armed and STOP.depth == 0:
        STOP.armed = False
        raise Stopped(signum)


@contextlib.contextmanager
def stop_signals_stop_clusters():
    """For a command that starts clusters and stops them in `finally` blocks (`pdserve demo`, the
    benches): a stop signal (SIGTERM, SIGINT, SIGHUP) raises `Stopped` as `launch`'s does, deferred
    past any spawn or stop in progress. Killed outright by SIGTERM (a CI timeout, `docker stop`),
    they left their routers and engines running without a parent. Yields the state: `.signum` is
    the signal that came, if any."""
    STOP.armed, STOP.signum = True, None
    old = {sig: signal.signal(sig, stop_starting) for sig in STOP_SIGNALS}
    try:
        yield STOP
    finally:
        STOP.armed = False
        for sig, handler in old.items():
            signal.signal(sig, handler)
