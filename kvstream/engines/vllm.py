"""vLLM's KV-event wire format (``KVEventBatch`` over msgpack), decoded into plain records.

vLLM publishes one msgpack payload per scheduler step (peers.md §1.2)::

    [ts: float, [event, ...], data_parallel_rank: int | nil]

Each event is a ``BlockStored``, ``BlockRemoved`` or ``AllBlocksCleared``, encoded

- up to vLLM 0.23 as a positional array ``[tag, field1, field2, ...]`` (6 to 16 slots as fields
  were added release by release; SGLang's older publisher used the same positions, 9 slots);
- from vLLM 0.24 as a map ``{"type": tag, "<field>": value, ...}`` in which fields at their
  default are omitted (SGLang 0.5 uses maps too, with its own extra fields).

:func:`decode_payload` accepts every one of these shapes and returns a :class:`WireBatch` of
:class:`WireEvent` records: hashes normalised to bytes, tokens split per block, ``medium``
mapped to kvstream's cache level. Unknown map keys and unknown trailing array slots are
ignored (newer engines add fields), as long as the payload is msgpack: a str with invalid
UTF-8 anywhere in it, an unknown key's or value's included, makes the whole payload
invalid. A payload that is not a batch at all raises
:class:`~kvstream.errors.InteropError`; a single event that is malformed becomes a
:class:`WireEvent` of kind ``"malformed"`` carrying the reason, so one bad event never costs
its neighbours. Turning records into kvstream events (ids, windows, sources) is
:mod:`kvstream.engines.stream`'s job.

Hashes (peers.md §8.3). An int is a 64-bit hash: vLLM's unsigned last-8-bytes form or
SGLang's signed int64 (wrapped to unsigned); both become 8 bytes big-endian. ``bin`` hashes
(vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``) are kept whole when the stream's
algorithm is 256-bit, and reduced to their last 8 bytes (exactly the int vLLM would have
published) when it is 64-bit.

Speed. Map-era payloads take a fast path: typed msgspec decoding that leaves the hash and token
arrays as msgpack bytes, read by the optional C extension :mod:`kvstream.engines._wire_native`
(no Python int per token), with a pure-Python fallback (msgspec decodes them) when it is not
built or ``KVSTREAM_NO_NATIVE`` is set; anything unusual is decoded by the generic path.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvstream._native import load as load_native
from kvstream._types import CacheLevel, TokenIds
from kvstream.errors import InteropError
from kvstream.events.trusted import token_blocks

if TYPE_CHECKING:  # typed by its stub; None at run time when not loaded
    from kvstream.engines import _wire_native
else:
    _wire_native = load_native("kvstream.engines._wire_native")

__all__ = [
    "MEDIUM_LEVELS",
    "STORED_POSITIONS",
    "Dialect",
    "VLLM",
    "WireBatch",
    "WireEvent",
    "decode_payload",
    "medium_level",
]

_U64: Final = 1 << 64
_BIG_ENDIAN: Final = sys.byteorder == "big"
_EXTERNAL: Final = int(CacheLevel.EXTERNAL)
_NO_TOKENS: Final = TokenIds()
_I64_MIN: Final = -(1 << 63)

#: ``medium`` strings engines publish -> kvstream cache level (the tiers Dynamo maps them to).
MEDIUM_LEVELS: Final[Mapping[str, int]] = {
    "GPU": int(CacheLevel.GPU),
    "DEVICE": int(CacheLevel.GPU),
    "CPU": int(CacheLevel.HOST),
    "CPU_PINNED": int(CacheLevel.HOST),
    "CPU_TIER1": int(CacheLevel.HOST),
    "HOST": int(CacheLevel.HOST),
    "CPU_TIER2": int(CacheLevel.DISK),
    "DISK": int(CacheLevel.DISK),
    "NVME": int(CacheLevel.DISK),
    "STORAGE": int(CacheLevel.DISK),
    "EXTERNAL": int(CacheLevel.EXTERNAL),
    "NETWORK": int(CacheLevel.EXTERNAL),
    "REMOTE": int(CacheLevel.EXTERNAL),
    "SHARED": int(CacheLevel.EXTERNAL),
}

#: Array-era slot of each ``BlockStored`` field (slot 0 is the tag), vLLM 0.22/0.23 order.
#: SGLang's positional events used slots 1-8 the same way.
STORED_POSITIONS: Final[tuple[str, ...]] = (
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
_REMOVED_POSITIONS: Final = ("type", "block_hashes", "medium", "group_idx", "locality", "ownership")
_MIN_SLOTS: Final = {"BlockStored": 5, "BlockRemoved": 2, "AllBlocksCleared": 1}


@dataclass(frozen=True, slots=True)
class Dialect:
    """What distinguishes one engine's use of the format.

    ``name`` labels errors; ``default_hash_algo`` is the algorithm its ints come from when the
    user names none; ``bigram_tokens``: ``token_ids`` may arrive as ``[[t0, t1], [t1, t2], ...]``
    pairs (SGLang under EAGLE speculative decoding), one pair per token position, read as
    the position's token ``t0, t1, ...``.
    """

    name: str
    default_hash_algo: str
    bigram_tokens: bool = False
    #: Array-era ``BlockStored`` slots (slot 0 is the tag).
    stored_positions: tuple[str, ...] = ()


#: vLLM (every release with KV events); the default hash is ``sha256`` (pickle) in int mode.
VLLM: Final = Dialect("vllm", "vllm_sha256_64", stored_positions=STORED_POSITIONS)


@dataclass(slots=True)  # not frozen: frozen dataclasses pay a setattr per field
class WireEvent:
    """One engine event, normalised.

    ``kind`` is ``"stored"``, ``"removed"``, ``"cleared"`` or ``"malformed"`` (then ``error``
    says why and the other fields are empty). For ``stored``: ``block_hashes`` (bytes, chain
    order), ``parent_hash``, ``block_tokens`` (one token list per block; empty lists for
    offload placeholders), ``extra_keys`` (one entry per block, or None), ``lora_id``,
    ``lora_name``, ``cache_salt`` (``token_bytes`` and ``block_size`` instead of ``block_tokens``
    when decoded for columns). ``cache_level`` comes from ``medium`` (and ``locality``
    REMOTE); ``group`` from ``group_idx``; ``sliding_window`` from
    ``kv_cache_spec_sliding_window`` when the engine sent one.
    """

    kind: str
    block_hashes: tuple[bytes, ...] = ()
    parent_hash: bytes | None = None
    block_tokens: tuple[TokenIds, ...] = ()
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    cache_level: int | None = None
    group: int = 0
    spec_kind: str | None = None
    sliding_window: int | None = None
    error: str = ""
    #: With ``split_tokens=False``: every block's token ids (u32 little-endian) in one string,
    #: and the engine's ``block_size`` (0 for offload placeholders, which carry no tokens);
    #: ``block_tokens`` is then empty. The same checks ran.
    token_bytes: bytes = b""
    block_size: int = 0


@dataclass(frozen=True, slots=True)
class WireBatch:
    """One decoded payload: engine timestamp (seconds), events in order, the engine's rank."""

    ts: float
    events: list[WireEvent] = field(default_factory=list)
    dp_rank: int | None = None


