"""The simulator's hot modules compiled with mypyc: same source, same results, ~2x faster.

Who calls it: ``pdserve simulate`` calls ``activate()`` before it imports the simulator (``--accel``
decides: ``auto`` uses a build if one matches the sources, ``on`` builds one first, ``off`` never);
``make sim-accel`` / ``python -m pdserve.sim.accel`` calls ``build()``; tests compare both.

Why compiled: the 48P96D scale run simulates 2.67 M turns through the event loop, the router
scheduler and the link bookings; the profile is flat (no single loop to vectorize) and pure Python
needs ~50 µs per turn. mypyc compiles the three modules of that loop (``sim/links.py``,
``dualpath/scheduler.py``, ``sim/cluster.py``) from their unchanged, type-annotated source into C
extensions. The source stays the reference: tests run it directly, and the compiled build is checked
against it (identical figures, to the last digit).

Where builds live: ``$PDSERVE_CACHE_DIR`` (default ``~/.cache/pdserve``) ``/sim-mypyc/<digest>/``, where
the digest covers the sources of the compiled modules and of the modules they import from pdserve, plus
the interpreter's ABI tag. Editing any of them makes the build stale, and a stale build is never used:
the extensions never sit next to the sources, so they cannot shadow an edited ``.py``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../pdserve
# Compiled together (one mypyc group: calls between them are direct C calls). Not the cost model:
# compiled, it gained at most ~8% (docs/benchmarks.md, 2026-12-04), but a compiled module must not be
# imported before `activate()`, and the cost model is imported by `--policy`'s check at parse time
# (through sim/config.py) and by much of the package, so every such path fell back to pure Python.
COMPILED = ("sim/links.py", "dualpath/scheduler.py", "sim/cluster.py")
# What the compiled code imports from pdserve: part of the digest, since mypyc compiles against it.
IMPORTED = ("sim/config.py", "sim/errors.py", "dualpath/cost_model.py", "bench/workloads.py")
# The digested modules' names: the compiled ones first (MODULE_NAMES), then what they import.
DIGESTED_MODULES = tuple("pdserve." + p.removesuffix(".py").replace("/", ".") for p in COMPILED + IMPORTED)
MODULE_NAMES = DIGESTED_MODULES[: len(COMPILED)]
# mypy's configuration for the build: it analyses exactly the digested modules (and type stubs, the
# standard library's and numpy's). Left to follow every import, it type-checked the package's whole
# import graph, 1,400 of torch's files among them (through `pdserve.bench`), for ~80% of the build's
# time, and the build depended on modules the digest does not cover. A skipped module's names are
# `Any` to mypyc: the compiled code is the same (the hot path uses only the modules named here).
MYPY_CONFIG = (
    f"[mypy]\nfollow_imports = skip\n\n[mypy-{','.join(DIGESTED_MODULES)}]\nfollow_imports = normal\n"
)
BUILD_TIMEOUT_S = 900


class AccelError(RuntimeError):
    """The compiled simulator cannot be built or used (the reason is in the message)."""


def source_digest() -> str:
    h = hashlib.sha256(sysconfig.get_config_var("EXT_SUFFIX").encode() + sys.version.encode())
    h.update(MYPY_CONFIG.encode() + b"\0")
    for rel in COMPILED + IMPORTED:
        h.update(rel.encode() + b"\0" + (PACKAGE_ROOT / rel).read_bytes() + b"\0")
    return h.hexdigest()[:20]


def build_dir(digest: str | None = None) -> Path:
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    return root / "sim-mypyc" / (digest or source_digest())


def is_built() -> bool:
    return (build_dir() / "BUILD_OK").is_file()


def mypyc_available() -> bool:
    """mypyc and what it builds with (setuptools; not in a Python >= 3.12 venv unless asked for)."""
    return all(importlib.util.find_spec(m) is not None for m in ("mypyc", "setuptools"))


_IMPORT_CHECK = (
    "import sys, pathlib; from pdserve.sim import accel; "
    "sys.exit(0 if accel.activate(pathlib.Path(sys.argv[1])) and accel.active() else 1)"
)


def verify(build: Path) -> bool:
    """Whether the build in `build` imports and is the one used, checked in a fresh interpreter."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _IMPORT_CHECK, str(build)], capture_output=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def build(quiet: bool = True) -> Path:
    """Compile the modules for the current sources; returns the build's dir. A no-op if a working
    build exists; a build that does not import (damaged, half-copied) is replaced.

    Runs mypyc on a copy of the package (it type-checks the digested modules), then keeps only the
    extension files, and marks the build done (BUILD_OK) only once it imports in a fresh interpreter.
    About 30 s on 2 cores (~2.5 min while mypy followed every import: see MYPY_CONFIG). Raises
    AccelError (mypyc's output, a timeout, an I/O error)."""
    out = build_dir()
    if (out / "BUILD_OK").is_file():
        if verify(out):
            return out
        shutil.rmtree(out, ignore_errors=True)  # damaged: rebuild below
    if not mypyc_available():
        raise AccelError("mypyc is not installed (pip install 'mypy[mypyc]')")
    staging = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        with tempfile.TemporaryDirectory(prefix="pdserve-mypyc-") as tmp:
            _compile(Path(tmp), out, staging, quiet)
        if not verify(staging):
            raise AccelError(f"the compiled modules in {staging} do not import")
        (staging / "BUILD_OK").write_text(" ".join(COMPILED) + "\n")
        if (out / "BUILD_OK").is_file():  # a concurrent build finished first: keep that one
            return out
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    except (OSError, subprocess.TimeoutExpired) as e:
        if (out / "BUILD_OK").is_file():  # lost a race to a concurrent build: fine
            return out
        raise AccelError(f"building the compiled simulator failed: {e!r}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _compile(tmp: Path, out: Path, staging: Path, quiet: bool) -> None:
    """mypyc in `tmp` on a copy of the package; the extensions are copied into `staging`."""
    src = tmp / "pdserve"
    shutil.copytree(PACKAGE_ROOT, src, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    (tmp / "mypy.ini").write_text(MYPY_CONFIG)  # (mypyc reads the configuration of its cwd)
    cmd = [sys.executable, "-m", "mypyc", *(f"pdserve/{p}" for p in COMPILED)]
    env = {**os.environ, "MYPY_CACHE_DIR": str(out.parent / ".mypy_cache")}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if proc.returncode != 0:
        raise AccelError(f"mypyc failed ({proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    if not quiet:
        print(proc.stdout[-2000:])
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for so in tmp.glob(f"*{suffix}"):  # the group's shared library, a top-level module
        shutil.copy2(so, staging / so.name)
    for rel in COMPILED:
        so = src / (rel.removesuffix(".py") + suffix)
        if not so.is_file():
            raise AccelError(f"mypyc produced no {so.name} for {rel}")
        dest = staging / "pdserve" / rel.removesuffix(".py")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest.with_name(so.name))


def activate(build: Path | None = None) -> bool:
    """Make the next imports of the three modules load the compiled build. True if it is (now) in
    use; False if there is no build for the current sources. Must run before any of the three is
    imported (mixing compiled and pure copies of one class would break isinstance checks): raises
    AccelError if a pure one already is, or if the build does not import. `build`: a build directory
    to use as is (``build()`` checks one before marking it done); default: the finished build for
    the current sources."""
    if active():
        return True
    d = build if build is not None else build_dir()
    if build is None and not (d / "BUILD_OK").is_file():
        return False
    loaded = [m for m in MODULE_NAMES if m in sys.modules]
    if loaded:
        raise AccelError(f"activate() after {loaded} were imported as Python; activate first")
    import pdserve.dualpath
    import pdserve.sim

    entries = [
        (sys.path, str(d)),  # the group's shared library is a top-level module
        (pdserve.sim.__path__, str(d / "pdserve" / "sim")),
        (pdserve.dualpath.__path__, str(d / "pdserve" / "dualpath")),
    ]
    for path, entry in entries:
        path.insert(0, entry)
    try:
        if active(check_import=True):
            return True
        error: BaseException | None = None
    except BaseException as e:  # a damaged build (ImportError) or a failing module body
        error = e
    # Undo, so that the pure modules import as usual: path entries, modules, package attributes.
    for path, entry in entries:
        path.remove(entry)
    for m in MODULE_NAMES:
        sys.modules.pop(m, None)
        parent, _, child = m.rpartition(".")
        if hasattr(sys.modules.get(parent), child):
            delattr(sys.modules[parent], child)
    if error is None:
        return False  # BUILD_OK but no extension module for cluster: the pure one loaded
    if not isinstance(error, Exception):
        raise error
    raise AccelError(
        f"compiled build in {d} does not import ({error}); `make sim-accel` rebuilds it"
    ) from error


def active(check_import: bool = False) -> bool:
    """Whether ``pdserve.sim.cluster`` is (or, with check_import, will be) the compiled module."""
    if check_import and "pdserve.sim.cluster" not in sys.modules:
        import pdserve.sim.cluster  # noqa: F401
    mod = sys.modules.get("pdserve.sim.cluster")
    return mod is not None and not str(getattr(mod, "__file__", "")).endswith(".py")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pdserve.sim.accel", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("build", "status"), nargs="?", default="build")
    args = p.parse_args(argv)
    if args.command == "status":
        print(f"{'built' if is_built() else 'not built'}: {build_dir()}")
        return 0
    try:
        out = build(quiet=False)
    except AccelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"compiled simulator: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
