"""Avro object container files: interop with plain fastavro, appending, torn tails."""

from __future__ import annotations

import io
import json
import zlib
from pathlib import Path

import fastavro
import pytest
from hypothesis import HealthCheck, given, settings
from test_codec_strategies import batches

from kvstream.codec import (
    AvroCodec,
    ContainerWriter,
    read_container,
    schema_registry,
    write_container,
)
from kvstream.codec.binary import encode_long
from kvstream.codec.container import CODECS, DEFAULT_CODEC
from kvstream.codec.records import batch_to_record
from kvstream.codec.samples import sample_batches
from kvstream.codec.schemas import CURRENT_VERSION, schema_dir
from kvstream.errors import DecodeError, EncodeError
from kvstream.events.model import EventBatch

SAMPLES = sample_batches()


def _many(n: int) -> list[EventBatch]:
    return [SAMPLES[i % len(SAMPLES)] for i in range(n)]


@pytest.mark.parametrize("codec", CODECS)
def test_plain_fastavro_reads_our_files(tmp_path: Path, codec: str) -> None:
    path = tmp_path / f"batches.{codec}.avro"
    assert write_container(path, _many(50), codec=codec, sync_interval=500) == 50
    with path.open("rb") as fo:
        reader = fastavro.reader(fo)
        records = list(reader)
        assert reader.metadata["avro.codec"] == codec
        assert reader.metadata["kvstream.schema_version"] == str(CURRENT_VERSION)
    assert len(records) == 50
    assert [len(r["events"]) for r in records[:3]] == [len(b.events) for b in SAMPLES]
    assert list(read_container(path)) == _many(50)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_events=4))
def test_container_round_trip(batch: EventBatch) -> None:
    buf = io.BytesIO()
    write_container(buf, [batch, batch], codec="deflate")
    buf.seek(0)
    assert list(read_container(buf)) == [batch, batch]


def test_v1_files_and_reader_details(tmp_path: Path) -> None:
    path = tmp_path / "v1.avro"
    write_container(path, [SAMPLES[0], SAMPLES[2]], schema_version=1)
    reader = read_container(path)
    got = list(reader)
    assert reader.writer_version == 1
    assert [b.schema_version for b in got] == [1, 1]
    assert [s.event_id for s in reader.skipped] == [0]  # v1 has no tokens_per_block
    assert reader.blocks_read == 1
    assert reader.batches_read == 2
    assert reader.torn_reason is None
    assert reader.ignored_bytes == 0
    assert reader.valid_end == path.stat().st_size


def test_files_written_by_plain_fastavro_are_readable(tmp_path: Path) -> None:
    path = tmp_path / "foreign.avro"
    for version in (1, 2, 3, CURRENT_VERSION):
        info = schema_registry().get(version)
        records = [batch_to_record(b, version, lossy=True) for b in SAMPLES]
        with path.open("wb") as fo:
            fastavro.writer(fo, info.parsed, records, codec="deflate")
        got = list(read_container(path))
        assert len(got) == len(SAMPLES)
        assert got[0].schema_version == version
    assert got == SAMPLES


def test_append_reuses_header(tmp_path: Path) -> None:
    path = tmp_path / "log.avro"
    with ContainerWriter(path, codec="deflate") as w:
        w.write_many(_many(3))
    with ContainerWriter(path) as w:
        assert w.codec == "deflate"
        assert w.schema_version == CURRENT_VERSION
        w.write_many(_many(4))
    assert list(read_container(path)) == _many(3) + _many(4)
    with path.open("rb") as fo:
        assert len(list(fastavro.reader(fo))) == 7
    with pytest.raises(EncodeError, match=f"v1 batches to a v{CURRENT_VERSION} file"):
        ContainerWriter(path, schema_version=1)
    with pytest.raises(EncodeError, match="codec 'null'"):
        ContainerWriter(path, codec="null")


def test_append_to_file_object(tmp_path: Path) -> None:
    path = tmp_path / "fo.avro"
    with path.open("a+b") as fo:
        with ContainerWriter(fo) as w:
            w.write(SAMPLES[0])
        assert not fo.closed
    with path.open("a+b") as fo, ContainerWriter(fo) as w:
        w.write(SAMPLES[1])
    assert list(read_container(path)) == SAMPLES[:2]


