"""The latency histogram buckets every kvstream histogram uses (layer 0: no imports).

The pipeline's export latencies (:mod:`kvstream.pipeline.metrics`) and the service's request
latencies (:mod:`kvstream.serve.metrics`) are bucketed alike, so dashboards can overlay them.
"""

from __future__ import annotations

from typing import Final

__all__ = ["LATENCY_BUCKETS", "LE_LABELS"]

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
