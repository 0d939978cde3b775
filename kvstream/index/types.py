"""Small value types shared by the index, the router and the sources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, NamedTuple

from kvstream.errors import ConfigError

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "MAX_TIERS",
    "DomainKey",
    "ShardSpec",
    "WorkerKey",
    "worker_key",
    "worker_partition",
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


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Shard ``shard`` of ``count``: owns the partitions ``p`` with ``p % count == shard``.

    ``str(spec)`` and :meth:`parse` use the form ``K/N``. ConfigError unless
    ``0 <= shard < count``.
    """

    shard: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.shard < self.count:
            raise ConfigError(f"a shard is K/N with 0 <= K < N, got {self.shard}/{self.count}")

    def __str__(self) -> str:
        return f"{self.shard}/{self.count}"

    @classmethod
    def parse(cls, value: ShardSpec | str | tuple[int, int]) -> ShardSpec:
        """A spec from ``"K/N"``, ``(K, N)`` or a spec; ConfigError otherwise."""
        if isinstance(value, ShardSpec):
            return value
        if isinstance(value, tuple) and len(value) == 2:
            return cls(int(value[0]), int(value[1]))
        if isinstance(value, str):
            k, sep, n = value.partition("/")
            if sep and k.strip().isdigit() and n.strip().isdigit():
                return cls(int(k), int(n))
        raise ConfigError(f"a shard is written K/N (e.g. 0/4), got {value!r}")

    @classmethod
    def all(cls, count: int) -> list[ShardSpec]:
        """The ``count`` shards of a split."""
        return [cls(k, count) for k in range(count)]

    def owns_partition(self, partition: int) -> bool:
        """True when ``partition`` belongs to this shard."""
        return partition % self.count == self.shard

    def partitions(self, num_partitions: int) -> list[int]:
        """This shard's partitions of a topic with ``num_partitions``; ConfigError when it
        gets none (more shards than partitions: the extra shards would idle)."""
        parts = [p for p in range(num_partitions) if p % self.count == self.shard]
        if not parts:
            raise ConfigError(
                f"shard {self} of a topic with {num_partitions} partition(s) owns none: "
                f"use at most {num_partitions} shards"
            )
        return parts

    def owns_worker(self, worker: WorkerKey | tuple[str, int | None], num_partitions: int) -> bool:
        """True when ``worker``'s events land in one of this shard's partitions."""
        return self.owns_partition(worker_partition(worker, num_partitions))


def worker_partition(worker: WorkerKey | tuple[str, int | None], num_partitions: int) -> int:
    """The partition the Kafka sink writes ``worker``'s batches to (its source key under the
    murmur2 rule; needs the ``kafka`` extra)."""
    from kvstream.events.model import SourceId
    from kvstream.sinks.kafka import partition_for, source_key

    if num_partitions < 1:
        raise ConfigError(f"a topic has at least one partition, got {num_partitions}")
    src = SourceId(instance_id=worker[0], attention_dp_rank=worker[1], incarnation=0)
    return partition_for(source_key(src), num_partitions)
