"""One sink's bounded, thread-safe queue: the hand-off point between producers and the sink task.

Producers (the engine thread, any thread, or coroutines on the loop) :meth:`~SinkQueue.put`
batches; the sink's task takes export chunks with :meth:`~SinkQueue.get_chunk`. Everything is
guarded by one ``threading.Lock`` held for a few dictionary/deque operations, so a put costs
about a microsecond and never waits on the sink unless the overflow policy is ``block``.
Bulk loss recording (a chunk given up, everything left at close) builds its ledger entries
outside the lock and merges them under it, so a producer never waits behind it.

The queue also owns the sink's :class:`~kvstream.pipeline.lost.LossLedger` and its counters,
so a drop (by a producer or by the sink task) and the marker that replaces it are recorded
under the same lock as the queue contents they refer to.

Batches are :class:`~kvstream.events.model.EventBatch` or
:class:`~kvstream.events.deferred.DeferredBatch` objects (the same object may sit in several
sinks' queues); the queue only reads their O(1) metadata (event count, first id, source) and,
when it drops one, its id spans: it never materialises a deferred batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvstream.clock import Clock
from kvstream.events.deferred import LAZY_BATCHES, AnyBatch
from kvstream.events.model import EventBatch

from .config import OverflowPolicy, SinkPolicy
from .lost import LossLedger, batch_first_id, batch_len, make_marker_batch

_NO_POSITIONS: frozenset[int] = frozenset()

__all__ = ["Chunk", "DropReason", "QueueCounters", "SinkQueue"]


class DropReason:
    """Why events were dropped (the ``reason`` label of the dropped-events metric)."""

    QUEUE_FULL = "queue_full"  # drop_oldest evicted, or drop_newest rejected
    BLOCK_TIMEOUT = "block_timeout"  # block: no room before the deadline
    RETRY_EXHAUSTED = "retry_exhausted"  # retriable failures until the retry deadline
    PERMANENT_ERROR = "permanent_error"  # the sink said retrying cannot help
    SHUTDOWN = "shutdown"  # still queued or in flight when close's deadline passed
    CLOSED = "closed"  # submitted after close (no marker: the stream has ended)
    #: given up while sent and unacknowledged, and the sink could not tell whether it arrived
    #: (its marker's reason says ``unknown``: some of those ids may be in the stream)
    UNKNOWN = "unknown"


@dataclass(slots=True)
class QueueCounters:
    """Plain counters, read by the metrics collector at scrape time (no hot-path cost)."""

    batches_in: int = 0
    events_in: int = 0
    batches_out: int = 0
    events_out: int = 0
    markers_out: int = 0
    retries: int = 0
    failures_retriable: int = 0
    failures_permanent: int = 0
    settled_batches: int = 0  # accepted batches that were delivered or dropped
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_batches: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one export call delivers: data batches in order, with marker batches in front of
    the batches whose ids follow a gap (and standalone markers at the end). Data batches may
    still be deferred: the sink task materialises them before exporting."""

    batches: Sequence[AnyBatch]
    data_batches: int
    data_events: int
    marker_events: int
    #: Positions in ``batches`` of the marker batches the queue put in.
    markers: frozenset[int] = frozenset()


