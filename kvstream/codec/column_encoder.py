"""Columns straight to Avro binary: the publish path with no model object per event or block.

:func:`encode_columns_body` writes exactly the bytes :func:`~kvstream.codec.encoder.
encode_batch_body` writes for the model batch the columns stand for (``cols.to_batch()``),
for every schema version, token encoding and ``lossy`` setting, and raises EncodeError where it
does: ``tests/test_column_encoder.py`` property-tests both. The columns must carry what a
publisher needs (:attr:`~kvstream.events.columns.ColumnBatch.stored_extra`, as
:func:`~kvstream.events.columns.publish_columns` and the engine bridges fill it); columns built
for consumers (:meth:`~kvstream.events.columns.ColumnBatch.from_batch`, which keep the model's
blocks) are encoded through their model.

The contract on the values is the model's: columns are built from validated models or from
values a decoder checked against the same rules (the engine bridges), so nothing is validated
twice here; the encoder's own EncodeErrors (what an older schema version cannot carry) are the
model path's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from kvstream._native import load as load_native
from kvstream.codec.binary import encode_bytes, encode_long
from kvstream.codec.downgrade import EXTRA_KEYS_SINCE, KINDS_BY_VERSION, PACKED_TOKENS_SINCE
from kvstream.codec.encoder import (
    _BRANCH1,
    _DEFAULT_ATTR_FIELDS,
    _DEFAULT_CACHE_LEVEL,
    _DEFAULT_PRIORITY,
    _DEFAULT_STORED_TAIL,
    _EMPTY_ARRAY,
    _ENVELOPES,
    _EXTRA_KEYS,
    _FRAMES,
    _LONG,
    _NULL,
    _STRING,
    ENCODED_VERSIONS,
    _array,
    _opt_long,
    _opt_string,
    _opt_u64,
    _size_fields,
    _token_fields,
    _uniform_or_column,
    check_token_encoding,
    encode_batch_body,
)
from kvstream.codec.encoder import (
    _NATIVE_ENCODE as _NATIVE_BODY,
)
from kvstream.codec.tokens import encode_tokens
from kvstream.errors import EncodeError
from kvstream.events.columns import (
    CREATED,
    KIND_NAMES,
    LOST,
    REMOVED,
    STORED,
    UPDATED,
    ColumnBatch,
    StoredAttrs,
)
from kvstream.events.model import DEFAULT_HASH_ALGO, AttentionKind

__all__ = ["encode_columns_body"]

_ATTENTION: Final = {AttentionKind.FULL.value: b"\x02", AttentionKind.SLIDING_WINDOW.value: b"\x04"}
_V1_KINDS: Final = frozenset(KIND_NAMES.index(k) for k in KINDS_BY_VERSION[1])


def _kind_name(eid: int, kind: int) -> str:
    if type(kind) is not int or not 0 <= kind < len(KIND_NAMES):
        raise EncodeError(f"event {eid}: unknown event kind code {kind!r}")
    return KIND_NAMES[kind]


def _extra_keys_problem(attrs: StoredAttrs | None, version: int) -> str | None:
    if attrs is None:
        return None
    for i, keys in enumerate(attrs[7]):
        if keys is not None:
            return (
                f"schema v{version} has no extra_keys field, and block {i} has extra keys "
                f"(encode with lossy=True to write the event without them)"
            )
    return None


def _kept(cols: ColumnBatch, version: int, lossy: bool) -> list[int] | None:
    """The indices of the events ``version`` carries (None: all), as
    :func:`~kvstream.codec.downgrade.events_for_version` decides for the model."""
    if version >= EXTRA_KEYS_SINCE:
        return None
    extra = cols.stored_extra
    assert extra is not None
    n_stored = cols.kinds.count(STORED)
    if len(extra) < n_stored:
        raise EncodeError(f"columns hold {len(extra)} stored extras for {n_stored} stored events")
    stored = iter(extra)
    attrs_of = [next(stored)[1] if k == STORED else None for k in cols.kinds]
    if version >= 2:
        if not lossy:
            for eid, attrs in zip(cols.event_ids, attrs_of, strict=True):
                problem = _extra_keys_problem(attrs, version)
                if problem is not None:
                    raise EncodeError(f"event {eid}: {problem}")
        return None
    kept: list[int] = []
    for i, (eid, kind, algo) in enumerate(
        zip(cols.event_ids, cols.kinds, cols.hash_algos, strict=True)
    ):
        if kind not in _V1_KINDS:
            problem = f"schema v{version} has no '{_kind_name(eid, kind)}' events"
        elif algo != DEFAULT_HASH_ALGO:
            problem = (
                f"schema v{version} has no hash_algo field; its readers would take "
                f"{algo} hashes for {DEFAULT_HASH_ALGO} ones"
            )
        else:
            if not lossy and (p := _extra_keys_problem(attrs_of[i], version)) is not None:
                raise EncodeError(f"event {eid}: {p}")
            kept.append(i)
            continue
        if not lossy:
            raise EncodeError(
                f"event {eid}: {problem} (encode with lossy=True to leave such events out)"
            )
    return kept


def _attr_fields(attrs: StoredAttrs, version: int, out: list[bytes]) -> None:
    """The per-block attribute fields (encoder._block_attrs, from columns)."""
    levels, priorities, lora_ids, lora_names, salts, extra_ids, mm_keys, extra_keys = attrs
    _uniform_or_column(levels, _DEFAULT_CACHE_LEVEL, encode_long, encode_long, out)
    _uniform_or_column(priorities, _DEFAULT_PRIORITY, encode_long, encode_long, out)
    _uniform_or_column(lora_ids, None, _opt_u64, _opt_u64, out)
    if version < 2:
        return
    _uniform_or_column(lora_names, None, _opt_string, _opt_string, out)
    _uniform_or_column(salts, None, _opt_string, _opt_string, out)
    out.append(
        _array(
            [
                encode_long(i) + key.hash + encode_long(key.start_offset) + _opt_string(key.uuid)
                for i, keys in enumerate(mm_keys)
                for key in keys
            ]
        )
    )
    out.append(
        _array(
            [
                encode_long(i) + encode_bytes(ids.raw)
                for i, ids in enumerate(extra_ids)
                if ids is not None
            ]
        )
    )
    if version < EXTRA_KEYS_SINCE:
        return
    out.append(
        _array([_LONG[i] + _EXTRA_KEYS[k] for i, k in enumerate(extra_keys) if k is not None])
    )


def _level_attrs(level: int | list[int], n: int) -> StoredAttrs:
    levels = tuple(level) if isinstance(level, list) else (level,) * n
    none = (None,) * n
    return (levels, (_DEFAULT_PRIORITY,) * n, none, none, none, none, ((),) * n, none)


def _events(
    cols: ColumnBatch, kept: Sequence[int] | None, version: int, stored_kind: str, out: list[bytes]
) -> None:
    envelopes = _ENVELOPES[version]
    frames = _FRAMES[version]
    extra = cols.stored_extra
    assert extra is not None
    default_tail = _DEFAULT_STORED_TAIL[version]
    stored_tail = frames["stored"][1]
    rows = zip(
        cols.event_ids,
        cols.kinds,
        cols.hash_algos,
        cols.group_ids,
        cols.window_sizes,
        cols.payloads,
        strict=True,
    )
    j = -1
    for i, (eid, kind, algo, gid, window, payload) in enumerate(rows):
        if kind == STORED:
            j += 1
            if kept is not None and i not in kept:
                continue
            parent, hashes, level, _ = payload
            sizes, attrs = extra[j]
            joined = b"".join(hashes)
            out += (
                encode_long(eid),
                envelopes[stored_kind, window, algo, gid],
                _NULL if parent is None else _BRANCH1 + _LONG[len(parent)] + parent,
                _LONG[len(hashes)],
                _LONG[len(joined)],
                joined,
                _size_fields(sizes),
            )
            if attrs is None and level == 0:
                out.append(default_tail)
                continue
            if attrs is None:
                attrs = _level_attrs(level, len(hashes))
            if _is_default(attrs):
                out.append(_DEFAULT_ATTR_FIELDS[version])
            else:
                _attr_fields(attrs, version, out)
            out.append(stored_tail)
            continue
        if kept is not None and i not in kept:
            continue
        name = _kind_name(eid, kind)
        out += (encode_long(eid), envelopes[name, window, algo, gid])
        if kind == REMOVED:
            hashes, level = payload
            out.append(_LONG[len(hashes)])
            out.append(encode_bytes(b"".join(hashes)))
            if version >= 2:
                out.append(_opt_long(level))
        elif kind == UPDATED:
            h, lv, pr = payload
            out.append(encode_bytes(h))
            out.append(_NULL if lv is None else _BRANCH1 + _LONG[lv[0]] + _LONG[lv[1]])
            out.append(_NULL if pr is None else _BRANCH1 + _LONG[pr[0]] + _LONG[pr[1]])
        elif kind == CREATED:
            caps, tpb, attention = payload
            out.append(_array([encode_long(c) for c in caps]))
            if version >= 2:
                out.append(_LONG[tpb])
                out.append(_ATTENTION[attention])
        elif kind == LOST:
            first, count, reason = payload
            out += (encode_long(first), encode_long(count), _STRING[reason])
        out.append(frames[name][1])


def _is_default(attrs: StoredAttrs) -> bool:
    # every block at the defaults (StoredBlock's): the model path's pre-encoded run
    levels, priorities, lora_ids, lora_names, salts, extra_ids, mm_keys, extra_keys = attrs
    n = len(levels)
    return (
        levels.count(_DEFAULT_CACHE_LEVEL) == n
        and priorities.count(_DEFAULT_PRIORITY) == n
        and lora_ids.count(None) == n
        and lora_names.count(None) == n
        and salts.count(None) == n
        and extra_ids.count(None) == n
        and mm_keys.count(()) == n
        and extra_keys.count(None) == n
    )


def _kept_tokens(cols: ColumnBatch, kept: Sequence[int]) -> bytes:
    """The token ids of the stored events among ``kept`` (what the model path's filtered
    events carry)."""
    extra = cols.stored_extra
    assert extra is not None
    raw = cols.tokens
    keep = frozenset(kept)
    parts: list[bytes] = []
    pos = j = 0
    for i, kind in enumerate(cols.kinds):
        if kind != STORED:
            continue
        end = pos + 4 * sum(extra[j][0])
        j += 1
        if i in keep:
            parts.append(raw[pos:end])
        pos = end
    return b"".join(parts)


def _stored_attr_bytes(
    attrs: StoredAttrs | None, level: int | list[int], n: int, version: int
) -> bytes:
    """The block attribute fields of a stored event of ``n`` blocks whose attributes are not
    the plain default run (the C encoder's helper, as :func:`_events` writes them)."""
    if attrs is None:
        attrs = _level_attrs(level, n)
    if _is_default(attrs):
        return _DEFAULT_ATTR_FIELDS[version]
    out: list[bytes] = []
    _attr_fields(attrs, version, out)
    return b"".join(out)


_NativeEncode = Callable[[bytes, ColumnBatch, int, str, bool], "bytes | None"]


def _native_encode() -> _NativeEncode | None:
    mod: Any = load_native("kvstream.codec._tokens_native")
    if mod is None or _NATIVE_BODY is None:  # the model encoder's setup is shared
        return None
    v1_kinds = sum(1 << k for k in _V1_KINDS)
    mod.columns_setup(
        (AttentionKind.FULL.value, AttentionKind.SLIDING_WINDOW.value),
        DEFAULT_HASH_ALGO,
        v1_kinds,
        _stored_attr_bytes,
    )
    encode: _NativeEncode = mod.encode_columns
    return encode


#: The C encoder (``_tokens_native.encode_columns``), or None (pure Python).
_NATIVE_ENCODE: _NativeEncode | None = _native_encode()


def encode_columns_body(
    cols: ColumnBatch,
    version: int,
    *,
    lossy: bool = False,
    prefix: bytes = b"",
    token_encoding: str = "auto",
) -> bytes:
    """The schemaless Avro body of the batch ``cols`` stands for, under schema ``version``,
    after ``prefix``: byte for byte :func:`~kvstream.codec.encoder.encode_batch_body` of
    ``cols.to_batch()`` (same arguments, same EncodeErrors), without building that model when
    ``cols.stored_extra`` is set.

    One C call writes the body where the extension is built; anything it does not expect (or
    any error) sends the columns through the Python twin (:func:`_encode_columns_py`), so
    results and errors are the same either way."""
    if cols.stored_extra is None and STORED in cols.kinds:
        return encode_batch_body(
            cols.to_batch(), version, lossy=lossy, prefix=prefix, token_encoding=token_encoding
        )
    if version not in ENCODED_VERSIONS:
        raise EncodeError(f"cannot write schema version {version}; writable: {ENCODED_VERSIONS}")
    check_token_encoding(version, token_encoding)
    if cols.stored_extra is None:
        cols.stored_extra = []
    if version < PACKED_TOKENS_SINCE:
        token_encoding = "planes"
    native = _NATIVE_ENCODE
    if native is not None and type(prefix) is bytes:
        try:
            body = native(prefix, cols, version, token_encoding, lossy)
        except Exception:  # the Python path raises what these columns raise there
            body = None
        if body is not None:
            return body
    return _encode_columns_py(cols, version, lossy, prefix, token_encoding)


def _encode_columns_py(
    cols: ColumnBatch, version: int, lossy: bool, prefix: bytes, token_encoding: str
) -> bytes:
    """:func:`encode_columns_body` in Python (``stored_extra`` set, arguments checked): the
    twin of the C ``encode_columns``, and the path for what it declines."""
    try:
        kept = _kept(cols, version, lossy)
        tokens = encode_tokens(
            cols.tokens if kept is None else _kept_tokens(cols, kept), token_encoding
        )
        out: list[bytes] = []
        _events(
            cols,
            None if kept is None else frozenset(kept),  # type: ignore[arg-type]
            version,
            "stored_packed" if tokens.is_packed else "stored",
            out,
        )
        n = len(cols.event_ids) if kept is None else len(kept)
        head = [prefix, _STRING[cols.instance_id], _opt_long(cols.attention_dp_rank)]
        if version >= 2:
            head.append(encode_long(cols.incarnation))
        head.append(encode_long(cols.ts_ns))
        head += _token_fields(tokens, version)
        head.append(encode_long(n) if n else _EMPTY_ARRAY)
        if n:
            out.append(_EMPTY_ARRAY)
        head += out
        return b"".join(head)
    except EncodeError:
        raise
    except (AttributeError, TypeError, ValueError, LookupError, OverflowError) as exc:
        raise EncodeError(f"cannot encode batch: {type(exc).__name__}: {exc}") from exc
