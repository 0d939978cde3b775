"""The engine of ``kvstream bridge``: any event source into any sinks, through the pipeline.

:func:`run_bridge` opens the source (a live vLLM/SGLang engine, Kafka, a file-sink directory,
TensorRT-LLM JSON), pushes every batch it yields into a :class:`~kvstream.pipeline.Pipeline`
over the sinks, and stops when the source ends, when nothing arrived for ``idle_exit_s``,
after ``max_batches``, or when ``stop`` is set (SIGTERM/SIGINT in the CLI). Closing flushes
every sink within the pipeline's close deadline; the result says what went where and what
was lost, counted by source.

A live engine's batches travel as columns (:class:`~kvstream.events.columns.ColumnBatch`: no
model object per event or block); sinks that encode columns (Kafka) take them as they are, the
pipeline builds the models for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstream.errors import ConfigError
from kvstream.events.columns import KIND_NAMES, LOST, REMOVED, STORED, ColumnBatch
from kvstream.events.model import EventBatch, Lost, Removed, Stored
from kvstream.index import EventSource, open_source
from kvstream.kafka_security import redact_url
from kvstream.pipeline import CloseReport, Pipeline, PipelineConfig
from kvstream.sink import Sink, create_sink

__all__ = ["BridgeOptions", "BridgeProgress", "BridgeResult", "SourceTally", "run_bridge"]

#: How long the bridge waits for a first message before saying what it waits for.
WAITING_NOTICE_S = 5.0


@dataclass(frozen=True)
class BridgeOptions:
    """What to bridge. ``sinks`` are sink URLs; the bare word ``file`` is a file sink in
    ``out_dir`` (a new temporary directory when None), as in ``kvstream demo``."""

    source: str
    sinks: tuple[str, ...] = ("file",)
    out_dir: Path | None = None
    idle_exit_s: float | None = None
    max_batches: int | None = None
    follow: bool | None = None  # None: follow Kafka topics, read files to their end
    config: PipelineConfig = field(default_factory=PipelineConfig)
    metrics_port: int | None = None
    source_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class SourceTally:
    """What one kvstream source (instance, rank, incarnation) sent through the bridge."""

    batches: int = 0
    events: int = 0
    first_id: int | None = None
    last_id: int | None = None
    lost_markers: int = 0
    lost_ids: int = 0


@dataclass
class BridgeProgress:
    """Live counters (also what the progress line shows)."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    lost_markers: int = 0
    lost_ids: int = 0
    dropped_batches: int = 0
    malformed: int = 0
    started: float = field(default_factory=time.monotonic)
    last_item: float | None = None
    waiting: str = ""
    #: Kafka sources: records behind the high watermark, per partition (refreshed each second)
    kafka_lag: dict[int, int] = field(default_factory=dict)

    def rate(self) -> float:
        """Stored + removed blocks per second since the start."""
        dt = time.monotonic() - self.started
        return (self.blocks_stored + self.blocks_removed) / dt if dt > 0 else 0.0


