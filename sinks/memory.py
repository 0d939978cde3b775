"""The memory sink: a bounded in-process log of batches; the reference sink and the test fake.

Exported batches are appended to a log that keeps the newest ``max_batches`` (older ones are
evicted and counted). Readers either look at :attr:`MemorySink.batches` or subscribe::

    sink = MemorySink(max_batches=10_000)
    async for batch in sink.subscribe(from_start=True):   # ends after sink.shutdown()
        ...

A subscription is a cursor into the log (like a Kafka consumer's offset), so a slow reader
never slows the sink: if it falls behind the retained window it skips ahead and counts the
batches it ``missed``.

The sink takes column batches too (``accepts_columns``): a pipeline hands it an engine
bridge's :class:`~kvstream.events.columns.ColumnBatch`, or a deferred emitter batch as its
columns, without building a model per block. Every read (:attr:`MemorySink.batches`,
:meth:`MemorySink.events`, :meth:`MemorySink.read_back`, subscriptions) still returns the
validated :class:`~kvstream.events.model.EventBatch`, built on first read (``to_batch()``, once
per batch, shared by every reader); a sink made with ``columns=True`` (``memory?columns=1``)
instead gives its subscriptions the columns as they were exported, for readers that apply
columns (the prefix index's :class:`~kvstream.index.sources.memory.MemorySource`).

For tests the sink can fail or stall on purpose: :meth:`MemorySink.fail_next` queues results
or exceptions for the next exports, :meth:`MemorySink.pause`/:meth:`MemorySink.resume` make
exports wait (a stalled sink), ``latency_s`` delays every export.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence

from kvstream.errors import ConfigError
from kvstream.events.columns import ColumnBatch
from kvstream.events.model import EventBatch, KVCacheEvent, SourceId
from kvstream.sink import ExportResult, Sink, SinkURL

__all__ = ["MemorySink", "MemorySubscription"]


class MemorySink(Sink):
    """Keeps the newest ``max_batches`` exported batches (None: unbounded) in memory; with
    ``columns``, subscriptions yield column batches as exported (see the module doc)."""

    scheme = "memory"
    accepts_columns = True

    def __init__(
        self,
        *,
        max_batches: int | None = 100_000,
        latency_s: float = 0.0,
        name: str | None = None,
        columns: bool = False,
    ) -> None:
        super().__init__(name=name)
        if max_batches is not None and max_batches < 1:
            raise ConfigError(f"max_batches must be >= 1 or None, got {max_batches}")
        self.max_batches = max_batches
        self.latency_s = latency_s
        #: subscriptions yield ColumnBatch objects as exported (else their models)
        self.columns = columns
        self._log: deque[EventBatch | ColumnBatch] = deque(maxlen=max_batches)
        self._base = 0  # absolute offset of _log[0]
        self._changed = asyncio.Event()
        self._shut_down = False
        self._faults: deque[ExportResult | BaseException] = deque()
        self._gate: asyncio.Event | None = None
        #: Batches evicted to keep the bound; export calls made; batches and events accepted.
        self.evicted = 0
        self.export_calls = 0
        self.batches_in = 0
        self.events_in = 0
        self.flushes = 0

    @classmethod
    def from_url(cls, url: SinkURL) -> MemorySink:
        """``memory?max_batches=1000&name=mem2&columns=1`` (``max_batches=0``: unbounded)."""
        url.check_keys(["max_batches", "latency_s", "name", "columns"])
        max_batches = url.get_int("max_batches", 100_000)
        return cls(
            max_batches=max_batches or None,
            latency_s=url.get_float("latency_s", 0.0) or 0.0,
            name=url.get("name"),
            columns=url.get_bool("columns", False),
        )

    # ------------------------------------------------------------------------- Sink API

    async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
        """Append ``batches`` (models or :class:`ColumnBatch` objects) to the log, after any
        injected delay, stall or failure."""
        self.export_calls += 1
        if self._shut_down:
            return ExportResult.permanent("the memory sink is shut down")
        if self._gate is not None:
            await self._gate.wait()
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if self._faults:
            fault = self._faults.popleft()
            if isinstance(fault, BaseException):
                raise fault
            return fault
        self._append(batches)
        return ExportResult.success()

    def _append(self, batches: Sequence[EventBatch]) -> None:
        log = self._log
        for b in batches:
            if self.max_batches is not None and len(log) == self.max_batches:
                self._base += 1
                self.evicted += 1
            log.append(b)
            self.events_in += len(b) if isinstance(b, ColumnBatch) else len(b.events)
        self.batches_in += len(batches)
        self._notify()

    def export_now(self, batches: Sequence[EventBatch]) -> bool:
        """:meth:`export` without the coroutine, when it would neither wait nor fail: no
        stall, latency or injected failure pending, not shut down, and ``export`` not
        overridden by a subclass. Then the batches are appended (counted as one export call,
        exactly as ``export`` does) and True returned; otherwise nothing happens (False).

        The pipeline uses it to deliver a batch without a trip through the sink's task when
        the task is idle (:meth:`~kvstream.pipeline.worker.SinkWorker.deliver_now`)."""
        if (
            self._shut_down
            or self._gate is not None
            or self.latency_s
            or self._faults
            or type(self).export is not MemorySink.export
        ):
            return False
        self.export_calls += 1
        self._append(batches)
        return True

    async def force_flush(self, timeout_s: float | None = None) -> bool:
        """Nothing to make durable; counts the call."""
        self.flushes += 1
        return True

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Refuse later exports and end every subscription once it has read the log."""
        self._shut_down = True
        if self._gate is not None:
            self._gate.set()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed.clear()

    # -------------------------------------------------------------------------- reading

    @property
    def batches(self) -> list[EventBatch]:
        """The retained batches, oldest first."""
        return list(map(_model, self._log))

    def events(self) -> list[tuple[SourceId, KVCacheEvent]]:
        """Every retained event with its source, in delivery order."""
        return [(b.source, ev) for b in self.batches for ev in b.events]

    @property
    def is_shut_down(self) -> bool:
        """True after :meth:`shutdown`."""
        return self._shut_down

    async def position(self) -> int:
        """The log offset after the last exported batch (see :meth:`read_back`)."""
        return self._base + len(self._log)

    async def read_back(self, since: object = None) -> list[EventBatch]:
        """Retained batches from log offset ``since`` (a :meth:`position`; None: all)."""
        start = since if isinstance(since, int) else self._base
        return list(map(_model, list(self._log)[max(start - self._base, 0) :]))

    def discard_before(self, offset: int) -> int:
        """Forget the retained batches before log offset ``offset`` (a :meth:`position`), as
        a reader that has applied them may: they are freed now rather than when the bound
        evicts them. Subscriptions still behind ``offset`` skip ahead and count the batches
        ``missed``, as after an eviction. Returns how many were discarded."""
        log = self._log
        n = min(offset - self._base, len(log))
        if n <= 0:
            return 0
        self._base += n
        if n == len(log):
            log.clear()
        else:
            pop = log.popleft
            for _ in range(n):
                pop()
        return n

    def clear(self) -> None:
        """Forget the retained batches (subscriptions skip to the end)."""
        self._base += len(self._log)
        self._log.clear()

    def subscribe(self, *, from_start: bool = False) -> MemorySubscription:
        """An async iterator over batches exported from now on (or from the oldest retained
        batch with ``from_start``); it ends after :meth:`shutdown` once caught up."""
        return MemorySubscription(self, self._base if from_start else self._base + len(self._log))

    # ---------------------------------------------------------------------- fault hooks

    def fail_next(self, times: int = 1, result: ExportResult | BaseException | None = None) -> None:
        """Make the next ``times`` exports fail with ``result`` (default: a retriable failure;
        an exception instance is raised instead of returned)."""
        fault = result if result is not None else ExportResult.retry("injected failure")
        self._faults.extend([fault] * times)

    def pause(self) -> None:
        """Make exports wait until :meth:`resume` (a stalled sink)."""
        if self._gate is None:
            self._gate = asyncio.Event()

    def resume(self) -> None:
        """Let paused exports continue."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.set()


def _model(batch: EventBatch | ColumnBatch) -> EventBatch:
    return batch.to_batch() if isinstance(batch, ColumnBatch) else batch


class MemorySubscription(AsyncIterator[EventBatch]):
    """A cursor over a :class:`MemorySink`'s log; see :meth:`MemorySink.subscribe`. It
    yields models, or, when the sink was made with ``columns``, the batches as exported
    (``EventBatch`` or ``ColumnBatch``; typed as models for the readers that take both)."""

    def __init__(self, sink: MemorySink, offset: int) -> None:
        self._sink = sink
        self._as_is = sink.columns
        self._offset = offset
        #: Batches evicted before this subscription read them.
        self.missed = 0

    def __aiter__(self) -> MemorySubscription:
        return self

    def poll(self) -> EventBatch | None:
        """The next batch if one is there, else None (never waits)."""
        sink = self._sink
        if self._offset < sink._base:
            self.missed += sink._base - self._offset
            self._offset = sink._base
        i = self._offset - sink._base
        if i < len(sink._log):
            self._offset += 1
            batch = sink._log[i]
            if self._as_is or not isinstance(batch, ColumnBatch):
                return batch  # type: ignore[return-value]  # columns: the sink's choice
            return batch.to_batch()
        return None

    async def __anext__(self) -> EventBatch:
        while True:
            batch = self.poll()
            if batch is not None:
                return batch
            if self._sink._shut_down:
                raise StopAsyncIteration
            await self._sink._changed.wait()

    async def get(self, timeout_s: float | None = None) -> EventBatch | None:
        """The next batch, waiting up to ``timeout_s``; None on timeout or when ended."""
        try:
            return await asyncio.wait_for(self.__anext__(), timeout_s)
        except (asyncio.TimeoutError, StopAsyncIteration):
            return None
