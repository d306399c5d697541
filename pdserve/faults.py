"""Fault injection points, compiled in and off by default (issue 7).

Who calls what:
* code on a fault point calls `faults.check(POINT, kind)` behind `if faults.ENABLED:` — one global
  read when off, so production pays nothing;
* a process enables rules from `$PDSERVE_FAULTS` at import (JSON, below) or with `configure(rules)`;
  an engine started with `--enable-fault-injection` also accepts `POST /debug/faults` (the chaos suite
  switches rules on a running cluster that way) — never without that flag.

A rule: `{"point": "control.send", "action": "drop", "kind": "kv_request", "prob": 1.0, "count": 1,
"skip": 0, "delay_s": 0.5}` — `kind` narrows the point (a message kind, "read" / "write"), `prob`
fires it at random (seeded by `seed`), `count` limits how many times it fires (None: forever), `skip`
lets that many matching calls through first (a test that needs "some pages sent, the rest in flight"
gets it deterministically, not by racing the transfer).

Points and the actions each honours:
| point            | actions                                   | where                          |
|------------------|-------------------------------------------|--------------------------------|
| control.send     | drop, delay, duplicate, reorder           | disagg/control.py (send)       |
| transfer.submit  | fail, stall (never completes)             | transfer/agent.py              |
| store.read       | fail, corrupt, slow (per block, any I/O)  | store/block_store.py, nixl_io  |
| store.write      | fail, slow, full (disk full: ENOSPC)      | store/block_store.py           |
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass

POINT_ACTIONS: dict[str, tuple[str, ...]] = {
    "control.send": ("drop", "delay", "duplicate", "reorder"),
    "transfer.submit": ("fail", "stall"),
    "store.read": ("fail", "corrupt", "slow"),
    "store.write": ("fail", "slow", "full"),
}
ENV = "PDSERVE_FAULTS"

ENABLED = False  # read on every fault point: keep it a plain module global


class FaultConfigError(ValueError):
    """A rule names an unknown point or an action its point does not honour."""


@dataclass
class FaultRule:
    point: str
    action: str
    kind: str = ""  # "" matches every kind
    prob: float = 1.0
    count: int | None = None
    skip: int = 0
    delay_s: float = 0.0
    fired: int = 0
    skipped: int = 0

    def __post_init__(self) -> None:
        if self.point not in POINT_ACTIONS:
            raise FaultConfigError(f"unknown fault point {self.point!r}; known: {sorted(POINT_ACTIONS)}")
        if self.action not in POINT_ACTIONS[self.point]:
            raise FaultConfigError(
                f"point {self.point} honours {POINT_ACTIONS[self.point]}, not {self.action!r}"
            )
        if (
            not 0.0 <= self.prob <= 1.0
            or self.delay_s < 0
            or self.skip < 0
            or (self.count is not None and self.count < 0)
        ):
            raise FaultConfigError("prob must be in [0, 1], delay_s >= 0, count >= 0, skip >= 0")


_COUNTERS = ("fired", "skipped")  # state, not configuration: a snapshot fed back starts them at 0
_lock = threading.Lock()
_rules: list[FaultRule] = []
_rng = random.Random(0)


def configure(rules: list[dict] | None, seed: int = 0) -> list[FaultRule]:
    """Replace every rule (None or [] turns injection off). Raises FaultConfigError, changing nothing."""
    global ENABLED
    parsed = [FaultRule(**{k: v for k, v in r.items() if k not in _COUNTERS}) for r in (rules or [])]
    with _lock:
        _rules[:] = parsed
        _rng.seed(seed)
        ENABLED = bool(parsed)
    return parsed


def check(point: str, kind: str = "") -> FaultRule | None:
    """The first rule of `point` matching `kind` that fires now (counted), else None."""
    with _lock:
        for rule in _rules:
            if rule.point != point or (rule.kind and rule.kind != kind):
                continue
            if rule.count is not None and rule.fired >= rule.count:
                continue
            if rule.skipped < rule.skip:
                rule.skipped += 1
                continue
            if rule.prob < 1.0 and _rng.random() >= rule.prob:
                continue
            rule.fired += 1
            return rule
    return None


def snapshot() -> list[dict]:
    with _lock:
        return [dict(r.__dict__) for r in _rules]


def _from_env() -> None:
    spec = os.environ.get(ENV)
    if spec:
        configure(json.loads(spec))


_from_env()