@dataclass
class BridgeResult:
    """The outcome: counters, per-source tallies, where the sinks wrote, the close report."""

    source: str
    sinks: list[str]
    stop_reason: str
    progress: BridgeProgress
    sources: dict[str, SourceTally]
    elapsed_s: float
    close: CloseReport | None = None
    events_by_kind: dict[str, int] = field(default_factory=dict)
    source_stats: dict[str, int] = field(default_factory=dict)
    #: Per sink that reports more than the pipeline counts (its ``details()``: e.g. what the
    #: vllm sink refused or skipped, and why).
    sink_details: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every batch reached every sink (what the source lost is reported, not an error)."""
        return self.close is not None and self.close.ok and not self.progress.dropped_batches

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        p = self.progress
        return {
            "ok": self.ok,
            "source": self.source,
            "sinks": self.sinks,
            "stop_reason": self.stop_reason,
            "elapsed_s": round(self.elapsed_s, 3),
            "batches": p.batches,
            "events": p.events,
            "events_by_kind": self.events_by_kind,
            "blocks_stored": p.blocks_stored,
            "blocks_removed": p.blocks_removed,
            "blocks_per_s": round((p.blocks_stored + p.blocks_removed) / self.elapsed_s, 1)
            if self.elapsed_s > 0
            else 0.0,
            "lost_markers": p.lost_markers,
            "lost_ids": p.lost_ids,
            "dropped_batches": p.dropped_batches,
            "source_stats": self.source_stats,
            "sources": {k: vars(v) for k, v in self.sources.items()},
            "close": self.close.as_dict() if self.close is not None else None,
            "sink_details": self.sink_details,
        }


def _sink_urls(opts: BridgeOptions) -> list[str]:
    urls = []
    for spec in opts.sinks or ("file",):
        if spec == "file":
            out = opts.out_dir or Path(tempfile.mkdtemp(prefix="kvstream-bridge-"))
            out.mkdir(parents=True, exist_ok=True)
            urls.append(f"file://{out.resolve()}")
        else:
            urls.append(spec)
    return urls


def _source_key(batch: EventBatch | ColumnBatch) -> str:
    s = batch.source
    rank = "" if s.attention_dp_rank is None else f"/rank{s.attention_dp_rank}"
    return f"{s.instance_id}{rank}#{s.incarnation}"


def _tally(
    batch: EventBatch | ColumnBatch, p: BridgeProgress, t: SourceTally, kinds: dict[str, int]
) -> None:
    p.batches += 1
    t.batches += 1
    if isinstance(batch, ColumnBatch):
        _tally_columns(batch, p, t, kinds)
        return
    for ev in batch.events:
        data = ev.data
        kinds[data.type] = kinds.get(data.type, 0) + 1
        if isinstance(data, Stored):
            p.blocks_stored += len(data.blocks)
        elif isinstance(data, Removed):
            p.blocks_removed += len(data.block_hashes)
        elif isinstance(data, Lost):
            p.lost_markers += 1
            p.lost_ids += data.count
            t.lost_markers += 1
            t.lost_ids += data.count
        if t.first_id is None:
            t.first_id = ev.event_id
        t.last_id = ev.event_id
    p.events += len(batch.events)
    t.events += len(batch.events)


def _tally_columns(
    cols: ColumnBatch, p: BridgeProgress, t: SourceTally, kinds: dict[str, int]
) -> None:
    for kind, payload in zip(cols.kinds, cols.payloads, strict=True):
        name = KIND_NAMES[kind]
        kinds[name] = kinds.get(name, 0) + 1
        if kind == STORED:
            p.blocks_stored += len(payload[1])
        elif kind == REMOVED:
            p.blocks_removed += len(payload[0])
        elif kind == LOST:
            p.lost_markers += 1
            p.lost_ids += payload[1]
            t.lost_markers += 1
            t.lost_ids += payload[1]
    n = len(cols.event_ids)
    if n:
        if t.first_id is None:
            t.first_id = cols.event_ids[0]
        t.last_id = cols.event_ids[-1]
    p.events += n
    t.events += n


def _open(opts: BridgeOptions) -> EventSource:
    kwargs = dict(opts.source_options)
    text = opts.source
    if text.startswith(("vllm://", "sglang://")):
        kwargs.setdefault("columns", True)
        return open_source(text, **kwargs)
    follow = opts.follow if opts.follow is not None else text.startswith("kafka://")
    return open_source(text, follow=follow, **kwargs)


def _waiting_text(source: EventSource) -> str:
    waiting = getattr(source, "waiting_ranks", None)
    if waiting is None:
        return f"waiting for data from {source.name}"
    ranks = waiting()
    if not ranks:
        return ""
    endpoint = getattr(source, "endpoint", None)
    where = ", ".join(endpoint.pub_address(r) for r in ranks) if endpoint else str(ranks)
    return f"waiting for the engine to publish on {where}"


async def run_bridge(
    opts: BridgeOptions,
    *,
    stop: asyncio.Event | None = None,
    on_progress: Callable[[BridgeProgress], None] | None = None,
    progress_every_s: float = 0.5,
) -> BridgeResult:
    """Bridge until the source ends, goes idle, hits ``max_batches`` or ``stop`` is set.

    Raises ConfigError (bad source/sink URLs, bad options) before anything is opened;
    a sink that cannot start raises its SinkError after the source is closed again.
    """
    stop = stop or asyncio.Event()
    urls = _sink_urls(opts)
    sinks: list[Sink] = [create_sink(u) for u in urls]
    source = _open(opts)
    progress = BridgeProgress()
    tallies: dict[str, SourceTally] = {}
    kinds: dict[str, int] = {}
    reason = "source ended"
    t0 = time.monotonic()
    pipe = Pipeline(sinks, opts.config)
    metrics_server = None
    await source.start()
    try:
        await pipe.start()
        if opts.metrics_port is not None:
            from prometheus_client import start_http_server

            from kvstream.cli.metrics import register_process_metrics

            pipe.registry.register(_ProgressCollector(progress, source))
            register_process_metrics(pipe.registry)
            try:
                metrics_server = start_http_server(opts.metrics_port, registry=pipe.registry)
            except OSError as exc:
                raise ConfigError(
                    f"--metrics-port {opts.metrics_port}: cannot serve metrics there "
                    f"({exc.strerror or exc}); pick a free port"
                ) from None
        last_report = last_lag = 0.0
        lag = getattr(source, "lag", None)  # a Kafka source's consumer lag, for /metrics
        while True:
            if stop.is_set():
                reason = "stopped by signal"
                break
            now = time.monotonic()
            if lag is not None and metrics_server is not None and now - last_lag >= 1.0:
                progress.kafka_lag = lag()
                last_lag = now
            if on_progress is not None and now - last_report >= progress_every_s:
                progress.malformed = source.stats.malformed
                quiet_for = now - (progress.last_item or t0)
                progress.waiting = (
                    _waiting_text(source)
                    if progress.last_item is None and quiet_for >= WAITING_NOTICE_S
                    else ""
                )
                on_progress(progress)
                last_report = now
            wait = progress_every_s
            if opts.idle_exit_s is not None:
                idle = now - (progress.last_item or t0)
                if idle >= opts.idle_exit_s:
                    reason = f"idle for {opts.idle_exit_s:g} s"
                    break
                wait = min(wait, opts.idle_exit_s - idle)
            item = source.read_ready()  # already here: no tasks to race against stop
            if item is None:
                item = await _read_or_stop(source, wait, stop)
            if item is None:
                if source.ended:
                    break
                continue
            progress.last_item = time.monotonic()
            batch = item.data  # columns from a live engine
            key = _source_key(batch)
            _tally(batch, progress, tallies.setdefault(key, SourceTally()), kinds)
            if not await pipe.put(batch):
                progress.dropped_batches += 1
            if opts.max_batches is not None and progress.batches >= opts.max_batches:
                reason = f"{opts.max_batches} batches"
                break
    finally:
        await source.aclose()
        close = await pipe.aclose()
        if metrics_server is not None:
            metrics_server[0].shutdown()
    progress.malformed = source.stats.malformed
    if on_progress is not None:
        progress.waiting = ""
        on_progress(progress)
    return BridgeResult(
        source=redact_url(opts.source),
        sinks=[redact_url(u) for u in urls],
        stop_reason=reason,
        progress=progress,
        sources=tallies,
        elapsed_s=time.monotonic() - t0,
        close=close,
        events_by_kind=kinds,
        source_stats=source.stats.as_dict(),
        sink_details=_sink_details(sinks),
    )


def _sink_details(sinks: list[Sink]) -> dict[str, dict[str, Any]]:
    """What sinks with a ``details()`` method report beyond the pipeline's counts."""
    out: dict[str, dict[str, Any]] = {}
    for sink in sinks:
        details = getattr(sink, "details", None)
        if callable(details):
            out[sink.name] = details()
    return out