class _BadEvent(Exception):
    """Internal: one event is malformed; the message is the reason."""


def medium_level(medium: Any) -> int | None:
    """kvstream cache level of an engine ``medium`` (None when the engine sent none)."""
    if medium is None:
        return None
    if not isinstance(medium, str):
        raise _BadEvent(f"medium must be a string, got {type(medium).__name__}")
    level = MEDIUM_LEVELS.get(medium.upper())
    if level is None:
        raise _BadEvent(f"unknown medium {medium!r} (known: {', '.join(MEDIUM_LEVELS)})")
    return int(level)


def _hash(value: Any, width: int | None, what: str) -> bytes:
    if type(value) is int:
        if value < 0:
            if value < _I64_MIN:
                raise _BadEvent(f"{what}: {value} does not fit in 64 bits")
            value += _U64
        elif value >= _U64:
            raise _BadEvent(f"{what}: {value} does not fit in 64 bits")
        if width is not None and width != 8:
            raise _BadEvent(f"{what}: an int hash is 64-bit, but the stream's algorithm is not")
        out: bytes = value.to_bytes(8, "big")
        return out
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if width is None or len(raw) == width:
            if len(raw) not in (8, 16, 32):
                raise _BadEvent(f"{what}: a {len(raw)}-byte hash")
            return raw
        if width == 8 and len(raw) in (16, 32):
            return raw[-8:]  # vLLM's int mode publishes the last 8 bytes, big-endian
        raise _BadEvent(f"{what}: a {len(raw)}-byte hash where {width} bytes were expected")
    raise _BadEvent(f"{what}: expected an int or bytes hash, got {type(value).__name__}")


