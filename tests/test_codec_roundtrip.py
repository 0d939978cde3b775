"""AvroCodec round trips, framings, the fast encoder against fastavro, older-version writing.

(Schema v3 specifics, the engine extra keys, are in test_codec_v3.py.)
"""

from __future__ import annotations

import io
import struct

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_strategies import batches, v1_batches

from kvstream._types import TokenIds
from kvstream.codec import AvroCodec, DecodeResult, schema_registry
from kvstream.codec.encoder import encode_batch_body
from kvstream.codec.framing import split_confluent, split_single_object
from kvstream.codec.records import batch_to_record
from kvstream.codec.samples import sample_batches
from kvstream.codec.schemas import crc64_avro
from kvstream.codec.tokens import TOKEN_ENCODINGS, tokens_from_record
from kvstream.errors import DecodeError, EncodeError, UnknownSchemaError
from kvstream.events.model import (
    CURRENT_SCHEMA_VERSION,
    Cleared,
    Created,
    EventBatch,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)

CODEC = AvroCodec()
CODEC_V2 = AvroCodec(2)
CODEC_V2_LOSSY = AvroCodec(2, lossy=True)
CODEC_V1 = AvroCodec(1)
CODEC_V1_LOSSY = AvroCodec(1, lossy=True)
CURRENT = CODEC.schema_version
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fastavro_body(
    batch: EventBatch, version: int, *, lossy: bool = False, token_encoding: str = "auto"
) -> bytes:
    buf = io.BytesIO()
    record = batch_to_record(batch, version, lossy=lossy, token_encoding=token_encoding)
    fastavro.schemaless_writer(buf, schema_registry().get(version).parsed, record)
    return buf.getvalue()


def without_extra_keys(data: Stored) -> Stored:
    return data.model_copy(
        update={"blocks": tuple(b.model_copy(update={"extra_keys": None}) for b in data.blocks)}
    )


def as_v2_sees_it(batch: EventBatch, schema_version: int = 2) -> EventBatch:
    """What a v3 reader gets back from v2 data (or a v2 reader from v3 data): no extra keys."""
    events = tuple(
        ev.model_copy(update={"data": without_extra_keys(ev.data)})
        if isinstance(ev.data, Stored)
        else ev
        for ev in batch.events
    )
    return batch.model_copy(update={"events": events, "schema_version": schema_version})


def as_v1_sees_it(batch: EventBatch) -> EventBatch:
    """What a v2 reader gets back from v1 data: v2-only information at its defaults."""
    kept = []
    for ev in batch.events:
        data = ev.data
        if isinstance(data, (Cleared, Lost)) or ev.hash_algo != "v1_block_key":
            continue
        if isinstance(data, Created):
            continue  # v1 has no tokens_per_block: the reader skips it
        if isinstance(data, Stored):
            data = data.model_copy(
                update={
                    "blocks": tuple(
                        b.model_copy(
                            update={
                                "lora_name": None,
                                "cache_salt": None,
                                "mm_keys": (),
                                "token_extra_ids": None,
                                "extra_keys": None,
                            }
                        )
                        for b in data.blocks
                    )
                }
            )
        elif isinstance(data, Removed):
            data = data.model_copy(update={"cache_level": None})
        kept.append(ev.model_copy(update={"layer_group_id": 0, "data": data}))
    return EventBatch(
        source=SourceId(
            instance_id=batch.source.instance_id,
            attention_dp_rank=batch.source.attention_dp_rank,
        ),
        ts_ns=batch.ts_ns,
        schema_version=1,
        events=tuple(kept),
    )


# ------------------------------------------------------------------------------ round trips


@SETTINGS
@given(batches())
def test_single_object_round_trip(batch: EventBatch) -> None:
    data = CODEC.encode(batch)
    assert data[:2] == b"\xc3\x01"
    assert CURRENT == CURRENT_SCHEMA_VERSION
    assert data[2:10] == schema_registry().get(CURRENT).fingerprint
    result = CODEC.decode_result(data)
    assert result.batch == batch
    assert result.writer_version == CURRENT
    assert result.skipped == ()


