"""Avro records straight into the columns a consumer needs, without building the event model.

A prefix index needs, per event, its id, kind, hash algorithm, layer group and window, and
per kind a few values: a stored event's parent hash, block hashes and cache levels; a
removed event's hashes; an update's hash and diffs; a created event's capacity and block
size; a lost marker's range. :func:`record_columns` reads exactly those from the record
fastavro decoded into a :class:`ColumnBatch`, about ten times faster than
:func:`~kvstream.codec.records.record_to_batch` builds pydantic models (which stay the public,
validated API: :meth:`ColumnBatch.to_batch` builds them on demand, from the same record).

Validation is not relaxed: every rule the event model and ``record_to_batch`` enforce on a
decoded record (lengths, counts, ranges, hash widths per algorithm, the token pack) is checked
on the columns, and a record one path rejects the other rejects too, with the same error type
(DecodeError); ``tests/test_columnar*.py`` property-tests that equivalence, malformed records
included. Token ids are unpacked once per batch by :func:`kvstream.codec.tokens.tokens_from_record`
(which validates the pack) and kept as raw bytes in :attr:`ColumnBatch.tokens`.

Readers: :func:`decode_columns_message` (single-object or Confluent bytes, any known writer
version) and :class:`ColumnarContainerReader` (object container files, the same framing,
torn-tail and skipped-event handling as :class:`~kvstream.codec.container.ContainerReader`).

Native fast path: records written with the shipped schema v3 or v4 (and read with it) are
decoded by the optional C extension ``kvstream.codec._columns_native`` straight from the Avro
bytes into the columns, hash slices and token ids included. It only accepts: for any record it
is not sure about (malformed, truncated, unusual, breaking a rule) it answers None and the
record is decoded here, by fastavro and :func:`record_columns`, the reference, which raises
the DecodeError or returns the result. Both paths give identical columns (property-tested on
valid, mutated and torn input). ``KVSTREAM_NO_NATIVE=1`` before import, or a missing
extension, leaves only the reference (:data:`NATIVE` says which).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, cast

from kvstream._native import load as load_native
from kvstream._types import ALLOWED_UNKNOWN_WIDTHS, BLOCK_HASH_WIDTHS, PRIORITY_MAX
from kvstream.codec.container import ContainerReader
from kvstream.codec.decoder import read_record
from kvstream.codec.framing import (
    SINGLE_OBJECT_HEADER_LEN,
    SINGLE_OBJECT_MAGIC,
    split_confluent,
    split_single_object,
)
from kvstream.codec.records import SkippedEvent, record_to_batch
from kvstream.codec.schemas import RELEASED, SchemaInfo, SchemaRegistry
from kvstream.codec.tokens import (
    MAX_HIGH_BITS,
    STORED_KINDS,
    _zstd_decompress,
    stored_kind,
    tokens_from_record,
)
from kvstream.errors import DecodeError, UnknownSchemaError
from kvstream.events.columns import (
    CLEARED,
    CREATED,
    KIND_NAMES,
    LOST,
    REMOVED,
    STORED,
    UPDATED,
    ColumnBatch,
)
from kvstream.events.model import DEFAULT_HASH_ALGO, AttentionKind, EventBatch

__all__ = [
    "NATIVE",
    "ColumnarContainerReader",
    "ColumnarResult",
    "decode_columns_body",
    "decode_columns_message",
    "record_columns",
]

_KIND_CODE: Final = {
    "CREATED": CREATED,
    "STORED": STORED,
    "REMOVED": REMOVED,
    "UPDATED": UPDATED,
    "CLEARED": CLEARED,
    "LOST": LOST,
}
_PAYLOADS: Final = ("created", "stored", "removed", "updated", "lost")
#: Per kind code, the payload fields that must be null.
_OTHERS: Final = tuple(tuple(p for p in _PAYLOADS if p != name) for name in KIND_NAMES)
_ATTENTION: Final = {
    "FULL_ATTENTION": AttentionKind.FULL.value,
    "SLIDING_WINDOW": AttentionKind.SLIDING_WINDOW.value,
}
_I32_MAX: Final = 2**31 - 1
_I64_MAX: Final = 2**63 - 1
_MAX_HASH: Final = 64


def _load_native() -> Any:
    mod: Any = load_native("kvstream.codec._columns_native")
    if mod is None:
        return None
    attention = (None, AttentionKind.FULL.value, AttentionKind.SLIDING_WINDOW.value)
    mod.configure(dict(BLOCK_HASH_WIDTHS), tuple(ALLOWED_UNKNOWN_WIDTHS), PRIORITY_MAX, attention)
    return mod


_native: Any = _load_native()
#: Whether the C decoder of schema v3/v4 records is in use (else fastavro for every record).
NATIVE: Final = _native is not None
#: The writer fingerprints whose records the C decoder reads: the shipped v3 and v4 layouts.
_NATIVE_LAYOUTS: Final = {bytes.fromhex(RELEASED[v].fingerprint): v for v in (3, 4)}


@dataclass(frozen=True, slots=True)
class ColumnarResult:
    """A decoded message as columns, its writer version and the events left out."""

    columns: ColumnBatch
    writer_version: int
    skipped: tuple[SkippedEvent, ...] = ()

    @property
    def batch(self) -> EventBatch:
        """The validated model of the batch (built on demand)."""
        return self.columns.to_batch()


def _record_model(record: Mapping[str, Any], schema_version: int) -> EventBatch:
    """The validated model of a decoded record (what :meth:`ColumnBatch.to_batch` builds)."""
    return record_to_batch(record, schema_version)[0]


def _body_model(buf: bytes | memoryview, start: int, end: int, writer: SchemaInfo) -> EventBatch:
    """The validated model of the record the C decoder read at ``buf[start:end]``."""
    return _record_model(read_record(bytes(buf[start:end]), writer, writer), writer.version)


# ---------------------------------------------------------------------------- validation


def _bad(where: str, what: str) -> DecodeError:
    return DecodeError(f"decoded values break the event model: {where}: {what}")


def _split(data: bytes, count: int, where: str) -> list[bytes]:
    if count < 1:
        raise DecodeError(f"{where}: block_count must be >= 1, got {count}")
    width, rest = divmod(len(data), count)
    if rest or width == 0:
        raise DecodeError(
            f"{where}: {len(data)} hash bytes do not split into {count} hashes of equal width"
        )
    if width > _MAX_HASH:
        raise _bad(where, f"a block hash has at most {_MAX_HASH} bytes, got {width}")
    if count == 1:
        return [data]
    return [data[i : i + width] for i in range(0, len(data), width)]


#: The hash width every known algorithm publishes (a hit skips :func:`_check_width`).
_WIDTH_OK: Final = dict(BLOCK_HASH_WIDTHS)


def _check_width(algo: str, width: int, where: str) -> None:
    want = BLOCK_HASH_WIDTHS.get(algo)
    if want is None:
        if width not in ALLOWED_UNKNOWN_WIDTHS:
            raise _bad(where, f"a hash must be {ALLOWED_UNKNOWN_WIDTHS} bytes, got {width}")
    elif width != want:
        raise _bad(where, f"{algo} hashes are {want} bytes, got {width}")


def _int_range(value: Any, lo: int, hi: int, where: str) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(where, f"must be an int in {lo}..{hi}, got {value!r}")
    return value


def _column(rec: Mapping[str, Any], many: str, n: int, where: str) -> list[Any] | None:
    values = rec.get(many)
    if values is None:
        return None
    if len(values) != n:
        raise DecodeError(f"{where}.{many} has {len(values)} entries for {n} blocks")
    return list(values)


def _check_sparse(entries: Sequence[Mapping[str, Any]], n: int, where: str, strict: bool) -> None:
    # strict: one entry per block at most; else repeats are allowed, but never index -1
    last = -1 if strict else 0
    for entry in entries:
        i = entry["block_index"]
        if not (last < i < n if strict else last <= i < n):
            raise DecodeError(
                f"{where}: block_index {i} repeated, out of order or outside 0..{n - 1}"
            )
        last = i


def _stored(
    rec: Mapping[str, Any], algo: str, pos: int, n_tokens: int, i: int
) -> tuple[tuple[Any, ...], int]:
    """The stored payload of event ``i`` and the token position after its blocks."""
    get = rec.get
    n = rec["block_count"]
    data = rec["block_hashes"]
    if n < 1 or len(data) % n or not data or len(data) > n * _MAX_HASH:
        _split(data, n, f"events[{i}].stored")  # raises, saying why
    width = len(data) // n
    hashes = [data] if n == 1 else [data[k : k + width] for k in range(0, len(data), width)]
    sizes = get("block_sizes")
    if sizes is None:
        last = rec["last_block_size"]
        first = rec["block_size"] if n > 1 else last
        low = first if first < last else last
        used = first * (n - 1) + last
    else:
        if len(sizes) != n:
            raise DecodeError(
                f"events[{i}].stored.block_sizes has {len(sizes)} entries for {n} blocks"
            )
        first = sizes[0]
        low = min(sizes)
        used = sum(sizes)
    if low < 0:
        raise DecodeError(f"events[{i}].stored: negative block token count {low}")
    end = pos + used
    if end > n_tokens:
        raise DecodeError(
            f"events[{i}].stored: blocks need more token ids than the batch's TokenPack holds "
            f"({n_tokens})"
        )
    levels = get("cache_levels")
    level: int | list[int]
    if levels is None:
        level = get("cache_level", 0)
        if type(level) is not int or not 0 <= level <= _I32_MAX:
            _int_range(level, 0, _I32_MAX, f"events[{i}].stored.cache_level")
    else:
        where = f"events[{i}].stored"
        levels = _column(rec, "cache_levels", n, where)
        assert levels is not None
        for v in levels:
            _int_range(v, 0, _I32_MAX, f"{where}.cache_levels")
        level = levels[0] if levels.count(levels[0]) == n else levels
    prios = get("priorities")
    if prios is None:
        prio = get("priority", 35)
        if type(prio) is not int or not 0 <= prio <= PRIORITY_MAX:
            _int_range(prio, 0, PRIORITY_MAX, f"events[{i}].stored.priority")
    else:
        prios = _column(rec, "priorities", n, f"events[{i}].stored")
        for v in prios or ():
            _int_range(v, 0, PRIORITY_MAX, f"events[{i}].stored.priority")
    if (
        get("lora_ids") is not None
        or get("lora_names") is not None
        or get("cache_salts") is not None
    ):
        for many in ("lora_ids", "lora_names", "cache_salts"):
            _column(rec, many, n, f"events[{i}].stored")
    if get("mm_keys") or get("token_extra_ids") or get("extra_keys"):
        _sparse_columns(rec, n, sizes, first, f"events[{i}].stored")
    parent = rec["parent_hash"]
    if parent is not None and len(parent) != width:
        raise DecodeError(
            f"events[{i}].stored: parent_hash has {len(parent)} bytes, block hashes {width}"
        )
    if _WIDTH_OK.get(algo) != width:
        _check_width(algo, width, f"events[{i}].stored")
    return (parent, hashes, level, first), end


_SCOPE_FIELDS: Final = (
    "lora_id",
    "lora_ids",
    "lora_name",
    "lora_names",
    "cache_salt",
    "cache_salts",
)
_SPARSE_FIELDS: Final = ("mm_keys", "token_extra_ids", "extra_keys")


def _plain_layout(rec: Mapping[str, Any], pos: int) -> tuple[int, list[int]] | None:
    """A stored record's :attr:`ColumnBatch.token_layout` entry: its first token's offset
    ``pos`` and its blocks' token counts when they carry token ids only, else None."""
    get = rec.get
    # _SCOPE_FIELDS and _SPARSE_FIELDS, spelled out: this runs once per stored event
    if (
        get("lora_id") is not None
        or get("lora_ids") is not None
        or get("lora_name") is not None
        or get("lora_names") is not None
        or get("cache_salt") is not None
        or get("cache_salts") is not None
        or get("mm_keys")
        or get("token_extra_ids")
        or get("extra_keys")
    ):
        return None
    n = rec["block_count"]
    sizes = get("block_sizes")
    if sizes is None:
        last = rec["last_block_size"]
        sizes = [rec["block_size"]] * (n - 1) + [last]
    return pos, list(sizes)


