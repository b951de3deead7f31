"""Prometheus metrics of one HTTP front end (one ``CollectorRegistry`` per app).

Latencies are measured by the server, from the moment a request arrived over HTTP. Engine gauges
are read from the ``EngineStats`` snapshot at scrape time. The P/D roles and the router register
their own metrics (KV hand-off bytes and latency, retries ...) on ``ServerMetrics.registry``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

if TYPE_CHECKING:  # the router uses the buckets without the engine (and torch)
    from pdinfer.engine.core_messages import EngineStats
    from pdinfer.engine.output_tracker import OutputTracker

PREFIX = "pdinfer_"
_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class RequestLatencyMetrics:
    """A registry with the per-request latency histograms an engine server and a router share."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=_TOKEN_BUCKETS_S,
            registry=r,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the last output token.",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )


class ServerMetrics(RequestLatencyMetrics):
    def __init__(self, model_name: str, role: str):
        super().__init__()
        r = self.registry
        self.requests_finished = Counter(
            PREFIX + "requests_finished", "Engine requests finished, by finish reason.", ["finish_reason"], registry=r
        )
        self.errors = Counter(
            PREFIX + "request_errors", "HTTP requests answered with an error, by kind.", ["kind"], registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens received.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens produced.", registry=r)
        self.num_waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to prefill.", registry=r)
        self.num_running = Gauge(PREFIX + "num_requests_running", "Sequences decoding.", registry=r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_ratio", "Fraction of KV blocks in use.", registry=r)
        self.free_blocks = Gauge(PREFIX + "kv_cache_free_blocks", "Free KV blocks.", registry=r)
        self.total_blocks = Gauge(PREFIX + "kv_cache_total_blocks", "KV blocks in all.", registry=r)
        self.prefix_hit_rate = Gauge(
            PREFIX + "prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.", registry=r
        )
        self.preemptions = Gauge(PREFIX + "num_preemptions", "Preemptions since start.", registry=r)
        self.migrated = Gauge(
            PREFIX + "num_requests_migrated",
            "Requests this engine gave up for another engine to continue (drained, out of KV blocks), since start.",
            registry=r,
        )
        self.healthy = Gauge(PREFIX + "engine_healthy", "1 while the engine loop runs.", registry=r)
        self.draining = Gauge(
            PREFIX + "engine_draining", "1 once the engine was drained: it takes no new request.", registry=r
        )
        # A gauge per cumulative PE hand-off stat (the engine counts; we copy at scrape time).
        self.handoffs = Gauge(PREFIX + "kv_handoffs", "K/V hand-offs the CE confirmed (PE).", registry=r)
        self.handoff_bytes = Gauge(PREFIX + "kv_handoff_bytes", "K/V bytes handed over (PE).", registry=r)
        self.handoff_seconds = Gauge(
            PREFIX + "kv_handoff_seconds",
            "Seconds from K/V push to the CE's confirmation, summed over hand-offs (PE).",
            registry=r,
        )
        self.handoffs_failed = Gauge(
            PREFIX + "kv_handoffs_failed", "Hand-offs that failed or were aborted (PE).", registry=r
        )
        info = Gauge(
            PREFIX + "engine_info", "Constant 1, labelled with the engine's identity.", ["model", "role"], registry=r
        )
        info.labels(model=model_name, role=role).set(1)

    def render(self, stats: EngineStats, healthy: bool, draining: bool) -> tuple[bytes, str]:
        self.num_waiting.set(stats.num_waiting)
        self.num_running.set(stats.num_running + stats.num_prompted)
        self.kv_usage.set(stats.kv_usage)
        self.free_blocks.set(stats.num_free_blocks)
        self.total_blocks.set(stats.num_total_blocks)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.preemptions.set(stats.num_preemptions)
        self.migrated.set(stats.num_migrated)
        self.healthy.set(1 if healthy else 0)
        self.draining.set(1 if draining else 0)
        self.handoffs.set(stats.num_handoffs)
        self.handoff_bytes.set(stats.handoff_bytes)
        self.handoff_seconds.set(stats.handoff_seconds)
        self.handoffs_failed.set(stats.num_handoffs_failed)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Latency of one engine request, fed its tracker after each update."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float | None = None):
        self.metrics = metrics
        self.arrival_s = arrival_s if arrival_s is not None else time.monotonic()
        self.first_token_s: float | None = None
        self.done = False

    def observe(self, tracker: OutputTracker) -> None:
        if self.done:
            return
        now = time.monotonic()
        if self.first_token_s is None and tracker.first_token_time is not None:
            self.first_token_s = now
            self.metrics.time_to_first_token.observe(now - self.arrival_s)
        if not tracker.finished:
            return
        self.done = True
        m = self.metrics
        choices = tracker.choices.values()
        num_tokens = max((len(c.token_ids) for c in choices), default=0)
        m.prompt_tokens.inc(len(tracker.prompt_token_ids))
        m.generation_tokens.inc(sum(len(c.token_ids) for c in choices))
        for choice in choices:
            m.requests_finished.labels(finish_reason=choice.finish_reason or "error").inc()
        if not choices:
            m.requests_finished.labels(finish_reason="error").inc()
        if tracker.error is None:
            m.e2e_latency.observe(now - self.arrival_s)
            if self.first_token_s is not None and num_tokens > 1:
                m.time_per_output_token.observe((now - self.first_token_s) / (num_tokens - 1))
