"""What the prefill and decode roles share: their config, the engine's transfer-side view of its KV
pool, and the notification format.

Notification of one page write: b"<room>:<seq>:<total>", where seq counts the room's writes from 1
and total is 0 on every write but the last, which carries the number of writes of the room. The
decode knows the room's KV has landed when it holds the last notification and `total` in all.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from dataclasses import dataclass

from pdserve.disagg.state import KVState, min_lease_s, new_room  # noqa: F401 (the roles' and tests' name for it)
from pdserve.engine.async_engine import RequestAborted
from pdserve.transfer.pages import RegionTable

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
# Abort lease = the prefill's longest room life (its three deadlines) + a margin, which covers the tail
# of writes the prefill's backend is still cancelling and the Abort's delivery delay: the default adds
# LEASE_MARGIN_S; a configured lease must add at least MIN_LEASE_MARGIN_S.
LEASE_MARGIN_S = 10.0
MIN_LEASE_MARGIN_S = 1.0
# A room lives at most three deadlines, sent in RegisterAck.room_life_s (bounded there by 1e6 s).
MAX_DEADLINE_S = 1e5


log = logging.getLogger(__name__)

# A prefill's refusal of a KVRequest from a decode that registered before the prefill's weights
# changed (Status(Failed).error): the decode registers again (refused unless its weights match too).
STALE_REGISTRATION = "decode registered under weights this prefill no longer serves"
PEER_GC_INTERVAL_S = 1.0  # idle peers are looked for at most this often (room clock)


@dataclass(frozen=True)
class PDConfig:
    """Knobs of one PD engine (either role). Deadlines bound every non-terminal state."""

    cluster_secret: bytes
    transfer_backend: str = "nixl"
    bootstrap_port: int = 8998  # prefill only; 0 = pick a free port
    deadline_s: float = 30.0  # per non-terminal state
    # The decode frees aborted pages after the prefill's ack or its lease (`lease_s`): this value, or,
    # when None, the room life for `deadline_s` + LEASE_MARGIN_S (100 s by default). A value below the
    # room life + MIN_LEASE_MARGIN_S is refused. Per prefill, the decode also waits at least that
    # prefill's own room life (from its RegisterAck) + MIN_LEASE_MARGIN_S.
    abort_lease_s: float | None = None
    num_handoff_slots: int = 256
    growth_reserve_tokens: int = 128  # decode admission: tokens of growth reserved per request
    admission_aging_s: float = 2.0  # decode admission: after this long in prealloc, nothing overtakes
    # Staging (gather -> one write per region -> scatter) for requests whose decode pages are
    # fragmented: runs / pages above this threshold, pages of at most `staging_max_page_bytes` (bigger
    # pages move as fast directly: docs/benchmarks.md, transfer). A negative threshold stages always.
    staging_threshold: float = 0.5
    staging_max_page_bytes: int = 32 << 10
    staging_capacity_pages: int = 512
    # DualPath persistent KV store (a directory; local disk, NFS or a 3FS mount). None: no store.
    kv_store_dir: str | None = None
    kv_store_gib: float = 8.0
    # After a weight update, keep the previous weights' store directory (default: removed once this
    # engine no longer reads or writes it: its blocks are never read again, and an RL loop's updates
    # would otherwise leave a full store's worth of disk behind each).
    kv_store_keep_old_weights: bool = False
    kv_block_size: int = 64  # tokens per stored block (a multiple of the page size)
    # DualPath node emulation (pdserve.netem): the node this engine belongs to, the directory holding
    # the node's shared link files, and the NIC budgets (inf: unlimited, i.e. a real deployment that
    # maps the traffic classes to the NIC's QoS instead).
    node: str = "node0"
    node_dir: str | None = None
    snic_bytes_per_s: float = float("inf")
    cnic_bytes_per_s: float = float("inf")
    # Registrations are leases. A prefill forgets a decode it has heard nothing from in `peer_idle_s`
    # and whose rooms are all gone (its transfer-agent entry is removed too: each decode restart, a
    # new agent name, used to stay for the prefill's life); a decode registers again with a prefill
    # it has sent nothing to in `peer_renew_s` before its next KVRequest, so a live decode is never
    # forgotten under it. A decode forgets a prefill it has not used in `peer_idle_s` likewise.
    peer_idle_s: float = 600.0
    # A store read still in flight after this long (None: half of `deadline_s`) is left behind and its
    # prompt computed instead (the decode asks the prefill for all of it); no request joins such a
    # read. A hung disk failed the request at its state deadline (a 503), and every retry joined the
    # same hung read.
    store_read_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.peer_idle_s < math.inf:  # (NaN fails too)
            raise ValueError(f"peer_idle_s must be finite and > 0 s, got {self.peer_idle_s}")
        if not 0.0 < self.deadline_s <= MAX_DEADLINE_S:  # (NaN fails too)
            raise ValueError(f"deadline_s must be in (0, {MAX_DEADLINE_S:.0f}] s, got {self.deadline_s}")
        if self.store_read_timeout_s is not None and not 0.0 < self.store_read_timeout_s < self.deadline_s:
            raise ValueError(
                f"store_read_timeout_s must be in (0, deadline_s = {self.deadline_s}) s, got "
                f"{self.store_read_timeout_s} (past the deadline the request fails before its read is left)"
            )
        # A lease shorter than the prefill's longest room life lets the decode reuse pages that a
        # prefill which never got the Abort (partitioned, ack lost) may still write: refuse it.
        floor_s = min_lease_s(self.deadlines(), margin_s=MIN_LEASE_MARGIN_S)
        if self.abort_lease_s is not None and not floor_s <= self.abort_lease_s < math.inf:
            raise ValueError(
                f"abort_lease_s={self.abort_lease_s} s is below the safe minimum of {floor_s} s (the "
                f"prefill's three state deadlines of {self.deadline_s} s + {MIN_LEASE_MARGIN_S} s, see "
                "disagg.state.min_lease_s): a decode could free pages that a late write still lands in"
            )

    @property
    def room_life_s(self) -> float:
        """The longest a room lives on a prefill with these deadlines (sent in its RegisterAck)."""
        return min_lease_s(self.deadlines(), margin_s=0.0)

    @property
    def peer_renew_s(self) -> float:
        """A decode re-registers before asking a prefill it has been silent to for this long: a
        quarter of the prefill's `peer_idle_s`, a wide margin for messages still on their way."""
        return self.peer_idle_s / 4

    @property
    def store_read_budget_s(self) -> float:
        """How long a store read may stay in flight before it is left behind (`store_read_timeout_s`)."""
        return self.deadline_s / 2 if self.store_read_timeout_s is None else self.store_read_timeout_s

    @property
    def lease_s(self) -> float:
        """The decode's abort lease: as configured, else derived from the deadlines."""
        if self.abort_lease_s is not None:
            return self.abort_lease_s
        return self.room_life_s + LEASE_MARGIN_S

    def deadlines(self) -> dict[KVState, float]:
        return {
            KVState.Bootstrapping: self.deadline_s,
            KVState.WaitingForInput: self.deadline_s,
            KVState.Transferring: self.deadline_s,
        }

    @staticmethod
    def secret_from(value: str | None) -> bytes:
        """--cluster-secret, else $PDSERVE_CLUSTER_SECRET; refuse to run PD without one."""
        value = value or os.environ.get(SECRET_ENV)
        if not value:
            raise ValueError(f"PD roles need a cluster secret: pass --cluster-secret or set ${SECRET_ENV}")
        return value.encode()

    @staticmethod
    def generate_secret() -> str:
        return secrets.token_hex(32)


