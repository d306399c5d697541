"""What a PD engine tells the router about its load (DualPath's per-fetch engine report).

Who calls it: the HTTP thread of a prefill or decode engine (`GET /pd/load`), which the router polls
every `--load-interval-s` (default 50 ms; the paper's scheduler needs a report at least every 100 ms).
It reads the engine thread's state without a lock: each container is copied by one C-level call
(`list(d.values())`, atomic under the GIL) and the sums over the copies are a snapshot that is at most
one engine step stale, which is all a load report promises.

Fields (paper §6, "seq_e, tok_e, read_q, free HBM"):
* `num_seqs`, `num_tokens` — prefill: requests not yet handed off and their prompt tokens still to
  compute (a stored hit being read, or the decode's hit pages, is not to compute: the scheduler books
  a request's new tokens only, and the two must count alike, else a prefill's load jumped by the hit at
  every report and fell back once it was loaded, a review, 2026-12-05); decode: requests held (admitted
  or waiting for their KV) and their whole lengths, prompt + max_tokens - 1 (the scheduler's len(r)).
* `num_free_pages` — decode: pages an allocation could get now (free + evictable cached) minus the
  growth reserved by requests whose KV is arriving and the prompt pages of requests not yet admitted.
* `read_queue_tokens` — hit tokens of this engine's store reads in flight.
* `planned_read_tokens` — DE read path requests waiting for pages: their reads start at admission,
  so without this a burst assigned to one decode would look like an idle node for a while.
* `node_read_queue_bytes` — bytes of storage reads pending on the node's storage NIC, all engines of
  the node together (from the shared link; -1 without node emulation or with an unlimited SNIC, whose
  link keeps no shared state, and the `snic_*` figures then stay 0). The router turns it into tokens
  with `kv_bytes_per_token` and keeps the larger of the two views.
"""

from __future__ import annotations

import math
import time

import msgspec

from pdserve.disagg.state import TERMINAL


