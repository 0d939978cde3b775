"""The loss ledger: which event ids a sink's stream is missing, and the ``lost`` markers for them.

When a batch is dropped for a sink, the ids it covered are recorded here per source (the full
:class:`SourceId`, so incarnations stay apart). Before that sink next delivers a batch of the
same source, a marker batch is put in front of it covering every recorded id below the batch's
first id; a source with nothing else queued gets a standalone marker batch.

Marker id rule (shared with the emitter): a marker covers the contiguous id range
``[first_event_id, first_event_id + count)`` and its own ``event_id`` is the *last* id of the
range, so the ids a consumer sees stay contiguous (each id once, as an event or inside a
marker's range). Adjacent or overlapping ranges of one source merge, and a dropped batch that
itself carried markers re-enters the ledger as the ranges those markers covered.

Batches may be :class:`~kvstream.events.deferred.DeferredBatch` objects: their ids and groups
are read from the raw records (:meth:`~kvstream.events.deferred.DeferredBatch.spans`), so a
dropped deferred batch is accounted for exactly without ever being materialised.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from kvstream.events.deferred import LAZY_BATCHES, AnyBatch, EventSpan
from kvstream.events.model import EventBatch, KVCacheEvent, Lost, SourceId

__all__ = [
    "Gap",
    "LossLedger",
    "batch_first_id",
    "batch_last_id",
    "batch_len",
    "batch_spans",
    "event_span",
    "make_marker_batch",
]

_MAX_REASON = 1024


def event_span(event: KVCacheEvent) -> tuple[int, int]:
    """The inclusive id range an event stands for: its own id, or a marker's whole range."""
    data = event.data
    if isinstance(data, Lost):
        first = min(data.first_event_id, event.event_id)
        return first, max(data.first_event_id + data.count - 1, event.event_id)
    return event.event_id, event.event_id


def batch_first_id(batch: AnyBatch) -> int | None:
    """The lowest id a batch covers (None for an empty batch); O(1), never materialises."""
    if isinstance(batch, LAZY_BATCHES):
        return batch.first_event_id
    if not batch.events:
        return None
    return event_span(batch.events[0])[0]


def batch_last_id(batch: AnyBatch) -> int:
    """The highest id a non-empty batch covers (events are in id order); O(1)."""
    if isinstance(batch, LAZY_BATCHES):
        last = batch.last_event_id
        assert last is not None
        return last
    return event_span(batch.events[-1])[1]


def batch_len(batch: AnyBatch) -> int:
    """How many events a batch holds (markers included); O(1), never materialises."""
    if isinstance(batch, LAZY_BATCHES):
        return batch.num_events
    return len(batch.events)


def batch_spans(batch: AnyBatch) -> Iterator[EventSpan]:
    """Per event: its inclusive id range and group fields; never materialises."""
    if isinstance(batch, LAZY_BATCHES):
        return batch.spans()
    return (
        (*event_span(ev), ev.hash_algo, ev.layer_group_id, ev.window_size) for ev in batch.events
    )


@dataclass(slots=True)
class Gap:
    """A contiguous run ``first..last`` (inclusive) of ids missing from one source's stream."""

    first: int
    last: int
    reasons: list[str]
    hash_algo: str
    layer_group_id: int
    window_size: int
    schema_version: int

    @property
    def count(self) -> int:
        """How many ids the gap covers."""
        return self.last - self.first + 1

    def absorb(self, other: Gap) -> None:
        """Merge an adjacent or overlapping gap into this one. The marker's group fields are
        those of the last dropped event (as the emitter's)."""
        if other.last > self.last:
            self.hash_algo = other.hash_algo
            self.layer_group_id = other.layer_group_id
            self.window_size = other.window_size
        self.first = min(self.first, other.first)
        self.last = max(self.last, other.last)
        for r in other.reasons:
            if r not in self.reasons:
                self.reasons.append(r)

    def to_event(self) -> KVCacheEvent:
        """The ``lost`` marker event for this gap (its id is the gap's last id)."""
        reason = ",".join(self.reasons)[:_MAX_REASON] or "dropped"
        return KVCacheEvent(
            event_id=self.last,
            hash_algo=self.hash_algo,
            layer_group_id=self.layer_group_id,
            window_size=self.window_size,
            data=Lost(first_event_id=self.first, count=self.count, reason=reason),
        )


def _runs(batch: AnyBatch, reason: str) -> Iterator[Gap]:
    """The batch's events as maximal contiguous id runs."""
    cur: Gap | None = None
    for lo, hi, hash_algo, layer_group_id, window_size in batch_spans(batch):
        if cur is not None and cur.last + 1 >= lo and hi >= cur.first:
            if hi > cur.last:
                cur.hash_algo, cur.layer_group_id = hash_algo, layer_group_id
                cur.window_size = window_size
            cur.first = min(cur.first, lo)
            cur.last = max(cur.last, hi)
            continue
        if cur is not None:
            yield cur
        cur = Gap(
            first=lo,
            last=hi,
            reasons=[reason],
            hash_algo=hash_algo,
            layer_group_id=layer_group_id,
            window_size=window_size,
            schema_version=batch.schema_version,
        )
    if cur is not None:
        yield cur


