"""Prefill side of PD disaggregation: compute the prompt, stream its pages to the decode, hand off.

Queues of a room (DESIGN.md §4):   bootstrap ──KVRequest──> waiting ──forward──> inflight ──ack──> freed
                                   Bootstrapping            WaitingForInput      Transferring       Success

* A request arrives from the router (`add`) and waits in `bootstrap` until the decode's `KVRequest`
  for its room says where its pages go; nothing is computed or written before that.
* Then it joins the engine's scheduler with `max_tokens=1` and `hold_pages`: its pages outlive it.
* Before each forward (pre-step hook) and after it (post-step hook) every *full* prompt page that is
  computed and not yet sent is written to the decode; so a prefix-cache hit goes out before the
  forward of the rest, and each chunk of a chunked prefill goes out while later chunks compute.
* When token 1 is sampled, the last write carries the remaining pages (the partial last one
  included) and the handoff row; its notification tells the decode how many writes to expect.
* Pages are freed only when the decode acks Success, or the room fails and no write of it is still
  in flight (a late read of a freed page could send another request's KV). Each write also holds a
  reference on the pages it reads until it is reported, which covers a request preempted (its pages
  freed by the scheduler) with writes in flight.
* The decode is trusted only within what it registered: a Register that does not match our regions
  is refused, and a KVRequest aiming outside the registered pages, slots or staging fails its room.
* DualPath: a request with stored KV (read here, PE path; or held by the decode, DE path) skips the
  scheduler and runs the layerwise lane (`pd_layerwise.py`).

Why one ~800-line file: it is one state machine (a room's queues, its writes, its failure and release
rules). The pieces that stand alone — page runs, staging, the layerwise compute, the wire — live in
their own modules; what remains here is the protocol, which reads best in one place.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from pdserve.disagg.handoff import BadHandoffRow, HandoffRow
from pdserve.disagg.messages import Abort, AbortAck, KVRequest, Register, RegisterAck, Status
from pdserve.disagg.state import TRANSFER_FAILED, DuplicateRoom, KVState
from pdserve.engine.async_engine import EngineRole, RequestAborted
from pdserve.engine.llm_engine import InvalidRequest, LLMEngine
from pdserve.engine.pd_common import STALE_REGISTRATION, PDConfig, PDRoleBase, encode_notif
from pdserve.engine.pd_layerwise import LayerwisePrefill, RoomEnded
from pdserve.engine.request import Request, RequestStatus
from pdserve.outputs import RequestOutput
from pdserve.transfer.base import TransferStatus
from pdserve.transfer.pages import RegionTable, merge_runs, page_descriptors, worth_staging
from pdserve.transfer.staging import gather_pages

log = logging.getLogger(__name__)


@dataclass
class DecodePeer:
    """A registered decode: where we may write (from its Register), and the bounds of each buffer that
    every KVRequest is checked against -- we never write outside them."""

    agent_name: str
    reply_addr: str
    kv: RegionTable
    num_kv_pages: int  # pages of each KV region
    handoff_base_addr: int
    handoff_slot_bytes: int
    num_handoff_slots: int
    staging_base_addr: int
    staging_capacity_pages: int  # its staging buffer in pages of every region
    heard_s: float = 0.0  # when it last sent us anything (room clock): idle peers are forgotten


@dataclass
class PrefillRoom:
    room: int
    req: Request
    peer: DecodePeer | None = None
    dst_page_ids: list[int] = field(default_factory=list)
    first_page: int = 0  # prompt pages before this one the decode already has (its prefix cache)
    handoff_slot: int = -1  # the decode's slot
    num_pages_sent: int = 0  # prompt pages [first_page, num_pages_sent) were submitted
    seq: int = 0  # writes submitted
    in_flight: set[int] = field(default_factory=set)  # transfer ids
    sent_last: bool = False
    local_slot: int = -1  # our handoff source row
    abort_reply_to: str | None = None  # the decode asked us to stop: ack once nothing is in flight
    fail_reason: str = ""
    client_abort: bool = False  # it failed because /abort_request named it (here or on the decode)
    # DualPath read paths: PE path = our own store read in flight; DE path = our pull of the prompt KV
    # the decode read from the store (a data-plane read). The request is schedulable when the
    # KVRequest arrived and neither is pending.
    kv_request_seen: bool = False
    store_read: object = None  # PendingRead in flight
    # (its PendingRead, leading good blocks) once read; the read, not only its buffer, until the
    # layerwise run takes it: other requests of the prompt join it meanwhile (store/joined_reads.py)
    store_hit: tuple | None = None
    de_hit_page_ids: list[int] = field(default_factory=list)  # DE path: the decode holds these
    staging_offset: int = -1  # the decode's staging slot (we write there, it scatters), or -1
    created_s: float = 0.0  # (room clock) it lives at most `room_life_s` from here: see `expires_s`


class Tombstone(NamedTuple):
    """A room that ended before one side knew it: the decode aborted it before the router's request
    reached us, or we failed it before the decode's KVRequest did. Kept for the abort lease, so the
    late half is answered at once (the request refused, the KVRequest told Failed) instead of waiting
    out a deadline, and with how it ended: a `client_abort` ends the late half as an abort too."""

    t_s: float
    reason: str
    client_abort: bool
    by_decode: bool  # the decode's Abort made it (else our own failure, reaped before the decode asked)


class PrefillRole(PDRoleBase, EngineRole):
    # A source row per room from its last write until the decode's Success is reaped, for every decode
    # this prefill serves; each decode admits up to `num_handoff_slots` rooms. Sized for one decode,
    # a prefill serving two ran out with both within their admission, and those rooms failed after
    # their whole prompt was computed (a review, 2026-12-05). 256 B a row: 1 MiB at the default 256.
    # Past that (more than 16 decodes at full admission) a computed room waits for a row
    # (`rows_wanted`) rather than fail.
    handoff_slots_factor = 16

    def __init__(self, engine: LLMEngine, config: PDConfig, control, agent, layout_fingerprint: str) -> None:
        super().__init__(engine, config, control, agent, layout_fingerprint)
        engine.holds_prompt_kv_only = True  # (the decode checks prompt + max_tokens against its own pool)
        self.staging_slots: dict[int, int] = {}  # transfer id -> our staging slot (freed on completion)
        # Transfer id -> our KV pages a write reads, each holding one extra reference until the agent
        # reports the write done or released: a preempted (or freed) request's pages must not be
        # reallocated and overwritten while the data plane still copies them to the decode.
        self.pinned: dict[int, list[int]] = {}
        # Layerwise pulls that timed out (transfer id -> our staging slot they read into): aborted, but
        # the slot is freed only when the agent reports the read released, so no late byte lands in a
        # reused slot.
        self.abandoned_reads: dict[int, int] = {}
        self.store = None  # StoreConnector when the engine has a persistent KV store (PE read path)
        self.layerwise = LayerwisePrefill(self)
        self.awaited: dict[int, object] = {}  # transfer id -> status once done (None: pending)
        self.num_layerwise_fallbacks = 0  # stored-KV prompts too long for the staging pool: prefilled whole
        self.by_room: dict[int, PrefillRoom] = {}
        self.by_request: dict[str, int] = {}
        self.peers: dict[str, DecodePeer] = {}  # by decode agent name
        self.stale_peers: dict[str, DecodePeer] = {}  # registered under weights we no longer serve
        self.early: dict[int, tuple[float, str, KVRequest]] = {}  # KVRequests that beat the router's POST
        self.transfers: dict[int, int] = {}  # transfer id -> room
        self.tombstones: dict[int, Tombstone] = {}  # rooms that ended before one side knew them
        # Rooms whose prompt is computed but whose last write waits for a free handoff row, oldest
        # first (a dict as an ordered set). Rows come back as Successes are reaped; a room waits
        # under its state's deadline, as for anything else, instead of failing a computed prompt.
        self.rows_wanted: dict[int, None] = {}
        self.pruned_at_s = -math.inf  # (room clock) when `tick` last dropped old early and tombstones
        self.num_pages_sent = 0
        engine.step_hooks.append(self._after_step)
        engine.pre_step_hooks.append(self._after_step)
        engine.extra_page_refs.append(lambda: [p for pages in self.pinned.values() for p in pages])

    # ---- intake (engine thread) ----------------------------------------------------------------
    def add(self, req: Request, prompt_text: str | None) -> None:
        room = req.pd
        tomb = self.tombstones.get(room)
        if tomb is not None:  # (usually the decode's Abort beat the router's request here)
            where = "by its decode engine" if tomb.by_decode else "here before"
            if tomb.client_abort:  # (the router then relays the decode's answer: "abort" too)
                raise RequestAborted(f"room {room} was aborted {where}: {tomb.reason}")
            # Not the client's doing (e.g. the decode's deadline): a failure the router may retry.
            raise RuntimeError(f"room {room} was aborted {where}: {tomb.reason}")
        try:
            self.rooms.create(room, KVState.Bootstrapping)
        except DuplicateRoom:
            raise InvalidRequest(f"room {room} is already active on this prefill engine") from None
        req.hold_pages = True
        try:
            self.engine.add_prefilled(req, prompt_text)  # registered, not yet schedulable
        except InvalidRequest:
            self.rooms.fail(room, "duplicate request id")
            self.rooms.remove(room)
            raise
        early = self.early.pop(room, None)
        # Its life (the agent's expiry of its writes) counts from the decode's KVRequest when that came
        # first: the decode's lease does. From the router's request, parked up to a deadline later, a
        # stalled thread's writes could outlive the lease into freed pages (a review, 2026-12-04).
        created_s = self.rooms.now() if early is None else early[0]
        pr = PrefillRoom(room, req, created_s=created_s)
        self.by_room[room] = pr
        self.by_request[req.request_id] = room
        if req.read_path == "pe" and self.store is not None:
            self._start_store_read(pr)
        if early is not None:
            self._on_kv_request(room, early[1], early[2])

    def new_weights(self, fingerprint: str) -> None:
        """The engine serves other weights (PDContext.on_new_weights): every decode registered under
        the old fingerprint is no longer written to. One on the new weights registers again; one on
        the old cannot, and its KVRequests are refused meanwhile (Status(Failed) to the address it
        registered, so it frees at once), never given KV of other weights. Its Aborts are still acked."""
        self.fingerprint = fingerprint
        self.stale_peers |= self.peers
        self.peers = {}

    def abort(self, request_id: str, client_abort: bool = False) -> RequestOutput | None:
        room = self.by_request.get(request_id)
        if room is None:
            return self.engine.abort(request_id)
        self._fail(room, "aborted by client", client_abort=client_abort)
        return None

    def abort_room(self, room: int, request_id: str) -> int:
        """Engine thread (the router's `/abort_request` with a room): end that room's half if it is
        `request_id`'s. Past its token 1 the half's id is held until its writes settle; the router
        retries the request under that id (a client's `/generate` rid) on another decode, here too:
        ended now, the id is free (`_fail`). A room that succeeded stays a success (the decode acked its
        last write before its reports of that write came back here), but its id is freed as well: its
        writes still in flight read pinned pages, and `_reap` frees the rest. 1 if there was such a room."""
        pr = self.by_room.get(room)
        if pr is None or pr.req.request_id != request_id:
            return 0
        if self.rooms.state(room) == KVState.Success:
            self._forget_request(pr)  # (nothing failed: nothing counted, the decode told nothing)
        else:
            self._fail(room, "aborted by its router: retried", client_abort=True)
        return 1

    # ---- the loop (engine thread) --------------------------------------------------------------
    def tick(self) -> bool:
        # Deadlines first: a room that outlived its state (e.g. the process was paused) fails before
        # any message or store read of this turn can start work for it.
        for room in self.rooms.expired():
            self._fail(room, self.rooms.reason(room), already_failed=True)
        for env in self.control.poll():
            self._on_message(env)
        self.drain_completions()
        now = self.rooms.now()
        for pr in list(self.by_room.values()):
            if pr.store_read is None:
                continue
            if pr.store_read.future.done():
                self._on_store_read_done(pr)
            elif self._store_read_overdue(pr.store_read, pr.room, now, "computing the prompt instead"):
                pr.store_read = None
                self._maybe_schedule(pr)
        for room, (t, _, _) in list(self.early.items()):
            if now - t > self.config.deadline_s:
                del self.early[room]
        for room, tomb in list(self.tombstones.items()):
            if now - tomb.t_s > self.config.lease_s:  # the decode has long forgotten the room
                del self.tombstones[room]
        self.pruned_at_s = now
        self._reap()
        self._forget_idle_peers()
        return bool(self.transfers) or bool(self.by_room)

    def _forget_idle_peers(self) -> None:
        """Drop decodes silent for `peer_idle_s` that no room of ours still uses, and their transfer
        agent entries. A restarted decode registers under a new agent name, so without this every
        restart stayed here (and in the backend: NIXL's remote agent and its connections) for the
        prefill's life. A live decode renews its registration well before (`PDConfig.peer_renew_s`);
        one that asks after being forgotten is told "decode is not registered" as any stranger.
        Runs after the messages of the turn (a paused prefill counts what it finds on waking up as
        heard) and never while an abandoned pull may still read from a decode (it has no room)."""
        if self.abandoned_reads or (now := self.peer_gc_due()) is None:
            return
        # By agent name: a renewed registration replaces the peer's entry, and a room started before
        # it holds the old one, so an identity check left the new entry unprotected under that room's
        # writes (a review, 2026-12-04: reachable with peer_idle_s below a room's life).
        in_use = {pr.peer.agent_name for pr in self.by_room.values() if pr.peer is not None}
        for table in (self.peers, self.stale_peers):
            for sender, peer in list(table.items()):
                if now - peer.heard_s > self.config.peer_idle_s and peer.agent_name not in in_use:
                    del table[sender]
                    self.num_peers_forgotten += 1
                    left = (*self.peers.values(), *self.stale_peers.values())
                    if not any(p.agent_name == peer.agent_name for p in left):
                        self.agent.remove_peer(peer.agent_name)

    @property
    def num_peers(self) -> int:
        """Registered decodes (under the weights we serve or earlier ones)."""
        return len(self.peers) + len(self.stale_peers)

    def _on_completion(self, tid: int, status) -> None:
        # Reported: the transfer is done or released, so none of its bytes moves any more.
        pages = self.pinned.pop(tid, None)
        if pages is not None:
            self.engine.kv.pool.release(reversed(pages))  # tail first, as KVManager.free
        if tid in self.awaited:  # a layerwise pull: its waiter collects it
            self.awaited[tid] = status
            return
        slot = self.staging_slots.pop(tid, None)
        if slot is None:
            slot = self.abandoned_reads.pop(tid, None)
        if slot is not None:
            self.staging.free(slot)
        room = self.transfers.pop(tid, None)
        pr = self.by_room.get(room) if room is not None else None
        if pr is None:
            return
        pr.in_flight.discard(tid)
        if status == TransferStatus.FAILED and self.rooms.state(room) != KVState.Failed:
            self._fail(room, TRANSFER_FAILED)  # (writes we aborted ourselves are not news)

    def wait_for_transfer(self, tid: int, staging_slot: int, timeout_s: float | None = None) -> bool:
        """Block (engine thread) until read `tid` into our `staging_slot` completes; other completions
        are handled as usual. Used by the layerwise lane, whose next layer needs this one's data.

        True if it succeeded: the slot is the caller's to read and free. False: the slot is no longer
        the caller's -- freed now if the read was reported failed, or, if it timed out, freed once the
        agent reports the aborted read released (`abort` only queues the request: until then the read
        may still write into the slot)."""
        deadline = time.monotonic() + (self.config.deadline_s if timeout_s is None else timeout_s)
        self.awaited.setdefault(tid, None)
        self.drain_completions()  # at least one look, even with no time left
        while self.awaited[tid] is None and time.monotonic() < deadline:
            time.sleep(0.0002)
            self.drain_completions()
        status = self.awaited.pop(tid)
        if status == TransferStatus.DONE:
            return True
        if status is None:
            self.agent.abort(tid)
            self.abandoned_reads[tid] = staging_slot  # `_on_completion` frees it
        else:
            self.staging.free(staging_slot)
        return False

    def alloc_staging(self, num_pages: int, timeout_s: float | None = None) -> int | None:
        """A staging slot of `num_pages` for the layerwise lane (engine thread), waiting for in-flight
        writes to free theirs when the pool is full (a slow link holds slots longer: backpressure, not
        failure). None if it can never fit, or nothing frees a slot before the deadline."""
        if num_pages > self.staging.capacity_pages:
            return None
        deadline = time.monotonic() + (self.config.deadline_s if timeout_s is None else timeout_s)
        while (slot := self.staging.alloc(num_pages)) is None:
            if not (self.staging_slots or self.abandoned_reads) or time.monotonic() > deadline:
                return None  # nothing in flight holds a slot: waiting cannot help
            self.drain_completions()
            time.sleep(0.0002)
        return slot

    def drain_completions(self) -> None:
        """Handle the transfers the agent reported since the last look (engine thread; the layerwise
        lane calls it between layers, so a failed write fails its room before the next layer)."""
        for t, status in self.agent.poll_completions():
            self._on_completion(t, status)

    def expect_transfer(self, tid: int) -> None:
        """Mark `tid` as one that `wait_for_transfer` will collect (so no other loop consumes it)."""
        self.awaited.setdefault(tid, None)

    def expires_s(self, pr: PrefillRoom) -> float:
        """When the room's transfers must be over, on the agent's clock: the room's end of life (its
        three deadlines from its creation; the sweep fails it then). The decode frees an aborted
        room's pages a lease later (`PDConfig.lease_s` > `room_life_s`), so the agent aborting what is
        still in flight then keeps a late write out of reused pages, even while this thread is stalled
        and cannot sweep (DESIGN §4: a freed page is never written by a late copy)."""
        life_left_s = pr.created_s + self.config.room_life_s - self.rooms.now()
        return self.agent.clock() + max(0.0, life_left_s)

    def submit_write(
        self, pr: PrefillRoom, local, remote, last: bool, staging_slot: int = -1, src_page_ids=()
    ) -> int:
        """Queue one write of the room to its decode; the last one's notification carries the count.
        `src_page_ids`: our KV pages the write reads, pinned until it is reported (see `pinned`)."""
        pr.seq += 1
        self.engine.kv.pool.acquire(src_page_ids)
        self.sync_device()  # the pages (or the gathered slot) hold their KV before NIXL reads them
        tid = self.agent.submit(
            pr.peer.agent_name,
            local,
            remote,
            encode_notif(pr.room, pr.seq, pr.seq if last else 0),
            expires_s=self.expires_s(pr),
        )
        self.transfers[tid] = pr.room
        if src_page_ids:
            self.pinned[tid] = list(src_page_ids)
        if staging_slot >= 0:
            self.staging_slots[tid] = staging_slot
        pr.in_flight.add(tid)
        self.rooms.advance(pr.room, KVState.Transferring)
        return tid

    def _on_message(self, env) -> None:
        body, room = env.body, env.room
        known = self._peer_by_sender(env.sender)
        if known is not None:
            known.heard_s = self.rooms.now()
        if isinstance(body, Register):
            self._on_register(body, room, env.sender)
        elif isinstance(body, KVRequest):
            pr = self.by_room.get(room)
            if pr is not None and pr.peer is None and self.rooms.state(room) == KVState.Failed:
                # Failed since the last tick (an abort, a deadline) but not yet reaped: nothing was
                # written, so `_reap` tells this decode Failed (else it waited out its deadline).
                pr.peer = self._peer_by_sender(env.sender)
            elif pr is not None:
                self._on_kv_request(room, env.sender, body)
            elif room in self.tombstones:  # it ended here before the decode asked: say so now
                self._tell_ended(room, env.sender)
            else:  # the decode was faster than the router's POST to us: keep it for a while
                self.early[room] = (self.rooms.now(), env.sender, body)
        elif isinstance(body, Status):
            if body.state == KVState.Success and room in self.by_room:
                # The decode's ack of the last write. Before that write went out, a Success (a confused
                # or hostile peer, a replay) would let `_reap` release the room without ever sending
                # the rest of the prompt: ignore it and count it. (On a terminal room it is a late or
                # repeated ack: nothing to do.)
                state = self.rooms.state(room)
                if self.by_room[room].sent_last and state == KVState.Transferring:
                    self.rooms.advance(room, KVState.Success)
                elif state not in (KVState.Success, KVState.Failed):
                    self.count_failure("early Success ignored")
            elif body.state == KVState.Failed and room in self.by_room:
                self._fail(room, f"decode failed: {body.error}")
        elif isinstance(body, Abort):
            pr = self.by_room.get(room)
            sender = self._peer_by_sender(env.sender)
            if pr is None:
                # Not (yet) ours: remember the abort so a late router request or a parked KVRequest
                # can never write into pages the decode is about to free, then ack at once.
                self.early.pop(room, None)
                self.tombstones[room] = Tombstone(self.rooms.now(), body.reason, body.client_abort, True)
                if sender is not None:
                    self.control.send(sender.reply_addr, AbortAck(), room)
                return
            peer = pr.peer or sender
            pr.abort_reply_to = peer.reply_addr if peer is not None else None
            if self.rooms.state(room) in (KVState.Success, KVState.Failed):
                return  # already terminal: `_reap` acks once nothing is in flight
            self._fail(room, f"aborted by decode: {body.reason}", client_abort=body.client_abort)

    def _peer_by_sender(self, sender: str) -> DecodePeer | None:
        """Where to answer `sender` (acks, failures): registered now, or before a weight update."""
        return self.peers.get(sender) or self.stale_peers.get(sender)

    def _tell_ended(self, room: int, sender: str) -> None:
        """A KVRequest for a room that failed here before it came (e.g. aborted while its decode was
        still tokenizing): Failed at once, as `_reap` would have told a decode it knew. Before, the
        request was parked and the decode waited out its deadline, then answered a 503. Nothing of
        the room was ever written, so the promise of Status(Failed) holds."""
        tomb = self.tombstones[room]
        self._tell_failed(self._peer_by_sender(sender), room, tomb.reason, tomb.client_abort)

    def _tell_failed(self, peer: DecodePeer | None, room: int, reason: str, client_abort: bool) -> None:
        """Status(Failed) to a decode: the promise that none of our writes to the room is in flight."""
        if peer is not None:
            failed = Status(state=KVState.Failed, error=reason, client_abort=client_abort)
            self.control.send(peer.reply_addr, failed, room)

    def _on_register(self, msg: Register, reg_id: int, sender: str) -> None:
        """A decode introduces itself (again after a lost RegisterAck, a stale registration or a weight
        update: each accepted Register adds its agent again). `reg_id` (the envelope's room field) is echoed back so
        the decode can tell which of its pending registrations this ack answers. A registration we
        could not write to exactly as described is refused here, with the reason; accepted, it is
        only ever used within the bounds it announced (`_kv_request_error`). A refused Register
        leaves an earlier registration of the same sender in place."""
        error, reason = self._register_error(msg)
        if error is not None:
            self.count_failure(reason)
            self.control.send(msg.reply_addr, RegisterAck(ok=False, error=error), reg_id)
            return
        # Only queued: a backend that rejects the metadata logs it on the agent thread, and our writes
        # to this peer then fail as transfers, which fails their rooms (never the engine).
        self.agent.add_peer(msg.agent_name, msg.agent_metadata)
        slot_page_bytes = self.local_kv.num_regions * self.local_kv.bytes_per_page[0]
        self.stale_peers.pop(sender, None)
        self.peers[sender] = DecodePeer(
            msg.agent_name,
            msg.reply_addr,
            RegionTable(tuple(msg.kv_base_addrs), tuple(msg.kv_bytes_per_page)),
            msg.kv_num_pages,
            msg.handoff_base_addr,
            msg.handoff_slot_bytes,
            msg.num_handoff_slots,
            msg.staging_base_addr,
            msg.staging_bytes // slot_page_bytes,
            heard_s=self.rooms.now(),
        )
        ack = RegisterAck(
            ok=True,
            agent_name=self.agent.agent_name,
            room_life_s=self.config.room_life_s,
            peer_idle_s=self.config.peer_idle_s,
        )
        self.control.send(msg.reply_addr, ack, reg_id)

    def _register_error(self, msg: Register) -> tuple[str | None, str]:
        """(why we cannot write to this decode, the metrics key), or (None, "") if we can. The layout
        fingerprint names the model and the page layout; the region table and slot size are checked
        too, since descriptors are built from them (a mismatch used to surface as an exception in the
        engine's step)."""
        if msg.layout_fingerprint != self.fingerprint:
            error = (
                f"KV layout mismatch: prefill has {self.fingerprint!r}, decode has {msg.layout_fingerprint!r}"
            )
            return error, "layout_mismatch"
        ours = self.local_kv.bytes_per_page
        if tuple(msg.kv_bytes_per_page) != ours:
            error = (
                f"KV region mismatch: prefill has {len(ours)} regions of {ours[0]} bytes per page, decode "
                f"announces {len(msg.kv_bytes_per_page)} regions of {sorted(set(msg.kv_bytes_per_page))}"
            )
            return error, "region_mismatch"
        if msg.handoff_slot_bytes != self.handoff.slot_bytes:
            ours_b, theirs_b = self.handoff.slot_bytes, msg.handoff_slot_bytes
            return f"handoff slot size mismatch: prefill {ours_b}, decode {theirs_b} bytes", "region_mismatch"
        return None, ""

    def _on_kv_request(self, room: int, sender: str, msg: KVRequest) -> None:
        pr = self.by_room[room]
        if self.rooms.state(room) != KVState.Bootstrapping:
            # A replay (or a confused peer): the room already has its destination, or is over. Failing
            # it now would report "nothing in flight" (Status(Failed)) while writes may be: the decode
            # would free pages under them. Ignore it and count it, whatever it asks.
            self.count_failure("duplicate KVRequest ignored")
            return
        peer = self.peers.get(sender)
        if peer is not None:
            error = self._kv_request_error(pr, peer, msg)
        elif sender in self.stale_peers:
            error = STALE_REGISTRATION
        else:
            error = "decode is not registered"
        if error is not None:
            # Still Bootstrapping: nothing of this room was ever written, so the decode may free at once.
            self._tell_failed(self._peer_by_sender(sender), room, error, False)
            self._fail(room, error)
            return
        first = msg.decode_prefix_len // self.page_size
        pr.peer, pr.dst_page_ids, pr.first_page = peer, list(msg.dst_page_ids), first
        pr.handoff_slot, pr.staging_offset = msg.handoff_slot, msg.staging_offset
        pr.num_pages_sent = first
        self.rooms.advance(room, KVState.WaitingForInput)
        pr.kv_request_seen = True
        pr.de_hit_page_ids = list(msg.hit_page_ids)
        self._maybe_schedule(pr)

    def _kv_request_error(self, pr: PrefillRoom, peer: DecodePeer, msg: KVRequest) -> str | None:
        """Why this KVRequest cannot be served as asked (None: it can). Every place we would write to
        (destination pages, handoff slot, staging range) or read from (DE hit pages) must lie inside
        what the decode registered: the messages are authenticated, but a confused or replaying peer
        must not be able to aim our writes anywhere else in its memory."""
        ps = self.page_size
        num_prompt_pages = -(-pr.req.num_prompt_tokens // ps)
        first = msg.decode_prefix_len // ps
        dst, hits = msg.dst_page_ids, msg.hit_page_ids
        if msg.decode_prefix_len % ps or first + len(dst) != num_prompt_pages:
            return f"bad KVRequest: covers {first}+{len(dst)} pages, prompt has {num_prompt_pages}"
        if msg.decode_prefix_len >= pr.req.num_prompt_tokens:  # (the prefill computes at least one token)
            return (
                f"bad KVRequest: a decode prefix of {msg.decode_prefix_len} tokens leaves nothing of the "
                f"prompt's {pr.req.num_prompt_tokens} to compute"
            )
        if hits and len(hits) * ps != msg.decode_prefix_len:
            return (
                f"bad KVRequest: {len(hits)} hit pages for a decode prefix of {msg.decode_prefix_len} tokens"
            )
        if msg.handoff_slot >= peer.num_handoff_slots:
            return f"bad KVRequest: handoff slot {msg.handoff_slot} of {peer.num_handoff_slots}"
        if any(p >= peer.num_kv_pages for p in (*dst, *hits)):
            return f"bad KVRequest: a page id beyond the decode's {peer.num_kv_pages} pages"
        if len(set(dst) | set(hits)) != len(dst) + len(hits):
            return "bad KVRequest: a page id appears twice"
        if msg.staging_offset >= 0 and (
            not dst or msg.staging_offset + len(dst) > peer.staging_capacity_pages
        ):
            return (
                f"bad KVRequest: staging pages [{msg.staging_offset}, +{len(dst)}) outside the decode's "
                f"{peer.staging_capacity_pages}"
            )
        return None

    # ---- DualPath read paths ---------------------------------------------------------------------
    def _maybe_schedule(self, pr: PrefillRoom) -> None:
        """Once the KVRequest is in and our store read (PE path) is done: a request with stored KV runs
        the layerwise lane (PE path: hits from our host buffer; DE path: pulled from the decode),
        anything else joins the scheduler like any prefill."""
        if not pr.kv_request_seen or pr.store_read is not None or pr.req.status != RequestStatus.WAITING:
            return
        if self.rooms.state(pr.room) != KVState.WaitingForInput:
            # Failed meanwhile (an Abort, or a deadline that passed while our store read was in
            # flight): the decode may already have freed its pages (after our ack or its lease), so
            # nothing of this room may be computed or written any more. `_reap` releases it.
            return
        stored = pr.store_hit is not None or bool(pr.de_hit_page_ids)
        if stored and not self.layerwise.fits(pr, 0 if pr.store_hit is not None else len(pr.de_hit_page_ids)):
            # A prompt too long for the staging pool: served the ordinary way below (its stored KV is
            # recomputed here; on the DE path the decode's hit pages still spare their transfer).
            self.num_layerwise_fallbacks += 1
            log.warning("room %d: prompt too long for layerwise staging; prefilling it whole", pr.room)
            stored, pr.store_hit = False, None
        if stored and pr.store_hit is not None:
            read, num_blocks = pr.store_hit
            buffer, pr.store_hit = read.buffer, None
            hit_tokens = num_blocks * self.store.layout.block_size
            load = self.layerwise.from_host_buffer(buffer, num_blocks, self.store.layout)
            self._run_layerwise(pr, hit_tokens, load, storage=hit_tokens)
        elif stored:
            hit_tokens = len(pr.de_hit_page_ids) * self.page_size
            load = self.layerwise.from_decode_pages(pr, pr.de_hit_page_ids)
            # (the decode read them from the store; reported here, as only we know they were used)
            self._run_layerwise(pr, hit_tokens, load, storage=hit_tokens)
        elif pr.req not in self.engine.scheduler.waiting:
            self.engine.scheduler.add(pr.req)

    def _start_store_read(self, pr: PrefillRoom) -> None:
        """PE read path: read the prompt's stored blocks into a host buffer (store I/O threads), unless our
        own prefix cache already covers as much."""
        num_blocks = self.store.lookup(pr.req)
        own = len(self.engine.kv.match_prefix(pr.req)[0]) * self.page_size
        if num_blocks and num_blocks * self.store.layout.block_size > own:
            pr.store_read = self._read_store(pr.req, num_blocks)

    def _on_store_read_done(self, pr: PrefillRoom) -> None:
        pending, pr.store_read = pr.store_read, None
        try:
            result = pending.future.result()
            num_ok = pending.num_prefix_ok(result)
        except Exception:  # noqa: BLE001 - a failed read only means recompute
            log.exception("store read failed; recomputing")
            num_ok = 0
        if num_ok:  # bad or missing blocks from the first one on are simply recomputed
            pr.store_hit = (pending, num_ok)
        self._maybe_schedule(pr)

    def _run_layerwise(self, pr: PrefillRoom, hit_tokens: int, load, storage: int) -> None:
        req = pr.req
        try:
            self.layerwise.run(pr, hit_tokens, load, pr.first_page)
        except RoomEnded as e:  # failed (then `_fail` keeps the first reason) or past its deadline
            self._fail(pr.room, str(e))
            return
        except Exception as e:  # noqa: BLE001 - fail this request, keep the engine
            log.exception("layerwise prefill failed")
            self._fail(pr.room, f"layerwise prefill failed: {e}")
            return
        req.num_storage_tokens = storage
        self._send_last(pr)
        self.aengine.deliver_step_output(self.engine.output(req))

    # ---- sending pages (engine thread, from the engine's step hooks) -------------------------------
    def _after_step(self, sched) -> None:
        # Deadlines are swept again after the forward: a room whose state outlived its deadline during
        # the step must send nothing (the decode's abort lease is the sum of our deadlines: a write
        # submitted late also restarted the room's clock in Transferring, eating that margin).
        for room in self.rooms.expired():
            self._fail(room, self.rooms.reason(room), already_failed=True)
        for req in sched.requests:
            room = self.by_request.get(req.request_id)
            pr = self.by_room.get(room) if room is not None else None
            if pr is None or pr.sent_last or not self._may_send(room):
                continue
            if req.status.finished:
                self._send_last(pr)
            else:
                # Only whole pages, and only of the prompt, whose KV is computed.
                num_full = min(req.num_computed_tokens, req.num_prompt_tokens) // self.page_size
                if num_full > pr.num_pages_sent:
                    self._send_pages(pr, pr.num_pages_sent, num_full, last=False)

    def _send_pages(self, pr: PrefillRoom, start: int, end: int, last: bool) -> None:
        src = pr.req.page_ids[start:end]
        dst = pr.dst_page_ids[start - pr.first_page : end - pr.first_page]
        local, remote, local_slot = [], [], -1
        try:
            if pr.staging_offset >= 0:
                local, remote, local_slot = self._staged_descriptors(pr, src, start - pr.first_page)
            elif src:
                local, remote = page_descriptors(merge_runs(src, dst), self.local_kv, pr.peer.kv)
        except ValueError as e:
            # The last line of defence (Register and KVRequest are checked on arrival): a destination
            # we cannot describe fails this room, never the engine's step.
            self._fail(pr.room, f"bad destination: {e}")
            return
        # Unless gathered into our staging slot first, the write reads our KV pages: pin them.
        pins = src if local_slot < 0 else ()
        if last:
            if local and self.handoff_apart:
                # One NIXL transfer moves one kind of memory per side: the pages (GPU) go out first,
                # on their own, and the handoff row (host) last; the decode counts both.
                self.submit_write(pr, local, remote, False, local_slot, pins)
                local, remote, local_slot, pins = [], [], -1, ()
            slot_addr, slot_bytes = self.handoff.slot_addr(pr.local_slot), self.handoff.slot_bytes
            local.append((slot_addr, slot_bytes))
            remote.append(
                (pr.peer.handoff_base_addr + pr.handoff_slot * pr.peer.handoff_slot_bytes, slot_bytes)
            )
        self.submit_write(pr, local, remote, last, local_slot, pins)
        self.num_pages_sent += len(src)
        pr.num_pages_sent = end

    def _staged_descriptors(self, pr: PrefillRoom, src: list[int], rel_start: int):
        """Descriptors writing pages `src` into the decode's staging slot at positions rel_start.. (the
        slot is [regions, n, bytes_per_page]). Fragmented source pages are first gathered into a slot
        of our own, so every region goes out as one descriptor. Returns (local, remote, our slot | -1)."""
        if not src:
            return [], [], -1
        page_bytes = self.local_kv.bytes_per_page[0]
        num_regions, n, m = len(self.local_kv.base_addrs), len(pr.dst_page_ids), len(src)
        remote_slot = pr.peer.staging_base_addr + pr.staging_offset * num_regions * page_bytes
        local_slot = self.staging.alloc(m) if worth_staging(src, self.config.staging_threshold) else None
        local, remote = [], []
        if local_slot is not None:
            gather_pages(self.kv_regions, src, self.staging.view(local_slot, m))
            base = self.staging.descriptor(local_slot, m)[0]
            for r in range(num_regions):
                local.append((base + r * m * page_bytes, m * page_bytes))
                remote.append((remote_slot + (r * n + rel_start) * page_bytes, m * page_bytes))
            return local, remote, local_slot
        runs = merge_runs(src, range(rel_start, rel_start + m))
        for r in range(num_regions):
            for s_page, d_pos, k in runs:
                local.append((self.local_kv.base_addrs[r] + s_page * page_bytes, k * page_bytes))
                remote.append((remote_slot + (r * n + d_pos) * page_bytes, k * page_bytes))
        return local, remote, -1

    def _send_last(self, pr: PrefillRoom) -> None:
        req = pr.req
        slot = self.handoff.alloc()
        if slot is None:
            self.rows_wanted[pr.room] = None  # `_reap` hands it the next row freed
            return
        self.rows_wanted.pop(pr.room, None)
        pr.local_slot = slot
        lp = req.logprobs[0] if req.logprobs else None
        try:
            self.handoff.write_local(
                slot,
                HandoffRow(
                    room=pr.room,
                    first_token_id=req.output_token_ids[0],
                    cached_tokens_device=max(req.num_cached_tokens, 0),
                    cached_tokens_host=0,
                    cached_tokens_storage=req.num_storage_tokens,
                    first_logprob=lp.logprob if lp else None,
                    top_logprobs=tuple(lp.top) if lp else (),
                    first_logprob_rank=(lp.rank or 0) if lp else 0,
                ),
            )
        except BadHandoffRow as e:
            # A row the handoff cannot carry (a NaN logprob: an fp16 forward whose logits overflowed)
            # fails this room; raised from the step hook it ended the engine thread, and every later
            # request to this prefill failed (a review, 2026-12-05). The slot goes with the room.
            self._fail(pr.room, f"the first token cannot be handed off: {e}")
            return
        pr.sent_last = True
        self._send_pages(pr, pr.num_pages_sent, -(-req.num_prompt_tokens // self.page_size), last=True)

    # ---- failure and release -------------------------------------------------------------------
    def _fail(self, room: int, reason: str, already_failed: bool = False, client_abort: bool = False) -> None:
        pr = self.by_room.get(room)
        if pr is None or self.rooms.state(room) == KVState.Success:
            return  # (a room that succeeded, not yet reaped: the first outcome stands, nothing counted)
        if not already_failed and self.rooms.state(room) == KVState.Failed:
            # Failed before (e.g. a write's failure seen inside the layerwise lane, then the lane's own
            # error): the first outcome stands, counted and reported once; stop anything sent since.
            for tid in list(pr.in_flight):
                self.agent.abort(tid)
            return
        if not already_failed:
            self.rooms.fail(room, reason)
        self.count_failure(reason)
        for tid in list(pr.in_flight):
            self.agent.abort(tid)
        # The decode hears of the failure (Status Failed, or AbortAck if it asked) from `_reap`, only
        # once none of our writes to it can still land: then it may free its pages at once.
        pr.fail_reason, pr.client_abort = reason, client_abort
        # Tell the router's waiter, if the prompt never finished. An abort on purpose is an answer
        # ("abort"), not a failure the router would retry on another prefill.
        if not pr.req.status.finished:
            self.deliver_failure(pr.req.request_id, f"prefill failed: {reason}", client_abort)
        elif pr.store_read is None:
            # Its first token was answered, and nothing computes for it any more: free its id now,
            # not once its writes settle (the router retries a failed attempt under the client's rid,
            # on another decode with this prefill: a 409 meanwhile). The writes read pinned pages.
            self._forget_request(pr)

    def _forget_request(self, pr: PrefillRoom) -> None:
        """The engine forgets `pr`'s finished request and frees its pages but those its writes still
        read (`pinned`); our id map drops it if the id is still this room's (a retry may hold it)."""
        self.engine.release_held(pr.req)
        if self.by_request.get(pr.req.request_id) == pr.room:
            del self.by_request[pr.req.request_id]

    def _reap(self) -> None:
        """Free rooms that are terminal and have nothing in flight."""
        for room, pr in list(self.by_room.items()):
            state = self.rooms.state(room)
            if state not in (KVState.Success, KVState.Failed) or pr.in_flight:
                continue
            if state == KVState.Failed and not pr.req.status.finished:
                self.engine.scheduler.finish(pr.req, RequestStatus.FINISHED_ABORTED, free_pages=False)
            self._forget_request(pr)
            if pr.local_slot >= 0:
                self.handoff.free(pr.local_slot)
            if pr.abort_reply_to is not None:
                self.control.send(pr.abort_reply_to, AbortAck(), room)
            elif state == KVState.Failed and pr.peer is not None:
                self._tell_failed(pr.peer, room, pr.fail_reason, pr.client_abort)
            elif state == KVState.Failed:  # the decode has not asked yet: answer its KVRequest when it does
                self.tombstones[room] = Tombstone(self.rooms.now(), pr.fail_reason, pr.client_abort, False)
            del self.by_room[room]
            self.rows_wanted.pop(room, None)
            self.rooms.remove(room)
        self._hand_out_rows()

    def _hand_out_rows(self) -> None:
        """Free handoff rows go to the rooms waiting for one, oldest first; a room that failed or
        ended meanwhile is dropped (its own failure path tells the decode)."""
        while self.rows_wanted and self.handoff.num_free:
            room = next(iter(self.rows_wanted))
            del self.rows_wanted[room]
            pr = self.by_room.get(room)
            if pr is not None and not pr.sent_last and self._may_send(room):
                self._send_last(pr)

    def _may_send(self, room: int) -> bool:
        return self.rooms.state(room) in (KVState.WaitingForInput, KVState.Transferring)

    def queue_sizes(self) -> dict[str, int]:
        counts = self.rooms.counts()
        return {
            "bootstrap": counts[KVState.Bootstrapping],
            "waiting": counts[KVState.WaitingForInput],
            # (Transferring rooms, and ended ones whose writes are still in flight: once each)
            "inflight": counts[KVState.Transferring]
            + sum(
                1
                for room, p in self.by_room.items()
                if p.in_flight and self.rooms.state(room) != KVState.Transferring
            ),
        }

    def check_integrity(self) -> None:
        self.rooms.check_integrity()
        self.handoff.check_integrity()
        assert all(room in self.rooms for room in self.by_room), "a room is tracked but not in the table"
        assert set(self.transfers.values()) <= set(self.by_room), "a transfer outlived its room"
        assert not set(self.tombstones) & set(self.by_room), "a room is both live and ended"
        # Kept on purpose for a while (a late KVRequest is told the room ended; a KVRequest that beat
        # the router's request waits for it), and no longer: none outlived its bound at the last prune.
        assert all(self.pruned_at_s - t <= self.config.deadline_s for t, _, _ in self.early.values())
        assert all(self.pruned_at_s - tomb.t_s <= self.config.lease_s for tomb in self.tombstones.values())
        assert set(self.staging_slots) <= set(self.transfers), "a staging slot outlived its transfer"
        assert set(self.pinned) <= set(self.transfers), "a pinned page outlived its write"
        assert not set(self.abandoned_reads) & set(self.awaited), "an abandoned read is still awaited"
        for room in self.rows_wanted:  # (a room that ended waits to be reaped, then leaves the list)
            pr = self.by_room.get(room)
            assert pr is not None and pr.local_slot < 0 and not pr.sent_last, "a row wanted twice"
        self.staging.check_integrity()
        if self.store is not None:
            self.store.reads.check_integrity()
