"""Decode side of PD disaggregation: reserve pages, ask the prefill for the prompt's KV, commit, decode.

Queues of a room:   prealloc ──pages + KVRequest──> transfer ──all writes + handoff gate──> running
                    Bootstrapping                   WaitingForInput / Transferring        Success

* `add`: the request (its prefill's control address already looked up by the HTTP handler, off
  this thread) waits in `prealloc`. The first request for a prefill registers this engine with it
  (transfer-agent metadata, KV region addresses and pool size, handoff slots, layout fingerprint), once
  per peer.
* Admission (`_admit`) matches our own prefix cache first and asks only for the rest
  (`decode_prefix_len`); it needs pages for the prompt plus a growth reserve for every admitted
  request. A request that does not fit does not block smaller ones behind it (no head-of-line).
* Commit needs both: every write of the room landed (notifications counted) **and** the handoff
  slot holds our room (metadata gate). Then token 1 joins the output, the prompt pages are published
  in our prefix cache and the request decodes from token 2 with no recompute.
* Abort after a KVRequest went out is two-phase: Abort → the prefill stops and acks (or its lease
  expires) → only then are the pages freed, so no late write can land in a reused page.

Length (~640 lines): like ``pd_prefill.py``, one state machine (a room's queues and its failure and
release rules) that reads best in one place; page runs, staging and the store live elsewhere.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pdserve.disagg.handoff import gate
from pdserve.disagg.messages import Abort, AbortAck, KVRequest, Register, RegisterAck, Status
from pdserve.disagg.state import AbortTracker, DuplicateRoom, KVState
from pdserve.engine.async_engine import EngineRole
from pdserve.engine.llm_engine import InvalidRequest, LLMEngine
from pdserve.engine.pd_common import (
    MIN_LEASE_MARGIN_S,
    STALE_REGISTRATION,
    PDConfig,
    PDRoleBase,
    decode_notif,
)
from pdserve.engine.request import Request, RequestStatus, TokenLogprob
from pdserve.outputs import RequestOutput
from pdserve.transfer.pages import worth_staging
from pdserve.transfer.staging import scatter_pages

log = logging.getLogger(__name__)

STORE_LOOKUP_REFRESH_S = 1.0  # a waiting DE-path request looks the store up again this often


@dataclass
class PrefillPeer:
    control_addr: str
    reg_id: int = 0  # echoed in the RegisterAck's room field
    state: str = "new"  # new -> registering -> ready (a refused registration goes back to new)
    error: str = ""
    agent_name: str = ""
    registered_s: float = 0.0  # when the last Register went out (it is re-sent while unanswered)
    lease_s: float = 0.0  # abort lease for this prefill's rooms: ours, or longer if its rooms live longer
    used_s: float = 0.0  # when our last Register or KVRequest went to it (room clock): renewal, forgetting
    renew_s: float = 0.0  # renew a registration silent this long: ours, or sooner if it forgets sooner


@dataclass
class DecodeRoom:
    room: int
    req: Request
    prompt_text: str | None
    peer_addr: str
    handoff_slot: int = -1
    notifs: set[int] = field(default_factory=set)
    total: int = 0  # writes to expect (known from the last notification)
    requested: bool = False  # a KVRequest went out: the prefill may write our pages
    growth_pages: int = 0  # pages kept free for this request's first tokens while its KV arrives
    staging_offset: int = -1  # our staging slot when the prefill writes there (fragmented pages)
    dst_page_ids: list[int] = field(default_factory=list)
    store_read: object = None  # DE read path: our store read in flight (PendingRead)
    num_hit_tokens: int = 0  # prompt tokens we hold before asking (prefix cache or store)
    queued_s: float = field(default_factory=time.monotonic)  # when it entered prealloc (aging)
    # DE read path: prompt blocks the store held at the last lookup (-1: not looked up yet), and when.
    # Not looked up on every pass while the request waits (each lookup may stat files and counts in
    # the store's hit metrics), but again once STORE_LOOKUP_REFRESH_S has passed: the previous turn's
    # last blocks may still have been in the write-back queue at the first try. A block evicted
    # meanwhile shows up as a short read, then recomputed.
    num_store_blocks: int = -1
    store_lookup_s: float = 0.0
    # Prefix hits of this room's last plan that did not fit (-1: none). While the pages it could get
    # stay below prompt pages - hits and its next page key is not cached, no plan can fit: admission
    # skips it without matching its prefix again (~0.2 ms for a 30k-token prompt, per room and pass).
    num_miss_hits: int = -1
    # DE read path served from our own prefix cache (it covered at least the store): tokens of our
    # pages the prefill pulls instead of computing. It reports them as stored; they were ours.
    num_own_hit_tokens: int = 0


class _PagePlan(NamedTuple):
    """How admission fills a request's prompt pages (`DecodeRole._plan_pages`)."""

    hit_page_ids: list[int]  # prefix-cache hits shared into the request
    hit_keys: list  # their keys
    num_hit_tokens: int  # tokens those pages hold (the KVRequest asks for the rest)
    num_store_blocks: int  # DE read path: leading blocks to read from the store first (0: none)


