"""One engine process (instance + DP rank) as one kvstream source.

:class:`EngineStream` turns the :class:`~kvstream.engines.vllm.WireBatch` records an engine
publishes into :class:`~kvstream.events.model.EventBatch`es with the guarantees kvstream's
consumers rely on (DESIGN §2):

- ``event_id`` counts 0, 1, 2, ... per incarnation with no gaps: every engine event becomes
  one kvstream event (consecutive removals of a group become one, as kvstream's emitter
  batches them), and whatever could not be delivered becomes a ``lost`` marker
  that takes the ids of what it stands for (the marker carries the last id of its range);
- an engine event that is malformed becomes a ``lost`` marker naming the reason, so a
  consumer knows its view of the worker may be incomplete instead of silently missing
  blocks;
- :meth:`EngineStream.restart` (the engine's sequence numbers went backwards: it restarted)
  starts a new incarnation, which tells consumers to drop everything the old one announced;
- ``AllBlocksCleared`` becomes a ``cleared`` event for every layer group seen so far;
- a group's window is the ``kv_cache_spec_sliding_window`` its stored events carry
  (remembered for its removals), else :data:`~kvstream.events.model.UNBOUNDED_WINDOW`.

The stream is synchronous and does no I/O; the transport (:mod:`.zmq_sub`) decides when
batches arrive and what was missed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Final

from kvstream._types import PRIORITY_DEFAULT, hash_width
from kvstream.engines import vllm as _vllm
from kvstream.engines.vllm import (
    _EXTERNAL,
    MEDIUM_LEVELS,
    VLLM,
    Dialect,
    WireBatch,
    WireEvent,
    _BadEvent,
    _extra_keys,
    _hash,
    _NotFast,
    _split_tokens,
    _token_layout,
    decode_payload,
)
from kvstream.errors import ConfigError, EventValidationError
from kvstream.events.columns import (
    CLEARED,
    LOST,
    REMOVED,
    STORED,
    ColumnBatch,
    StoredExtra,
    publish_columns,
)
from kvstream.events.model import (
    CURRENT_SCHEMA_VERSION,
    UNBOUNDED_WINDOW,
    Cleared,
    EventBatch,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
)
from kvstream.events.trusted import trusted_builder, trusted_stored_blocks

__all__ = ["ColumnBurst", "EngineStream", "batch_rank", "decode_typed"]

_trusted_event = trusted_builder(KVCacheEvent)
_trusted_stored = trusted_builder(Stored)
_trusted_removed = trusted_builder(Removed)
_trusted_batch = trusted_builder(EventBatch)
_BLOCK_FIELDS: Final = ("block_hash", "token_ids")


def _given_fields() -> tuple[frozenset[str], ...]:
    # index: bit0 cache_level, bit1 lora_id, bit2 lora_name, bit3 cache_salt (given when set)
    names = ("cache_level", "lora_id", "lora_name", "cache_salt")
    return tuple(
        frozenset(_BLOCK_FIELDS + tuple(n for b, n in enumerate(names) if mask >> b & 1))
        for mask in range(16)
    )


#: A stored event's blocks' ``model_fields_set`` by which optional values the engine set.
_GIVEN: Final = _given_fields()


class EngineStream:
    """kvstream batches of one engine instance and DP rank (module docstring for the rules).

    ``hash_algo`` is published in every event (the algorithm the engine hashed with);
    ``clock_ns`` gives incarnation numbers (strictly increasing per stream).
    """

    def __init__(
        self,
        instance_id: str,
        rank: int | None,
        hash_algo: str,
        *,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        if not instance_id:
            raise ConfigError("an engine stream needs a non-empty instance id")
        if not hash_algo:
            raise ConfigError("an engine stream needs a hash_algo")
        self.instance_id = instance_id
        self.rank = rank
        self.hash_algo = hash_algo
        #: Byte width of the algorithm's hashes (None for an algorithm kvstream does not know).
        self.width = hash_width(hash_algo)
        self._clock_ns = clock_ns
        self._windows: dict[int, int] = {}
        self._next_id = 0
        self.source = SourceId(instance_id=instance_id, attention_dp_rank=rank, incarnation=0)
        self.restart()
        #: Events produced, lost markers included; engine events turned into lost markers.
        self.events = 0
        self.malformed_events = 0

    @property
    def next_event_id(self) -> int:
        """The id the next event will get."""
        return self._next_id

    def state(self) -> dict[str, Any]:
        """What :meth:`resume` needs to go on with this incarnation after a process restart
        (a consumer's checkpoint keeps it next to the engine's seq)."""
        return {
            "incarnation": self.source.incarnation,
            "next_id": self._next_id,
            "windows": {str(g): w for g, w in self._windows.items()},
        }

    def resume(self, state: Mapping[str, Any]) -> None:
        """Continue the incarnation of a :meth:`state`: same incarnation, ids on from where
        it stopped, its groups' windows; ConfigError for a malformed state."""
        try:
            incarnation = int(state["incarnation"])
            next_id = int(state["next_id"])
            windows = {int(g): int(w) for g, w in dict(state.get("windows") or {}).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not an engine stream state: {state!r} ({exc})") from None
        if incarnation < 0 or next_id < 0:
            raise ConfigError(f"engine stream state out of range: {state!r}")
        self.source = SourceId(
            instance_id=self.instance_id, attention_dp_rank=self.rank, incarnation=incarnation
        )
        self._next_id = next_id
        self._windows = windows

    def restart(self) -> None:
        """Begin a new incarnation: ids restart at 0, group windows are forgotten."""
        incarnation = max(self._clock_ns(), self.source.incarnation + 1)
        self.source = SourceId(
            instance_id=self.instance_id, attention_dp_rank=self.rank, incarnation=incarnation
        )
        self._next_id = 0
        self._windows.clear()

    def convert(self, wire: WireBatch) -> EventBatch:
        """The kvstream batch of one engine batch (possibly with no events).

        Consecutive ``BlockRemoved`` events of one layer group and tier become one
        ``removed`` event (vLLM publishes one per evicted block), as kvstream's own emitter
        batches removals; every other engine event becomes exactly one kvstream event.
        """
        events: list[KVCacheEvent] = []
        removed: list[bytes] = []  # hashes of the removal run being collected
        run_key: tuple[int, int | None] | None = None
        for ev in wire.events:
            if ev.kind == "removed":
                key = (ev.group, ev.cache_level)
                if key != run_key and removed:
                    events.append(self._removed(run_key, removed))
                    removed = []
                run_key = key
                removed.extend(ev.block_hashes)
                continue
            if removed:
                events.append(self._removed(run_key, removed))
                removed, run_key = [], None
            first = self._next_id
            try:
                if ev.kind == "stored":
                    events.append(self._stored(ev))
                else:
                    events.extend(self._events_of(ev))
            except EventValidationError as exc:  # a value the model refuses: never guess
                events.append(self._malformed(first, exc))
        if removed:
            events.append(self._removed(run_key, removed))
        return self._batch(events, _ts_ns(wire.ts))

    def convert_columns(self, wire: WireBatch) -> ColumnBatch:
        """:meth:`convert` as columns, for a publisher (no model object per event or block):
        the same events, ids, windows and lost markers, and ``to_batch()`` equals what
        :meth:`convert` returns. ``wire`` must come from ``decode_payload(...,
        split_tokens=False)``. A stream whose algorithm kvstream does not know (its hashes need
        the model's width checks) converts through the model."""
        if not self.width:
            return publish_columns(self.convert(_split(wire)))
        cols = ColumnBatch(
            self.instance_id,
            attention_dp_rank=self.rank,
            incarnation=self.source.incarnation,
            ts_ns=_ts_ns(wire.ts),
            schema_version=CURRENT_SCHEMA_VERSION,
            tokens=b"",
        )
        extra: list[StoredExtra] = []
        cols.stored_extra = extra
        raws: list[bytes] = []
        ids = cols.event_ids
        kinds = cols.kinds
        groups = cols.group_ids
        windows = cols.window_sizes
        payloads = cols.payloads
        algo = self.hash_algo
        known = self._windows
        removed: list[bytes] = []
        run_key: tuple[int, int | None] | None = None
        for ev in wire.events:
            kind = ev.kind
            if kind == "removed":
                key = (ev.group, ev.cache_level)
                if key != run_key and removed:
                    self._removed_column(cols, run_key, removed)
                    removed = []
                run_key = key
                removed.extend(ev.block_hashes)
                continue
            if removed:
                self._removed_column(cols, run_key, removed)
                removed, run_key = [], None
            if kind == "stored":
                group = ev.group
                window = ev.sliding_window
                if window is None:
                    window = known.setdefault(group, UNBOUNDED_WINDOW)
                else:
                    known[group] = window
                hashes = ev.block_hashes
                n = len(hashes)
                size = ev.block_size
                raw = ev.token_bytes
                if size:
                    last = (len(raw) >> 2) - size * (n - 1)
                    sizes = [size] * (n - 1)
                    sizes.append(last)
                    first = size if n > 1 else last
                    raws.append(raw)
                else:
                    sizes, first = [0] * n, 0
                level = ev.cache_level or 0
                keys = ev.extra_keys
                if keys is not None and keys.count(None) == n:
                    keys = None
                lora_id, lora_name, salt = ev.lora_id, ev.lora_name, ev.cache_salt
                if keys is None and lora_id is None and lora_name is None and salt is None:
                    extra.append((sizes, None))
                else:
                    none = (None,) * n
                    extra.append(
                        (
                            sizes,
                            (
                                (level,) * n,
                                (PRIORITY_DEFAULT,) * n,
                                (lora_id,) * n,
                                (lora_name,) * n,
                                (salt,) * n,
                                none,
                                ((),) * n,
                                none if keys is None else keys,
                            ),
                        )
                    )
                ids.append(self._take_id())
                kinds.append(STORED)
                groups.append(group)
                windows.append(window)
                payloads.append((ev.parent_hash, list(hashes), level, first))
            elif kind == "cleared":
                for g in sorted(known) or [0]:
                    ids.append(self._take_id())
                    kinds.append(CLEARED)
                    groups.append(g)
                    windows.append(known.get(g, UNBOUNDED_WINDOW))
                    payloads.append(None)
            else:
                self.malformed_events += 1
                self._lost_column(cols, 1, f"malformed engine event: {ev.error}")
        if removed:
            self._removed_column(cols, run_key, removed)
        cols.hash_algos = [algo] * len(ids)
        cols.tokens = b"".join(raws)
        cols.token_layout = _token_layout_of(extra)
        self.events += len(ids)
        return cols

    def payload_columns(
        self, payload: bytes, dialect: Dialect = VLLM, *, typed: Any = None
    ) -> ColumnBatch:
        """The columns of one engine payload: exactly ``self.convert_columns(decode_payload(
        payload, width=self.width, dialect=dialect, split_tokens=False))`` (InteropError
        likewise), in one pass over msgspec's structs for the payloads every current engine
        sends (map-era events, int hashes, values in range); any other payload takes that
        path. ``typed``: ``decode_typed(payload)``, when the caller already decoded it (to
        read its rank). The stream's state changes only once the whole payload is
        converted."""
        native = _vllm.native_readers()
        if self.width == 8 and native is not None:
            if typed is None:
                cols = self._native_columns(payload, native)
                if cols is not None:
                    return cols
                typed = decode_typed(payload)
            if typed is not None:
                try:
                    return self._fast_columns(typed, native)
                except _NotFast:
                    pass
        return self.convert_columns(
            decode_payload(payload, width=self.width, dialect=dialect, split_tokens=False)
        )

    def burst(self, *rank: int | None) -> ColumnBurst | None:
        """An accumulator of this stream's next engine payloads into one column batch
        (:class:`ColumnBurst`); None when the one-call C reader is not there or the stream's
        hashes are not 8 bytes (then read each with :meth:`payload_columns`). ``rank``
        (optional): the burst takes only payloads that name that ``data_parallel_rank``
        (None: none)."""
        native = _vllm.native_readers()
        if self.width != 8 or native is None:
            return None
        return ColumnBurst(self, native.batch_columns, *rank)

    def _native_columns(self, payload: bytes, native: Any) -> ColumnBatch | None:
        # What _fast_columns gives, read from the bytes in one C call for the payloads every
        # current engine sends; None for anything else (nothing changed then).
        known = dict(self._windows)
        got = native.batch_columns(
            payload, self._next_id, known, MEDIUM_LEVELS, _EXTERNAL, UNBOUNDED_WINDOW
        )
        if got is None:
            return None
        ts, _rank, ids, kinds, groups, windows, payloads, extra, tokens, next_id, layout = got
        cols = self._new_columns(
            ts,
            ids=ids,
            kinds=kinds,
            groups=groups,
            windows=windows,
            payloads=payloads,
            extra=extra,
            tokens=tokens,
            layout=layout,  # every stored event in them is plain
        )
        self._took(next_id, known, len(ids))
        return cols

    def _new_columns(
        self,
        ts: float,
        *,
        ids: list[int],
        kinds: list[int],
        groups: list[int],
        windows: list[int],
        payloads: list[Any],
        extra: list[StoredExtra],
        tokens: bytes,
        layout: list[tuple[int, list[int]] | None] | None = None,
    ) -> ColumnBatch:
        """A publisher's columns of this stream's current incarnation, with the token
        layouts of its plain stored events (``layout``, or computed from ``extra``)."""
        cols = ColumnBatch(
            self.instance_id,
            attention_dp_rank=self.rank,
            incarnation=self.source.incarnation,
            ts_ns=_ts_ns(ts),
            schema_version=CURRENT_SCHEMA_VERSION,
            tokens=tokens,
        )
        cols.event_ids = ids
        cols.kinds = kinds
        cols.hash_algos = [self.hash_algo] * len(ids)
        cols.group_ids = groups
        cols.window_sizes = windows
        cols.payloads = payloads
        cols.stored_extra = extra
        cols.token_layout = _token_layout_of(extra) if layout is None else layout
        return cols

    def _took(self, next_id: int, windows: dict[int, int], events: int) -> None:
        """Commit a converted batch: ids go on from ``next_id``, the groups' windows."""
        self._next_id = next_id
        self._windows = windows
        self.events += events

    def _fast_columns(self, batch: Any, native: Any) -> ColumnBatch:
        # The checks of vllm._decode_fast/_fast_event and the conversion of convert_columns,
        # fused; anything they would not take raises _NotFast before the state changes.
        from kvstream.engines import _wire_structs as structs

        stored_t, removed_t = structs.Stored, structs.Removed
        be64 = native.be64_array
        u32 = native.u32_array
        removed_run = getattr(native, "removed_run", None)
        levels = MEDIUM_LEVELS
        next_id = self._next_id
        known = dict(self._windows)
        ids: list[int] = []
        kinds: list[int] = []
        groups: list[int] = []
        windows: list[int] = []
        payloads: list[Any] = []
        extra: list[StoredExtra] = []
        raws: list[bytes] = []
        run: list[bytes] = []
        run_key: tuple[int, int | None] | None = None

        def flush(hashes: list[bytes], key: tuple[int, int | None] | None) -> None:
            nonlocal next_id
            assert key is not None
            ids.append(next_id)
            next_id += 1
            kinds.append(REMOVED)
            groups.append(key[0])
            windows.append(known.setdefault(key[0], UNBOUNDED_WINDOW))
            payloads.append((hashes, key[1]))

        try:
            events: list[Any] = batch.events  # narrowed by type(ev) below
            i, n_events = 0, len(events)
            while i < n_events:
                ev = events[i]
                t = type(ev)
                if t is removed_t and removed_run is not None:
                    # a run of plain removals in C; what it stops at is read below
                    got = removed_run(events, i, removed_t, levels)
                    if got is not None:
                        i, hashes, group, level = got
                        key = (group, level)
                        if key != run_key and run:
                            flush(run, run_key)
                            run = []
                        run_key = key
                        run += hashes
                        continue
                i += 1
                if t is removed_t or t is stored_t:
                    group = ev.group_idx or 0
                    if not 0 <= group < 1 << 31:
                        raise _NotFast
                    medium = ev.medium
                    level = None if medium is None else levels.get(medium.upper())
                    if level is None and medium is not None:
                        raise _NotFast
                    if ev.locality is not None and ev.locality.upper() == "REMOTE":
                        level = _EXTERNAL
                    hashes = be64(ev.block_hashes)
                    if not hashes:
                        raise _NotFast
                    if t is removed_t:
                        key = (group, level)
                        if key != run_key and run:
                            flush(run, run_key)
                            run = []
                        run_key = key
                        run.extend(hashes)
                        continue
                    if run:
                        flush(run, run_key)
                        run, run_key = [], None
                    n = len(hashes)
                    window = ev.kv_cache_spec_sliding_window
                    lora_id = ev.lora_id
                    if (window is not None and window < 1) or (lora_id is not None and lora_id < 0):
                        raise _NotFast
                    tokens = u32(ev.token_ids)
                    size = _token_layout(tokens, n, ev.block_size)
                    keys = ev.extra_keys
                    if keys is not None:
                        keys = None if len(keys) == n == keys.count(None) else _extra_keys(keys, n)
                        if keys is not None and keys.count(None) == n:
                            keys = None
                    parent = ev.parent_block_hash
                    if parent is not None:
                        parent = _hash(parent, 8, "")
                    if window is None:
                        window = known.setdefault(group, UNBOUNDED_WINDOW)
                    else:
                        known[group] = window
                    if size:
                        last = (len(tokens) >> 2) - size * (n - 1)
                        sizes = [size] * (n - 1)
                        sizes.append(last)
                        first = size if n > 1 else last
                        raws.append(tokens)
                    else:
                        sizes, first = [0] * n, 0
                    lv = level or 0
                    lora_name, salt = ev.lora_name, ev.cache_salt
                    if keys is None and lora_id is None and lora_name is None and salt is None:
                        extra.append((sizes, None))
                    else:
                        none = (None,) * n
                        extra.append(
                            (
                                sizes,
                                (
                                    (lv,) * n,
                                    (PRIORITY_DEFAULT,) * n,
                                    (lora_id,) * n,
                                    (lora_name,) * n,
                                    (salt,) * n,
                                    none,
                                    ((),) * n,
                                    none if keys is None else keys,
                                ),
                            )
                        )
                    ids.append(next_id)
                    next_id += 1
                    kinds.append(STORED)
                    groups.append(group)
                    windows.append(window)
                    payloads.append((parent, list(hashes), lv, first))
                else:  # AllBlocksCleared
                    if run:
                        flush(run, run_key)
                        run, run_key = [], None
                    for g in sorted(known) or [0]:
                        ids.append(next_id)
                        next_id += 1
                        kinds.append(CLEARED)
                        groups.append(g)
                        windows.append(known.get(g, UNBOUNDED_WINDOW))
                        payloads.append(None)
        except (ValueError, _BadEvent):  # the C readers' refusals, a bad value
            raise _NotFast from None
        if run:
            flush(run, run_key)
        cols = self._new_columns(
            batch.ts,
            ids=ids,
            kinds=kinds,
            groups=groups,
            windows=windows,
            payloads=payloads,
            extra=extra,
            tokens=b"".join(raws),
        )
        self._took(next_id, known, len(ids))
        return cols

    def _removed_column(
        self, cols: ColumnBatch, key: tuple[int, int | None] | None, hashes: list[bytes]
    ) -> None:
        assert key is not None
        group, level = key
        cols.event_ids.append(self._take_id())
        cols.kinds.append(REMOVED)
        cols.group_ids.append(group)
        cols.window_sizes.append(self._window(group, None))
        cols.payloads.append((hashes, level))

    def _lost_column(self, cols: ColumnBatch, count: int, reason: str) -> None:
        first = self._next_id
        self._next_id = first + count
        cols.event_ids.append(first + count - 1)
        cols.kinds.append(LOST)
        cols.group_ids.append(0)
        cols.window_sizes.append(UNBOUNDED_WINDOW)
        cols.payloads.append((first, count, reason[:1024]))

    def _removed(self, key: tuple[int, int | None] | None, hashes: list[bytes]) -> KVCacheEvent:
        assert key is not None
        group, level = key
        values = {"block_hashes": tuple(hashes), "cache_level": level}
        if self.width:
            return self._event(group, self._window(group, None), _trusted_removed(values))
        first = self._next_id
        try:
            return self._event(group, self._window(group, None), Removed(**values))
        except EventValidationError as exc:  # an unknown algorithm's run mixing hash widths
            return self._malformed(first, exc)

    def _malformed(self, first: int, exc: EventValidationError) -> KVCacheEvent:
        """The lost marker of an event the model refused (ids restart at ``first``)."""
        self._next_id = first
        self.malformed_events += 1
        reason = str(exc).replace("\n", " ")
        return self._lost(1, f"malformed engine event: {reason}")

    def lost(self, count: int, reason: str) -> EventBatch:
        """A batch holding one ``lost`` marker for ``count`` events that never arrived."""
        if count < 1:
            raise ValueError("a lost marker covers at least one event")
        return self._batch([self._lost(count, reason)], time.time_ns())

    def _batch(self, events: list[KVCacheEvent], ts_ns: int) -> EventBatch:
        self.events += len(events)
        # Every event is a model object already (validated, or built from checked values):
        # EventBatch's validation would only re-run their validators.
        return _trusted_batch({"source": self.source, "ts_ns": ts_ns, "events": tuple(events)})

    def _take_id(self) -> int:
        i = self._next_id
        self._next_id = i + 1
        return i

    def _lost(self, count: int, reason: str) -> KVCacheEvent:
        first = self._next_id
        self._next_id = first + count
        return KVCacheEvent(
            event_id=first + count - 1,
            hash_algo=self.hash_algo,
            window_size=UNBOUNDED_WINDOW,
            data=Lost(first_event_id=first, count=count, reason=reason[:1024]),
        )

    def _window(self, group: int, announced: int | None) -> int:
        if announced is not None:
            self._windows[group] = announced
            return announced
        return self._windows.setdefault(group, UNBOUNDED_WINDOW)

    def _events_of(self, ev: WireEvent) -> list[KVCacheEvent]:
        # every kind but "removed" (runs, in convert) and "stored" (convert's fast lane)
        if ev.kind == "cleared":
            groups = sorted(self._windows) or [0]
            windows = self._windows
            return [self._event(g, windows.get(g, UNBOUNDED_WINDOW), Cleared()) for g in groups]
        self.malformed_events += 1
        return [self._lost(1, f"malformed engine event: {ev.error}")]

    def _event(self, group: int, window: int, data: Any) -> KVCacheEvent:
        values = {
            "event_id": self._take_id(),
            "hash_algo": self.hash_algo,
            "layer_group_id": group,
            "window_size": window,
            "data": data,
        }
        if self.width:
            # Known width: the decoder has made every hash exactly that wide, which is all
            # the event's validator checks beyond the ranges the decoder checked too.
            return _trusted_event(values)
        return KVCacheEvent(**values)

    def _stored(self, ev: WireEvent) -> KVCacheEvent:
        # The decoder has checked every value (hash widths, token ranges, extra keys), so
        # blocks are built without re-validation: this is the bridge's per-block cost, and
        # this method the per-event one (hence the inlined _event/_window).
        level, lora_id, lora_name, salt = ev.cache_level, ev.lora_id, ev.lora_name, ev.cache_salt
        # a value given is in the fields set even when falsy (lora_id 0, lora_name ""): the
        # encoder takes a block whose fields set is the basic one for a block at the defaults
        if level or lora_id is not None or lora_name is not None or salt is not None:
            given = _GIVEN[
                (1 if level else 0)
                | (2 if lora_id is not None else 0)
                | (4 if lora_name is not None else 0)
                | (8 if salt is not None else 0)
            ]
        else:
            given = _GIVEN[0]
        blocks = trusted_stored_blocks(
            ev.block_hashes,
            ev.block_tokens,
            extra_keys=ev.extra_keys,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_level=level or 0,
            cache_salt=salt,
            fields_set=given,
        )
        stored = {"parent_hash": ev.parent_hash, "blocks": blocks}
        group = ev.group
        if not self.width:
            data = Stored(**stored)
            return self._event(group, self._window(group, ev.sliding_window), data)
        window = ev.sliding_window
        if window is None:
            window = self._windows.setdefault(group, UNBOUNDED_WINDOW)
        else:
            self._windows[group] = window
        event_id = self._next_id
        self._next_id = event_id + 1
        return _trusted_event(
            {
                "event_id": event_id,
                "hash_algo": self.hash_algo,
                "layer_group_id": group,
                "window_size": window,
                "data": _trusted_stored(stored),
            }
        )


class ColumnBurst:
    """Consecutive engine payloads of one :class:`EngineStream` read into one column batch,
    for a reader that drained several at once (:meth:`EngineStream.burst`).

    :meth:`add` takes a payload when the one-call C reader takes it (exactly the events
    :meth:`EngineStream.payload_columns` gives it, the event ids following on from one payload
    to the next) and refuses it otherwise, leaving the burst as it was (read that payload
    with ``payload_columns`` after :meth:`finish`). :meth:`finish` returns the batch and
    commits the stream's state (next event id, layer-group windows); nothing of the stream
    changes before it. Applying the batch gives the index the state the payloads one by one
    give it (one batch in the index's ``batches`` counter instead of :attr:`count`).
    """

    __slots__ = ("_call", "_into", "_known", "_next_id", "_rank", "_stream", "_ts", "count")

    def __init__(self, stream: EngineStream, call: Callable[..., Any], *rank: int | None) -> None:
        """``call``: the C reader (``_wire_native.batch_columns``); ``rank``: see
        :meth:`EngineStream.burst`."""
        self._stream = stream
        self._call = call
        self._rank = rank  # () or (the rank every payload must name,)
        self._known = dict(stream._windows)
        self._next_id = stream._next_id
        #: ids, kinds, groups, windows, payloads, extra, layout, then the tokens
        self._into: list[Any] = [[], [], [], [], [], [], [], bytearray()]
        self._ts = 0.0
        #: payloads taken
        self.count = 0

    def add(self, payload: bytes) -> bool:
        """Take ``payload`` (True), or refuse it with nothing changed (False)."""
        got = self._call(
            payload,
            self._next_id,
            self._known,
            MEDIUM_LEVELS,
            _EXTERNAL,
            UNBOUNDED_WINDOW,
            self._into,
            *self._rank,
        )
        if got is None:
            return False
        if not self.count:
            self._ts = got[0]
        self._next_id = got[2]
        self.count += 1
        return True

    def finish(self) -> ColumnBatch:
        """The batch of the payloads taken (at least one), the stream's state committed."""
        if not self.count:
            raise ValueError("ColumnBurst.finish: no payload taken")
        ids, kinds, groups, windows, payloads, extra, layout, tokens = self._into
        stream = self._stream
        cols = stream._new_columns(
            self._ts,
            ids=ids,
            kinds=kinds,
            groups=groups,
            windows=windows,
            payloads=payloads,
            extra=extra,
            tokens=bytes(tokens),
            layout=layout,
        )
        stream._took(self._next_id, self._known, len(ids))
        return cols


def _split(wire: WireBatch) -> WireBatch:
    """``wire`` with every stored event's tokens split per block, as :meth:`EngineStream.convert`
    takes them (a no-op for a batch decoded with ``split_tokens=True``)."""
    events = [
        replace(ev, block_tokens=_split_tokens(ev.token_bytes, len(ev.block_hashes), ev.block_size))
        if ev.kind == "stored" and not ev.block_tokens
        else ev
        for ev in wire.events
    ]
    return WireBatch(wire.ts, events, wire.dp_rank)


def decode_typed(payload: bytes) -> Any:
    """``payload`` decoded by msgspec into the engine's typed batch struct (what
    :meth:`EngineStream.payload_columns` reads), or None when it is not that shape (the
    general decoder then says why). Its ``data_parallel_rank`` is checked to be None or
    non-negative."""
    from kvstream.engines import _wire_structs as structs

    try:
        batch = structs.decode(payload)
    except Exception:  # msgspec's DecodeError/ValidationError: the general path says why
        return None
    rank = batch.data_parallel_rank
    return None if rank is not None and rank < 0 else batch


def batch_rank(payload: bytes) -> tuple[int | None, Any]:
    """The ``data_parallel_rank`` a payload names (None: none), with the payload decoded
    into the typed batch struct when that was how the rank was read (else None: pass it on
    to :meth:`EngineStream.payload_columns` as ``typed``). ValueError when the payload is
    not a batch whose rank is None or an int >= 0; the general decoder then says why."""
    native = _vllm.native_readers()
    if native is not None:
        rank: int | None = native.peek_rank(payload)
        return rank, None
    typed = decode_typed(payload)
    if typed is None:
        raise ValueError("not a typed engine batch")
    return typed.data_parallel_rank, typed


def _token_layout_of(extra: list[StoredExtra]) -> list[tuple[int, list[int]] | None]:
    """The :attr:`ColumnBatch.token_layout` of a publisher's columns: each stored event's
    first token (its tokens lie in order in ``tokens``) and block sizes, when it is plain."""
    out: list[tuple[int, list[int]] | None] = []
    at = 0
    for sizes, attrs in extra:
        out.append((at, sizes) if attrs is None else None)
        at += sum(sizes)
    return out


def _ts_ns(ts: float) -> int:
    if math.isfinite(ts) and 0 <= ts < 2**62 / 1e9:
        return int(ts * 1e9)
    return time.time_ns()
