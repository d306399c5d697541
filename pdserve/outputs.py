"""Results as the offline API and the servers return them (shaped like vLLM's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

from pdserve.engine.request import TokenLogprob


class GrowingPrefix(Sequence):
    """A read-only view of the first `n` items of a list that is only ever appended to (a running
    request's output tokens or logprobs). The engine hands one out for every running request at every
    step: a copy there cost O(output) per request and step (64 requests of 32k tokens with logprobs:
    ~56 ms of the engine thread per step). Indexing, slices (lists), iteration and `len` see exactly
    the first `n` items whatever is appended later; it compares equal to a list or tuple of the same
    items, and `list(view)` copies it."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list, n: int | None = None) -> None:
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            if i.step is not None and i.step < 0:  # (indices() gives stop -1 here: "the end" to a list)
                return [self._items[j] for j in range(self._n)[i]]
            return self._items[slice(*i.indices(self._n))]
        return self._items[range(self._n)[i]]  # (negative indices count from n; IndexError past it)

    def __iter__(self):
        return islice(self._items, self._n)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, GrowingPrefix)):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]  # a list once finished; while running, a `GrowingPrefix`
    logprobs: Sequence[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (with logprobs)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: dict = field(default_factory=dict)  # arrival/first/last token times (monotonic s)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None, token i's given tokens < i, ...]
