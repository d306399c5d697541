"""Range-checked argparse types, shared by `pdserve` and `pdserve simulate`: a bad value is a usage
error before anything loads (not an OverflowError after the model loaded, a 2-page pool, a value
read as "unset", or a simulation that ran before the mistake was found)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(
    kind: type, low: float, low_ok: bool, inf_ok: bool = False, high: float | None = None
) -> Callable[[str], float]:
    """A finite ``kind`` number above ``low`` (or equal to it when ``low_ok``), at most ``high``;
    ``inf`` only when ``inf_ok`` (an unbounded buffer; an infinite rate, size or horizon means nothing)."""
    bound = f"{'≥' if low_ok else '>'} {low:g}"
    bound += f" and ≤ {high:g}" if high is not None else ("" if inf_ok else " and finite")

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if (
            math.isnan(v)
            or v < low
            or (v == low and not low_ok)
            or (math.isinf(v) and not inf_ok)
            or (high is not None and v > high)
        ):
            raise argparse.ArgumentTypeError(f"{text} must be {bound}")
        return v

    parse.is_number = True  # type: ignore[attr-defined]  # (for tests that scan options for addresses)
    return parse


def number_list(item: Callable[[str], float]) -> Callable[[str], list]:
    """A comma-separated list of ``item`` values, at least one ("0.5,1,2")."""

    def parse(text: str) -> list:
        parts = [t.strip() for t in text.split(",") if t.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one value")
        return [item(t) for t in parts]

    return parse


def name_list(known: tuple[str, ...]) -> Callable[[str], list[str]]:
    """A comma-separated list of names out of ``known``, at least one ("round_robin,dualpath")."""

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one of {', '.join(known)}")
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; known: {', '.join(known)}")
        return names

    return parse


def engine_url(text: str) -> str:
    """An engine's base URL, http(s)://HOST[:PORT][/PREFIX] ("127.0.0.1:8001" was taken and every
    health check then failed unseen: httpx refuses a URL without a scheme)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(text)
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r} is not an engine URL such as http://127.0.0.1:8001")
    return text.rstrip("/")


def _output_file(text: str, formats: Callable[[], set[str]] | None) -> str:
    """A file a command writes its results to, checked before anything runs: a bad one used to fail
    after the run (minutes of simulation or benchmark) with a traceback, and the results were lost.
    Returns the path with ``~`` expanded (a quoted or ``--json=~/x`` one was written under ``./~``).
    Refused: empty; a directory (or a path ending in a separator, which ``Path`` would drop); with
    ``formats``, a suffix not among ``formats()``; an existing file this process cannot write; a broken
    symlink on the way; a nearest existing ancestor that is not a directory this process can write
    into (missing directories are made when the file is written: ``make_parent``)."""
    import os
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    expanded = os.path.expanduser(text)
    path = Path(expanded)
    if expanded.endswith(os.sep) or (os.altsep and expanded.endswith(os.altsep)) or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} names a directory, not a file to write")
    if formats is not None:
        known = formats()
        if path.suffix.lstrip(".").lower() not in known:
            raise argparse.ArgumentTypeError(
                f"{text!r}: the file's suffix names its format; one of {', '.join(sorted(known))}"
            )
    if path.exists():
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not writable")
        return expanded
    parent = path.absolute()
    while not parent.exists():
        if parent.is_symlink():
            raise argparse.ArgumentTypeError(f"{text!r}: {parent} is a broken symlink")
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: {parent} is not writable")
    return expanded


def _plot_formats() -> set[str]:
    """What matplotlib's savefig writes, by suffix (imported only when a plot is asked for); pgf only
    where its TeX program is installed (else savefig fails, after the run)."""
    import shutil

    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    formats = set(FigureCanvasBase.get_supported_filetypes())
    if shutil.which(matplotlib.rcParams["pgf.texsystem"]) is None:
        formats.discard("pgf")
    return formats


def output_file(text: str) -> str:
    """A results file (JSON and the like): see ``_output_file``."""
    return _output_file(text, None)


def plot_file(text: str) -> str:
    """A plot file, its format named by its suffix (.png, .svg, .pdf, ...): see ``_output_file``."""
    return _output_file(text, _plot_formats)


def make_parent(path: str) -> str:
    """Make the directories ``path`` (checked by ``output_file``/``plot_file``) is to be written in."""
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return path


def json_object(text: str) -> dict:
    """A JSON object given on the command line (`--extra-body '{"read_path":"pe"}'`): a bad one was
    found only after connecting, as a bare "Expecting value", hidden behind a refused connection."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, not an object")
    return value


def wide_console():
    """rich's Console for a results table: a log or a pipe got 80 columns, and the table's headers and
    policy names were cut to "jct_sp…", "round_…"."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


# The ranges every command line uses.
port = number(int, 0, low_ok=True, high=65535)
count = number(int, 1, low_ok=True)  # 1, 2, ...
positive = number(float, 0, low_ok=False)
non_negative = number(float, 0, low_ok=True)
fraction = number(float, 0, low_ok=False, high=1)  # (0, 1]
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