def _sparse_columns(
    rec: Mapping[str, Any], n: int, sizes: Sequence[int] | None, first: int, where: str
) -> None:
    """Check the sparse per-block arrays: multimodal keys, extra token ids, extra keys."""
    last = rec["last_block_size"]
    mm = rec.get("mm_keys", ())
    if mm:
        _check_sparse(mm, n, f"{where}.mm_keys", False)
        for entry in mm:
            if len(entry["hash"]) != 32:
                raise _bad(f"{where}.mm_keys", f"hash must be 32 bytes, got {len(entry['hash'])}")
            _int_range(entry["start_offset"], 0, _I32_MAX, f"{where}.mm_keys.start_offset")
    extra_ids = rec.get("token_extra_ids", ())
    if extra_ids:
        _check_sparse(extra_ids, n, f"{where}.token_extra_ids", True)
        for entry in extra_ids:
            i = entry["block_index"]
            size = sizes[i] if sizes is not None else (last if i == n - 1 else first)
            if len(entry["ids"]) != 4 * size:
                raise DecodeError(
                    f"{where}.token_extra_ids: block {i} has {size} tokens but "
                    f"{len(entry['ids'])} bytes of extra ids (need 4 per token)"
                )
    extra = rec.get("extra_keys", ())
    if extra:
        _check_sparse(extra, n, f"{where}.extra_keys", True)


