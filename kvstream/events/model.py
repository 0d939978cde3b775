"""The typed event model: frozen pydantic v2 models, a closed discriminated union of kinds.

``EventBatch`` is the unit on the wire (one Kafka message, one file record). It carries the
``SourceId`` of the producer and a tuple of ``KVCacheEvent``; each event carries an id, the hash
algorithm and layer group of its hashes, and exactly one payload (``data``):

========== ================================================================================
kind        meaning
========== ================================================================================
created     a layer group's pools exist (capacity per cache level, block size, attention kind)
stored      blocks entered the cache; ``blocks[0]``'s parent is ``parent_hash``, block i's is i-1
removed     blocks left the cache (the last tier they were on)
updated     a block moved between tiers (``cache_level`` old->new) or changed priority
cleared     every block of this source and layer group is gone (engine reset)
lost        ``count`` events starting at ``first_event_id`` were dropped before delivery
========== ================================================================================

Hashes are ``bytes``: 8 bytes (big-endian unsigned) for 64-bit algorithms, 32 for 256-bit
ones; :mod:`kvstream._types` converts to and from the int/hex forms of peer JSON.

Every constructor validates; a bad value raises :class:`kvstream.errors.EventValidationError`
naming the field (never pydantic's own error type).
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import Annotated, Any, Final, Literal, TypeAlias

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic._internal._model_construction import ModelMetaclass
from typing_extensions import Self

from kvstream._types import (
    ALLOWED_UNKNOWN_WIDTHS,
    PRIORITY_DEFAULT,
    PRIORITY_MAX,
    PRIORITY_MIN,
    TokenIds,
    hash_width,
)
from kvstream.errors import EventValidationError

__all__ = [
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
    "ExtraKey",
    "KVCacheEvent",
    "Lost",
    "MmKey",
    "Removed",
    "SourceId",
    "StoredBlock",
    "Stored",
    "UNBOUNDED_WINDOW",
    "Updated",
]

#: The schema version this library writes by default (see ``schemas/``).
CURRENT_SCHEMA_VERSION: Final = 4
#: What a missing ``hash_algo`` means (TensorRT-LLM V1 events carry none).
DEFAULT_HASH_ALGO: Final = "v1_block_key"
#: ``window_size`` of a full-attention group whose producer did not say its maximum sequence
#: length (vLLM and SGLang events carry a window only for sliding-window groups).
UNBOUNDED_WINDOW: Final = 2**31 - 1

_U64_MAX: Final = 2**64 - 1
_I32_MAX: Final = 2**31 - 1
_I64_MAX: Final = 2**63 - 1

# strict: pydantic would otherwise silently UTF-8-encode a str passed by mistake. JSON input
# carries hashes as hex text (model_config val_json_bytes), which strict mode still accepts.
BlockHash: TypeAlias = Annotated[bytes, Field(min_length=1, max_length=64, strict=True)]
NonNegInt: TypeAlias = Annotated[int, Field(ge=0, le=_I64_MAX, strict=True)]
NonNegInt32: TypeAlias = Annotated[int, Field(ge=0, le=_I32_MAX, strict=True)]
Priority: TypeAlias = Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX, strict=True)]


class EventKind(str, Enum):
    """The closed set of event kinds (the ``type`` tag of :data:`EventData`)."""

    CREATED = "created"
    STORED = "stored"
    REMOVED = "removed"
    UPDATED = "updated"
    CLEARED = "cleared"
    LOST = "lost"


class AttentionKind(str, Enum):
    """How a layer group attends: to the whole sequence or to a sliding window."""

    FULL = "full_attention"
    SLIDING_WINDOW = "sliding_window"


class _RaisesKVStreamErrors(ModelMetaclass):
    # Constructing a model goes through the metaclass; nested models are built by pydantic-core
    # without it, so only the outermost call translates pydantic's error into ours.
    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except pydantic.ValidationError as exc:
            raise EventValidationError.from_pydantic(cls.__name__, exc) from None


class _Frozen(BaseModel, metaclass=_RaisesKVStreamErrors):
    """Frozen, extra-forbidding base whose validation errors are kvstream errors."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", ser_json_bytes="hex", val_json_bytes="hex"
    )

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        """Validate ``obj`` (a dict or model); raises EventValidationError naming the field."""
        try:
            return super().model_validate(obj, **kwargs)
        except pydantic.ValidationError as exc:
            raise EventValidationError.from_pydantic(cls.__name__, exc) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        """Validate JSON text (hashes as hex); raises EventValidationError naming the field."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except pydantic.ValidationError as exc:
            raise EventValidationError.from_pydantic(cls.__name__, exc) from None


class SourceId(_Frozen):
    """Who produced a batch. A new ``incarnation`` means: forget everything from the old one."""

    instance_id: Annotated[str, Field(min_length=1, max_length=256)]
    attention_dp_rank: NonNegInt32 | None = None
    incarnation: NonNegInt = 0

    @property
    def key(self) -> tuple[str, int | None]:
        """The stream identity that persists across incarnations (Kafka message key)."""
        return (self.instance_id, self.attention_dp_rank)


class MmKey(_Frozen):
    """A multimodal item overlapping a block: its 32-byte BLAKE3 content digest and the offset,
    within the item, of the item's first token that falls in this block."""

    hash: Annotated[bytes, Field(min_length=32, max_length=32, strict=True)]
    start_offset: NonNegInt32
    uuid: str | None = None


