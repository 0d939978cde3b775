"""Deferred event batches: hand raw records over now, build the pydantic models later.

Building and validating an :class:`~kvstream.events.model.EventBatch` costs a few
microseconds per block, too much for the engine thread. :meth:`EventEmitter.take_deferred
<kvstream.events.emitter.EventEmitter.take_deferred>` therefore swaps the emitter's buffer out
(O(1), no per-event work) into a :class:`DeferredBatch`, which the engine thread hands to the
pipeline like a batch; the first consumer that needs the models calls :meth:`~DeferredBatch.
materialize`, which builds and validates the ``EventBatch`` exactly once and caches it, so every
sink shares one set of models.

The cheap metadata (``source``, ``ts_ns``, ``num_events``, ``first_event_id``,
``last_event_id`` and :meth:`~DeferredBatch.spans`) is read from the raw records without
building anything, so a pipeline can count, order and drop a deferred batch (and account for
its ids in ``lost`` markers) without ever materialising it.

Thread safety: a ``DeferredBatch`` is immutable from the outside; :meth:`~DeferredBatch.
materialize` may be called from any thread, concurrently, and builds the batch once; the
metadata and :meth:`~DeferredBatch.spans` never wait on it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Final, TypeAlias

from kvstream._types import TokenIds
from kvstream.events.columns import ColumnBatch, publish_columns
from kvstream.events.model import (
    CURRENT_SCHEMA_VERSION,
    DEFAULT_HASH_ALGO,
    EventBatch,
    KVCacheEvent,
    Lost,
    SourceId,
)

__all__ = ["LAZY_BATCHES", "AnyBatch", "BlockRun", "DeferredBatch", "EventSpan", "model_input"]

#: ``(first id, last id, hash_algo, layer_group_id, window_size)`` of one event: the inclusive
#: id range it stands for (a ``lost`` marker's whole range, else its own id) and its group.
EventSpan: TypeAlias = tuple[int, int, str, int, int]

_EMPTY: Final[tuple[dict[str, Any], ...]] = ()
# Serialises materialisation (of any batch): a batch is built once even when several threads
# ask at the same time. Sink tasks share one loop thread, so it is all but never contended.
_BUILD_LOCK: Final = threading.Lock()


class BlockRun:
    """The blocks of one buffered ``stored`` event, as the emitter records them: parallel
    lists (appending a block costs two list appends, a chain of blocks two list extends) and,
    sparsely, the extra fields of blocks that have any. Expanded into the per-block dicts the
    model validates only when the batch is materialised (:func:`model_input`).

    The emitter appends while the event is its group's coalescing target and never touches
    the run once the event is taken.
    """

    __slots__ = ("attrs", "hashes", "tokens")

    def __init__(self) -> None:
        self.hashes: list[bytes] = []
        #: The blocks' tokens, in order: a TokenIds for one block, or (packed TokenIds, k)
        #: for k consecutive blocks of equal length.
        self.tokens: list[TokenIds | tuple[TokenIds, int]] = []
        #: block index -> its fields other than block_hash/token_ids (cache_level, priority,
        #: lora_id, ...), for the blocks that have any; the dicts may be shared, never mutated.
        self.attrs: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.hashes)

    def block_tokens(self) -> list[TokenIds]:
        """One TokenIds per block (packed runs cut into blocks)."""
        out: list[TokenIds] = []
        for t in self.tokens:
            if isinstance(t, tuple):
                packed, k = t
                out += _cut(packed.raw, k)
            else:
                out.append(t)
        return out

    def dicts(self) -> list[dict[str, Any]]:
        """One dict per block, as :class:`~kvstream.events.model.StoredBlock` validates it."""
        attrs = self.attrs
        tokens = self.block_tokens()
        if not attrs:
            return [
                {"block_hash": h, "token_ids": t} for h, t in zip(self.hashes, tokens, strict=True)
            ]
        get = attrs.get
        out: list[dict[str, Any]] = []
        for i, (h, t) in enumerate(zip(self.hashes, tokens, strict=True)):
            a = get(i)
            if a is None:
                out.append({"block_hash": h, "token_ids": t})
            else:
                out.append({**a, "block_hash": h, "token_ids": t})
        return out


def _cut(raw: bytes, k: int) -> list[TokenIds]:
    # k TokenIds of equal length from packed ids (valid by construction: skip from_bytes's
    # copy and checks, a third of the cost of a materialised block's tokens).
    step = len(raw) // k
    new = TokenIds.__new__
    out: list[TokenIds] = []
    for i in range(0, step * k, step):
        t = new(TokenIds)
        t._raw = raw[i : i + step]
        out.append(t)
    return out


def model_input(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records as :class:`~kvstream.events.model.KVCacheEvent` validates them: a
    ``stored`` event's :class:`BlockRun` expanded into a list of block dicts (new dicts; the
    records are left as they are). Anything else passes through unchanged."""
    out: list[dict[str, Any]] = []
    append = out.append
    for rec in records:
        data = rec["data"]
        blocks = data.get("blocks")
        if type(blocks) is BlockRun:
            append({**rec, "data": {**data, "blocks": blocks.dicts()}})
        else:
            append(rec)
    return out


