"""TensorRT-LLM JSON event lists -> :class:`~kvstream.events.model.EventBatch` objects:
:class:`TrtllmEventReader` (the state that matters across successive reads of one engine:
event numbering per rank, the largest window, multimodal items continued across reads) and
:func:`from_trtllm_events` / :func:`from_trtllm_event`. The rules are in
:mod:`kvstream.engines.trtllm`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvstream.clock import SYSTEM_CLOCK, Clock
from kvstream.engines.trtllm_parse import (
    _DEFAULT_MM_STATE_CAPACITY,
    _I32_MAX,
    _I64_MAX,
    RankedEvent,
    TolerantRead,
    _describe,
    _fail,
    _int,
    _make_event,
    _Parser,
    _Pending,
)
from kvstream.errors import ConfigError, EventValidationError, InteropError
from kvstream.events.model import (
    UNBOUNDED_WINDOW,
    EventBatch,
    KVCacheEvent,
    SourceId,
)

__all__ = [
    "TrtllmEventReader",
    "from_trtllm_event",
    "from_trtllm_events",
]


def _event_list(events: Any) -> Sequence[Any]:
    if isinstance(events, (str, bytes, bytearray, Mapping)) or not isinstance(events, Iterable):
        _fail("events", f"expected a list of event objects, got {_describe(events)}")
    return events if isinstance(events, (list, tuple)) else list(events)


def _first_ids(count: int, prev_id: int | None, next_id: int | None) -> int:
    """The first of ``count`` consecutive ids for events without ``event_id`` that follow
    ``prev_id`` (None: nothing before) and precede an event with ``next_id`` (None: none)."""
    low = -1 if prev_id is None else prev_id
    if next_id is not None and next_id - count > low:
        return next_id - count
    return low + 1


class TrtllmEventReader:
    """Reads successive TensorRT-LLM event lists of one engine into :class:`EventBatch` objects.

    One reader per engine process (``instance_id``, ``incarnation``). Each :meth:`read` converts
    one list (one ``get_kv_cache_events()`` result or ``POST /kv_cache_events`` drain). Between
    reads it keeps, per attention-DP rank, the last event id (so events without ``event_id`` are
    numbered on from it, see the module docs); the largest ``window_size`` seen; and,
    LRU-bounded by ``mm_state_capacity``, the most recent multimodal item at the end of each
    multimodal block (so ``mm_keys`` of a block continuing an item can be derived later). State
    changes only when a read succeeds, except the multimodal memory, which holds facts that are
    true whatever happens to the rest of the read. :meth:`numbering_state` /
    :meth:`restore_numbering` save and restore the ids and window (not the multimodal memory).

    Raises :class:`~kvstream.errors.ConfigError` for bad arguments.
    """

    def __init__(
        self,
        *,
        instance_id: str,
        incarnation: int = 0,
        tokens_per_block: int | None = None,
        mm_token_id_offset: int | None = None,
        default_window_size: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
        mm_state_capacity: int = _DEFAULT_MM_STATE_CAPACITY,
    ) -> None:
        self._parser = _Parser(
            tokens_per_block=tokens_per_block,
            mm_token_id_offset=mm_token_id_offset,
            default_window_size=default_window_size,
            mm_state_capacity=mm_state_capacity,
        )
        self._sources: dict[int | None, SourceId] = {}
        try:
            self._sources[None] = SourceId(instance_id=instance_id, incarnation=incarnation)
        except EventValidationError as exc:
            raise ConfigError(f"bad source for TensorRT-LLM events: {exc}") from exc
        self._instance_id = instance_id
        self._incarnation = incarnation
        self._clock = clock
        self._last_ids: dict[int | None, int] = {}
        self._max_window: int | None = None

    def _source(self, rank: int | None) -> SourceId:
        source = self._sources.get(rank)
        if source is None:
            source = SourceId(
                instance_id=self._instance_id, attention_dp_rank=rank, incarnation=self._incarnation
            )
            self._sources[rank] = source
        return source

    def _stamp(self, ts_ns: int | None) -> int:
        if ts_ns is None:
            return self._clock.time_ns()
        if isinstance(ts_ns, bool) or not isinstance(ts_ns, int) or not 0 <= ts_ns <= _I64_MAX:
            raise ConfigError(f"ts_ns must be an int in 0..{_I64_MAX} or None, got {ts_ns!r}")
        return ts_ns

    def numbering_state(self) -> dict[str, Any]:
        """The JSON-able state that numbers events without ``event_id`` and windows markers:
        ``{"last_ids": [[rank, id], ...], "max_window": int | None}`` (rank null: no rank)."""
        return {
            "last_ids": [[rank, event_id] for rank, event_id in self._last_ids.items()],
            "max_window": self._max_window,
        }

    def restore_numbering(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`numbering_state` (e.g. a source resuming from a checkpoint).

        Raises :class:`~kvstream.errors.ConfigError` for a malformed state.
        """
        try:
            pairs = state["last_ids"]
            last_ids: dict[int | None, int] = {}
            for rank, event_id in pairs:
                if rank is not None:
                    _int(rank, "rank", 0, _I32_MAX)
                last_ids[rank] = _int(event_id, "event_id", 0, _I64_MAX)
            window = state.get("max_window")
            max_window = None if window is None else _int(window, "max_window", 1, _I64_MAX)
        except (KeyError, TypeError, ValueError, InteropError) as exc:
            raise ConfigError(f"not a TensorRT-LLM reader numbering state: {state!r}") from exc
        self._last_ids = last_ids
        self._max_window = max_window

    def read(
        self, events: Iterable[Mapping[str, Any]], *, ts_ns: int | None = None
    ) -> list[EventBatch]:
        """Convert one list of TensorRT-LLM event dicts into one batch per attention-DP rank.

        Batches come in the order each rank is first seen (no rank is a source of its own);
        each keeps its rank's events in input order. ``ts_ns`` (default: the clock's wall
        time) stamps every batch. An empty list gives ``[]``.

        Raises :class:`~kvstream.errors.InteropError` naming ``event[i]`` and the field path
        for malformed input; then no batch is returned.
        """
        stamp = self._stamp(ts_ns)
        return self._read(_event_list(events), 0, stamp)

    def read_tolerant(
        self, events: Iterable[Mapping[str, Any]], *, ts_ns: int | None = None
    ) -> TolerantRead:
        """Like :meth:`read`, but a malformed event costs only itself.

        When the whole list converts, this is :meth:`read`. Otherwise each event is read on
        its own (so events without ``event_id`` are numbered without look-ahead) and the
        events that convert are grouped into one batch per rank, in order; each event that
        does not gives one ``InteropError`` naming ``event[i]``. Used by bridges (file sources,
        the in-process pump) that must count bad input and go on.
        """
        stamp = self._stamp(ts_ns)
        try:
            items = _event_list(events)
        except InteropError as exc:
            return TolerantRead([], [exc])
        try:
            return TolerantRead(self._read(items, 0, stamp), [])
        except InteropError:
            pass
        per_rank: dict[int | None, list[KVCacheEvent]] = {}
        errors: list[InteropError] = []
        for i, raw in enumerate(items):
            try:
                for batch in self._read([raw], i, stamp):
                    per_rank.setdefault(batch.source.attention_dp_rank, []).extend(batch.events)
            except InteropError as exc:
                errors.append(exc)
        batches = [
            EventBatch(source=self._source(rank), ts_ns=stamp, events=tuple(evs))
            for rank, evs in per_rank.items()
        ]
        return TolerantRead(batches, errors)

    def _read(self, items: Sequence[Any], base: int, stamp: int) -> list[EventBatch]:
        parsed = [
            self._parser.parse(raw, f"event[{base + i}]", allow_pending=True)
            for i, raw in enumerate(items)
        ]
        if not parsed:
            return []
        # TensorRT-LLM's fan-out stamps rank 0 on its all_cleared marker even when the engine
        # runs without attention DP (its events carry no rank): the marker is then the rank-less
        # source's.
        ranks = {p.rank for p in parsed if not p.marker}.union(self._last_ids)
        marker_rank_zero_is_none = None in ranks and 0 not in ranks
        per_rank: dict[int | None, list[KVCacheEvent | _Pending]] = {}
        max_window = self._max_window
        for p in parsed:
            rank = None if p.marker and p.rank == 0 and marker_rank_zero_is_none else p.rank
            per_rank.setdefault(rank, []).append(p.event)
            window = p.window_size
            if window is not None and (max_window is None or window > max_window):
                max_window = window

        batches: list[EventBatch] = []
        last_ids: dict[int | None, int] = {}
        for rank, pending in per_rank.items():
            resolved = self._resolve(pending, self._last_ids.get(rank), max_window)
            last_ids[rank] = resolved[-1].event_id
            batches.append(
                EventBatch(source=self._source(rank), ts_ns=stamp, events=tuple(resolved))
            )
        self._last_ids.update(last_ids)
        self._max_window = max_window
        return batches

    @staticmethod
    def _resolve(
        events: list[KVCacheEvent | _Pending], prev_id: int | None, max_window: int | None
    ) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        j = 0
        while j < len(events):
            ev = events[j]
            if isinstance(ev, KVCacheEvent):
                out.append(ev)
                prev_id = ev.event_id
                j += 1
                continue
            k = j
            if ev.event_id is None:  # a run of events without ids, up to the next id
                while (
                    k < len(events)
                    and isinstance(events[k], _Pending)
                    and events[k].event_id is None
                ):
                    k += 1
                next_id = events[k].event_id if k < len(events) else None
                first = _first_ids(k - j, prev_id, next_id)
            else:  # a marker with an id but no window
                k, first = j + 1, ev.event_id
            for n, pending in enumerate(events[j:k]):
                assert isinstance(pending, _Pending)
                window = pending.window_size
                if window is None:  # all_cleared: the fan-out forwards the largest window
                    window = UNBOUNDED_WINDOW if max_window is None else max_window
                out.append(
                    _make_event(
                        pending.path,
                        event_id=first + n,
                        hash_algo=pending.hash_algo,
                        layer_group_id=pending.layer_group_id,
                        window_size=window,
                        data=pending.data,
                    )
                )
            prev_id = out[-1].event_id
            j = k
        return out