def _diff(rec: Mapping[str, Any] | None, hi: int, where: str) -> tuple[int, int] | None:
    if rec is None:
        return None
    return (
        _int_range(rec["old_value"], 0, hi, where),
        _int_range(rec["new_value"], 0, hi, where),
    )


def record_columns(
    record: Mapping[str, Any], schema_version: int
) -> tuple[ColumnBatch, tuple[SkippedEvent, ...]]:
    """The columns of a record read with a kvstream reader schema, and the events skipped.

    The same contract as :func:`~kvstream.codec.records.record_to_batch` (which
    :meth:`ColumnBatch.to_batch` calls on this record): DecodeError for everything it
    rejects, the same events skipped."""
    try:
        return _record_columns(record, schema_version)
    except (KeyError, TypeError, AttributeError) as exc:  # a record not of the reader schema
        raise DecodeError(f"record does not have the reader schema's shape: {exc!r}") from exc


def _record_columns(
    record: Mapping[str, Any], schema_version: int
) -> tuple[ColumnBatch, tuple[SkippedEvent, ...]]:
    token_record = record["tokens"]
    raw = tokens_from_record(token_record)
    packed_kind = stored_kind(token_record)
    n_tokens = len(raw) >> 2
    source = record["source"]
    inst = source["instance_id"]
    if not 1 <= len(inst) <= 256:
        raise _bad("source.instance_id", f"must have 1..256 characters, got {len(inst)}")
    rank = source["attention_dp_rank"]
    if rank is not None:
        _int_range(rank, 0, _I32_MAX, "source.attention_dp_rank")
    inc = _int_range(source.get("incarnation", 0), 0, _I64_MAX, "source.incarnation")
    ts = _int_range(record["ts_ns"], 0, _I64_MAX, "ts_ns")
    out = ColumnBatch(
        inst,
        attention_dp_rank=rank,
        incarnation=inc,
        ts_ns=ts,
        schema_version=schema_version,
        tokens=raw,
        build=partial(_record_model, record, schema_version),
    )
    skipped: list[SkippedEvent] = []
    pos = 0
    layout: list[tuple[int, list[int]] | None] = []
    out.token_layout = layout
    ids = out.event_ids
    kinds = out.kinds
    algos = out.hash_algos
    gids = out.group_ids
    windows = out.window_sizes
    payloads = out.payloads
    kind_code = _KIND_CODE
    for i, ev in enumerate(record["events"]):
        kind = ev["kind"]
        eid = ev["event_id"]
        if kind == "UNKNOWN":
            skipped.append(SkippedEvent(eid, kind, "event kind unknown to this reader"))
            continue
        if kind in STORED_KINDS:
            if kind != packed_kind:
                raise DecodeError(
                    f"events[{i}]: kind {kind} in a batch whose token ids call for {packed_kind}"
                )
            kind = "STORED"
        code = kind_code.get(kind)
        if code is None:
            raise DecodeError(f"events[{i}]: unknown event kind symbol {kind!r}")
        name = KIND_NAMES[code]
        get = ev.get
        rec = get(name) if code != CLEARED else None
        for other in _OTHERS[code]:
            if get(other) is not None:
                raise DecodeError(f"events[{i}]: kind {kind} but the '{other}' payload is set")
        if rec is None and code != CLEARED:
            raise DecodeError(f"events[{i}]: kind {kind} but its '{name}' payload is null")
        where = f"events[{i}].{name}"
        algo = get("hash_algo", DEFAULT_HASH_ALGO)
        payload: Any
        pos0 = pos
        if code == STORED:
            payload, pos = _stored(rec, algo, pos, n_tokens, i)  # type: ignore[arg-type]
        elif code == REMOVED:
            hashes = _split(rec["block_hashes"], rec["block_count"], where)  # type: ignore[index]
            lv = rec.get("cache_level")  # type: ignore[union-attr]
            if lv is not None:
                _int_range(lv, 0, _I32_MAX, f"{where}.cache_level")
            _check_width(algo, len(hashes[0]), where)
            payload = (hashes, lv)
        elif code == UPDATED:
            h = rec["block_hash"]  # type: ignore[index]
            if not 1 <= len(h) <= _MAX_HASH:
                raise _bad(f"{where}.block_hash", f"must have 1..{_MAX_HASH} bytes")
            lvd = _diff(rec["cache_level"], _I32_MAX, f"{where}.cache_level")  # type: ignore[index]
            prd = _diff(rec["priority"], _I32_MAX, f"{where}.priority")  # type: ignore[index]
            if lvd is None and prd is None:
                raise _bad(where, "an updated event must change cache_level or priority")
            if prd is not None and not (prd[0] <= PRIORITY_MAX and prd[1] <= PRIORITY_MAX):
                raise _bad(where, f"priority {prd} is outside 0..{PRIORITY_MAX}")
            _check_width(algo, len(h), where)
            payload = (h, lvd, prd)
        elif code == CREATED:
            tpb = rec.get("tokens_per_block", 0)  # type: ignore[union-attr]
            if tpb == 0:
                skipped.append(
                    SkippedEvent(eid, kind, "created event without tokens_per_block (v1 data)")
                )
                continue
            symbol = rec.get("attention_kind", "FULL_ATTENTION")  # type: ignore[union-attr]
            attention = _ATTENTION.get(symbol)
            if attention is None:
                skipped.append(
                    SkippedEvent(
                        eid, kind, f"created event with attention kind {symbol} unknown here"
                    )
                )
                continue
            _int_range(tpb, 1, _I32_MAX, f"{where}.tokens_per_block")
            caps = tuple(rec["num_blocks_per_cache_level"])  # type: ignore[index]
            if not caps:
                raise _bad(f"{where}.num_blocks_per_cache_level", "needs at least one level")
            for c in caps:
                _int_range(c, 0, _I64_MAX, f"{where}.num_blocks_per_cache_level")
            payload = (caps, tpb, attention)
        elif code == LOST:
            first = _int_range(rec["first_event_id"], 0, _I64_MAX, f"{where}.first_event_id")  # type: ignore[index]
            count = _int_range(rec["count"], 1, _I64_MAX, f"{where}.count")  # type: ignore[index]
            reason = rec["reason"]  # type: ignore[index]
            if len(reason) > 1024:
                raise _bad(f"{where}.reason", "has more than 1024 characters")
            payload = (first, count, reason)
        else:
            payload = None
        gid = get("layer_group_id", 0)
        window = ev["window_size"]
        if not (
            type(eid) is int
            and 0 <= eid <= _I64_MAX
            and 1 <= len(algo) <= 64
            and type(gid) is int
            and 0 <= gid <= _I32_MAX
            and type(window) is int
            and 1 <= window <= _I64_MAX
        ):
            _int_range(eid, 0, _I64_MAX, f"events[{i}].event_id")
            if not 1 <= len(algo) <= 64:
                raise _bad(f"events[{i}].hash_algo", f"must have 1..64 characters, got {len(algo)}")
            _int_range(gid, 0, _I32_MAX, f"events[{i}].layer_group_id")
            _int_range(window, 1, _I64_MAX, f"events[{i}].window_size")
        if code == STORED:
            layout.append(_plain_layout(rec, pos0))  # type: ignore[arg-type]
        ids.append(eid)
        kinds.append(code)
        algos.append(algo)
        gids.append(gid)
        windows.append(window)
        payloads.append(payload)
    if pos != n_tokens:
        raise DecodeError(
            f"the TokenPack holds {n_tokens} token ids but the stored blocks use {pos}"
        )
    return out, tuple(skipped)


