"""Request counters of the index service, kept on the request path (``GET /metrics``).

Requests are counted in plain counters (a dict increment and a bucketed latency per
request, no lock: one event loop writes them). prometheus-client is imported only when
``/metrics`` is first scraped (:mod:`kvstream.serve.exposition` turns these counters and the
service's state into the exposition text): a service nobody scrapes does not carry it.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING

from kvstream.latency import LATENCY_BUCKETS, LE_LABELS, LatencyHistogram

if TYPE_CHECKING:
    from kvstream.serve.exposition import Exposition
    from kvstream.serve.service import IndexService

__all__ = ["LATENCY_BUCKETS", "LE_LABELS", "RequestLatency", "ServiceMetrics"]


#: One endpoint's request latencies (the pipeline's histogram type).
RequestLatency = LatencyHistogram


class ServiceMetrics:
    """The service's request counters; :meth:`observe` records one request, :meth:`render`
    answers a scrape."""

    def __init__(self, service: IndexService) -> None:
        self.service = service
        #: requests by (endpoint, method, status)
        self.requests: dict[tuple[str, str, int], int] = {}
        self.latency: dict[str, RequestLatency] = {}
        self._exposition: Exposition | None = None

    def observe(self, endpoint: str, method: str, status: int, seconds: float) -> None:
        """Count one request and its latency."""
        key = (endpoint, method, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        h = self.latency.get(endpoint)
        if h is None:
            h = self.latency[endpoint] = RequestLatency()
        h.sum += seconds  # RequestLatency.observe, inline: one call less on every request
        h.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def render(self) -> bytes:
        """The exposition text (Prometheus text format)."""
        if self._exposition is None:
            from kvstream.serve.exposition import Exposition

            self._exposition = Exposition(self)
        return self._exposition.render()