def from_trtllm_events(
    events: Iterable[Mapping[str, Any]],
    *,
    instance_id: str,
    incarnation: int = 0,
    ts_ns: int | None = None,
    tokens_per_block: int | None = None,
    mm_token_id_offset: int | None = None,
    default_window_size: int | None = None,
) -> list[EventBatch]:
    """Convert TensorRT-LLM event dicts (``LLM.get_kv_cache_events()``, ``POST
    /kv_cache_events``) into one :class:`EventBatch` per attention-DP rank.

    Batches come in the order each rank is first seen, with ``attention_dp_rank`` absent/null
    as one more source without rank; each keeps its rank's events in input order. Every batch
    gets ``SourceId(instance_id, rank, incarnation)`` and ``ts_ns`` (default: now).
    ``tokens_per_block`` is required when the list holds ``created`` events;
    ``mm_token_id_offset`` when it holds V2 multimodal (hex) tokens; ``default_window_size``
    is the window of events without ``window_size``. A one-shot :class:`TrtllmEventReader`:
    use a reader to keep state (event numbering, multimodal items) across successive lists.
    See the module docs for every rule.

    Raises :class:`~kvstream.errors.InteropError` (location-prefixed) for malformed input and
    :class:`~kvstream.errors.ConfigError` for bad arguments.
    """
    reader = TrtllmEventReader(
        instance_id=instance_id,
        incarnation=incarnation,
        tokens_per_block=tokens_per_block,
        mm_token_id_offset=mm_token_id_offset,
        default_window_size=default_window_size,
    )
    return reader.read(events, ts_ns=ts_ns)


def from_trtllm_event(
    event: Mapping[str, Any],
    *,
    tokens_per_block: int | None = None,
    mm_token_id_offset: int | None = None,
    default_window_size: int | None = None,
) -> RankedEvent:
    """Convert one TensorRT-LLM event dict into ``(attention_dp_rank, KVCacheEvent)``.

    Same rules as :func:`from_trtllm_events`, except that nothing is inferred from other
    events: the event must carry its ``event_id`` (one event alone has no stream to number it
    in), an ``all_cleared`` marker without ``window_size`` gets ``default_window_size`` else
    :data:`~kvstream.events.model.UNBOUNDED_WINDOW`, and multimodal items continued from an
    ancestor block cannot be resolved unless the block lists its ``mm_keys``. Errors are
    located under ``event``.
    """
    parser = _Parser(
        tokens_per_block=tokens_per_block,
        mm_token_id_offset=mm_token_id_offset,
        default_window_size=default_window_size,
        mm_state_capacity=0,
    )
    parsed = parser.parse(event, "event", allow_pending=False)
    assert isinstance(parsed.event, KVCacheEvent)  # allow_pending=False never defers
    return RankedEvent(parsed.rank, parsed.event)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------