# ---------------------------------------------------------------------------- readers


def _native_ok(writer: SchemaInfo) -> bool:
    """Whether the C decoder reads ``writer``'s records (read with ``writer`` itself)."""
    return _native is not None and _NATIVE_LAYOUTS.get(writer.fingerprint) == writer.version


def _native_columns(
    buf: bytes | memoryview, offset: int, writer: SchemaInfo
) -> tuple[ColumnBatch, tuple[SkippedEvent, ...], int] | None:
    """The C decoder's columns of the record at ``buf[offset:]``, its skipped events and where
    it ends; None when the reference must decode it (see the module doc)."""
    got = _native.decode(buf, offset, writer.version)
    if got is None:
        return None
    (
        end,
        inst,
        rank,
        inc,
        ts,
        tokens,
        ids,
        kinds,
        algos,
        gids,
        windows,
        payloads,
        skipped,
        layout,
    ) = got
    planes = None
    if type(tokens) is tuple and len(tokens) == 4:  # valid bit planes, unpacked on demand
        planes = (_native.planes_ids, buf, *tokens)
        tokens = None
    elif type(tokens) is tuple:  # zstd-compressed packed ids, decompressed as tokens.py does
        code, count, packed = tokens
        # the most bytes `count` ids can take in this encoding (tokens.decode_packed's bound)
        most = 2 * count + MAX_HIGH_BITS * ((count + 7) >> 3) if code == 2 else 5 * count
        try:
            data = _zstd_decompress(packed, most)
        except DecodeError:
            return None
        tokens = _native.packed_ids(code, data, count)
        if tokens is None:
            return None
    # to_batch reads the record again later: from an immutable buffer
    body = (
        (buf, offset, end, writer)
        if type(buf) is bytes
        else (bytes(buf[offset:end]), 0, end - offset, writer)
    )
    out = ColumnBatch.decoded(
        inst, rank, inc, ts, writer.version, tokens, planes, partial(_body_model, *body),
        ids, kinds, algos, gids, windows, payloads, layout,
    )  # fmt: skip
    return out, tuple(SkippedEvent(*s) for s in skipped) if skipped else (), end


