"""The router's Prometheus metrics (`GET /metrics` on `pdserve router`): what an operator watches at
the front of a PD cluster, beside each engine's own /metrics.

* Requests by route and status code, the time to an answer's first body bytes (a stream: its first
  event, about the time to first token as the client sees it) and to its last: `RequestMetrics`, an
  ASGI wrapper around the router's app (it sees streams end, which a route's handler does not).
* Retries by the side that failed, requests in flight, and each engine's health and requests in
  flight: `RouterCollector`, read from the `Router` at scrape time (no second count to drift).

Who calls it: `router/routes.py`'s `build_router_app` wraps its app in `RequestMetrics` and registers a
`RouterCollector`; `Router` counts its retries in `retries_by_side`. Routes outside `ROUTES` are
counted as "other" (a scanner's random paths would otherwise make a label each).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/generate",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/abort_request",
        "/update_weights_from_disk",
        "/flush_cache",
        "/reset_prefix_cache",
        "/get_model_info",
        "/get_weight_version",
        "/version",
        "/health",
        "/metrics",
        "/pd/cluster",
    }
)
# Seconds: a cached turn's first token within ~50 ms, a long cold prefill or a queued burst in tens.
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class RouterCollector:
    """Gauges and counters the `Router` already keeps, read when Prometheus scrapes."""

    def __init__(self, router) -> None:
        self.router = router

    def collect(self):
        r = self.router
        retries = CounterMetricFamily(
            "pdserve_router_retries",
            "Attempts retried on another engine, by the side that failed",
            labels=["side"],
        )
        for side, count in sorted(r.retries_by_side.items()):
            retries.add_metric([side], count)
        yield retries
        yield GaugeMetricFamily(
            "pdserve_router_requests_in_flight",
            "Requests taken in and not yet answered to the end",
            value=r.num_in_flight(),
        )
        healthy = GaugeMetricFamily(
            "pdserve_router_engine_healthy", "1 while the engine passes health checks", labels=["role", "url"]
        )
        in_flight = GaugeMetricFamily(
            "pdserve_router_engine_requests_in_flight",
            "Requests whose decode leg runs on the engine (prefills: 0, their part ends at token 1)",
            labels=["role", "url"],
        )
        for e in r.prefills + r.decodes:
            healthy.add_metric([e.role, e.url], float(e.healthy))
            in_flight.add_metric([e.role, e.url], e.in_flight)
        yield healthy
        yield in_flight


class RequestMetrics:
    """ASGI wrapper: counts each HTTP request by route and status when its answer starts, and times
    its first and last body bytes. A route that raised is counted with the 500 it gets; an answer
    that never starts otherwise (the client left first) with code 499, as the router's own answer to
    a departed client says."""

    def __init__(self, app, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter(
            "pdserve_router_requests",
            "Requests answered, by route and status code",
            ["route", "code"],
            registry=registry,
        )
        self.first_byte = Histogram(
            "pdserve_router_first_byte_seconds",
            "Arrival to the answer's first body bytes (a stream: its first event)",
            ["route"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.duration = Histogram(
            "pdserve_router_request_duration_seconds",
            "Arrival to the answer's last byte",
            ["route"],
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in ROUTES else "other"
        start_s = time.perf_counter()
        seen = {"code": None, "first": False, "done": False}

        async def timed_send(message) -> None:
            if message["type"] == "http.response.start":
                seen["code"] = message["status"]
            elif message["type"] == "http.response.body":
                if message.get("body") and not seen["first"]:
                    seen["first"] = True
                    self.first_byte.labels(route).observe(time.perf_counter() - start_s)
                if not message.get("more_body", False) and not seen["done"]:
                    seen["done"] = True
                    self.duration.labels(route).observe(time.perf_counter() - start_s)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        except Exception:  # (Starlette's outermost middleware answers it with a 500, outside us)
            seen["code"] = seen["code"] or 500
            raise
        finally:
            self.requests.labels(route, str(seen["code"] or 499)).inc()
