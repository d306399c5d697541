"""DualPath request scheduler: which prefill engine, which decode engine, which read path.

Who calls it: the router (and the simulator in ``pdserve.sim``, which runs this very module). The caller
owns a FIFO queue of pending requests; whenever the queue is non-empty and the engines' load changed, it
calls :meth:`DualPathScheduler.assign` with the queue head, then sends each returned assignment to its
engines and drops those requests from the queue. Engines report their load with the ``report_*``
methods (absolute values; a report overwrites the scheduler's optimistic view). Torch-free, no I/O.

Algorithms (paper arXiv 2602.21548 §6, Algorithm 1; see ``../shared/notes/dualpath.md``):

* **PE choice** - engines whose unfinished tokens exceed β are never chosen; among the rest prefer
  engines whose *node* read queue is ≤ α, else take the remaining ones; pick the fewest unfinished
  tokens. If no engine is under β the fetch stops (FIFO: later requests wait too).
* **DE choice** - phase 1: the request goes to the decode group with the fewest unfinished tokens;
  phase 2, inside the group: R = the fetch's requests for this group, from the head, whose pages fit the
  group's free pages; Z = z_factor x (sum of len(r) for r in R + sum of tok_e) / |E|. Among engines with
  enough free pages for r, a "low" engine has tok_e + len(r) ≤ Z; choose the low engine with the fewest
  unfinished requests, else the (high) engine with the fewest tokens. If no engine of the group has the
  pages the fetch stops.
* **Read path** - the side (PE node or DE node) whose read queue is shorter.
* **split** (the paper's future work) - one request's hit blocks are divided between both sides so both
  read queues end as level as possible (water filling: each side gets a share proportional to its
  headroom below the common level), in whole store blocks.

Deterministic tie-breaking (documented, tested): every ``min`` compares a tuple that ends with the
engine id or group id, so equal loads go to the lowest id; equal read queues choose the node that has
read fewer hit tokens so far (cumulative, our addition: it keeps SNICs level when queues drain), and
if that ties too, the PE path (the one that works without the DE's host buffer). Round robin starts at engine 0 and keeps
its cursor across fetches.

Length: ~790 lines because it holds both halves of Algorithm 1 (cross-engine placement and intra-PE
batch building under the compute quota) - the router and the PE import this one module - and the
placement keeps incremental heaps so a fetch at 1,000+ GPUs stays cheap (the simulator runs this very
code millions of times, hence the NamedTuple value types and the incremental bookkeeping).

Units: tokens are tokens; pages are engine KV pages (``page_tokens`` tokens each); blocks are store
blocks (``block_tokens`` tokens each). Read queues are in hit tokens waiting to be read at that node;
all storage NICs are assumed equal, so tokens compare like seconds.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

# Engine choice policies.
ENGINE_LOAD_AWARE = "load_aware"
ENGINE_ROUND_ROBIN = "round_robin"
ENGINE_CHOICES = (ENGINE_LOAD_AWARE, ENGINE_ROUND_ROBIN)

# Read path policies. "pe": always the PE's storage NIC (the Basic system). "alternate": PE, DE, PE, ...
# per assignment (dual path without the scheduler's queue view). "shorter_queue": paper's rule. "split":
# both sides, water filling.
READ_PE = "pe"
READ_ALTERNATE = "alternate"
READ_SHORTER_QUEUE = "shorter_queue"
READ_SPLIT = "split"
READ_CHOICES = (READ_PE, READ_ALTERNATE, READ_SHORTER_QUEUE, READ_SPLIT)

# Phase 1's key for a decode group with no live engine (it sinks below every other), and a pool
# size no request reaches (an engine that did not report its size).
DEAD_GROUP_TOKENS = 1 << 62
NO_BOUND_PAGES = 1 << 62

PATH_PE = "pe"
PATH_DE = "de"
PATH_SPLIT = "split"


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler knobs; baselines are this same code with parts switched off.

    alpha_tokens: a node whose read queue is ≤ this is preferred (paper: tokens readable in 3 s).
    beta_tokens: a PE with more unfinished tokens is never chosen (paper: tokens one GPU computes in 5 s).
    z_factor: DE "low token" threshold over the group mean (paper: 1.05).
    """

    alpha_tokens: int
    beta_tokens: int
    z_factor: float = 1.05
    engine_choice: str = ENGINE_LOAD_AWARE
    read_path: str = READ_SHORTER_QUEUE
    block_tokens: int = 64
    page_tokens: int = 16

    def __post_init__(self) -> None:
        if self.engine_choice not in ENGINE_CHOICES:
            raise ValueError(f"engine_choice must be one of {ENGINE_CHOICES}, got {self.engine_choice!r}")
        if self.read_path not in READ_CHOICES:
            raise ValueError(f"read_path must be one of {READ_CHOICES}, got {self.read_path!r}")
        if self.alpha_tokens < 0 or self.beta_tokens < 0:
            raise ValueError("alpha_tokens and beta_tokens must be >= 0")
        if self.block_tokens <= 0 or self.page_tokens <= 0:
            raise ValueError("block_tokens and page_tokens must be > 0")