@SETTINGS
@given(batches(), st.integers(0, 2**31 - 1))
def test_confluent_round_trip(batch: EventBatch, schema_id: int) -> None:
    data = CODEC.encode_confluent(batch, schema_id)
    assert data[0] == 0
    assert struct.unpack(">I", data[1:5])[0] == schema_id
    assert CODEC.decode_confluent(data, {schema_id: CURRENT}) == batch
    assert CODEC.decode_confluent(data, lambda i: CURRENT) == batch


@SETTINGS
@given(batches())
def test_body_round_trip_and_matches_fastavro_byte_for_byte(batch: EventBatch) -> None:
    body = CODEC.encode_body(batch)
    assert body == fastavro_body(batch, CURRENT)
    assert CODEC.decode_body(body, CURRENT) == batch
    # fastavro with the writer schema alone (no kvstream code) reads it too.
    record = fastavro.schemaless_reader(
        io.BytesIO(body), schema_registry().get(CURRENT).parsed, None
    )
    assert len(record["events"]) == len(batch.events)


@SETTINGS
@given(batches(), st.sampled_from(TOKEN_ENCODINGS))
def test_v4_every_token_encoding_round_trips_and_matches_fastavro(
    batch: EventBatch, encoding: str
) -> None:
    codec = AvroCodec(4, token_encoding=encoding)
    body = codec.encode_body(batch)
    assert body == fastavro_body(batch, 4, token_encoding=encoding)
    result = codec.decode_body_result(body, 4)
    assert result.batch == batch.model_copy(update={"schema_version": 4})
    assert result.skipped == ()


def test_v4_token_encoding_is_checked() -> None:
    with pytest.raises(EncodeError, match="unknown token encoding"):
        AvroCodec(4, token_encoding="lz4")
    with pytest.raises(EncodeError, match="only bit-plane tokens"):
        AvroCodec(3, token_encoding="varint")
    assert AvroCodec(3, token_encoding="planes").token_encoding == "planes"


def test_v4_kind_and_token_layout_must_agree() -> None:
    """STORED with packed ids (or STORED_PACKED with bit planes) would read differently in a
    v3 reader: the decoder refuses it."""
    batch = sample_batches()[0]
    for encoding, wrong in (("varint", "STORED"), ("planes", "STORED_PACKED")):
        record = batch_to_record(batch, 4, token_encoding=encoding)
        for ev in record["events"]:
            if ev["kind"] in ("STORED", "STORED_PACKED"):
                ev["kind"] = wrong
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, schema_registry().get(4).parsed, record)
        with pytest.raises(DecodeError, match="call for"):
            CODEC.decode_body(buf.getvalue(), 4)


@SETTINGS
@given(batches())
def test_v2_lossy_body_matches_fastavro(batch: EventBatch) -> None:
    assert encode_batch_body(batch, 2, lossy=True) == fastavro_body(batch, 2, lossy=True)


@SETTINGS
@given(batches())
def test_v2_round_trip_keeps_everything_but_extra_keys(batch: EventBatch) -> None:
    data = CODEC_V2_LOSSY.encode(batch)
    assert data[2:10] == schema_registry().get(2).fingerprint
    result = CODEC.decode_result(data)
    assert result.writer_version == 2
    assert result.batch == as_v2_sees_it(batch)
    assert result.skipped == ()
    has_keys = any(
        b.extra_keys is not None
        for ev in batch.events
        if isinstance(ev.data, Stored)
        for b in ev.data.blocks
    )
    if has_keys:
        with pytest.raises(EncodeError, match="extra_keys"):
            CODEC_V2.encode(batch)
    else:
        assert CODEC_V2.encode(batch) == data


@SETTINGS
@given(batches())
def test_v1_lossy_body_matches_fastavro(batch: EventBatch) -> None:
    assert encode_batch_body(batch, 1, lossy=True) == fastavro_body(batch, 1, lossy=True)