#: One item of an engine's per-block extra hash keys, as vLLM publishes them
#: (``BlockStored.extra_keys``): a LoRA name or cache salt (str), a multimodal
#: ``(identifier, offset)`` pair, a prompt-embeds digest (bytes), an int. Nested tuples hold
#: scalars only.
ExtraKeyAtom: TypeAlias = (
    Annotated[str, Field(strict=True)]
    | Annotated[int, Field(ge=-(2**63), le=_U64_MAX, strict=True)]
    | Annotated[bytes, Field(strict=True)]
)
ExtraKey: TypeAlias = ExtraKeyAtom | tuple[ExtraKeyAtom, ...]


class StoredBlock(_Frozen):
    """One block announced by a ``stored`` event."""

    block_hash: BlockHash
    token_ids: TokenIds
    #: Per-token extra ids (TensorRT-LLM prompt-table ids); None when every one is 0.
    token_extra_ids: TokenIds | None = None
    lora_id: Annotated[int, Field(ge=0, le=_U64_MAX, strict=True)] | None = None
    lora_name: str | None = None
    cache_level: NonNegInt32 = 0
    priority: Priority = PRIORITY_DEFAULT
    mm_keys: tuple[MmKey, ...] = ()
    cache_salt: str | None = None
    #: The engine's extra hash keys of this block, kept verbatim (vLLM ``extra_keys``); None
    #: when the engine published none. kvstream's own hashers do not read them.
    extra_keys: tuple[ExtraKey, ...] | None = None

    @model_validator(mode="after")
    def _extra_ids_match_tokens(self) -> Self:
        if self.token_extra_ids is not None and len(self.token_extra_ids) != len(self.token_ids):
            raise ValueError(
                f"token_extra_ids has {len(self.token_extra_ids)} entries for "
                f"{len(self.token_ids)} tokens"
            )
        return self


class Created(_Frozen):
    """A layer group's pools exist. Index 0 of ``num_blocks_per_cache_level`` is the GPU."""

    type: Literal["created"] = "created"
    num_blocks_per_cache_level: Annotated[tuple[NonNegInt, ...], Field(min_length=1)]
    tokens_per_block: Annotated[int, Field(ge=1, le=_I32_MAX, strict=True)]
    attention_kind: AttentionKind = AttentionKind.FULL


class Stored(_Frozen):
    """Blocks entered the cache. ``parent_hash`` is ``blocks[0]``'s parent (None at the root);
    block i's parent is block i-1."""

    type: Literal["stored"] = "stored"
    parent_hash: BlockHash | None = None
    blocks: Annotated[tuple[StoredBlock, ...], Field(min_length=1)]


class Removed(_Frozen):
    """Blocks left the cache, from ``cache_level`` when known."""

    type: Literal["removed"] = "removed"
    block_hashes: Annotated[tuple[BlockHash, ...], Field(min_length=1)]
    cache_level: NonNegInt32 | None = None


class EventDiff(_Frozen):
    """An old -> new change of an integer attribute."""

    old_value: NonNegInt32
    new_value: NonNegInt32