# Named policies (what ``--policy`` selects). The simulator adds its own execution modes on top
# (layerwise prefill on/off, Oracle); the scheduler only knows engine choice and read path.
POLICY_KNOBS: dict[str, tuple[str, str]] = {
    "round_robin": (ENGINE_ROUND_ROBIN, READ_PE),  # Basic
    "round_robin_dual": (ENGINE_ROUND_ROBIN, READ_ALTERNATE),  # ablation: dual path, no scheduler
    "dualpath": (ENGINE_LOAD_AWARE, READ_SHORTER_QUEUE),
    "split": (ENGINE_LOAD_AWARE, READ_SPLIT),
}


def policy_config(name: str, *, alpha_tokens: int, beta_tokens: int, **kwargs) -> SchedulerConfig:
    """Config for a named policy; unknown names raise ValueError listing the known ones."""
    if name not in POLICY_KNOBS:
        raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICY_KNOBS)}")
    engine_choice, read_path = POLICY_KNOBS[name]
    return SchedulerConfig(
        alpha_tokens=alpha_tokens,
        beta_tokens=beta_tokens,
        engine_choice=engine_choice,
        read_path=read_path,
        **kwargs,
    )


class PendingRequest(NamedTuple):
    """One request waiting in the router's FIFO queue.

    num_hit_tokens: prompt tokens whose KV is in the store (to be read); num_new_tokens: the rest (to be
    computed by the PE); num_decode_tokens: the DE's token load (prompt + expected output), i.e. len(r).
    num_choices: how many decodes this prompt's KV goes to (the router's `n` choices of one prompt,
    placed once, each choice to a decode of its own): on the DE path each of those decodes reads the
    hit from its own node's store (up to n reads), on the PE path the choices share one prefill, whose
    reads of the same blocks join (one read); the read-path choice weighs that (`_choose_read_path`).
    Immutable value types here are NamedTuples: a simulated 1,000-GPU run creates millions of them and a
    tuple is ~5x cheaper to build than a frozen dataclass.
    """

    request_id: int
    num_hit_tokens: int
    num_new_tokens: int
    num_decode_tokens: int
    num_choices: int = 1

    def num_decode_pages(self, page_tokens: int) -> int:
        return -(-self.num_decode_tokens // page_tokens)


@dataclass
class EngineLoad:
    """The scheduler's view of one engine (seq_e, tok_e, free pages); node and group are fixed.
    `alive` False: the router's health checks lost it (the simulator's engines never die): it takes
    nothing (a dead prefill's tokens are held past β, so no choice by load can name it), and a dead
    decode's load counts neither in its group's sum nor in the group's Z (its
    node-mates stay placeable). `num_total_pages` (decodes; 0 = not reported, no bound): the most a
    request can ever take there, so that phase 1 does not send a request to a group none of whose
    engines could ever hold it (decodes of unequal pools)."""

    engine_id: int
    node_id: int
    group_id: int = 0
    num_seqs: int = 0
    num_tokens: int = 0
    num_free_pages: int = 0
    alive: bool = True
    num_total_pages: int = 0


class Assignment(NamedTuple):
    """Where one request goes. Read tokens say how many hit tokens each side's storage NIC reads."""

    request_id: int
    prefill_engine: int
    decode_engine: int
    read_path: str
    num_pe_read_tokens: int
    num_de_read_tokens: int


def _next_alive(
    engines: Sequence[EngineLoad], cursor: int, num_pages: int = 0
) -> tuple[int, EngineLoad] | None:
    """Round robin from `cursor`: (the cursor at the first alive engine whose pool could ever hold
    `num_pages`, that engine); None if none is."""
    n = len(engines)
    for k in range(n):
        e = engines[(cursor + k) % n]
        if e.alive and (not e.num_total_pages or e.num_total_pages >= num_pages):
            return cursor + k, e
    return None


def _checked_id(i: int, items: Sequence, what: str) -> int:
    """`i` if it names one of `items` (a negative one silently named the last engine or node)."""
    if not 0 <= i < len(items):
        raise ValueError(f"{what} id {i} is not in 0..{len(items) - 1}")
    return i


class DualPathScheduler:
    """Router-side scheduler. Mutates only its own load view; never blocks, never does I/O.

    Aggregates kept incrementally so a placement costs O(log nodes + log groups + engines per node),
    not O(engines): each PE node's least-loaded engine (recomputed when one of its engines changes) in a
    heap, each decode group's token and free-page sums in a heap, and the β slack of the PEs. Engine loads must
    therefore change only through ``report_*`` and ``assign`` (not by writing ``EngineLoad`` fields).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        prefill: Sequence[EngineLoad],
        decode: Sequence[EngineLoad],
        num_nodes: int,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode engine")
        for i, e in enumerate(prefill):
            if e.engine_id != i:
                raise ValueError("prefill engine ids must be 0..n-1 in order")
        for i, e in enumerate(decode):
            if e.engine_id != i:
                raise ValueError("decode engine ids must be 0..n-1 in order")
        # (an engine past the last node failed `assign` halfway, its cursors and loads already moved)
        if any(not 0 <= e.node_id < num_nodes for e in (*prefill, *decode)):
            raise ValueError(f"engine node ids must be 0..{num_nodes - 1}")
        self.config = config
        for e in prefill:
            if not e.alive:
                e.num_tokens = self._dead_prefill_tokens(e.num_tokens)
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.read_queue_tokens = [0] * num_nodes
        self.read_tokens_total = [0] * num_nodes  # hit tokens ever assigned to each node's SNIC
        # PE engines grouped by node: the PE choice scans nodes (read queue is per node), then engines.
        self._pe_by_node: dict[int, list[EngineLoad]] = {}
        for e in self.prefill:
            self._pe_by_node.setdefault(e.node_id, []).append(e)
        self._pe_nodes = sorted(self._pe_by_node)
        self._node_best: dict[int, EngineLoad | None] = dict.fromkeys(self._pe_nodes)
        self._pe_heap: list[tuple[int, int, int]] = []  # (best tok_e, engine id, node), lazy deletion
        for node in self._pe_nodes:
            self._refresh_node(node)
        self._de_by_group: dict[int, list[EngineLoad]] = {}
        for e in self.decode:
            self._de_by_group.setdefault(e.group_id, []).append(e)
        self._de_groups = sorted(self._de_by_group)
        self._group_tokens = {g: self._group_sum(g) for g in self._de_by_group}
        self._group_alive = {g: sum(e.alive for e in es) for g, es in self._de_by_group.items()}
        self._group_cap = {g: self._group_capacity(g) for g in self._de_by_group}
        self._any_group_bounded = min(self._group_cap.values()) < NO_BOUND_PAGES  # (not in the simulator)
        self._group_heap = [(t, g) for g, t in self._group_tokens.items()]
        heapq.heapify(self._group_heap)
        self._group_dirty: set[int] = set()  # groups whose token sum changed since the last fetch
        self._group_pages = {g: sum(e.num_free_pages for e in es) for g, es in self._de_by_group.items()}
        beta = config.beta_tokens
        self._beta_slack = sum(beta - e.num_tokens for e in self.prefill if e.num_tokens <= beta)
        self._beta_count = sum(1 for e in self.prefill if e.num_tokens <= beta)
        self._rr_prefill = 0
        self._rr_decode = 0
        self._alternate = 0

    # ---- load reports (absolute values; called by engines / the simulator) ----

    def report_prefill(self, engine_id: int, num_seqs: int, num_tokens: int, alive: bool = True) -> None:
        e = self.prefill[_checked_id(engine_id, self.prefill, "prefill")]
        e.num_seqs, e.alive = num_seqs, alive
        self._set_prefill_tokens(e, num_tokens if alive else self._dead_prefill_tokens(num_tokens))

    def _dead_prefill_tokens(self, num_tokens: int) -> int:
        """A dead prefill's tokens as kept: past β, so neither the PE choice nor β's slack counts it
        (it was chosen by load when reported with few tokens: a review, 2026-12-05)."""
        return max(num_tokens, self.config.beta_tokens + 1)

    def report_decode(
        self,
        engine_id: int,
        num_seqs: int,
        num_tokens: int,
        num_free_pages: int,
        alive: bool = True,
        num_total_pages: int | None = None,
    ) -> None:
        """`num_total_pages` None: as before (the simulator's engines never change size)."""
        e = self.decode[_checked_id(engine_id, self.decode, "decode")]
        g = e.group_id
        self._group_pages[g] += num_free_pages - e.num_free_pages
        e.num_free_pages = num_free_pages
        e.num_seqs = num_seqs
        if alive == e.alive and (num_total_pages is None or num_total_pages == e.num_total_pages):
            if num_tokens != e.num_tokens:
                if alive:
                    self._group_tokens[g] += num_tokens - e.num_tokens
                    self._group_dirty.add(g)  # its heap entry is pushed at the next fetch
                e.num_tokens = num_tokens
            return
        # (rare: an engine died, came back or changed size) the group's aggregates anew
        e.alive, e.num_tokens = alive, num_tokens
        if num_total_pages is not None:
            e.num_total_pages = num_total_pages
        self._group_alive[g] = sum(x.alive for x in self._de_by_group[g])
        self._group_tokens[g] = self._group_sum(g)
        self._group_cap[g] = self._group_capacity(g)
        self._any_group_bounded = min(self._group_cap.values()) < NO_BOUND_PAGES
        self._group_dirty.add(g)

    def _group_sum(self, g: int) -> int:
        """Phase 1's key: the group's live engines' tokens (a group with none sinks below every other)."""
        live = [e.num_tokens for e in self._de_by_group[g] if e.alive]
        return sum(live) if live else DEAD_GROUP_TOKENS

    def _group_capacity(self, g: int) -> int:
        """The most pages one request can ever take in group g (0: none alive; no bound if unreported)."""
        caps = [e.num_total_pages or NO_BOUND_PAGES for e in self._de_by_group[g] if e.alive]
        return max(caps, default=0)

    def report_read_queue(self, node_id: int, num_tokens: int) -> None:
        self.read_queue_tokens[_checked_id(node_id, self.read_queue_tokens, "node")] = num_tokens

    def _set_prefill_tokens(self, e: EngineLoad, num_tokens: int) -> None:
        beta = self.config.beta_tokens
        old = e.num_tokens
        if old <= beta:
            self._beta_slack -= beta - old
            self._beta_count -= 1
        e.num_tokens = num_tokens
        if num_tokens <= beta:
            self._beta_slack += beta - num_tokens
            self._beta_count += 1
        self._refresh_node(e.node_id, e, old)

    # ---- the fetch ----

    def assign(self, queue: Sequence[PendingRequest]) -> list[Assignment]:
        """Assign requests from the head of ``queue`` in order; stop at the first that cannot be placed.

        Returns the assignments (a prefix of ``queue``). The scheduler's view is updated as if each
        assignment had been applied: PE tok_e/seq_e, DE tok_e/seq_e/free pages, and the read queue of
        the node(s) that will read the hit tokens.
        """
        if not queue:
            return []
        if self.config.engine_choice == ENGINE_ROUND_ROBIN:
            return self._assign_round_robin(queue)
        return self._assign_load_aware(queue)

    def _assign_round_robin(self, queue: Sequence[PendingRequest]) -> list[Assignment]:
        """Basic: PEs and DEs in turn, skipping dead ones; the DE must still have the pages (else the
        fetch stops). (A dead decode has no free pages: waiting for it blocked the queue for good.)"""
        out: list[Assignment] = []
        page_tokens = self.config.page_tokens
        for req in queue:
            pages = req.num_decode_pages(page_tokens)
            # (a decode whose pool can never hold the request loses its turn: waiting for it held the
            # queue to its timeout, decodes of unequal pools, a review, 2026-12-05)
            de_turn, pe_turn = (
                _next_alive(self.decode, self._rr_decode, pages),
                _next_alive(self.prefill, self._rr_prefill),
            )
            if de_turn is None or pe_turn is None:
                break
            (de_cursor, de), (pe_cursor, pe) = de_turn, pe_turn
            if de.num_free_pages < pages:
                break
            self._rr_prefill, self._rr_decode = pe_cursor + 1, de_cursor + 1
            out.append(self._commit(req, pe, de, pages))
        return out

    def _prefill_room(self, queue: Sequence[PendingRequest]) -> int:
        """Upper bound on how many head requests the PEs can take in this fetch under β.

        An engine with tok_e ≤ β accepts requests until it passes β, i.e. at most
        floor((β - tok_e) / m) + 1 of them, m = the fewest new tokens in the queue head; summed over
        engines this is ≤ slack // m + count (no bound when a request has no new tokens: it leaves
        tok_e as it is). Phase 1 and Z then look only at requests this fetch could place, which keeps a
        fetch over a long blocked queue cheap. It never turns away a request the PE choice would
        accept, but it is also our reading of R in Z = 1.05 x mean: the requests being assigned now,
        not the whole queue; with the whole queue Z is higher and a DE choice can differ
        (``test_prefill_room_cut_with_beta_binding_places_what_algorithm_1_places``).
        """
        if self._beta_count == 0:
            return 0
        m = min(r.num_new_tokens for r in queue)
        if m == 0:
            return len(queue)  # a request with no new tokens leaves tok_e as it is: no bound
        return min(len(queue), self._beta_slack // m + self._beta_count)

    def _assign_load_aware(self, queue: Sequence[PendingRequest]) -> list[Assignment]:
        cfg = self.config
        page_tokens = cfg.page_tokens
        queue = queue[: self._prefill_room(queue)]
        if not queue:
            return []
        # Phase 1: each request to the decode group with the fewest tokens (ties: lowest group id);
        # the group's sum grows as requests are placed so one fetch spreads over groups.
        # A heap of (tokens, group id) with lazy deletion: an entry is live iff its tokens equal the
        # group's current (tentative) sum; min over it equals min over all groups by (tokens, id).
        group_tokens = self._group_tokens
        heap = self._group_heap
        dirty = self._group_dirty
        if len(heap) + len(dirty) > 4 * len(group_tokens) or 4 * len(dirty) > len(group_tokens):
            heap[:] = [(t, g) for g, t in group_tokens.items()]
            heapq.heapify(heap)
        else:  # one fresh entry per changed group, however many reports it had
            for g in dirty:
                heapq.heappush(heap, (group_tokens[g], g))
        dirty.clear()
        tentative: dict[int, int] = {}
        group_of: list[int] = []
        by_group: dict[int, list[PendingRequest]] = {}
        group_cap = self._group_cap
        bounded = self._any_group_bounded
        for i, req in enumerate(queue):
            while True:
                tok, g = heap[0]
                if tok == group_tokens[g] + tentative.get(g, 0):
                    break
                heapq.heappop(heap)
            if bounded and group_cap[g] < req.num_decode_pages(page_tokens):
                # No engine of the least-loaded group could ever hold it (unequal decode pools, or
                # the group is dead): the least-loaded group that could (a scan: rare).
                holding = self._least_loaded_group_holding(req.num_decode_pages(page_tokens), tentative)
                if holding is None:  # (none now: the fetch stops at it)
                    queue = queue[:i]
                    break
                g = holding
                tentative[g] = tentative.get(g, 0) + req.num_decode_tokens
                heapq.heappush(heap, (group_tokens[g] + tentative[g], g))
            else:
                tentative[g] = tentative.get(g, 0) + req.num_decode_tokens
                heapq.heapreplace(heap, (group_tokens[g] + tentative[g], g))
            group_of.append(g)
            by_group.setdefault(g, []).append(req)
        # Tentative sums end with the fetch; re-insert the real sums of the touched groups.
        for g in tentative:
            heapq.heappush(heap, (group_tokens[g], g))
        # Phase 2 thresholds: R = this group's requests from the head whose pages fit the group.
        z_by_group: dict[int, float] = {}
        for g, reqs in by_group.items():
            free_pages = self._group_pages[g]
            sum_len = 0
            for req in reqs:
                pages = req.num_decode_pages(page_tokens)
                if pages > free_pages:
                    break
                free_pages -= pages
                sum_len += req.num_decode_tokens
            total = sum_len + self._group_tokens[g]
            z_by_group[g] = cfg.z_factor * total / max(1, self._group_alive[g])  # (mean over live engines)

        out: list[Assignment] = []
        for req, g in zip(queue, group_of, strict=True):
            pe = self._choose_prefill()
            if pe is None:
                break
            pages = req.num_decode_pages(page_tokens)
            de = self._choose_decode(req, pages, self._de_by_group[g], z_by_group[g])
            if de is None:
                break
            out.append(self._commit(req, pe, de, pages))
        return out

    def _choose_prefill(self) -> EngineLoad | None:
        """Algorithm 1 PE choice: min over engines with tok_e ≤ β of (read_q(node) > α, tok_e, id).

        α is a node property, so only each node's best engine by (tok_e, id) can win. Nodes sit in a
        heap ordered by their best engine's (tok_e, id) (lazy deletion: an entry is live iff it matches
        the node's current best). Popping in that order, the first live node with read_q ≤ α is the
        answer; if none qualifies, the first live node popped is (the min of the "else the rest"
        category). Popped live entries are pushed back, so the heap is unchanged by a query.
        """
        alpha = self.config.alpha_tokens
        beta = self.config.beta_tokens
        rq = self.read_queue_tokens
        heap = self._pe_heap
        node_best = self._node_best
        if heap:  # fast path: the top entry is live and qualifies (no pops, same answer)
            tok, eid, node = heap[0]
            e = node_best[node]
            if e is not None and e.engine_id == eid and e.num_tokens == tok and tok <= beta:
                if rq[node] <= alpha:
                    return e
        popped: list[tuple[int, int, int]] = []
        chosen: EngineLoad | None = None
        fallback: EngineLoad | None = None
        while heap:
            tok, eid, node = heap[0]
            e = node_best[node]
            if e is None or e.engine_id != eid or e.num_tokens != tok:
                heapq.heappop(heap)  # stale
                continue
            if tok > beta:
                break  # every remaining node's best is over β
            popped.append(heapq.heappop(heap))
            if fallback is None:
                fallback = e
            if rq[node] <= alpha:
                chosen = e
                break
        for entry in popped:
            heapq.heappush(heap, entry)
        return chosen if chosen is not None else fallback

    def _refresh_node(self, node: int, changed: EngineLoad | None = None, old_tokens: int = 0) -> None:
        """Recompute node's best engine by (tok_e, id) after ``changed`` went from ``old_tokens``.

        Incremental: a non-best engine can only displace the best; the best engine stays best when its
        tokens fall; only when the best's tokens rise is the node rescanned. Same answer as a full min.
        """
        best = self._node_best[node]
        if changed is None or best is None:
            e = min(self._pe_by_node[node], key=_TOKENS_THEN_ID)
        elif changed is best:
            if changed.num_tokens <= old_tokens:
                e = best
            else:
                e = min(self._pe_by_node[node], key=_TOKENS_THEN_ID)
        elif (changed.num_tokens, changed.engine_id) < (best.num_tokens, best.engine_id):
            e = changed
        else:
            return  # best unchanged and its heap entry is still live
        self._node_best[node] = e
        heap = self._pe_heap
        heapq.heappush(heap, (e.num_tokens, e.engine_id, node))
        if len(heap) > 4 * len(self._pe_nodes) + 64:
            live = [(b.num_tokens, b.engine_id, n) for n, b in self._node_best.items() if b is not None]
            heap[:] = live
            heapq.heapify(heap)

    def _least_loaded_group_holding(self, pages: int, tentative: dict[int, int]) -> int | None:
        """Phase 1 restricted to groups with an engine whose pool could ever hold `pages`: min (tokens
        with this fetch's tentative ones, group id); None if no group could."""
        best: tuple[int, int] | None = None
        for g, cap in self._group_cap.items():
            if cap >= pages:
                key = (self._group_tokens[g] + tentative.get(g, 0), g)
                if best is None or key < best:
                    best = key
        return None if best is None else best[1]

    @staticmethod
    def _choose_decode(
        req: PendingRequest, pages: int, engines: list[EngineLoad], z: float
    ) -> EngineLoad | None:
        """Phase 2 inside the group: low-token engine with fewest requests, else fewest tokens.

        Low: min (seq_e, tok_e, id); high: min (tok_e, seq_e, id). ``engines`` is in id order, so a
        strict comparison on the first two keys keeps the lowest id on ties.
        """
        low: EngineLoad | None = None
        high: EngineLoad | None = None
        ls = lt = hs = ht = 0
        dt = req.num_decode_tokens
        for e in engines:
            if e.num_free_pages < pages or not e.alive:
                continue
            tok = e.num_tokens
            if tok + dt <= z:
                seq = e.num_seqs
                if low is None or seq < ls or (seq == ls and tok < lt):
                    low, ls, lt = e, seq, tok
            elif high is None or tok < ht or (tok == ht and e.num_seqs < hs):
                high, ht, hs = e, tok, e.num_seqs
        return low if low is not None else high

    def _commit(self, req: PendingRequest, pe: EngineLoad, de: EngineLoad, pages: int) -> Assignment:
        path, pe_read, de_read = self._choose_read_path(req, pe.node_id, de.node_id)
        pe.num_seqs += 1
        self._set_prefill_tokens(pe, pe.num_tokens + req.num_new_tokens)
        self.report_decode(
            de.engine_id, de.num_seqs + 1, de.num_tokens + req.num_decode_tokens, de.num_free_pages - pages
        )
        self.read_queue_tokens[pe.node_id] += pe_read
        self.read_queue_tokens[de.node_id] += de_read
        self.read_tokens_total[pe.node_id] += pe_read
        self.read_tokens_total[de.node_id] += de_read
        return Assignment(req.request_id, pe.engine_id, de.engine_id, path, pe_read, de_read)

    def _choose_read_path(self, req: PendingRequest, pe_node: int, de_node: int) -> tuple[str, int, int]:
        hit = req.num_hit_tokens
        mode = self.config.read_path
        if hit == 0 or mode == READ_PE:
            return PATH_PE, hit, 0
        if req.num_choices > 1:
            # n choices of one prompt: one joined read on the PE side, up to n on the DE side. The DE
            # side only where its queue with all n reads is still shorter (an idle decode SNIC beside
            # a loaded prefill one); elsewhere (the ablation's alternation, split) the PE side.
            q_pe, q_de = self.read_queue_tokens[pe_node], self.read_queue_tokens[de_node]
            if mode == READ_SHORTER_QUEUE and q_de + req.num_choices * hit < q_pe + hit:
                return PATH_DE, 0, hit  # (counted once, on the first choice's decode node)
            return PATH_PE, hit, 0
        if mode == READ_ALTERNATE:
            self._alternate += 1
            if self._alternate % 2 == 1:
                return PATH_PE, hit, 0
            return PATH_DE, 0, hit
        q_pe = self.read_queue_tokens[pe_node]
        q_de = self.read_queue_tokens[de_node]
        if mode == READ_SHORTER_QUEUE:
            # Equal queues (typically both empty when storage is not the bottleneck): the node that
            # has read fewer tokens so far, then the PE side. Without this, ties always favour the PE
            # nodes and their SNICs carry most of the load whenever the queues drain.
            key_pe = (q_pe, self.read_tokens_total[pe_node], 0)
            key_de = (q_de, self.read_tokens_total[de_node], 1)
            return (PATH_PE, hit, 0) if key_pe < key_de else (PATH_DE, 0, hit)
        pe_read = split_hit_tokens(hit, q_pe, q_de, self.config.block_tokens)
        if pe_read == hit:
            return PATH_PE, hit, 0
        if pe_read == 0:
            return PATH_DE, 0, hit
        return PATH_SPLIT, pe_read, hit - pe_read


_TOKENS_THEN_ID = attrgetter("num_tokens", "engine_id")  # min key: (tok_e, id)


def split_hit_tokens(
    num_hit_tokens: int, pe_queue_tokens: int, de_queue_tokens: int, block_tokens: int
) -> int:
    """Hit tokens the PE side reads under ``split``; the DE side reads the rest.

    Water filling: the common level is L = (q_pe + q_de + hit) / 2; each side's share is its headroom
    below L (clamped to [0, hit]), i.e. proportional to headroom. The PE share is rounded to whole store
    blocks, half a block rounding toward the PE side, and capped at ``hit``. Store hits are whole blocks,
    so both shares are whole blocks.
    """
    if num_hit_tokens <= 0:
        return 0
    ideal = (de_queue_tokens - pe_queue_tokens + num_hit_tokens) / 2.0
    ideal = min(max(ideal, 0.0), float(num_hit_tokens))
    blocks = math.floor(ideal / block_tokens + 0.5)
    return min(blocks * block_tokens, num_hit_tokens)


# ---- intra-PE batching ----


class PrefillItem(NamedTuple):
    """A request waiting on one PE: tokens already in KV (hit + previous chunks) and tokens to compute."""

    request_id: int
    num_cached_tokens: int
    num_new_tokens: int


class BatchPlan(NamedTuple):
    """What the PE runs next: whole requests plus, optionally, a first chunk of the next one."""

    items: tuple[PrefillItem, ...]
    chunk: PrefillItem | None  # the last request's first ``num_new_tokens`` (a page multiple)
    predicted_s: float


BatchCost = Callable[[Sequence[tuple[int, int]]], float]


class AdditiveBatchCost:
    """A batch cost of the form overhead + Σ item_cost(cached, new); lets the builder add incrementally.

    Any callable works as ``batch_cost_s``; this one only makes batch building O(n) instead of O(n²).
    """

    def __init__(self, overhead_s: float, item_cost_s: Callable[[int, int], float]) -> None:
        self.overhead_s = overhead_s
        self.item_cost_s = item_cost_s

    def __call__(self, pairs: Sequence[tuple[int, int]]) -> float:
        if not pairs:
            return 0.0
        return self.overhead_s + sum(self.item_cost_s(c, n) for c, n in pairs)


def _no_item_cost(num_cached_tokens: int, num_new_tokens: int) -> float:
    raise AssertionError("only additive batch costs have an item cost")


class _BatchSoFar:
    """The batch ``build_prefill_batch`` has built so far, to price it with one more (cached, new).

    A class, not closures over the builder's locals: compiled with mypyc (``pdserve.sim.accel``), a
    closure's environment and the closure refer to each other, so every batch built would leave a
    reference cycle that only the cyclic GC frees (the simulator pauses it while it runs)."""

    __slots__ = (
        "batch_cost_s",
        "additive",
        "overhead_s",
        "item_cost_s",
        "pairs",
        "items_s",
        "quota_s",
        "page_tokens",
    )

    def __init__(self, batch_cost_s: BatchCost, quota_s: float, page_tokens: int) -> None:
        self.batch_cost_s = batch_cost_s
        self.quota_s = quota_s
        self.page_tokens = page_tokens
        self.pairs: list[tuple[int, int]] = []
        self.items_s = 0.0  # Σ item costs so far (additive costs only)
        self.additive = False
        self.overhead_s = 0.0
        self.item_cost_s: Callable[[int, int], float] = _no_item_cost
        if isinstance(batch_cost_s, AdditiveBatchCost):
            self.additive = True
            self.overhead_s = batch_cost_s.overhead_s
            self.item_cost_s = batch_cost_s.item_cost_s

    def cost_with(self, cached: int, new: int) -> float:
        if self.additive:
            return self.overhead_s + self.items_s + self.item_cost_s(cached, new)
        return self.batch_cost_s(self.pairs + [(cached, new)])

    def fits(self, cached: int, num_pages: int) -> bool:
        """Does the batch plus the first ``num_pages`` pages of a request with ``cached`` tokens stay
        within the quota?"""
        return self.cost_with(cached, num_pages * self.page_tokens) <= self.quota_s

    def add(self, cached: int, new: int, item_s: float) -> None:
        """Put (cached, new) in the batch; ``item_s`` is its item cost (additive costs only)."""
        self.pairs.append((cached, new))
        if self.additive:
            self.items_s += item_s


def build_prefill_batch(
    waiting: Iterable[PrefillItem], batch_cost_s: BatchCost, quota_s: float, page_tokens: int = 16
) -> BatchPlan:
    """FIFO batch under a compute quota; the first request that does not fit is chunked to fit.

    ``batch_cost_s`` maps [(cached, new), ...] to predicted seconds (profiled cost model). Chunks are
    whole pages (non-final chunks send only whole pages). A search finds the largest page count that
    keeps the batch within quota (binary search; for additive costs it starts from a linear estimate
    and gallops, which finds the same page count in fewer cost evaluations since cost grows with the
    chunk). The batch is never empty when ``waiting`` is not: if even one page of the head request
    exceeds the quota, the head runs alone (one page, or whole if shorter) so the engine always makes
    progress. ``waiting`` may be any iterable (a lazy one is consumed only up to the chunk).
    """
    items: list[PrefillItem] = []
    so_far = _BatchSoFar(batch_cost_s, quota_s, page_tokens)
    additive, overhead_s, item_cost_s = so_far.additive, so_far.overhead_s, so_far.item_cost_s  # read-only
    cost = 0.0
    for it in waiting:
        one = 0.0
        if additive:  # same sum as cost_with, item cost evaluated once
            one = item_cost_s(it.num_cached_tokens, it.num_new_tokens)
            c = overhead_s + so_far.items_s + one
        else:
            c = so_far.cost_with(it.num_cached_tokens, it.num_new_tokens)
        if c <= quota_s:
            items.append(it)
            so_far.add(it.num_cached_tokens, it.num_new_tokens, one)
            cost = c
            continue
        # Chunk ``it``: largest n (page multiple, < new tokens) with cost(batch + (cached, n)) ≤ quota.
        max_pages = (it.num_new_tokens - 1) // page_tokens
        lo, hi = 0, max_pages
        if additive and hi > 0:
            lo, hi = _gallop_bracket(
                so_far.fits,
                it.num_cached_tokens,
                (quota_s - overhead_s - so_far.items_s) * it.num_new_tokens / one / page_tokens
                if one > 0
                else 0,
                hi,
            )
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if so_far.fits(it.num_cached_tokens, mid):
                lo = mid
            else:
                hi = mid - 1
        if lo > 0:
            n = lo * page_tokens
            chunk = PrefillItem(it.request_id, it.num_cached_tokens, n)
            return BatchPlan(tuple(items), chunk, so_far.cost_with(it.num_cached_tokens, n))
        if not items:
            # Progress guarantee: run one page of the head (or all of it when it is at most a page).
            n = min(page_tokens, it.num_new_tokens)
            if n == it.num_new_tokens:
                return BatchPlan((it,), None, c)
            chunk = PrefillItem(it.request_id, it.num_cached_tokens, n)
            return BatchPlan((), chunk, so_far.cost_with(it.num_cached_tokens, n))
        return BatchPlan(tuple(items), None, cost)
    return BatchPlan(tuple(items), None, cost)


def _gallop_bracket(
    fits: Callable[[int, int], bool], cached: int, estimate: float, max_pages: int
) -> tuple[int, int]:
    """Narrow [0, max_pages] around the largest m with fits(cached, m), from an estimate, by doubling
    steps.

    Returns (lo, hi) with fits(lo) or lo == 0, and not fits(m) for every m > hi; a binary search on it
    gives the same m as one on [0, max_pages] (fits is monotone: cost grows with the chunk).
    """
    lo, hi = 0, max_pages
    guess = min(max(int(estimate), 1), max_pages)
    step = 1
    if fits(cached, guess):
        lo = guess
        while lo < hi:
            nxt = min(lo + step, hi)
            if not fits(cached, nxt):
                return lo, nxt - 1
            lo = nxt
            step *= 2
        return lo, hi
    hi = guess - 1
    while lo < hi:
        nxt = max(hi - step, lo + 1)
        if fits(cached, nxt):
            return nxt, hi
        hi = nxt - 1
        step *= 2
    return lo, hi
