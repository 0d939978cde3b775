"""TensorRT-LLM JSON -> kvstream events, one event at a time: the field parsers and the
event parser behind :class:`~kvstream.engines.trtllm.TrtllmEventReader`.

Every shape TensorRT-LLM's serializers, managers and bridges publish (V1 and V2 managers,
OpenEngine servicer and bridge shapes, the fan-out's ``all_cleared`` marker) is read here, by
the rules in :mod:`kvstream.engines.trtllm` (defaults, hashes, tokens, multimodal items).
Malformed input raises :class:`~kvstream.errors.InteropError` naming its location.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple, NoReturn, TypeVar

from kvstream._types import (
    PRIORITY_DEFAULT,
    PRIORITY_MAX,
    PRIORITY_MIN,
    TOKEN_ID_MAX,
    TokenIds,
    hash_from_int,
    hash_width,
)
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
    Stored,
    StoredBlock,
    Updated,
)

__all__ = [
    "MmUuidMode",
    "RankedEvent",
    "TolerantRead",
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