def decode_columns_body(body: bytes, writer: SchemaInfo, reader: SchemaInfo) -> ColumnarResult:
    """Decode a schemaless body written with ``writer`` (resolved into ``reader``)."""
    if reader is writer and _native_ok(writer):
        got = _native_columns(body, 0, writer)
        if got is not None and got[2] == len(body):
            return ColumnarResult(got[0], writer.version, got[1])
    record = read_record(body, writer, reader)
    cols, skipped = record_columns(record, writer.version)
    return ColumnarResult(cols, writer.version, skipped)


def _single_object_native(data: bytes, registry: SchemaRegistry) -> ColumnarResult | None:
    try:
        writer = registry.by_fingerprint(data[2:SINGLE_OBJECT_HEADER_LEN])
    except UnknownSchemaError:
        return None
    if not _native_ok(writer):
        return None
    got = _native_columns(data, SINGLE_OBJECT_HEADER_LEN, writer)
    if got is None or got[2] != len(data):
        return None
    return ColumnarResult(got[0], writer.version, got[1])


def decode_columns_message(
    data: bytes | bytearray | memoryview,
    registry: SchemaRegistry,
    *,
    reader_version: int | None = None,
    schema_ids: Mapping[int, int] | Callable[[int], int] | None = None,
    header_version: int | None = None,
) -> ColumnarResult:
    """Decode a message of either framing into columns: Avro single-object (``C3 01`` +
    fingerprint) or Confluent (``00`` + schema id, mapped to a version by ``schema_ids``,
    else ``header_version``). Raises DecodeError (UnknownSchemaError for unknown schemas)."""
    # A shipped writer version is read with its own schema: the columns take the current
    # schema's defaults for fields it lacks, so fastavro's (slower) resolution is only needed
    # to behave like an older reader (``reader_version``).
    if (
        _native is not None
        and reader_version is None
        and type(data) is bytes
        and data[:2] == SINGLE_OBJECT_MAGIC
    ):
        # the C decoder reads the body in place (no copy); anything else takes the path below
        got = _single_object_native(data, registry)
        if got is not None:
            return got
    reader = None if reader_version is None else registry.get(reader_version)
    if bytes(data[:1]) == b"\x00":
        sid, body = split_confluent(data)
        version: int | None = None
        if schema_ids is not None:
            try:
                version = schema_ids(sid) if callable(schema_ids) else schema_ids[sid]
            except LookupError:
                version = None
        if version is None:
            version = header_version
        if version is None:
            raise UnknownSchemaError(
                f"Confluent message with schema id {sid}: no mapping to a schema version "
                "(pass schema_ids or send the kvstream-schema-version header)"
            )
        writer = registry.get(version)
        return decode_columns_body(body, writer, reader or writer)
    fingerprint, body = split_single_object(data)
    writer = registry.by_fingerprint(fingerprint)
    return decode_columns_body(body, writer, reader or writer)