def _hashes(value: Any, width: int | None, what: str) -> tuple[bytes, ...]:
    if not isinstance(value, list):
        raise _BadEvent(f"{what}: expected a list of hashes, got {type(value).__name__}")
    return tuple(_hash(v, width, f"{what}[{i}]") for i, v in enumerate(value))


def _opt_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int:
        raise _BadEvent(f"{what}: expected an int, got {type(value).__name__}")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise _BadEvent(f"{what}: expected a string, got {type(value).__name__}")


def _tokens(value: Any, bigram: bool) -> bytes:
    """The token ids as little-endian uint32 bytes (``TokenIds`` layout)."""
    if not isinstance(value, list):
        raise _BadEvent(f"token_ids: expected a list, got {type(value).__name__}")
    if bigram and value and isinstance(value[0], list):
        # SGLang's EAGLE pages carry (raw[j], raw[j+1]) per position j: the position's token
        # is the pair's head, so a page of P pairs is the same P tokens as a plain page.
        heads: list[int] = []
        for i, pair in enumerate(value):
            if not isinstance(pair, list) or len(pair) < 2:
                raise _BadEvent(f"token_ids[{i}]: a bigram pair needs two tokens")
            heads.append(pair[0])
        value = heads
    try:
        packed = array("I", value)  # C-speed range and type check of every id
    except (OverflowError, TypeError):
        bad = next(
            (i, t) for i, t in enumerate(value) if type(t) is not int or not 0 <= t < 1 << 32
        )
        raise _BadEvent(f"token_ids[{bad[0]}]: {bad[1]!r} is not a token id (uint32)") from None
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def _token_layout(raw: bytes, n_blocks: int, block_size: Any) -> int:
    """The block size the token ids ``raw`` split into ``n_blocks`` blocks of (0: no ids, an
    offload placeholder); _BadEvent when they do not."""
    if type(block_size) is not int or block_size < 0:
        raise _BadEvent(f"block_size: expected a non-negative int, got {block_size!r}")
    if not raw:  # offload placeholders: hashes only
        return 0
    if block_size == 0:
        raise _BadEvent("block_size 0 with token ids")
    n_tokens = len(raw) >> 2
    last = n_tokens - (n_blocks - 1) * block_size
    if not 0 < last <= block_size:
        raise _BadEvent(
            f"{n_tokens} token ids do not split into {n_blocks} block(s) of {block_size}"
        )
    return block_size


def _split_tokens(raw: bytes, n_blocks: int, block_size: Any) -> tuple[TokenIds, ...]:
    if not _token_layout(raw, n_blocks, block_size):
        return (_NO_TOKENS,) * n_blocks
    return token_blocks(raw, block_size * 4)


def _extra_item(value: Any, what: str) -> Any:
    if isinstance(value, (str, bytes)) or type(value) is int:
        return value
    if isinstance(value, list):
        for i, v in enumerate(value):
            if not (isinstance(v, (str, bytes)) or type(v) is int):
                raise _BadEvent(f"{what}[{i}]: unsupported extra key value {type(v).__name__}")
        return tuple(value)
    raise _BadEvent(f"{what}: unsupported extra key value {type(value).__name__}")


