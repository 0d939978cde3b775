"""The fast path: an :class:`~kvstream.events.EventBatch` straight to Avro binary.

This writes exactly the bytes ``fastavro.schemaless_writer`` writes for the record that
:func:`kvstream.codec.records.batch_to_record` builds (the tests compare them byte for byte),
without building that record: fastavro costs about 0.3-0.6 us per field of a record even for
fields left at their default, which is more than the whole per-block budget. Constant runs of
default fields are pre-encoded, and a ``stored`` event whose blocks were all constructed with
only ``block_hash``/``token_ids`` skips the per-attribute scan.

Field order must follow the schema files; one function per record type keeps that visible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, Final

from kvstream._native import load as load_native
from kvstream._types import TokenIds
from kvstream.codec.binary import LONG_MAX, encode_bytes, encode_long, encode_string
from kvstream.codec.downgrade import (
    EXTRA_KEYS_SINCE,
    PACKED_TOKENS_SINCE,
    WRITABLE_VERSIONS,
    events_for_version,
)
from kvstream.codec.tokens import TOKEN_ENCODINGS, EncodedTokens, encode_tokens
from kvstream.errors import EncodeError
from kvstream.events.model import (
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    EventDiff,
    KVCacheEvent,
    Lost,
    Removed,
    Stored,
    StoredBlock,
    Updated,
)

__all__ = ["ENCODED_VERSIONS", "check_token_encoding", "encode_batch_body"]

#: Versions this encoder writes.
ENCODED_VERSIONS: Final = WRITABLE_VERSIONS

_NULL: Final = b"\x00"
_BRANCH1: Final = b"\x02"  # union branch 1 (the non-null one of ["null", T])
_EMPTY_ARRAY: Final = b"\x00"
_U64: Final = 2**64

# EventKind symbol indices (zig-zag encoded): UNKNOWN, CREATED, STORED, REMOVED, UPDATED,
# CLEARED, LOST, STORED_PACKED (v4: a stored event whose token ids are packed).
_KIND: Final = {
    "created": b"\x02",
    "stored": b"\x04",
    "removed": b"\x06",
    "updated": b"\x08",
    "cleared": b"\x0a",
    "lost": b"\x0c",
    "stored_packed": b"\x0e",
}
# TokenEncoding symbols UNKNOWN, NONE, BIT_PLANES, VARINT, DELTA_VARINT and TokenCompression
# symbols UNKNOWN, NONE, ZSTD (zig-zag encoded indices).
_TOKEN_ENCODING: Final = {
    "NONE": b"\x02",
    "BIT_PLANES": b"\x04",
    "VARINT": b"\x06",
    "DELTA_VARINT": b"\x08",
}
_TOKEN_COMPRESSION: Final = {"NONE": b"\x02", "ZSTD": b"\x04"}
# The v4 packed-token fields of a batch whose ids are bit planes: NONE, NONE, 0, empty.
_NO_PACKED: Final = b"\x02\x02\x00\x00"
# Extra-key union branches (zig-zag encoded): string, long, ExtraKeyBytes, ExtraKeyUInt64 (both
# one-field records, so encoded as their field), array of scalars.
_KEY_STRING: Final = b"\x00"
_KEY_LONG: Final = b"\x02"
_KEY_BYTES: Final = b"\x04"
_KEY_UINT64: Final = b"\x06"
_KEY_TUPLE: Final = b"\x08"
# AttentionKind symbols: UNKNOWN, FULL_ATTENTION, SLIDING_WINDOW.
_ATTENTION: Final = {AttentionKind.FULL: b"\x02", AttentionKind.SLIDING_WINDOW: b"\x04"}
_PAYLOAD_ORDER: Final = ("created", "stored", "removed", "updated", "lost")

_BLOCK_HASH = attrgetter("block_hash")
_BLOCK_RAW = attrgetter("token_ids.raw")
if TokenIds([1])._raw == TokenIds([1]).raw:  # pragma: no branch
    # The slot behind the public property: reading it skips a Python-level property call,
    # ~9% of the encoding time. Guarded so a change of TokenIds' internals only costs speed.
    _BLOCK_RAW = attrgetter("token_ids._raw")
_STORED_FIELDS = attrgetter("blocks", "parent_hash")
_FIELDS_SET = attrgetter("__pydantic_fields_set__")
_BASIC_FIELDS: Final = frozenset({"block_hash", "token_ids"})
_ATTRS = attrgetter(
    "cache_level",
    "priority",
    "lora_id",
    "lora_name",
    "cache_salt",
    "token_extra_ids",
    "mm_keys",
    "extra_keys",
)
_DEFAULT_BLOCK = StoredBlock(block_hash=b"\x00" * 8, token_ids=())
_DEFAULT_CACHE_LEVEL: Final = _DEFAULT_BLOCK.cache_level
_DEFAULT_PRIORITY: Final = _DEFAULT_BLOCK.priority
_DEFAULT_ATTRS: Final = _ATTRS(_DEFAULT_BLOCK)


class _Cache(dict[Any, bytes]):
    """Memo of encoded values that repeat (sizes, window sizes, names); bounded. When full it
    stops adding, or with ``refresh`` starts over (for values that drift over time)."""

    def __init__(self, encode: Any, limit: int = 4096, *, refresh: bool = False) -> None:
        super().__init__()
        self._encode = encode
        self._limit = limit
        self._refresh = refresh

    def __missing__(self, key: Any) -> bytes:
        value: bytes = self._encode(key)
        if len(self) >= self._limit:
            if not self._refresh:
                return value
            self.clear()
        self[key] = value
        return value


_LONG = _Cache(encode_long)
_STRING = _Cache(encode_string)


def _payload_frames(version: int) -> dict[str, tuple[bytes, bytes]]:
    """Per kind: the bytes before and after its payload record in the Event's payload fields."""
    fields = _PAYLOAD_ORDER if version >= 2 else _PAYLOAD_ORDER[:-1]
    frames: dict[str, tuple[bytes, bytes]] = {}
    for kind in _KIND:
        if kind == "cleared":
            frames[kind] = (_NULL * len(fields), b"")
            continue
        if kind not in fields:
            continue
        i = fields.index(kind)
        frames[kind] = (_NULL * i + _BRANCH1, _NULL * (len(fields) - i - 1))
    if version >= PACKED_TOKENS_SINCE:
        frames["stored_packed"] = frames["stored"]
    return frames


