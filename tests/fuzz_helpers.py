"""Shared knobs of the fuzz tests (test_fuzz_http / _messages / _store).

PDSERVE_FUZZ_SCALE multiplies every example count; PDSERVE_FUZZ_RANDOM=1 draws fresh examples instead
of the derandomized (reproducible) default."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("PDSERVE_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("PDSERVE_FUZZ_RANDOM", "") not in ("", "0")


def fuzz_settings(n: int, **extra) -> settings:
    """Hypothesis settings for `n` examples (scaled), no deadline, no example database."""
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=list(HealthCheck),
        **extra,
    )
