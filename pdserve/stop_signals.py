"""Stop signals while clusters start and run: `pdserve launch` and the commands that start clusters of
their own (`pdserve demo`, the benches).

Who uses it: `launch.py` (`stops_armed` while `launch` starts its cluster, and `Cluster`'s spawns and
stops as `unstoppable` sections),
`cli.py` (`stop_signals_stop_clusters` around `demo` and `bench`). Kept apart from `launch.py`,
which imports the engine (and torch): a bench against a running server needs none of it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
REDELIVER_S = 0.01  # a stop that Python swallowed is signalled again this much later (see _swallowed)


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
    redelivery: threading.Timer | None = None  # a swallowed stop's second signal, on its way


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
def stops_armed():
    """While the section runs a stop signal (SIGTERM, SIGINT, SIGHUP) raises `Stopped`, deferred past
    any `unstoppable` spawn or stop in progress, and a `Stopped` Python swallowed (raised inside a
    weakref callback) is raised again (`_swallowed`). Yields the state: `.signum` is the signal that
    came, if any. On exit the stop is disarmed, a redelivery still on its way cancelled; the handlers
    stay `stop_starting` (`launch` installs its own next; `stop_signals_stop_clusters` restores)."""
    STOP.armed, STOP.signum = True, None
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_starting)
    old_hook, sys.unraisablehook = sys.unraisablehook, _swallowed(sys.unraisablehook)
    try:
        yield STOP
    finally:
        STOP.armed = False
        if STOP.redelivery is not None:
            STOP.redelivery.cancel()
            STOP.redelivery = None
        sys.unraisablehook = old_hook


@contextlib.contextmanager
def stop_signals_stop_clusters():
    """For a command that starts clusters and stops them in `finally` blocks (`pdserve demo`, the
    benches): `stops_armed` for the whole command, the previous handlers back after it. Killed
    outright by SIGTERM (a CI timeout, `docker stop`), they left their routers and engines running
    without a parent."""
    old = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        with stops_armed() as stop:
            yield stop
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _swallowed(previous_hook):
    """`sys.unraisablehook` under `stops_armed`. A handler's Stopped raised inside code
    whose exceptions Python cannot propagate (a weakref callback, such as the import system's module
    locks; a `__del__`) is printed as "Exception ignored" and lost: with the stop raised once and the
    signals then ignored, `pdserve demo` ran on after its SIGTERM (seen in a test run under load). Here
    the stop is armed again and the signal sent again a moment later, when the main thread is out of
    that code; anything else goes to the previous hook."""

    def hook(unraisable) -> None:
        if not (
            isinstance(unraisable.exc_value, Stopped)
            and threading.current_thread() is threading.main_thread()
        ):
            previous_hook(unraisable)
            return
        STOP.armed = True
        for sig in STOP_SIGNALS:
            signal.signal(sig, stop_starting)
        STOP.redelivery = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), unraisable.exc_value.args[0]))
        STOP.redelivery.daemon = True
        STOP.redelivery.start()

    return hook
