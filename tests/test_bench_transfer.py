"""`pdserve bench transfer` end to end (small): bytes verified on the receiver, one table row per case."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.transfer.nixl_backend import nixl_available


@pytest.mark.skipif(not nixl_available(), reason="NIXL not installed")
def test_bench_transfer_runs_rounds_and_prints_one_row_per_case():
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "transfer"]
    cmd += ["--page-kib", "4", "64", "--total-mib", "4", "--repeats", "2", "--rounds", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert "ratio per round" in table[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    # contiguous direct, scattered direct, scattered staged -- per page size, once (not once per round)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (k, case, path)
        for k in ("4", "64")
        for case, path in (("contiguous", "direct"), ("scattered", "direct"), ("scattered", "staged"))
    ]
    for r in rows:
        assert len(r[-1].split()) == 2  # one ratio per round
        assert float(r[4]) > 0 and float(r[5]) > 0  # GB/s of nixl and of the copy
    contiguous = {r[0]: r for r in rows if r[1] == "contiguous"}
    assert contiguous["4"][3] == "2" and contiguous["64"][3] == "2"  # merged: one descriptor per region
