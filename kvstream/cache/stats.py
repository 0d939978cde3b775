"""Counters and gauges of a cache manager (snapshots; the manager keeps the live values)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstream.cache.disk_store import DiskStoreStats
    from kvstream.cache.tiering import TierStats

__all__ = ["CacheStats", "GroupStats"]


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One layer group. Gauges: ``free_blocks`` (uncached free plus evictable),
    ``evictable_blocks`` (free but cached), ``cached_blocks`` (committed, in use or not),
    ``used_blocks`` (held by requests). Counters since construction: ``evictions``,
    ``hit_blocks`` (prompt blocks before the group's reuse boundary) of ``queried_blocks``
    (full prompt blocks looked up). ``tier``: the host/disk tier counters (None without
    tiers)."""

    layer_group_id: int
    window_size: int | None
    num_blocks: int
    free_blocks: int
    evictable_blocks: int
    cached_blocks: int
    used_blocks: int
    evictions: int
    hit_blocks: int
    queried_blocks: int
    tier: TierStats | None = None

    @property
    def miss_blocks(self) -> int:
        """Queried prompt blocks after the reuse boundary (computed, not reused)."""
        return self.queried_blocks - self.hit_blocks

    @property
    def hit_ratio(self) -> float:
        """``hit_blocks / queried_blocks`` (0.0 before any query)."""
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The whole manager: ``running_requests`` (gauge); counters ``requests_added``,
    ``requests_rejected`` (CacheFullError), ``prompt_tokens`` and ``reusable_tokens`` (the
    per-request minimum over groups, summed); every group's :class:`GroupStats`; and the disk
    store's counters (None without a disk tier)."""

    running_requests: int
    requests_added: int
    requests_rejected: int
    prompt_tokens: int
    reusable_tokens: int
    groups: tuple[GroupStats, ...]
    disk: DiskStoreStats | None = None
