"""Prometheus metrics of pipelines (prometheus-client).

Counters and gauges are plain integers kept by each sink queue and read at scrape time by a
custom collector, so the hot path pays nothing for them. The export latency histogram is
observed once per export attempt into plain bucket counts (:class:`LatencyHistogram`: one
bisect and two additions, where a prometheus-client ``Histogram`` takes its locks for the sum
and the bucket), exported by the same collector. Every series carries ``pipeline`` and
``sink`` labels.

=============================================== ======= ========================================
metric                                          type    meaning
=============================================== ======= ========================================
kvstream_pipeline_events_in_total               counter events accepted into a sink's queue
kvstream_pipeline_events_out_total              counter events the sink accepted
kvstream_pipeline_batches_out_total             counter batches the sink accepted
kvstream_pipeline_events_dropped_total          counter events dropped, by ``reason``
kvstream_pipeline_lost_markers_total            counter ``lost`` marker events delivered
kvstream_pipeline_export_retries_total          counter export attempts that were retries
kvstream_pipeline_export_failures_total         counter failed attempts, by ``kind``
kvstream_pipeline_queue_depth_batches           gauge   batches waiting in a sink's queue
kvstream_pipeline_queue_depth_events            gauge   events waiting in a sink's queue
kvstream_pipeline_lost_pending_ids              gauge   ids dropped whose markers are not out yet
kvstream_pipeline_export_latency_seconds        hist.   duration of one export attempt
=============================================== ======= ========================================

Several pipelines may share one registry (they differ by the ``pipeline`` label; a pipeline
replaces an earlier one of the same name); by default
each pipeline has its own :class:`~prometheus_client.CollectorRegistry`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvstream.latency import LATENCY_BUCKETS, LatencyHistogram

from .queue import SinkQueue

__all__ = ["LATENCY_BUCKETS", "LatencyHistogram", "MetricsSource", "PipelineMetrics"]


class MetricsSource(Protocol):
    """What a pipeline exposes to the collector."""

    def metric_queues(self) -> list[tuple[str, SinkQueue]]:
        """(sink name, its queue) for every sink."""
        ...


class _SharedCollector(Collector):
    """One per registry; reads every registered pipeline's counters at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, weakref.ReferenceType[MetricsSource]] = {}
        # by (pipeline, sink): kept after a pipeline unregisters, and shared by a later
        # pipeline of the same name, as a labelled prometheus-client histogram's children are
        self._latency: dict[tuple[str, str], LatencyHistogram] = {}

    def latency(self, pipeline: str, sink: str) -> LatencyHistogram:
        with self._lock:
            return self._latency.setdefault((pipeline, sink), LatencyHistogram())

    def add(self, name: str, source: MetricsSource) -> None:
        with self._lock:  # a later pipeline of the same name replaces the earlier one
            self._sources[name] = weakref.ref(source)

    def remove(self, name: str, source: MetricsSource) -> None:
        with self._lock:
            ref = self._sources.get(name)
            if ref is not None and ref() in (source, None):
                del self._sources[name]

    def _live(self) -> list[tuple[str, MetricsSource]]:
        with self._lock:
            out = [(n, r()) for n, r in self._sources.items()]
        return [(n, s) for n, s in out if s is not None]

    def describe(self) -> list[Metric]:
        return [*self._families([]), self._latency_family({})]

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._live())
        with self._lock:
            latency = dict(self._latency)
        yield self._latency_family(latency)

    @staticmethod
    def _latency_family(hists: dict[tuple[str, str], LatencyHistogram]) -> Metric:
        family = HistogramMetricFamily(
            "kvstream_pipeline_export_latency_seconds",
            "Duration of one export attempt.",
            labels=["pipeline", "sink"],
        )
        for labels, h in hists.items():
            family.add_metric(list(labels), h.buckets(), h.sum)
        return family

    @staticmethod
    def _families(sources: list[tuple[str, MetricsSource]]) -> Iterator[Metric]:
        p = "kvstream_pipeline_"
        lbl = ["pipeline", "sink"]

        def counter(name: str, doc: str, extra: list[str] | None = None) -> CounterMetricFamily:
            return CounterMetricFamily(p + name, doc, labels=lbl + (extra or []))

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(p + name, doc, labels=lbl)

        ev_in = counter("events_in", "Events accepted into a sink's queue.")
        ev_out = counter("events_out", "Events the sink accepted.")
        b_out = counter("batches_out", "Batches the sink accepted.")
        dropped = counter("events_dropped", "Events dropped before delivery.", ["reason"])
        markers = counter("lost_markers", "Lost-marker events delivered.")
        retries = counter("export_retries", "Export attempts that were retries.")
        failures = counter("export_failures", "Failed export attempts.", ["kind"])
        depth_b = gauge("queue_depth_batches", "Batches waiting in a sink's queue.")
        depth_e = gauge("queue_depth_events", "Events waiting in a sink's queue.")
        pending = gauge("lost_pending_ids", "Dropped ids whose lost markers are not out yet.")
        for pname, source in sources:
            for sname, q in source.metric_queues():
                c = q.counters
                labels = [pname, sname]
                ev_in.add_metric(labels, c.events_in)
                ev_out.add_metric(labels, c.events_out)
                b_out.add_metric(labels, c.batches_out)
                for reason, n in sorted(c.dropped.items()):
                    dropped.add_metric([*labels, reason], n)
                markers.add_metric(labels, c.markers_out)
                retries.add_metric(labels, c.retries)
                failures.add_metric([*labels, "retriable"], c.failures_retriable)
                failures.add_metric([*labels, "permanent"], c.failures_permanent)
                nb, ne = q.depth()
                depth_b.add_metric(labels, nb)
                depth_e.add_metric(labels, ne)
                pending.add_metric(labels, q.pending_lost_ids())
        yield from (ev_in, ev_out, b_out, dropped, markers, retries, failures)
        yield from (depth_b, depth_e, pending)


class _RegistryState:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.collector = _SharedCollector()
        registry.register(self.collector)


_states: weakref.WeakKeyDictionary[CollectorRegistry, _RegistryState] = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def _state_for(registry: CollectorRegistry) -> _RegistryState:
    with _states_lock:
        state = _states.get(registry)
        if state is None:
            state = _states[registry] = _RegistryState(registry)
        return state


class PipelineMetrics:
    """A pipeline's handle on its registry: register/unregister and latency observers."""

    def __init__(
        self, pipeline_name: str, source: MetricsSource, registry: CollectorRegistry | None
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._name = pipeline_name
        self._source = source
        self._state = _state_for(self.registry)
        self._state.collector.add(pipeline_name, source)

    def latency_observer(self, sink_name: str) -> Callable[[float], None]:
        """A function recording one export attempt's duration for ``sink_name``."""
        return self._state.collector.latency(self._name, sink_name).observe

    def unregister(self) -> None:
        """Stop reporting this pipeline (its latency series stay in the histogram)."""
        self._state.collector.remove(self._name, self._source)