class ColumnarContainerReader(ContainerReader):
    """A :class:`~kvstream.codec.container.ContainerReader` that yields :class:`ColumnBatch`
    objects instead of model batches: the same framing, torn-tail, ``skipped`` and position
    attributes; only the records are turned into columns."""

    def _record_reader(self) -> Any:
        # a shipped version is read with its own schema (see decode_columns_message); a later
        # one this reader does not ship is resolved into the current schema
        writer = self.writer_schema
        assert writer is not None
        shipped = writer.version in self._registry.versions() and (
            self._registry.get(writer.version).fingerprint == writer.fingerprint
        )
        return None if shipped or writer is self._reader_schema else self._reader_schema.parsed

    def _decode_records(self, payload: bytes, count: int) -> list[ColumnBatch]:  # type: ignore[override]
        writer = self.writer_schema
        assert writer is not None
        reader = self._record_reader()
        native = reader is None and _native_ok(writer)
        fo: io.BytesIO | None = None
        pos = 0
        out = []
        for i in range(count):
            got = _native_columns(payload, pos, writer) if native else None
            if got is not None:
                cols, skipped, pos = got
            else:  # the reference decodes this record, from where it starts
                if fo is None:
                    fo = io.BytesIO(payload)
                fo.seek(pos)
                record = self._read_record(fo, i, reader)
                pos = fo.tell()
                cols, skipped = record_columns(record, writer.version)
            self.skipped.extend(skipped)
            out.append(cols)
        self._check_consumed(pos, payload, count)
        return out

    def __next__(self) -> ColumnBatch:  # type: ignore[override]
        return super().__next__()  # type: ignore[return-value]

    def __iter__(self) -> Iterator[ColumnBatch]:  # type: ignore[override]
        return cast("Iterator[ColumnBatch]", self)
