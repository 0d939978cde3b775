"""What every event source gives a consumer: decoded batches, resumable positions, counters.

A source yields :class:`SourceItem` objects (a batch and the ids of events the decoder had to
leave out of it) in stream order. After each item, :meth:`EventSource.checkpoint` is the
JSON-able position just past it: store it with the index state the item produced (a
snapshot) and a new source built with ``resume_from=checkpoint`` continues after it.
:meth:`EventSource.commit` tells the stream (Kafka consumer groups) that everything up to a
checkpoint is safely stored; call it only after the snapshot holding that checkpoint is
written.

Malformed input (bytes that do not decode, a corrupt file block) is skipped, counted in
``stats.malformed``, logged with its position, and remembered in ``recent_malformed``; the
source keeps going.
"""

from __future__ import annotations

import abc
import functools
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final

from kvstream.events.columns import ColumnBatch
from kvstream.events.model import EventBatch

if TYPE_CHECKING:  # the codec (fastavro, numpy) loads with the first Avro message
    from kvstream.codec import AvroCodec, SkippedEvent
    from kvstream.codec.columnar import ColumnarResult

__all__ = [
    "EventSource",
    "Malformed",
    "ReadStats",
    "SourceItem",
    "attribute_skipped",
    "decode_message",
    "skipped_ids",
]

log = logging.getLogger("kvstream.index.sources")

#: How many malformed inputs a source remembers (all are counted).
RECENT_MALFORMED: Final = 100


class SourceItem:
    """One decoded batch; ``skipped_ids`` are ids of its events the decoder could not
    represent (pass them to ``PrefixIndex.apply`` so they do not look like a gap).

    Sources that decode bytes hand over the batch's columns (:attr:`columns`, what the index
    applies fastest: ``index.apply(item.data, item.skipped_ids)``); :attr:`batch` is the
    validated event model, built on first access.
    """

    __slots__ = ("_batch", "columns", "count", "skipped_ids")

    def __init__(
        self,
        batch: EventBatch | ColumnBatch,
        skipped_ids: tuple[int, ...] = (),
        count: int = 1,
    ) -> None:
        """``count``: how many of the source's own batches this one holds (an engine source
        reads a drained burst of engine batches into one)."""
        self.columns: ColumnBatch | None
        self._batch: EventBatch | None
        if isinstance(batch, ColumnBatch):
            self.columns, self._batch = batch, None
        else:
            self.columns, self._batch = None, batch
        self.skipped_ids = tuple(skipped_ids)
        self.count = count

    @property
    def batch(self) -> EventBatch:
        """The batch as the event model."""
        if self._batch is None:
            assert self.columns is not None
            self._batch = self.columns.to_batch()
        return self._batch

    @property
    def data(self) -> EventBatch | ColumnBatch:
        """What to apply to an index: the columns when the source decoded some, else the
        model."""
        return self.columns if self.columns is not None else self.batch

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SourceItem):
            return NotImplemented
        return self.batch == other.batch and self.skipped_ids == other.skipped_ids

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SourceItem({self.data!r}, skipped_ids={self.skipped_ids!r})"


@dataclass(frozen=True, slots=True)
class Malformed:
    """A skipped input: where it was (``topic[partition]@offset``, ``file@byte``) and why."""

    where: str
    error: str