def region_table(kv_cache) -> RegionTable:
    """The KV pool as the transfer layer addresses it: regions K0, V0, K1, V1, ..."""
    regions = kv_cache.regions()
    return RegionTable(
        base_addrs=tuple(addr for addr, _ in regions),
        bytes_per_page=(kv_cache.layout.bytes_per_page,) * len(regions),
    )


def encode_notif(room: int, seq: int, total: int) -> bytes:
    return b"%d:%d:%d" % (room, seq, total)


def decode_notif(notif: bytes) -> tuple[int, int, int] | None:
    try:
        room, seq, total = (int(x) for x in notif.split(b":"))
    except ValueError:
        return None
    return room, seq, total


def make_staging(kv_cache, capacity_pages: int):
    """The engine's staging pool: slots laid out [regions, pages, bytes_per_page] (one page = one page
    of every K/V region), registered with the transfer agent next to the KV pool, on the pool's device
    (gathers and scatters stay device-local copies; the transfer moves GPU memory to GPU memory)."""
    from pdserve.transfer.staging import StagingPool, kv_regions

    layout = kv_cache.layout
    regions = kv_regions(kv_cache.k, kv_cache.v)
    return StagingPool(len(regions), layout.bytes_per_page, capacity_pages, device=regions[0].device), regions


