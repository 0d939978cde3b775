"""Consumers that build prefix indexes from KV-cache event streams, and a KV-aware router
(layer L3: imports events, hashing, codec and sinks; never cache or pipeline; no torch, and
aiokafka only inside :mod:`kvstream.index.sources.kafka`).

::

    from kvstream.index import IndexConsumer, PrefixIndex, Router, RouterConfig, open_source

    consumer = IndexConsumer(open_source("kafka://broker:9092/kv-events"))
    await consumer.run()                                  # catch up, then stop
    router = Router(consumer.index, config=RouterConfig(policy="kv"))
    decision = router.route(prompt_tokens)                # worker + per-worker matches

Modules: :mod:`.index` (the index and its rules), :mod:`.table` (one worker's prefix tree in
flat arrays), :mod:`.keys` and :mod:`.token_table` (token-derived keys: one index across
engines and hash algorithms, ``PrefixIndex(key_mode="tokens")``), :mod:`.domain` (the shared
block -> workers masks and the prefix search),
:mod:`.matching` (request hashing, match results), :mod:`.router`, :mod:`.load` (active load),
:mod:`.snapshot` (versioned snapshot files), :mod:`.consumer` (source -> index, snapshots,
commits), :mod:`.sources` (Kafka, files, memory), :mod:`.stats`, :mod:`.errors`,
:mod:`.types`.
"""

from typing import TYPE_CHECKING, Any

from kvstream.index.consumer import ConsumerReport, IndexConsumer
from kvstream.index.errors import (
    HashConfigMismatchError,
    PrefixIndexError,
    SnapshotError,
    SourceError,
)
from kvstream.index.index import GroupInfo, PrefixIndex, WorkerInfo
from kvstream.index.keys import CANONICAL_ALGO, KeyMode
from kvstream.index.load import LoadTracker, WorkerLoad
from kvstream.index.matching import HashRequest, MatchResult, RequestHasher, WorkerMatch
from kvstream.index.router import (
    RouteDecision,
    Router,
    RouterConfig,
    RoutingPolicy,
    WorkerScore,
)
from kvstream.index.snapshot import Snapshot, load_snapshot, save_snapshot
from kvstream.index.sources import (
    EventSource,
    MemorySource,
    SourceItem,
    open_source,
)
from kvstream.index.stats import IndexStats, SourceStats
from kvstream.index.types import DEFAULT_TIER_WEIGHTS, DomainKey, WorkerKey

if TYPE_CHECKING:
    from kvstream.index.sources.file import FileSource

__all__ = [
    "CANONICAL_ALGO",
    "DEFAULT_TIER_WEIGHTS",
    "ConsumerReport",
    "DomainKey",
    "EventSource",
    "FileSource",
    "GroupInfo",
    "HashConfigMismatchError",
    "HashRequest",
    "IndexConsumer",
    "IndexStats",
    "KeyMode",
    "LoadTracker",
    "MatchResult",
    "MemorySource",
    "PrefixIndex",
    "PrefixIndexError",
    "RequestHasher",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "RoutingPolicy",
    "Snapshot",
    "SnapshotError",
    "SourceError",
    "SourceItem",
    "SourceStats",
    "WorkerInfo",
    "WorkerKey",
    "WorkerLoad",
    "WorkerMatch",
    "WorkerScore",
    "load_snapshot",
    "open_source",
    "save_snapshot",
]


def __getattr__(name: str) -> Any:
    # FileSource brings the codec (fastavro, numpy): loaded when first named (see sources).
    if name == "FileSource":
        from kvstream.index.sources.file import FileSource

        return FileSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
