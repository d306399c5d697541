"""Discrete-event simulator of a PD-disaggregated cluster with DualPath KV loading.

Who calls it: scenarios (``pdserve.sim.scenarios``), the CLI and tests: ``ClusterSim(config,
workload).run()`` returns a ``SimResult``. It drives the real router scheduler
(``pdserve.dualpath.scheduler``) with load reports, as the router would. ``progress(t_s, num_turns_done)``,
if given, is called every 5 simulated seconds (the CLI's bar shows it).

Model (one concept, the cluster; the file is long, ~1,100 lines, because the event handlers of storage
reads, host buffers, prefill groups and decode groups share the event heap, the clock and each other's
state, and splitting them would only add indirection, and a module boundary to the compiled build):

* P prefill nodes and D decode nodes of g GPUs; one engine per GPU (a DP-attention rank / TP group).
  Prefill ranks form EP groups (``prefill_ep_gpus``: 16 for DS-660B's EP16, 8 for DS-27B, 1 for a dense
  model) that run every forward in lockstep, as DP attention + EP MoE does: a group step starts when
  the group is idle and any rank has ready work; each rank brings its own batch; the step's compute is
  the overhead + the MoE share of all the group's new tokens spread over the ranks + the slowest rank's
  attention, and its copies wait for the slowest rank's.
  Per node: one SNIC link (storage reads), one DRAM link (reads + writes add); per GPU: a CNIC read link
  (the NIC reads memory: egress, and the host side of a loopback copy) and a CNIC write link (ingress,
  and the device side of a loopback copy). All GPU traffic, local H2D included, goes through the GPU's
  paired CNIC (paper §5), which is what the analytic bounds 1/7 ≤ P/D ≤ 7/2 assume.
* Requests: the router queue is FIFO; a fetch runs the scheduler; each assignment starts the hit
  reads (FIFO per SNIC; the node's read queue is the hit tokens not yet read); when they are done the
  request joins its PE's ready list (kept in rid = FIFO order, so waiting-for-read requests are never
  scanned). A PE builds a batch from requests whose reads are done, in FIFO order, under the
  compute quota (``build_prefill_batch``), and books the batch's per-layer copies:
  PE path: PE DRAM→PE GPU (loopback on the PE CNIC), then hit+miss KV PE GPU→DE host;
  DE path: DE DRAM→DE CNIC→PE GPU, then only the miss KV back to the DE host.
  Layerwise: step time = max(compute, copies, descriptor submission) + one layer of pipeline fill.
  Not layerwise (Basic): every rank loads all, then the group computes, then every rank sends,
  serially; a rank's batch KV must fit its HBM.
  When a request's prefill ends (first token = TTFT) the DE copies its whole prompt KV host→GPU
  (loopback on the DE CNIC), then decodes.
* Host buffers (pinned DRAM per node, ``SimConfig.host_buffer_gb``; paper: 80 GB for the DS models):
  at its first read a request reserves the PE-read hit on its PE node and its whole prompt's KV on its
  DE node (the DE-read hit plus what the PE sends back), all at once so that no request holds room
  while waiting for more. A read without room waits, and the reads queued behind it on that SNIC,
  except a split request's second read, whose room is already held: it passes (else two split
  requests could wait on each other's room); a request with nothing to read waits per DE node. Room
  on a node goes in FIFO order over both kinds of waiter (``_reserve``). Freed: the PE side once
  loaded into the GPU (Basic) or when the request's prefill ends (layerwise streams the hit again for
  every chunk); the DE side at the decode H2D. A node with an empty buffer takes any size.
* Decode: DE ranks form decode EP groups (``decode_ep_gpus``: 32 for DS-660B = EP32 over 4 nodes, 8
  for DS-27B, 1 for a dense model) that step in lockstep: a step costs the overhead + the per-sequence
  (MoE) work of all the group's sequences spread over its ranks + the slowest rank's attention (KV
  bytes read); with one rank per group it is the cost model's step for that engine's batch. Instead
  of one event per step we keep a virtual token clock per group (tokens each sequence has decoded
  since the group started), so events happen only when a sequence joins or leaves.
* Agents: when a turn's last token is out, the agent submits its next turn after the turn's think
  time; prompt = previous context + append; hit = previous context rounded down to store blocks.

Ties: events at equal times run in the order they were scheduled (a global sequence number), so a run
is a deterministic function of (config, workload). A next turn with zero think time (the paper's
replay) is submitted inside the finishing handler instead of through the heap.

Speed (the 48P96D scale run simulates 2.67 M turns): handlers index a table by event kind; per-turn
workload arrays are Python lists; the cost model is bound once per profile (``prefill_request_fn``,
``decode_attn_fn``); the three links of every KV copy are booked in one call (``links.book3``); the
cyclic GC is paused during the run.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from bisect import insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count, islice
from typing import Any

import numpy as np

from pdserve.bench.workloads import Workload
from pdserve.dualpath.cost_model import (
    decode_attn_fn,
    hbm_kv_bytes,
    prefill_request_fn,
    prefill_tokens_per_s,
)
from pdserve.dualpath.scheduler import (
    PATH_PE,
    AdditiveBatchCost,
    DualPathScheduler,
    EngineLoad,
    PendingRequest,
    PrefillItem,
    build_prefill_batch,
    policy_config,
)
from pdserve.sim.config import HardwareConfig, SimConfig, get_mode
from pdserve.sim.errors import SimulationStalled, TurnDoesNotFit
from pdserve.sim.links import KV_MIN_SHARE, Link, book3

# A 300 ms quota holds a handful of agentic appends; the batch builder looks at no more ready requests.
MAX_READY_SCAN = 16


def _rid(r: _Req) -> int:
    return r.rid


# Event kinds.
_ARRIVE, _FETCH, _READ_DONE, _BATCH_LOADED, _BATCH_DONE, _DE_READY, _DE_TICK, _BUF_FREE, _PE_TRY = range(9)


class _Req:
    __slots__ = (
        "rid",
        "agent",
        "turn",
        "t_submit",
        "hit",
        "new",
        "gen",
        "prompt",
        "pe",
        "de",
        "path",
        "pe_read",
        "de_read",
        "reads_left",
        "new_done",
        "inbound_done",
        "pe_buf",
        "de_buf",
        "waits_room",
        "room_seen",
        "t_first",
        "t_join",
        "t_done",
    )

    def __init__(
        self, rid: int, agent: int, turn: int, t_submit: float, hit: int, new: int, gen: int
    ) -> None:
        self.rid = rid
        self.agent = agent
        self.turn = turn
        self.t_submit = t_submit
        self.hit = hit
        self.new = new
        self.gen = gen
        self.prompt = hit + new
        self.pe = self.de = -1
        self.path = PATH_PE
        self.pe_read = self.de_read = 0
        self.reads_left = 0
        self.new_done = 0
        self.inbound_done = False
        self.pe_buf = self.de_buf = 0  # host-buffer bytes held on the PE / DE node
        self.waits_room = False  # refused room and not given it yet (in ``ClusterSim.room_wait``)
        self.room_seen = -1  # ``ClusterSim.room_ver`` of its two nodes, summed, when last refused room
        self.t_first = self.t_join = self.t_done = math.nan


class _Decode:
    """One decode engine (a DP-attention rank): its running batch and what the scheduler sees."""

    __slots__ = ("n", "ctx_base", "attn_s", "seqs", "tokens", "free_pages")

    def __init__(self, free_pages: int):
        self.n = 0  # running sequences
        self.ctx_base = 0.0  # Σ (ctx at join - group clock v at join) over running sequences
        self.attn_s = 0.0  # its batch's attention time, as of its last join or leave (lockstep only)
        self.seqs = 0  # assigned and not finished (includes those not yet joined)
        self.tokens = 0
        self.free_pages = free_pages


class _DecodeGroup:
    """Decode ranks that step in lockstep (one decode EP group) under one virtual token clock ``v``:
    every running sequence of the group has decoded ``v - v_at_join`` tokens, so only joins and leaves
    are events. ``heap`` holds (v at which the sequence is done, rid, request) for all its ranks."""

    __slots__ = ("v", "t_last", "step_s", "heap", "version", "n", "attn_max", "attn_arg")

    def __init__(self) -> None:
        self.v = 0.0
        self.t_last = 0.0
        self.step_s = 0.0
        self.heap: list[tuple[float, int, _Req]] = []
        self.version = 0
        self.n = 0  # running sequences over all ranks
        self.attn_max = 0.0  # the slowest rank's attention time and that rank (lockstep only)
        self.attn_arg = -1


@dataclass
class SimResult:
    """Per-run figures; arrays are per finished turn unless said otherwise."""

    config: SimConfig
    makespan_s: float
    agent_done_s: np.ndarray
    agent_arrival_s: np.ndarray  # when each agent's first turn was submitted
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    turn_submit_s: np.ndarray  # submit time of the turn behind each ``ttft_s``
    tpot_submit_s: np.ndarray  # submit time of the turn behind each ``tpot_s``
    num_turns_submitted: int
    unanswered_submit_s: np.ndarray  # submit times of turns without a first token when the run stopped
    num_turns_done: int
    # Mean over EP-group forwards in which every rank has work of the slowest rank's attention time
    # over the ranks' mean; nan with one rank per group or if no forward had every rank busy.
    attn_max_over_avg: float
    wall_s: float
    cpu_s: float  # process CPU time: the fair speed figure on a shared machine
    links: dict[str, list[Link]] = field(default_factory=dict)
    reqs: list | None = None  # every request (tests only)
    buffer_peak_bytes: list[int] = field(default_factory=list)  # per node: prefill nodes, then decode

    @property
    def pe_buffer_peak_gb(self) -> float:
        """Largest host-buffer use of any prefill node, GB."""
        return max(self.buffer_peak_bytes[: self.config.num_prefill_nodes], default=0) / 1e9

    @property
    def de_buffer_peak_gb(self) -> float:
        """Largest host-buffer use of any decode node, GB."""
        return max(self.buffer_peak_bytes[self.config.num_prefill_nodes :], default=0) / 1e9

    @property
    def jct_s(self) -> float:
        """Job completion time: when the last agent finished (offline)."""
        return self.makespan_s

    @property
    def jct_mean_s(self) -> float:
        """Mean agent completion time: from the agent's first submit to its last turn's end (offline
        agents all arrive at t = 0; `mooncake@trace` keeps the trace's arrivals, which the mean of the
        end times counted in: 55.1 s against 47.0 s of completion time on 64 of its requests)."""
        finished = ~np.isnan(self.agent_done_s)
        times = self.agent_done_s[finished] - self.agent_arrival_s[finished]
        return float(times.mean()) if len(times) else math.nan

    def snic_max_over_avg(self, min_util: float | None = None) -> float:
        """Mean over busy windows of (max SNIC bytes / mean SNIC bytes) across all nodes' SNICs.

        A window counts when the mean SNIC utilization in it is ≥ ``min_util`` (default: the config's
        ``balance_min_util``, 0.2; idle tails say nothing about balance). Returns nan if no window
        qualifies.
        """
        if min_util is None:
            min_util = self.config.balance_min_util
        snics = self.links["snic"]
        n_win = max(len(s.windows) for s in snics)
        mat = np.zeros((len(snics), n_win))
        for i, s in enumerate(snics):
            mat[i, : len(s.windows)] = s.windows
        cap = snics[0].capacity * snics[0].window_s
        means = mat.mean(axis=0)
        ok = (means >= min_util * cap) & (means > 0)  # (an idle window has no max/avg, even at min_util 0)
        if not ok.any():
            return math.nan
        return float((mat[:, ok].max(axis=0) / means[ok]).mean())


def model_cnic_shares(cfg: SimConfig) -> tuple[float, float]:
    """The expected model-traffic (EP all-to-all) share of each prefill and each decode CNIC, reserved
    for the high traffic class. ValueError when a side's share passes 99% (see `_model_cnic_share`);
    the sweeps call it for every setting before their first run, so that none is lost to it."""
    m, hw = cfg.model, cfg.hw
    pe_rate = prefill_tokens_per_s(m, 32_768)
    u_pe = _model_cnic_share(
        m.model_cnic_bytes_per_prefill_token * pe_rate, cfg.prefill_ep_group, hw, m.name, "prefill"
    )
    u_de = _model_cnic_share(  # ~1.5K tok/s/GPU
        m.model_cnic_bytes_per_decode_token * 1500.0, cfg.decode_ep_group, hw, m.name, "decode"
    )
    return u_pe, u_de


def _model_cnic_share(bytes_per_s: float, ep_gpus: int, hw: HardwareConfig, model: str, side: str) -> float:
    """The share of each of a side's CNICs its EP all-to-all takes at the expected token rate (the high
    traffic class's reservation). An EP group inside one node (EP1 included) keeps its all-to-all on
    NVLink: none (before, `--prefill-ep-gpus 1` and DS-27B's EP8 on 8-GPU nodes reserved 10% and 8%).
    ValueError past 99% (KV's floor): the all-to-all would slow the forward, which the model leaves out,
    and model + KV traffic ran above the link's capacity (from ~41 Gbit/s CNICs for DS-660B)."""
    if ep_gpus <= hw.gpus_per_node and hw.gpus_per_node % ep_gpus == 0:
        return 0.0
    share = bytes_per_s / hw.cnic_bytes_per_s
    if share > 1.0 - KV_MIN_SHARE:
        raise ValueError(
            f"{model}: the {side} EP{ep_gpus} all-to-all needs {bytes_per_s * 8 / 1e9:.0f} Gbit/s of each "
            f"{side} GPU's compute NIC at its expected token rate, more than 99% of --cnic-gbps "
            f"{hw.cnic_gbps:g}: a compute NIC that slow is not modelled (its all-to-all would slow the "
            "forward itself)"
        )
    return share


def _arrivals(wl: Workload) -> np.ndarray:
    """When each agent's first turn is submitted: its start plus that turn's think time (an agent
    without turns: its start)."""
    first = np.asarray(wl.offsets[:-1])
    has_turns = first < np.asarray(wl.offsets[1:])
    think = np.zeros(wl.num_agents)
    think[has_turns] = wl.think_s[first[has_turns]]
    return wl.start_s + think


class ClusterSim:
    def __init__(
        self,
        config: SimConfig,
        workload: Workload,
        progress: Callable[[float, int], None] | None = None,
        keep_requests: bool = False,
    ) -> None:
        self.cfg = cfg = config
        self.wl = workload
        self.mode = get_mode(cfg.mode)
        self.progress = progress
        self.keep_requests = keep_requests
        hw, m = cfg.hw, cfg.model
        g = hw.gpus_per_node
        self.g = g
        self.P, self.D = cfg.num_prefill_nodes, cfg.num_decode_nodes
        self.num_pe = self.P * g
        self.num_de = self.D * g
        self.kv_tok = m.kv_bytes_per_token
        self.layers = m.num_layers
        u_pe, u_de = model_cnic_shares(cfg)
        W, rec = cfg.window_s, cfg.record_intervals
        n_nodes = self.P + self.D
        self.snic = [Link(f"snic{n}", hw.snic_bytes_per_s, W, 0.0, rec) for n in range(n_nodes)]
        # Per-window accounting on SNICs always (balance metric); on the other links only when asked
        # (tests, bandwidth-model scenario), as it costs ~30% of the run time at scale.
        ww = cfg.all_link_windows or rec
        self.dram = [Link(f"dram{n}", hw.dram_bytes_per_s, W, 0.0, rec, ww) for n in range(n_nodes)]
        n_gpu = n_nodes * g
        self.cnic_rd = [
            Link(f"cnic_rd{i}", hw.cnic_bytes_per_s, W, u_pe if i < self.num_pe else u_de, rec, ww)
            for i in range(n_gpu)
        ]
        self.cnic_wr = [
            Link(f"cnic_wr{i}", hw.cnic_bytes_per_s, W, u_pe if i < self.num_pe else u_de, rec, ww)
            for i in range(n_gpu)
        ]
        # Scheduler, with α/β from the paper's definitions.
        alpha = int(cfg.alpha_read_s * hw.snic_bytes_per_s / self.kv_tok)
        beta = int(cfg.beta_compute_s * prefill_tokens_per_s(m, 32_768))
        sc = policy_config(
            self.mode.policy,
            alpha_tokens=alpha,
            beta_tokens=beta,
            z_factor=cfg.z_factor,
            block_tokens=cfg.block_tokens,
            page_tokens=cfg.page_tokens,
        )
        self.de_kv_bytes = hbm_kv_bytes(m, True, cfg.decode_ep_group)
        self.de_pages = int(self.de_kv_bytes // (cfg.page_tokens * self.kv_tok))
        self.de_tokens = self.de_pages * cfg.page_tokens  # the most KV a turn can need (prompt + output)
        pes = [EngineLoad(i, i // g) for i in range(self.num_pe)]
        des = [
            EngineLoad(
                j, self.P + j // g, (j // g) // cfg.decode_nodes_per_group, num_free_pages=self.de_pages
            )
            for j in range(self.num_de)
        ]
        self.sched = DualPathScheduler(sc, pes, des, n_nodes)
        self.max_fetch = cfg.max_fetch
        # State.
        self.events: list = []
        self._seq = count(1)  # tie-break: events at equal times run in scheduling order
        # The router's FIFO queue, as two parallel deques (what the scheduler sees; the simulator's request).
        self.queue: deque[PendingRequest] = deque()
        self.queue_reqs: deque[_Req] = deque()
        self.fetch_pending = False
        self.last_fetch = -math.inf
        self.read_q: list[deque[tuple[_Req, int]]] = [deque() for _ in range(n_nodes)]
        self.read_q_tokens = [0] * n_nodes
        self.snic_busy = [False] * n_nodes
        # Host buffer per node (bytes), see ``_reserve``: nodes whose head read waits for room.
        self.buf_cap = cfg.host_buffer_bytes
        self.buf_used = [0] * n_nodes
        self.buf_peak = [0] * n_nodes
        self.read_stalled = [False] * n_nodes
        self.stalled_nodes: list[int] = []
        self.reserved_queued = [0] * n_nodes  # queued reads whose request already holds its room
        self.buf_waiting: list[deque[_Req]] = [deque() for _ in range(n_nodes)]  # requests with no read
        self.first_turn_nodes: list[int] = []  # nodes whose ``buf_waiting`` is not empty
        # Per node, the rids of the requests waiting for room that need room there, ascending: room
        # goes in FIFO order over both kinds of waiter (a stalled read and a first turn), see ``_reserve``.
        self.room_wait: list[list[int]] = [[] for _ in range(n_nodes)]
        # Per node, a counter bumped whenever a refused request could have become able to get room
        # there: room freed, or a waiter leaving ``room_wait`` (taking room or adding a waiter only make
        # a refusal more certain). A waiter whose two nodes' counters have not moved since it was
        # refused would be refused again: ``_retry_room`` skips it (``_room_unchanged``).
        self.room_ver = [0] * n_nodes
        self._retrying_room = False
        # What ``_retry_room`` visits, so that a release costs O(its waiters), not O(stalled nodes) (at
        # 48P96D nearly every node is stalled on room): per node x, the stalled nodes whose head read's
        # request has x as its PE or DE node (its ``_room_unchanged`` reads x's counter); the stalled
        # nodes that may pass a retry (a counter of their head's nodes moved, or a read holding room
        # queued behind the head): a superset, each still checked exactly when visited; and per
        # stalled node the order it stalled in (= its place in ``stalled_nodes``).
        self.room_watch: list[set[int]] = [set() for _ in range(n_nodes)]
        self.room_dirty: set[int] = set()
        self.stall_stamp = [0] * n_nodes
        self.stall_nodes: list[tuple[int, int]] = [(0, 0)] * n_nodes  # the watched (PE, DE) nodes
        self._num_stalls = 0
        # Per PE, the requests whose reads are done and whose prefill is not, in FIFO (= rid) order:
        # assignments follow the router's FIFO queue, so a PE's requests arrive in rid order.
        self.pe_ready: list[list[_Req]] = [[] for _ in range(self.num_pe)]
        # EP groups of PE ranks that step together (see ``_try_prefill``); the size divides the PE count.
        self.ep = cfg.prefill_ep_group
        self.group_busy = [False] * (self.num_pe // self.ep)
        self.attn_imbalance_sum = 0.0  # Σ over full steps of max/avg attention time across the ranks
        self.num_full_steps = 0
        self.pe_tokens = [0] * self.num_pe
        self.pe_seqs = [0] * self.num_pe
        self.dec = [_Decode(self.de_pages) for _ in range(self.num_de)]
        # Decode EP groups: ranks [i * dep, (i + 1) * dep) step together (see ``_resched``).
        self.dep = cfg.decode_ep_group
        self.dgroups = [_DecodeGroup() for _ in range(self.num_de // self.dep)]
        self.pe_hbm_tokens = int(hbm_kv_bytes(m, False, cfg.prefill_ep_group) // self.kv_tok)
        # Each rank sizes its batch on its own forward as if alone (its tokens' MoE work included): under
        # even load that is its fair share of the group's step, so loaded steps stay near the quota.
        self._cost = AdditiveBatchCost(m.prefill_batch_overhead_s, prefill_request_fn(m))
        self._batch_overhead_s, self._linear_s = m.prefill_batch_overhead_s, m.prefill_s_per_new_token
        self._decode_attn = decode_attn_fn(m)
        self._decode_over_s = m.decode_step_overhead_s
        self._decode_per_seq_s = m.decode_s_per_seq
        self._layerwise, self._oracle = self.mode.layerwise, self.mode.oracle
        self._submit_s = cfg.submit_us_per_copy * 1e-6 / max(cfg.copies_per_submit, 1)
        # Agents.
        self.agent_ctx: list[int] = [0] * workload.num_agents
        # Python lists of the workload's per-turn arrays: the handlers read one element per event and a
        # list index is several times cheaper than a numpy scalar access plus conversion.
        # Cast first: the compiled build (sim/accel.py) takes these as native ints and floats and would
        # reject numpy scalars or float token counts that a caller's own Workload might hold.
        self._offsets: list[int] = np.asarray(workload.offsets, dtype=np.int64).tolist()
        self._hit_override: list[int] = np.asarray(workload.hit_override, dtype=np.int64).tolist()
        self._append: list[int] = np.asarray(workload.append, dtype=np.int64).tolist()
        self._gen: list[int] = np.asarray(workload.gen, dtype=np.int64).tolist()
        self._think: list[float] = np.asarray(workload.think_s, dtype=np.float64).tolist()
        self.agent_done = np.full(workload.num_agents, np.nan)
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.tpot_submit_t: list[float] = []
        self.submit_t: list[float] = []
        self.reqs: list[_Req] = []
        self.n_submitted = 0
        self.open_turns: dict[int, float] = {}  # rid -> submit time, until the first token
        self.n_done = 0
        self.n_agents_done = 0
        self.now = 0.0

    # ---- event plumbing ----

    def _push(self, t: float, kind: int, a=None, b=None) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, a, b))

    def run(self) -> SimResult:
        # The event loop allocates millions of small acyclic objects; the cyclic GC's repeated scans of
        # them cost ~20-30% of a large run and free nothing, so it is paused for the run.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if gc_was_enabled:
                gc.enable()

    def _run(self) -> SimResult:
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        wl = self.wl
        for agent in range(wl.num_agents):
            first = int(wl.offsets[agent])
            if first < int(wl.offsets[agent + 1]):
                self._push(float(wl.start_s[agent]) + float(wl.think_s[first]), _ARRIVE, agent, first)
        horizon = self.cfg.horizon_s
        events = self.events
        pop = heapq.heappop
        next_progress = 0.0
        # One handler per event kind, each taking the event's two payload slots.
        handlers: list[Callable[[Any, Any], None]] = [self._arrive] * 9
        handlers[_ARRIVE] = self._arrive
        handlers[_FETCH] = lambda a, b: self._fetch()
        handlers[_READ_DONE] = lambda a, b: self._read_done(a)
        handlers[_BATCH_LOADED] = self._batch_loaded
        handlers[_BATCH_DONE] = self._batch_done
        handlers[_DE_READY] = lambda a, b: self._de_join(b)
        handlers[_DE_TICK] = self._de_tick
        handlers[_BUF_FREE] = self._buf_free
        handlers[_PE_TRY] = lambda a, b: self._try_prefill(a)
        progress = self.progress
        if horizon is None:
            horizon = math.inf
        while events:
            t, _, kind, a, b = pop(events)
            if t > horizon:
                break
            self.now = t
            handlers[kind](a, b)
            if progress is not None and t >= next_progress:
                progress(t, self.n_done)
                next_progress = t + 5.0
        if self.cfg.horizon_s is None and self.n_done < self.n_submitted:
            raise SimulationStalled(
                f"no event left at t={self.now:.3f} s with {self.n_submitted - self.n_done} turns open"
                f" ({self.n_done} done): a wait that nothing can end (a simulator bug)"
            )
        return SimResult(
            config=self.cfg,
            makespan_s=float(np.nanmax(self.agent_done)) if self.n_agents_done else math.nan,
            agent_done_s=self.agent_done,
            agent_arrival_s=_arrivals(wl),
            ttft_s=np.array(self.ttft),
            tpot_s=np.array(self.tpot),
            turn_submit_s=np.array(self.submit_t),
            tpot_submit_s=np.array(self.tpot_submit_t),
            num_turns_submitted=self.n_submitted,
            unanswered_submit_s=np.array(list(self.open_turns.values())),
            num_turns_done=self.n_done,
            attn_max_over_avg=(
                self.attn_imbalance_sum / self.num_full_steps if self.num_full_steps else math.nan
            ),
            wall_s=time.perf_counter() - wall0,
            cpu_s=time.process_time() - cpu0,
            links={"snic": self.snic, "dram": self.dram, "cnic_rd": self.cnic_rd, "cnic_wr": self.cnic_wr},
            reqs=self.reqs if self.keep_requests else None,
            buffer_peak_bytes=list(self.buf_peak),
        )

    # ---- agents and router ----

    def _arrive(self, agent: int, turn: int) -> None:
        ctx = self.agent_ctx[agent]
        override = self._hit_override[turn]
        bt = self.cfg.block_tokens
        # (a trace's hit is in 64-token store blocks: on whole blocks of this run's size, the rest
        # computed, so the prompt stays hit + append)
        hit = (override if override >= 0 else ctx) // bt * bt
        new = self._append[turn] + ((ctx if override < 0 else override) - hit)
        req = _Req(self.n_submitted, agent, turn, self.now, hit, new, self._gen[turn])
        self.n_submitted += 1
        self.open_turns[req.rid] = self.now
        if self.keep_requests:
            self.reqs.append(req)
        total = req.prompt + req.gen
        if total > self.de_tokens:
            raise TurnDoesNotFit(
                f"turn {turn} of agent {agent} needs {total} tokens of KV, but a decode engine of"
                f" {self.cfg.model.name} holds {self.de_tokens} ({self.de_kv_bytes / 1e9:.1f} GB of HBM for"
                " KV): no schedule can place it"
            )
        self.queue.append(PendingRequest(req.rid, hit, new, total))
        self.queue_reqs.append(req)
        if not self.fetch_pending:
            self._want_fetch()

    def _want_fetch(self) -> None:
        # The router fetches at most once per ``fetch_interval_s`` (a real router polls its queue
        # too); a change of load between fetches is seen by the next one.
        if not self.fetch_pending and self.queue:
            self.fetch_pending = True
            self._push(max(self.now, self.last_fetch + self.cfg.fetch_interval_s), _FETCH)

    def _fetch(self) -> None:
        self.fetch_pending = False
        self.last_fetch = self.now
        if not self.queue:
            return
        offered = list(islice(self.queue, self.max_fetch))
        out = self.sched.assign(offered)
        head = [(self.queue.popleft(), self.queue_reqs.popleft()) for _ in out]
        oracle = self._oracle
        pages_per = self.cfg.page_tokens
        # Ready now: Oracle requests and first turns given room here. Collected as they are placed
        # (not by ``reads_left == 0`` afterwards), so a request is never made ready twice even if a
        # room retry inside this fetch readies a waiter itself.
        instant: list[_Req] = []
        for asg, (pend, req) in zip(out, head, strict=True):
            req.pe, req.de, req.path = asg.prefill_engine, asg.decode_engine, asg.read_path
            req.pe_read, req.de_read = asg.num_pe_read_tokens, asg.num_de_read_tokens
            self.pe_tokens[req.pe] += req.new
            self.pe_seqs[req.pe] += 1
            d = self.dec[req.de]
            d.seqs += 1
            d.tokens += pend.num_decode_tokens
            d.free_pages -= pend.num_decode_pages(pages_per)
            if oracle:
                # No I/O: reads are free; the scheduler sees empty read queues.
                self.sched.report_read_queue(req.pe // self.g, 0)
                self.sched.report_read_queue(self.P + req.de // self.g, 0)
                instant.append(req)
                continue
            if not (req.pe_read or req.de_read):
                # Nothing to read (a first turn), but the KV the PE sends back needs room in the DE's
                # buffer: without it the request waits, in FIFO order per node, as one read left.
                if self._reserve(req):
                    instant.append(req)
                else:
                    req.reads_left = 1
                    de_node = self.P + req.de // self.g
                    waiting = self.buf_waiting[de_node]
                    if not waiting:
                        self.first_turn_nodes.append(de_node)
                    waiting.append(req)
                    self._wait_room(req)
            if req.pe_read:
                req.reads_left += 1
                self._enqueue_read(req.pe // self.g, req, req.pe_read)
            if req.de_read:
                req.reads_left += 1
                self._enqueue_read(self.P + req.de // self.g, req, req.de_read)
        self._ready_together(instant)
        if len(out) == len(offered) == self.max_fetch and self.queue:
            # Cut by the per-fetch cap, not by the engines: fetch the rest an interval later (before,
            # it waited for an unrelated event to ask again).
            self._want_fetch()

    def _ready_together(self, reqs: list[_Req]) -> None:
        """Ready requests that became ready at the same instant, then start their groups' steps: they
        must be able to share one step (one group's, or one engine's batch)."""
        groups: list[int] = []
        for req in reqs:
            self._ready(req)
            grp = req.pe // self.ep
            if grp not in groups:
                groups.append(grp)
        for grp in groups:
            self._try_prefill(grp * self.ep)

    # ---- storage reads ----

    def _enqueue_read(self, node: int, req: _Req, tokens: int) -> None:
        self.read_q[node].append((req, tokens))
        self.read_q_tokens[node] += tokens
        if not self.snic_busy[node]:
            self._start_read(node)

    def _start_read(self, node: int) -> None:
        q = self.read_q[node]
        req, tokens = q[0]
        wake = -1  # a node holding this request's second read, to retry once this one has started
        waited = req.waits_room  # (``_reserve`` clears it)
        granted_waiter = False
        if req.de_buf:  # its room was reserved at its other read (a split request's second read)
            self.reserved_queued[node] -= 1
        elif self._reserve(req):
            granted_waiter = waited
            other = self._other_read_node(req, node)
            if other >= 0:
                self.reserved_queued[other] += 1
                if self.read_stalled[other]:
                    self.room_dirty.add(other)  # a read holding room may now pass its head
                wake = other
        else:
            if not waited:
                self._wait_room(req)
            # A read whose room is already reserved passes the reads waiting for room: otherwise a
            # split request holding room here could wait behind a request that waits for that room.
            # (``reserved_queued`` may count a read not queued yet: its request is still in ``_fetch``.)
            passing = -1
            if self.reserved_queued[node]:
                for i in range(1, len(q)):
                    if q[i][0].de_buf:
                        passing = i
                        break
            if passing < 0:
                if not self.read_stalled[node]:
                    self._stall(node, req)
                elif not self.reserved_queued[node]:
                    self.room_dirty.discard(node)  # just refused: clean until a counter moves
                return  # FIFO: the reads queued behind wait too; ``_buf_free`` retries
            item = q[passing]
            del q[passing]
            q.appendleft(item)
            req, tokens = item
            self.reserved_queued[node] -= 1
        if self.read_stalled[node]:
            self._unstall(node)
        nbytes = tokens * self.kv_tok
        t = self.now
        end = max(self.snic[node].book(t, nbytes), self.dram[node].book(t, nbytes))
        self.snic_busy[node] = True
        self._push(end, _READ_DONE, node)
        if wake >= 0 and self.read_stalled[wake] and not self.snic_busy[wake]:
            self._start_read(wake)
        if granted_waiter and not self._retrying_room:
            self._retry_room()  # younger waiters on its nodes may go now

    def _stall(self, node: int, head: _Req) -> None:
        """``node``'s head read (of ``head``, just refused room) waits; the reads behind it too."""
        self.read_stalled[node] = True
        self.stalled_nodes.append(node)
        self._num_stalls += 1
        self.stall_stamp[node] = self._num_stalls
        pe_node, de_node = head.pe // self.g, self.P + head.de // self.g
        self.stall_nodes[node] = (pe_node, de_node)
        self.room_watch[pe_node].add(node)
        self.room_watch[de_node].add(node)
        if self.reserved_queued[node]:
            self.room_dirty.add(node)

    def _unstall(self, node: int) -> None:
        """``node``'s stalled head read (or a read that passes it) starts now. A stalled node's head
        never changes (its SNIC is idle, so nothing pops it), so the nodes it watched are its head's."""
        self.read_stalled[node] = False
        self.stalled_nodes.remove(node)
        pe_node, de_node = self.stall_nodes[node]
        self.room_watch[pe_node].discard(node)
        self.room_watch[de_node].discard(node)
        self.room_dirty.discard(node)

    def _loosen(self, node: int) -> None:
        """A refused request may now get room on ``node``: bump its counter, mark the stalled nodes
        whose head depends on it."""
        self.room_ver[node] += 1
        if self.room_watch[node]:
            self.room_dirty.update(self.room_watch[node])

    def _other_read_node(self, req: _Req, node: int) -> int:
        """The node of ``req``'s other read (a split request reads on both sides), or -1."""
        if node < self.P:
            return self.P + req.de // self.g if req.de_read else -1
        return req.pe // self.g if req.pe_read else -1

    def _reserve(self, req: _Req) -> bool:
        """Reserve all of a request's host-buffer room at its first read, or return False if a node
        lacks it: the PE-read hit on the PE node, and the whole prompt's KV on the DE node (the DE-read
        hit plus what the PE sends back: hit + miss on the PE path, the miss on the DE path). Taking it
        all at once means a request never holds room while waiting for more room (a split request's
        second read still needs the passing rule in ``_start_read``); a node with an empty buffer takes
        any size (else a request larger than the buffer would never start).

        FIFO per node: room on a node is refused while an older request waits for room there (a read
        stalled at the head of its SNIC queue, or a first turn), so neither kind overtakes the other.
        No cycle: a waiter is held back only by older waiters and by room, and the oldest waiter's room
        is freed by requests that already hold theirs."""
        kv, cap = self.kv_tok, self.buf_cap
        used, wait, rid = self.buf_used, self.room_wait, req.rid
        pe_node, de_node = req.pe // self.g, self.P + req.de // self.g
        pe_b, de_b = req.pe_read * kv, req.prompt * kv
        if (
            (wait[de_node] and wait[de_node][0] < rid)
            or (pe_b and wait[pe_node] and wait[pe_node][0] < rid)
            or (pe_b and used[pe_node] and used[pe_node] + pe_b > cap)
            or (used[de_node] and used[de_node] + de_b > cap)
        ):
            # The answer depends only on these two nodes' room and waiters: remember their state.
            req.room_seen = self.room_ver[pe_node] + self.room_ver[de_node]
            return False
        if pe_b:
            self._buf_take(pe_node, pe_b)
            req.pe_buf = pe_b
        self._buf_take(de_node, de_b)
        req.de_buf = de_b
        if req.waits_room:
            req.waits_room = False
            wait[de_node].remove(rid)
            self._loosen(de_node)
            if pe_b:
                wait[pe_node].remove(rid)
                self._loosen(pe_node)
        return True

    def _wait_room(self, req: _Req) -> None:
        """``req`` was refused room: hold back younger requests that need room on its nodes."""
        req.waits_room = True
        insort(self.room_wait[self.P + req.de // self.g], req.rid)
        if req.pe_read:
            insort(self.room_wait[req.pe // self.g], req.rid)

    def _buf_take(self, node: int, nbytes: int) -> None:
        used = self.buf_used[node] + nbytes
        self.buf_used[node] = used
        if used > self.buf_peak[node]:
            self.buf_peak[node] = used

    def _room_unchanged(self, req: _Req) -> bool:
        """Nothing that ``_reserve``'s answer for ``req`` depends on has loosened since it refused it.
        A sum is enough: each counter only grows and the two nodes differ, so an equal sum means
        neither moved."""
        ver = self.room_ver
        return req.room_seen == ver[req.pe // self.g] + ver[self.P + req.de // self.g]

    def _buf_free(self, node: int, nbytes: int) -> None:
        self.buf_used[node] -= nbytes
        self._loosen(node)
        # Every loosening (this, or a waiter given room) is followed by a retry run to a fixed point,
        # so before this release no waiter could get room; now only one that needs room here can.
        if self.room_wait[node]:
            self._retry_room()

    def _retry_room(self) -> None:
        """Retry the requests waiting for room: the stalled reads (one may need room on either of its
        request's nodes), then the first turns; a waiter is skipped when nothing it depends on loosened
        since it was refused (``_room_unchanged``: the retry would refuse it, with no side effect).
        ``_reserve`` keeps the order FIFO whatever the order of the retries; but a grant may let a
        younger waiter that was held back by it go, so the pass is repeated while it grants anything.
        First turns given room are made ready together."""
        self._retrying_room = True
        fits: list[_Req] = []
        granted = True
        dirty, stamp = self.room_dirty, self.stall_stamp
        while granted:
            granted = False
            # The stalled nodes in stall order, as they were when this round began (a node stalled
            # during it waits for the next round); visited only if marked dirty, which every node that
            # could pass is (``room_dirty``): the rest would be refused with no side effect.
            limit = self._num_stalls + 1
            after = 0
            while dirty:
                n, at = -1, limit
                for m in dirty:
                    s = stamp[m]
                    if after < s < at:
                        n, at = m, s
                if n < 0:
                    break
                after = at
                # (Unless a read whose room is held may pass the stalled head.)
                if not self.reserved_queued[n] and self._room_unchanged(self.read_q[n][0][0]):
                    dirty.discard(n)
                    continue
                self._start_read(n)
                granted = granted or not self.read_stalled[n]
            for n in list(self.first_turn_nodes):
                waiting = self.buf_waiting[n]  # first turns only ever wait for room on their DE node
                while waiting and not self._room_unchanged(waiting[0]) and self._reserve(waiting[0]):
                    req = waiting.popleft()
                    req.reads_left = 0
                    fits.append(req)
                    granted = True
                if not waiting:
                    self.first_turn_nodes.remove(n)
        self._retrying_room = False
        if fits:
            self._ready_together(fits)

    def _read_done(self, node: int) -> None:
        req, tokens = self.read_q[node].popleft()
        self.read_q_tokens[node] -= tokens
        self.sched.report_read_queue(node, self.read_q_tokens[node])
        self.snic_busy[node] = False
        if self.read_q[node]:
            self._start_read(node)
        req.reads_left -= 1
        if req.reads_left == 0:
            self._ready(req)
            # The step starts after every event of this instant (a later sequence number): another read
            # that ends now readies its request in time to share it, as `_ready_together` does for the
            # requests one fetch or one room grant readies (before, it waited a whole step).
            self._push(self.now, _PE_TRY, req.pe)
        self._want_fetch()  # α categories may have changed

    # ---- prefill ----

    def _ready(self, r: _Req) -> None:
        ready = self.pe_ready[r.pe]
        if not ready or ready[-1].rid < r.rid:
            ready.append(r)
        else:
            insort(ready, r, key=_rid)

    def _try_prefill(self, pe: int) -> None:
        """Start a forward on ``pe``'s EP group if the group is idle and any of its ranks has ready work.

        The ranks of an EP group (DP attention + EP MoE) run each forward in lockstep: every MoE layer's
        all-to-all waits for every rank. So the step's compute is the per-step overhead, the MoE share of
        all the group's new tokens spread over the ranks, and the slowest rank's attention; not
        layerwise, it also waits for the slowest rank's load before and its send after. With one rank
        per group this is exactly the rank's own predicted batch time.
        """
        ep = self.ep
        grp = pe // ep
        if self.group_busy[grp]:
            return
        steps: list[tuple[int, list[tuple[_Req, int]]]] = []
        compute = 0.0
        new_total, attn_max, attn_sum = 0, 0.0, 0.0
        for p in range(grp * ep, grp * ep + ep):
            ready = self.pe_ready[p][:MAX_READY_SCAN]  # the first ready requests, FIFO order
            if not ready:
                continue
            if not self._layerwise:
                # Whole-prompt KV of the batch must sit in HBM: cut the ready list at the HBM limit.
                cap, acc, cut = self.pe_hbm_tokens, 0, 0
                for r in ready:
                    acc += r.prompt
                    if acc > cap and cut > 0:
                        break
                    cut += 1
                ready = ready[:cut]
            items = (PrefillItem(r.rid, r.hit + r.new_done, r.new - r.new_done) for r in ready)
            plan = build_prefill_batch(items, self._cost, self.cfg.compute_quota_s, self.cfg.page_tokens)
            # The plan is a FIFO prefix of ``items`` (whole requests, then at most one chunk).
            batch = [(ready[i], it.num_new_tokens) for i, it in enumerate(plan.items)]
            if plan.chunk is not None:
                batch.append((ready[len(batch)], plan.chunk.num_new_tokens))
            steps.append((p, batch))
            if ep == 1:
                compute = plan.predicted_s
            else:
                n_new = 0
                for _r, n in batch:
                    n_new += n
                new_total += n_new
                attn = plan.predicted_s - self._batch_overhead_s - n_new * self._linear_s
                attn_sum += attn
                if attn > attn_max:
                    attn_max = attn
        if not steps:
            return
        if ep > 1:
            compute = self._batch_overhead_s + new_total * self._linear_s / ep + attn_max
            if len(steps) == ep and attn_sum > 0.0:
                # Attention-time balance of a step in which every rank has work (the paper's max/avg
                # over an EP group; steps with idle ranks say more about arrivals than about balance).
                self.attn_imbalance_sum += attn_max * ep / attn_sum
                self.num_full_steps += 1
        self.group_busy[grp] = True
        t = self.now
        if self._oracle:
            self._push(t + compute, _BATCH_DONE, grp, steps)
            return
        if self._layerwise:
            copies_end = self._book_copies(steps, t, inbound=True, outbound=True)
            # A two-stage pipeline over the layers (copy layer i+1 while computing layer i): the longer
            # stage runs throughout and the shorter one's share of one layer is the fill, so
            # L·max(c, x) + min(c, x) per layer = max(C, X) + min(C, X) / L. Nothing to copy costs
            # nothing (Oracle ≤ layerwise ≤ Basic even when I/O is light); the H200 anchor
            # (h200_layerwise) measures 2-4% above this, the copies' contention for HBM.
            copy_s = copies_end - t
            end = t + max(compute, copy_s) + min(compute, copy_s) / self.layers
            self._push(end, _BATCH_DONE, grp, steps)
        else:
            t_loaded = self._book_copies(steps, t, inbound=True, outbound=False)
            # Loaded: the hit KV sits in HBM now (chunks reuse it), so its host buffer is free.
            g = self.g
            for p, batch in steps:
                for r, _n in batch:
                    if r.pe_buf:
                        self._push(t_loaded, _BUF_FREE, p // g, r.pe_buf)
                        r.pe_buf = 0
            self._push(t_loaded + compute, _BATCH_LOADED, grp, steps)

    def _book_copies(
        self, steps: list[tuple[int, list[tuple[_Req, int]]]], t: float, inbound: bool, outbound: bool
    ) -> float:
        """Book every rank's copies of a step from ``t`` (hit KV in, and/or KV out to the DE host) and
        return when the slowest rank is done: the later of its links' end and of posting its own copy
        descriptors (each rank posts in parallel with the other ranks)."""
        end = t
        for p, batch in steps:
            e, n = self._book_inbound(p, batch, t) if inbound else (t, 0)
            if outbound:
                e_out, n_out = self._book_outbound(p, batch, t)
                if e_out > e:
                    e = e_out
                n += n_out
            posted = t + n * self._submit_s
            if posted > e:
                e = posted
            if e > end:
                end = e
        return end

    def _book_inbound(self, pe: int, batch: list[tuple[_Req, int]], t: float) -> tuple[float, int]:
        """Hit KV of each request into the PE GPU, one layer block per copy; returns (end, copies)."""
        kv, g, bt = self.kv_tok, self.g, self.cfg.block_tokens
        pe_node = pe // g
        end, copies = t, 0
        for r, _n in batch:
            if r.inbound_done and not self._layerwise:
                continue
            if r.pe_read:
                b = r.pe_read * kv
                e = book3(self.dram[pe_node], self.cnic_rd[pe], self.cnic_wr[pe], t, b)
                if e > end:
                    end = e
                copies += -(-r.pe_read // bt) * self.layers
            if r.de_read:
                b = r.de_read * kv
                de_gpu = self.num_pe + r.de
                de_node = self.P + r.de // g
                e = book3(self.dram[de_node], self.cnic_rd[de_gpu], self.cnic_wr[pe], t, b)
                if e > end:
                    end = e
                copies += -(-r.de_read // bt) * self.layers
            r.inbound_done = True
        return end, copies

    def _book_outbound(self, pe: int, batch: list[tuple[_Req, int]], t: float) -> tuple[float, int]:
        """KV back to the DE host: the new tokens, plus the PE-read hit once (PE path); (end, copies)."""
        kv, g, bt = self.kv_tok, self.g, self.cfg.block_tokens
        end, copies = t, 0
        for r, n in batch:
            tokens = n + (r.pe_read if r.new_done == 0 else 0)
            if tokens <= 0:
                continue
            b = tokens * kv
            de_gpu = self.num_pe + r.de
            de_node = self.P + r.de // g
            e = book3(self.cnic_rd[pe], self.cnic_wr[de_gpu], self.dram[de_node], t, b)
            if e > end:
                end = e
            copies += -(-tokens // bt) * self.layers
        return end, copies

    def _batch_loaded(self, grp: int, steps: list[tuple[int, list[tuple[_Req, int]]]]) -> None:
        """Not layerwise: compute finished; now every rank sends its batch's whole KV to the DE host."""
        end = self._book_copies(steps, self.now, inbound=False, outbound=True)
        self._push(end, _BATCH_DONE, grp, steps)

    def _batch_done(self, grp: int, steps: list[tuple[int, list[tuple[_Req, int]]]]) -> None:
        for pe, batch in steps:
            self._rank_done(pe, batch)
        self.group_busy[grp] = False
        self._try_prefill(grp * self.ep)
        self._want_fetch()

    def _rank_done(self, pe: int, batch: list[tuple[_Req, int]]) -> None:
        t = self.now
        finished = []
        for r, n in batch:
            r.new_done += n
            self.pe_tokens[pe] -= n
            if r.new_done >= r.new:
                finished.append(r)
        if finished:
            ready = self.pe_ready[pe]
            for r in finished:
                ready.remove(r)  # identity (no __eq__); finished ones sit near the front
                if r.pe_buf:  # layerwise: every chunk re-streamed the hit layers from the buffer
                    self._buf_free(pe // self.g, r.pe_buf)
                    r.pe_buf = 0
        self.pe_seqs[pe] -= len(finished)
        self.sched.report_prefill(pe, self.pe_seqs[pe], self.pe_tokens[pe])
        kv, g = self.kv_tok, self.g
        bt, layers, submit_s = self.cfg.block_tokens, self.layers, self._submit_s
        events, seq, heappush = self.events, self._seq, heapq.heappush
        for r in finished:
            r.t_first = t
            del self.open_turns[r.rid]
            self.ttft.append(t - r.t_submit)
            self.submit_t.append(r.t_submit)
            if self._oracle:
                self._push(t, _DE_READY, None, r)
                continue
            # DE host → DE GPU, loopback on the DE GPU's CNIC.
            b = r.prompt * kv
            de_gpu = self.num_pe + r.de
            de_node = self.P + r.de // g
            end = book3(self.dram[de_node], self.cnic_rd[de_gpu], self.cnic_wr[de_gpu], t, b)
            post = t + -(-r.prompt // bt) * layers * submit_s
            heappush(events, (end if end >= post else post, next(seq), _DE_READY, None, r))

    # ---- decode ----

    def _resched(self, gi: int, grp: _DecodeGroup, changed: list[int]) -> None:
        """Set the group's step time after its batch changed and schedule its next leave.

        Lockstep (DP attention + EP MoE, like the prefill groups): the overhead, the per-sequence
        (MoE) work of all the group's sequences spread over its ranks, and the slowest rank's
        attention; with one rank this is the cost model's ``decode_step_s`` for its batch, to the last
        bit. A rank's attention is re-evaluated when its own batch changes (``changed``); the others
        keep theirs from their last change (their contexts grew by the few tokens decoded since).
        """
        grp.version += 1
        n = grp.n
        v = grp.v
        dep = self.dep
        # Update the changed ranks first, even when the group has just emptied: a rank left with a
        # stale attention time would slow the group's next steps.
        dec, attn_fn = self.dec, self._decode_attn
        rescan = False
        for de in changed:
            d = dec[de]
            a = attn_fn(d.n, d.ctx_base + d.n * v)
            d.attn_s = a
            if a >= grp.attn_max:
                grp.attn_max, grp.attn_arg = a, de
            elif de == grp.attn_arg:
                rescan = True  # the slowest rank got faster: find the new slowest
        if rescan:
            best, arg = 0.0, -1
            for de in range(gi * dep, gi * dep + dep):
                a = dec[de].attn_s
                if a > best:
                    best, arg = a, de
            grp.attn_max, grp.attn_arg = best, arg
        if not n:
            return
        grp.step_s = step = self._decode_over_s + n * self._decode_per_seq_s / dep + grp.attn_max
        left = grp.heap[0][0] - v
        heapq.heappush(
            self.events,
            (self.now + (left if left > 0.0 else 0.0) * step, next(self._seq), _DE_TICK, gi, grp.version),
        )

    def _advance(self, grp: _DecodeGroup) -> None:
        """Move the group's token clock to now: its running sequences decoded one token per step."""
        t = self.now
        if grp.n:
            grp.v += (t - grp.t_last) / grp.step_s
        grp.t_last = t

    def _de_join(self, r: _Req) -> None:
        r.t_join = self.now
        if r.de_buf:  # the prompt KV is in the DE GPU now
            self._buf_free(self.P + r.de // self.g, r.de_buf)
            r.de_buf = 0
        remaining = r.gen - 1  # the first token came from the PE
        if remaining <= 0:
            self._finish(r)
            return
        gi = r.de // self.dep
        grp = self.dgroups[gi]
        self._advance(grp)
        heapq.heappush(grp.heap, (grp.v + remaining, r.rid, r))
        grp.n += 1
        d = self.dec[r.de]
        d.n += 1
        d.ctx_base += r.prompt - grp.v
        self._resched(gi, grp, [r.de])

    def _de_tick(self, gi: int, version: int) -> None:
        grp = self.dgroups[gi]
        if version != grp.version:
            return
        self._advance(grp)
        heap = grp.heap
        # This (current) tick was set for the head's finish, so only rounding leaves the token clock
        # short of it: past ~1e5 simulated seconds a step's time is below `now`'s resolution, and the
        # tick set itself again at the same `now` for ever (a review, 2026-12-04: the run hung).
        if heap and heap[0][0] > grp.v:
            grp.v = heap[0][0]
        dec = self.dec
        changed: list[int] = []
        while heap and heap[0][0] <= grp.v + 1e-9:
            v_end, _, r = heapq.heappop(heap)
            grp.n -= 1
            d = dec[r.de]
            d.n -= 1
            d.ctx_base -= r.prompt - (v_end - (r.gen - 1))
            if d.n == 0:
                d.ctx_base = 0.0
            if r.de not in changed:
                changed.append(r.de)
            self._finish(r)
        self._resched(gi, grp, changed)

    def _finish(self, r: _Req) -> None:
        t = self.now
        r.t_done = t
        if r.gen > 1:
            # From the first token (the prefill's), as a client measures it: the decode's wait for its
            # prompt's KV and H2D is inside, as it is in a real stream's first gap.
            self.tpot.append((t - r.t_first) / (r.gen - 1))
            self.tpot_submit_t.append(r.t_submit)
        d = self.dec[r.de]
        d.seqs -= 1
        d.tokens -= r.prompt + r.gen
        d.free_pages += -(-(r.prompt + r.gen) // self.cfg.page_tokens)
        self.sched.report_decode(r.de, d.seqs, d.tokens, d.free_pages)
        self.n_done += 1
        agent = r.agent
        self.agent_ctx[agent] = r.prompt + r.gen
        nxt = r.turn + 1
        if nxt < self._offsets[agent + 1]:
            think = self._think[nxt]
            if think > 0.0:
                self._push(t + think, _ARRIVE, agent, nxt)
            else:
                # Zero think time (the paper's replay: no tool latency): submit now rather than through
                # the event heap; only the order among events at this exact instant changes.
                self._arrive(agent, nxt)
        else:
            self.agent_done[agent] = t
            self.n_agents_done += 1
        if not self.fetch_pending:
            self._want_fetch()