_FRAMES: Final = {v: _payload_frames(v) for v in ENCODED_VERSIONS}
# Per-block attribute fields when every block has its default attributes.
_DEFAULT_ATTR_FIELDS: Final = {
    # cache_level, cache_levels, priority, priorities, lora_id, lora_ids
    1: encode_long(_DEFAULT_CACHE_LEVEL) + _NULL + encode_long(_DEFAULT_PRIORITY) + _NULL * 3,
    # ... + lora_name, lora_names, cache_salt, cache_salts, mm_keys, token_extra_ids
    2: encode_long(_DEFAULT_CACHE_LEVEL)
    + _NULL
    + encode_long(_DEFAULT_PRIORITY)
    + _NULL * 7
    + _EMPTY_ARRAY * 2,
    # ... + extra_keys
    3: encode_long(_DEFAULT_CACHE_LEVEL)
    + _NULL
    + encode_long(_DEFAULT_PRIORITY)
    + _NULL * 7
    + _EMPTY_ARRAY * 3,
}
_DEFAULT_ATTR_FIELDS[4] = _DEFAULT_ATTR_FIELDS[3]  # v4 changed only the TokenPack and kinds

# ... followed by the payload fields after ``stored`` (removed, updated[, lost]: all null).
_DEFAULT_STORED_TAIL: Final = {
    v: _DEFAULT_ATTR_FIELDS[v] + _FRAMES[v]["stored"][1] for v in ENCODED_VERSIONS
}


