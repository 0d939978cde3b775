"""Schema v3: the engines' per-block extra keys on the wire; what older versions do with them."""

from __future__ import annotations

import io
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from test_codec_roundtrip import as_v1_sees_it, as_v2_sees_it
from test_codec_strategies import batches, v1_batches

from kvstream._types import CacheLevel, TokenIds
from kvstream.codec import AvroCodec, read_container, schema_registry, write_container
from kvstream.codec.records import batch_to_record
from kvstream.errors import DecodeError, EncodeError
from kvstream.events.model import (
    EventBatch,
    EventDiff,
    ExtraKey,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
    Updated,
)

CODEC = AvroCodec(3)  # this module is about schema v3 itself
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
V3 = schema_registry().get(3)


def _batch(*extra_keys: tuple[ExtraKey, ...] | None, event_id: int = 7) -> EventBatch:
    blocks = tuple(
        StoredBlock(block_hash=bytes([i]) * 8, token_ids=TokenIds([i]), extra_keys=keys)
        for i, keys in enumerate(extra_keys)
    )
    return EventBatch(
        source=SourceId(instance_id="w"),
        ts_ns=0,
        schema_version=3,
        events=(KVCacheEvent(event_id=event_id, window_size=16, data=Stored(blocks=blocks)),),
    )


def _keys(batch: EventBatch) -> list[tuple[ExtraKey, ...] | None]:
    data = batch.events[0].data
    assert isinstance(data, Stored)
    return [b.extra_keys for b in data.blocks]


def _plain_record(body: bytes) -> dict[str, Any]:
    """The body as fastavro reads it with the v3 schema alone (no kvstream code)."""
    record = fastavro.schemaless_reader(io.BytesIO(body), V3.parsed, None)
    assert isinstance(record, dict)
    return record


# ------------------------------------------------------------------------------ round trips


def test_absent_empty_and_typed_keys_stay_distinct() -> None:
    keys: list[tuple[ExtraKey, ...] | None] = [
        None,
        (),
        ((),),
        ("",),
        (b"",),
        (0,),
        ("1", 1, b"1", ("1", 1, b"1")),
        None,
    ]
    batch = _batch(*keys)
    decoded = CODEC.decode(CODEC.encode(batch))
    assert decoded == batch
    assert _keys(decoded) == keys
    got = _keys(decoded)[6]
    assert got is not None
    assert [type(k) for k in got] == [str, int, bytes, tuple]
    # Sparse: only the six blocks with keys have an entry.
    stored = _plain_record(CODEC.encode_body(batch))["events"][0]["stored"]
    assert [e["block_index"] for e in stored["extra_keys"]] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("value", "on_the_wire"),
    [
        (-(2**63), -(2**63)),
        (-1, -1),
        (0, 0),
        (2**63 - 1, 2**63 - 1),
        (2**63, {"value": -(2**63)}),
        (2**64 - 1, {"value": -1}),
    ],
)
def test_integers_over_the_whole_model_range(value: int, on_the_wire: object) -> None:
    batch = _batch((value, ("mm", value)))
    assert CODEC.decode(CODEC.encode(batch)) == batch
    stored = _plain_record(CODEC.encode_body(batch))["events"][0]["stored"]
    assert stored["extra_keys"][0]["keys"] == [on_the_wire, ["mm", on_the_wire]]


def test_wire_bytes_of_the_extra_keys_field() -> None:
    """The bytes docs/wire-format.md describes, for one block (the stored event ends the body)."""
    batch = _batch(("a", -1, b"\x01", 2**64 - 1, ("x", 2**63)))
    expected = (
        b"\x02"  # extra_keys: one entry
        + b"\x00"  # block_index 0
        + b"\x0a"  # keys: 5 items
        + b"\x00\x02a"  # branch 0 string, "a"
        + b"\x02\x01"  # branch 1 long, -1
        + b"\x04\x02\x01"  # branch 2 ExtraKeyBytes, bytes 01
        + b"\x06\x01"  # branch 3 ExtraKeyUInt64, long -1 (= 2^64 - 1)
        + b"\x08\x04"  # branch 4 array: 2 items
        + b"\x00\x02x"  # string "x"
        + b"\x06\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"  # ExtraKeyUInt64, long -2^63 (= 2^63)
        + b"\x00"  # end of the tuple's items
        + b"\x00"  # end of keys
        + b"\x00"  # end of extra_keys
    )
    # ... then the null removed/updated/lost payloads and the end of the events array.
    assert CODEC.encode_body(batch).endswith(expected + b"\x00" * 4)


