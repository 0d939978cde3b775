"""Model <-> Avro record (the plain dicts fastavro reads and writes).

* :func:`batch_to_record` builds the record of a batch for schema v1 to v4. It is the
  reference for the fast encoder (:mod:`.encoder`, which must write the same bytes) and feeds
  fastavro where a record is needed (compatibility checks, tests).
* :func:`record_to_batch` turns a record read with a reader schema (normally the current
  one; fastavro has already resolved the writer's version into it) into an
  :class:`EventBatch`, validating every length and count; problems raise DecodeError saying
  what was wrong. Events the current model cannot represent are skipped and reported, never
  guessed: kinds unknown to this reader (``UNKNOWN``) and ``created`` events without
  ``tokens_per_block`` (v1 data) or with an unknown attention kind.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any, Final

from kvstream._types import TokenIds
from kvstream.codec.downgrade import (
    EXTRA_KEYS_SINCE,
    PACKED_TOKENS_SINCE,
    WRITABLE_VERSIONS,
    events_for_version,
)
from kvstream.codec.tokens import STORED_KINDS, encode_tokens, stored_kind, tokens_from_record
from kvstream.errors import DecodeError, EncodeError, EventValidationError
from kvstream.events.model import (
    DEFAULT_HASH_ALGO,
    AttentionKind,
    Created,
    EventBatch,
    EventDiff,
    ExtraKey,
    KVCacheEvent,
    Lost,
    Removed,
    Stored,
    Updated,
)

__all__ = ["SkippedEvent", "batch_to_record", "record_to_batch"]

_U64: Final = 2**64
_I64_MAX: Final = 2**63 - 1
_DEFAULT_CACHE_LEVEL: Final = 0
_DEFAULT_PRIORITY: Final = 35
_ATTENTION_SYMBOL: Final = {
    AttentionKind.FULL: "FULL_ATTENTION",
    AttentionKind.SLIDING_WINDOW: "SLIDING_WINDOW",
}
_ATTENTION_KIND: Final = {v: k for k, v in _ATTENTION_SYMBOL.items()}
_PAYLOAD_FIELDS: Final = ("created", "stored", "removed", "updated", "lost")


@dataclass(frozen=True)
class SkippedEvent:
    """An event the decoder left out: its id, its kind symbol on the wire, and why."""

    event_id: int
    kind: str
    reason: str


# ---------------------------------------------------------------------------------- encoding


def _signed(u64: int | None) -> int | None:
    if u64 is None:
        return None
    return u64 - _U64 if u64 > _I64_MAX else u64


def _extra_atom_record(atom: Any) -> Any:
    """An extra-key scalar as its union branch: a str or long as itself, bytes and integers
    above 2^63 - 1 as the one-field records ExtraKeyBytes and ExtraKeyUInt64."""
    if isinstance(atom, bytes):
        return {"value": atom}
    if isinstance(atom, int) and atom > _I64_MAX:
        return {"value": atom - _U64}
    return atom


def _extra_key_record(key: ExtraKey) -> Any:
    # A list, never a tuple: fastavro reads a tuple in a union as (branch name, value).
    if isinstance(key, tuple):
        return [_extra_atom_record(a) for a in key]
    return _extra_atom_record(key)


def _column(values: Sequence[Any], default: Any, rec: dict[str, Any], one: str, many: str) -> None:
    if values.count(values[0]) == len(values):
        rec[one] = values[0]
        rec[many] = None
    else:
        rec[one] = default
        rec[many] = list(values)


def _stored_record(data: Stored, version: int, tokens: list[bytes]) -> dict[str, Any]:
    blocks = data.blocks
    n = len(blocks)
    sizes = [len(b.token_ids) for b in blocks]
    tokens.extend(b.token_ids.raw for b in blocks)
    rec: dict[str, Any] = {
        "parent_hash": data.parent_hash,
        "block_count": n,
        "block_hashes": b"".join(b.block_hash for b in blocks),
    }
    same = sizes.count(sizes[0])
    if same == n or (same == n - 1 and sizes[-1] != sizes[0]):
        rec.update(block_size=sizes[0], last_block_size=sizes[-1], block_sizes=None)
    else:
        rec.update(block_size=0, last_block_size=0, block_sizes=sizes)
    _column(
        [b.cache_level for b in blocks], _DEFAULT_CACHE_LEVEL, rec, "cache_level", "cache_levels"
    )
    _column([b.priority for b in blocks], _DEFAULT_PRIORITY, rec, "priority", "priorities")
    _column([_signed(b.lora_id) for b in blocks], None, rec, "lora_id", "lora_ids")
    if version >= 2:
        _column([b.lora_name for b in blocks], None, rec, "lora_name", "lora_names")
        _column([b.cache_salt for b in blocks], None, rec, "cache_salt", "cache_salts")
        rec["mm_keys"] = [
            {"block_index": i, "hash": k.hash, "start_offset": k.start_offset, "uuid": k.uuid}
            for i, b in enumerate(blocks)
            for k in b.mm_keys
        ]
        rec["token_extra_ids"] = [
            {"block_index": i, "ids": b.token_extra_ids.raw}
            for i, b in enumerate(blocks)
            if b.token_extra_ids is not None
        ]
    if version >= EXTRA_KEYS_SINCE:
        rec["extra_keys"] = [
            {"block_index": i, "keys": [_extra_key_record(k) for k in b.extra_keys]}
            for i, b in enumerate(blocks)
            if b.extra_keys is not None
        ]
    return rec


def _diff_record(diff: EventDiff | None) -> dict[str, int] | None:
    return None if diff is None else {"old_value": diff.old_value, "new_value": diff.new_value}


def _event_record(ev: KVCacheEvent, version: int, tokens: list[bytes]) -> dict[str, Any]:
    data = ev.data
    rec: dict[str, Any] = {
        "event_id": ev.event_id,
        "kind": data.type.upper(),
        "window_size": ev.window_size,
    }
    if version >= 2:
        rec["hash_algo"] = ev.hash_algo
        rec["layer_group_id"] = ev.layer_group_id
    for name in _PAYLOAD_FIELDS[: 5 if version >= 2 else 4]:
        rec[name] = None
    if isinstance(data, Stored):
        rec["stored"] = _stored_record(data, version, tokens)
    elif isinstance(data, Removed):
        rec["removed"] = {
            "block_count": len(data.block_hashes),
            "block_hashes": b"".join(data.block_hashes),
        }
        if version >= 2:
            rec["removed"]["cache_level"] = data.cache_level
    elif isinstance(data, Updated):
        rec["updated"] = {
            "block_hash": data.block_hash,
            "cache_level": _diff_record(data.cache_level),
            "priority": _diff_record(data.priority),
        }
    elif isinstance(data, Created):
        rec["created"] = {"num_blocks_per_cache_level": list(data.num_blocks_per_cache_level)}
        if version >= 2:
            rec["created"]["tokens_per_block"] = data.tokens_per_block
            rec["created"]["attention_kind"] = _ATTENTION_SYMBOL[data.attention_kind]
    elif isinstance(data, Lost):
        rec["lost"] = {
            "first_event_id": data.first_event_id,
            "count": data.count,
            "reason": data.reason,
        }
    return rec


def batch_to_record(
    batch: EventBatch, version: int, *, lossy: bool = False, token_encoding: str = "auto"
) -> dict[str, Any]:
    """The Avro record (fastavro's dict form) of ``batch`` under schema ``version``.

    Same rules as the fast encoder: older versions drop or reject what they cannot carry
    (:mod:`kvstream.codec.downgrade`); ``token_encoding`` (see
    :func:`kvstream.codec.tokens.encode_tokens`) applies from v4 on, earlier versions always
    write bit planes. Raises EncodeError.
    """
    if version not in WRITABLE_VERSIONS:
        raise EncodeError(f"cannot build a schema v{version} record")
    if version < PACKED_TOKENS_SINCE and token_encoding not in ("auto", "planes"):
        raise EncodeError(f"schema v{version} has only bit-plane tokens, not {token_encoding!r}")
    events = events_for_version(batch, version, lossy=lossy)
    tokens: list[bytes] = []
    event_records = [_event_record(ev, version, tokens) for ev in events]
    encoded = encode_tokens(
        b"".join(tokens), token_encoding if version >= PACKED_TOKENS_SINCE else "planes"
    )
    if encoded.is_packed:
        for rec in event_records:
            if rec["kind"] == "STORED":
                rec["kind"] = "STORED_PACKED"
    packed = encoded.planes
    token_record: dict[str, Any] = {
        "count": packed.count,
        "high_bits": packed.high_bits,
        "low16": packed.low16,
        "high_planes": packed.high_planes,
    }
    if version >= PACKED_TOKENS_SINCE:
        token_record.update(
            packed_encoding=encoded.encoding,
            packed_compression=encoded.compression,
            packed_count=encoded.count if encoded.is_packed else 0,
            packed=encoded.packed,
        )
    source: dict[str, Any] = {
        "instance_id": batch.source.instance_id,
        "attention_dp_rank": batch.source.attention_dp_rank,
    }
    if version >= 2:
        source["incarnation"] = batch.source.incarnation
    return {
        "source": source,
        "ts_ns": batch.ts_ns,
        "tokens": token_record,
        "events": event_records,
    }


# ---------------------------------------------------------------------------------- decoding


def _split_hashes(data: bytes, count: int, where: str) -> list[bytes]:
    if count < 1:
        raise DecodeError(f"{where}: block_count must be >= 1, got {count}")
    width, rest = divmod(len(data), count)
    if rest or width == 0:
        raise DecodeError(
            f"{where}: {len(data)} hash bytes do not split into {count} hashes of equal width"
        )
    return [data[i : i + width] for i in range(0, len(data), width)]


def _per_block(
    rec: Mapping[str, Any], one: str, many: str, n: int, where: str
) -> Sequence[Any] | None:
    """The per-block column ``many`` (checked to have n entries) or None when uniform."""
    values = rec.get(many)
    if values is None:
        return None
    if len(values) != n:
        raise DecodeError(f"{where}.{many} has {len(values)} entries for {n} blocks")
    return list(values)


def _extra_atom(value: Any) -> Any:
    if isinstance(value, dict):  # ExtraKeyBytes or ExtraKeyUInt64
        inner = value["value"]
        if isinstance(inner, bytes):
            return inner
        return inner + _U64 if inner < 0 else inner
    return value


def _extra_key(value: Any) -> Any:
    if isinstance(value, list):  # the tuple (array) branch
        return tuple(map(_extra_atom, value))
    return _extra_atom(value)


def _unsigned(value: int | None) -> int | None:
    return value + _U64 if value is not None and value < 0 else value


class _Tokens:
    """Hands out consecutive slices of the batch's unpacked token ids."""

    def __init__(self, raw: bytes, kind: str) -> None:
        self.raw = raw
        self.pos = 0
        self.stored_kind = kind

    def take(self, sizes: Sequence[int], where: str) -> list[TokenIds]:
        if min(sizes) < 0:
            raise DecodeError(f"{where}: negative block token count {min(sizes)}")
        start = self.pos
        end = start + 4 * sum(sizes)
        if end > len(self.raw):
            raise DecodeError(
                f"{where}: blocks need more token ids than the batch's TokenPack holds "
                f"({len(self.raw) // 4})"
            )
        self.pos = end
        raw = self.raw
        bounds = [start + 4 * t for t in accumulate(sizes, initial=0)]
        return [TokenIds.from_bytes(raw[a:b]) for a, b in pairwise(bounds)]


def _block_sizes(rec: Mapping[str, Any], n: int, where: str) -> Sequence[int]:
    sizes = _per_block(rec, "block_size", "block_sizes", n, where)
    if sizes is not None:
        return sizes
    return [rec["block_size"]] * (n - 1) + [rec["last_block_size"]]


def _stored_data(rec: Mapping[str, Any], tokens: _Tokens, where: str) -> dict[str, Any]:
    n = rec["block_count"]
    hashes = _split_hashes(rec["block_hashes"], n, where)
    token_ids = tokens.take(_block_sizes(rec, n, where), where)
    blocks: list[dict[str, Any]] = [
        {"block_hash": h, "token_ids": t} for h, t in zip(hashes, token_ids, strict=True)
    ]
    for one, many, key, default, convert in (
        ("cache_level", "cache_levels", "cache_level", _DEFAULT_CACHE_LEVEL, None),
        ("priority", "priorities", "priority", _DEFAULT_PRIORITY, None),
        ("lora_id", "lora_ids", "lora_id", None, _unsigned),
        ("lora_name", "lora_names", "lora_name", None, None),
        ("cache_salt", "cache_salts", "cache_salt", None, None),
    ):
        column = _per_block(rec, one, many, n, where)
        if column is None:
            value = rec.get(one, default)
            if value != default:
                value = convert(value) if convert else value
                for b in blocks:
                    b[key] = value
        else:
            for b, value in zip(blocks, column, strict=True):
                if value != default:
                    b[key] = convert(value) if convert else value
    last = 0  # a block may have several keys (repeated index), but none has index -1
    mm: dict[int, list[dict[str, Any]]] = {}
    for entry in rec.get("mm_keys", ()):
        i = entry["block_index"]
        if not last <= i < n:
            raise DecodeError(
                f"{where}.mm_keys: block_index {i} out of order or outside 0..{n - 1}"
            )
        last = i
        mm.setdefault(i, []).append(
            {"hash": entry["hash"], "start_offset": entry["start_offset"], "uuid": entry["uuid"]}
        )
    for i, keys in mm.items():
        blocks[i]["mm_keys"] = keys
    last = -1
    for entry in rec.get("token_extra_ids", ()):
        i = entry["block_index"]
        if not last < i < n:
            raise DecodeError(
                f"{where}.token_extra_ids: block_index {i} repeated, out of order or outside "
                f"0..{n - 1}"
            )
        last = i
        ids = entry["ids"]
        if len(ids) != len(token_ids[i].raw):
            raise DecodeError(
                f"{where}.token_extra_ids: block {i} has {len(token_ids[i])} tokens but "
                f"{len(ids)} bytes of extra ids (need 4 per token)"
            )
        blocks[i]["token_extra_ids"] = TokenIds.from_bytes(ids)
    last = -1
    for entry in rec.get("extra_keys", ()):
        i = entry["block_index"]
        if not last < i < n:
            raise DecodeError(
                f"{where}.extra_keys: block_index {i} repeated, out of order or outside 0..{n - 1}"
            )
        last = i
        blocks[i]["extra_keys"] = tuple(map(_extra_key, entry["keys"]))
    parent = rec["parent_hash"]
    if parent is not None and len(parent) != len(hashes[0]):
        raise DecodeError(
            f"{where}: parent_hash has {len(parent)} bytes, block hashes {len(hashes[0])}"
        )
    return {"type": "stored", "parent_hash": parent, "blocks": blocks}


def _diff(rec: Mapping[str, Any] | None) -> dict[str, int] | None:
    return None if rec is None else {"old_value": rec["old_value"], "new_value": rec["new_value"]}


def _data(kind: str, ev: Mapping[str, Any], tokens: _Tokens, where: str) -> dict[str, Any] | str:
    """The model dict of the payload, or a reason string when the event must be skipped."""
    if kind in STORED_KINDS:
        if kind != tokens.stored_kind:
            raise DecodeError(
                f"{where}: kind {kind} in a batch whose token ids call for {tokens.stored_kind}"
            )
        kind = "STORED"
    payload_name = kind.lower()
    for name in _PAYLOAD_FIELDS:
        if name != payload_name and ev.get(name) is not None:
            raise DecodeError(f"{where}: kind {kind} but the '{name}' payload is set")
    if kind == "CLEARED":
        return {"type": "cleared"}
    rec = ev.get(payload_name)
    if rec is None:
        raise DecodeError(f"{where}: kind {kind} but its '{payload_name}' payload is null")
    where = f"{where}.{payload_name}"
    if kind == "STORED":
        return _stored_data(rec, tokens, where)
    if kind == "REMOVED":
        return {
            "type": "removed",
            "block_hashes": _split_hashes(rec["block_hashes"], rec["block_count"], where),
            "cache_level": rec.get("cache_level"),
        }
    if kind == "UPDATED":
        return {
            "type": "updated",
            "block_hash": rec["block_hash"],
            "cache_level": _diff(rec["cache_level"]),
            "priority": _diff(rec["priority"]),
        }
    if kind == "CREATED":
        tokens_per_block = rec.get("tokens_per_block", 0)
        if tokens_per_block == 0:
            return "created event without tokens_per_block (v1 data)"
        symbol = rec.get("attention_kind", "FULL_ATTENTION")
        attention = _ATTENTION_KIND.get(symbol)
        if attention is None:
            return f"created event with attention kind {symbol} unknown here"
        return {
            "type": "created",
            "num_blocks_per_cache_level": tuple(rec["num_blocks_per_cache_level"]),
            "tokens_per_block": tokens_per_block,
            "attention_kind": attention,
        }
    if kind == "LOST":
        return {
            "type": "lost",
            "first_event_id": rec["first_event_id"],
            "count": rec["count"],
            "reason": rec["reason"],
        }
    raise DecodeError(f"{where}: unknown event kind symbol {kind!r}")  # pragma: no cover


def _events(
    records: Sequence[Mapping[str, Any]], tokens: _Tokens, skipped: list[SkippedEvent]
) -> Iterator[dict[str, Any]]:
    for i, ev in enumerate(records):
        kind = ev["kind"]
        if kind == "UNKNOWN":
            skipped.append(SkippedEvent(ev["event_id"], kind, "event kind unknown to this reader"))
            continue
        data = _data(kind, ev, tokens, f"events[{i}]")
        if isinstance(data, str):
            skipped.append(SkippedEvent(ev["event_id"], kind, data))
            continue
        yield {
            "event_id": ev["event_id"],
            "hash_algo": ev.get("hash_algo", DEFAULT_HASH_ALGO),
            "layer_group_id": ev.get("layer_group_id", 0),
            "window_size": ev["window_size"],
            "data": data,
        }


def record_to_batch(
    record: Mapping[str, Any], schema_version: int
) -> tuple[EventBatch, tuple[SkippedEvent, ...]]:
    """The batch of a record read with a kvstream reader schema, and the events skipped.

    Fields an older reader schema lacks take the model's defaults (the same values the
    current schema's field defaults give).

    ``schema_version`` (the writer's version) becomes ``EventBatch.schema_version``. Raises
    DecodeError for inconsistent lengths/counts or values the model rejects (the model's
    EventValidationError is chained as the cause).
    """
    try:
        token_record = record["tokens"]
        tokens = _Tokens(tokens_from_record(token_record), stored_kind(token_record))
        skipped: list[SkippedEvent] = []
        events = list(_events(record["events"], tokens, skipped))
        if tokens.pos != len(tokens.raw):
            raise DecodeError(
                f"the TokenPack holds {len(tokens.raw) // 4} token ids but the stored blocks "
                f"use {tokens.pos // 4}"
            )
        source = record["source"]
        batch = EventBatch.model_validate(
            {
                "source": {
                    "instance_id": source["instance_id"],
                    "attention_dp_rank": source["attention_dp_rank"],
                    "incarnation": source.get("incarnation", 0),
                },
                "ts_ns": record["ts_ns"],
                "schema_version": schema_version,
                "events": events,
            }
        )
    except EventValidationError as exc:
        raise DecodeError(f"decoded values break the event model: {exc}") from exc
    except (KeyError, TypeError, AttributeError) as exc:  # a record not of the reader schema
        raise DecodeError(f"record does not have the reader schema's shape: {exc!r}") from exc
    return batch, tuple(skipped)
