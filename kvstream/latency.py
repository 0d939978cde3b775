"""The latency histogram buckets every kvstream histogram uses (layer 0: no imports).

The pipeline's export latencies (:mod:`kvstream.pipeline.metrics`) and the service's request
latencies (:mod:`kvstream.serve.metrics`) are bucketed alike, so dashboards can overlay them.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

__all__ = ["LATENCY_BUCKETS", "LE_LABELS", "LatencyHistogram"]

#: Latency buckets (seconds): 100 us .. 30 s (upper bounds, inclusive).
LATENCY_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

#: The buckets' ``le`` labels as Prometheus writes them (``repr`` equals prometheus-client's
#: ``floatToGoString`` for these values; tests hold them equal).
LE_LABELS: Final = (*(repr(b) for b in LATENCY_BUCKETS), "+Inf")


class LatencyHistogram:
    """Latencies bucketed by :data:`LATENCY_BUCKETS` (upper bounds, inclusive, as Prometheus
    buckets are) plus +Inf, and their sum.

    :meth:`observe` runs on one thread (an event loop); a scrape may read the counts from
    another without a lock, and then may see an observation in the sum and not yet in its
    bucket (a prometheus-client histogram updates the two under separate locks too)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Record one observation of ``seconds``."""
        self.sum += seconds
        self.counts[bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts per upper bound (the last one ``+Inf``: every observation)."""
        out: list[tuple[str, float]] = []
        total = 0
        for le, n in zip(LE_LABELS, list(self.counts), strict=True):
            total += n
            out.append((le, total))
        return out