def _array(items: Sequence[bytes]) -> bytes:
    if not items:
        return _EMPTY_ARRAY
    return encode_long(len(items)) + b"".join(items) + _EMPTY_ARRAY


def _opt_long(value: int | None) -> bytes:
    return _NULL if value is None else _BRANCH1 + _LONG[value]


def _opt_string(value: str | None) -> bytes:
    return _NULL if value is None else _BRANCH1 + _STRING[value]


def _opt_u64(value: int | None) -> bytes:
    if value is None:
        return _NULL
    return _BRANCH1 + encode_long(value - _U64 if value >= 2**63 else value)


def _extra_atom(atom: Any) -> bytes:
    # bool is not a model atom (strict int), so int here is a plain integer.
    if isinstance(atom, str):
        return _KEY_STRING + _STRING[atom]
    if isinstance(atom, bytes):
        return _KEY_BYTES + encode_bytes(atom)
    if isinstance(atom, int):
        if atom > LONG_MAX:
            return _KEY_UINT64 + encode_long(atom - _U64)
        return _KEY_LONG + encode_long(atom)
    raise EncodeError(f"extra key item {atom!r} is not a str, int or bytes")


def _extra_key(key: Any) -> bytes:
    if isinstance(key, tuple):
        return _KEY_TUPLE + _array([_extra_atom(a) for a in key])
    return _extra_atom(key)


def _extra_keys(keys: tuple[Any, ...]) -> bytes:
    return _array([_extra_key(k) for k in keys])


# A block's whole extra keys, encoded: the blocks of one request share them (LoRA name, salt).
# Keys are tuples of str/int/bytes (the model rejects bool and float, which would compare
# equal to ints), so equal keys have equal encodings.
_EXTRA_KEYS = _Cache(_extra_keys, refresh=True)


def _uniform_or_column(
    column: tuple[Any, ...], default: Any, scalar: Any, item: Any, out: list[bytes]
) -> None:
    """Append the scalar field and the per-block array field of one block attribute."""
    first = column[0]
    if column.count(first) == len(column):
        out.append(scalar(first))
        out.append(_NULL)
    else:
        out.append(scalar(default))
        out.append(_BRANCH1 + _array([item(v) for v in column]))


def _block_attrs(blocks: tuple[StoredBlock, ...], version: int, out: list[bytes]) -> None:
    rows = list(map(_ATTRS, blocks))
    if rows.count(_DEFAULT_ATTRS) == len(rows):
        out.append(_DEFAULT_ATTR_FIELDS[version])
        return
    levels, priorities, lora_ids, lora_names, salts, extra_ids, mm_keys, extra_keys = zip(
        *rows, strict=True
    )
    _uniform_or_column(levels, _DEFAULT_CACHE_LEVEL, encode_long, encode_long, out)
    _uniform_or_column(priorities, _DEFAULT_PRIORITY, encode_long, encode_long, out)
    _uniform_or_column(lora_ids, None, _opt_u64, _opt_u64, out)
    if version < 2:
        return
    _uniform_or_column(lora_names, None, _opt_string, _opt_string, out)
    _uniform_or_column(salts, None, _opt_string, _opt_string, out)
    mm_items = [
        encode_long(i) + key.hash + encode_long(key.start_offset) + _opt_string(key.uuid)
        for i, keys in enumerate(mm_keys)
        for key in keys
    ]
    out.append(_array(mm_items))
    extra_items = [
        encode_long(i) + encode_bytes(ids.raw) for i, ids in enumerate(extra_ids) if ids is not None
    ]
    out.append(_array(extra_items))
    if version < EXTRA_KEYS_SINCE:
        return
    key_items = [
        _LONG[i] + _EXTRA_KEYS[keys] for i, keys in enumerate(extra_keys) if keys is not None
    ]
    out.append(_array(key_items))


