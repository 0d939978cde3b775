"""Conversion both ways between kvstream's event model and TensorRT-LLM's JSON KV-cache events.

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
engine (each ``POST /kv_cache_events`` drains the engine's queue).

Contracts
=========

Errors. Malformed input (a missing field, a wrong type, an unknown ``type`` tag, bad hex, a hash
of the wrong width, an out-of-range integer) raises :class:`~kvstream.errors.InteropError` whose
message starts with the location, e.g.
``event[3].data.blocks[1].block_hash: expected hex string of 64 chars ...``; never ``KeyError``
or ``TypeError``. A value the event model rejects (:class:`~kvstream.errors.EventValidationError`)
is re-raised as an ``InteropError`` with the same location prefix (the original is chained as
``__cause__``). Bad *arguments* (an empty ``instance_id``, ``tokens_per_block=0``) raise
:class:`~kvstream.errors.ConfigError`.

Defaults when reading (what TensorRT-LLM omits or leaves null):

- ``hash_algo`` missing or null: ``data.hash_algo`` (TensorRT-LLM's router reads that too),
  else ``"v1_block_key"`` (V1 C++ events carry none).
- ``layer_group_id`` missing or null: 0. ``attention_dp_rank`` missing or null: no rank.
- ``window_size`` missing: the ``default_window_size`` argument (serializers before
  TensorRT-LLM #5580 had none), else an error.
- In a stored block: ``token_extra_id`` 0, ``cache_level`` 0, ``priority`` 35, ``mm_keys`` [],
  ``cache_salt`` null, ``parent_hash`` null. All-zero extra ids become
  ``token_extra_ids=None``; a ``type`` tag may be omitted but must be right when present.
- Unknown keys are ignored (newer serializers may add fields).

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
as uint32; TensorRT-LLM's type is wider but no producer uses that range).

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

``mm_key`` uuids. V2 publishes ``{"hash": <digest hex>, "start_offset", "uuid"?}`` (additive).
V1's serializer puts the uuid *in place of* the digest (``"hash": "<uuid>"``). A ``hash`` that is
not 64 hex chars is read as such a uuid; the digest is then unknown and stored as 32 zero bytes
(``MmKey.hash == bytes(32)`` with ``uuid`` set means "peer published only the uuid"). A key with
the zero digest and a uuid is always written back in the uuid-replaces-hash form; other keys
follow ``mm_uuid_mode`` (``"additive"`` by default, or ``"replaces_hash"``). A uuid that is
itself 64 hex chars cannot be told from a digest and is read as one.

``created``. TensorRT-LLM does not publish ``tokens_per_block``; the ``tokens_per_block``
argument supplies it (no inference from stored blocks: V1 publishes partial blocks, so a
block's length does not tell the block size). A ``created`` event without either raises
``InteropError``. ``attention_kind`` is FULL unless the data carries a kvstream extension key.

Kinds TensorRT-LLM lacks. ``cleared`` is written ``{"type": "cleared"}`` and ``lost`` as
``{"type": "lost", "first_event_id", "count", "reason"}``; ``include_kvstream_kinds=False``
drops them (their ids then show as gaps, which TensorRT-LLM's own fan-out treats as lost
state). Both are accepted when reading, and so is ``{"type": "all_cleared"}``, which
TensorRT-LLM's ``KvEventFanout`` injects on an id gap, read as ``cleared``. Those markers carry
no ``event_id`` and no ``window_size``: :class:`TrtllmEventReader` gives one the id before the
rank's next event in the same read (the last lost id; ids stay monotonic), else the rank's
previous id + 1, else 0; and the window ``default_window_size``, else the largest
``window_size`` the reader has seen (the fan-out only forwards the largest window), else an
error. :func:`from_trtllm_event` requires both fields.

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
derived ``mm_keys`` filled in, unknown keys dropped, and ``all_cleared`` written as
``cleared`` with the inferred id and window.

Grouping. Events are grouped by ``attention_dp_rank`` (missing/null is one more source, without
rank) into one batch per rank; batches come in the order each rank is first seen and each keeps
its rank's events in input order (TensorRT-LLM's ids are monotonic per rank only).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple, NoReturn, TypeVar

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
    "MmUuidMode",
    "RankedEvent",
    "TrtllmEventReader",
    "from_trtllm_event",
    "from_trtllm_events",
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


def _parse_mm_key(value: Any, path: str) -> MmKey:
    obj = _obj(value, path)
    _check_tag(obj, "mm_key", path)
    hash_text = _str(_req(obj, "hash", path), f"{path}.hash")
    start = _int(_req(obj, "start_offset", path), f"{path}.start_offset", 0, _I32_MAX)
    uuid = _opt_str(obj, "uuid", path)
    if _is_hex(hash_text, 2 * _DIGEST_LEN):
        digest = bytes.fromhex(hash_text)
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


@dataclass
class _PendingClear:
    """An ``all_cleared`` marker whose event_id and/or window_size is inferred after the pass."""

    path: str
    event_id: int | None
    window_size: int | None
    hash_algo: str
    layer_group_id: int


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

    def parse(
        self, value: Any, path: str, *, allow_pending: bool
    ) -> tuple[int | None, KVCacheEvent | _PendingClear]:
        """Parse one event dict into (attention_dp_rank, event).

        With ``allow_pending``, an ``all_cleared`` marker missing its ``event_id`` or
        ``window_size`` comes back as a :class:`_PendingClear` for the caller to complete.
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
        window = _opt_int(obj, "window_size", path, 1, _I64_MAX)
        if window is None:
            window = self.default_window_size

        if kind == "all_cleared" and allow_pending and (event_id is None or window is None):
            return rank, _PendingClear(path, event_id, window, hash_algo, layer_group_id)
        if event_id is None:
            _fail(f"{path}.event_id", "missing required field")
        if window is None:
            _fail(f"{path}.window_size", "missing, and no default_window_size was given")

        payload = self._parse_data(kind, data, dpath, hash_algo)
        try:
            event = KVCacheEvent(
                event_id=event_id,
                hash_algo=hash_algo,
                layer_group_id=layer_group_id,
                window_size=window,
                data=payload,
            )
        except EventValidationError as exc:
            raise InteropError(f"{path}: {exc}") from exc
        return rank, event

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
        item = self._mm_item_after(hash_algo, parent) if self.mm_offset is not None else None
        blocks: list[StoredBlock] = []
        for j, raw in enumerate(raw_blocks):
            block, item = self._parse_block(raw, f"{bpath}[{j}]", hash_algo, item)
            blocks.append(block)
        return _build(Stored, dpath, parent_hash=parent, blocks=tuple(blocks))

    def _parse_block(
        self, value: Any, path: str, hash_algo: str, item: bytes | None
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
            extras.append(
                0 if extra is None else _int(extra, f"{p}.token_extra_id", 0, TOKEN_ID_MAX)
            )

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
        if offset is not None and item is not None:
            self._mm_remember(hash_algo, block_hash, item)

        block = _build(
            StoredBlock,
            path,
            block_hash=block_hash,
            token_ids=TokenIds(ids),
            token_extra_ids=TokenIds(extras) if any(extras) else None,
            lora_id=_opt_int(obj, "lora_id", path, 0, _U64_MAX),
            lora_name=_opt_str(obj, "lora_name", path),
            cache_level=_opt_int(obj, "cache_level", path, 0, _I32_MAX) or 0,
            priority=(
                PRIORITY_DEFAULT
                if obj.get("priority") is None
                else _int(obj["priority"], f"{path}.priority", PRIORITY_MIN, PRIORITY_MAX)
            ),
            mm_keys=tuple(mm_keys),
            cache_salt=_opt_str(obj, "cache_salt", path),
        )
        return block, item


def _event_list(events: Any) -> Sequence[Any]:
    if isinstance(events, (str, bytes, bytearray, Mapping)) or not isinstance(events, Iterable):
        _fail("events", f"expected a list of event objects, got {_describe(events)}")
    return events if isinstance(events, (list, tuple)) else list(events)


class TrtllmEventReader:
    """Reads successive TensorRT-LLM event lists of one engine into :class:`EventBatch` objects.

    One reader per engine process (``instance_id``, ``incarnation``). Each :meth:`read` converts
    one list (one ``get_kv_cache_events()`` result or ``POST /kv_cache_events`` drain). Between
    reads it keeps, per attention-DP rank, the last event id; the largest ``window_size`` seen;
    and, LRU-bounded by ``mm_state_capacity``, the most recent multimodal item at the end of each
    multimodal block (so ``mm_keys`` of a block continuing an item can be derived later). State
    changes only when a read succeeds, except the multimodal memory, which holds facts that are
    true whatever happens to the rest of the read.

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
        if ts_ns is not None and (
            isinstance(ts_ns, bool) or not isinstance(ts_ns, int) or not 0 <= ts_ns <= _I64_MAX
        ):
            raise ConfigError(f"ts_ns must be an int in 0..{_I64_MAX} or None, got {ts_ns!r}")
        items = _event_list(events)
        per_rank: dict[int | None, list[KVCacheEvent | _PendingClear]] = {}
        max_window = self._max_window
        for i, raw in enumerate(items):
            rank, event = self._parser.parse(raw, f"event[{i}]", allow_pending=True)
            per_rank.setdefault(rank, []).append(event)
            if isinstance(event, KVCacheEvent) and (
                max_window is None or event.window_size > max_window
            ):
                max_window = event.window_size
        if not per_rank:
            return []

        stamp = self._clock.time_ns() if ts_ns is None else ts_ns
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
        events: list[KVCacheEvent | _PendingClear], prev_id: int | None, max_window: int | None
    ) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for j, ev in enumerate(events):
            if isinstance(ev, KVCacheEvent):
                out.append(ev)
                prev_id = ev.event_id
                continue
            event_id = ev.event_id
            if event_id is None:
                next_id = next(
                    (e.event_id for e in events[j + 1 :] if isinstance(e, KVCacheEvent)), None
                )
                if next_id is not None and next_id - 1 > (-1 if prev_id is None else prev_id):
                    event_id = next_id - 1
                elif prev_id is not None:
                    event_id = prev_id + 1
                else:
                    event_id = 0
            window = ev.window_size if ev.window_size is not None else max_window
            if window is None:
                _fail(
                    f"{ev.path}.window_size",
                    "all_cleared carries no window_size; pass default_window_size= (no event "
                    "with a window_size has been seen to infer it from)",
                )
            try:
                event = KVCacheEvent(
                    event_id=event_id,
                    hash_algo=ev.hash_algo,
                    layer_group_id=ev.layer_group_id,
                    window_size=window,
                    data=Cleared(),
                )
            except EventValidationError as exc:
                raise InteropError(f"{ev.path}: {exc}") from exc
            out.append(event)
            prev_id = event_id
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
    when events lack ``window_size``. A one-shot :class:`TrtllmEventReader`: use a reader to
    keep state across successive lists. See the module docs for every rule.

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
    events: an ``all_cleared`` marker needs its ``event_id`` and a ``window_size`` (or
    ``default_window_size``), and multimodal items continued from an ancestor block cannot be
    resolved unless the block lists its ``mm_keys``. Errors are located under ``event``.
    """
    parser = _Parser(
        tokens_per_block=tokens_per_block,
        mm_token_id_offset=mm_token_id_offset,
        default_window_size=default_window_size,
        mm_state_capacity=0,
    )
    rank, ev = parser.parse(event, "event", allow_pending=False)
    assert isinstance(ev, KVCacheEvent)  # allow_pending=False never defers
    return RankedEvent(rank, ev)


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