def test_flush_writes_a_block_each(tmp_path: Path) -> None:
    path = tmp_path / "flush.avro"
    w = ContainerWriter(path)
    w.write(SAMPLES[0])
    size0 = path.stat().st_size
    w.flush()
    assert path.stat().st_size > size0
    w.write(SAMPLES[1])
    w.flush(fsync=True)
    w.close()
    w.close()
    reader = read_container(path)
    assert list(reader) == SAMPLES[:2]
    assert reader.blocks_read == 2
    with pytest.raises(EncodeError, match="closed"):
        w.write(SAMPLES[0])


def _three_blocks(path: Path) -> list[int]:
    """Write three one-batch blocks; return the file size after each."""
    sizes = []
    with ContainerWriter(path) as w:
        for b in SAMPLES:
            w.write(b)
            w.flush()
            sizes.append(path.stat().st_size)
    return sizes


def test_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "torn.avro"
    ends = _three_blocks(path)
    data = path.read_bytes()
    path.write_bytes(data[: ends[1] + 7])  # crash while writing the third block
    with pytest.raises(DecodeError, match=f"block at byte {ends[1]}"):
        list(read_container(path))
    reader = read_container(path, tolerate_torn_tail=True)
    assert list(reader) == SAMPLES[:2]
    assert reader.valid_end == ends[1]
    assert reader.ignored_bytes == 7
    assert reader.torn_reason is not None
    assert "ends inside" in reader.torn_reason
    # Appending refuses a torn file unless told to cut it back first.
    with pytest.raises(DecodeError, match="torn block"):
        ContainerWriter(path)
    with ContainerWriter(path, truncate_torn_tail=True) as w:
        w.write(SAMPLES[2])
    assert list(read_container(path)) == SAMPLES