def _extra_keys(value: Any, n_blocks: int) -> tuple[tuple[Any, ...] | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n_blocks:
        raise _BadEvent(f"extra_keys: expected one entry per block ({n_blocks})")
    out: list[tuple[Any, ...] | None] = []
    for i, entry in enumerate(value):
        if entry is None:
            out.append(None)
        elif isinstance(entry, list):
            out.append(tuple(_extra_item(v, f"extra_keys[{i}][{j}]") for j, v in enumerate(entry)))
        else:
            out.append((_extra_item(entry, f"extra_keys[{i}]"),))
    return tuple(out)


def _fields(raw: Any, dialect: Dialect) -> tuple[str, Mapping[str, Any]]:
    """(tag, fields by name) of an event in either encoding."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise _BadEvent("event map without a string 'type'")
        return tag, raw
    if isinstance(raw, list) and raw:
        tag = raw[0]
        if not isinstance(tag, str):
            raise _BadEvent("event array whose first slot is not a tag string")
        if len(raw) < _MIN_SLOTS.get(tag, 1):
            raise _BadEvent(f"{tag} array has {len(raw)} slots, needs {_MIN_SLOTS[tag]}")
        names = _REMOVED_POSITIONS if tag == "BlockRemoved" else dialect.stored_positions
        return tag, dict(zip(names, raw, strict=False))  # unknown trailing slots are dropped by zip
    raise _BadEvent(f"an event must be a map or an array, got {type(raw).__name__}")


def _salt(fields: Mapping[str, Any]) -> str | None:
    salt = _opt_str(fields.get("cache_salt"), "cache_salt")
    metadata = fields.get("metadata")  # SGLang 0.5.19: {"cache_salt": ...} in slot 7
    if salt is None and metadata is not None:
        if not isinstance(metadata, dict):
            raise _BadEvent(f"metadata: expected a map, got {type(metadata).__name__}")
        salt = _opt_str(metadata.get("cache_salt"), "metadata.cache_salt")
    return salt


def _level(fields: Mapping[str, Any]) -> int | None:
    level = medium_level(fields.get("medium"))
    locality = fields.get("locality")
    if isinstance(locality, str) and locality.upper() == "REMOTE":
        return int(CacheLevel.EXTERNAL)
    return level


def _group(fields: Mapping[str, Any]) -> int:
    group = _opt_int(fields.get("group_idx"), "group_idx")
    if group is not None and not 0 <= group < 1 << 31:
        raise _BadEvent(f"group_idx {group} out of range")
    return group or 0


def _stored(
    fields: Mapping[str, Any], width: int | None, dialect: Dialect, split: bool = True
) -> WireEvent:
    if "block_hashes" not in fields or "token_ids" not in fields:
        raise _BadEvent("BlockStored without block_hashes/token_ids")
    hashes = _hashes(fields["block_hashes"], width, "block_hashes")
    parent_raw = fields.get("parent_block_hash")
    parent = None if parent_raw is None else _hash(parent_raw, width, "parent_block_hash")
    if not hashes:
        raise _BadEvent("BlockStored with no block hashes")
    tokens = _tokens(fields["token_ids"], dialect.bigram_tokens)
    if split:
        blocks = _split_tokens(tokens, len(hashes), fields.get("block_size", 0))
        size = 0
    else:
        blocks = ()
        size = _token_layout(tokens, len(hashes), fields.get("block_size", 0))
    window = _opt_int(fields.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window")
    if window is not None and window < 1:
        raise _BadEvent(f"kv_cache_spec_sliding_window {window} is not positive")
    lora_id = _opt_int(fields.get("lora_id"), "lora_id")
    if lora_id is not None and not 0 <= lora_id < _U64:
        raise _BadEvent(f"lora_id {lora_id} out of range")
    return WireEvent(
        kind="stored",
        block_hashes=hashes,
        parent_hash=parent,
        block_tokens=blocks,
        extra_keys=_extra_keys(fields.get("extra_keys"), len(hashes)),
        lora_id=lora_id,
        lora_name=_opt_str(fields.get("lora_name"), "lora_name"),
        cache_salt=_salt(fields),
        cache_level=_level(fields),
        group=_group(fields),
        spec_kind=_opt_str(fields.get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
        sliding_window=window,
        token_bytes=b"" if split else tokens,
        block_size=size,
    )


def _removed(fields: Mapping[str, Any], width: int | None) -> WireEvent:
    if "block_hashes" not in fields:
        raise _BadEvent("BlockRemoved without block_hashes")
    hashes = _hashes(fields["block_hashes"], width, "block_hashes")
    if not hashes:
        raise _BadEvent("BlockRemoved with no block hashes")
    return WireEvent(
        kind="removed", block_hashes=hashes, cache_level=_level(fields), group=_group(fields)
    )


_CLEARED: Final = WireEvent(kind="cleared")


def decode_event(
    raw: Any, width: int | None, dialect: Dialect = VLLM, *, split_tokens: bool = True
) -> WireEvent:
    """One event (already msgpack-decoded) as a :class:`WireEvent`; a malformed one comes back
    with ``kind="malformed"`` and the reason, and unknown tags likewise. ``split_tokens``: as
    in :func:`decode_payload`."""
    try:
        tag, fields = _fields(raw, dialect)
        if tag == "BlockStored":
            return _stored(fields, width, dialect, split_tokens)
        if tag == "BlockRemoved":
            return _removed(fields, width)
        if tag == "AllBlocksCleared":
            return _CLEARED
        raise _BadEvent(f"unknown event type {tag!r}")
    except _BadEvent as exc:
        return WireEvent(kind="malformed", error=str(exc))


@functools.cache
def _msgpack_decoder() -> Callable[[bytes], Any]:
    import msgspec

    return msgspec.msgpack.Decoder().decode


def native_readers() -> Any:
    """The C array readers in use (``kvstream.engines._wire_native``), None for pure Python."""
    return _wire_native


class _NotFast(Exception):
    """Internal: the payload leaves the fast path's happy case; decode it generically."""


@functools.cache
def _hash_list_decoder() -> Callable[[Any], list[int | bytes]]:
    import msgspec

    return msgspec.msgpack.Decoder(list[int | bytes]).decode


def _fast_hashes(raw: Any, width: int | None) -> tuple[bytes, ...]:
    """The hashes of a msgpack array (msgspec.Raw), or _NotFast."""
    if _wire_native is not None and (width == 8 or width is None):
        try:
            out: tuple[bytes, ...] = _wire_native.be64_array(raw)
        except ValueError:  # bytes hashes, signed ints, not an array: the rules below
            pass
        else:
            if out:
                return out
            raise _NotFast
    try:
        values = _hash_list_decoder()(raw)
    except Exception:  # msgspec's DecodeError/ValidationError: let the generic path say why
        raise _NotFast from None
    if not values:
        raise _NotFast
    if width == 8 or width is None:
        n = len(values)
        try:
            packed = struct.pack(f">{n}Q", *values)  # non-negative ints only
        except struct.error:
            pass
        else:
            return tuple(packed[i : i + 8] for i in range(0, 8 * n, 8))
    try:
        return tuple(_hash(v, width, "") for v in values)
    except _BadEvent:
        raise _NotFast from None


def _fast_tokens(raw: Any, bigram: bool) -> bytes:
    """The token ids of a msgpack array (msgspec.Raw) as packed uint32; _BadEvent if they
    are not token ids, _NotFast if they are not even msgpack."""
    if _wire_native is not None:
        try:
            out: bytes = _wire_native.u32_array(raw)
        except ValueError:  # bigram pairs, or not token ids at all: the generic rules
            pass
        else:
            return out
    try:
        values = _msgpack_decoder()(raw)
    except Exception:  # msgspec skipped it unchecked (bad UTF-8 inside): the generic path says
        raise _NotFast from None
    return _tokens(values, bigram)


def _fast_event(
    ev: Any, width: int | None, dialect: Dialect, structs: Any, split: bool = True
) -> WireEvent:
    # msgspec has checked every field's type but the arrays; what remains are value rules.
    if type(ev) is structs.Cleared:
        return _CLEARED
    group = ev.group_idx or 0
    if not 0 <= group < 1 << 31:
        raise _NotFast
    medium = ev.medium
    level = None if medium is None else MEDIUM_LEVELS.get(medium.upper())
    if level is None and medium is not None:
        raise _NotFast
    if ev.locality is not None and ev.locality.upper() == "REMOTE":
        level = _EXTERNAL
    hashes = _fast_hashes(ev.block_hashes, width)
    if type(ev) is structs.Removed:
        return WireEvent(kind="removed", block_hashes=hashes, cache_level=level, group=group)
    n = len(hashes)
    window = ev.kv_cache_spec_sliding_window
    lora_id = ev.lora_id
    if (window is not None and window < 1) or (lora_id is not None and lora_id < 0):
        raise _NotFast
    parent = ev.parent_block_hash
    try:
        tokens = _fast_tokens(ev.token_ids, dialect.bigram_tokens)
        if split:
            blocks, size = _split_tokens(tokens, n, ev.block_size), 0
        else:
            blocks, size = (), _token_layout(tokens, n, ev.block_size)
        extra = None if ev.extra_keys is None else _extra_keys(ev.extra_keys, n)
        parent_hash = None if parent is None else _hash(parent, width, "")
    except _BadEvent:
        raise _NotFast from None
    if not split:
        return WireEvent(
            "stored",
            hashes,
            parent_hash,
            (),
            extra,
            lora_id,
            ev.lora_name,
            ev.cache_salt,
            level,
            group,
            ev.kv_cache_spec_kind,
            window,
            "",
            tokens,
            size,
        )
    return WireEvent(  # positionally, in field order: half the cost of keywords, per event
        "stored",
        hashes,
        parent_hash,
        blocks,
        extra,
        lora_id,
        ev.lora_name,
        ev.cache_salt,
        level,
        group,
        ev.kv_cache_spec_kind,
        window,
    )


def _decode_fast(
    payload: bytes, width: int | None, dialect: Dialect, split: bool = True
) -> WireBatch:
    """The map-era happy path (every current engine): typed msgspec decoding, no per-field
    Python checks. Raises _NotFast for anything else."""
    from kvstream.engines import _wire_structs as structs

    try:
        batch = structs.decode(payload)
    except Exception:  # msgspec's DecodeError/ValidationError: let the generic path say why
        raise _NotFast from None
    rank = batch.data_parallel_rank
    if rank is not None and rank < 0:
        raise _NotFast
    events = [_fast_event(ev, width, dialect, structs, split) for ev in batch.events]
    return WireBatch(batch.ts, events, rank)


def decode_payload(
    payload: bytes, *, width: int | None, dialect: Dialect = VLLM, split_tokens: bool = True
) -> WireBatch:
    """Decode one ``KVEventBatch`` payload.

    ``width`` is the byte width of the stream's hash algorithm (8 or 32; None when unknown).
    Raises InteropError when the payload is not msgpack or not a ``[ts, events, rank]``
    array; malformed single events come back as ``kind="malformed"`` records.
    ``split_tokens=False`` (the columnar path) leaves a stored event's token ids in one
    string (:attr:`WireEvent.token_bytes`) instead of one ``TokenIds`` per block, after the
    same checks.
    """
    try:
        return _decode_fast(payload, width, dialect, split_tokens)
    except _NotFast:
        return _decode_generic(payload, width, dialect, split_tokens)


def _decode_generic(
    payload: bytes, width: int | None, dialect: Dialect, split: bool = True
) -> WireBatch:
    """:func:`decode_payload` without the fast path: every event checked field by field.

    The fast path answers only for payloads whose answer here is the same (the tests hold
    the two equal); invalid UTF-8 anywhere (an unknown key included) is not msgpack.
    """
    try:
        obj = _msgpack_decoder()(payload)
    except Exception as exc:  # msgspec.DecodeError, and anything a hostile payload triggers
        raise InteropError(f"{dialect.name} payload is not msgpack: {exc}") from None
    if not isinstance(obj, list) or len(obj) < 2:
        raise InteropError(f"{dialect.name} payload is not a [ts, events, dp_rank] array")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise InteropError(f"{dialect.name} batch timestamp is {type(ts).__name__}, not a number")
    if not isinstance(events, list):
        raise InteropError(f"{dialect.name} batch events are {type(events).__name__}, not a list")
    if rank is not None and (type(rank) is not int or rank < 0):
        raise InteropError(f"{dialect.name} batch data_parallel_rank {rank!r} is not a rank")
    return WireBatch(
        float(ts), [decode_event(e, width, dialect, split_tokens=split) for e in events], rank
    )