class SinkQueue:
    """A bounded queue of batches for one sink, with the policy's overflow rule."""

    def __init__(self, policy: SinkPolicy, clock: Clock) -> None:
        self.policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._items: deque[AnyBatch] = deque()
        self._events = 0
        self._max_batches = policy.max_queue_batches
        self._max_events = policy.max_queue_events
        self._closed = False
        self._blocked_out = False  # a block wait timed out; no more waiting until progress
        self._thread_waiters = 0
        self.ledger = LossLedger()
        self.counters = QueueCounters()
        # consumer wake-up (bound to the loop by attach())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wakeup: asyncio.Event | None = None
        self._space: asyncio.Event | None = None
        self._consumer_waiting = False
        self._want_batches = 1
        self._want_events = 1
        self._urgent = 0
        self._marker_not_before = 0.0
        # the last chunk failed permanently: at close, its markers are not offered again
        self._refused = False
        #: Close's recording deadline (a ``time.monotonic()`` value): drops recorded after
        #: it are recorded per source from the batches' ends (see :meth:`drain_remaining`).
        self.record_until: float | None = None

    # ---------------------------------------------------------------------- loop binding

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the loop the sink task runs on (called from that loop)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._wakeup = asyncio.Event()
        self._space = asyncio.Event()

    def on_loop_thread(self) -> bool:
        """True when called from the thread running the sink task's loop."""
        return self._loop_thread == threading.get_ident()

    def _signal(self) -> None:
        # lock held; wake the consumer. From another thread this goes through the loop's
        # self-pipe (a few microseconds), so it happens only when the consumer is waiting.
        self._consumer_waiting = False
        wakeup, loop = self._wakeup, self._loop
        if wakeup is None or loop is None:
            return
        if self._loop_thread == threading.get_ident():
            wakeup.set()
        else:
            try:  # noqa: SIM105 - cheaper than contextlib.suppress on the hot path
                loop.call_soon_threadsafe(wakeup.set)
            except RuntimeError:  # loop closed: nobody left to wake
                pass

    def _space_freed(self) -> None:
        # lock held, on the loop thread
        self._blocked_out = False
        if self._thread_waiters:
            self._not_full.notify_all()
        if self._space is not None:
            self._space.set()

    # ------------------------------------------------------------------------- producers

    def _fits(self, n: int) -> bool:
        return not self._items or (
            len(self._items) < self._max_batches and self._events + n <= self._max_events
        )

    def _accept(self, batch: AnyBatch, n: int) -> None:
        self._items.append(batch)
        self._events += n
        c = self.counters
        c.batches_in += 1
        c.events_in += n
        if self._consumer_waiting and (
            len(self._items) >= self._want_batches or self._events >= self._want_events
        ):
            self._signal()

    def _drop(self, batch: AnyBatch, n: int, reason: str, *, marker: bool = True) -> None:
        c = self.counters
        c.dropped[reason] = c.dropped.get(reason, 0) + n
        c.dropped_batches[reason] = c.dropped_batches.get(reason, 0) + 1
        if marker and n:
            self.ledger.record(batch, reason)
            if self._consumer_waiting:
                self._signal()

    def _offer(self, batch: AnyBatch, n: int) -> bool | None:
        """Lock held. True/False when decided (accepted/dropped), None when ``block`` must wait."""
        if self._closed:
            self._drop(batch, n, DropReason.CLOSED, marker=False)
            return False
        if self._fits(n):
            self._accept(batch, n)
            return True
        policy = self.policy.overflow
        if policy is OverflowPolicy.DROP_OLDEST:
            while not self._fits(n):
                old = self._items.popleft()
                k = batch_len(old)
                self._events -= k
                self.counters.settled_batches += 1
                self._drop(old, k, DropReason.QUEUE_FULL)
            self._accept(batch, n)
            return True
        if policy is OverflowPolicy.DROP_NEWEST:
            self._drop(batch, n, DropReason.QUEUE_FULL)
            return False
        return None

    def put(self, batch: AnyBatch, deadline: float | None = None) -> bool:
        """Enqueue from any thread; True when accepted.

        ``deadline`` (a ``time.monotonic()`` value) bounds a ``block`` wait together with the
        policy's ``block_timeout_s``; None or a past deadline never waits. Never call with a
        deadline from the loop thread (it would wait on the task that makes room): use
        :meth:`put_async` there.
        """
        n = batch.num_events if isinstance(batch, LAZY_BATCHES) else len(batch.events)
        with self._lock:
            if self._append_if_room(batch, n):
                return True
            decided = self._offer(batch, n)
            if decided is not None:
                return decided
            if deadline is not None and not self._blocked_out:
                now = time.monotonic()
                until = min(deadline, now + self.policy.block_timeout_s)
                self._thread_waiters += 1
                try:
                    while not self._closed and not self._fits(n) and now < until:
                        self._not_full.wait(until - now)
                        now = time.monotonic()
                finally:
                    self._thread_waiters -= 1
                decided = self._offer(batch, n)
                if decided is not None:
                    return decided
                self._blocked_out = True  # waited in vain: do not wait again until progress
            self._drop(batch, n, DropReason.BLOCK_TIMEOUT)
            return False

    def _append_if_room(self, batch: AnyBatch, n: int) -> bool:
        # The common case of put/offer, under the lock: room in the queue (or an empty one).
        items = self._items
        if self._closed or (
            items and (len(items) >= self._max_batches or self._events + n > self._max_events)
        ):
            return False
        items.append(batch)
        self._events += n
        c = self.counters
        c.batches_in += 1
        c.events_in += n
        if self._consumer_waiting and (
            len(items) >= self._want_batches or self._events >= self._want_events
        ):
            self._signal()
        return True

    def offer(self, batch: AnyBatch, n: int) -> bool | None:
        """Enqueue ``batch`` (``n`` events) if that needs no waiting: True/False when decided
        (accepted/dropped, as :meth:`put` decides), None when a ``block`` queue is full (then
        :meth:`put_async` waits for room). Never waits; any thread."""
        with self._lock:
            if self._append_if_room(batch, n):
                return True
            return self._offer(batch, n)

    def deliver_now(
        self, export: Callable[[Sequence[EventBatch]], bool], batch: EventBatch, n: int
    ) -> bool:
        """Hand ``batch`` (``n`` events) straight to the sink when the sink task waits for work
        with nothing queued and no lost markers owed (it would be the next and only thing the
        task exports): ``export((batch,))`` (a synchronous export that returns False, having
        done nothing, when it cannot take the batch without waiting) and, when it took it,
        count the batch as accepted, delivered and settled, as a one-batch chunk through the
        queue would be. The check, the export and the counts happen under the queue's lock,
        so no batch is offered in between. False, having done nothing, otherwise (then queue
        it). See :meth:`~kvstream.pipeline.worker.SinkWorker.deliver_now`."""
        with self._lock:
            if (
                not self._consumer_waiting
                or self._items
                or self.ledger
                or self._closed
                or not export((batch,))
            ):
                return False
            c = self.counters
            c.batches_in += 1
            c.events_in += n
            c.batches_out += 1
            c.events_out += n
            c.settled_batches += 1
            self._marker_not_before = 0.0
            self._refused = False
            return True

    async def put_async(self, batch: AnyBatch, timeout_s: float | None = None) -> bool:
        """Enqueue from a coroutine on the sink task's loop; ``block`` waits without blocking
        the loop, up to ``min(timeout_s, block_timeout_s)``."""
        n = batch_len(batch)
        wait = (
            self.policy.block_timeout_s
            if timeout_s is None
            else min(timeout_s, self.policy.block_timeout_s)
        )
        until = time.monotonic() + wait
        while True:
            with self._lock:
                decided = self._offer(batch, n)
                if decided is not None:
                    return decided
                remaining = until - time.monotonic()
                if remaining <= 0 or self._blocked_out or self._space is None:
                    self._blocked_out = self._blocked_out or wait > 0
                    self._drop(batch, n, DropReason.BLOCK_TIMEOUT)
                    return False
                space = self._space
                space.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(space.wait(), remaining)

    # -------------------------------------------------------------------------- consumer

    def set_urgent(self, delta: int) -> None:
        """Flush/close in progress (> 0): take chunks without lingering."""
        with self._lock:
            self._urgent += delta
            if self._urgent > 0 and self._consumer_waiting:
                self._signal()

    def close(self) -> None:
        """Stop accepting batches; waiting producers give up and the consumer drains."""
        with self._lock:
            self._closed = True
            self._urgent += 1
            self._not_full.notify_all()
            if self._space is not None and self.on_loop_thread():
                self._space.set()
            self._signal()

    def _ready(self, now: float) -> bool:
        return bool(self._items) or (bool(self.ledger) and now >= self._marker_not_before)

    async def get_chunk(self) -> Chunk | None:
        """Wait for work and take the next chunk; None once closed and nothing is left.

        Lingers up to ``linger_s`` for a full chunk unless a flush or close is in progress.
        Once closed with no batch left, markers still owed are offered again only if the
        last export did not fail permanently: the sink said retrying cannot help (e.g. the
        vllm sink refusing a source it cannot publish), so close does not wait out its
        deadline on them; they stay pending (``lost_pending_ids``).
        """
        assert self._wakeup is not None, "attach() first"
        wakeup = self._wakeup
        pol = self.policy
        while True:
            with self._lock:
                now = time.monotonic()
                if self._closed and not self._items and (not self.ledger or self._refused):
                    return None
                if self._ready(now):
                    break
                self._want_batches = self._want_events = 1
                self._consumer_waiting = True
                wakeup.clear()
                timeout = (self._marker_not_before - now) if self.ledger else None
            if timeout is None:
                await wakeup.wait()
            else:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), max(timeout, 0.0))
        if pol.linger_s > 0:
            until = time.monotonic() + pol.linger_s
            while True:
                with self._lock:
                    remaining = until - time.monotonic()
                    if (
                        remaining <= 0
                        or self._urgent
                        or len(self._items) >= pol.max_export_batches
                        or self._events >= pol.max_export_events
                    ):
                        break
                    self._want_batches = pol.max_export_batches
                    self._want_events = pol.max_export_events
                    self._consumer_waiting = True
                    wakeup.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), remaining)
        return self._take()

    def _take(self) -> Chunk:
        pol = self.policy
        max_batches, max_events = pol.max_export_batches, pol.max_export_events
        out: list[AnyBatch] = []
        markers: list[int] = []
        data_batches = data_events = marker_events = 0
        with self._lock:
            self._consumer_waiting = False
            items, ledger = self._items, self.ledger
            gaps_pending = bool(ledger)
            now_ns = self._clock.time_ns() if gaps_pending else 0
            popleft, append = items.popleft, out.append
            while items and data_batches < max_batches:
                b = items[0]
                n = batch_len(b)
                if data_batches and data_events + n > max_events:
                    break
                popleft()
                if gaps_pending:
                    first = batch_first_id(b)
                    if first is not None:
                        gaps = ledger.take_before(b.source, first)
                        if gaps:
                            markers.append(len(out))
                            append(make_marker_batch(b.source, gaps, now_ns))
                            marker_events += len(gaps)
                append(b)
                data_batches += 1
                data_events += n
            self._events -= data_events
            if gaps_pending and ledger and time.monotonic() >= self._marker_not_before:
                waiting = {b.source for b in items}
                for source in ledger.sources():
                    if source not in waiting:
                        gaps = ledger.take_all(source)
                        markers.append(len(out))
                        append(make_marker_batch(source, gaps, now_ns))
                        marker_events += len(gaps)
            if data_batches:
                self._space_freed()
        return Chunk(
            out,
            data_batches,
            data_events,
            marker_events,
            frozenset(markers) if markers else _NO_POSITIONS,
        )

    # ------------------------------------------------------------------- sink task results

    def delivered(self, chunk: Chunk) -> None:
        """The sink accepted ``chunk``."""
        with self._lock:
            c = self.counters
            c.batches_out += chunk.data_batches
            c.events_out += chunk.data_events
            c.markers_out += chunk.marker_events
            c.settled_batches += chunk.data_batches
            self._marker_not_before = 0.0
            self._refused = False

    def failed(
        self,
        chunk: Chunk,
        reason: str,
        marker_backoff_s: float,
        *,
        delivered: Collection[int] = _NO_POSITIONS,
        unknown: Collection[int] = _NO_POSITIONS,
    ) -> None:
        """``chunk`` is given up for ``reason``: count it and put its ids in the ledger.

        ``delivered`` are positions in ``chunk.batches`` the sink did deliver after all
        (counted as out, no marker); ``unknown`` those it cannot tell about (recorded as
        ``unknown``). Markers for the rest are not retried alone before ``marker_backoff_s``
        has passed, so a sink that fails everything is not hammered with marker-only exports.
        """
        lost = LossLedger()
        dropped: dict[str, list[int]] = {}  # reason -> [events, batches]
        out_batches = out_events = out_markers = 0
        by_reason: dict[str, list[AnyBatch]] = {}
        for i, b in enumerate(chunk.batches):
            n = batch_len(b)
            is_marker = i in chunk.markers
            if i in delivered:
                if is_marker:
                    out_markers += n
                else:
                    out_batches += 1
                    out_events += n
                continue
            why = DropReason.UNKNOWN if i in unknown else reason
            if not is_marker:
                count = dropped.setdefault(why, [0, 0])
                count[0] += n
                count[1] += 1
            if n:
                by_reason.setdefault(why, []).append(b)
        for why, given_up in by_reason.items():
            self._record(lost, given_up, why)
        with self._lock:
            c = self.counters
            for why, (n_events, n_batches) in dropped.items():
                c.dropped[why] = c.dropped.get(why, 0) + n_events
                c.dropped_batches[why] = c.dropped_batches.get(why, 0) + n_batches
            c.batches_out += out_batches
            c.events_out += out_events
            c.markers_out += out_markers
            c.settled_batches += chunk.data_batches
            self.ledger.merge(lost)
            self._marker_not_before = time.monotonic() + marker_backoff_s
            self._refused = reason == DropReason.PERMANENT_ERROR

    def _record(
        self,
        lost: LossLedger,
        batches: Sequence[AnyBatch],
        reason: str,
        until: float | None = None,
    ) -> None:
        """Record ``batches`` in ``lost`` (no lock needed): per event while time is left
        before ``until`` (default :attr:`record_until`), then per source from the batches'
        ends only (:meth:`LossLedger.record_coarse`)."""
        until = self.record_until if until is None else until
        clock = time.monotonic
        for i, b in enumerate(batches):
            if until is not None and not i & 15 and clock() > until:
                lost.record_coarse(itertools.islice(batches, i, None), reason)
                return
            if batch_len(b):
                lost.record(b, reason)

    def drain_remaining(self, reason: str, until: float | None = None) -> tuple[int, int]:
        """Drop everything still queued (close's deadline passed); returns (batches, events).

        The queue is emptied under the lock; the drops are recorded outside it and merged
        back, so a producer calling :meth:`put` meanwhile is not held up. Recording is exact
        (per event) until ``until`` (a ``time.monotonic()`` value); what is left then is
        recorded per source from its batches' ends only (:meth:`LossLedger.record_coarse`),
        so a huge queue cannot hold close past its deadline.
        """
        with self._lock:
            items, self._items = self._items, deque()
            events, self._events = self._events, 0
        lost = LossLedger()
        self._record(lost, items, reason, until)
        if not items:
            return 0, 0
        with self._lock:
            c = self.counters
            c.settled_batches += len(items)
            c.dropped[reason] = c.dropped.get(reason, 0) + events
            c.dropped_batches[reason] = c.dropped_batches.get(reason, 0) + len(items)
            self.ledger.merge(lost)
            if lost and self._consumer_waiting:
                self._signal()
        n = len(items)
        # freeing a million event models takes seconds: not on close's clock (one batch per
        # step, so the GIL goes back and forth; deque.clear() would hold it throughout)
        threading.Thread(
            target=_release, args=(items,), name="kvstream-release", daemon=True
        ).start()
        return n, events

    # ------------------------------------------------------------------------ inspection

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def depth(self) -> tuple[int, int]:
        """(batches, events) queued now."""
        return len(self._items), self._events

    def idle(self) -> bool:
        """Nothing queued and no markers pending."""
        with self._lock:
            return not self._items and not self.ledger

    def flushed(self, target: int) -> bool:
        """Every batch accepted before ``counters.batches_in`` was ``target`` is settled, and
        lost markers are out, or will go out in front of batches still queued (so a flush
        under continuous load does not wait for later batches)."""
        with self._lock:
            return self.counters.settled_batches >= target and (
                not self.ledger or bool(self._items)
            )

    def pending_lost_ids(self) -> int:
        """Ids recorded as lost whose markers are not delivered yet."""
        with self._lock:
            return self.ledger.pending_ids()


def _release(items: deque[AnyBatch]) -> None:
    pop = items.pop
    while items:
        pop()
