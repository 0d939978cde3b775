"""Process-level Prometheus metrics for the CLI's ``/metrics`` (``bridge --metrics-port``).

:func:`register_process_metrics` adds to a registry what every Prometheus exporter is
expected to show beside its own numbers: ``process_*`` (CPU, memory, file descriptors),
``python_info`` and ``python_gc_*``, and ``kvstream_build_info`` (value 1, labels
``version``, ``schema_version`` and ``native``: the C extensions in use, see
:mod:`kvstream.cli.native_info`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["BuildInfoCollector", "register_process_metrics"]


class BuildInfoCollector:
    """``kvstream_build_info{version, schema_version, native} 1``."""

    def __init__(self) -> None:
        from kvstream import EVENT_SCHEMA_VERSION, __version__
        from kvstream.cli.native_info import active_native

        self.labels = {
            "version": __version__,
            "schema_version": str(EVENT_SCHEMA_VERSION),
            "native": ",".join(active_native()) or "none",
        }

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily(
            "kvstream_build_info",
            "kvstream version, event schema version written, C extensions in use",
            labels=list(self.labels),
        )
        g.add_metric(list(self.labels.values()), 1.0)
        yield g


def register_process_metrics(registry: CollectorRegistry) -> None:
    """Add the process, platform (Python), GC and build-info collectors to ``registry``."""
    from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(BuildInfoCollector())