@SETTINGS
@given(v1_batches())
def test_v1_round_trip_keeps_v1_information(batch: EventBatch) -> None:
    data = CODEC_V1.encode(batch)
    assert data[2:10] == schema_registry().get(1).fingerprint
    result = CODEC.decode_result(data)
    assert result.writer_version == 1
    assert result.batch == as_v1_sees_it(batch)
    created = sum(isinstance(ev.data, Created) for ev in batch.events)
    assert result.skipped_count == created


@SETTINGS
@given(batches())
def test_v1_lossy_drops_what_v1_cannot_carry(batch: EventBatch) -> None:
    result = CODEC.decode_result(CODEC_V1_LOSSY.encode(batch))
    assert result.batch == as_v1_sees_it(batch)


def test_sample_batches_round_trip() -> None:
    for batch in sample_batches():
        assert CODEC.decode(CODEC.encode(batch)) == batch


def test_schema_version_field_is_the_writers() -> None:
    batch = sample_batches()[0].model_copy(update={"schema_version": 1})
    assert CODEC.decode(CODEC.encode(batch)).schema_version == CURRENT
    assert CODEC.decode(CODEC_V2.encode(batch)).schema_version == 2
    assert CODEC.decode(CODEC_V1.encode(batch)).schema_version == 1


# ---------------------------------------------------------------------- older-version writing


@pytest.mark.parametrize(
    "event",
    [
        KVCacheEvent(event_id=5, window_size=8, data=Cleared()),
        KVCacheEvent(event_id=5, window_size=8, data=Lost(first_event_id=1, count=2)),
        KVCacheEvent(
            event_id=5,
            window_size=8,
            hash_algo="v2_sha256_64",
            data=Removed(block_hashes=(b"\x01" * 8,)),
        ),
    ],
    ids=["cleared", "lost", "hash_algo"],
)
def test_v1_rejects_what_it_would_misstate(event: KVCacheEvent) -> None:
    batch = EventBatch(source=SourceId(instance_id="w"), ts_ns=1, events=(event,))
    with pytest.raises(EncodeError, match="event 5"):
        CODEC_V1.encode(batch)
    decoded = CODEC.decode(CODEC_V1_LOSSY.encode(batch))
    assert decoded.events == ()


def test_unknown_writer_version_is_rejected() -> None:
    with pytest.raises(UnknownSchemaError):
        AvroCodec(5)


def test_confluent_schema_id_range() -> None:
    batch = sample_batches()[2]
    for bad in (-1, 2**31):
        with pytest.raises(EncodeError):
            CODEC.encode_confluent(batch, bad)


def test_confluent_unknown_id() -> None:
    data = CODEC.encode_confluent(sample_batches()[0], 17)
    with pytest.raises(UnknownSchemaError, match="17"):
        CODEC.decode_confluent(data, {1: 2})

    def resolver(schema_id: int) -> int:
        raise KeyError(schema_id)

    with pytest.raises(UnknownSchemaError):
        CODEC.decode_confluent(data, resolver)
    with pytest.raises(UnknownSchemaError, match="version 9"):
        CODEC.decode_confluent(data, {17: 9})


# ------------------------------------------------------------------------------ framing


def test_fingerprints_follow_the_avro_spec() -> None:
    import avro.schema

    # The spec's CRC-64-AVRO of the schema "null" (Java SchemaNormalization test data).
    assert int.from_bytes(crc64_avro(b'"null"'), "little") == 7195948357588979594
    for info in schema_registry():
        assert fastavro.schema.fingerprint(info.canonical_form, "CRC-64-AVRO") == (
            info.fingerprint_hex
        )
        parsed = avro.schema.parse(info.schema_text)
        assert parsed.fingerprint() == info.fingerprint
        assert parsed.canonical_form == info.canonical_form


