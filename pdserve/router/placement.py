"""The router's DualPath placement: a FIFO of waiting requests fed to `pdserve.dualpath.scheduler`.

Who calls what (all on the router's event loop, so no locks):
* the load poller calls `on_load(engine, report)` with each engine's `/pd/load` report (every
  `--load-interval-s`, default 50 ms) and `on_health(engine)` when its health changes;
* `Router.dispatch` awaits `place(...)` for every request; the request waits in the FIFO until the
  scheduler assigns it (prefill engine, decode engine, read path) — the very scheduler module the
  simulator runs (`pdserve simulate`), with the same named policies (`round_robin` = Basic, `dualpath`,
  `round_robin_dual`);
* after each load report and each arrival, `_pump()` runs one fetch over the queue head.

Hit tokens: the scheduler needs each request's hit tokens (stored KV to read) before any engine sees
it; the router estimates them from the prompts it has routed (`router/prompts.py`, `PrefixIndex`).

Dead engines: a dead prefill is reported `alive` False (never chosen); a dead decode
is reported `alive` False: it takes nothing, and its load counts neither in its group's token sum nor
in the group's Z, so its live node-mates are placed as if it were not there (a fake huge load there
once took them out of placement, and made every one of them "low" under Z); a request only a dead
decode could hold is refused at once. `round_robin` ignores loads: it skips engines reported dead,
and `Router` re-picks a live engine when the scheduler named one that died since its last report.
Each decode's pool size goes to the scheduler too: phase 1 never sends a request to a group none of
whose engines could ever hold it (decodes of unequal pools; it waited there to the queue timeout).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.dualpath.scheduler import (
    POLICY_KNOBS,
    Assignment,
    DualPathScheduler,
    EngineLoad,
    PendingRequest,
    policy_config,
)
from pdserve.router.prompts import DEFAULT_PLACEMENT_TOKENS, PrefixIndex

REAL_POLICIES = tuple(p for p in POLICY_KNOBS if p != "split")
# A request that reaches a router whose first load reports are not all in waits this long for them
# (a freshly started router answers /health before its poller's first round: its first requests
# were 503s).
FIRST_REPORTS_WAIT_S = 5.0
UNLIMITED_TOKENS = 1 << 40
ALPHA_READ_S = 3.0  # paper: a node is preferred when its read queue is readable within 3 s
# An assignment counts in its node's read queue until a report taken this long after it (the request
# reached the engine by then: router -> engine dispatch is a loopback HTTP call, milliseconds).
DISPATCH_MARGIN_S = 0.05
RECENT_READ_KEEP_S = 2.0


def _after_report(ledger: deque, report_s: float) -> list[tuple]:
    """The entries (wall time first) of a ledger of what this router assigned that a report taken at
    `report_s` cannot show yet: those after `report_s - DISPATCH_MARGIN_S` (the engine had them by
    then). Entries older than RECENT_READ_KEEP_S before the report are dropped for good."""
    while ledger and ledger[0][0] < report_s - RECENT_READ_KEEP_S:
        ledger.popleft()
    return [entry for entry in ledger if entry[0] > report_s - DISPATCH_MARGIN_S]


class PlacementError(Exception):
    """A request that can never be placed (bigger than every decode engine's pool): a 400."""

    status = 400


class NotPlaceableNow(PlacementError):
    """No placement is possible now (no load report yet, or no live engine of a role): a 503, the
    client's to retry. Waiting instead held the client until the queue timeout (10 minutes)."""

    status = 503


def _only_down_decodes(num_pages: int, what: str = "") -> NotPlaceableNow:
    """A request no live decode can hold, though one out of service could: the outage's 503."""
    return NotPlaceableNow(
        f"{what}needs {num_pages} KV pages: only a decode engine out of service has that many; retry shortly"
    )


class PlacementAborted(Exception):
    """`abort_waiting` ended the wait: an `/abort_request` of everything reached the router."""


class Placed(NamedTuple):
    """What `place` returns: the scheduler's assignment, and the prompt's keys in the hit index
    (block keys of a token-id prompt, piece keys of a text or chat one) for `Placement.record`."""

    assignment: Assignment
    prompt_keys: list[bytes]


@dataclass
class _Waiting:
    pending: PendingRequest
    future: asyncio.Future
    num_pages: int = 0  # KV pages it needs on a decode (prompt + max_tokens - 1)
    name: tuple[str, ...] = ()  # the client's names for it (router/app.py client_name): named aborts


class Placement:
    def __init__(
        self,
        policy: str,
        prefills: list,
        decodes: list,
        alpha_tokens: int | None = None,
        beta_tokens: int | None = None,
        queue_timeout_s: float = 600.0,
    ) -> None:
        if policy == "split":
            raise ValueError(
                "policy 'split' exists only in the simulator: it gains at most ~0.5% there and loses up to"
                " ~6% on small clusters (docs/simulation.md), so the real read paths do not implement it"
            )
        if policy not in REAL_POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {list(REAL_POLICIES)}")
        for name, value in (("alpha_tokens", alpha_tokens), ("beta_tokens", beta_tokens)):
            if value is not None and value < 0:  # (else refused only when the scheduler is built: in
                raise ValueError(f"{name} must be >= 0, got {value}")  # the load poller, unseen)
        self.policy = policy
        self.prefills, self.decodes = prefills, decodes
        self.alpha_tokens, self.beta_tokens = alpha_tokens, beta_tokens
        self.queue_timeout_s = queue_timeout_s
        self.reports: dict[str, dict] = {}  # engine url -> last /pd/load report
        self.scheduler: DualPathScheduler | None = None
        self.index: PrefixIndex | None = None
        self.node_ids: dict[str, int] = {}
        self.built_nodes: dict[str, str] = {}  # engine URL -> the node the scheduler was built with
        self.queue: list[_Waiting] = []
        self._ids = itertools.count()
        self.num_placed = 0
        self.read_paths = {"pe": 0, "de": 0}

    # ---- reports ---------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Every healthy engine has reported, and at least one prefill and one decode have. An engine
        that is down at start stands on a node of its own until its first report (which rebuilds)."""
        engines = self.prefills + self.decodes
        return (
            all(e.url in self.reports for e in engines if e.healthy)
            and any(e.url in self.reports for e in self.prefills)
            and any(e.url in self.reports for e in self.decodes)
        )

    def _report(self, engine) -> dict:
        """The engine's last report, or a placeholder (no pages, own node) for one never heard from."""
        r = self.reports.get(engine.url)
        if r is not None:
            return r
        any_report = next(iter(self.reports.values()))
        return any_report | {
            "node": f"unreported:{engine.url}",
            "num_seqs": 0,
            "num_tokens": 0,
            "num_free_pages": 0,
            "num_total_pages": 0,
            "read_queue_tokens": 0,
            "planned_read_tokens": 0,
            "node_read_queue_bytes": -1,
        }

    def _build(self) -> None:
        """The scheduler, once every engine has reported (node names, page and block sizes)."""
        engines = self.prefills + self.decodes
        self.built_nodes = {e.url: self._report(e)["node"] for e in engines}
        nodes = sorted(set(self.built_nodes.values()))
        self.node_ids = {n: i for i, n in enumerate(nodes)}
        any_report = next(iter(self.reports.values()))
        page_tokens, block_tokens = any_report["page_size"], any_report["kv_block_size"]
        alpha = self.alpha_tokens
        if alpha is None:
            rates = [r["snic_bytes_per_s"] for r in self.reports.values() if r["snic_bytes_per_s"] > 0]
            alpha = (
                int(ALPHA_READ_S * min(rates) / max(1, any_report["kv_bytes_per_token"]))
                if rates
                else UNLIMITED_TOKENS
            )
        config = policy_config(
            self.policy,
            alpha_tokens=alpha,
            beta_tokens=self.beta_tokens if self.beta_tokens is not None else UNLIMITED_TOKENS,
            block_tokens=block_tokens,
            page_tokens=page_tokens,
        )
        decode_nodes = sorted({self._report(e)["node"] for e in self.decodes})
        self.scheduler = DualPathScheduler(
            config,
            [EngineLoad(i, self.node_ids[self._report(e)["node"]]) for i, e in enumerate(self.prefills)],
            [
                EngineLoad(
                    i,
                    self.node_ids[self._report(e)["node"]],
                    decode_nodes.index(self._report(e)["node"]),
                )
                for i, e in enumerate(self.decodes)
            ],
            num_nodes=len(nodes),
        )
        self.index = PrefixIndex(block_tokens)
        self._recent_reads = [deque() for _ in nodes]  # per node: (wall time, hit tokens) assigned
        # Per engine URL: (wall time, seqs, tokens, pages) this router booked on it, kept as the reads
        # are: a report taken before an assignment reached its engine put back the engine's tokens
        # and a decode's pages, and the next placement booked those pages again (a review, 2026-12-05).
        self._recent_books: dict[str, deque] = {e.url: deque() for e in engines}
        for e in self.prefills + self.decodes:
            self._apply(e)

    def on_load(self, engine, report: dict) -> None:
        self.reports[engine.url] = report
        if self.scheduler is None or report["node"] != self.built_nodes.get(engine.url):
            # First build, or an engine on another node than the scheduler has it: one we had never
            # heard from (built on a placeholder node: it was down; its node-mates' node may exist
            # already, and checking only for a new node left it on the placeholder for good, its reads
            # booked there: a review, 2026-12-04), or one restarted on another node. Rebuild; the
            # scheduler's optimistic state is replaced by the reports anyway.
            if self.ready():
                self._build()
                self._pump()
            return
        self._apply(engine)
        self._pump()

    def on_health(self, engine) -> None:
        if self.scheduler is not None:
            self._apply(engine)
            try:
                self._check_live()
            except NotPlaceableNow as e:  # the last live engine of a role died: nobody can be placed
                why = str(e)
                self._end_waiting(lambda w: True, lambda w: NotPlaceableNow(why))
                return
            biggest = self._biggest_live_decode()  # (... or the only one big enough for some)
            self._end_waiting(lambda w: w.num_pages > biggest, lambda w: _only_down_decodes(w.num_pages))
            self._pump()
        elif self.reports and self.ready():  # the engine everyone waited for was declared dead
            self._build()
            self._pump()

    def _apply(self, engine) -> None:
        s, r = self.scheduler, self._report(engine)
        # Placeable once healthy *and* heard from: a decode back up but not yet reported stood in the
        # scheduler with no pages and no bound on its pool, the least loaded group, and the queue
        # stopped on it until its first report.
        live = engine.healthy and engine.url in self.reports
        seqs, tokens, pages = self._booked_since(engine.url, r["time_s"])
        if engine.role == "prefill":
            i = self.prefills.index(engine)
            s.report_prefill(i, r["num_seqs"] + seqs, r["num_tokens"] + tokens, alive=live)
        else:
            i = self.decodes.index(engine)
            if live:
                s.report_decode(
                    i,
                    r["num_seqs"] + seqs,
                    r["num_tokens"] + tokens,
                    max(0, r["num_free_pages"] - pages),
                    num_total_pages=r["num_total_pages"],
                )
            else:
                s.report_decode(i, 0, 0, 0, alive=False)
        # The node as the scheduler was built with it: an engine that moved node reports the new one
        # before the rebuild (deferred while another engine has not reported: that lookup was a
        # KeyError that failed the health round, a review, 2026-12-05).
        built = self.built_nodes[engine.url]
        node = self.node_ids[built]
        # Node read queue = reads the node's storage link still has to serve (the shared link's view
        # when emulated, else the node's engines' reads in flight) + reads its engines accepted but
        # have not submitted + reads this router assigned there after the report was taken (they
        # are on their way; without them a burst would see the node as idle until the next report).
        # Live engines only: a dead one's last report kept its reads in its node's queue until it came
        # back, and α and the read path shunned its idle node-mates (a review, 2026-12-05).
        same_node = [
            self.reports[e.url]
            for e in self.prefills + self.decodes
            if e.healthy and e.url in self.reports and self.built_nodes.get(e.url) == built
        ]
        tokens = sum(x["read_queue_tokens"] for x in same_node)
        if r["node_read_queue_bytes"] >= 0:  # (the link's view; reads past the link but still reading
            # from disk are in the engines' own: the larger of the two, as pd_load says)
            tokens = max(tokens, r["node_read_queue_bytes"] // max(1, r["kv_bytes_per_token"]))
        tokens += sum(x.get("planned_read_tokens", 0) for x in same_node)
        tokens += sum(n for _, n in _after_report(self._recent_reads[node], r["time_s"]))
        s.report_read_queue(node, int(tokens))

    def _booked_since(self, url: str, report_s: float) -> tuple[int, int, int]:
        """(seqs, tokens, pages) booked on the engine that its report taken at `report_s` cannot show."""
        late = _after_report(self._recent_books.get(url, deque()), report_s)
        return sum(b[1] for b in late), sum(b[2] for b in late), sum(b[3] for b in late)

    # ---- requests --------------------------------------------------------------------------------
    async def place(
        self,
        prompt_ids: list[int] | None,
        prompt_len: int,
        max_tokens: int | None,
        prompt_pieces: list[tuple[bytes, int]] | None = None,
        name: tuple[str, ...] = (),
        num_choices: int = 1,
        cache_salt: str | None = None,
    ) -> Placed:
        """Wait until the scheduler assigns this request; raises PlacementError or TimeoutError.
        The prompt's keys come back unrecorded: `record(placed)` once an engine has taken it.
        A text or chat prompt (`prompt_ids` None) gives its `prompt_pieces` for a hit estimate; hits
        are estimated among the prompts of the same `cache_salt` only (the engines' keys are salted).
        `num_choices` > 1: the first of that many choices of one prompt (`PendingRequest.num_choices`).
        `max_tokens` None (the client sent none): the engines' default, which they lower to the room the
        prompt leaves, so it never refuses a prompt that fits; DEFAULT_PLACEMENT_TOKENS of growth are
        reserved, as far as the largest live decode holds them (it was refused as "prompt +
        max_tokens = ... tokens" for a max_tokens the client never sent: a review, 2026-12-04)."""
        if self.scheduler is None:  # (just started: the first reports are a poll or two away)
            deadline = time.monotonic() + FIRST_REPORTS_WAIT_S
            while self.scheduler is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if self.scheduler is None:
                raise NotPlaceableNow("the router has no load report from every engine yet; retry shortly")
        self._check_live()
        page_tokens = self.scheduler.config.page_tokens
        # (as the engines count: the last token sampled is never computed, so it holds no KV)
        num_tokens = prompt_len + (DEFAULT_PLACEMENT_TOKENS if max_tokens is None else max_tokens)
        need_pages = -(-(num_tokens - 1) // page_tokens)
        biggest = max(self._report(e)["num_total_pages"] for e in self.decodes)
        what = (
            f"prompt + max_tokens = {num_tokens} tokens " if max_tokens else f"prompt = {prompt_len} tokens "
        )
        if max_tokens is None:  # (a default growth: as much as fits, the prompt's own pages at least)
            prompt_pages = -(-prompt_len // page_tokens)
            need_pages = max(prompt_pages, min(need_pages, self._biggest_live_decode() or biggest))
            num_tokens = min(num_tokens, need_pages * page_tokens + 1)
        if need_pages > biggest:
            raise PlacementError(
                f"{what}needs {need_pages} KV pages; the largest decode engine has {biggest}"
            )
        if need_pages > self._biggest_live_decode():  # (it waited to the queue timeout; then a 400)
            raise _only_down_decodes(need_pages, what)
        if prompt_ids:
            hits, keys = self.index.hit_tokens_and_keys(prompt_ids, cache_salt)
        elif prompt_pieces:
            hits, keys = self.index.estimated_hits_and_keys(prompt_pieces, prompt_len, cache_salt)
        else:
            hits, keys = 0, []
        # (its decode tokens as the engines count its slots: the last token sampled holds no KV; with
        # all `num_tokens`, one that filled a decode's pool exactly never fit, and waited to the queue
        # timeout)
        pending = PendingRequest(
            next(self._ids), hits, max(1, prompt_len - hits), num_tokens - 1, num_choices
        )
        waiting = _Waiting(pending, asyncio.get_running_loop().create_future(), need_pages, name)
        self.queue.append(waiting)
        self._pump()
        try:
            assignment = await asyncio.wait_for(asyncio.shield(waiting.future), self.queue_timeout_s)
            return Placed(assignment, keys)
        except (TimeoutError, asyncio.CancelledError):
            if waiting in self.queue:
                self.queue.remove(waiting)
            raise

    def record(self, placed: Placed) -> None:
        """Who calls: the router, when an engine has taken the placed request (its answer is not an
        error). Its prompt counts as hits for the prompts after it from then on; a refused one never
        does (the engines computed nothing of it)."""
        if self.index is not None:
            self.index.record_keys(placed.prompt_keys)

    def _biggest_live_decode(self) -> int:
        return max((self._report(e)["num_total_pages"] for e in self.decodes if e.healthy), default=0)

    def _check_live(self) -> None:
        """NotPlaceableNow unless a prefill and a decode are live (the scheduler never assigns a dead
        engine, so a request would wait to the queue timeout; with no decode the size check below
        blamed the client with a 400)."""
        for role, engines in (("prefill", self.prefills), ("decode", self.decodes)):
            if not any(e.healthy for e in engines):
                raise NotPlaceableNow(f"no healthy {role} engine")

    def abort_waiting(self, named=None) -> None:
        """Every request waiting for a placement (or each whose name `named(name)` picks) stops
        waiting (PlacementAborted), unplaced."""
        self._end_waiting(lambda w: named is None or named(w.name), lambda w: PlacementAborted())
        if self.queue:
            self._pump()  # (the ones behind may fit now)

    def _end_waiting(self, which, error) -> None:
        """The waiting requests `which(waiting)` picks leave the queue, each failed with `error(it)`."""
        ended = [w for w in self.queue if which(w)]
        if ended:
            self.queue = [w for w in self.queue if not which(w)]
        for waiting in ended:
            if not waiting.future.done():
                waiting.future.set_exception(error(waiting))

    def _pump(self) -> None:
        if self.scheduler is None or not self.queue:
            return
        placed = self.scheduler.assign([w.pending for w in self.queue])
        now = time.time()
        for waiting, assignment in zip(self.queue, placed, strict=False):
            self.num_placed += 1
            pe = self.scheduler.prefill[assignment.prefill_engine].node_id
            de = self.scheduler.decode[assignment.decode_engine].node_id
            for node, tokens in ((pe, assignment.num_pe_read_tokens), (de, assignment.num_de_read_tokens)):
                if tokens:
                    self._recent_reads[node].append((now, tokens))
            # (as the scheduler booked them in `assign`: a prefill its new tokens, a decode its
            # decode tokens and pages)
            req = waiting.pending
            self._recent_books[self.prefills[assignment.prefill_engine].url].append(
                (now, 1, req.num_new_tokens, 0)
            )
            self._recent_books[self.decodes[assignment.decode_engine].url].append(
                (now, 1, req.num_decode_tokens, waiting.num_pages)
            )
            self.read_paths[assignment.read_path] = self.read_paths.get(assignment.read_path, 0) + 1
            if not waiting.future.done():
                waiting.future.set_result(assignment)
        del self.queue[: len(placed)]

    def snapshot(self) -> dict:
        s = self.scheduler
        return {
            "policy": self.policy,
            "queue_len": len(self.queue),
            "num_placed": self.num_placed,
            "read_paths": dict(self.read_paths),
            "read_queue_tokens": dict(zip(self.node_ids, s.read_queue_tokens, strict=True)) if s else {},
        }