def test_non_canonical_uint64_branch_reads_as_its_unsigned_value() -> None:
    """Writers use ExtraKeyUInt64 only for integers >= 2^63; readers accept any value there."""
    record = batch_to_record(_batch(("k",)), 3)
    record["events"][0]["stored"]["extra_keys"][0]["keys"] = [{"value": 5}, ["t", {"value": -2}]]
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, V3.parsed, record)
    assert _keys(CODEC.decode_body(buf.getvalue(), 3)) == [(5, ("t", 2**64 - 2))]


def test_external_cache_level() -> None:
    batch = EventBatch(
        source=SourceId(instance_id="w"),
        ts_ns=0,
        events=(
            KVCacheEvent(
                event_id=0,
                window_size=4,
                data=Stored(
                    blocks=(
                        StoredBlock(
                            block_hash=b"a" * 8, token_ids=(1,), cache_level=CacheLevel.EXTERNAL
                        ),
                    )
                ),
            ),
            KVCacheEvent(
                event_id=1,
                window_size=4,
                data=Removed(block_hashes=(b"a" * 8,), cache_level=CacheLevel.EXTERNAL),
            ),
            KVCacheEvent(
                event_id=2,
                window_size=4,
                data=Updated(
                    block_hash=b"b" * 8,
                    cache_level=EventDiff(old_value=CacheLevel.HOST, new_value=CacheLevel.EXTERNAL),
                ),
            ),
        ),
    )
    for version in (2, 3):  # v1 has no removed.cache_level
        assert AvroCodec(version).decode(AvroCodec(version).encode(batch)).events == batch.events


@pytest.mark.parametrize(("entry", "block_index"), [(1, 0), (1, 2), (0, -1)])
def test_decoder_checks_extra_keys_block_indexes(entry: int, block_index: int) -> None:
    record = batch_to_record(_batch(("a",), ("b",)), 3)
    record["events"][0]["stored"]["extra_keys"][entry]["block_index"] = block_index
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, V3.parsed, record)
    with pytest.raises(DecodeError, match="extra_keys: block_index"):
        CODEC.decode_body(buf.getvalue(), 3)


# ------------------------------------------------------------------ older writers and readers


@pytest.mark.parametrize("version", [1, 2])
def test_older_versions_reject_extra_keys_unless_lossy(version: int) -> None:
    batch = _batch(None, ("lora-a", ("mm", -3)), event_id=9)
    with pytest.raises(EncodeError, match=r"event 9: schema v\d has no extra_keys.*block 1"):
        AvroCodec(version).encode(batch)
    with pytest.raises(EncodeError, match="extra_keys"):
        write_container(io.BytesIO(), [batch], schema_version=version)
    # Lossy: the event and its blocks arrive, without the keys.
    decoded = CODEC.decode(AvroCodec(version, lossy=True).encode(batch))
    assert _keys(decoded) == [None, None]
    assert decoded.events[0].event_id == 9
    buf = io.BytesIO()
    write_container(buf, [batch], schema_version=version, lossy=True)
    buf.seek(0)
    assert [_keys(b) for b in read_container(buf)] == [[None, None]]
    # Blocks without keys need no permission.
    plain = _batch(None, None)
    assert AvroCodec(version).encode(plain) == AvroCodec(version, lossy=True).encode(plain)


@SETTINGS
@given(batches())
def test_v2_reader_of_v3_data_sees_everything_but_extra_keys(batch: EventBatch) -> None:
    result = AvroCodec(reader_version=2).decode_result(CODEC.encode(batch))
    assert result.writer_version == 3
    assert result.batch == as_v2_sees_it(batch, schema_version=3)
    assert result.skipped == ()


@SETTINGS
@given(v1_batches())
def test_v1_reader_of_v3_data(batch: EventBatch) -> None:
    result = AvroCodec(reader_version=1).decode_result(CODEC.encode(batch))
    assert result.batch == as_v1_sees_it(batch).model_copy(update={"schema_version": 3})


@SETTINGS
@given(batches(max_events=4))
def test_v3_container_round_trip_and_plain_fastavro(batch: EventBatch) -> None:
    buf = io.BytesIO()
    write_container(buf, [batch, batch], codec="deflate", schema_version=3)
    buf.seek(0)
    reader = read_container(buf)
    v3 = batch.model_copy(update={"schema_version": 3})
    assert list(reader) == [v3, v3]
    assert reader.writer_version == 3
    buf.seek(0)
    assert len(list(fastavro.reader(buf))) == 2
