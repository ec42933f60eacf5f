"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.queue_depth = Gauge(
            "kvtier_serving_queue_depth", "requests held by a pool's workers", ["pool"], registry=r
        )
        self.queued = Gauge("kvtier_serving_queued_requests", "admitted requests without a first token", registry=r)
        self.ttft = Histogram(
            "kvtier_serving_ttft_seconds", "arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "kvtier_serving_tpot_seconds", "time per output token after the first", buckets=LATENCY_BUCKETS, registry=r
        )
        self.requests = Counter("kvtier_serving_requests", "requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kvtier_serving_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.hit_tokens = Counter("kvtier_serving_hit_tokens", "prompt tokens reused from the store", registry=r)
        self.generated = Counter("kvtier_serving_generated_tokens", "tokens generated", registry=r)
        self.replays = Counter("kvtier_serving_replays", "requests whose sliding state was replayed", registry=r)
        self.store_timeouts = Counter(
            "kvtier_serving_store_timeouts",
            "requests that computed their prompt: the store did not answer in time",
            registry=r,
        )
        self.rejections = Counter("kvtier_serving_rejections", "requests refused with 429", ["reason"], registry=r)
        self.aborts = Counter("kvtier_serving_aborts", "requests aborted on the workers", ["reason"], registry=r)
        self.worker_restarts = Gauge("kvtier_serving_worker_restarts", "restarts of a worker", ["worker"], registry=r)