class Updated(_Frozen):
    """A block's tier and/or priority changed; an unchanged attribute is None."""

    type: Literal["updated"] = "updated"
    block_hash: BlockHash
    cache_level: EventDiff | None = None
    priority: EventDiff | None = None

    @model_validator(mode="after")
    def _something_changed(self) -> Self:
        if self.cache_level is None and self.priority is None:
            raise ValueError("an updated event must change cache_level or priority")
        if self.priority is not None:
            for v in (self.priority.old_value, self.priority.new_value):
                if not PRIORITY_MIN <= v <= PRIORITY_MAX:
                    raise ValueError(f"priority {v} is outside {PRIORITY_MIN}..{PRIORITY_MAX}")
        return self


class Cleared(_Frozen):
    """Every block of this source and layer group is gone."""

    type: Literal["cleared"] = "cleared"


class Lost(_Frozen):
    """``count`` events with ids ``first_event_id``.. were dropped before delivery.

    Consumers treat it like a gap: state may be stale until the producer resyncs.
    """

    type: Literal["lost"] = "lost"
    first_event_id: NonNegInt
    count: Annotated[int, Field(ge=1, le=_I64_MAX, strict=True)]
    reason: Annotated[str, Field(max_length=1024)] = "overflow"


EventData: TypeAlias = Annotated[
    Created | Stored | Removed | Updated | Cleared | Lost, Field(discriminator="type")
]


def _hashes_of(data: EventData) -> Iterator[tuple[str, bytes]]:
    """Every hash in ``data`` with its field path (only walked to report an error)."""
    if isinstance(data, Stored):
        if data.parent_hash is not None:
            yield "data.parent_hash", data.parent_hash
        for i, b in enumerate(data.blocks):
            yield f"data.blocks.{i}.block_hash", b.block_hash
    elif isinstance(data, Removed):
        for i, h in enumerate(data.block_hashes):
            yield f"data.block_hashes.{i}", h
    elif isinstance(data, Updated):
        yield "data.block_hash", data.block_hash


def _hash_lengths(data: EventData) -> set[int]:
    if isinstance(data, Stored):
        lengths = {len(b.block_hash) for b in data.blocks}
        if data.parent_hash is not None:
            lengths.add(len(data.parent_hash))
        return lengths
    if isinstance(data, Removed):
        return {len(h) for h in data.block_hashes}
    if isinstance(data, Updated):
        return {len(data.block_hash)}
    return set()


class KVCacheEvent(_Frozen):
    """One event of one layer group.

    ``event_id`` counts from 0 per (instance_id, attention_dp_rank, incarnation), +1 per
    emitted event (lost markers included), so consumers detect loss by gaps.
    Every hash in ``data`` has the width of ``hash_algo``'s published hashes.
    """

    event_id: NonNegInt
    hash_algo: Annotated[str, Field(min_length=1, max_length=64)] = DEFAULT_HASH_ALGO
    layer_group_id: NonNegInt32 = 0
    window_size: Annotated[int, Field(ge=1, le=_I64_MAX, strict=True)]
    data: EventData

    @property
    def kind(self) -> EventKind:
        """The payload's kind."""
        return EventKind(self.data.type)

    @model_validator(mode="after")
    def _hash_widths(self) -> Self:
        lengths = _hash_lengths(self.data)
        width = hash_width(self.hash_algo)
        if not lengths or lengths == {width}:
            return self
        if width is None and len(lengths) == 1 and lengths <= set(ALLOWED_UNKNOWN_WIDTHS):
            return self
        # Slow path, taken only to report: name the first offending hash.
        for loc, h in _hashes_of(self.data):
            if width is None:
                if len(h) not in ALLOWED_UNKNOWN_WIDTHS:
                    raise ValueError(
                        f"{loc}: a hash must be {ALLOWED_UNKNOWN_WIDTHS} bytes, got {len(h)}"
                    )
                width = len(h)
            elif len(h) != width:
                raise ValueError(f"{loc}: {self.hash_algo} hashes are {width} bytes, got {len(h)}")
        return self  # pragma: no cover - lengths disagreed, so the loop raised


class EventBatch(_Frozen):
    """The unit on the wire: one source's events, in emission order."""

    source: SourceId
    ts_ns: NonNegInt
    schema_version: Annotated[int, Field(ge=1, le=_I32_MAX, strict=True)] = CURRENT_SCHEMA_VERSION
    events: tuple[KVCacheEvent, ...] = ()

    def event_keys(self) -> Iterator[tuple[str, int | None, int, int]]:
        """(instance_id, rank, incarnation, event_id) per event: the at-least-once dedupe key."""
        s = self.source
        for ev in self.events:
            yield (s.instance_id, s.attention_dp_rank, s.incarnation, ev.event_id)
