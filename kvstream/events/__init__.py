"""Events: the typed model (:mod:`.model`), the emitter the cache records into
(:mod:`.emitter`) and deferred batches that build the models off the engine thread
(:mod:`.deferred`). Engines' own formats live in :mod:`kvstream.engines`."""

from kvstream.events.deferred import AnyBatch, DeferredBatch, EventSpan
from kvstream.events.dp_gather import gather_attention_dp
from kvstream.events.emitter import (
    NULL_RECORDER,
    EmitterStats,
    EventEmitter,
    EventRecorder,
    NullRecorder,
)
from kvstream.events.model import (
    CURRENT_SCHEMA_VERSION,
    DEFAULT_HASH_ALGO,
    AttentionKind,
    BlockHash,
    Cleared,
    Created,
    EventBatch,
    EventData,
    EventDiff,
    EventKind,
    KVCacheEvent,
    Lost,
    MmKey,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)

__all__ = [
    "AnyBatch",
    "DeferredBatch",
    "EventSpan",
    "NULL_RECORDER",
    "EmitterStats",
    "EventEmitter",
    "EventRecorder",
    "NullRecorder",
    "gather_attention_dp",
    "CURRENT_SCHEMA_VERSION",
    "DEFAULT_HASH_ALGO",
    "AttentionKind",
    "BlockHash",
    "Cleared",
    "Created",
    "EventBatch",
    "EventData",
    "EventDiff",
    "EventKind",
    "KVCacheEvent",
    "Lost",
    "MmKey",
    "Removed",
    "SourceId",
    "Stored",
    "StoredBlock",
    "Updated",
]
