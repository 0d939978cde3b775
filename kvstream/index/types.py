"""Small value types shared by the index, the router and the sources."""

from __future__ import annotations

from typing import Final, NamedTuple

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "MAX_TIERS",
    "DomainKey",
    "WorkerKey",
    "worker_key",
]

#: Cache levels the index tells apart (0 GPU, 1 host, 2 disk, 3 anything deeper).
MAX_TIERS: Final = 4
#: Default weight of a cached block by the best tier holding it (GPU, host, disk, deeper).
DEFAULT_TIER_WEIGHTS: Final[tuple[float, ...]] = (1.0, 0.8, 0.5, 0.3)


class WorkerKey(NamedTuple):
    """A worker the index tracks: one event source (instance and attention-DP rank).

    It persists across incarnations (a restarted worker keeps its key; its state is purged).
    ``str(key)`` is ``instance_id/rank`` (``instance_id/-`` without a rank).
    """

    instance_id: str
    dp_rank: int | None = None

    def __str__(self) -> str:
        return f"{self.instance_id}/{'-' if self.dp_rank is None else self.dp_rank}"

    @classmethod
    def parse(cls, text: str) -> WorkerKey:
        """The key of ``instance_id/rank`` (``/-`` or no slash: no rank)."""
        inst, sep, rank = text.rpartition("/")
        if not sep:
            return cls(text, None)
        if rank == "-":
            return cls(inst, None)
        if rank.isdigit():
            return cls(inst, int(rank))
        return cls(text, None)


def worker_key(instance_id: str, dp_rank: int | None = None) -> WorkerKey:
    """Shorthand for :class:`WorkerKey`."""
    return WorkerKey(instance_id, dp_rank)


class DomainKey(NamedTuple):
    """What a request must be hashed with to be matched against a layer group's blocks.

    Workers whose group advertises the same algorithm and block size share one domain: a
    request is hashed once per domain and matched against all of them at once.
    """

    hash_algo: str
    tokens_per_block: int
    layer_group_id: int