def test_single_object_readable_by_apache_avro() -> None:
    avro_io = pytest.importorskip("avro.io")
    import avro.schema

    batch = sample_batches()[1]
    data = AvroCodec(3).encode(batch)
    fingerprint, body = split_single_object(data)
    reader = avro_io.DatumReader(avro.schema.parse(schema_registry().get(3).schema_text))
    record = reader.read(avro_io.BinaryDecoder(io.BytesIO(body)))
    assert [e["kind"] for e in record["events"]] == [
        "CREATED",
        "STORED",
        "REMOVED",
        "UPDATED",
        "CLEARED",
        "LOST",
    ]
    assert fingerprint == schema_registry().get(3).fingerprint
    # The engine extra keys as any Avro library sees them: one-field records for bytes and
    # for 2^64 - 1, arrays for tuples, the long branch for negative offsets.
    stored = record["events"][1]["stored"]
    assert [e["block_index"] for e in stored["extra_keys"]] == [0, 2]
    keys = stored["extra_keys"][0]["keys"]
    assert keys[1] == ["img-1", -3]
    assert keys[3] == {"value": sample_batches()[1].events[1].data.blocks[0].extra_keys[3]}
    assert keys[4] == {"value": -1}
    assert keys[7] == ["u64", {"value": -(2**63)}, {"value": b""}]
    assert stored["extra_keys"][1]["keys"] == []


def test_v4_packed_single_object_readable_by_apache_avro() -> None:
    """Any Avro library reads v4 packed data: the new kind and the packed token fields."""
    avro_io = pytest.importorskip("avro.io")
    import avro.schema

    batch = sample_batches()[1]
    _, body = split_single_object(AvroCodec(4, token_encoding="varint+zstd").encode(batch))
    reader = avro_io.DatumReader(avro.schema.parse(schema_registry().get(4).schema_text))
    record = reader.read(avro_io.BinaryDecoder(io.BytesIO(body)))
    assert [e["kind"] for e in record["events"]][:2] == ["CREATED", "STORED_PACKED"]
    tok = record["tokens"]
    assert (tok["packed_encoding"], tok["packed_compression"]) == ("VARINT", "ZSTD")
    raw = b"".join(b.token_ids.raw for b in batch.events[1].data.blocks)  # type: ignore[union-attr]
    assert tokens_from_record(tok) == raw


def test_framing_errors_say_what_is_wrong() -> None:
    good = CODEC.encode(sample_batches()[0])
    with pytest.raises(DecodeError, match="too short"):
        CODEC.decode(good[:5])
    with pytest.raises(DecodeError, match="single-object"):
        CODEC.decode(b"\x00\x01" + good[2:])
    with pytest.raises(UnknownSchemaError, match="fingerprint"):
        CODEC.decode(good[:2] + b"\x00" * 8 + good[10:])
    with pytest.raises(DecodeError, match="left over"):
        CODEC.decode(good + b"\x00")
    with pytest.raises(DecodeError, match=f"not a valid schema v{CURRENT} record"):
        CODEC.decode(good[:-3])
    with pytest.raises(DecodeError, match="Confluent"):
        CODEC.decode_confluent(b"\x01\x00\x00\x00\x01", {1: 2})
    with pytest.raises(DecodeError, match="too short"):
        split_confluent(b"\x00\x00")


# -------------------------------------------------------------------- decoder validation


def _v3_body(record_edit: object) -> bytes:
    """A body of sample batch 1 with ``record_edit(record)`` applied before writing."""
    record = batch_to_record(sample_batches()[1], 3)
    record_edit(record)  # type: ignore[operator]
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema_registry().get(3).parsed, record)
    return buf.getvalue()


