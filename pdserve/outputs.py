"""Results as the offline API and the servers return them (shaped like vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.request import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: dict = field(default_factory=dict)  # arrival/first/last token times (monotonic s)
