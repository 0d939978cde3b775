"""Prometheus exposition of the index service (``GET /metrics``), imported at the first scrape.

The request counters come from :class:`~kvstream.serve.metrics.ServiceMetrics`; everything
else is read from the service when Prometheus scrapes:

- ``kvstream_serve_requests_total{endpoint,method,status}``,
  ``kvstream_serve_request_duration_seconds{endpoint}`` (histogram);
- ``kvstream_serve_ingested_batches_total{feed}``, ``..._events_total{feed}``,
  ``kvstream_serve_feed_errors_total{feed}``, ``kvstream_serve_feed_caught_up{feed}``,
  ``kvstream_serve_feed_lag_seconds{feed}`` (since its last batch),
  ``kvstream_serve_feed_records_behind{feed,partition}`` (Kafka: records not read yet);
- ``kvstream_serve_lost_events_total{model}`` (lost markers and id gaps the index saw),
  ``kvstream_serve_blocks{model}`` (cached blocks), ``kvstream_serve_workers{model,status}``,
  ``kvstream_serve_models``, ``kvstream_serve_ready``;
- the process and Python collectors, and ``kvstream_build_info{version}``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvstream import __version__

if TYPE_CHECKING:
    from kvstream.serve.metrics import ServiceMetrics

__all__ = ["Exposition"]


class Exposition(Collector):
    """The service's registry: its own collector plus the process, platform and GC ones."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(c)

    def render(self) -> bytes:
        """The exposition text."""
        return bytes(generate_latest(self.registry))

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        svc = self.metrics.service
        info = GaugeMetricFamily(
            "kvstream_build_info", "kvstream build information", labels=["version"]
        )
        info.add_metric([__version__], 1)
        yield info
        req = CounterMetricFamily(
            "kvstream_serve_requests",
            "HTTP requests by endpoint, method and status",
            labels=["endpoint", "method", "status"],
        )
        for (ep, method, status), n in sorted(self.metrics.requests.items()):
            req.add_metric([ep, method, str(status)], n)
        yield req
        dur = HistogramMetricFamily(
            "kvstream_serve_request_duration_seconds",
            "HTTP request latency (server side)",
            labels=["endpoint"],
        )
        for ep, h in sorted(self.metrics.latency.items()):
            dur.add_metric([ep], h.buckets(), h.sum)
        yield dur
        batches = CounterMetricFamily(
            "kvstream_serve_ingested_batches", "Batches applied per feed", labels=["feed"]
        )
        events = CounterMetricFamily(
            "kvstream_serve_ingested_events", "Events applied per feed", labels=["feed"]
        )
        errors = CounterMetricFamily(
            "kvstream_serve_feed_errors", "Source failures per feed (retried)", labels=["feed"]
        )
        caught = GaugeMetricFamily(
            "kvstream_serve_feed_caught_up", "1 once the feed has caught up", labels=["feed"]
        )
        lag = GaugeMetricFamily(
            "kvstream_serve_feed_lag_seconds",
            "Seconds since the feed's last batch (since its start before any)",
            labels=["feed"],
        )
        behind = GaugeMetricFamily(
            "kvstream_serve_feed_records_behind",
            "Kafka records between the feed's position and the partition's high watermark",
            labels=["feed", "partition"],
        )
        now = time.monotonic()
        for feed in svc.feeds():
            batches.add_metric([feed.name], feed.batches)
            events.add_metric([feed.name], feed.events)
            errors.add_metric([feed.name], feed.errors)
            caught.add_metric([feed.name], 1 if feed.caught_up else 0)
            lag.add_metric([feed.name], now - (feed.last_batch_at or feed.started_at))
            records_lag = getattr(feed.source, "lag", None)  # Kafka sources
            if records_lag is not None:
                for partition, n in sorted(records_lag().items()):
                    behind.add_metric([feed.name, str(partition)], n)
        yield from (batches, events, errors, caught, lag, behind)
        lost = CounterMetricFamily(
            "kvstream_serve_lost_events",
            "Events the index knows it missed (lost markers and id gaps)",
            labels=["model"],
        )
        blocks = GaugeMetricFamily("kvstream_serve_blocks", "Cached blocks", labels=["model"])
        workers = GaugeMetricFamily(
            "kvstream_serve_workers", "Workers (index sources) by state", labels=["model", "state"]
        )
        unmatchable = GaugeMetricFamily(
            "kvstream_serve_unmatchable_workers",
            "Workers whose events cannot be matched (an unusable hash algorithm)",
            labels=["model"],
        )
        models = svc.models()
        for m in models:
            name = str(m.key)
            st = m.index.stats()
            c = st.counters
            lost.add_metric([name], c.lost_events + c.gap_events)
            blocks.add_metric([name], st.blocks)
            workers.add_metric([name, "trusted"], st.workers - st.stale_workers)
            workers.add_metric([name, "stale"], st.stale_workers)
            unmatchable.add_metric(
                [name], sum(1 for w in m.index.workers() if m.index.unmatchable(w))
            )
        yield from (lost, blocks, workers, unmatchable)
        n_models = GaugeMetricFamily("kvstream_serve_models", "Model indexes")
        n_models.add_metric([], len(models))
        yield n_models
        ready = GaugeMetricFamily("kvstream_serve_ready", "1 when /ready answers true")
        ready.add_metric([], 1 if svc.ready()[0] else 0)
        yield ready
