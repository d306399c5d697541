"""The engine's Prometheus metrics, in process: what is observed when, and which are counters
(found by a review of the metrics against vLLM's, 2026-12-02)."""

from __future__ import annotations

import re
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.server.metrics import EngineMetrics, PDMetrics, _Mirror
from pdserve.transfer.agent import TransferStats


def test_ttft_is_observed_at_the_first_token_and_once(demo_model_dir):
    """It was observed when the request ended: a dashboard's TTFT lagged by the whole generation,
    and a long request's did not show while it ran."""
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=256))
    m = EngineMetrics()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0), "r1")
    counts = []
    while engine.has_unfinished():
        m.on_step(engine, engine.step())
        counts.append(m.registry.get_sample_value("pdserve_time_to_first_token_seconds_count"))
    assert counts == [1.0] * 6  # from the first token on, once
    assert m.registry.get_sample_value("pdserve_request_time_per_output_token_seconds_count") == 1
    assert m.registry.get_sample_value("pdserve_requests_finished_total", {"finish_reason": "length"}) == 1
    assert m.registry.get_sample_value("pdserve_generation_tokens_total") == 6
    assert m.registry.get_sample_value("pdserve_prompt_tokens_total") == 3  # at its first token, once
    assert m.registry.get_sample_value("pdserve_e2e_request_latency_seconds_count") == 1
    # An abort after the first token: its end is counted by the abort hook, its TTFT not again.
    engine.add_request([5, 6, 8], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0), "r2")
    m.on_step(engine, engine.step())
    m.observe_end(engine.abort("r2"))
    assert m.registry.get_sample_value("pdserve_time_to_first_token_seconds_count") == 2
    assert m.registry.get_sample_value("pdserve_requests_finished_total", {"finish_reason": "abort"}) == 1
    assert m.registry.get_sample_value("pdserve_prompt_tokens_total") == 6
    assert m.registry.get_sample_value("pdserve_e2e_request_latency_seconds_count") == 2  # an abort ends too
    m.observe_failed("error")  # (a PD room that failed: counted by the decode, once)
    assert m.registry.get_sample_value("pdserve_requests_finished_total", {"finish_reason": "error"}) == 1
    assert m.registry.get_sample_value("pdserve_e2e_request_latency_seconds_count") == 2  # (no output)


def test_counts_that_only_grow_are_counters_and_never_decrease(demo_model_dir):
    """Preemptions and prefix-cache tokens were gauges (vLLM's are counters: `rate()` and restarts
    work on those). A count kept elsewhere that starts again (a new store after a weight update) is
    followed from there, the counter keeping its total."""
    m = EngineMetrics()
    engine = LLMEngine(EngineConfig.create(demo_model_dir, num_pages=64, max_model_len=256))
    m.on_step(engine, [])
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", generate_latest(m.registry).decode(), re.M))
    for name in ("num_preemptions", "prefix_cache_query_tokens", "prefix_cache_hit_tokens", "prefix_waits"):
        assert types[f"pdserve_{name}_total"] == "counter", name
    c = _Mirror("t_count", "t", CollectorRegistry(), ("k",))
    for value in (3, 5, 5, 2, 4):  # 3, +2, +0, then a restart at 2 (+2), +2
        c.set(value, "a")
    assert c.counter.labels("a")._value.get() == 9


def test_each_transfer_latency_is_observed_once_whatever_the_reads_interleave():
    """The count of finished transfers and the latencies were read apart while the agent thread wrote
    them apart: a read between the two writes observed an old latency again and never the new one."""
    stats = TransferStats()
    rooms = type("Rooms", (), {"counts": lambda self: {}, "__len__": lambda self: 0})()
    role = SimpleNamespace(queue_sizes=dict, rooms=rooms, failures={})
    control = SimpleNamespace(num_forged=0, num_malformed=0, num_wrong_version=0)
    m = PDMetrics(
        CollectorRegistry(), SimpleNamespace(role=role, agent=SimpleNamespace(stats=stats), control=control)
    )

    def finish(latency_s: float) -> None:  # (as TransferAgent._finish: the count, then the latency)
        stats.transfers_done += 1
        m.update()  # a read in between
        stats.latencies_s.append((stats.transfers_done + stats.transfers_failed, latency_s))

    finish(0.001)
    m.update()
    finish(0.5)
    m.update()
    m.update()
    assert m.latency._sum.get() == 0.501
    assert m.xfer.counter.labels("transfers_done")._value.get() == 2