class _ProgressCollector:
    """Prometheus view of what the bridge read (the pipeline exports what the sinks did)."""

    def __init__(self, progress: BridgeProgress, source: EventSource) -> None:
        self._progress = progress
        self._source = source

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = self._progress
        label = [self._source.name]
        for name, doc, value in (
            ("batches", "batches read from the source", p.batches),
            ("events", "events read from the source", p.events),
            (
                "lost_ids",
                "event ids covered by lost markers (what the source could not get)",
                p.lost_ids,
            ),
            ("malformed", "malformed inputs the source skipped", self._source.stats.malformed),
            ("dropped_batches", "batches a full sink queue refused", p.dropped_batches),
        ):
            c = CounterMetricFamily(f"kvstream_bridge_{name}", doc, labels=["source"])
            c.add_metric(label, value)
            yield c
        blocks = CounterMetricFamily(
            "kvstream_bridge_blocks",
            "blocks in stored/removed events read",
            labels=["source", "kind"],
        )
        blocks.add_metric([*label, "stored"], p.blocks_stored)
        blocks.add_metric([*label, "removed"], p.blocks_removed)
        yield blocks
        waiting = GaugeMetricFamily(
            "kvstream_bridge_idle_seconds",
            "seconds since the source last yielded",
            labels=["source"],
        )
        waiting.add_metric(label, time.monotonic() - (p.last_item or p.started))
        yield waiting
        if p.kafka_lag:
            lag = GaugeMetricFamily(
                "kvstream_bridge_kafka_lag",
                "records behind the partition's high watermark (Kafka sources)",
                labels=["source", "partition"],
            )
            for part, behind in sorted(p.kafka_lag.items()):
                lag.add_metric([*label, str(part)], behind)
            yield lag


async def _read_or_stop(source: EventSource, wait: float, stop: asyncio.Event) -> Any:
    """``source.read(wait)``, returning None early when ``stop`` is set."""
    read = asyncio.ensure_future(source.read(wait))
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({read, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if read in done:
        return read.result()
    read.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await read
    return None