def test_corrupt_block_stops_a_tolerant_reader(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.avro"
    ends = _three_blocks(path)
    data = bytearray(path.read_bytes())
    data[ends[1] - 3] ^= 0xFF  # inside block 2's sync marker
    path.write_bytes(bytes(data))
    reader = read_container(path, tolerate_torn_tail=True)
    assert list(reader) == SAMPLES[:1]
    assert reader.valid_end == ends[0]
    assert reader.ignored_bytes == len(data) - ends[0]
    assert "sync marker" in (reader.torn_reason or "")


def test_torn_header_and_empty_files() -> None:
    header = io.BytesIO()
    write_container(header, [])
    data = header.getvalue()
    for cut in (0, 3, 10, len(data) - 1):
        reader = read_container(io.BytesIO(data[:cut]), tolerate_torn_tail=True)
        assert list(reader) == []
        assert reader.writer_version is None
        assert reader.valid_end == 0
        assert reader.ignored_bytes == cut
        with pytest.raises(DecodeError, match="header is truncated"):
            read_container(io.BytesIO(data[:cut]))
    reader = read_container(io.BytesIO(data))
    assert list(reader) == []
    assert reader.writer_version == CURRENT_VERSION


def test_not_a_container() -> None:
    with pytest.raises(DecodeError, match="not an Avro container"):
        read_container(io.BytesIO(b"PK\x03\x04 zip file"), tolerate_torn_tail=True)


def test_block_size_limit() -> None:
    buf = io.BytesIO()
    write_container(buf, SAMPLES)
    buf.seek(0)
    with pytest.raises(DecodeError, match="objects in"):
        list(read_container(buf, max_block_bytes=100))


def test_unknown_later_version_is_resolved(tmp_path: Path) -> None:
    """A file from a later kvstream (unknown schema, header says v5) is still readable."""
    v5 = json.loads((schema_dir() / "kv_event_batch.v4.avsc").read_text())
    v5["kvstream.schema_version"] = 5
    lost = next(f for f in v5["fields"][3]["type"]["items"]["fields"] if f["name"] == "lost")
    lost["type"][1]["fields"].append({"name": "detail", "type": "string", "default": ""})
    path = tmp_path / "v5.avro"
    records = [batch_to_record(b, 4) for b in SAMPLES]
    with path.open("wb") as fo:
        fastavro.writer(fo, fastavro.parse_schema(v5), records)
    reader = read_container(path)
    assert list(reader) == [b.model_copy(update={"schema_version": 5}) for b in SAMPLES]
    assert reader.writer_version == 5


def test_unsupported_codec() -> None:
    with pytest.raises(EncodeError, match="unsupported container codec"):
        write_container(io.BytesIO(), SAMPLES, codec="lzo")


def test_container_and_codec_bodies_agree(tmp_path: Path) -> None:
    """Container records are the same schemaless bodies AvroCodec writes."""
    path = tmp_path / "same.avro"
    write_container(path, SAMPLES[:1], codec="null")
    body = AvroCodec().encode_body(SAMPLES[0])
    assert body in path.read_bytes()


# ----------------------------------------------------------------------------- checksums


def _one_block(codec: str = "snappy") -> tuple[bytes, int]:
    """A container with one block of SAMPLES; returns (bytes, offset of the block)."""
    buf = io.BytesIO()
    write_container(buf, SAMPLES, codec=codec, sync_interval=1 << 30)
    data = buf.getvalue()
    with read_container(io.BytesIO(data)) as reader:
        return data, reader.valid_end


def test_new_files_are_snappy_with_a_crc32_per_block() -> None:
    data, _ = _one_block(codec=DEFAULT_CODEC)
    assert DEFAULT_CODEC == "snappy"
    with read_container(io.BytesIO(data)) as reader:
        assert reader.codec == "snappy"
    crc = data[-16 - 4 : -16]  # the Avro snappy block: data, CRC32 (big endian), sync
    payload = b"".join(AvroCodec().encode_body(b) for b in SAMPLES)
    assert crc == zlib.crc32(payload).to_bytes(4, "big")
    bad = bytearray(data)
    bad[-17] ^= 0x01
    with pytest.raises(DecodeError, match="CRC32"):
        list(read_container(io.BytesIO(bytes(bad))))
    reader = read_container(io.BytesIO(bytes(bad)), tolerate_torn_tail=True)
    assert list(reader) == []
    assert "CRC32" in (reader.torn_reason or "")


def test_a_snappy_block_that_claims_too_much_is_refused() -> None:
    data, start = _one_block()
    payload = sum(len(AvroCodec().encode_body(b)) for b in SAMPLES)
    assert len(data) - start < payload  # the block is compressed
    with pytest.raises(DecodeError, match="inflates to more than"):
        list(read_container(io.BytesIO(data), max_block_bytes=payload - 1))
    frame = encode_long(1) + encode_long(9) + b"\xff\xff\xff\xff\x0f" + b"\0" * 4
    sync = data[start - 16 : start]
    with pytest.raises(DecodeError, match="inflates to more than"):
        list(read_container(io.BytesIO(data[:start] + frame + sync)))
    frame = encode_long(1) + encode_long(3) + b"\x01\x02\x03"
    with pytest.raises(DecodeError, match="no CRC32"):
        list(read_container(io.BytesIO(data[:start] + frame + sync)))


def test_a_damaged_header_is_damage_not_another_schema() -> None:
    """The header has no checksum of its own, so a header whose schema no longer matches the
    registered version it names, or that lost its codec key, is refused."""
    data, _ = _one_block()
    renamed = data.replace(b'"name":"instance_id"', b'"name":"instance_ie"', 1)
    assert renamed != data
    with pytest.raises(DecodeError, match="header is damaged"):
        read_container(io.BytesIO(renamed))
    nocodec = data.replace(b"avro.codec", b"avro.codeb", 1)
    with pytest.raises(DecodeError, match=r"no avro\.codec"):
        read_container(io.BytesIO(nocodec))


def test_apache_avro_reads_and_checks_snappy_files(tmp_path: Path) -> None:
    import avro.datafile
    import avro.errors
    import avro.io

    data, _ = _one_block()
    path = tmp_path / "snappy.avro"
    path.write_bytes(data)
    with path.open("rb") as fo, avro.datafile.DataFileReader(fo, avro.io.DatumReader()) as r:
        assert len(list(r)) == len(SAMPLES)
    bad = bytearray(data)
    bad[-17] ^= 0x01
    path.write_bytes(bytes(bad))
    with (
        path.open("rb") as fo,
        avro.datafile.DataFileReader(fo, avro.io.DatumReader()) as r,
        pytest.raises(avro.errors.AvroException, match=r"[Cc]hecksum"),
    ):
        list(r)