def _record_span(rec: dict[str, Any]) -> tuple[int, int]:
    eid: int = rec["event_id"]
    data = rec["data"]
    if data.get("type") == "lost":
        first: int = data["first_event_id"]
        return min(first, eid), max(first + data["count"] - 1, eid)
    return eid, eid


def _event_span(ev: KVCacheEvent) -> tuple[int, int]:
    data = ev.data
    if isinstance(data, Lost):
        first = data.first_event_id
        return min(first, ev.event_id), max(first + data.count - 1, ev.event_id)
    return ev.event_id, ev.event_id


class DeferredBatch:
    """One source's events as raw records, materialised into an :class:`EventBatch` on demand.

    Made by :meth:`EventEmitter.take_deferred
    <kvstream.events.emitter.EventEmitter.take_deferred>`, which hands its records over
    (ownership passes to the batch: nobody mutates them afterwards). ``records`` are event
    dicts as :class:`~kvstream.events.model.KVCacheEvent` validates them, in id order, except
    that a ``stored`` event's ``blocks`` may be a :class:`BlockRun` (see :func:`model_input`).
    :meth:`materialize` returns exactly what :meth:`EventEmitter.take
    <kvstream.events.emitter.EventEmitter.take>` would have returned at the same moment.
    """

    __slots__ = ("_batch", "_ids", "_ids_known", "_n", "_records", "_source", "_ts_ns")

    def __init__(self, source: SourceId, ts_ns: int, records: Sequence[dict[str, Any]]) -> None:
        # The engine thread builds one per iteration: keep it to a few attribute stores.
        self._source = source
        self._ts_ns = ts_ns
        self._records = records
        self._n = len(records)
        self._ids: tuple[int, int] | None = None  # (first id, last id), computed on first use
        self._ids_known = False
        self._batch: EventBatch | None = None

    # ------------------------------------------------------------------ cheap metadata

    @property
    def source(self) -> SourceId:
        """The producer (as :attr:`EventBatch.source`)."""
        return self._source

    @property
    def ts_ns(self) -> int:
        """When the batch was taken (as :attr:`EventBatch.ts_ns`)."""
        return self._ts_ns

    @property
    def schema_version(self) -> int:
        """The schema version the materialised batch will carry."""
        return CURRENT_SCHEMA_VERSION

    @property
    def num_events(self) -> int:
        """How many events (a ``lost`` marker included) the batch holds."""
        return self._n

    @property
    def first_event_id(self) -> int | None:
        """The lowest id the batch covers (a leading marker's range start); None if empty."""
        bounds = self._bounds()
        return None if bounds is None else bounds[0]

    @property
    def last_event_id(self) -> int | None:
        """The highest id the batch covers (its last event's id); None if empty."""
        bounds = self._bounds()
        return None if bounds is None else bounds[1]

    def _bounds(self) -> tuple[int, int] | None:
        # (first id, last id), computed on first use (the events are in id order).
        if not self._ids_known:
            bounds: tuple[int, int] | None = None
            records = self._records
            if records:
                bounds = _record_span(records[0])[0], _record_span(records[-1])[1]
            elif self._n:
                assert self._batch is not None  # set before the records were released
                events = self._batch.events
                bounds = _event_span(events[0])[0], _event_span(events[-1])[1]
            self._ids = bounds
            self._ids_known = True
        return self._ids

    @property
    def materialized(self) -> bool:
        """True once :meth:`materialize` has built the batch."""
        return self._batch is not None

    def spans(self) -> Iterator[EventSpan]:
        """Per event, in order: the id range it stands for and its group (see
        :data:`EventSpan`), read from the raw records (or the models once built); never
        materialises and never waits."""
        # _batch is set before _records is released, so reading in this order always finds
        # one of them complete.
        records = self._records
        if records or not self._n:
            for rec in records:
                lo, hi = _record_span(rec)
                yield (
                    lo,
                    hi,
                    rec.get("hash_algo", DEFAULT_HASH_ALGO),
                    rec.get("layer_group_id", 0),
                    rec["window_size"],
                )
            return
        batch = self._batch
        assert batch is not None
        for ev in batch.events:
            lo, hi = _event_span(ev)
            yield lo, hi, ev.hash_algo, ev.layer_group_id, ev.window_size

    # ------------------------------------------------------------------ materialisation

    def materialize(self) -> EventBatch:
        """The :class:`EventBatch`, built and validated on the first call, then cached.

        Thread-safe: concurrent callers wait for one build and get the same object. The raw
        records are released once built. A validation error (never expected for an emitter's
        records) propagates and leaves the batch unmaterialised.
        """
        batch = self._batch
        if batch is not None:
            return batch
        with _BUILD_LOCK:
            batch = self._batch
            if batch is None:
                batch = EventBatch(
                    source=self._source, ts_ns=self._ts_ns, events=model_input(self._records)
                )
                self._batch = batch
                self._records = _EMPTY
            return batch

    def columns(self) -> ColumnBatch:
        """The batch as publisher columns, built from the raw records without the models
        (:func:`~kvstream.events.deferred_columns.deferred_columns`: equal to
        ``publish_columns(self.materialize())``, or exactly that once materialised). Their
        ``to_batch`` is :meth:`materialize`, so every reader shares one set of models.

        New columns on every call (cheap: no object per block): caching them here would make
        a reference cycle (columns -> this batch's ``materialize`` -> columns) that only the
        cyclic garbage collector could free. Thread-safe like :meth:`materialize`."""
        batch = self._batch
        if batch is not None:
            return publish_columns(batch)
        records = self._records  # (a concurrent materialize releases them, never mutates)
        if not records and self._n:
            return publish_columns(self.materialize())
        from kvstream.events.deferred_columns import deferred_columns  # (imports this module)

        return deferred_columns(self._source, self._ts_ns, records, self.materialize)

    def __repr__(self) -> str:
        state = "materialized" if self._batch is not None else "deferred"
        bounds = self._bounds()
        ids = "" if bounds is None else f" ids {bounds[0]}..{bounds[1]}"
        return (
            f"DeferredBatch({self._source.instance_id!r} rank={self._source.attention_dp_rank}"
            f", {self._n} events{ids}, {state})"
        )


#: What a pipeline accepts: a built batch, or one whose models are built on demand (a
#: deferred emitter batch, or an engine bridge's :class:`~kvstream.events.columns.ColumnBatch`).
AnyBatch: TypeAlias = EventBatch | DeferredBatch | ColumnBatch
#: The batch types whose models are built on demand (same metadata API: ``source``,
#: ``num_events``, ``first_event_id``, ``last_event_id``, ``spans()``, ``materialize()``).
LAZY_BATCHES: Final = (DeferredBatch, ColumnBatch)
