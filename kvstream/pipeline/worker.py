"""The task that drives one sink: take a chunk, materialise it, export it, retry, settle, repeat.

Deferred batches (:class:`~kvstream.events.deferred.DeferredBatch`) are materialised here, on
the pipeline's loop, by the first sink task that exports them; the batch caches its models,
so every other sink gets the same :class:`~kvstream.events.model.EventBatch` for free. Column
batches (:class:`~kvstream.events.columns.ColumnBatch`, an engine bridge's) go to a sink whose
``accepts_columns`` is true as they are (it encodes them without the models), materialised
for any other; such a sink gets a deferred batch as its columns (built from the raw records),
so no model is built unless another sink needs one, or, when it also ``accepts_deferred``,
the deferred batch itself (it builds the columns where it encodes them: the Kafka sink, in
its encoding thread, while the messages encoded before are sent).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from kvstream.errors import PermanentSinkError
from kvstream.events.deferred import LAZY_BATCHES, AnyBatch, DeferredBatch
from kvstream.events.model import EventBatch
from kvstream.sink import Abandoned, ExportResult, ExportStatus, Sink

from .config import SinkPolicy
from .queue import Chunk, DropReason, SinkQueue
from .retry import Backoff

__all__ = ["SinkWorker"]

log = logging.getLogger("kvstream.pipeline")
T = TypeVar("T")


class SinkWorker:
    """Runs :meth:`run` as one asyncio task per sink.

    Exports are sequential, so a sink sees its batches in queue order. A retriable failure is
    retried with backoff until ``retry.deadline_s`` after the chunk's first attempt; then, or
    on a permanent failure, the chunk is dropped into the loss ledger (markers follow). When
    the task is cancelled (close's deadline) the chunk in flight is dropped as ``shutdown``.
    A chunk's deferred batches are materialised once, before its first attempt; one that
    cannot be (a recorder bug) fails the chunk permanently.

    Giving a chunk up first asks the sink to :meth:`~kvstream.sink.Sink.abandon` it: the
    sink stops delivering it and says which batches arrived after all and which are in
    doubt; those in doubt are :meth:`~kvstream.sink.Sink.resolve`-d before the rest is
    recorded lost, so markers cover exactly what is missing. Resolving is retried with backoff
    until the sink answers (nothing else could be delivered meanwhile anyway), it says it never
    can (permanent) or close cancels it; what is left is recorded as ``unknown``.
    """

    def __init__(
        self,
        sink: Sink,
        queue: SinkQueue,
        policy: SinkPolicy,
        *,
        observe_latency: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.sink = sink
        self.queue = queue
        self.policy = policy
        self._observe = observe_latency
        self._backoff = Backoff(policy.retry, rng)
        self._marker_backoff = Backoff(policy.retry, rng)
        self._started = False
        #: the sink encodes ColumnBatch itself (no models needed)
        self._columns = bool(getattr(sink, "accepts_columns", False))
        #: ... and turns deferred batches into columns itself
        self._deferred = self._columns and bool(getattr(sink, "accepts_deferred", False))
        # the sink's synchronous export (see deliver_now); not with lingering, which exists
        # to make chunks fuller than one batch
        self._export_now: Callable[[Sequence[EventBatch]], bool] | None = (
            getattr(sink, "export_now", None) if policy.linger_s == 0 else None
        )
        #: Set after each settled chunk (delivered or dropped); flush() waits on it.
        self.progress = asyncio.Event()
        #: The last failure, cleared when data is delivered again.
        self.last_error: str | None = None
        # the chunk being given up: (chunk, batches, reason, delivered, in doubt positions)
        self._giving_up: tuple[Chunk, Sequence[EventBatch], str, set[int], set[int]] | None = None

    async def run(self) -> None:
        """Deliver chunks until the queue is closed and empty (or the task is cancelled)."""
        try:
            while True:
                chunk = await self.queue.get_chunk()
                if chunk is None:
                    return
                if not chunk.batches:
                    continue
                try:
                    await self._deliver(chunk)
                except asyncio.CancelledError:
                    # close's deadline passed with this chunk in flight (or being given up)
                    self._cancelled(chunk)
                    raise
                finally:
                    self.progress.set()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: keep the pipeline alive, the queue fills and drops
            log.exception("sink task for %s crashed", self.sink.name)
            self.last_error = "sink task crashed; see the log"

    def deliver_now(self, batch: AnyBatch, n: int) -> bool:
        """Export ``batch`` (``n`` events) right away, in the calling coroutine (on the
        pipeline's loop), when that cannot be told apart from queueing it; False, having done
        nothing, otherwise (then queue it).

        Right away means: the sink offers ``export_now`` (a synchronous export that only
        exports when it needs no waiting and cannot fail, the memory sink's), no lingering is
        configured, the sink was started, the batch is built (or the sink takes columns: a
        deferred batch goes as its columns, a column batch as it is) and this task waits for
        work with nothing queued and no lost markers owed. The batch would then be
        the next chunk exported, alone, and delivered by one attempt: it is counted the same
        (accepted, delivered, settled, one latency observation, progress set), one event-loop
        round trip sooner. The check, the export and the counts are one step under the
        queue's lock (:meth:`~kvstream.pipeline.queue.SinkQueue.deliver_now`).
        """
        export_now = self._export_now
        if export_now is None or not self._started:
            return False
        ready: Any = batch  # (columns go to a sink that declares it takes them)
        if isinstance(batch, LAZY_BATCHES):
            if not self._columns:
                return False
            if isinstance(batch, DeferredBatch):
                try:
                    ready = batch.columns()
                except Exception:  # a recorder bug: the queued path fails the chunk and says so
                    return False
        t0 = time.perf_counter()
        if not self.queue.deliver_now(export_now, ready, n):
            return False
        if self._observe is not None:
            self._observe(time.perf_counter() - t0)
        self._marker_backoff.reset()
        self.last_error = None  # data flows (as after any delivered data chunk)
        self.progress.set()
        return True

    async def _deliver(self, chunk: Chunk) -> None:
        retry = self.policy.retry
        counters = self.queue.counters
        try:
            batches = _materialized(chunk.batches, self._columns, self._deferred)
        except Exception as exc:
            self.last_error = f"materialising a deferred batch failed: {type(exc).__name__}: {exc}"
            counters.failures_permanent += 1
            log.exception("sink %s: %s", self.sink.name, self.last_error)
            self.queue.failed(chunk, DropReason.PERMANENT_ERROR, self._marker_backoff.next_delay())
            return
        first = time.monotonic()
        deadline = None if retry.deadline_s is None else first + retry.deadline_s
        self._backoff.reset()
        while True:
            timeout = retry.attempt_timeout_s
            if deadline is not None:
                timeout = max(min(timeout, deadline - time.monotonic()), 0.001)
            t0 = time.perf_counter()
            result = await self._attempt(batches, timeout)
            if self._observe is not None:
                self._observe(time.perf_counter() - t0)
            if result.status is ExportStatus.SUCCESS:
                self.queue.delivered(chunk)
                self._marker_backoff.reset()
                if chunk.data_batches:  # data flows again (a marker alone is no recovery)
                    self.last_error = None
                return
            self.last_error = result.reason
            if result.status is ExportStatus.PERMANENT:
                counters.failures_permanent += 1
                log.warning("sink %s failed permanently: %s", self.sink.name, result.reason)
                await self._give_up(chunk, batches, DropReason.PERMANENT_ERROR)
                return
            counters.failures_retriable += 1
            delay = self._backoff.next_delay()
            if deadline is not None and time.monotonic() + delay >= deadline:
                log.warning(
                    "sink %s: giving up after %.1fs of retries: %s",
                    self.sink.name,
                    time.monotonic() - first,
                    result.reason,
                )
                await self._give_up(chunk, batches, DropReason.RETRY_EXHAUSTED)
                return
            counters.retries += 1
            await asyncio.sleep(delay)

    def _abandon(self, batches: Sequence[EventBatch]) -> tuple[set[int], set[int]]:
        """Ask the sink to stop delivering ``batches``: (positions delivered, in doubt)."""
        try:
            outcome = self.sink.abandon()
        except Exception:  # a third-party sink breaking the contract: assume nothing arrived
            log.exception("sink %s: abandon() raised", self.sink.name)
            outcome = Abandoned()
        where = {id(b): i for i, b in enumerate(batches)}
        delivered = {where[id(b)] for b in outcome.delivered if id(b) in where}
        doubt = {where[id(b)] for b in outcome.in_doubt if id(b) in where} - delivered
        return delivered, doubt

    async def _give_up(self, chunk: Chunk, batches: Sequence[EventBatch], reason: str) -> None:
        delivered, doubt = self._abandon(batches)
        unknown: set[int] = set()
        if doubt:
            self._giving_up = (chunk, batches, reason, delivered, doubt)
            arrived, unknown = await self._resolve(batches, doubt)
            self._giving_up = None
            delivered |= arrived
        self.queue.failed(
            chunk,
            reason,
            self._marker_backoff.next_delay(),
            delivered=delivered,
            unknown=unknown,
        )

    async def _resolve(
        self, batches: Sequence[EventBatch], doubt: set[int]
    ) -> tuple[set[int], set[int]]:
        """Ask the sink which batches in doubt arrived: (arrived, still unknown) positions."""
        retry = self.policy.retry
        order = sorted(doubt)
        asked = [batches[i] for i in order]
        backoff = Backoff(retry)
        while True:
            try:
                found = await asyncio.wait_for(self.sink.resolve(asked), retry.resolve_timeout_s)
                if len(found) != len(order):
                    raise PermanentSinkError("resolve() answered for other batches")
                arrived = {i for i, ok in zip(order, found, strict=True) if ok}
                return arrived, set()
            except asyncio.CancelledError:
                raise
            except PermanentSinkError as exc:
                log.warning("sink %s: cannot tell whether sends arrived: %s", self.sink.name, exc)
                return set(), doubt
            except Exception as exc:  # retriable (timeouts included); last_error keeps the cause
                log.info("sink %s: reading sends in doubt back failed: %r", self.sink.name, exc)
            await asyncio.sleep(backoff.next_delay())

    def _cancelled(self, chunk: Chunk) -> None:
        """Close's deadline passed: record the chunk in flight (or being given up)."""
        if self._giving_up is not None and self._giving_up[0] is chunk:
            _, _, reason, delivered, doubt = self._giving_up
            self._giving_up = None
            self.queue.failed(chunk, reason, 0.0, delivered=delivered, unknown=doubt)
            return
        try:
            batches = _materialized(chunk.batches, self._columns, self._deferred)
        except Exception:
            self.queue.failed(chunk, DropReason.SHUTDOWN, 0.0)
            return
        delivered, doubt = self._abandon(batches)
        self.queue.failed(chunk, DropReason.SHUTDOWN, 0.0, delivered=delivered, unknown=doubt)

    async def _attempt(self, batches: Sequence[EventBatch], timeout: float) -> ExportResult:
        sink = self.sink
        try:
            if not self._started:
                await asyncio.wait_for(sink.start(), timeout)
                self._started = True
            result = await _within(sink.export(batches), timeout)
        except asyncio.TimeoutError:
            return ExportResult.retry(f"export did not finish within {timeout:.3g}s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return ExportResult.from_exception(exc)
        if not isinstance(result, ExportResult):  # a third-party sink breaking the contract
            return ExportResult.permanent(  # type: ignore[unreachable]
                f"{type(sink).__name__}.export returned {result!r}, not an ExportResult"
            )
        return result


async def _within(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """``await coro``, cancelled after ``timeout_s`` (asyncio.TimeoutError), as
    ``asyncio.wait_for`` does. From Python 3.11 the coroutine runs in the calling task
    (``asyncio.timeout``) instead of a task of its own, so an export that completes
    without waiting (the memory sink's) costs no extra trip through the event loop."""
    if _TIMEOUT is None:
        return await asyncio.wait_for(coro, timeout_s)
    async with _TIMEOUT(timeout_s):
        return await coro


_TIMEOUT: Any = getattr(asyncio, "timeout", None)  # Python >= 3.11


def _materialized(
    batches: Sequence[AnyBatch], columns: bool = False, deferred: bool = False
) -> Sequence[EventBatch]:
    """The chunk's batches with every deferred one materialised (cached by the batch itself,
    so a batch shared by several sinks is built once); with ``columns``, column batches stay
    columns and deferred ones become theirs, built without the models (typed as the sink's
    export takes them: such a sink declares it takes both); with ``deferred`` too, every
    batch stays as it is (the sink builds the columns)."""
    if deferred:
        same: list[Any] = list(batches)
        return same
    if columns:
        cols: list[Any] = [b.columns() if isinstance(b, DeferredBatch) else b for b in batches]
        return cols
    out: list[Any] = [b.materialize() if isinstance(b, LAZY_BATCHES) else b for b in batches]
    return out
