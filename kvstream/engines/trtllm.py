"""TensorRT-LLM's JSON KV-cache events: conversion both ways, and an in-process pump.

TensorRT-LLM's ``LLM.get_kv_cache_events()`` and ``POST /kv_cache_events`` return a list of
dicts shaped by its ``KVCacheEventSerializer``::

    {"event_id": 1, "data": {"type": "stored", ...}, "window_size": 4096,
     "attention_dp_rank": 1,            # only under attention data parallelism
     "hash_algo": "v2_sha256",          # V2 managers only; V1 events carry none
     "layer_group_id": 0}               # V2 managers only

:func:`from_trtllm_events` turns such a list into :class:`~kvstream.events.model.EventBatch`
objects (one per attention-DP rank), :func:`to_trtllm_events` writes batches back in the same
shape. :func:`from_trtllm_event` / :func:`to_trtllm_event` convert one event, and
:class:`TrtllmEventReader` keeps the little state that matters across successive reads of one
engine (each ``POST /kv_cache_events`` drains the engine's queue). :func:`pump` polls a live
``LLM`` in-process, as NVIDIA Dynamo's TensorRT-LLM worker does, and hands the batches to a
pipeline.

Every shape the serializers, managers and bridges have published is read; the corpus under
``tests/data/trtllm/shapes/`` (with its manifest naming each source) pins them.

Contracts
=========

Errors. Malformed input (a missing field, a wrong type, an unknown ``type`` tag, bad hex, a hash
of the wrong width, an out-of-range integer) raises :class:`~kvstream.errors.InteropError` whose
message starts with the location, e.g.
``event[3].data.blocks[1].block_hash: expected hex string of 64 chars ...``; never ``KeyError``
or ``TypeError``. A value the event model rejects (:class:`~kvstream.errors.EventValidationError`)
is re-raised as an ``InteropError`` with the same location prefix (the original is chained as
``__cause__``). Bad *arguments* (an empty ``instance_id``, ``tokens_per_block=0``) raise
:class:`~kvstream.errors.ConfigError`. :meth:`TrtllmEventReader.read_tolerant` keeps the good
events of a list and reports each bad one instead of failing the whole list.

Defaults when reading (what TensorRT-LLM omits or leaves null):

- ``hash_algo`` missing or null: ``data.hash_algo`` (TensorRT-LLM's router reads that too),
  else ``"v1_block_key"`` (V1 C++ events carry none).
- ``layer_group_id`` missing or null: 0. ``attention_dp_rank`` missing or null: no rank.
- ``event_id`` missing or null (OpenEngine-servicer and bridge shapes, the fan-out's
  ``all_cleared`` marker): numbered by the reader, see "Event ids" below.
- ``window_size`` missing, null or 0 (serializers before TensorRT-LLM #5580, OpenEngine
  shapes; V2 managers built without a window publish 0): the ``default_window_size`` argument,
  else for an ``all_cleared`` marker the largest window the reader has seen (TensorRT-LLM's
  fan-out only forwards the largest window), else
  :data:`~kvstream.events.model.UNBOUNDED_WINDOW` (a full-attention group of unknown length).
- In a stored block: ``token_extra_id`` 0, ``cache_level`` 0, ``priority`` 35, ``mm_keys`` [],
  ``cache_salt`` null, ``parent_hash`` null. All-zero extra ids become
  ``token_extra_ids=None``; a ``type`` tag may be omitted but must be right when present.
- ``lora_id``, ``lora_name`` and ``cache_salt`` may also sit on the stored event's ``data``
  (bridges put them there; TensorRT-LLM's OpenEngine servicer and Dynamo read them there): a
  block without its own value takes the ``data``-level one; a block's own value wins.
- In an ``mm_key``: ``start_offset`` 0 (as TensorRT-LLM's OpenEngine servicer reads it).
- Unknown keys are ignored (newer serializers may add fields).

Event ids. TensorRT-LLM numbers events from 0 per producer and attention-DP rank. Events
without ``event_id`` are numbered per rank, contiguously, continuing across successive reads
of one :class:`TrtllmEventReader`: a run of ``k`` such events after the rank's previous event
``p`` (from this read or an earlier one; none: -1) and before its next numbered event ``n`` in
the same read takes ``n-k .. n-1`` when those lie above ``p`` (so ids stay strictly increasing
and the fan-out's ``all_cleared`` marker lands on the last lost id, right before the events it
precedes), else ``p+1 .. p+k`` (also when no numbered event follows). :func:`from_trtllm_event`
has no stream and requires ``event_id``.

Hashes (TensorRT-LLM reference §1.3). An int is a 64-bit hash: the unsigned form (which may
exceed 2^63) or the signed int64 wire form (wrapped to unsigned). A str is hex. The width is
enforced from :data:`kvstream._types.BLOCK_HASH_WIDTHS`: ``v1_block_key``/``v2_sha256_64`` take
an int (or 16 hex chars), ``v2_sha256`` takes 64 hex chars and rejects ints (TensorRT-LLM never
publishes a 256-bit hash as an int, and accepting one would silently widen a mislabelled
``v2_sha256_64`` value). For an unknown algorithm an int is 8 bytes and hex is ``len/2`` bytes.
When writing, an 8-byte hash is an unsigned int and any other width lowercase hex, so every
known algorithm gets TensorRT-LLM's representation.

Tokens. ``token_id`` ints must fit in uint32; negative int32 ids are wrapped to uint32 (as
``v1_block_key`` hashes them). ``token_extra_id`` must fit in uint32 (kvstream stores extra ids
as uint32), with one exception: the older V2 manager (``kv_cache_manager_v2/_events.py``)
published a multimodal digest token as ``token_id`` 0 with the digest's first 8 bytes,
little-endian, as a 64-bit ``token_extra_id``. Such a token (id 0, extra id above 2^32-1) is
kept as token id 0 and its item as a partial digest (the 8 bytes, zero-filled to 32) in
``mm_keys`` with ``start_offset`` 0 when the block lists none; the 64-bit extra id itself is
dropped (it does not fit, and the digest's other 24 bytes were never published).

V2 multimodal tokens (reference §3.3). TensorRT-LLM V2 puts a multimodal item into the token
stream as its raw 32-byte digest (JSON: a 64-char hex ``token_id``) followed by item tokens
``mm_token_id_offset + k`` (k >= 1; the offset is the vocabulary size). kvstream token ids are
uint32, so with ``mm_token_id_offset`` given:

- a digest token is stored as the token id ``mm_token_id_offset`` itself (item-local token 0;
  the engine never produces that id, so it is unambiguous; an int token equal to the offset is
  rejected) and the digest lives in the block's ``mm_keys`` as ``(digest, 0)``. The block's hash
  stays the engine's: re-inserting the ``start_offset == 0`` digests in order at those
  positions gives back the engine's token stream.
- if the block's ``mm_keys`` are empty (older V2 events), they are derived from the tokens: a
  digest token starts item X -> ``(X, 0)``; an int token ``t > offset`` continues the most
  recent item, which may come from an ancestor block, and the first token of each such run
  emits ``(X, t - offset)``; a text token (``t < offset``) ends the run. Non-empty ``mm_keys``
  in the JSON are taken as published (they may carry uuids). The most recent item at the end
  of each block is remembered per hash by the reader (LRU-bounded) so a later read can
  continue a chain. A continuation whose item is unknown raises ``InteropError``.
- without ``mm_token_id_offset`` a hex token raises ``InteropError`` saying so.

When writing with ``mm_token_id_offset``, the k-th token equal to the offset becomes the hex of
the block's k-th ``mm_key`` with ``start_offset == 0``; without it token ids are written as ints.

``mm_key`` hashes and uuids. V2 publishes ``{"hash": <digest hex>, "start_offset", "uuid"?}``
(additive uuid). V1's serializer puts the uuid *in place of* the digest (``"hash": "<uuid>"``).

- 64 hex chars: the digest.
- Shorter hex (e.g. a 16-char routing hash): a short mm hash. TensorRT-LLM's OpenEngine
  servicer and Dynamo read ``int(h[:16], 16)`` as the item's 64-bit hash; kvstream keeps that
  value as the digest's first 8 bytes (big-endian), zero-filled to 32, and sets no uuid. It is
  written back as 64 hex chars.
- Anything else (not hex): a uuid published in place of the digest; the digest is then unknown
  and stored as 32 zero bytes (``MmKey.hash == bytes(32)`` with ``uuid`` set means "peer
  published only the uuid"). A uuid that happens to be hex cannot be told from a (short) digest
  and is read as one.

A key with the zero digest and a uuid is always written back in the uuid-replaces-hash form;
other keys follow ``mm_uuid_mode`` (``"additive"`` by default, or ``"replaces_hash"``).

``created``. TensorRT-LLM does not publish ``tokens_per_block``; the ``tokens_per_block``
argument supplies it (no inference from stored blocks: V1 publishes partial blocks, so a
block's length does not tell the block size). A ``created`` event without either raises
``InteropError``. ``attention_kind`` is FULL unless the data carries a kvstream extension key.

Kinds TensorRT-LLM lacks. ``cleared`` is written ``{"type": "cleared"}`` and ``lost`` as
``{"type": "lost", "first_event_id", "count", "reason"}``; ``include_kvstream_kinds=False``
drops them (their ids then show as gaps, which TensorRT-LLM's own fan-out treats as lost
state). Both are accepted when reading, and so is ``{"type": "all_cleared"}``, which
TensorRT-LLM's ``KvEventFanout`` injects on an id gap (with no ``event_id`` and no
``window_size``), read as ``cleared``. The fan-out stamps its marker with
``attention_dp_rank`` 0 even for an engine without attention DP, whose events carry no rank:
so a reader that has seen events without rank and none of rank 0 gives such a marker to the
rank-less source.

kvstream extensions (written only with ``extensions=True``, always accepted when reading):
``created.tokens_per_block``, ``created.attention_kind`` and ``removed.cache_level``.
``lora_id`` and ``lora_name`` of a stored block are written whenever set (TensorRT-LLM's C++
event has ``loraId`` but no serializer emits it) and read when present.

Round trips. ``from_trtllm_events(to_trtllm_events(batch)) == [batch]`` for every batch with at
least one event, given the batch's ``instance_id``/``incarnation``/``ts_ns`` and, when it has
``created`` events, its ``tokens_per_block`` (or ``extensions=True``), plus
``mm_token_id_offset`` on both sides for V2 multimodal blocks. Losses: ``schema_version`` (read
as the current one), ``attention_kind`` and ``Removed.cache_level`` (kept with
``extensions=True``), explicit all-zero ``token_extra_ids`` (read as None), a real digest of a
key written in ``replaces_hash`` mode, and batch boundaries (batches of the same rank merge).
``to_trtllm_events(from_trtllm_events(json)) == json`` for well-formed TensorRT-LLM JSON up to
normalisation: defaults filled in, ``layer_group_id`` and ``hash_algo`` always present (unless
``include_hash_algo=False``), signed hashes and negative token ids unsigned, hex lowercase,
derived ``mm_keys`` filled in, ``data``-level LoRA/salt moved onto the blocks, short mm hashes
zero-filled, 64-bit extra ids dropped, unknown keys dropped, and ``all_cleared`` written as
``cleared`` with the assigned id and window.

Grouping. Events are grouped by ``attention_dp_rank`` (missing/null is one more source, without
rank) into one batch per rank; batches come in the order each rank is first seen and each keeps
its rank's events in input order (TensorRT-LLM's ids are monotonic per rank only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple, NoReturn, Protocol, TypeVar

from kvstream._types import (
    PRIORITY_DEFAULT,
    PRIORITY_MAX,
    PRIORITY_MIN,
    TOKEN_ID_MAX,
    TokenIds,
    hash_from_int,
    hash_to_hex,
    hash_to_int,
    hash_width,
)
from kvstream.clock import SYSTEM_CLOCK, Clock
from kvstream.errors import ConfigError, EventValidationError, InteropError
from kvstream.events.model import (
    DEFAULT_HASH_ALGO,
    UNBOUNDED_WINDOW,
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    EventData,
    EventDiff,
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
    "BatchSubmitter",
    "KvEventsLLM",
    "MmUuidMode",
    "PumpStats",
    "RankedEvent",
    "TolerantRead",
    "TrtllmEventReader",
    "from_trtllm_event",
    "from_trtllm_events",
    "pump",
    "to_trtllm_event",
    "to_trtllm_events",
]

#: How ``mm_key`` uuids are written: as an extra ``uuid`` key (TensorRT-LLM V2) or in place of
#: the digest hex (TensorRT-LLM V1's serializer).
MmUuidMode = Literal["additive", "replaces_hash"]

_I32_MAX: Final = 2**31 - 1
_I64_MAX: Final = 2**63 - 1
_U64_MAX: Final = 2**64 - 1
_DIGEST_LEN: Final = 32
#: Digest of an ``mm_key`` whose peer published only the uuid (V1 "uuid replaces hash").
_UNKNOWN_DIGEST: Final = bytes(_DIGEST_LEN)
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]+")
_KNOWN_TYPES: Final = ("created", "stored", "removed", "updated", "cleared", "all_cleared", "lost")
_DEFAULT_MM_STATE_CAPACITY: Final = 65536

_M = TypeVar("_M", MmKey, StoredBlock, Created, Stored, Removed, Updated, Lost, EventDiff)


class RankedEvent(NamedTuple):
    """One converted event and the attention-DP rank it came from (None without attention DP)."""

    attention_dp_rank: int | None
    event: KVCacheEvent


# --------------------------------------------------------------------------------------------
# Checked access to untrusted JSON values. Every failure is an InteropError naming the path.
# --------------------------------------------------------------------------------------------


def _fail(path: str, message: str) -> NoReturn:
    raise InteropError(f"{path}: {message}")


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        shown = value if len(value) <= 24 else value[:21] + "..."
        return f"str {shown!r} ({len(value)} chars)"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _obj(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        _fail(path, f"expected an object, got {_describe(value)}")
    return value


def _list(value: Any, path: str) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        _fail(path, f"expected a list, got {_describe(value)}")
    return value


def _req(obj: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in obj:
        _fail(f"{path}.{key}", "missing required field")
    return obj[key]


def _int(value: Any, path: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"expected an integer, got {_describe(value)}")
    if not lo <= value <= hi:
        _fail(path, f"{value} is outside {lo}..{hi}")
    return value


def _opt_int(obj: Mapping[str, Any], key: str, path: str, lo: int, hi: int) -> int | None:
    value = obj.get(key)
    return None if value is None else _int(value, f"{path}.{key}", lo, hi)


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, f"expected a string, got {_describe(value)}")
    return value


def _opt_str(obj: Mapping[str, Any], key: str, path: str) -> str | None:
    value = obj.get(key)
    return None if value is None else _str(value, f"{path}.{key}")


def _check_tag(obj: Mapping[str, Any], expected: str, path: str) -> None:
    tag = obj.get("type")
    if tag is not None and tag != expected:
        _fail(f"{path}.type", f"expected {expected!r}, got {_describe(tag)}")


def _is_hex(text: str, chars: int | None = None) -> bool:
    return (chars is None or len(text) == chars) and _HEX_RE.fullmatch(text) is not None


def _build(cls: type[_M], path: str, **fields: Any) -> _M:
    try:
        return cls(**fields)
    except EventValidationError as exc:
        raise InteropError(f"{path}: {exc}") from exc


def _parse_hash(value: Any, path: str, hash_algo: str) -> bytes:
    """Bytes of a JSON hash: an int is 64-bit (unsigned or signed wire form), a str is hex."""
    width = hash_width(hash_algo)
    if isinstance(value, int) and not isinstance(value, bool):
        if width is not None and width != 8:
            _fail(
                path,
                f"expected hex string of {2 * width} chars ({hash_algo} hashes are {width} "
                f"bytes), got {_describe(value)}",
            )
        try:
            return hash_from_int(value, 8)
        except ValueError:
            _fail(path, f"integer hash {value} does not fit in 64 bits (unsigned or signed)")
    if isinstance(value, str):
        if width is not None and not _is_hex(value, 2 * width):
            _fail(
                path,
                f"expected hex string of {2 * width} chars ({hash_algo} hashes are {width} "
                f"bytes), got {_describe(value)}",
            )
        if not _is_hex(value) or len(value) % 2:
            _fail(path, f"expected an even number of hex digits, got {_describe(value)}")
        return bytes.fromhex(value)
    expected = "an integer" if width == 8 else "a hex string"
    _fail(path, f"expected {expected} ({hash_algo} hash), got {_describe(value)}")


def _opt_hash(obj: Mapping[str, Any], key: str, path: str, hash_algo: str) -> bytes | None:
    value = obj.get(key)
    return None if value is None else _parse_hash(value, f"{path}.{key}", hash_algo)


def _parse_diff(obj: Mapping[str, Any], key: str, path: str, lo: int, hi: int) -> EventDiff | None:
    value = obj.get(key)
    if value is None:
        return None
    p = f"{path}.{key}"
    diff = _obj(value, p)
    _check_tag(diff, "event_diff", p)
    new = _int(_req(diff, "new_value", p), f"{p}.new_value", lo, hi)
    old = _int(_req(diff, "old_value", p), f"{p}.old_value", lo, hi)
    return _build(EventDiff, p, old_value=old, new_value=new)


def _partial_digest(first8: bytes) -> bytes:
    """A 32-byte digest of which only the first 8 bytes are known (the rest zero)."""
    return first8 + bytes(_DIGEST_LEN - len(first8))


def _parse_mm_key(value: Any, path: str) -> MmKey:
    obj = _obj(value, path)
    _check_tag(obj, "mm_key", path)
    hash_text = _str(_req(obj, "hash", path), f"{path}.hash")
    start_value = obj.get("start_offset")
    start = 0 if start_value is None else _int(start_value, f"{path}.start_offset", 0, _I32_MAX)
    uuid = _opt_str(obj, "uuid", path)
    if _is_hex(hash_text, 2 * _DIGEST_LEN):
        digest = bytes.fromhex(hash_text)
    elif _is_hex(hash_text):
        # A short hex mm hash: TensorRT-LLM's and Dynamo's consumers take int(h[:16], 16) as the
        # item's 64-bit hash, i.e. the first 8 bytes of the digest.
        digest = _partial_digest(int(hash_text[:16], 16).to_bytes(8, "big"))
    else:  # TensorRT-LLM V1: the uuid replaces the digest hex
        if not hash_text:
            _fail(f"{path}.hash", "expected a 64-char hex digest or a uuid, got an empty string")
        if uuid is not None and uuid != hash_text:
            _fail(
                f"{path}.uuid",
                f"{uuid!r} contradicts the uuid {hash_text!r} given in place of the hash",
            )
        digest, uuid = _UNKNOWN_DIGEST, hash_text
    return _build(MmKey, path, hash=digest, start_offset=start, uuid=uuid)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Pending:
    """An event whose ``event_id`` (and, for an ``all_cleared`` marker, ``window_size``) is
    assigned by :class:`TrtllmEventReader` once the whole read is known."""

    path: str
    event_id: int | None
    window_size: int | None
    hash_algo: str
    layer_group_id: int
    data: EventData


@dataclass(slots=True, frozen=True)
class _BlockDefaults:
    """Stored-event (``data``-level) values that fill blocks lacking their own."""

    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None


class _Parsed(NamedTuple):
    rank: int | None
    event: KVCacheEvent | _Pending
    #: The ``window_size`` the event itself carried (None: absent, null or 0).
    window_size: int | None
    #: An ``all_cleared`` marker (TensorRT-LLM's fan-out makes them).
    marker: bool


class TolerantRead(NamedTuple):
    """What :meth:`TrtllmEventReader.read_tolerant` made of one list: the batches of every
    event that converted and one located :class:`~kvstream.errors.InteropError` per event that
    did not."""

    batches: list[EventBatch]
    errors: list[InteropError]


def _check_config(
    tokens_per_block: int | None,
    mm_token_id_offset: int | None,
    default_window_size: int | None,
) -> None:
    for name, value, lo, hi in (
        ("tokens_per_block", tokens_per_block, 1, _I32_MAX),
        ("mm_token_id_offset", mm_token_id_offset, 0, TOKEN_ID_MAX),
        ("default_window_size", default_window_size, 1, _I64_MAX),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi
        ):
            raise ConfigError(f"{name} must be an int in {lo}..{hi} or None, got {value!r}")


def _make_event(
    path: str,
    *,
    event_id: int,
    hash_algo: str,
    layer_group_id: int,
    window_size: int,
    data: EventData,
) -> KVCacheEvent:
    try:
        return KVCacheEvent(
            event_id=event_id,
            hash_algo=hash_algo,
            layer_group_id=layer_group_id,
            window_size=window_size,
            data=data,
        )
    except EventValidationError as exc:
        raise InteropError(f"{path}: {exc}") from exc


class _Parser:
    """Parses single TensorRT-LLM event dicts; holds the reader's multimodal chain state."""

    def __init__(
        self,
        *,
        tokens_per_block: int | None,
        mm_token_id_offset: int | None,
        default_window_size: int | None,
        mm_state_capacity: int,
    ) -> None:
        _check_config(tokens_per_block, mm_token_id_offset, default_window_size)
        if isinstance(mm_state_capacity, bool) or not isinstance(mm_state_capacity, int):
            raise ConfigError(f"mm_state_capacity must be an int, got {mm_state_capacity!r}")
        if mm_state_capacity < 0:
            raise ConfigError(f"mm_state_capacity must be >= 0, got {mm_state_capacity}")
        self.tokens_per_block = tokens_per_block
        self.mm_offset = mm_token_id_offset
        self.default_window_size = default_window_size
        self._mm_capacity = mm_state_capacity
        # (hash_algo, block_hash) -> digest of the most recent multimodal item at the end of
        # that block. A function of the block's prefix, so entries never go stale; LRU-bounded.
        self._mm_items: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()

    # -- multimodal chain state ----------------------------------------------------------

    def _mm_item_after(self, hash_algo: str, block_hash: bytes | None) -> bytes | None:
        if block_hash is None:
            return None
        key = (hash_algo, block_hash)
        item = self._mm_items.get(key)
        if item is not None:
            self._mm_items.move_to_end(key)
        return item

    def _mm_remember(self, hash_algo: str, block_hash: bytes, item: bytes) -> None:
        if self._mm_capacity == 0:
            return
        key = (hash_algo, block_hash)
        self._mm_items[key] = item
        self._mm_items.move_to_end(key)
        while len(self._mm_items) > self._mm_capacity:
            self._mm_items.popitem(last=False)

    # -- envelope ----------------------------------------------------------------------------

    def parse(self, value: Any, path: str, *, allow_pending: bool) -> _Parsed:
        """Parse one event dict.

        With ``allow_pending``, an event without ``event_id`` (or an ``all_cleared`` marker
        without ``window_size``) comes back as a :class:`_Pending` for the reader to number;
        without it a missing ``event_id`` is an error.
        """
        obj = _obj(value, path)
        rank = _opt_int(obj, "attention_dp_rank", path, 0, _I32_MAX)
        dpath = f"{path}.data"
        data = _obj(_req(obj, "data", path), dpath)
        kind = _str(_req(data, "type", dpath), f"{dpath}.type")
        if kind not in _KNOWN_TYPES:
            _fail(f"{dpath}.type", f"unknown event type {kind!r}; expected one of {_KNOWN_TYPES}")

        algo_value = obj.get("hash_algo")
        algo_path = f"{path}.hash_algo"
        if algo_value is None:
            algo_value, algo_path = data.get("hash_algo"), f"{dpath}.hash_algo"
        hash_algo = DEFAULT_HASH_ALGO if algo_value is None else _str(algo_value, algo_path)
        if not 1 <= len(hash_algo) <= 64:
            _fail(algo_path, f"expected 1..64 chars, got {len(hash_algo)}")
        layer_group_id = _opt_int(obj, "layer_group_id", path, 0, _I32_MAX) or 0
        event_id = _opt_int(obj, "event_id", path, 0, _I64_MAX)
        explicit_window = _opt_int(obj, "window_size", path, 0, _I64_MAX) or None
        window = self.default_window_size if explicit_window is None else explicit_window
        if window is None and (kind != "all_cleared" or not allow_pending):
            window = UNBOUNDED_WINDOW
        if event_id is None and not allow_pending:
            _fail(
                f"{path}.event_id",
                "missing, and one event alone has no stream to number it in (read it with "
                "a TrtllmEventReader)",
            )

        payload = self._parse_data(kind, data, dpath, hash_algo)
        marker = kind == "all_cleared"
        if event_id is None or window is None:
            pending = _Pending(path, event_id, window, hash_algo, layer_group_id, payload)
            return _Parsed(rank, pending, explicit_window, marker)
        event = _make_event(
            path,
            event_id=event_id,
            hash_algo=hash_algo,
            layer_group_id=layer_group_id,
            window_size=window,
            data=payload,
        )
        return _Parsed(rank, event, explicit_window, marker)

    # -- payloads ----------------------------------------------------------------------------

    def _parse_data(
        self, kind: str, data: Mapping[str, Any], dpath: str, hash_algo: str
    ) -> EventData:
        if kind == "stored":
            return self._parse_stored(data, dpath, hash_algo)
        if kind == "removed":
            raw = _list(_req(data, "block_hashes", dpath), f"{dpath}.block_hashes")
            hashes = tuple(
                _parse_hash(h, f"{dpath}.block_hashes[{i}]", hash_algo) for i, h in enumerate(raw)
            )
            level = _opt_int(data, "cache_level", dpath, 0, _I32_MAX)
            return _build(Removed, dpath, block_hashes=hashes, cache_level=level)
        if kind == "updated":
            return _build(
                Updated,
                dpath,
                block_hash=_parse_hash(
                    _req(data, "block_hash", dpath), f"{dpath}.block_hash", hash_algo
                ),
                cache_level=_parse_diff(data, "cache_level", dpath, 0, _I32_MAX),
                priority=_parse_diff(data, "priority", dpath, PRIORITY_MIN, PRIORITY_MAX),
            )
        if kind == "created":
            return self._parse_created(data, dpath)
        if kind == "lost":
            fields: dict[str, Any] = {
                "first_event_id": _int(
                    _req(data, "first_event_id", dpath), f"{dpath}.first_event_id", 0, _I64_MAX
                ),
                "count": _int(_req(data, "count", dpath), f"{dpath}.count", 1, _I64_MAX),
            }
            reason = _opt_str(data, "reason", dpath)
            if reason is not None:
                fields["reason"] = reason
            return _build(Lost, dpath, **fields)
        return Cleared()  # "cleared" or "all_cleared"

    def _parse_created(self, data: Mapping[str, Any], dpath: str) -> Created:
        lpath = f"{dpath}.num_blocks_per_cache_level"
        levels = _list(_req(data, "num_blocks_per_cache_level", dpath), lpath)
        if not levels:
            _fail(lpath, "expected at least one cache level")
        nums = tuple(_int(n, f"{lpath}[{i}]", 0, _I64_MAX) for i, n in enumerate(levels))
        tpb = _opt_int(data, "tokens_per_block", dpath, 1, _I32_MAX)
        if tpb is None:
            tpb = self.tokens_per_block
        if tpb is None:
            _fail(
                dpath,
                "TensorRT-LLM's created events carry no tokens_per_block; pass "
                "tokens_per_block= (the engine's KV cache block size)",
            )
        kind_value = _opt_str(data, "attention_kind", dpath)
        if kind_value is None:
            attention_kind = AttentionKind.FULL
        else:
            try:
                attention_kind = AttentionKind(kind_value)
            except ValueError:
                _fail(
                    f"{dpath}.attention_kind",
                    f"unknown attention kind {kind_value!r}; expected one of "
                    f"{[k.value for k in AttentionKind]}",
                )
        return _build(
            Created,
            dpath,
            num_blocks_per_cache_level=nums,
            tokens_per_block=tpb,
            attention_kind=attention_kind,
        )

    def _parse_stored(self, data: Mapping[str, Any], dpath: str, hash_algo: str) -> Stored:
        parent = _opt_hash(data, "parent_hash", dpath, hash_algo)
        bpath = f"{dpath}.blocks"
        raw_blocks = _list(_req(data, "blocks", dpath), bpath)
        if not raw_blocks:
            _fail(bpath, "expected at least one stored_block")
        defaults = _BlockDefaults(
            lora_id=_opt_int(data, "lora_id", dpath, 0, _U64_MAX),
            lora_name=_opt_str(data, "lora_name", dpath),
            cache_salt=_opt_str(data, "cache_salt", dpath),
        )
        item = self._mm_item_after(hash_algo, parent) if self.mm_offset is not None else None
        blocks: list[StoredBlock] = []
        for j, raw in enumerate(raw_blocks):
            block, item = self._parse_block(raw, f"{bpath}[{j}]", hash_algo, item, defaults)
            blocks.append(block)
        return _build(Stored, dpath, parent_hash=parent, blocks=tuple(blocks))

    def _parse_block(
        self,
        value: Any,
        path: str,
        hash_algo: str,
        item: bytes | None,
        defaults: _BlockDefaults,
    ) -> tuple[StoredBlock, bytes | None]:
        """Parse one stored_block; ``item`` is the most recent multimodal item before it.

        Returns the block and the most recent item after it.
        """
        obj = _obj(value, path)
        _check_tag(obj, "stored_block", path)
        block_hash = _parse_hash(_req(obj, "block_hash", path), f"{path}.block_hash", hash_algo)
        tpath = f"{path}.tokens"
        raw_tokens = _list(_req(obj, "tokens", path), tpath)
        offset = self.mm_offset

        ids: list[int] = []
        extras: list[int] = []
        derived: list[tuple[bytes, int]] = []
        unknown_item_at: str | None = None
        in_run = False
        for k, raw in enumerate(raw_tokens):
            p = f"{tpath}[{k}]"
            tok = _obj(raw, p)
            _check_tag(tok, "unique_token", p)
            token_id = _req(tok, "token_id", p)
            if isinstance(token_id, str):
                if not _is_hex(token_id, 2 * _DIGEST_LEN):
                    _fail(
                        f"{p}.token_id",
                        f"expected an integer or a 64-char hex multimodal digest, "
                        f"got {_describe(token_id)}",
                    )
                if offset is None:
                    _fail(
                        f"{p}.token_id",
                        "a 64-char hex token is a TensorRT-LLM V2 multimodal digest; pass "
                        "mm_token_id_offset= (the engine's multimodal token id offset, i.e. "
                        "its vocabulary size) to decode it",
                    )
                item = bytes.fromhex(token_id)
                ids.append(offset)
                derived.append((item, 0))
                in_run = True
            else:
                tid = _int(token_id, f"{p}.token_id", -(2**31), TOKEN_ID_MAX) & TOKEN_ID_MAX
                if offset is not None:
                    if tid == offset:
                        _fail(
                            f"{p}.token_id",
                            f"token id {tid} equals mm_token_id_offset, which kvstream reserves "
                            "for multimodal digest tokens (TensorRT-LLM never emits it)",
                        )
                    if tid < offset:
                        in_run = False
                    elif not in_run:
                        in_run = True
                        if item is None:
                            unknown_item_at = unknown_item_at or f"{p}.token_id"
                        else:
                            derived.append((item, tid - offset))
                ids.append(tid)
            extra = tok.get("token_extra_id")
            if extra is None:
                extras.append(0)
            elif (
                token_id == 0
                and not isinstance(token_id, bool)
                and isinstance(extra, int)
                and not isinstance(extra, bool)
                and TOKEN_ID_MAX < extra <= _U64_MAX
            ):
                # The older V2 manager's multimodal digest token: token id 0 and the digest's
                # first 8 bytes, little-endian, as the extra id. The extra id is dropped (it
                # does not fit in uint32); the item is kept as a partial digest.
                item = _partial_digest(extra.to_bytes(8, "little"))
                derived.append((item, 0))
                in_run = True
                extras.append(0)
            else:
                extras.append(_int(extra, f"{p}.token_extra_id", 0, TOKEN_ID_MAX))

        mm_value = obj.get("mm_keys")
        mpath = f"{path}.mm_keys"
        raw_keys = () if mm_value is None else _list(mm_value, mpath)
        mm_keys = [_parse_mm_key(v, f"{mpath}[{i}]") for i, v in enumerate(raw_keys)]
        if not mm_keys and offset is not None:
            if unknown_item_at is not None:
                _fail(
                    unknown_item_at,
                    f"token id > mm_token_id_offset {offset} continues a multimodal item whose "
                    "digest token is in an ancestor block this reader has not seen, and the "
                    "block's mm_keys are empty, so they cannot be derived",
                )
            mm_keys = [
                _build(MmKey, f"{mpath}(derived)[{i}]", hash=d, start_offset=s)
                for i, (d, s) in enumerate(derived)
            ]
        elif not mm_keys and derived:  # 64-bit digest tokens, no offset to find continuations
            mm_keys = [
                _build(MmKey, f"{mpath}(derived)[{i}]", hash=d, start_offset=s)
                for i, (d, s) in enumerate(derived)
            ]
        if offset is not None and item is not None:
            self._mm_remember(hash_algo, block_hash, item)

        lora_id = _opt_int(obj, "lora_id", path, 0, _U64_MAX)
        lora_name = _opt_str(obj, "lora_name", path)
        cache_salt = _opt_str(obj, "cache_salt", path)
        block = _build(
            StoredBlock,
            path,
            block_hash=block_hash,
            token_ids=TokenIds(ids),
            token_extra_ids=TokenIds(extras) if any(extras) else None,
            lora_id=defaults.lora_id if lora_id is None else lora_id,
            lora_name=defaults.lora_name if lora_name is None else lora_name,
            cache_level=_opt_int(obj, "cache_level", path, 0, _I32_MAX) or 0,
            priority=(
                PRIORITY_DEFAULT
                if obj.get("priority") is None
                else _int(obj["priority"], f"{path}.priority", PRIORITY_MIN, PRIORITY_MAX)
            ),
            mm_keys=tuple(mm_keys),
            cache_salt=defaults.cache_salt if cache_salt is None else cache_salt,
        )
        return block, item


