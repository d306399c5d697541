"""Continuous batching with chunked prefill and preemption by recompute. Pure Python.

One step has a token budget (`max_num_batched_tokens`). Running requests are served first, in
admission order: a decode takes 1 token, an unfinished prefill takes as much of its remaining prompt
as the budget allows (so prefill chunks and decodes share a step). Waiting requests are then admitted
FIFO while budget, `max_num_seqs` and pages last; admission first matches the prefix cache.

A waiting request whose next prompt page is being computed by a running prefill (the same prompt
sent n times at once: n choices, an RL group) is put off until that page is in the prefix cache,
rather than computing it again; the requests behind it are admitted meanwhile (SGLang's in-batch
prefix caching has the same aim).

When a running request cannot grow, the most recently admitted running request is preempted: its
pages are released and it goes back to the head of the waiting queue with its generated tokens kept,
to be recomputed (mostly from the prefix cache) when it is readmitted.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.dualpath.scheduler import AdditiveBatchCost, PrefillItem, build_prefill_batch
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvcache.kv_manager import KVManager


@dataclass
class SchedulerOutput:
    """What the model runner computes this step: for each request, tokens [start, start + n)."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefix_waits = 0  # admissions put off for a page another request was computing
        self._cost = (
            AdditiveBatchCost(config.prefill_overhead_s, config.prefill_cost_s)
            if config.prefill_quota_s is not None
            else None
        )

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self._cost is not None:
            budget = min(budget, self._quota_tokens())
        scheduled: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                scheduled.add(req.request_id)
                budget -= num_new
                i += 1
                continue
            break  # `req` itself was preempted: nothing behind it is left

        # A request is never scheduled twice: preempted ones wait for the next step.
        in_flight: set | None = None  # keys of prompt pages running prefills are computing (lazy)
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not out.preempted:
            req = self.waiting[0]
            hit_pages, hit_keys = self._prefix_hits(req)
            next_key = self._next_prompt_page_key(req, len(hit_pages))
            if next_key is not None:
                if in_flight is None:
                    in_flight = set().union(*(self._in_flight_keys(r) for r in self.running))
                if next_key in in_flight:
                    # Its next page is being computed by a running prefill (the same prompt, e.g. n
                    # choices or an RL group sent at once): wait for it to land in the prefix cache
                    # instead of computing it again. Requests behind it may go ahead meanwhile.
                    deferred.append(self.waiting.popleft())
                    self.num_prefix_waits += 1
                    continue
            num_hit_tokens = len(hit_pages) * self.kv.page_size
            num_new = min(req.num_tokens - req.num_computed_tokens - num_hit_tokens, budget)
            if not self.kv.allocate(req, num_new, hit_pages, hit_keys):
                break
            self.kv.record_admission(req, num_hit_tokens)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            budget -= num_new
            if in_flight is not None:
                in_flight |= self._in_flight_keys(req)
        self.waiting.extendleft(reversed(deferred))  # back at the head, in their order
        return out

    def _next_prompt_page_key(self, req: Request, num_hit_pages: int):
        """Key of the first full prompt page a waiting request would compute (None: no such page, or
        no prefix caching, or its KV came from elsewhere). `match_prefix` cached the keys."""
        if not (self.kv.enable_prefix_caching and self.config.share_in_flight_prefixes) or req.page_ids:
            return None
        max_pages = (req.num_tokens - 1) // self.kv.page_size
        if num_hit_pages >= max_pages or num_hit_pages >= len(req.page_key_cache):
            return None
        return req.page_key_cache[num_hit_pages]

    def _in_flight_keys(self, req: Request) -> set:
        """Keys of the full prompt pages a running request has yet to compute (it will publish them)."""
        ps = self.kv.page_size
        if not self.kv.enable_prefix_caching or req.num_computed_tokens >= req.num_prompt_tokens:
            return set()
        first = req.num_computed_tokens // ps
        return set(req.page_key_cache[first : (req.num_prompt_tokens - 1) // ps])

    @property
    def max_running(self) -> int:
        """Requests running at once: `max_num_seqs`, and no more than a step's token budget, so that
        every running decode gets its token each step (more would leave the last ones none, step
        after step, until one ahead of them finished)."""
        return min(self.config.max_num_seqs, self.config.max_num_batched_tokens)

    def _prefix_hits(self, req: Request) -> tuple[list, list]:
        """Prefix-cache pages a waiting request would share at admission (read-only). A request that
        arrives with KV already in its pages (loaded from the store or another engine) is not matched
        against the prefix cache again."""
        return ([], []) if req.page_ids else self.kv.match_prefix(req)

    def _quota_tokens(self) -> int:
        """Tokens this step may compute under the compute quota: the DualPath batch builder over
        running requests, then waiting ones, in the order the loops below serve them. A waiting
        request is planned after the prefix hit its admission will take: the same tokens cost more
        over a longer cached context (planned from token 0, a step with a 2k-token hit ran 15% over)."""

        def item(i: int, r: Request) -> PrefillItem:
            cached = r.num_computed_tokens
            if r.status == RequestStatus.WAITING:
                cached += len(self._prefix_hits(r)[0]) * self.kv.page_size
            return PrefillItem(i, cached, r.num_tokens - cached)

        items = (item(i, r) for i, r in enumerate(itertools.chain(self.running, self.waiting)))
        plan = build_prefill_batch(
            items, self._cost, self.config.prefill_quota_s, page_tokens=self.kv.page_size
        )
        return sum(it.num_new_tokens for it in plan.items) + (plan.chunk.num_new_tokens if plan.chunk else 0)

    def _preempt(self, req: Request) -> None:
        # Safe for a PD prefill request with page writes in flight: each write holds its own reference
        # on the pages it reads until the transfer is reported (PrefillRole.pinned), so these pages are
        # not reallocated under it. Such a victim frees little at once (its pinned pages return when
        # the writes are reported, within the transfer's deadline); the caller may then preempt another.
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def add_prefilled(self, req: Request) -> None:
        """Queue a request whose prompt KV is already in its pages (decode side of PD, after the
        transfer). It waits FIFO like any request, so `max_running` bounds the batch; admission does
        not match it against the prefix cache and computes only its next token."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus, free_pages: bool = True) -> None:
        """Remove a request from whichever queue holds it and (unless told not to) release its pages."""
        if req.status == RequestStatus.RUNNING and req in self.running:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        if free_pages:
            self.kv.free(req)
        req.status = status