def _stored(record: dict) -> dict:  # type: ignore[type-arg]
    return next(e["stored"] for e in record["events"] if e["stored"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["tokens"].update(count=r["tokens"]["count"] + 1), "low16"),
        (lambda r: r["tokens"].update(high_bits=17), "high_bits"),
        (lambda r: r["tokens"].update(high_planes=b""), "high_planes"),
        (lambda r: _stored(r).update(block_count=0), "block_count"),
        (lambda r: _stored(r).update(block_count=5), "equal width"),
        (lambda r: _stored(r).update(block_sizes=[1, 2]), "block_sizes has 2 entries"),
        (lambda r: _stored(r).update(block_sizes=[3, 4, 0]), "stored blocks use 7"),
        (lambda r: _stored(r).update(block_sizes=[3, 5, 100]), "more token ids"),
        (lambda r: _stored(r).update(cache_levels=[1]), "cache_levels has 1"),
        (lambda r: _stored(r).update(parent_hash=b"x"), "parent_hash has 1 bytes"),
        (lambda r: _stored(r)["mm_keys"][0].update(block_index=7), "mm_keys"),
        (lambda r: _stored(r)["mm_keys"].reverse(), "out of order"),
        (lambda r: _stored(r)["token_extra_ids"][0].update(ids=b"\x00" * 4), "extra ids"),
        (
            lambda r: _stored(r)["token_extra_ids"].append(_stored(r)["token_extra_ids"][0]),
            "repeated",
        ),
        (lambda r: _stored(r)["extra_keys"][1].update(block_index=3), "extra_keys"),
        (lambda r: _stored(r)["extra_keys"].reverse(), "extra_keys: block_index 0 repeated"),
        (lambda r: r["events"][1].update(kind="REMOVED"), "'stored' payload is set"),
        (lambda r: r["events"][2].update(removed=None), "payload is null"),
        (lambda r: _stored(r).update(priorities=[500, 1, 2]), "event model"),
        (lambda r: r["source"].update(instance_id=""), "event model"),
    ],
)
def test_decoder_rejects_inconsistent_records(edit: object, message: str) -> None:
    body = _v3_body(edit)
    with pytest.raises(DecodeError, match=message):
        CODEC.decode_body(body, 3)


def test_model_errors_are_chained() -> None:
    body = _v3_body(lambda r: r["source"].update(instance_id=""))
    with pytest.raises(DecodeError) as info:
        CODEC.decode_body(body, 3)
    assert info.value.__cause__ is not None


def test_decode_result_type() -> None:
    result = CODEC.decode_result(CODEC.encode(sample_batches()[0]))
    assert isinstance(result, DecodeResult)
    assert result.skipped_count == 0


# ------------------------------------------------------------------------ encoder details


def test_irregular_and_partial_layouts() -> None:
    def event(sizes: list[int]) -> KVCacheEvent:
        blocks = tuple(
            StoredBlock(block_hash=bytes([i]) * 8, token_ids=TokenIds(range(n)))
            for i, n in enumerate(sizes)
        )
        return KVCacheEvent(event_id=0, window_size=1, data=Stored(blocks=blocks))

    for sizes in ([4, 4, 4], [4, 4, 2], [4], [2, 4, 4], [0, 0], [4, 4, 2, 4]):
        batch = EventBatch(source=SourceId(instance_id="w"), ts_ns=0, events=(event(sizes),))
        record = batch_to_record(batch, 3)["events"][0]["stored"]
        irregular = sizes[:-1].count(sizes[0]) != len(sizes) - 1
        assert (record["block_sizes"] is not None) == irregular
        assert CODEC.decode(CODEC.encode(batch)) == batch


def test_explicit_default_attributes_take_the_slow_path_to_the_same_bytes() -> None:
    blocks_a = (StoredBlock(block_hash=b"a" * 8, token_ids=TokenIds([1])),)
    blocks_b = (
        StoredBlock(block_hash=b"a" * 8, token_ids=TokenIds([1]), cache_level=0, priority=35),
    )
    a, b = (
        EventBatch(
            source=SourceId(instance_id="w"),
            ts_ns=0,
            events=(KVCacheEvent(event_id=0, window_size=1, data=Stored(blocks=bl)),),
        )
        for bl in (blocks_a, blocks_b)
    )
    assert CODEC.encode(a) == CODEC.encode(b)


def test_bytes_per_block_for_a_128k_vocabulary() -> None:
    blocks = tuple(
        StoredBlock(
            block_hash=i.to_bytes(8, "big"),
            token_ids=TokenIds([(i * 64 + t) * 1999 % 128_000 for t in range(64)]),
        )
        for i in range(16)
    )
    batch = EventBatch(
        source=SourceId(instance_id="w"),
        ts_ns=0,
        events=(KVCacheEvent(event_id=0, window_size=1, data=Stored(blocks=blocks)),),
    )
    body = CODEC.encode_body(batch)
    # 64 ids x 17 bits = 136 bytes + an 8-byte hash per block, plus a few bytes per event.
    assert len(body) / 16 < 150