def _event_list(events: Any) -> Sequence[Any]:
    if isinstance(events, (str, bytes, bytearray, Mapping)) or not isinstance(events, Iterable):
        _fail("events", f"expected a list of event objects, got {_describe(events)}")
    return events if isinstance(events, (list, tuple)) else list(events)


def _first_ids(count: int, prev_id: int | None, next_id: int | None) -> int:
    """The first of ``count`` consecutive ids for events without ``event_id`` that follow
    ``prev_id`` (None: nothing before) and precede an event with ``next_id`` (None: none)."""
    low = -1 if prev_id is None else prev_id
    if next_id is not None and next_id - count > low:
        return next_id - count
    return low + 1


class TrtllmEventReader:
    """Reads successive TensorRT-LLM event lists of one engine into :class:`EventBatch` objects.

    One reader per engine process (``instance_id``, ``incarnation``). Each :meth:`read` converts
    one list (one ``get_kv_cache_events()`` result or ``POST /kv_cache_events`` drain). Between
    reads it keeps, per attention-DP rank, the last event id (so events without ``event_id`` are
    numbered on from it, see the module docs); the largest ``window_size`` seen; and,
    LRU-bounded by ``mm_state_capacity``, the most recent multimodal item at the end of each
    multimodal block (so ``mm_keys`` of a block continuing an item can be derived later). State
    changes only when a read succeeds, except the multimodal memory, which holds facts that are
    true whatever happens to the rest of the read. :meth:`numbering_state` /
    :meth:`restore_numbering` save and restore the ids and window (not the multimodal memory).

    Raises :class:`~kvstream.errors.ConfigError` for bad arguments.
    """

    def __init__(
        self,
        *,
        instance_id: str,
        incarnation: int = 0,
        tokens_per_block: int | None = None,
        mm_token_id_offset: int | None = None,
        default_window_size: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
        mm_state_capacity: int = _DEFAULT_MM_STATE_CAPACITY,
    ) -> None:
        self._parser = _Parser(
            tokens_per_block=tokens_per_block,
            mm_token_id_offset=mm_token_id_offset,
            default_window_size=default_window_size,
            mm_state_capacity=mm_state_capacity,
        )
        self._sources: dict[int | None, SourceId] = {}
        try:
            self._sources[None] = SourceId(instance_id=instance_id, incarnation=incarnation)
        except EventValidationError as exc:
            raise ConfigError(f"bad source for TensorRT-LLM events: {exc}") from exc
        self._instance_id = instance_id
        self._incarnation = incarnation
        self._clock = clock
        self._last_ids: dict[int | None, int] = {}
        self._max_window: int | None = None

    def _source(self, rank: int | None) -> SourceId:
        source = self._sources.get(rank)
        if source is None:
            source = SourceId(
                instance_id=self._instance_id, attention_dp_rank=rank, incarnation=self._incarnation
            )
            self._sources[rank] = source
        return source

    def _stamp(self, ts_ns: int | None) -> int:
        if ts_ns is None:
            return self._clock.time_ns()
        if isinstance(ts_ns, bool) or not isinstance(ts_ns, int) or not 0 <= ts_ns <= _I64_MAX:
            raise ConfigError(f"ts_ns must be an int in 0..{_I64_MAX} or None, got {ts_ns!r}")
        return ts_ns

    def numbering_state(self) -> dict[str, Any]:
        """The JSON-able state that numbers events without ``event_id`` and windows markers:
        ``{"last_ids": [[rank, id], ...], "max_window": int | None}`` (rank null: no rank)."""
        return {
            "last_ids": [[rank, event_id] for rank, event_id in self._last_ids.items()],
            "max_window": self._max_window,
        }

    def restore_numbering(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`numbering_state` (e.g. a source resuming from a checkpoint).

        Raises :class:`~kvstream.errors.ConfigError` for a malformed state.
        """
        try:
            pairs = state["last_ids"]
            last_ids: dict[int | None, int] = {}
            for rank, event_id in pairs:
                if rank is not None:
                    _int(rank, "rank", 0, _I32_MAX)
                last_ids[rank] = _int(event_id, "event_id", 0, _I64_MAX)
            window = state.get("max_window")
            max_window = None if window is None else _int(window, "max_window", 1, _I64_MAX)
        except (KeyError, TypeError, ValueError, InteropError) as exc:
            raise ConfigError(f"not a TensorRT-LLM reader numbering state: {state!r}") from exc
        self._last_ids = last_ids
        self._max_window = max_window

    def read(
        self, events: Iterable[Mapping[str, Any]], *, ts_ns: int | None = None
    ) -> list[EventBatch]:
        """Convert one list of TensorRT-LLM event dicts into one batch per attention-DP rank.

        Batches come in the order each rank is first seen (no rank is a source of its own);
        each keeps its rank's events in input order. ``ts_ns`` (default: the clock's wall
        time) stamps every batch. An empty list gives ``[]``.

        Raises :class:`~kvstream.errors.InteropError` naming ``event[i]`` and the field path
        for malformed input; then no batch is returned.
        """
        stamp = self._stamp(ts_ns)
        return self._read(_event_list(events), 0, stamp)

    def read_tolerant(
        self, events: Iterable[Mapping[str, Any]], *, ts_ns: int | None = None
    ) -> TolerantRead:
        """Like :meth:`read`, but a malformed event costs only itself.

        When the whole list converts, this is :meth:`read`. Otherwise each event is read on
        its own (so events without ``event_id`` are numbered without look-ahead) and the
        events that convert are grouped into one batch per rank, in order; each event that
        does not gives one ``InteropError`` naming ``event[i]``. Used by bridges (file sources,
        the in-process pump) that must count bad input and go on.
        """
        stamp = self._stamp(ts_ns)
        try:
            items = _event_list(events)
        except InteropError as exc:
            return TolerantRead([], [exc])
        try:
            return TolerantRead(self._read(items, 0, stamp), [])
        except InteropError:
            pass
        per_rank: dict[int | None, list[KVCacheEvent]] = {}
        errors: list[InteropError] = []
        for i, raw in enumerate(items):
            try:
                for batch in self._read([raw], i, stamp):
                    per_rank.setdefault(batch.source.attention_dp_rank, []).extend(batch.events)
            except InteropError as exc:
                errors.append(exc)
        batches = [
            EventBatch(source=self._source(rank), ts_ns=stamp, events=tuple(evs))
            for rank, evs in per_rank.items()
        ]
        return TolerantRead(batches, errors)

    def _read(self, items: Sequence[Any], base: int, stamp: int) -> list[EventBatch]:
        parsed = [
            self._parser.parse(raw, f"event[{base + i}]", allow_pending=True)
            for i, raw in enumerate(items)
        ]
        if not parsed:
            return []
        # TensorRT-LLM's fan-out stamps rank 0 on its all_cleared marker even when the engine
        # runs without attention DP (its events carry no rank): the marker is then the rank-less
        # source's.
        ranks = {p.rank for p in parsed if not p.marker}.union(self._last_ids)
        marker_rank_zero_is_none = None in ranks and 0 not in ranks
        per_rank: dict[int | None, list[KVCacheEvent | _Pending]] = {}
        max_window = self._max_window
        for p in parsed:
            rank = None if p.marker and p.rank == 0 and marker_rank_zero_is_none else p.rank
            per_rank.setdefault(rank, []).append(p.event)
            window = p.window_size
            if window is not None and (max_window is None or window > max_window):
                max_window = window

        batches: list[EventBatch] = []
        last_ids: dict[int | None, int] = {}
        for rank, pending in per_rank.items():
            resolved = self._resolve(pending, self._last_ids.get(rank), max_window)
            last_ids[rank] = resolved[-1].event_id
            batches.append(
                EventBatch(source=self._source(rank), ts_ns=stamp, events=tuple(resolved))
            )
        self._last_ids.update(last_ids)
        self._max_window = max_window
        return batches

    @staticmethod
    def _resolve(
        events: list[KVCacheEvent | _Pending], prev_id: int | None, max_window: int | None
    ) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        j = 0
        while j < len(events):
            ev = events[j]
            if isinstance(ev, KVCacheEvent):
                out.append(ev)
                prev_id = ev.event_id
                j += 1
                continue
            k = j
            if ev.event_id is None:  # a run of events without ids, up to the next id
                while (
                    k < len(events)
                    and isinstance(events[k], _Pending)
                    and events[k].event_id is None
                ):
                    k += 1
                next_id = events[k].event_id if k < len(events) else None
                first = _first_ids(k - j, prev_id, next_id)
            else:  # a marker with an id but no window
                k, first = j + 1, ev.event_id
            for n, pending in enumerate(events[j:k]):
                assert isinstance(pending, _Pending)
                window = pending.window_size
                if window is None:  # all_cleared: the fan-out forwards the largest window
                    window = UNBOUNDED_WINDOW if max_window is None else max_window
                out.append(
                    _make_event(
                        pending.path,
                        event_id=first + n,
                        hash_algo=pending.hash_algo,
                        layer_group_id=pending.layer_group_id,
                        window_size=window,
                        data=pending.data,
                    )
                )
            prev_id = out[-1].event_id
            j = k
        return out


def from_trtllm_events(
    events: Iterable[Mapping[str, Any]],
    *,
    instance_id: str,
    incarnation: int = 0,
    ts_ns: int | None = None,
    tokens_per_block: int | None = None,
    mm_token_id_offset: int | None = None,
    default_window_size: int | None = None,
) -> list[EventBatch]:
    """Convert TensorRT-LLM event dicts (``LLM.get_kv_cache_events()``, ``POST
    /kv_cache_events``) into one :class:`EventBatch` per attention-DP rank.

    Batches come in the order each rank is first seen, with ``attention_dp_rank`` absent/null
    as one more source without rank; each keeps its rank's events in input order. Every batch
    gets ``SourceId(instance_id, rank, incarnation)`` and ``ts_ns`` (default: now).
    ``tokens_per_block`` is required when the list holds ``created`` events;
    ``mm_token_id_offset`` when it holds V2 multimodal (hex) tokens; ``default_window_size``
    is the window of events without ``window_size``. A one-shot :class:`TrtllmEventReader`:
    use a reader to keep state (event numbering, multimodal items) across successive lists.
    See the module docs for every rule.

    Raises :class:`~kvstream.errors.InteropError` (location-prefixed) for malformed input and
    :class:`~kvstream.errors.ConfigError` for bad arguments.
    """
    reader = TrtllmEventReader(
        instance_id=instance_id,
        incarnation=incarnation,
        tokens_per_block=tokens_per_block,
        mm_token_id_offset=mm_token_id_offset,
        default_window_size=default_window_size,
    )
    return reader.read(events, ts_ns=ts_ns)


def from_trtllm_event(
    event: Mapping[str, Any],
    *,
    tokens_per_block: int | None = None,
    mm_token_id_offset: int | None = None,
    default_window_size: int | None = None,
) -> RankedEvent:
    """Convert one TensorRT-LLM event dict into ``(attention_dp_rank, KVCacheEvent)``.

    Same rules as :func:`from_trtllm_events`, except that nothing is inferred from other
    events: the event must carry its ``event_id`` (one event alone has no stream to number it
    in), an ``all_cleared`` marker without ``window_size`` gets ``default_window_size`` else
    :data:`~kvstream.events.model.UNBOUNDED_WINDOW`, and multimodal items continued from an
    ancestor block cannot be resolved unless the block lists its ``mm_keys``. Errors are
    located under ``event``.
    """
    parser = _Parser(
        tokens_per_block=tokens_per_block,
        mm_token_id_offset=mm_token_id_offset,
        default_window_size=default_window_size,
        mm_state_capacity=0,
    )
    parsed = parser.parse(event, "event", allow_pending=False)
    assert isinstance(parsed.event, KVCacheEvent)  # allow_pending=False never defers
    return RankedEvent(parsed.rank, parsed.event)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _hash_out(block_hash: bytes) -> int | str:
    return hash_to_int(block_hash) if len(block_hash) == 8 else hash_to_hex(block_hash)


def _diff_out(diff: EventDiff | None) -> dict[str, Any] | None:
    if diff is None:
        return None
    return {"type": "event_diff", "new_value": diff.new_value, "old_value": diff.old_value}


def _mm_key_out(key: MmKey, mode: MmUuidMode) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "mm_key"}
    if key.uuid is not None and (mode == "replaces_hash" or key.hash == _UNKNOWN_DIGEST):
        out["hash"] = key.uuid
    else:
        out["hash"] = key.hash.hex()
        if key.uuid is not None:
            out["uuid"] = key.uuid
    out["start_offset"] = key.start_offset
    return out


def _tokens_out(block: StoredBlock, path: str, mm_offset: int | None) -> list[dict[str, Any]]:
    ids = block.token_ids.tolist()
    extras = block.token_extra_ids.tolist() if block.token_extra_ids is not None else None
    digests = [k for k in block.mm_keys if k.start_offset == 0] if mm_offset is not None else []
    used = 0
    out: list[dict[str, Any]] = []
    for k, tid in enumerate(ids):
        token: int | str = tid
        if mm_offset is not None and tid == mm_offset:
            if used >= len(digests):
                _fail(
                    f"{path}.token_ids[{k}]",
                    f"token id {tid} equals mm_token_id_offset (a multimodal digest token) but "
                    "the block has no unused mm_key with start_offset 0 to take the digest from",
                )
            key = digests[used]
            if key.hash == _UNKNOWN_DIGEST and key.uuid is not None:
                _fail(
                    f"{path}.token_ids[{k}]",
                    f"the digest of multimodal item {key.uuid!r} is unknown (only its uuid "
                    "was published), so its digest token cannot be written",
                )
            token = key.hash.hex()
            used += 1
        out.append(
            {
                "type": "unique_token",
                "token_id": token,
                "token_extra_id": extras[k] if extras is not None else 0,
            }
        )
    return out


def _data_out(
    data: EventData,
    path: str,
    *,
    mm_token_id_offset: int | None,
    mm_uuid_mode: MmUuidMode,
    extensions: bool,
) -> dict[str, Any]:
    if isinstance(data, Stored):
        blocks: list[dict[str, Any]] = []
        for j, b in enumerate(data.blocks):
            bpath = f"{path}.blocks[{j}]"
            block: dict[str, Any] = {
                "type": "stored_block",
                "block_hash": _hash_out(b.block_hash),
                "tokens": _tokens_out(b, bpath, mm_token_id_offset),
                "cache_level": b.cache_level,
                "priority": b.priority,
                "mm_keys": [_mm_key_out(k, mm_uuid_mode) for k in b.mm_keys],
                "cache_salt": b.cache_salt,
            }
            if b.lora_id is not None:
                block["lora_id"] = b.lora_id
            if b.lora_name is not None:
                block["lora_name"] = b.lora_name
            blocks.append(block)
        parent = None if data.parent_hash is None else _hash_out(data.parent_hash)
        return {"type": "stored", "parent_hash": parent, "blocks": blocks}
    if isinstance(data, Removed):
        out: dict[str, Any] = {
            "type": "removed",
            "block_hashes": [_hash_out(h) for h in data.block_hashes],
        }
        if extensions and data.cache_level is not None:
            out["cache_level"] = data.cache_level
        return out
    if isinstance(data, Updated):
        return {
            "type": "updated",
            "block_hash": _hash_out(data.block_hash),
            "cache_level": _diff_out(data.cache_level),
            "priority": _diff_out(data.priority),
        }
    if isinstance(data, Created):
        out = {
            "type": "created",
            "num_blocks_per_cache_level": list(data.num_blocks_per_cache_level),
        }
        if extensions:
            out["tokens_per_block"] = data.tokens_per_block
            out["attention_kind"] = data.attention_kind.value
        return out
    if isinstance(data, Lost):
        return {
            "type": "lost",
            "first_event_id": data.first_event_id,
            "count": data.count,
            "reason": data.reason,
        }
    return {"type": "cleared"}


def _event_out(
    event: KVCacheEvent,
    path: str,
    *,
    attention_dp_rank: int | None,
    include_hash_algo: bool,
    mm_token_id_offset: int | None,
    mm_uuid_mode: MmUuidMode,
    extensions: bool,
) -> dict[str, Any]:
    if not include_hash_algo and event.hash_algo != DEFAULT_HASH_ALGO:
        _fail(
            f"{path}.hash_algo",
            f"include_hash_algo=False writes TensorRT-LLM V1's shape, which readers take as "
            f"{DEFAULT_HASH_ALGO!r}; this event's hashes are {event.hash_algo!r}",
        )
    out: dict[str, Any] = {
        "event_id": event.event_id,
        "data": _data_out(
            event.data,
            f"{path}.data",
            mm_token_id_offset=mm_token_id_offset,
            mm_uuid_mode=mm_uuid_mode,
            extensions=extensions,
        ),
        "window_size": event.window_size,
    }
    if attention_dp_rank is not None:
        out["attention_dp_rank"] = attention_dp_rank
    if include_hash_algo:
        out["hash_algo"] = event.hash_algo
    out["layer_group_id"] = event.layer_group_id
    return out


def _check_write_options(mm_token_id_offset: int | None, mm_uuid_mode: str) -> None:
    _check_config(None, mm_token_id_offset, None)
    if mm_uuid_mode not in ("additive", "replaces_hash"):
        raise ConfigError(
            f"mm_uuid_mode must be 'additive' or 'replaces_hash', got {mm_uuid_mode!r}"
        )


def to_trtllm_event(
    event: KVCacheEvent,
    *,
    attention_dp_rank: int | None = None,
    include_hash_algo: bool = True,
    mm_token_id_offset: int | None = None,
    mm_uuid_mode: MmUuidMode = "additive",
    extensions: bool = False,
) -> dict[str, Any]:
    """One event as a JSON-ready dict in TensorRT-LLM's serializer shape.

    ``attention_dp_rank`` is written only when not None. ``include_hash_algo=False`` omits
    ``hash_algo`` (V1's shape) and raises :class:`~kvstream.errors.InteropError` for events
    whose algorithm is not ``v1_block_key``. ``cleared``/``lost`` are always written (see
    :func:`to_trtllm_events` for dropping them). Other options: see :func:`to_trtllm_events`.
    Errors are located under ``event``.
    """
    _check_write_options(mm_token_id_offset, mm_uuid_mode)
    return _event_out(
        event,
        "event",
        attention_dp_rank=attention_dp_rank,
        include_hash_algo=include_hash_algo,
        mm_token_id_offset=mm_token_id_offset,
        mm_uuid_mode=mm_uuid_mode,
        extensions=extensions,
    )


def to_trtllm_events(
    batches: EventBatch | Iterable[EventBatch],
    *,
    include_hash_algo: bool = True,
    include_kvstream_kinds: bool = True,
    mm_token_id_offset: int | None = None,
    mm_uuid_mode: MmUuidMode = "additive",
    extensions: bool = False,
) -> list[dict[str, Any]]:
    """Batches as the JSON-ready list TensorRT-LLM's ``get_kv_cache_events()`` returns.

    Events are written batch after batch, in order; each carries its batch's
    ``attention_dp_rank`` (omitted when None). The batch's ``instance_id``, ``incarnation``,
    ``ts_ns`` and ``schema_version`` are not written (TensorRT-LLM has no place for them).

    - ``include_hash_algo``: write ``hash_algo`` (V2's shape, the default). ``False`` writes V1's
      shape and raises :class:`~kvstream.errors.InteropError` for a non-``v1_block_key`` event.
    - ``include_kvstream_kinds``: write ``cleared``/``lost`` events (``{"type": "cleared"}``,
      ``{"type": "lost", "first_event_id", "count", "reason"}``); ``False`` drops them, which
      leaves gaps in the event ids.
    - ``mm_token_id_offset``: write each token id equal to it as the hex digest of the block's
      next ``mm_key`` with ``start_offset == 0`` (TensorRT-LLM V2 multimodal tokens); raises
      ``InteropError`` when the block has no such key left.
    - ``mm_uuid_mode``: ``"additive"`` (``uuid`` key beside the digest, V2) or
      ``"replaces_hash"`` (the uuid in place of the digest hex, V1). Keys whose digest is
      unknown are always written in the replaces-hash form.
    - ``extensions``: also write kvstream fields TensorRT-LLM lacks (``created.tokens_per_block``,
      ``created.attention_kind``, ``removed.cache_level``) so reading back loses nothing.

    Raises ``TypeError`` for an argument that is not an :class:`EventBatch` (or an iterable of
    them) and :class:`~kvstream.errors.ConfigError` for bad options.
    """
    _check_write_options(mm_token_id_offset, mm_uuid_mode)
    items = [batches] if isinstance(batches, EventBatch) else list(batches)
    out: list[dict[str, Any]] = []
    for b, batch in enumerate(items):
        if not isinstance(batch, EventBatch):
            raise TypeError(f"batches[{b}]: expected an EventBatch, got {type(batch).__name__}")
        rank = batch.source.attention_dp_rank
        for e, event in enumerate(batch.events):
            if not include_kvstream_kinds and isinstance(event.data, (Cleared, Lost)):
                continue
            out.append(
                _event_out(
                    event,
                    f"batches[{b}].events[{e}]",
                    attention_dp_rank=rank,
                    include_hash_algo=include_hash_algo,
                    mm_token_id_offset=mm_token_id_offset,
                    mm_uuid_mode=mm_uuid_mode,
                    extensions=extensions,
                )
            )
    return out


# --------------------------------------------------------------------------------------------
# In-process pump
# --------------------------------------------------------------------------------------------

log = logging.getLogger("kvstream.engines.trtllm")

#: How many malformed events :class:`PumpStats` remembers (all are counted).
_RECENT_MALFORMED: Final = 100


class BatchSubmitter(Protocol):
    """What :func:`pump` uses of a pipeline: :meth:`kvstream.pipeline.Pipeline.submit`
    (thread-safe; True when every sink's queue took the batch)."""

    def submit(self, batch: EventBatch) -> bool: ...


class KvEventsLLM(Protocol):
    """What :func:`pump` uses of TensorRT-LLM's ``LLM``: ``get_kv_cache_events_async(timeout)``,
    which returns an async iterable of event dicts (an ``IterationResult``, or an async
    generator in proxies and tests); an awaitable list is accepted too."""

    def get_kv_cache_events_async(self, timeout: float | None) -> Any: ...


@dataclass
class PumpStats:
    """What :func:`pump` did: ``polls`` of the engine, ``events`` received, ``batches``
    submitted, ``refused`` batches (``submit`` returned False: a sink's queue dropped them and
    the pipeline put a ``lost`` marker in their place), ``malformed`` events skipped (the most
    recent messages in ``recent_malformed``) and ``poll_errors`` (polls that raised; logged)."""

    polls: int = 0
    events: int = 0
    batches: int = 0
    refused: int = 0
    malformed: int = 0
    poll_errors: int = 0
    recent_malformed: deque[str] = field(default_factory=lambda: deque(maxlen=_RECENT_MALFORMED))


class _Pump:
    """One :func:`pump` run: polls, converts, submits."""

    def __init__(
        self,
        llm: KvEventsLLM,
        pipeline: BatchSubmitter,
        reader: TrtllmEventReader,
        stats: PumpStats,
        *,
        poll_timeout_s: float | None,
        max_events_per_read: int,
    ) -> None:
        self.llm = llm
        self.pipeline = pipeline
        self.reader = reader
        self.stats = stats
        self.poll_timeout_s = poll_timeout_s
        self.max_events_per_read = max_events_per_read

    def flush(self, events: list[Any]) -> None:
        """Convert one drain's events (malformed ones counted, never raised) and submit."""
        if not events:
            return
        self.stats.events += len(events)
        result = self.reader.read_tolerant(events)
        for error in result.errors:
            self.stats.malformed += 1
            self.stats.recent_malformed.append(str(error))
            log.warning("TensorRT-LLM pump: skipping a malformed event: %s", error)
        for batch in result.batches:
            self.stats.batches += 1
            if not self.pipeline.submit(batch):
                self.stats.refused += 1

    async def poll(self) -> int:
        """One ``get_kv_cache_events_async`` drain; returns how many events it brought."""
        self.stats.polls += 1
        events: list[Any] = []
        received = 0
        try:
            result = self.llm.get_kv_cache_events_async(self.poll_timeout_s)
            if hasattr(result, "__aiter__"):
                async for event in result:
                    events.append(event)
                    received += 1
                    if len(events) >= self.max_events_per_read:
                        self.flush(events)
                        events = []
            else:
                drained = await result
                events.extend(drained or ())
                received += len(events)
        except (asyncio.TimeoutError, TimeoutError, asyncio.QueueEmpty):
            pass  # nothing (more) arrived within the timeout
        except asyncio.CancelledError:
            self.flush(events)  # what was drained is the engine's only copy
            raise
        except Exception as exc:  # a failing poll must not end the pump
            self.stats.poll_errors += 1
            log.warning("TensorRT-LLM pump: get_kv_cache_events_async failed: %r", exc)
        self.flush(events)
        return received


async def _idle(stop: asyncio.Event | None, seconds: float) -> None:
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def pump(
    llm: KvEventsLLM,
    pipeline: BatchSubmitter,
    *,
    instance_id: str,
    incarnation: int = 0,
    tokens_per_block: int | None = None,
    mm_token_id_offset: int | None = None,
    default_window_size: int | None = None,
    stop: asyncio.Event | None = None,
    poll_timeout_s: float | None = 0.0,
    min_sleep_s: float = 0.005,
    max_sleep_s: float = 0.02,
    backoff: float = 1.5,
    max_events_per_read: int = 4096,
    reader: TrtllmEventReader | None = None,
    stats: PumpStats | None = None,
) -> PumpStats:
    """Stream a live TensorRT-LLM ``LLM``'s KV-cache events into ``pipeline``, in-process.

    The loop is NVIDIA Dynamo's TensorRT-LLM publisher's: call
    ``llm.get_kv_cache_events_async(poll_timeout_s)`` (default 0: return at once), iterate the
    result asynchronously, treat ``TimeoutError``/``QueueEmpty`` as "nothing more", and when a
    poll brought nothing sleep ``min_sleep_s``, growing by ``backoff`` up to ``max_sleep_s``
    (reset by the next event). Each drain (at most ``max_events_per_read`` events) is converted
    by one :class:`TrtllmEventReader` (``instance_id``, ``incarnation``, ``tokens_per_block``,
    ``mm_token_id_offset``, ``default_window_size``; or pass ``reader``) with
    :meth:`~TrtllmEventReader.read_tolerant` and each resulting batch is handed to
    ``pipeline.submit`` (any object with ``submit(batch) -> bool``;
    :class:`kvstream.pipeline.Pipeline` is one). Called on the pipeline's own event loop,
    ``Pipeline.submit`` never waits, so a ``block`` sink's full queue drops (and the pipeline
    accounts for it) rather than stalling; run the pump on another loop or thread to get
    backpressure.

    Never ended by bad input: a malformed event is counted and logged and the rest of its
    drain delivered; a poll that raises is counted and logged, and polling goes on. Ends when
    ``stop`` is set (checked between polls and during the idle sleep) and returns the
    :class:`PumpStats` (``stats`` if given, updated live); on cancellation the events already
    drained are submitted before ``CancelledError`` propagates.

    Raises :class:`~kvstream.errors.ConfigError` for bad arguments.
    """
    for name, value in (
        ("min_sleep_s", min_sleep_s),
        ("max_sleep_s", max_sleep_s),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not backoff >= 1:
        raise ConfigError(f"backoff must be a number >= 1, got {backoff!r}")
    if (
        isinstance(max_events_per_read, bool)
        or not isinstance(max_events_per_read, int)
        or max_events_per_read < 1
    ):
        raise ConfigError(f"max_events_per_read must be an int >= 1, got {max_events_per_read!r}")
    if reader is None:
        reader = TrtllmEventReader(
            instance_id=instance_id,
            incarnation=incarnation,
            tokens_per_block=tokens_per_block,
            mm_token_id_offset=mm_token_id_offset,
            default_window_size=default_window_size,
        )
    stats = PumpStats() if stats is None else stats
    run = _Pump(
        llm,
        pipeline,
        reader,
        stats,
        poll_timeout_s=poll_timeout_s,
        max_events_per_read=max_events_per_read,
    )
    sleep_s = float(min_sleep_s)
    while stop is None or not stop.is_set():
        if await run.poll():
            sleep_s = float(min_sleep_s)
            continue
        await _idle(stop, sleep_s)
        sleep_s = min(float(max_sleep_s), sleep_s * backoff)
    return stats
