"""Fuzzing every decoder: arbitrary bytes, truncations and bit flips raise only DecodeError."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_strategies import batches

from kvstream.codec import AvroCodec, read_container, write_container
from kvstream.codec.samples import sample_batches
from kvstream.errors import DecodeError
from kvstream.events.model import EventBatch

CODEC = AvroCodec()
CODEC_V3 = AvroCodec(3)
CODEC_V2 = AvroCodec(2, lossy=True)
CODEC_V1 = AvroCodec(1, lossy=True)
# v4 token layouts: every packed encoding's decoder sees corrupt planes too.
CODEC_V4 = {
    enc: AvroCodec(4, token_encoding=enc) for enc in ("varint+zstd", "delta_varint", "planes+zstd")
}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _container(data: bytes, tolerant: bool = False) -> None:
    list(read_container(io.BytesIO(data), tolerate_torn_tail=tolerant))


DECODERS: dict[str, Callable[[bytes], object]] = {
    "single_object": CODEC.decode,
    "confluent": lambda d: CODEC.decode_confluent(d, lambda i: 1 + i % 3),
    "body_v1": lambda d: CODEC.decode_body(d, 1),
    "body_v2": lambda d: CODEC.decode_body(d, 2),
    "body_v3": lambda d: CODEC.decode_body(d, 3),
    **{f"body_v4_{enc}": lambda d: CODEC.decode_body(d, 4) for enc in CODEC_V4},
    "v3_reader_of_v4": AvroCodec(reader_version=3).decode,
    "v1_reader": AvroCodec(reader_version=1).decode,
    "v2_reader": AvroCodec(reader_version=2).decode,
    "container": _container,
}


def only_decode_errors(decoder: Callable[[bytes], object], data: bytes) -> None:
    try:
        decoder(data)
    except DecodeError as exc:
        message = str(exc)
        assert message  # says what was wrong


def _encodings(batch: EventBatch) -> dict[str, bytes]:
    buf = io.BytesIO()
    write_container(buf, [batch, batch], codec="deflate")
    return {
        "single_object": CODEC.encode(batch),
        "confluent": CODEC_V3.encode_confluent(batch, 2),  # id 2: schema v3
        "body_v1": CODEC_V1.encode_body(batch),
        "body_v2": CODEC_V2.encode_body(batch),
        "body_v3": CODEC_V3.encode_body(batch),
        **{f"body_v4_{enc}": codec.encode_body(batch) for enc, codec in CODEC_V4.items()},
        "v3_reader_of_v4": CODEC_V4["varint+zstd"].encode(batch),
        "v1_reader": CODEC.encode(batch),
        "v2_reader": CODEC.encode(batch),
        "container": buf.getvalue(),
    }


@pytest.mark.parametrize("name", list(DECODERS))
@FUZZ
@given(data=st.binary(max_size=300))
def test_arbitrary_bytes(name: str, data: bytes) -> None:
    only_decode_errors(DECODERS[name], data)


@pytest.mark.parametrize("name", list(DECODERS))
@FUZZ
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_behind_valid_headers(name: str, data: bytes) -> None:
    prefix = {
        "single_object": CODEC.encode(sample_batches()[2])[:10],
        "confluent": b"\x00\x00\x00\x00\x02",  # id 2: schema v3
        "container": _encodings(sample_batches()[2])["container"][:-40],
    }.get(name, b"")
    only_decode_errors(DECODERS[name], prefix + data)


@pytest.mark.parametrize("name", list(DECODERS))
@FUZZ
@given(batch=batches(max_events=3), cut=st.integers(0, 10**6))
def test_truncations(name: str, batch: EventBatch, cut: int) -> None:
    data = _encodings(batch)[name]
    cut %= len(data)
    only_decode_errors(DECODERS[name], data[:cut])


@pytest.mark.parametrize("name", list(DECODERS))
@FUZZ
@given(
    batch=batches(max_events=3),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=3),
)
def test_bit_flips(name: str, batch: EventBatch, flips: list[tuple[int, int]]) -> None:
    data = bytearray(_encodings(batch)[name])
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    only_decode_errors(DECODERS[name], bytes(data))


@FUZZ
@given(batch=batches(max_events=3), cut=st.integers(0, 10**6))
def test_torn_container_tail_never_raises(batch: EventBatch, cut: int) -> None:
    buf = io.BytesIO()
    write_container(buf, [batch, batch, batch], sync_interval=1)  # one block per batch
    data = buf.getvalue()
    cut %= len(data) + 1
    reader = read_container(io.BytesIO(data[:cut]), tolerate_torn_tail=True)
    got = list(reader)
    assert all(b == batch for b in got)
    assert reader.valid_end + reader.ignored_bytes == cut
    if cut == len(data):
        assert len(got) == 3
        assert reader.torn_reason is None


@pytest.mark.parametrize(
    "data",
    [
        b"\xc3\x01" + b"\x00" * 8,
        b"\x00\xff\xff\xff\xff",
        b"",
        b"\xc3\x01" + bytes.fromhex("f9e9d3199857e8b2") + b"\xff" * 20,
        # A v2 body claiming a 2**62-byte string: must not try to allocate it.
        b"\xc3\x01" + bytes.fromhex("f9e9d3199857e8b2") + b"\xfe\xff\xff\xff\xff\xff\xff\xff\x7f",
        b"\xc3\x01" + bytes.fromhex("479674ac542f98fe") + b"\xfe\xff\xff\xff\xff\xff\xff\xff\x7f",
    ],
)
def test_hostile_inputs(data: bytes) -> None:
    for decoder in DECODERS.values():
        only_decode_errors(decoder, data)
