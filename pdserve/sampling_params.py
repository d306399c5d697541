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
    # Token-dependent logits processors (model/logits_processors.py; vLLM v1's formulas and order).
    min_tokens: int = 0  # no EOS / stop token (nor stop string match) before this many output tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt or output (HF/CTRL form)

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
        self.logit_bias = _token_bias(self.logit_bias)
        _check(
            isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool),
            "min_tokens must be an integer",
            self.min_tokens,
        )
        for name in ("max_tokens", "top_k", "logprobs", "seed"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, int) and not isinstance(value, bool)),
                f"{name} must be an integer",
                value,
            )
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
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
        _check(self.min_tokens >= 0, "min_tokens must be >= 0", self.min_tokens)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens must be <= max_tokens ({self.max_tokens})",
            self.min_tokens,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2]", value)
        _check(
            0.0 < self.repetition_penalty < math.inf,
            "repetition_penalty must be finite and > 0",
            self.repetition_penalty,
        )
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


def _token_bias(bias) -> dict[int, float]:
    """logit_bias as {token id: bias}: JSON keys are strings ("50256"), so digit strings are accepted;
    biases must lie in [-100, 100] (OpenAI's range; vLLM clamps, we refuse)."""
    if bias is None:
        return {}
    _check(isinstance(bias, dict), "logit_bias must be a map of token id to bias", bias)
    out: dict[int, float] = {}
    for key, value in bias.items():
        tok = key
        if isinstance(key, str) and key.isascii() and key.isdigit():
            tok = int(key)
        _check(
            isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0, "bad logit_bias token id", key
        )
        _check(
            isinstance(value, int | float) and not isinstance(value, bool) and -100.0 <= value <= 100.0,
            "logit_bias values must be numbers in [-100, 100]",
            value,
        )
        out[tok] = float(value)
    return out


def _check(ok: bool, message: str, value) -> None:
    if not ok:
        raise ValueError(f"{message}, got {value!r}")