@dataclass(slots=True)
class ReadStats:
    """What a source read: ``batches`` yielded, ``malformed`` inputs skipped,
    ``skipped_events`` left out by the decoder, ``torn`` incomplete file tails given up on,
    ``missed`` batches evicted before they were read (memory source)."""

    batches: int = 0
    malformed: int = 0
    skipped_events: int = 0
    torn: int = 0
    missed: int = 0

    def as_dict(self) -> dict[str, int]:
        """Counters by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class EventSource(abc.ABC):
    """An async stream of :class:`SourceItem` with resumable positions (module docstring).

    Use as ``async with source: async for item in source: ...`` or call :meth:`read`.
    """

    #: A short description for logs and reports.
    name: str = "source"

    def __init__(self) -> None:
        self.stats = ReadStats()
        self.recent_malformed: deque[Malformed] = deque(maxlen=RECENT_MALFORMED)
        #: True once the source will yield nothing more.
        self.ended = False

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open connections / files (``read`` calls it when needed)."""

    @abc.abstractmethod
    async def read(self, timeout_s: float | None = None) -> SourceItem | None:
        """The next item; None when none arrived within ``timeout_s`` (None: wait until one
        does) or when the source ended (then :attr:`ended` is True)."""

    def read_ready(self) -> SourceItem | None:
        """The next item when one is ready now, without waiting; None when none is (or the
        source cannot tell: then only :meth:`read` delivers). Items come in the same order
        whichever of the two returns them."""
        return None

    @abc.abstractmethod
    def checkpoint(self) -> dict[str, Any]:
        """The JSON-able position just past the last item returned."""

    async def commit(self, checkpoint: Mapping[str, Any]) -> None:  # noqa: B027 - optional
        """Tell the stream that everything up to ``checkpoint`` is stored (a no-op unless the
        source has a committed position, like a Kafka consumer group)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""

    async def __aenter__(self) -> EventSource:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[SourceItem]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SourceItem]:
        while True:
            item = await self.read(None)
            if item is None:
                if self.ended:
                    return
                continue
            yield item

    def _malformed(self, where: str, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.stats.malformed += 1
        self.recent_malformed.append(Malformed(where, text))
        log.warning("%s: skipping malformed input at %s: %s", self.name, where, text)


@functools.cache
def _columns_decoder() -> Callable[..., ColumnarResult]:
    """``decode_columns_message``, imported on first use (the codec loads fastavro) and kept:
    a function-level import costs microseconds on every message."""
    from kvstream.codec.columnar import decode_columns_message

    return decode_columns_message


def decode_message(
    codec: AvroCodec,
    value: bytes,
    *,
    schema_ids: dict[int, int] | None = None,
    header_version: int | None = None,
) -> ColumnarResult:
    """Decode one message of either framing into columns (the fast path; ``.batch`` builds
    the model): Avro single-object (``C3 01``) or Confluent (``00`` + schema id; the id maps
    to a version through ``schema_ids``, else the version the message's headers state), read
    with ``codec``'s schemas. Raises DecodeError (or UnknownSchemaError)."""
    return _columns_decoder()(
        value,
        codec.registry,
        reader_version=(
            None if codec.reader_version == codec.registry.current.version else codec.reader_version
        ),
        schema_ids=schema_ids or None,
        header_version=header_version,
    )


def attribute_skipped(batch: EventBatch | ColumnBatch, pending: deque[int]) -> tuple[int, ...]:
    """Take from the front of ``pending`` (skipped event ids of a container block, in record
    order) the ids that belong to ``batch``: holes inside its id range, a consecutive run
    just before its first id, and a consecutive run just after its last one, in ascending
    order (a record's skipped events come in id order). A batch with no events takes one
    consecutive run. Ids that fit no batch stay for the next one.

    The codec reports a container block's skipped events for the whole block, not per batch;
    this recovers the per-batch split. Should two batches of one block both fit an id, either
    choice leaves the consumer's id accounting intact when they come from the same worker.
    """
    ids = (
        batch.event_ids if isinstance(batch, ColumnBatch) else [ev.event_id for ev in batch.events]
    )
    own = set(ids)
    taken: list[int] = []
    lo = ids[0] if ids else None
    hi = ids[-1] if ids else None
    while pending:
        x = pending[0]
        if taken and x <= taken[-1]:
            break  # one record's skipped events come in ascending id order
        if lo is None or hi is None:
            ok = not taken or x == taken[-1] + 1
        elif lo <= x <= hi:
            ok = x not in own
        elif x > hi:
            ok = x == hi + 1
        else:  # a leading run x, x+1, ..., lo-1 must come next
            run = lo - x
            ok = run <= len(pending) and all(pending[i] == x + i for i in range(run))
        if not ok:
            break
        pending.popleft()
        taken.append(x)
        if lo is None or hi is None:
            continue
        if x > hi:
            hi = x
        elif x < lo:
            lo = x
    return tuple(taken)


def skipped_ids(skipped: Sequence[SkippedEvent]) -> tuple[int, ...]:
    """The ids of decoder-skipped events."""
    return tuple(s.event_id for s in skipped)
