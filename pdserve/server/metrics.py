"""Prometheus metrics of one engine (a registry per server, so tests can run several in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.engine.llm_engine import LLMEngine
from pdserve.outputs import RequestOutput

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EngineMetrics:
    def __init__(self) -> None:
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
        self.prefix_queries = Gauge(
            "pdserve_prefix_cache_query_tokens", "Prompt tokens looked up", registry=r
        )
        self.prefix_hits = Gauge("pdserve_prefix_cache_hit_tokens", "Prompt tokens found cached", registry=r)
        self.preemptions = Gauge(
            "pdserve_num_preemptions", "Requests preempted (recompute) so far", registry=r
        )
        self.generated = Counter("pdserve_generation_tokens", "Tokens generated", registry=r)
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
            "pdserve_time_per_output_token_seconds",
            "Mean gap between output tokens",
            buckets=_LATENCY_BUCKETS_S,
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
        for out in outputs:
            self.generated.inc()
            if out.finished:
                self.observe_finished(out)

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.finished.labels(out.outputs[0].finish_reason or "abort").inc()
        if m.get("first_token_time") is None:
            return
        self.ttft.observe(m["first_token_time"] - m["arrival_time"])
        n = len(out.outputs[0].token_ids)
        if n > 1:
            self.tpot.observe((m["last_token_time"] - m["first_token_time"]) / (n - 1))
