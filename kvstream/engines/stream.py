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
from collections.abc import Callable
from typing import Any

from kvstream._types import hash_width
from kvstream.engines.vllm import WireBatch, WireEvent
from kvstream.errors import ConfigError, EventValidationError
from kvstream.events.model import (
    UNBOUNDED_WINDOW,
    Cleared,
    EventBatch,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
)
from kvstream.events.trusted import trusted, trusted_stored_block

__all__ = ["EngineStream"]


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
                events.extend(self._events_of(ev))
            except EventValidationError as exc:  # a value the model refuses: never guess
                self._next_id = first
                self.malformed_events += 1
                reason = str(exc).replace("\n", " ")
                events.append(self._lost(1, f"malformed engine event: {reason}"))
        if removed:
            events.append(self._removed(run_key, removed))
        return self._batch(events, _ts_ns(wire.ts))

    def _removed(self, key: tuple[int, int | None] | None, hashes: list[bytes]) -> KVCacheEvent:
        assert key is not None
        group, level = key
        values = {"block_hashes": tuple(hashes), "cache_level": level}
        data = trusted(Removed, values) if self.width else Removed(**values)
        return self._event(group, self._window(group, None), data)

    def lost(self, count: int, reason: str) -> EventBatch:
        """A batch holding one ``lost`` marker for ``count`` events that never arrived."""
        if count < 1:
            raise ValueError("a lost marker covers at least one event")
        return self._batch([self._lost(count, reason)], time.time_ns())

    def _batch(self, events: list[KVCacheEvent], ts_ns: int) -> EventBatch:
        self.events += len(events)
        return EventBatch(source=self.source, ts_ns=ts_ns, events=tuple(events))

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
        kind = ev.kind
        if kind == "stored":
            return [self._stored(ev)]
        if kind == "cleared":
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
            return trusted(KVCacheEvent, values)
        return KVCacheEvent(**values)

    def _stored(self, ev: WireEvent) -> KVCacheEvent:
        # The decoder has checked every value (hash widths, token ranges, extra keys), so
        # blocks are built without re-validation: this is the bridge's per-block cost.
        given = {"block_hash", "token_ids"}
        for name in ("cache_level", "lora_id", "lora_name", "cache_salt"):
            if getattr(ev, name):
                given.add(name)
        base = frozenset(given)
        with_extra = base | {"extra_keys"}
        level = ev.cache_level or 0
        lora_id, lora_name, salt = ev.lora_id, ev.lora_name, ev.cache_salt
        extra = ev.extra_keys
        tokens = ev.block_tokens
        blocks = []
        for i, h in enumerate(ev.block_hashes):
            keys = None if extra is None else extra[i]
            blocks.append(
                trusted_stored_block(
                    h,
                    tokens[i],
                    lora_id=lora_id,
                    lora_name=lora_name,
                    cache_level=level,
                    cache_salt=salt,
                    extra_keys=keys,
                    fields_set=base if keys is None else with_extra,
                )
            )
        stored = {"parent_hash": ev.parent_hash, "blocks": tuple(blocks)}
        data = trusted(Stored, stored) if self.width else Stored(**stored)
        return self._event(ev.group, self._window(ev.group, ev.sliding_window), data)


def _ts_ns(ts: float) -> int:
    if math.isfinite(ts) and 0 <= ts < 2**62 / 1e9:
        return int(ts * 1e9)
    return time.time_ns()
