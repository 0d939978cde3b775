"""Helpers for the index tests: a hand-driven event producer with real hashes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstream.events.model import (
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)
from kvstream.hashing import get_hasher, split_blocks

WINDOW = 4096


class Producer:
    """Builds the events one worker would send, numbering ids itself."""

    def __init__(
        self,
        instance: str = "w0",
        *,
        rank: int | None = None,
        incarnation: int = 1,
        algo: str = "blake3_64",
        tpb: int = 4,
    ) -> None:
        self.source = SourceId(
            instance_id=instance, attention_dp_rank=rank, incarnation=incarnation
        )
        self.algo = algo
        self.tpb = tpb
        self.hasher = get_hasher(algo)
        self.next_id = 0

    def restart(self, incarnation: int) -> None:
        """A new process: new incarnation, ids from 0."""
        self.source = SourceId(
            instance_id=self.source.instance_id,
            attention_dp_rank=self.source.attention_dp_rank,
            incarnation=incarnation,
        )
        self.next_id = 0

    def chain(self, tokens: Sequence[int]) -> list[bytes]:
        """The hashes of the full blocks of ``tokens``."""
        return self.hasher.chain_bytes(split_blocks(list(tokens), self.tpb))

    def _ev(self, data: Any, group: int = 0, algo: str | None = None) -> KVCacheEvent:
        ev = KVCacheEvent(
            event_id=self.next_id,
            hash_algo=algo or self.algo,
            layer_group_id=group,
            window_size=WINDOW,
            data=data,
        )
        self.next_id += 1
        return ev

    def created(
        self, group: int = 0, capacity: tuple[int, ...] = (1000,), tpb: int | None = None
    ) -> KVCacheEvent:
        return self._ev(
            Created(num_blocks_per_cache_level=capacity, tokens_per_block=tpb or self.tpb), group
        )

    def stored(
        self,
        hashes: Sequence[bytes],
        parent: bytes | None = None,
        *,
        level: int = 0,
        group: int = 0,
        algo: str | None = None,
    ) -> KVCacheEvent:
        blocks = tuple(
            StoredBlock(block_hash=h, token_ids=[1] * self.tpb, cache_level=level) for h in hashes
        )
        return self._ev(Stored(parent_hash=parent, blocks=blocks), group, algo)

    def removed(
        self, hashes: Sequence[bytes], level: int | None = None, group: int = 0
    ) -> KVCacheEvent:
        return self._ev(Removed(block_hashes=tuple(hashes), cache_level=level), group)

    def updated(self, h: bytes, old: int, new: int, group: int = 0) -> KVCacheEvent:
        return self._ev(
            Updated(block_hash=h, cache_level=EventDiff(old_value=old, new_value=new)), group
        )

    def priority(self, h: bytes, old: int, new: int, group: int = 0) -> KVCacheEvent:
        return self._ev(
            Updated(block_hash=h, priority=EventDiff(old_value=old, new_value=new)), group
        )

    def cleared(self, group: int = 0) -> KVCacheEvent:
        return self._ev(Cleared(), group)

    def lost(self, count: int, reason: str = "overflow") -> KVCacheEvent:
        """A marker standing for ``count`` dropped ids (its own id is the last of them)."""
        first = self.next_id
        self.next_id += count - 1
        return self._ev(Lost(first_event_id=first, count=count, reason=reason))

    def skip(self, n: int = 1) -> None:
        """Lose ``n`` ids silently (a gap)."""
        self.next_id += n

    def batch(self, *events: KVCacheEvent) -> EventBatch:
        return EventBatch(source=self.source, ts_ns=1, events=events)


def tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` distinct-ish token ids."""
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]