_Gathered = tuple[bytes, list[bytes], list[bool]]


def _size_fields(sizes: list[int]) -> bytes:
    """block_size, last_block_size, block_sizes of blocks of ``sizes`` tokens."""
    first = sizes[0]
    last = sizes[-1]
    same = sizes.count(first)
    if same == len(sizes) or (same == len(sizes) - 1 and last != first):
        return _LONG[first] + _LONG[last] + _NULL
    # block_size 0, last_block_size 0, block_sizes branch 1 + the array
    return b"\x00\x00\x02" + _array([_LONG[s] for s in sizes])


def _gather_py(block_tuples: list[tuple[StoredBlock, ...]]) -> _Gathered:
    """(all token ids joined; per event its
    ``block_count``, ``block_hashes`` and the three size fields, encoded; per event whether
    every block has only ``block_hash``/``token_ids`` set, so all other attributes default)."""
    raws: list[bytes] = []
    heads: list[bytes] = []
    for blocks in block_tuples:
        event_raws = list(map(_BLOCK_RAW, blocks))
        raws += event_raws
        hashes = b"".join(map(_BLOCK_HASH, blocks))
        sizes = [len(r) >> 2 for r in event_raws]
        heads.append(_LONG[len(blocks)] + _LONG[len(hashes)] + hashes + _size_fields(sizes))
    plain = [all(map(_BASIC_FIELDS.issuperset, map(_FIELDS_SET, t))) for t in block_tuples]
    return b"".join(raws), heads, plain


class _Blocks:
    """The batch's stored blocks, read in one pass (:func:`_gather_py`)."""

    __slots__ = ("event", "heads", "plain", "raw")
    raw: bytes
    heads: list[bytes]
    plain: list[bool]

    def __init__(self, block_tuples: list[tuple[StoredBlock, ...]]) -> None:
        self.raw, self.heads, self.plain = _gather_py(block_tuples)
        self.event = 0


def _stored(data: Stored, version: int, cols: _Blocks, out: list[bytes]) -> None:
    blocks, parent = _STORED_FIELDS(data)
    event = cols.event
    cols.event = event + 1
    parent_field = _NULL if parent is None else _BRANCH1 + _LONG[len(parent)] + parent
    if cols.plain[event]:
        out += (parent_field, cols.heads[event], _DEFAULT_STORED_TAIL[version])
        return
    out += (parent_field, cols.heads[event])
    _block_attrs(blocks, version, out)
    out.append(_FRAMES[version]["stored"][1])


def _removed(data: Removed, version: int, cols: _Blocks, out: list[bytes]) -> None:
    out.append(_LONG[len(data.block_hashes)])
    out.append(encode_bytes(b"".join(data.block_hashes)))
    if version >= 2:
        out.append(_opt_long(data.cache_level))


def _diff(diff: EventDiff | None) -> bytes:
    if diff is None:
        return _NULL
    return _BRANCH1 + _LONG[diff.old_value] + _LONG[diff.new_value]


def _updated(data: Updated, version: int, cols: _Blocks, out: list[bytes]) -> None:
    out.append(encode_bytes(data.block_hash))
    out.append(_diff(data.cache_level))
    out.append(_diff(data.priority))


def _created(data: Created, version: int, cols: _Blocks, out: list[bytes]) -> None:
    out.append(_array([encode_long(c) for c in data.num_blocks_per_cache_level]))
    if version >= 2:
        out.append(_LONG[data.tokens_per_block])
        out.append(_ATTENTION[data.attention_kind])


def _lost(data: Lost, version: int, cols: _Blocks, out: list[bytes]) -> None:
    out.append(encode_long(data.first_event_id))
    out.append(encode_long(data.count))
    out.append(_STRING[data.reason])


def _cleared(data: Cleared, version: int, cols: _Blocks, out: list[bytes]) -> None:
    pass


