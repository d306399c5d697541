"""Prometheus metrics of one engine (a registry per server, so tests can run several in a process).

Counts that only grow (preemptions, prefix-cache tokens, pages sent, failures, ...) are Counters, as
vLLM's are (`*_total`: `rate()` and restarts work); the engine keeps them as plain ints, mirrored here
(`_Mirror`). TTFT is observed when a request's first token is produced (a dashboard saw it only when
the request ended), TPOT once per request at its end (the mean gap: vLLM's per-request histogram).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.engine.llm_engine import LLMEngine
from pdserve.outputs import RequestOutput
from pdserve.server.protocol import HEALTH_PROBE_PREFIX

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# A whole request (agentic turns decode for minutes): vLLM's e2e buckets.
_E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960)
_E2E_BUCKETS_S += (1920, 7680)


class _Mirror:
    """A Counter that follows a count kept elsewhere: it rises by what the count rose since the last
    look; a count that starts again from 0 (a new store after a weight update) is followed from there
    (the counter keeps its total, so it never decreases)."""

    def __init__(self, name: str, doc: str, registry: CollectorRegistry, labels: tuple[str, ...] = ()):
        self.counter = Counter(name, doc, list(labels), registry=registry)
        self.last: dict[tuple, float] = {}
        self._lock = threading.Lock()  # (the engine thread and a scrape may both update)

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            prev = self.last.get(labels)
            self.last[labels] = value
            delta = value - prev if prev is not None and value >= prev else value
            child = self.counter.labels(*labels) if labels else self.counter  # (shown from 0 on)
            if delta > 0:
                child.inc(delta)


class EngineMetrics:
    def __init__(self) -> None:
        self.pd: PDMetrics | None = None  # set for prefill/decode engines
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("pdserve_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("pdserve_num_requests_waiting", "Requests waiting for admission", registry=r)
        self.pages_used = Gauge("pdserve_kv_pages_used", "KV pages held by requests or reserved", registry=r)
        self.pages_total = Gauge("pdserve_kv_pages_total", "KV pages in the pool", registry=r)
        self.pages_cached = Gauge("pdserve_kv_pages_cached", "Pages with a prefix-cache key", registry=r)
        self.prefix_hit_rate = Gauge(
            "pdserve_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up",
            registry=r,
        )
        self.prefix_queries = _Mirror("pdserve_prefix_cache_query_tokens", "Prompt tokens looked up", r)
        self.prefix_hits = _Mirror("pdserve_prefix_cache_hit_tokens", "Prompt tokens found cached", r)
        self.preemptions = _Mirror("pdserve_num_preemptions", "Requests preempted (recompute)", r)
        self.prefix_waits = _Mirror(
            "pdserve_prefix_waits",
            "Requests put off at admission for a prompt page another request was computing (then shared)",
            r,
        )
        self.generated = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens",
            "Prompt tokens of requests that got their first token (cached ones included, as vLLM's)",
            registry=r,
        )
        self.finished = Counter(
            "pdserve_requests_finished", "Requests finished", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Arrival to first token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_request_time_per_output_token_seconds",
            "Mean gap between a request's output tokens (one per request, at its end)",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Arrival to end, per request that produced an output (aborted ones included)",
            buckets=_E2E_BUCKETS_S,
            registry=r,
        )

    def on_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after every step and once when it goes idle."""
        pool = engine.kv.pool
        self.running.set(len(engine.scheduler.running))
        self.waiting.set(len(engine.scheduler.waiting))
        self.pages_used.set(pool.num_used_pages)
        self.pages_total.set(pool.num_pages)
        self.pages_cached.set(pool.num_cached_pages)
        self.prefix_queries.set(engine.kv.num_query_tokens)
        self.prefix_hits.set(engine.kv.num_hit_tokens)
        self.prefix_hit_rate.set(engine.kv.num_hit_tokens / max(engine.kv.num_query_tokens, 1))
        self.preemptions.set(engine.scheduler.num_preemptions)
        self.prefix_waits.set(engine.scheduler.num_prefix_waits)
        if self.pd is not None:
            self.pd.update()
        for out in outputs:
            if out.request_id.startswith(HEALTH_PROBE_PREFIX):  # (a probe is not traffic: SGLang's
                continue  # probes carry log_metrics=False)
            self.generated.inc()
            self.observe(out)

    def observe(self, out: RequestOutput) -> None:
        """An output of a request (a step's, or a PD decode's handed-over first token, whose token
        this engine did not generate): its TTFT with its first token (every such output adds one
        token, so the output holding one is the first), its end when it ends."""
        m = out.metrics
        if len(out.outputs[0].token_ids) == 1 and m.get("first_token_time") is not None:
            self.ttft.observe(m["first_token_time"] - m["arrival_time"])
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        if out.finished:
            self.observe_end(out)

    def observe_end(self, out: RequestOutput) -> None:
        """A request's end (also the async engine's abort hook: an aborted request's first token, if it
        had one, was observed with the output that brought it)."""
        if out.request_id.startswith(HEALTH_PROBE_PREFIX):
            return
        m = out.metrics
        self.finished.labels(out.outputs[0].finish_reason or "abort").inc()
        if m.get("arrival_time") is not None:  # (monotonic, as the engine stamps it)
            self.e2e.observe(time.monotonic() - m["arrival_time"])
        n = len(out.outputs[0].token_ids)
        if m.get("first_token_time") is not None and n > 1:
            self.tpot.observe((m["last_token_time"] - m["first_token_time"]) / (n - 1))

    def observe_failed(self, finish_reason: str) -> None:
        """A request that ended without an output (its PD transfer failed, or was aborted before the
        first token): counted once, by the engine that answers the client (the decode)."""
        self.finished.labels(finish_reason).inc()


