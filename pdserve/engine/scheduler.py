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
to be recomputed (mostly from the prefix cache) when it is readmitted. A waiting request that holds
pages (its KV came from elsewhere: `add_prefilled`) is released the same way when the head cannot be
admitted and nothing runs, which would otherwise leave the two waiting on each other for good.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.dualpath.scheduler import AdditiveBatchCost, PrefillItem, build_prefill_batch
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvcache.hashing import cached_keys
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
        self.num_prefix_waits = 0  # requests put off (at least once) for a page another was computing
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
                budget -= num_new
                i += 1
                continue
            break  # `req` itself was preempted: nothing behind it is left

        # A request is never scheduled twice: preempted ones wait for the next step. A request put off
        # for a page in flight keeps its place in `max_running` and its pages (those its uncached part
        # needs) from the requests admitted behind it, so it is not made to wait for their generations.
        deferred: list[Request] = []
        num_reserved_pages = 0
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(deferred) < self.max_running
            and not out.preempted
        ):
            req = self.waiting[0]
            hit_pages, hit_keys = self._prefix_hits(req)
            if self._waits_for_page_in_flight(req, len(hit_pages), self.running):
                # Its next page is being computed by a running prefill (the same prompt, e.g. n
                # choices or an RL group sent at once): wait for it to land in the prefix cache
                # instead of computing it again. Requests behind it may go ahead meanwhile.
                deferred.append(self.waiting.popleft())
                num_reserved_pages += self.kv.num_pages_for(req.num_tokens) - len(hit_pages)
                if not req.waited_for_prefix:
                    req.waited_for_prefix = True
                    self.num_prefix_waits += 1
                continue
            num_hit_tokens = len(hit_pages) * self.kv.page_size
            num_left = req.num_tokens - req.num_computed_tokens - num_hit_tokens
            num_new = min(num_left, budget)
            if (
                num_new < num_left
                and not self.running
                and not self.kv.can_allocate(req, num_left, hit_pages, num_reserved_pages)
                and self._release_a_waiting_holder()
            ):
                # Alone, and only a chunk of it fits: it would grow into the pages waiting holders
                # keep, preempt itself, and be admitted again with a chunk, for ever (the holders
                # are released only for a head that cannot be admitted at all; a review, 2026-12-04).
                continue
            if not self.kv.allocate(req, num_new, hit_pages, hit_keys, num_reserved_pages):
                if self.running or not self._release_a_waiting_holder():
                    break
                continue  # (nothing runs that could free pages: the head tries again with these)
            self.kv.record_admission(req, num_hit_tokens)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))  # back at the head, in their order
        return out

    def _waits_for_page_in_flight(self, req: Request, num_hit_pages: int, running) -> bool:
        """Whether the first full prompt page a waiting request would compute is one a request in
        `running` is still prefilling (it will publish it). Keys are chained, so equal keys at the
        same page index mean the same prefix. O(len(running)) per call."""
        if not (self.kv.enable_prefix_caching and self.config.share_in_flight_prefixes) or req.page_ids:
            return False
        if req.prompt_logprobs is not None:  # (it takes no hit on a first admission: see _prefix_hits)
            return False
        ps, h = self.kv.page_size, num_hit_pages
        if h >= (req.num_tokens - 1) // ps or h >= len(req.page_key_cache):  # (match_prefix filled it)
            return False
        key = req.page_key_cache[h]
        for r in running:
            first, end = r.num_computed_tokens // ps, r.num_prompt_tokens // ps  # its unpublished full pages
            if first <= h < end and r.num_computed_tokens < r.num_prompt_tokens:
                if cached_keys(r.page_key_cache, r.all_token_ids, ps, self.kv.root_for(r), end)[h] == key:
                    return True
        return False

    @property
    def max_running(self) -> int:
        """Requests running at once: `max_num_seqs`, and no more than a step's token budget, so that
        every running decode gets its token each step (more would leave the last ones none, step
        after step, until one ahead of them finished)."""
        return min(self.config.max_num_seqs, self.config.max_num_batched_tokens)

    def _prefix_hits(self, req: Request) -> tuple[list, list]:
        """Prefix-cache pages a waiting request would share at admission (read-only). A request that
        arrives with KV already in its pages (loaded from the store or another engine) is not matched
        against the prefix cache again; one that wants prompt logprobs computes its whole prompt (a
        cached token has no logits, as in vLLM), except, after a preemption, the part whose entries it
        already has."""
        if req.page_ids:
            return [], []
        hit_pages, hit_keys = self.kv.match_prefix(req)
        if req.prompt_logprobs is not None and len(req.prompt_logprobs) < req.num_prompt_tokens:
            # Only pages before the first missing entry (its logits come from the token before it).
            # Once every entry exists (after a preemption past the prompt) the whole cached context
            # is a hit: capped, a preempted request recomputed all its output tokens.
            n = (len(req.prompt_logprobs) - 1) // self.kv.page_size
            hit_pages, hit_keys = hit_pages[:n], hit_keys[:n]
        return hit_pages, hit_keys

    def _quota_tokens(self) -> int:
        """Tokens this step may compute under the compute quota: the DualPath batch builder over
        running requests, then waiting ones, in the order the loops below serve them. A waiting
        request is planned after the prefix hit its admission will take: the same tokens cost more
        over a longer cached context (planned from token 0, a step with a 2k-token hit ran 15% over)."""

        planned = list(self.running)

        def items():
            for i, r in enumerate(itertools.chain(self.running, self.waiting)):
                cached = r.num_computed_tokens
                if r.status == RequestStatus.WAITING:
                    num_hit_pages = len(self._prefix_hits(r)[0])
                    if self._waits_for_page_in_flight(r, num_hit_pages, planned):
                        continue  # put off by the admission loop: none of the step's tokens go to it
                    cached += num_hit_pages * self.kv.page_size
                    planned.append(r)
                yield PrefillItem(i, cached, r.num_tokens - cached)

        plan = build_prefill_batch(
            items(), self._cost, self.config.prefill_quota_s, page_tokens=self.kv.page_size
        )
        return sum(it.num_new_tokens for it in plan.items) + (plan.chunk.num_new_tokens if plan.chunk else 0)

    def retract_all(self) -> list[Request]:
        """Preempt every running request (a pause's "retract", AsyncEngine.pause): its pages freed, it
        goes back to the head of the waiting queue, the running ones in admission order ahead of those
        that waited already. Returns them."""
        victims, self.running = self.running, []
        for req in reversed(victims):
            self._preempt(req)
        return victims

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

    def _release_a_waiting_holder(self) -> bool:
        """Preempt the last waiting request, after the head, that holds pages (its KV came from another
        engine or the store: `add_prefilled`); False if there is none. Called when the head cannot be
        admitted and nothing runs: admission is FIFO, so those pages would otherwise wait behind the
        head forever, and the head for them (a decode whose only running request outgrew the pool and
        was preempted, with committed requests queued behind it). The released request keeps its
        place and recomputes, mostly from its pages, now in the prefix cache, as any preempted one."""
        for req in reversed(self.waiting):
            if req is self.waiting[0]:
                return False
            if req.page_ids:
                self.kv.free(req)
                req.num_preemptions += 1
                self.num_preemptions += 1
                return True
        return False

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