_PAYLOAD: Final[dict[str, Callable[[Any, int, _Blocks, list[bytes]], None]]] = {
    "removed": _removed,
    "updated": _updated,
    "created": _created,
    "lost": _lost,
    "cleared": _cleared,
}


def _envelope(key: tuple[str, int, str, int], version: int) -> bytes:
    """The event fields before the payload record: kind .. layer_group_id, payload unions."""
    kind, window_size, hash_algo, layer_group_id = key
    parts = [_KIND[kind], encode_long(window_size)]
    if version >= 2:
        parts += (encode_string(hash_algo), encode_long(layer_group_id))
    parts.append(_FRAMES[version][kind][0])
    return b"".join(parts)


_ENVELOPES: Final = {v: _Cache(lambda key, v=v: _envelope(key, v)) for v in ENCODED_VERSIONS}


def _events(
    events: tuple[KVCacheEvent, ...], version: int, token_encoding: str, out: list[bytes]
) -> EncodedTokens:
    """Append the encoded events to ``out``; return the encoded token ids of their blocks."""
    datas = [ev.data for ev in events]
    cols = _Blocks([d.blocks for d in datas if isinstance(d, Stored)])
    tokens = encode_tokens(cols.raw, token_encoding)
    stored_kind = "stored_packed" if tokens.is_packed else "stored"
    frames = _FRAMES[version]
    envelopes = _ENVELOPES[version]
    for ev, data in zip(events, datas, strict=True):
        kind = data.type
        if isinstance(data, Stored):  # the hot path; appends its own tail
            out += (
                encode_long(ev.event_id),
                envelopes[stored_kind, ev.window_size, ev.hash_algo, ev.layer_group_id],
            )
            _stored(data, version, cols, out)
        else:
            out += (
                encode_long(ev.event_id),
                envelopes[kind, ev.window_size, ev.hash_algo, ev.layer_group_id],
            )
            _PAYLOAD[kind](data, version, cols, out)
            out.append(frames[kind][1])
    return tokens


def _token_fields(tokens: EncodedTokens, version: int) -> list[bytes]:
    packed = tokens.planes
    fields = [
        encode_long(packed.count),
        _LONG[packed.high_bits],
        encode_long(len(packed.low16)),
        packed.low16,
        encode_long(len(packed.high_planes)),
        packed.high_planes,
    ]
    if version >= PACKED_TOKENS_SINCE:
        if tokens.is_packed:
            fields += (
                _TOKEN_ENCODING[tokens.encoding],
                _TOKEN_COMPRESSION[tokens.compression],
                encode_long(tokens.count),
                encode_long(len(tokens.packed)),
                tokens.packed,
            )
        else:
            fields.append(_NO_PACKED)
    return fields


def check_token_encoding(version: int, token_encoding: str) -> None:
    """Raise EncodeError unless schema ``version`` can write ``token_encoding``."""
    if token_encoding not in TOKEN_ENCODINGS:
        raise EncodeError(f"unknown token encoding {token_encoding!r}; known: {TOKEN_ENCODINGS}")
    if version < PACKED_TOKENS_SINCE and token_encoding not in ("auto", "planes"):
        raise EncodeError(f"schema v{version} has only bit-plane tokens, not {token_encoding!r}")


def _block_attrs_bytes(blocks: tuple[StoredBlock, ...], version: int) -> bytes:
    """The block attribute fields of a stored event (the C encoder's helper for events where
    some block has an attribute set)."""
    out: list[bytes] = []
    _block_attrs(blocks, version, out)
    return b"".join(out)