STORE_LEVELS = ("used_bytes", "capacity_bytes", "num_blocks")  # the store's stats that are not counts


class PDMetrics:
    """PD-role metrics (prefill or decode), refreshed from the role's state after every engine step.

    Everything is read on the engine thread from counters that the role, the control channel and the
    transfer agent keep; nothing here changes engine state.
    """

    def __init__(self, registry: CollectorRegistry, pd) -> None:
        self.pd = pd
        r = registry
        self.queue = Gauge("pdserve_pd_queue_requests", "Requests per PD queue", ["queue"], registry=r)
        self.rooms = Gauge("pdserve_pd_rooms_held", "Rooms in the room table (exact)", registry=r)
        self.room_states = Gauge(
            "pdserve_pd_rooms_by_state", "Rooms per transfer state", ["state"], registry=r
        )
        self.failures = _Mirror("pdserve_pd_failures", "Failed rooms by reason", r, ("reason",))
        self.handoff_mismatch = _Mirror(
            "pdserve_pd_handoff_mismatches", "Handoff rows whose room did not match", r
        )
        self.dropped = _Mirror("pdserve_pd_control_dropped", "Control messages dropped", r, ("why",))
        self.xfer = _Mirror("pdserve_pd_transfer", "Transfer agent counts", r, ("counter",))
        self.pages_sent = _Mirror("pdserve_pd_pages_sent", "KV pages written to decode engines", r)
        self.peers = Gauge(
            "pdserve_pd_peers", "Peers known: a prefill's registered decodes, a decode's prefills", registry=r
        )
        self.peers_forgotten = _Mirror(
            "pdserve_pd_peers_forgotten", "Peers dropped after peer_idle_s unused (a restarted one)", r
        )
        self.staged = _Mirror("pdserve_pd_staged_requests", "Requests whose KV arrived through staging", r)
        self.latency = Histogram(
            "pdserve_pd_transfer_latency_seconds",
            "Submit to completion of one write",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=r,
        )
        self._seen_transfer = 0  # the last finished transfer (its place) whose latency was observed
        self.store = Gauge("pdserve_store", "Persistent KV store levels", ["counter"], registry=r)
        self.store_ops = _Mirror("pdserve_store_ops", "Persistent KV store counts", r, ("op",))
        self.layerwise = _Mirror(
            "pdserve_pd_layerwise_prefills", "Prefills run layer by layer over stored KV", r
        )
        self.layerwise_fallbacks = _Mirror(
            "pdserve_pd_layerwise_fallbacks",
            "Prefills with stored KV too long for the layerwise staging pool, prefilled whole",
            r,
        )
        self.store_reads_left = _Mirror(
            "pdserve_pd_store_reads_left",
            "Store reads still in flight past their budget, left behind: their prompts were computed",
            r,
        )
        self.store_written = _Mirror("pdserve_store_blocks_written", "Blocks this engine wrote back", r)
        self.store_skipped = _Mirror(
            "pdserve_store_blocks_skipped",
            "Full blocks write-back found stored already (a turn's hit, an earlier turn): never copied",
            r,
        )
        self.store_joined = _Mirror(
            "pdserve_store_blocks_read_joined",
            "Blocks a request took from another's store read in flight (the same prompt): not read again",
            r,
        )
        self.store_bad = _Mirror(
            "pdserve_store_blocks_bad", "Stored blocks found corrupt, truncated or missing", r
        )
        self.store_pending = Gauge(
            "pdserve_store_writes_pending", "Blocks queued for write-back, not yet on disk", registry=r
        )

    def update_any_thread(self) -> None:
        """Control-channel drop counters and the store writer's counters: plain ints, safe to read from
        any thread (also at scrape time, so drops and write-back progress are visible while the engine
        idles)."""
        control = self.pd.control
        self.dropped.set(control.num_forged, "forged")
        self.dropped.set(control.num_malformed, "malformed")
        self.dropped.set(control.num_wrong_version, "wrong_version")
        store = getattr(self.pd.role, "store", None)
        if store is not None:
            self.store_written.set(store.num_blocks_written)
            self.store_skipped.set(store.num_blocks_skipped)
            self.store_pending.set(store.num_writes_pending)
            self.store_joined.set(store.reads.num_blocks_joined)
            self.store_bad.set(store.reads.num_blocks_bad)

    def update(self) -> None:
        role, agent = self.pd.role, self.pd.agent
        for name, size in role.queue_sizes().items():
            self.queue.labels(name).set(size)
        self.rooms.set(len(role.rooms))
        for state, n in role.rooms.counts().items():
            self.room_states.labels(state.name).set(n)
        for reason, n in role.failures.items():
            self.failures.set(n, reason)
        self.handoff_mismatch.set(getattr(role, "num_handoff_mismatches", 0))
        self.update_any_thread()
        self.pages_sent.set(getattr(role, "num_pages_sent", 0))
        self.peers.set(getattr(role, "num_peers", 0))
        self.peers_forgotten.set(getattr(role, "num_peers_forgotten", 0))
        self.staged.set(getattr(role, "num_staged", 0))
        self.store_reads_left.set(getattr(role, "num_store_reads_left", 0))
        if hasattr(role, "layerwise"):
            self.layerwise.set(role.layerwise.num_runs)
            self.layerwise_fallbacks.set(role.num_layerwise_fallbacks)
        if getattr(role, "store", None) is not None:
            for name, value in vars(role.store.store.stats()).items():
                if name in STORE_LEVELS:
                    self.store.labels(name).set(value)
                elif isinstance(value, int | float):
                    self.store_ops.set(value, name)
        stats = agent.stats.snapshot()
        latencies = stats.pop("latencies_s")
        for name, value in stats.items():
            self.xfer.set(value, name)
        for n, latency_s in latencies:  # (each finished transfer once: by its place, not by a count)
            if n > self._seen_transfer:
                self.latency.observe(latency_s)
                self._seen_transfer = n