class DecodeRole(PDRoleBase, EngineRole):
    answers_client = True

    def __init__(self, engine: LLMEngine, config: PDConfig, control, agent, layout_fingerprint: str) -> None:
        super().__init__(engine, config, control, agent, layout_fingerprint)
        self.num_staged = 0
        self.store = None  # StoreConnector: write-back of full blocks; the DE read path
        engine.step_hooks.append(self._write_back)
        engine.finish_hooks.append(self._write_back_last)
        # A releasing room's request is forgotten by the engine (its id free for a retry), but its
        # pages stay held until the prefill's ack or the lease: the engine's integrity check counts them.
        engine.extra_page_refs.append(
            lambda: [p for d in list(self.releasing.values()) for p in d.req.page_ids]
        )
        self.aborts = AbortTracker()
        self.peers: dict[str, PrefillPeer] = {}
        self._reg_ids = itertools.count(1)  # a registration's id, echoed by its RegisterAck
        self.prealloc: list[DecodeRoom] = []
        self.transfer: dict[int, DecodeRoom] = {}
        self.releasing: dict[int, DecodeRoom] = {}  # aborted after a KVRequest: wait for ack / lease
        self.by_request: dict[str, int] = {}
        self.num_handoff_mismatches = 0

    def _reserved_pages(self) -> int:
        """Growth reserved by requests whose KV is still arriving (they will need it at once).

        Also called from the HTTP thread (`pd_load.load_report`) while this engine's thread adds and
        removes rooms: iterate a copy taken by one C-level call (atomic under the GIL), never the live
        dict, whose change mid-iteration raises RuntimeError."""
        return sum(d.growth_pages for d in list(self.transfer.values()))

    # ---- intake --------------------------------------------------------------------------------
    def add(self, req: Request, prompt_text: str | None) -> None:
        room, peer_addr = req.pd
        try:
            self.rooms.create(room, KVState.Bootstrapping)
        except DuplicateRoom:
            raise InvalidRequest(f"room {room} is already active on this decode engine") from None
        try:
            self.engine.add_prefilled(req, prompt_text)
        except InvalidRequest:
            self.rooms.fail(room, "duplicate request id")
            self.rooms.remove(room)
            raise
        dr = DecodeRoom(room, req, prompt_text, peer_addr)
        self.prealloc.append(dr)
        self.by_request[req.request_id] = room
        peer = self.peers.get(peer_addr)
        if peer is None:
            peer = self.peers[peer_addr] = PrefillPeer(peer_addr, reg_id=next(self._reg_ids))
        if peer.state == "new":
            self._register(peer)

    def new_weights(self, fingerprint: str) -> None:
        """The engine serves other weights (PDContext.on_new_weights): register again with every
        prefill, under the new fingerprint, before asking it for KV (one on the old weights refuses)."""
        self.fingerprint = fingerprint
        waiting = {d.peer_addr for d in self.prealloc}
        for peer in self.peers.values():
            self._forget_registration(peer)
            if peer.control_addr in waiting:
                self._register(peer)

    def _forget_registration(self, peer: PrefillPeer) -> None:
        """Register with `peer` again before asking it for KV, under a fresh id (an ack of the old
        registration still on its way is then not taken for the new one's)."""
        peer.state, peer.reg_id = "new", next(self._reg_ids)

    def register_message(self) -> Register:
        """What this decode tells a prefill about itself: where and how much the prefill may write."""
        kv = self.local_kv
        return Register(
            agent_name=self.agent.agent_name,
            agent_metadata=self.agent.metadata(),
            kv_base_addrs=list(kv.base_addrs),
            kv_bytes_per_page=list(kv.bytes_per_page),
            handoff_base_addr=self.handoff.base_addr,
            handoff_slot_bytes=self.handoff.slot_bytes,
            num_handoff_slots=self.handoff.num_slots,
            staging_base_addr=self.staging.region()[0],
            staging_bytes=self.staging.region()[1],
            layout_fingerprint=self.fingerprint,
            reply_addr=self.control.address,
            kv_num_pages=self.engine.kv.pool.num_pages,
        )

    def _register(self, peer: PrefillPeer) -> None:
        self.control.send(peer.control_addr, self.register_message(), peer.reg_id)
        peer.state = "registering"
        peer.registered_s = time.monotonic()
        peer.used_s = self.rooms.now()

    def _renew_if_idle(self, peer: PrefillPeer) -> None:
        """Register again with a ready prefill we have sent nothing to in `peer.renew_s` (a quarter of
        the lesser of its and our `peer_idle_s`), before the next KVRequest: the prefill forgets
        decodes silent for its `peer_idle_s` (`PrefillRole._forget_idle_peers`), and a KVRequest it
        no longer knows the sender of is only refused, with no one to tell, so the room would wait out
        its Bootstrapping deadline."""
        if peer.state == "ready" and self.rooms.now() - peer.used_s > peer.renew_s:
            self._forget_registration(peer)
            self._register(peer)

    def _forget_unused_peers(self) -> None:
        """Drop prefills unused for `peer_idle_s` that no room of ours names (a restarted prefill
        listens on a new control address, so its old entry would stay for good)."""
        if (now := self.peer_gc_due()) is None:
            return
        named = {d.peer_addr for d in self.prealloc}
        named.update(d.peer_addr for d in self.transfer.values())
        named.update(d.peer_addr for d in self.releasing.values())
        for addr, peer in list(self.peers.items()):
            if now - peer.used_s > self.config.peer_idle_s and addr not in named:
                del self.peers[addr]
                self.num_peers_forgotten += 1

    @property
    def num_peers(self) -> int:
        """Prefills we know (registered, registering or refused)."""
        return len(self.peers)

    def _retry_registrations(self) -> None:
        """Re-send a Register that got no RegisterAck while requests wait for that prefill.

        The control channel may lose a message (a dropped connection, a prefill that restarted between
        our Register and its ack, fault injection); without this a lost Register or RegisterAck left
        the peer in `registering` for good and every later request for that prefill expired in
        Bootstrapping. Registration is idempotent on the prefill (the same agent metadata is loaded
        again, the ack is re-sent) and a late or duplicate ack is ignored here (matched by reg_id and
        state), so re-sending is safe. The interval is short next to the Bootstrapping deadline so a
        request that saw one loss still makes it."""
        now = time.monotonic()
        retry_s = min(1.0, self.config.deadline_s / 4)
        waiting = {d.peer_addr for d in self.prealloc}
        for peer in self.peers.values():
            if (
                peer.state == "registering"
                and peer.control_addr in waiting
                and now - peer.registered_s > retry_s
            ):
                self._register(peer)

    def abort(self, request_id: str, client_abort: bool = False) -> RequestOutput | None:
        room = self.by_request.get(request_id)  # (never a releasing room: those ids are forgotten)
        if room is None or room not in self._all_rooms():
            return self.engine.abort(request_id)  # already running: a plain decode abort
        self._fail(room, "aborted by client", client_abort=client_abort)
        return None

    def _all_rooms(self) -> dict[int, DecodeRoom]:
        return {**{d.room: d for d in self.prealloc}, **self.transfer}

    # ---- the loop ------------------------------------------------------------------------------
    def tick(self) -> bool:
        for env in self.control.poll():
            self._on_message(env)
        for _peer, notif in self.agent.poll_notifications():
            parsed = decode_notif(notif)
            if parsed is None:
                continue
            room, seq, total = parsed
            dr = self.transfer.get(room)
            if dr is None:
                continue
            dr.notifs.add(seq)
            if total:
                dr.total = total
            self.rooms.advance(room, KVState.Transferring)
            if dr.total and len(dr.notifs) == dr.total:
                self._commit(dr)
        now = self.rooms.now()
        for dr in list(self.transfer.values()):
            if dr.store_read is None:
                continue
            if dr.store_read.future.done():
                self._on_store_read_done(dr)
            elif self._store_read_overdue(dr.store_read, dr.room, now, "asking the prefill for all of it"):
                # (the prefill waits for our KVRequest in Bootstrapping, whose deadline failed it before)
                dr.store_read = None
                self._request_kv(dr)
        for room in self.rooms.expired():
            self._fail(room, self.rooms.reason(room), already_failed=True)
        self._retry_registrations()
        self._admit()
        for room in self.aborts.ready_to_free():
            dr = self.releasing.pop(room, None)
            if dr is not None:
                self._free(dr)
        self._forget_unused_peers()
        return bool(self.prealloc or self.transfer or self.releasing)

    def _on_message(self, env) -> None:
        body, room = env.body, env.room
        if isinstance(body, RegisterAck):
            peer = next(
                (p for p in self.peers.values() if p.reg_id == room and p.state == "registering"), None
            )
            if peer is None:
                return
            if body.ok:
                peer.state, peer.agent_name = "ready", body.agent_name
                # A prefill with longer deadlines than ours may write to a room that long: wait it out,
                # with the margin our own lease keeps over our own room life (the write tail and the
                # Abort's delivery do not shrink because the prefill's deadlines are longer).
                margin_s = max(MIN_LEASE_MARGIN_S, self.config.lease_s - self.config.room_life_s)
                peer.lease_s = max(self.config.lease_s, body.room_life_s + margin_s)
                # A prefill that forgets silent decodes sooner than we would renew: renew in time for it.
                renew_s = self.config.peer_renew_s
                peer.renew_s = min(renew_s, body.peer_idle_s / 4) if body.peer_idle_s > 0 else renew_s
            else:
                peer.state, peer.error = "failed", body.error
                for dr in [d for d in self.prealloc if d.peer_addr == peer.control_addr]:
                    self._fail(dr.room, f"registration refused by prefill: {body.error}")
                peer.state = "new"  # let a later request retry (e.g. after the prefill restarts)
        elif isinstance(body, Status) and body.state == KVState.Failed:
            dr = self.transfer.get(room) or next((d for d in self.prealloc if d.room == room), None)
            peer = self.peers.get(dr.peer_addr) if dr is not None else None
            stale = body.error == STALE_REGISTRATION and peer is not None and peer.state == "ready"
            if stale:
                # The prefill's weights changed since we registered: register again (it refuses us
                # unless ours changed alike), instead of every later request being refused.
                self._forget_registration(peer)
            if dr is not None:
                self._fail(
                    room,
                    f"prefill failed: {body.error}",
                    peer_already_knows=True,
                    client_abort=body.client_abort,
                )
            if stale and any(d.peer_addr == peer.control_addr for d in self.prealloc):
                # Rooms still waiting for that prefill are admitted only once it is `ready` again:
                # without a Register now they waited out their Bootstrapping deadline (30 s).
                self._register(peer)
            elif room in self.releasing:
                # We aborted first, but the prefill failed the room on its own (e.g. its deadline) and
                # reports it with the same promise as an AbortAck: none of its writes can still land.
                # Without this, a lost Abort or AbortAck held the pages for the whole lease.
                self.aborts.acked(room)
        elif isinstance(body, AbortAck):
            self.aborts.acked(room)

    # ---- admission -----------------------------------------------------------------------------
    def _admit(self) -> None:
        """Admit prealloc rooms in order while pages last. A room that does not fit is passed by
        smaller ones (no head-of-line blocking) until it has waited `admission_aging_s`: from then on
        nothing overtakes it, so sustained load of small requests cannot starve a large one past the
        prefill's Bootstrapping deadline (seen in a 10-minute soak before this rule)."""
        kv = self.engine.kv
        now = time.monotonic()
        reserved = self._reserved_pages()  # (once a pass; each admission adds its growth below)
        for dr in list(self.prealloc):
            peer = self.peers[dr.peer_addr]
            self._renew_if_idle(peer)
            if peer.state != "ready":
                continue
            if self.handoff.num_free == 0:
                return  # taken only once the pages are in hand (below): nothing to give back on a miss
            req = dr.req
            # (never more than the request can use past its prompt's pages: its last sampled token
            # holds no KV, so one that fills the pool exactly waited for a page it would never take
            # until the prefill's Bootstrapping deadline failed it)
            growth = min(
                -(-min(self.config.growth_reserve_tokens, req.max_tokens) // self.page_size),
                kv.num_pages_for(req.num_prompt_tokens + req.max_tokens - 1)
                - kv.num_pages_for(req.num_prompt_tokens),
            )
            budget = kv.pool.num_free_pages - reserved - growth
            plan = self._plan_pages(dr, budget, now) if self._may_fit(dr, budget) else None
            if plan is None or not kv.allocate(
                req, req.num_prompt_tokens - plan.num_hit_tokens, plan.hit_page_ids, plan.hit_keys
            ):
                # (`allocate` agrees with the plan's count; were it ever to refuse, the request waits
                # like one that does not fit, rather than the engine dying in an assert.)
                if now - dr.queued_s >= self.config.admission_aging_s:
                    return  # aged: the pages freed from now on are its
                continue  # does not fit now; smaller requests behind it may
            kv.record_admission(req, plan.num_hit_tokens)
            dr.handoff_slot = self.handoff.alloc()  # a free one exists: checked above, same thread
            dr.growth_pages, dr.num_hit_tokens = growth, plan.num_hit_tokens
            reserved += growth
            self.prealloc.remove(dr)
            self.transfer[dr.room] = dr
            if plan.num_store_blocks:  # DE read path: read first, ask the prefill once the blocks are in
                dr.store_read = self._read_store(req, plan.num_store_blocks)
            elif req.read_path == "de" and self.store is not None and plan.num_hit_tokens:
                # Our prefix cache covers at least what the store holds (we served the previous turn):
                # the prefill pulls those pages layer by layer, as it would the store's, rather than
                # computing every token its own cache lacks.
                dr.num_own_hit_tokens = plan.num_hit_tokens
                self._request_kv(dr, req.page_ids[: plan.num_hit_tokens // self.page_size])
            else:
                self._request_kv(dr)

    def _may_fit(self, dr: DecodeRoom, num_free_pages: int) -> bool:
        """False only when `_plan_pages` would surely return None: its last plan missed with h hits,
        `num_free_pages` < prompt pages - h (fewer hits need more pages still), and hits cannot have
        grown past h (the prompt's page h is not in the prefix cache, or it has no page h to hit)."""
        h = dr.num_miss_hits
        if h < 0:
            return True
        req = dr.req
        if num_free_pages >= -(-req.num_prompt_tokens // self.page_size) - h:
            return True
        keys = req.page_key_cache  # the prompt's page keys (match_prefix computed them up to its max)
        max_hits = (req.num_tokens - 1) // self.page_size
        return h < max_hits and (h >= len(keys) or self.engine.kv.pool.lookup(keys[h]) is not None)

    def _plan_pages(self, dr: DecodeRoom, num_free_pages: int, now: float) -> _PagePlan | None:
        """Where the prompt's KV comes from (our prefix cache, the store, the prefill) if its pages fit
        in `num_free_pages` (free + evictable, less every reserve), else None.

        The fresh pages an admission takes: the prompt's pages less the prefix hits it shares, plus
        the hits that sit in the LRU -- `num_free_pages` counts those as allocatable, and they stop
        being so once acquired. On the DE read path, when the store covers more than our hits, the
        hits are not used: the whole prompt needs fresh pages (the blocks are read into them)."""
        kv, req = self.engine.kv, dr.req
        hits, keys = kv.match_prefix(req)
        num_prompt_pages = -(-req.num_prompt_tokens // self.page_size)
        num_evictable_hits = sum(1 for p in hits if kv.pool.ref_count(p) == 0)
        if num_prompt_pages - len(hits) + num_evictable_hits > num_free_pages:
            dr.num_miss_hits = len(hits)
            return None  # (the store path needs more still)
        dr.num_miss_hits = -1
        num_hit_tokens = len(hits) * self.page_size
        if req.read_path == "de" and self.store is not None:
            if dr.num_store_blocks < 0 or now - dr.store_lookup_s >= STORE_LOOKUP_REFRESH_S:
                dr.num_store_blocks, dr.store_lookup_s = self.store.lookup(req), now
            if dr.num_store_blocks * self.store.layout.block_size > num_hit_tokens:
                if num_prompt_pages > num_free_pages:
                    return None
                return _PagePlan([], [], 0, dr.num_store_blocks)
        return _PagePlan(hits, keys, num_hit_tokens, 0)

    def _request_kv(self, dr: DecodeRoom, hit_page_ids: list[int] = ()) -> None:
        """Ask the prefill for the prompt's KV from token `dr.num_hit_tokens` on. With `hit_page_ids`
        (DE read path) the prefill pulls the tokens before that from our pages instead of computing them."""
        req = dr.req
        dr.dst_page_ids = req.page_ids[dr.num_hit_tokens // self.page_size :]
        dr.staging_offset = self._staging_slot(dr.dst_page_ids)
        dr.requested = True
        peer = self.peers.get(dr.peer_addr)
        if peer is not None:
            peer.used_s = self.rooms.now()
        self.control.send(
            dr.peer_addr,
            KVRequest(
                dst_page_ids=dr.dst_page_ids,
                handoff_slot=dr.handoff_slot,
                decode_prefix_len=dr.num_hit_tokens,
                staging_offset=dr.staging_offset,
                hit_page_ids=list(hit_page_ids),
            ),
            dr.room,
        )
        self.rooms.advance(dr.room, KVState.WaitingForInput)

    def _on_store_read_done(self, dr: DecodeRoom) -> None:
        pending, dr.store_read = dr.store_read, None
        req = dr.req
        try:
            result = pending.future.result()
            num_ok = pending.num_prefix_ok(result)
        except Exception:  # noqa: BLE001 - a failed read only means the prefill computes more
            log.exception("store read failed")
            num_ok = 0
        num_tokens = num_ok * self.store.layout.block_size
        if num_tokens:
            self.store.scatter_blocks(pending.buffer, num_ok, req.page_ids)
            req.num_storage_tokens = dr.num_hit_tokens = num_tokens
        self._request_kv(dr, req.page_ids[: num_tokens // self.page_size])

    def _staging_slot(self, dst_page_ids: list[int]) -> int:
        """A staging slot for these pages if they are fragmented enough to be worth it, else -1."""
        cfg = self.config
        if not dst_page_ids or self.engine.runner.kv_cache.layout.bytes_per_page > cfg.staging_max_page_bytes:
            return -1
        if not worth_staging(dst_page_ids, cfg.staging_threshold):
            return -1
        offset = self.staging.alloc(len(dst_page_ids))
        return -1 if offset is None else offset

    # ---- commit --------------------------------------------------------------------------------
    def _commit(self, dr: DecodeRoom) -> None:
        row = self.handoff.try_read(dr.handoff_slot)  # None: not landed, torn or corrupt
        if not gate(row, dr.room):
            self.num_handoff_mismatches += 1
            self._fail(dr.room, "handoff room mismatch")
            return
        req = dr.req
        if dr.staging_offset >= 0:  # the prefill wrote into our staging slot: scatter into our pages
            n = len(dr.dst_page_ids)
            scatter_pages(self.staging.view(dr.staging_offset, n), self.kv_regions, dr.dst_page_ids)
            self.sync_device()  # the scatter has read the slot before a peer may write into it again
            self.staging.free(dr.staging_offset)
            dr.staging_offset = -1
            self.num_staged += 1
        self.rooms.advance(dr.room, KVState.Success)
        self.control.send(dr.peer_addr, Status(state=KVState.Success), dr.room)  # prefill may free
        del self.transfer[dr.room]
        self.handoff.free(dr.handoff_slot)
        self.rooms.remove(dr.room)
        req.num_computed_tokens = req.num_prompt_tokens
        # Reported cached tokens = prompt tokens nobody recomputed, as the prefill accounts them: its own
        # prefix hits, or the stored blocks its layerwise run loaded (read by it, PE path, or by us, DE
        # path). Not our store read itself: a prefill that fell back to a whole prefill recomputed
        # those tokens (counting both gave more cached tokens than the prompt). Off the DE path our
        # prefix hits only spared the prefill sending those pages (our prefix-cache metrics count
        # them); on it the prefill pulled them, and reports them as stored: they were our device hits.
        own = min(dr.num_own_hit_tokens, row.cached_tokens_storage)  # (ours, pulled: device hits)
        req.num_storage_tokens = row.cached_tokens_storage - own
        req.num_cached_tokens = (
            row.cached_tokens_device + own + row.cached_tokens_host + req.num_storage_tokens
        )
        req.append_output(row.first_token_id)
        now = time.monotonic()
        req.first_token_time = req.last_token_time = now
        if req.sampling_params.logprobs is not None and row.first_logprob is not None:
            top = list(row.top_logprobs)[: req.sampling_params.logprobs]
            rank = row.first_logprob_rank or None  # (0: not sent)
            req.logprobs.append(TokenLogprob(row.first_token_id, row.first_logprob, top, rank))
        self._burn_first_draw(req)
        self.engine.kv.cache_computed_pages(req)
        if self.store is not None:  # write-back: the whole prompt's full blocks, off the critical path
            self.store.persist(req)
        status = self.engine.check_stop(req)
        if status is not None:
            if self.store is not None:  # its pages go now: what the writer's queue had no room for is lost
                self.store.persist(req, final=True)
            req.status = RequestStatus.RUNNING
            self.engine.scheduler.finish(req, status)
            out = self.engine.release(req)
        else:
            # Queued, not run at once: the scheduler admits it within max_num_seqs (its KV is in its
            # pages, so admission computes only its next token). The room is done; waiting here has
            # no deadline, where holding it back before the transfer would run into Bootstrapping's.
            self.engine.scheduler.add_prefilled(req)
            out = self.engine.output(req)
        self.by_request.pop(req.request_id, None)
        self.aengine.deliver_output(out)  # (counted here: one that ends at its first token never steps)

    def _write_back(self, sched) -> None:
        """After each step: persist blocks that decoding filled, so the next turn finds them."""
        if self.store is None:
            return
        for req in sched.requests:
            if req.page_ids and not req.status.finished:
                self.store.persist(req)

    def _write_back_last(self, req: Request) -> None:
        """A request stopped in this step: persist the block its last step filled, before its pages go
        (the step hook above runs after they are freed, and the next turn would miss that block)."""
        if self.store is not None and req.page_ids:
            self.store.persist(req, final=True)

    def _burn_first_draw(self, req: Request) -> None:
        """The prefill drew token 1 from this seed; advance our copy of the generator past that
        draw so seeded sampling continues exactly as a colocated engine would."""
        gen = self.engine.runner.generators.get(req.request_id)
        if gen is not None and not req.sampling_params.greedy:
            # Same draw as the sampler's (one float32 row of the vocabulary) on the generator's device:
            # a CUDA generator cannot draw into a CPU tensor.
            vocab = self.engine.config.model_config.vocab_size
            torch.empty(vocab, device=gen.device).exponential_(generator=gen)

    # ---- failure -------------------------------------------------------------------------------
    def _fail(
        self,
        room: int,
        reason: str,
        already_failed: bool = False,
        peer_already_knows: bool = False,
        client_abort: bool = False,
    ) -> None:
        """`client_abort`: /abort_request named the request (here, or on the prefill that tells us):
        its caller gets the abort as an answer, and the prefill hears it was one."""
        dr = self.transfer.pop(room, None)
        if dr is None:
            dr = next((d for d in self.prealloc if d.room == room), None)
            if dr is None:
                return
            self.prealloc.remove(dr)
        if not already_failed:
            self.rooms.fail(room, reason)
        self.count_failure(reason)
        self.deliver_failure(dr.req.request_id, f"PD transfer failed: {reason}", client_abort)
        abort = Abort(reason=reason, client_abort=client_abort)
        if dr.requested and not peer_already_knows:
            # The prefill may still write our pages: stop it, free only after its ack or the lease.
            self.control.send(dr.peer_addr, abort, room)
            peer = self.peers.get(dr.peer_addr)
            self.aborts.begin(room, max(self.config.lease_s, peer.lease_s if peer else 0.0))
            self.releasing[room] = dr
            # Its caller has its answer: free the request id now, not at the ack or the lease. The router
            # retries a failed attempt under the client's rid, and with one decode engine that retry
            # comes here; the pages stay with `dr` (counted by our extra_page_refs hook).
            self._forget_request(dr)
        else:
            # Never asked for KV, or the prefill failed the room itself: it sends Status(Failed) only
            # once none of its writes to us can still land, so the pages are free to reuse now.
            if not dr.requested and not peer_already_knows:
                self.control.send(dr.peer_addr, abort, room)  # let it drop the room early
            self._free(dr)

    def _free(self, dr: DecodeRoom) -> None:
        if dr.handoff_slot >= 0:
            self.handoff.free(dr.handoff_slot)
        if dr.staging_offset >= 0:
            self.staging.free(dr.staging_offset)
        self.engine.kv.free(dr.req)
        self._forget_request(dr)
        if dr.room in self.rooms:
            self.rooms.remove(dr.room)

    def _forget_request(self, dr: DecodeRoom) -> None:
        """The engine and our id map stop knowing `dr`'s request; its pages are not touched. Each only
        if it is still this room's: a retry under the same id may hold them by now."""
        req = dr.req
        req.status = RequestStatus.FINISHED_ABORTED
        if self.engine.requests.get(req.request_id) is req:
            self.engine.release(req)
        if self.by_request.get(req.request_id) == dr.room:
            del self.by_request[req.request_id]

    def queue_sizes(self) -> dict[str, int]:
        return {
            "prealloc": len(self.prealloc),
            "transfer": len(self.transfer),
            "releasing": len(self.releasing),
        }

    def check_integrity(self) -> None:
        self.rooms.check_integrity()
        self.handoff.check_integrity()
        self.staging.check_integrity()
        self.aborts.check_integrity()
        if self.store is not None:
            self.store.reads.check_integrity()
        assert set(self.aborts.pending()) == set(self.releasing), "an aborted room's pages lost their lease"
