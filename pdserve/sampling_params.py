"""Per-request sampling settings, shaped like vLLM's `SamplingParams`. Pure Python.

Invalid values raise `ValueError` at construction, so a bad request is refused before it touches any
engine state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to max_model_len
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token plus top-n
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        self.stop = self.stop if self.stop is not None else []
        _check(
            isinstance(self.stop_token_ids, list | tuple | type(None)),
            "stop_token_ids must be a list",
            self.stop_token_ids,
        )
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("max_tokens", "top_k", "logprobs", "seed"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and not isinstance(value, bool)),
                f"{name} must be an integer",
                value,
            )
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and not isinstance(value, bool),
                f"{name} must be a number",
                value,
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"{name} must be a boolean", value)
        _check(isinstance(self.stop, list), "stop must be a string or a list of strings", self.stop)
        if self.top_k == -1:
            self.top_k = 0
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be >= 1", self.max_tokens)
        _check(0.0 <= self.temperature < math.inf, "temperature must be finite and >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", self.top_p)
        _check(0 <= self.top_k < 2**63, "top_k must be -1, 0 (disabled) or >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", self.min_p)
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
            self.logprobs,
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty", self.stop)
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "bad stop_token_ids",
            self.stop_token_ids,
        )
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**64, "seed must be in [-2**63, 2**64)", self.seed
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _check(ok: bool, message: str, value) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")
