"""The task that drives one sink: take a chunk, materialise it, export it, retry, settle, repeat.

Deferred batches (:class:`~kvstream.events.deferred.DeferredBatch`) are materialised here, on
the pipeline's loop, by the first sink task that exports them; the batch caches its models,
so every other sink gets the same :class:`~kvstream.events.model.EventBatch` for free.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence

from kvstream.events.deferred import AnyBatch, DeferredBatch
from kvstream.events.model import EventBatch
from kvstream.sink import ExportResult, ExportStatus, Sink

from .config import SinkPolicy
from .queue import Chunk, DropReason, SinkQueue
from .retry import Backoff

__all__ = ["SinkWorker"]

log = logging.getLogger("kvstream.pipeline")


class SinkWorker:
    """Runs :meth:`run` as one asyncio task per sink.

    Exports are sequential, so a sink sees its batches in queue order. A retriable failure is
    retried with backoff until ``retry.deadline_s`` after the chunk's first attempt; then, or
    on a permanent failure, the chunk is dropped into the loss ledger (markers follow). When
    the task is cancelled (close's deadline) the chunk in flight is dropped as ``shutdown``.
    A chunk's deferred batches are materialised once, before its first attempt; one that
    cannot be (a recorder bug) fails the chunk permanently.
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
        #: Set after each settled chunk (delivered or dropped); flush() waits on it.
        self.progress = asyncio.Event()
        self.last_error: str | None = None

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
                    # close's deadline passed with this chunk in flight
                    self.queue.failed(chunk, DropReason.SHUTDOWN, 0.0)
                    raise
                finally:
                    self.progress.set()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: keep the pipeline alive, the queue fills and drops
            log.exception("sink task for %s crashed", self.sink.name)
            self.last_error = "sink task crashed; see the log"

    async def _deliver(self, chunk: Chunk) -> None:
        retry = self.policy.retry
        counters = self.queue.counters
        try:
            batches = _materialized(chunk.batches)
        except Exception as exc:
            self.last_error = f"materialising a deferred batch failed: {type(exc).__name__}: {exc}"
            counters.failures_permanent += 1
            log.exception("sink %s: %s", self.sink.name, self.last_error)
            self._give_up(chunk, DropReason.PERMANENT_ERROR)
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
                return
            self.last_error = result.reason
            if result.status is ExportStatus.PERMANENT:
                counters.failures_permanent += 1
                log.warning("sink %s failed permanently: %s", self.sink.name, result.reason)
                self._give_up(chunk, DropReason.PERMANENT_ERROR)
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
                self._give_up(chunk, DropReason.RETRY_EXHAUSTED)
                return
            counters.retries += 1
            await asyncio.sleep(delay)

    def _give_up(self, chunk: Chunk, reason: str) -> None:
        self.queue.failed(chunk, reason, self._marker_backoff.next_delay())

    async def _attempt(self, batches: Sequence[EventBatch], timeout: float) -> ExportResult:
        sink = self.sink
        try:
            if not self._started:
                await asyncio.wait_for(sink.start(), timeout)
                self._started = True
            result = await asyncio.wait_for(sink.export(batches), timeout)
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


def _materialized(batches: Sequence[AnyBatch]) -> Sequence[EventBatch]:
    """The chunk's batches with every deferred one materialised (cached by the batch itself,
    so a batch shared by several sinks is built once)."""
    return [b.materialize() if isinstance(b, DeferredBatch) else b for b in batches]