@dataclass(slots=True)
class LossLedger:
    """Missing id ranges per source, kept sorted and merged. Not thread-safe by itself."""

    _gaps: dict[SourceId, list[Gap]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self._gaps)

    def record(self, batch: AnyBatch, reason: str) -> None:
        """Record every id ``batch`` covers as missing, for ``reason`` (a deferred batch is
        read from its raw records, never materialised)."""
        for gap in _runs(batch, reason):
            self._insert(batch.source, gap)

    def record_coarse(self, batches: Iterable[AnyBatch], reason: str) -> None:
        """Record ``batches`` as one range per source, from the lowest first id to the highest
        last id, reading only each batch's ends (O(batches), not O(events)). Exact when each
        source's ids are contiguous across the batches (the emitter's guarantee: consecutive
        ids per source, events in id order); for close's deadline, when exact recording of a
        huge queue would not fit."""
        # keyed by the source object (hashing a pydantic model per batch costs more than the
        # rest); equal sources held as distinct objects merge in _insert
        ends: dict[int, tuple[int, int, AnyBatch]] = {}
        for b in batches:
            first = batch_first_id(b)
            if first is None:
                continue
            last = batch_last_id(b)
            key = id(b.source)
            cur = ends.get(key)
            if cur is None:
                ends[key] = (first, last, b)
            else:
                lo, hi, top = cur
                ends[key] = (min(lo, first), max(hi, last), b if last >= hi else top)
        for lo, hi, top in ends.values():
            *_, (_, _, hash_algo, layer_group_id, window_size) = batch_spans(top)
            gap = Gap(lo, hi, [reason], hash_algo, layer_group_id, window_size, top.schema_version)
            self._insert(top.source, gap)

    def merge(self, other: LossLedger) -> None:
        """Add every gap of ``other`` (built elsewhere, e.g. outside a lock) to this ledger."""
        for source, gaps in other._gaps.items():
            for gap in gaps:
                self._insert(source, gap)

    def _insert(self, source: SourceId, gap: Gap) -> None:
        gaps = self._gaps.setdefault(source, [])
        if gaps and gaps[-1].last + 1 >= gap.first and gap.last + 1 >= gaps[-1].first:
            gaps[-1].absorb(gap)  # the common case: the run right after the previous drop
            self._merge_back(gaps, len(gaps) - 1)
            return
        i = bisect.bisect_left([g.first for g in gaps], gap.first)
        gaps.insert(i, gap)
        if i > 0 and gaps[i - 1].last + 1 >= gap.first:
            gaps[i - 1].absorb(gap)
            del gaps[i]
            i -= 1
        while i + 1 < len(gaps) and gaps[i].last + 1 >= gaps[i + 1].first:
            gaps[i].absorb(gaps.pop(i + 1))

    @staticmethod
    def _merge_back(gaps: list[Gap], i: int) -> None:
        while i > 0 and gaps[i - 1].last + 1 >= gaps[i].first:
            gaps[i - 1].absorb(gaps.pop(i))
            i -= 1

    def sources(self) -> list[SourceId]:
        """Sources with missing ids."""
        return list(self._gaps)

    def take_before(self, source: SourceId, first_id: int) -> list[Gap]:
        """Remove and return ``source``'s gaps that end before ``first_id``."""
        gaps = self._gaps.get(source)
        if not gaps or gaps[0].last >= first_id:
            return []
        n = 0
        while n < len(gaps) and gaps[n].last < first_id:
            n += 1
        taken, rest = gaps[:n], gaps[n:]
        if rest:
            self._gaps[source] = rest
        else:
            del self._gaps[source]
        return taken

    def take_all(self, source: SourceId) -> list[Gap]:
        """Remove and return every gap of ``source``."""
        return self._gaps.pop(source, [])

    def pending_ids(self) -> int:
        """How many ids the ledger holds for all sources together."""
        return sum(g.count for gaps in self._gaps.values() for g in gaps)

    def gaps(self) -> dict[SourceId, list[Gap]]:
        """A copy of the ledger (for reports and tests)."""
        return {s: list(g) for s, g in self._gaps.items()}


def make_marker_batch(source: SourceId, gaps: Iterable[Gap], ts_ns: int) -> EventBatch:
    """A batch of ``lost`` markers, one per gap, in id order."""
    gap_list = list(gaps)
    return EventBatch(
        source=source,
        ts_ns=ts_ns,
        schema_version=gap_list[0].schema_version,
        events=tuple(g.to_event() for g in gap_list),
    )
