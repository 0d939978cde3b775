"""Counters of what the index applied, skipped and repaired, per source and in total."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["IndexStats", "SourceStats"]


@dataclass(slots=True)
class SourceStats:
    """Monotonic counters of one source (worker); they survive purges and resyncs.

    Event flow: ``batches``, ``events`` (applied, by kind below), ``duplicate_events``
    (ids already applied: at-least-once redelivery), ``skipped_events`` (ids the decoder could
    not represent, accounted for), ``old_incarnation_batches`` (from an incarnation older than
    the current one). Loss: ``gaps``/``gap_events`` (id jumps and the ids they skipped),
    ``lost_markers``/``lost_events``. Repairs: ``duplicate_stores`` (refcount bumps),
    ``refcounted_removes`` (a removal that left the block cached elsewhere or with another
    reference), ``unknown_removes``, ``unknown_updates``, ``unknown_parent_stores``,
    ``parent_mismatches``, ``tier_mismatches``, ``refcount_saturated``, ``capacity_overflows``
    (more blocks cached than advertised: removals were missed), ``tokenless_resolved`` /
    ``tokenless_skipped`` (token-keyed index: stores without token ids resolved through the
    engine hash of a known block, or skipped because the block is unknown). State changes:
    ``purges``, ``incarnation_changes``, ``stale_transitions``, ``resyncs``,
    ``hash_algo_changes``, ``block_size_changes``, ``block_size_mismatches`` (a stored block
    longer than the group's block size: the worker went stale).
    """

    batches: int = 0
    events: int = 0
    created_events: int = 0
    stored_events: int = 0
    stored_blocks: int = 0
    removed_events: int = 0
    removed_blocks: int = 0
    updated_events: int = 0
    priority_updates: int = 0
    cleared_events: int = 0
    lost_markers: int = 0
    lost_events: int = 0
    duplicate_events: int = 0
    skipped_events: int = 0
    gaps: int = 0
    gap_events: int = 0
    old_incarnation_batches: int = 0
    duplicate_stores: int = 0
    refcounted_removes: int = 0
    unknown_removes: int = 0
    unknown_updates: int = 0
    unknown_parent_stores: int = 0
    parent_mismatches: int = 0
    tier_mismatches: int = 0
    refcount_saturated: int = 0
    capacity_overflows: int = 0
    tokenless_resolved: int = 0
    tokenless_skipped: int = 0
    purges: int = 0
    incarnation_changes: int = 0
    stale_transitions: int = 0
    resyncs: int = 0
    hash_algo_changes: int = 0
    block_size_changes: int = 0
    block_size_mismatches: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load(self, values: dict[str, Any]) -> None:
        """Set counters from :meth:`as_dict` output (unknown names are ignored)."""
        for f in fields(self):
            v = values.get(f.name)
            if isinstance(v, int):
                setattr(self, f.name, v)

    def add(self, other: SourceStats) -> None:
        """Add ``other``'s counters to these."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True, slots=True)
class IndexStats:
    """A snapshot of the whole index: gauges plus the sources' counters summed.

    ``workers`` sources known, ``stale_workers`` not trusted now, ``blocks`` cached blocks
    (present in some tier), ``ghost_blocks`` removed blocks kept only because cached
    descendants hang off them, ``unrooted_blocks`` cached blocks whose chain to the root is
    broken (not matchable), ``domains`` hash domains in use.
    """

    workers: int
    stale_workers: int
    blocks: int
    ghost_blocks: int
    unrooted_blocks: int
    domains: int
    counters: SourceStats = field(default_factory=SourceStats)

    def as_dict(self) -> dict[str, Any]:
        """Gauges and counters as one flat JSON-able dict."""
        out: dict[str, Any] = {
            "workers": self.workers,
            "stale_workers": self.stale_workers,
            "blocks": self.blocks,
            "ghost_blocks": self.ghost_blocks,
            "unrooted_blocks": self.unrooted_blocks,
            "domains": self.domains,
        }
        out.update(self.counters.as_dict())
        return out
