"""The fan-out pipeline: engine thread -> one bounded queue and one task per sink -> sinks."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from kvstream.clock import SYSTEM_CLOCK, Clock
from kvstream.errors import ConfigError
from kvstream.events.deferred import AnyBatch
from kvstream.sink import Sink

from .config import OverflowPolicy, PipelineConfig
from .errors import PipelineClosedError, PipelineNotStartedError
from .lost import batch_len
from .metrics import PipelineMetrics
from .queue import DropReason, SinkQueue
from .report import CloseReport, SinkReport
from .worker import SinkWorker

__all__ = ["Pipeline"]

T = TypeVar("T")


class _Lane:
    """One sink with its queue, worker and task."""

    __slots__ = ("name", "queue", "sink", "task", "worker")

    def __init__(self, name: str, sink: Sink, queue: SinkQueue, worker: SinkWorker) -> None:
        self.name = name
        self.sink = sink
        self.queue = queue
        self.worker = worker
        self.task: asyncio.Task[None] | None = None


class Pipeline:
    """Fans event batches out to sinks, each through its own bounded queue and task.

    Producers hand batches over with :meth:`submit` (any thread; the engine thread's call
    returns within ``handoff_timeout_s`` whatever the sinks do), :meth:`submit_nowait` (never
    waits) or ``await`` :meth:`put` (coroutines on the pipeline's loop). A batch is an
    :class:`~kvstream.events.model.EventBatch` or, to keep model building off the engine
    thread, a :class:`~kvstream.events.deferred.DeferredBatch` (from
    ``KVCacheManager.flush_events_deferred()`` / ``EventEmitter.flush_deferred()``): the
    hand-off only enqueues it, and the first sink task that exports it materialises it once
    for every sink. Each sink gets every batch in submission order, unless its queue
    overflows or its exports fail: then the dropped ids are counted (per sink and reason) and
    a ``lost`` marker takes their place in that sink's stream, so consumers know to resync.
    Queues, overflow policies and lost markers work the same for both kinds of batch (a
    deferred batch that is dropped is accounted for from its raw records, never built).

    Lifecycle::

        async with Pipeline([FileSink("/var/kv"), kafka], config) as pipe:   # start()
            pipe.submit(batch)                                                 # any thread
            await pipe.flush()            # everything submitted so far delivered and durable
        # aclose(): stop intake, drain within close_timeout_s, flush + shut every sink down

    :meth:`aclose` returns a :class:`CloseReport` of what each sink did not receive.
    Metrics go to ``registry`` (a fresh :class:`~prometheus_client.CollectorRegistry` by
    default, see :mod:`kvstream.pipeline.metrics`).
    """

    def __init__(
        self,
        sinks: Sequence[Sink] | Mapping[str, Sink],
        config: PipelineConfig | None = None,
        *,
        registry: CollectorRegistry | None = None,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config or PipelineConfig()
        named = _named(sinks)
        unknown = sorted(set(self.config.sinks) - set(named))
        if unknown:
            raise ConfigError(
                f"pipeline config has overrides for unknown sink(s) {', '.join(unknown)}; "
                f"sinks: {', '.join(named)}"
            )
        self._clock = clock
        self._lanes: list[_Lane] = []
        self.metrics = PipelineMetrics(self.config.name, self, registry)
        for name, sink in named.items():
            policy = self.config.policy_for(name)
            queue = SinkQueue(policy, clock)
            worker = SinkWorker(
                sink,
                queue,
                policy,
                observe_latency=self.metrics.latency_observer(name),
                rng=rng,
            )
            self._lanes.append(_Lane(name, sink, queue, worker))
        self._queues = [lane.queue for lane in self._lanes]
        self._any_block = any(q.policy.overflow is OverflowPolicy.BLOCK for q in self._queues)
        self._loop_thread: int | None = None
        self._started = False
        self._closed = False
        self._close_result: asyncio.Future[CloseReport] | None = None

    # ------------------------------------------------------------------------ properties

    @property
    def sinks(self) -> dict[str, Sink]:
        """The sinks by name."""
        return {lane.name: lane.sink for lane in self._lanes}

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry this pipeline reports to."""
        return self.metrics.registry

    @property
    def started(self) -> bool:
        """True after :meth:`start`."""
        return self._started

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` began: new batches are refused."""
        return self._closed

    def metric_queues(self) -> list[tuple[str, SinkQueue]]:
        """(sink name, queue) pairs, for the metrics collector."""
        return [(lane.name, lane.queue) for lane in self._lanes]

    # ------------------------------------------------------------------------- lifecycle

    async def start(self) -> Pipeline:
        """Start one task per sink on the running loop. Sinks are started by their task
        before its first export, so a sink that is down does not fail ``start``."""
        if self._closed:
            raise PipelineClosedError("the pipeline is closed")
        if self._started:
            return self
        loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        for lane in self._lanes:
            lane.queue.attach(loop)
            lane.task = loop.create_task(lane.worker.run(), name=f"kvstream-sink-{lane.name}")
        self._started = True
        return self

    async def __aenter__(self) -> Pipeline:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------------------- hand-off

    def submit(self, batch: AnyBatch, *, timeout_s: float | None = None) -> bool:
        """Hand ``batch`` to every sink; True when every sink's queue accepted it.

        Thread-safe. The call returns within ``timeout_s`` (default ``handoff_timeout_s``)
        however slow the sinks are: only ``block`` sinks wait, each at most its
        ``block_timeout_s``, all within that bound. Called on the pipeline's own loop thread
        it never waits (a wait there would stall the tasks that make room): use :meth:`put`.
        A refused batch is counted and replaced by a ``lost`` marker in that sink's stream
        (after :meth:`aclose` it is only counted, as ``closed``).
        """
        deadline: float | None = None
        if self._any_block and self._loop_thread != threading.get_ident():
            bound = self.config.handoff_timeout_s if timeout_s is None else timeout_s
            deadline = time.monotonic() + bound
        ok = True
        for q in self._queues:
            if not q.put(batch, deadline):
                ok = False
        return ok

    def submit_nowait(self, batch: AnyBatch) -> bool:
        """Like :meth:`submit` but never waits, whatever the overflow policy."""
        ok = True
        for q in self._queues:
            if not q.put(batch, None):
                ok = False
        return ok

    async def put(self, batch: AnyBatch, *, timeout_s: float | None = None) -> bool:
        """Hand ``batch`` over from a coroutine on the pipeline's loop; ``block`` sinks wait
        for room without blocking the loop (at most ``timeout_s``, default
        ``handoff_timeout_s``, in total).

        A sink whose task is idle and that can take the batch without waiting (the memory
        sink's ``export_now``) gets it right here, without a trip through its task: see
        :meth:`SinkWorker.deliver_now <kvstream.pipeline.worker.SinkWorker.deliver_now>`."""
        n = batch_len(batch)
        until: float | None = None
        ok = True
        for lane in self._lanes:
            if lane.worker.deliver_now(batch, n):
                continue
            q = lane.queue
            accepted = q.offer(batch, n)
            if accepted is None:  # a full ``block`` queue: wait for room
                if until is None:
                    bound = self.config.handoff_timeout_s if timeout_s is None else timeout_s
                    until = time.monotonic() + bound
                accepted = await q.put_async(batch, max(until - time.monotonic(), 0.0))
            ok = ok and accepted
        return ok

    # ---------------------------------------------------------------------------- flush

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Deliver everything submitted before the call, then force-flush every sink.

        True when every sink received all of it (or its ``lost`` markers) and flushed within
        ``timeout_s`` (default ``flush_timeout_s``). Lingering is skipped while flushing.
        """
        if not self._started:
            raise PipelineNotStartedError("start() the pipeline before flush()")
        bound = self.config.flush_timeout_s if timeout_s is None else timeout_s
        until = time.monotonic() + bound
        targets = [(lane, lane.queue.counters.batches_in) for lane in self._lanes]
        for lane in self._lanes:
            lane.queue.set_urgent(1)
        try:
            ok = True
            for lane, target in targets:
                ok = await self._await_settled(lane, target, until) and ok
            remaining = max(until - time.monotonic(), 0.0)
            flushed = await asyncio.gather(
                *(self._force_flush(lane.sink, remaining) for lane in self._lanes)
            )
            return ok and all(f is True for f in flushed)
        finally:
            for lane in self._lanes:
                lane.queue.set_urgent(-1)

    @staticmethod
    async def _await_settled(lane: _Lane, target: int, until: float) -> bool:
        progress = lane.worker.progress
        while True:
            progress.clear()
            if lane.queue.flushed(target):
                return True
            if lane.task is None or lane.task.done():
                return False
            remaining = until - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(progress.wait(), min(remaining, 0.05))

    @staticmethod
    async def _force_flush(sink: Sink, timeout_s: float) -> bool | str:
        try:
            return bool(await _bounded(sink.force_flush(timeout_s * 0.9), timeout_s))
        except asyncio.TimeoutError:
            return f"force_flush did not finish within {timeout_s:.3g}s"
        except Exception as exc:
            return f"force_flush failed: {type(exc).__name__}: {exc}"

    # ---------------------------------------------------------------------------- close

    async def aclose(self, timeout_s: float | None = None) -> CloseReport:
        """Stop intake, drain, flush and shut every sink down, all within ``timeout_s``
        (default ``close_timeout_s``) whatever the sinks do; returns what each sink did not
        receive.

        A sink call that overruns its share of the budget is cancelled and left behind, not
        waited for (a sink that ignores cancellation cannot hold ``aclose`` past its
        deadline); the report then says ``shut_down=False``.

        Batches still queued or in flight when the drain deadline passes are dropped as
        ``shutdown``. Idempotent: later calls return the first call's report.
        """
        if self._close_result is not None:
            return await asyncio.shield(self._close_result)
        self._close_result = asyncio.get_running_loop().create_future()
        try:
            report = await self._close(timeout_s)
        except BaseException as exc:
            self._close_result.set_exception(exc)
            self._close_result.exception()  # mark retrieved
            raise
        self._close_result.set_result(report)
        return report

    async def _close(self, timeout_s: float | None) -> CloseReport:
        t0 = time.monotonic()
        bound = self.config.close_timeout_s if timeout_s is None else timeout_s
        deadline = t0 + bound
        grace = min(self.config.shutdown_grace_s, bound / 4)
        if not self._started:
            await self.start()
        self._closed = True
        # exact drop recording while time is left, then per-source ranges (the rest of the
        # budget is for the sinks' flush and shutdown)
        until = deadline - grace / 2
        for q in self._queues:
            q.record_until = until
            q.close()
        tasks = [lane.task for lane in self._lanes if lane.task is not None]
        pending: set[asyncio.Task[None]] = set()
        drain_s = deadline - grace - time.monotonic()
        if tasks:
            if drain_s > 0:
                _, pending = await asyncio.wait(tasks, timeout=drain_s)
            else:
                pending = {t for t in tasks if not t.done()}
        for t in pending:
            t.cancel()
        if pending:  # a sink task records its chunk in flight when cancelled: a loop turn
            await asyncio.wait(pending, timeout=max(deadline - time.monotonic(), 0.001))
        for q in self._queues:
            q.drain_remaining(DropReason.SHUTDOWN)
        remaining = max(deadline - time.monotonic(), 0.001)
        stops = await asyncio.gather(
            *(self._stop_sink(lane.sink, remaining) for lane in self._lanes)
        )
        reports = {}
        for lane, (flushed, shut, err) in zip(self._lanes, stops, strict=True):
            reports[lane.name] = self._report(
                lane, flushed=flushed, shut_down=shut, error=err or lane.worker.last_error
            )
        return CloseReport(reports, elapsed_s=time.monotonic() - t0, timed_out=bool(pending))

    async def _stop_sink(self, sink: Sink, timeout_s: float) -> tuple[bool, bool, str | None]:
        t0 = time.monotonic()
        flushed = await self._force_flush(sink, timeout_s / 2)
        error = flushed if isinstance(flushed, str) else None
        remaining = max(timeout_s - (time.monotonic() - t0), 0.001)
        shut = True
        try:
            await _bounded(sink.shutdown(remaining * 0.9), remaining)
        except asyncio.TimeoutError:
            shut, error = False, error or f"shutdown did not finish within {remaining:.3g}s"
        except Exception as exc:
            shut = False
            error = error or f"shutdown failed: {type(exc).__name__}: {exc}"
        return flushed is True, shut, error

    # ---------------------------------------------------------------------------- stats

    def stats(self) -> dict[str, SinkReport]:
        """A live snapshot of every sink's counters."""
        return {lane.name: self._report(lane) for lane in self._lanes}

    @staticmethod
    def _report(
        lane: _Lane,
        *,
        flushed: bool | None = None,
        shut_down: bool | None = None,
        error: str | None = None,
    ) -> SinkReport:
        q = lane.queue
        c = q.counters
        nb, ne = q.depth()
        return SinkReport(
            sink=lane.name,
            events_in=c.events_in,
            events_out=c.events_out,
            batches_out=c.batches_out,
            dropped=dict(c.dropped),
            lost_markers_out=c.markers_out,
            lost_pending_ids=q.pending_lost_ids(),
            retries=c.retries,
            queued_batches=nb,
            queued_events=ne,
            flushed=flushed,
            shut_down=shut_down,
            last_error=error if error is not None else lane.worker.last_error,
        )


async def _bounded(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """Await ``coro`` for at most ``timeout_s``; then cancel it and raise TimeoutError at once
    (unlike ``asyncio.wait_for``, which waits for the cancelled call to finish)."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise asyncio.TimeoutError
    return task.result()


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # an abandoned call's late failure is not an unretrieved error


def _named(sinks: Sequence[Sink] | Mapping[str, Sink]) -> dict[str, Sink]:
    if isinstance(sinks, Mapping):
        named = dict(sinks)
    else:
        named = {}
        for sink in sinks:
            if not isinstance(sink, Sink):
                raise ConfigError(f"{sink!r} is a {type(sink).__name__}, not a kvstream Sink")
            base = sink.name
            name, i = base, 2
            while name in named:
                name, i = f"{base}-{i}", i + 1
            named[name] = sink
    if not named:
        raise ConfigError("a pipeline needs at least one sink")
    for name, sink in named.items():
        if not isinstance(sink, Sink):
            raise ConfigError(f"sink {name!r} is a {type(sink).__name__}, not a kvstream Sink")
    return named
