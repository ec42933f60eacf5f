"""``/metrics`` and ``/health`` for the transfer processes (fetcher, directory), read from their ``stats()``.

Every numeric entry of ``stats()`` becomes one series ``kvtier_<component>_<name>``: a counter if its name is
listed in ``counters`` (totals since start), a gauge otherwise. ``stats()`` is called at scrape time, on the
HTTP thread, so it must be safe to call from another thread (the fetcher's and directory's are: they only
read). Those totals are every tenant's together, whose changes tell one tenant of another's activity: a scrape of
``/metrics`` presents the cluster (admin) token, ``Authorization: Bearer TOKEN`` (Prometheus: ``authorization``
with ``credentials_file``); ``/health`` says only whether the process answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.kvstore.cluster.config import DEFAULT_TENANT, ClusterConfig
from kvtier.kvstore.wire.metrics import MetricsServer
from kvtier.kvstore.wire.protocol import Limits


class StatsCollector(Collector):
    def __init__(self, component: str, stats: Callable[[], dict[str, Any]], counters: frozenset[str]) -> None:
        self.component = component
        self.stats = stats
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self.stats().items()):
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            full = f"kvtier_{self.component}_{name}"
            help_text = f"{self.component} {name.replace('_', ' ')}"
            if name in self.counters:
                yield CounterMetricFamily(full, help_text, value=value)
            else:
                yield GaugeMetricFamily(full, help_text, value=value)


def serve_metrics(
    component: str,
    address: tuple[str, int],
    stats: Callable[[], dict[str, Any]],
    counters: frozenset[str] = frozenset(),
    limits: Limits | None = None,
    admin: Callable[[str], bool] | None = None,
) -> MetricsServer:
    """Start serving ``/metrics`` (``stats()`` as series, to a scrape ``admin(token)`` accepts the bearer token of)
    and ``/health`` (ok while ``stats()`` answers), within ``limits`` (the cluster file's: connections at once, the
    time a request may take)."""
    registry = CollectorRegistry()
    registry.register(StatsCollector(component, stats, counters))

    def health() -> dict[str, Any]:
        stats()
        return {"status": "ok"}

    return MetricsServer(registry, address[0], address[1], health, limits, admin).start()


def admin_only(config: ClusterConfig) -> Callable[[str], bool]:
    """Whether a token is the cluster's (admin) token, by ``config`` (which may hold only its hash)."""
    return lambda token: config.tenant_for_token(token) == DEFAULT_TENANT