def _encode_py(
    batch: EventBatch,
    events: tuple[KVCacheEvent, ...],
    version: int,
    token_encoding: str,
    prefix: bytes,
) -> bytes:
    """:func:`encode_batch_body` of ``events`` (already :func:`events_for_version`'s) in
    Python: the twin of the C ``encode_body``, and the path for what it declines."""
    try:
        out: list[bytes] = []
        tokens = _events(events, version, token_encoding, out)
        source = batch.source
        head = [
            prefix,
            _STRING[source.instance_id],
            _opt_long(source.attention_dp_rank),
        ]
        if version >= 2:
            head.append(encode_long(source.incarnation))
        head.append(encode_long(batch.ts_ns))
        head += _token_fields(tokens, version)
        head.append(encode_long(len(events)) if events else _EMPTY_ARRAY)
        if events:
            out.append(_EMPTY_ARRAY)
        # One join: a second copy of a ~150 KB result costs as much as all the varints.
        head += out
        return b"".join(head)
    except EncodeError:
        raise
    except (AttributeError, TypeError, ValueError, LookupError, OverflowError) as exc:
        raise EncodeError(f"cannot encode batch: {type(exc).__name__}: {exc}") from exc


_NativeEncode = Callable[[bytes, EventBatch, tuple[KVCacheEvent, ...], int, str], bytes | None]


def _native_encode() -> _NativeEncode | None:
    mod: Any = load_native("kvstream.codec._tokens_native")
    if mod is None:
        return None
    kinds = (Created, Stored, Removed, Updated, Cleared, Lost)
    names = ("created", "stored", "removed", "updated", "cleared", "lost")
    frames: list[tuple[tuple[bytes, bytes] | None, ...] | None] = [None]
    tails: list[bytes | None] = [None]
    for v in range(1, 5):
        if v not in ENCODED_VERSIONS:  # pragma: no cover - every version 1-4 is writable
            frames.append(None)
            tails.append(None)
            continue
        frames.append(tuple(_FRAMES[v].get(name) for name in names))
        tails.append(_DEFAULT_STORED_TAIL[v])
    fields = tuple(StoredBlock.model_fields)
    mod.body_setup(
        (StoredBlock, *kinds, EventDiff, TokenIds),
        (AttentionKind.FULL, AttentionKind.SLIDING_WINDOW),
        fields,
        tuple(StoredBlock.model_fields[name].default for name in fields[2:]),
        tuple(frames),
        tuple(tails),
        _block_attrs_bytes,
        encode_tokens,
    )
    encode: _NativeEncode = mod.encode_body
    return encode


#: The C encoder (``_tokens_native.encode_body``), or None (pure Python).
_NATIVE_ENCODE: _NativeEncode | None = _native_encode()


def encode_batch_body(
    batch: EventBatch,
    version: int,
    *,
    lossy: bool = False,
    prefix: bytes = b"",
    token_encoding: str = "auto",
) -> bytes:
    """The schemaless Avro body of ``batch`` under schema ``version`` (1 to 4), after
    ``prefix`` (a framing header, joined in the same copy).

    Older versions drop or reject what they cannot carry (see :mod:`.downgrade`).
    ``token_encoding`` (:data:`~kvstream.codec.tokens.TOKEN_ENCODINGS`) picks how v4 carries
    token ids; versions before 4 always write bit planes (``auto`` and ``planes`` accepted).
    Raises EncodeError for a batch that cannot be encoded; ``batch.schema_version`` is ignored.

    One C call writes the body where the extension is built; anything it does not expect
    (or any error) sends the batch through the Python twin, so results and errors are the
    same either way.
    """
    if version not in ENCODED_VERSIONS:
        raise EncodeError(f"cannot write schema version {version}; writable: {ENCODED_VERSIONS}")
    check_token_encoding(version, token_encoding)
    events = events_for_version(batch, version, lossy=lossy)
    if version < PACKED_TOKENS_SINCE:
        token_encoding = "planes"
    native = _NATIVE_ENCODE
    if native is not None and type(prefix) is bytes:
        try:
            body = native(prefix, batch, events, version, token_encoding)
        except Exception:  # the Python path raises what this batch raises there
            body = None
        if body is not None:
            return body
    return _encode_py(batch, events, version, token_encoding, prefix)