class LoadReport(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    node: str
    num_seqs: int
    num_tokens: int
    num_free_pages: int
    num_total_pages: int
    page_size: int
    kv_block_size: int
    kv_bytes_per_token: int
    read_queue_tokens: int
    planned_read_tokens: int = 0  # reads accepted but not yet submitted (a decode's prealloc queue)
    node_read_queue_bytes: int = -1
    node_read_queue_tokens: int = -1  # the same backlog in tokens (bytes / kv_bytes_per_token)
    snic_bytes_per_s: float = 0.0  # 0: unlimited / not emulated
    snic_bytes_served: int = 0  # cumulative, node-wide (utilization = its rate of change)
    snic_read_bytes_served: int = 0
    time_s: float = 0.0


def _pending_read_tokens(rooms, block_size: int) -> int:
    """Tokens the rooms' store reads in flight read, each read once: requests that joined another's
    read share its future and buffer (`store/joined_reads.PendingRead`), whose rows are the blocks read
    (the owner's, also once its room is gone)."""
    num_blocks_by_read: dict[int, int] = {}
    for r in rooms:
        # Read `store_read` once per room: the engine thread sets it to None when the read completes,
        # so a second read of the attribute (test, then use) could see None.
        if (read := r.store_read) is not None:
            num_blocks_by_read[id(read.future)] = len(read.buffer)
    return sum(num_blocks_by_read.values()) * block_size


def _tokens_to_compute(pr, store_block_size: int, page_size: int) -> int:
    """A prefill room's prompt tokens still to compute: its hit (a store read in flight or done, or
    the decode's hit pages), once known, is loaded, not computed; at least one token is computed."""
    req = pr.req
    if (read := pr.store_read) is not None:  # (each attribute read once: the engine thread clears it)
        hit = len(read.buffer) * store_block_size
    elif (got := pr.store_hit) is not None:
        hit = got[1] * store_block_size
    else:
        hit = len(pr.de_hit_page_ids) * page_size
    done = max(req.num_computed_tokens, min(hit, req.num_prompt_tokens - 1))
    return max(0, req.num_prompt_tokens - done)


def _computing(role, room: int) -> bool:
    """A prefill room not yet ended (read off the engine thread: one removed meanwhile is not)."""
    try:
        return role.rooms.state(room) not in TERMINAL
    except KeyError:  # (UnknownRoom)
        return False


def load_report(role, node: str, traffic=None) -> LoadReport:
    """The report of a `PrefillRole` or `DecodeRole` (duck-typed on `role.by_room`)."""
    engine = role.engine
    kv_layout = engine.runner.kv_cache.layout
    store = getattr(role, "store", None)
    block_size = store.layout.block_size if store is not None else role.config.kv_block_size
    bytes_per_token = (
        store.layout.block_nbytes // store.layout.block_size
        if store is not None
        else 2 * kv_layout.num_layers * kv_layout.bytes_per_page // kv_layout.page_size
    )
    pool = engine.kv.pool
    planned = 0
    if hasattr(role, "by_room"):  # prefill
        # (rooms that ended -- failed, or succeeded -- and wait only for their writes to settle have
        # nothing left to compute: a failed one's freed request read as its whole prompt to compute,
        # and placement kept away from a prefill with nothing to do; a review, 2026-12-04)
        rooms = [pr for room, pr in list(role.by_room.items()) if _computing(role, room)]
        num_seqs = len(rooms)
        num_tokens = sum(_tokens_to_compute(pr, block_size, role.page_size) for pr in rooms)
        num_free = pool.num_free_pages
    else:  # decode
        rooms = list(role.prealloc) + list(role.transfer.values())
        # Every request it holds (the engine has each from `DecodeRole.add`, before its KV arrives) at
        # its whole length, prompt + max_tokens - 1: the scheduler's len(r), what it books at
        # assignment; current lengths made a decode's load fall at each report below what was booked
        # (a review, 2026-12-05).
        reqs = list(engine.requests.values())
        num_seqs = len(reqs)
        num_tokens = sum(max(r.num_tokens, r.num_prompt_tokens + r.max_tokens - 1) for r in reqs)
        waiting_pages = sum(-(-d.req.num_prompt_tokens // role.page_size) for d in list(role.prealloc))
        num_free = max(0, pool.num_free_pages - role._reserved_pages() - waiting_pages)
        planned = sum(
            (d.req.num_prompt_tokens - 1) // block_size * block_size
            for d in list(role.prealloc)
            if d.req.read_path == "de" and store is not None
        )
    report = LoadReport(
        role="prefill" if hasattr(role, "by_room") else "decode",
        node=node,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        num_free_pages=num_free,
        num_total_pages=pool.num_pages,
        page_size=role.page_size,
        kv_block_size=block_size,
        kv_bytes_per_token=bytes_per_token,
        read_queue_tokens=_pending_read_tokens(rooms, block_size),
        planned_read_tokens=planned,
        time_s=time.time(),
    )
    snic = traffic.snapshot()["snic"] if traffic is not None else None
    # Node-wide figures only from an emulated SNIC with a rate: an unlimited one (a node dir with no
    # --snic-mbps) has no shared state, so its read queue read 0 and its counters were this process's
    # own, and the router took "0" for the node's queue over its engines' reads (a review, 2026-12-05).
    if snic is not None and math.isfinite(snic["bytes_per_s"]):
        report.node_read_queue_bytes = int(traffic.read_queue_bytes())
        report.node_read_queue_tokens = report.node_read_queue_bytes // max(1, bytes_per_token)
        report.snic_bytes_per_s = float(snic["bytes_per_s"])
        report.snic_bytes_served = int(sum(snic["served_bytes_by_class"].values()))
        report.snic_read_bytes_served = int(snic["served_bytes_by_tag"]["read"])
    return report