class PDRoleBase:
    """State both PD roles keep (the subclasses are `EngineRole`s: every method runs on the engine
    thread, with the exceptions `EngineRole` names). `agent` may be set after construction: the agent registers the role's handoff and
    staging buffers, so it is created once the role exists (see `PDContext`)."""

    answers_client = False  # the decode's stream is the client's answer (it counts a failed request)
    # Handoff rows per `num_handoff_slots`: a decode's are its admission's (one per room it admits); a
    # prefill's are the source rows of its last writes, to every decode it serves (PrefillRole).
    handoff_slots_factor = 1

    def __init__(self, engine, config: PDConfig, control, agent, layout_fingerprint: str) -> None:
        from pdserve.disagg.handoff import HandoffPool
        from pdserve.disagg.state import RoomTable

        self.engine = engine
        self.config = config
        self.control = control
        self.agent = agent
        self.fingerprint = layout_fingerprint
        self.page_size = engine.kv.page_size
        self.local_kv = region_table(engine.runner.kv_cache)
        self.handoff = HandoffPool(config.num_handoff_slots * self.handoff_slots_factor)
        self.staging, self.kv_regions = make_staging(engine.runner.kv_cache, config.staging_capacity_pages)
        # KV and staging live on the engine's device, handoff slots in host memory: on a GPU a write
        # cannot carry pages and the handoff row together (see PrefillRole._send_pages).
        self.handoff_apart = self.kv_regions[0].device.type != "cpu"
        self.rooms = RoomTable(config.deadlines())
        self.failures: dict[str, int] = {}  # reason -> count (metrics)
        self.num_peers_forgotten = 0  # peers dropped after `peer_idle_s` unused (metrics)
        self.num_store_reads_left = 0  # store reads past `store_read_budget_s`: their prompts computed
        self._next_peer_gc_s = 0.0

    def _read_store(self, req, num_blocks: int):
        """Start (or join) the store read of `req`'s first `num_blocks` blocks, stamped with the room
        clock; a read in flight longer than the budget is not joined (`_store_read_overdue`)."""
        return self.store.start_read(req, num_blocks, self.rooms.now(), self.config.store_read_budget_s)

    def _store_read_overdue(self, pending, room: int, now: float, instead: str) -> bool:
        """Whether `pending` (not done) has been in flight past `store_read_budget_s` (a stuck disk);
        if so it is counted and logged, and the caller leaves it behind and does `instead`. The read
        ends on the store's I/O threads whenever it does; its buffer goes with it."""
        budget_s = self.config.store_read_budget_s
        if now - pending.started_s <= budget_s:
            return False
        self.num_store_reads_left += 1
        log.warning("room %d: store read in flight for over %.1f s; %s", room, budget_s, instead)
        return True

    def peer_gc_due(self) -> float | None:
        """The room clock's time when idle peers are due for a look (at most every
        PEER_GC_INTERVAL_S: a role's tick runs thousands of times a second), else None."""
        now = self.rooms.now()
        if now < self._next_peer_gc_s:
            return None
        self._next_peer_gc_s = now + PEER_GC_INTERVAL_S
        return now

    def sync_device(self) -> None:
        """Wait until the engine's queued GPU work has run (nothing to wait for on the CPU).

        Called before KV or staging memory is handed to the transfer agent: NIXL's GPU copies do not
        run on the engine's stream, so a write must not start before the kernels that fill its source
        (the forward's KV stores, a gather) have run, and no copy may land in a staging slot a queued
        kernel still reads (a scatter, a copy-out)."""
        device = self.kv_regions[0].device
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)

    def deliver_failure(self, request_id: str, message: str, client_abort: bool) -> None:
        """Engine thread: the request's room failed. Aborted on purpose (`client_abort`: here, or on
        the peer that told us), its caller answers "abort" (RequestAborted); else it gets a failure
        (a 503, which the router may retry). Counted as ended ("abort" or "error") by the role that
        answers the client (`answers_client`: the decode), once per request."""
        error = (RequestAborted if client_abort else RuntimeError)(message)
        if self.answers_client:
            self.aengine.deliver_failed(error, request_id, "abort" if client_abort else "error")
        else:
            self.aengine.deliver(error, request_id)

    def count_failure(self, reason: str) -> None:
        key = reason.split(":")[0]
        self.failures[key] = self.failures.get(key, 0) + 1
