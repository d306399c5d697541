"""The compiled simulator (mypyc) is the same simulator: identical figures, never a stale build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.sim import accel
from tests.conftest import can_compile_simulator

# Runs a small cluster under every mode in a fresh interpreter (activation must precede the imports)
# and prints the figures, exactly (repr of floats), plus which cluster module ran and the types of
# the objects the runs left in reference cycles (the cyclic GC is paused while a run goes, so any
# would pile up for the whole run: mypyc-compiled closures did, ~3 objects per simulated turn; the
# pure source never made cycles, so the compiled half of the check is the one with teeth).
_SCRIPT = r"""
import collections, gc, json, sys
from pdserve.sim import accel
compiled = sys.argv[1] == "compiled"
if compiled:
    assert accel.activate(), "no build"
from pdserve.dualpath.cost_model import DS_660B
from pdserve.sim.config import SimConfig
from pdserve.sim.scenarios import run_one
import pdserve.sim.cluster as cluster
out = {"cluster": cluster.__file__, "runs": {}}
gc.collect()
gc.set_debug(gc.DEBUG_SAVEALL)
for mode in ("basic", "layerwise", "dual_path", "dualpath", "split", "oracle"):
    r = run_one(SimConfig(num_prefill_nodes=1, num_decode_nodes=2, model=DS_660B, mode=mode, seed=3), "32k", 48)
    out["runs"][mode] = [repr(r.jct_s), repr(r.jct_mean_s), repr(float(r.ttft_s.sum())),
                         repr(float(r.tpot_s.sum())), r.num_turns_done, repr(r.snic_max_over_avg())]
gc.collect()
out["cyclic_garbage"] = collections.Counter(type(o).__name__ for o in gc.garbage)
print(json.dumps(out))
"""


def _python(code: str, cache_dir, *argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter whose build cache is `cache_dir`."""
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache_dir)}
    return subprocess.run(
        [sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True, timeout=timeout_s
    )


def _run(which: str, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, which], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_digest_covers_the_compiled_and_imported_sources(tmp_path, monkeypatch):
    pkg = tmp_path / "pdserve"
    shutil.copytree(accel.PACKAGE_ROOT, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(accel, "PACKAGE_ROOT", pkg)
    base = accel.source_digest()
    assert accel.source_digest() == base  # deterministic
    for rel in ("sim/cluster.py", "dualpath/scheduler.py", "sim/links.py", "dualpath/cost_model.py"):
        f = pkg / rel
        original = f.read_bytes()
        f.write_bytes(original + b"\n# edited\n")
        assert accel.source_digest() != base, rel  # an edit makes any existing build stale
        f.write_bytes(original)
    (pkg / "sim" / "cli.py").write_bytes(b"# not compiled, not imported by compiled code\n")
    assert accel.source_digest() == base


def test_the_build_analyses_exactly_the_digested_modules():
    # mypy follows only the modules the digest covers (the rest are skipped, their names `Any`). So
    # each pdserve module a compiled one imports must be among them: one that was not would compile
    # against `Any`, and an edit to it would not make the build stale.
    import ast

    digested = set(accel.DIGESTED_MODULES)
    for rel in accel.COMPILED:
        tree = ast.parse((accel.PACKAGE_ROOT / rel).read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("pdserve"):
                    assert name in digested, f"{rel} imports {name}: add it to accel.IMPORTED"
    sections = [line for line in accel.MYPY_CONFIG.splitlines() if line.startswith("[")]
    assert sections[0] == "[mypy]" and "follow_imports = skip" in accel.MYPY_CONFIG
    assert set(sections[1].removeprefix("[mypy-").removesuffix("]").split(",")) == digested


def test_no_build_means_pure_python(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert not accel.is_built()
    assert accel.build_dir().parent == tmp_path / "sim-mypyc"
    proc = _python("from pdserve.sim import accel; print(accel.activate(), accel.active(True))", tmp_path)
    assert proc.stdout.split() == ["False", "False"], proc.stderr


def test_activate_refuses_after_a_pure_import(tmp_path):
    # (in a fresh interpreter: this worker may have loaded a real build already, through another
    # test file's `pdserve simulate` under --accel auto, when one for these sources is in the cache)
    script = (
        "from pdserve.sim import accel\n"
        "marker = accel.build_dir() / 'BUILD_OK'\n"
        "marker.parent.mkdir(parents=True)\n"
        "marker.write_text('fake build')\n"
        "import pdserve.sim.cluster\n"
        "try:\n    accel.activate()\nexcept accel.AccelError as e:\n    print('refused', 'imported as Python' in str(e))\n"
    )
    proc = _python(script, tmp_path)
    assert proc.stdout.split() == ["refused", "True"], proc.stderr[-2000:]


def test_damaged_build_falls_back_to_pure_python(tmp_path):
    import sysconfig

    d = _python("from pdserve.sim import accel; print(accel.build_dir())", tmp_path).stdout.strip()
    so = Path(d) / "pdserve" / "sim" / ("cluster" + sysconfig.get_config_var("EXT_SUFFIX"))
    so.parent.mkdir(parents=True)
    so.write_bytes(b"not an ELF file")
    (Path(d) / "BUILD_OK").write_text("damaged\n")
    script = (
        "from pdserve.sim import accel\n"
        "try:\n    accel.activate()\nexcept accel.AccelError as e:\n    print('refused', 'does not import' in str(e))\n"
        "import pdserve.sim.cluster as c\nprint(c.__file__.endswith('cluster.py'), accel.active())\n"
    )
    proc = _python(script, tmp_path)
    assert proc.stdout.split() == ["refused", "True", "True", "False"], proc.stderr[-2000:]


@pytest.mark.timeout(1200)  # a cold mypyc build takes ~30 s on 2 cores, more on a loaded machine
@pytest.mark.skipif(
    not can_compile_simulator(), reason="needs mypyc (pip install mypy), a C compiler and Python.h"
)
def test_compiled_simulator_gives_identical_figures(simulator_build):
    # Started after collection (tests/conftest.py), over a damaged build where this one goes: `build`
    # must replace it, not trust its marker.
    cache, build = simulator_build
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(cache)}
    build.wait(timeout=900)
    assert build.returncode == 0, (cache / "build.log").read_text()[-4000:]
    pure, compiled = _run("pure", env), _run("compiled", env)
    assert pure["cluster"].endswith("cluster.py")
    assert compiled["cluster"].endswith(".so") and str(cache) in compiled["cluster"]
    assert compiled["runs"] == pure["runs"]  # every mode, to the last digit
    assert compiled["cyclic_garbage"] == pure["cyclic_garbage"] == {}
    assert all(r[4] > 0 for r in pure["runs"].values())
