"""The TokenPack byte formats: bit planes (every version) and v4's packed encodings."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream._native import import_part
from kvstream.codec import tokens
from kvstream.codec.tokens import (
    TOKEN_ENCODINGS,
    EncodedTokens,
    PackedTokens,
    encode_tokens,
    pack_tokens,
    stored_kind,
    tokens_from_record,
    unpack_tokens,
)
from kvstream.errors import DecodeError, EncodeError


def _raw(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200))
def test_round_trip(ids: list[int]) -> None:
    packed = pack_tokens(_raw(ids))
    assert packed.count == len(ids)
    assert unpack_tokens(packed.count, packed.high_bits, packed.low16, packed.high_planes) == (
        _raw(ids)
    )
    assert 2 ** (16 + packed.high_bits) > max(ids, default=0)
    assert packed.high_bits == 0 or max(ids) >= 2 ** (15 + packed.high_bits)


def test_documented_vector() -> None:
    """The example a non-Python consumer can check its implementation against."""
    ids = [1, 65535, 65536, 131071, 70000, 5, 6, 7, 8, 2**17]
    packed = pack_tokens(_raw(ids))
    assert packed.high_bits == 2
    assert packed.low16 == struct.pack("<10H", *(i & 0xFFFF for i in ids))
    # plane 0 (bit 16): ids 2, 3, 4 -> 0b00011100; plane 1 (bit 17): id 9 -> byte 1 bit 1.
    assert packed.high_planes == bytes([0b00011100, 0b00, 0b00000000, 0b10])


def test_sizes() -> None:
    assert pack_tokens(b"") == PackedTokens(0, 0, b"", b"")
    small = pack_tokens(_raw([0, 1, 65535]))
    assert (small.high_bits, len(small.low16), small.high_planes) == (0, 6, b"")
    vocab = pack_tokens(_raw([127_999] * 64))
    assert vocab.high_bits == 1
    assert len(vocab.low16) + len(vocab.high_planes) == 136


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 0, b"", b""), "negative"),
        ((1, 17, b"\x00\x00", b""), "high_bits"),
        ((2, 0, b"\x00\x00", b""), "low16"),
        ((2, 1, b"\x00" * 4, b""), "high_planes"),
        ((2, 1, b"\x00" * 4, b"\x04"), "padding"),
    ],
)
def test_inconsistent_fields(args: tuple[int, int, bytes, bytes], message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        unpack_tokens(*args)


# ------------------------------------------------------------------ v4 packed encodings

PACKED = [e for e in TOKEN_ENCODINGS if e not in ("auto", "planes")]
# Token lists the encodings must carry: anything in uint32, the edges, long runs, steps.
token_lists = st.one_of(
    st.lists(st.integers(0, 2**32 - 1), max_size=300),
    st.lists(st.sampled_from([0, 1, 127, 128, 2**14, 2**31 - 1, 2**31, 2**32 - 1]), max_size=80),
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 3000)).map(lambda t: [t[0]] * t[1]),
    st.tuples(st.integers(0, 2**32 - 1), st.integers(-3, 3), st.integers(0, 2000)).map(
        lambda t: [(t[0] + t[1] * i) % 2**32 for i in range(t[2])]
    ),
)


def _record(enc: EncodedTokens) -> dict[str, object]:
    """The v4 TokenPack record of ``enc``, as fastavro reads it."""
    return {
        "count": enc.planes.count,
        "high_bits": enc.planes.high_bits,
        "low16": enc.planes.low16,
        "high_planes": enc.planes.high_planes,
        "packed_encoding": enc.encoding,
        "packed_compression": enc.compression,
        "packed_count": enc.count if enc.is_packed else 0,
        "packed": enc.packed,
    }


@settings(max_examples=300, deadline=None)
@given(ids=token_lists, encoding=st.sampled_from(TOKEN_ENCODINGS))
def test_every_encoding_round_trips(ids: list[int], encoding: str) -> None:
    raw = _raw(ids)
    enc = encode_tokens(raw, encoding)
    assert enc.count == len(ids)
    assert tokens_from_record(_record(enc)) == raw
    assert stored_kind(_record(enc)) == ("STORED_PACKED" if enc.is_packed else "STORED")
    if encoding == "planes" or not ids:
        assert not enc.is_packed
    elif encoding != "auto":
        assert enc.is_packed
        assert enc.compression == ("ZSTD" if encoding.endswith("+zstd") else "NONE")
    assert encode_tokens(raw, encoding) == enc  # deterministic


@settings(max_examples=200, deadline=None)
@given(ids=token_lists)
def test_auto_is_never_larger_than_bit_planes(ids: list[int]) -> None:
    raw = _raw(ids)
    planes = pack_tokens(raw)
    enc = encode_tokens(raw)
    assert enc.wire_bytes <= len(planes.low16) + len(planes.high_planes)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=300), delta=st.booleans())
def test_numpy_varints_match_the_documented_format(ids: list[int], delta: bool) -> None:
    """The numpy coder against a plain-Python LEB128 of the schema doc's definition."""
    values = ids
    if delta:
        values = []
        prev = 0
        for i in ids:
            d = (i - prev) % 2**32
            d = d - 2**32 if d >= 2**31 else d
            values.append(((d << 1) ^ (d >> 31)) % 2**32)
            prev = i
    expected = bytearray()
    for value in values:
        v = value
        while v >= 0x80:
            expected.append(v & 0x7F | 0x80)
            v >>= 7
        expected.append(v)
    raw = _raw(ids)
    assert tokens._varint_encode_np(raw, delta) == bytes(expected)
    assert tokens._varint_decode_np(bytes(expected), len(ids), delta) == raw


@pytest.mark.skipif(not tokens.NATIVE, reason="C accelerator not built")
@settings(max_examples=300, deadline=None)
@given(ids=token_lists, delta=st.booleans())
def test_native_varints_equal_numpy(ids: list[int], delta: bool) -> None:
    native = import_part("kvstream.codec._tokens_native")
    raw = _raw(ids)
    data = native.varint_encode(raw, delta)
    assert data == tokens._varint_encode_np(raw, delta)
    assert native.varint_decode(data, len(ids), delta) == raw
    assert native.varint_sizes(raw) == tokens._varint_sizes_np(raw)


def _both_decoders(data: bytes, count: int, delta: bool) -> list[object]:
    """What each varint decoder does with ``data``: the ids, or the DecodeError's type."""
    out: list[object] = []
    for decode in {tokens._varint_decode_np, tokens._varint_decode}:
        try:
            out.append(decode(data, count, delta))
        except DecodeError:
            out.append(DecodeError)
    return out


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=64), count=st.integers(0, 70), delta=st.booleans())
def test_varint_decoders_agree_on_arbitrary_bytes(data: bytes, count: int, delta: bool) -> None:
    results = _both_decoders(data, count, delta)
    assert all(r == results[0] for r in results)
    if results[0] is not DecodeError:  # canonical: decoding then encoding gives the bytes back
        assert tokens._varint_encode_np(results[0], delta) == data  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "count", "message"),
    [
        (b"\x80", 1, "tokens.packed"),  # unterminated
        (b"\x01\x02", 1, "tokens.packed"),  # left over
        (b"\x01", 2, "tokens.packed"),  # too few
        (b"\x80\x00", 1, "redundant"),
        (b"\xff\xff\xff\xff\x10", 1, "32 bits"),
        (b"\xff\xff\xff\xff\x8f\x01", 1, "5 bytes"),
    ],
)
def test_bad_varints(data: bytes, count: int, message: str) -> None:
    for decode in {tokens._varint_decode_np, tokens._varint_decode}:
        with pytest.raises(DecodeError, match=message):
            decode(data, count, False)


def _decodes_or_says_why(record: dict[str, object], count: int) -> None:
    """``record`` decodes to ``count`` ids, or raises a DecodeError with a message."""
    message = ""
    try:
        got = tokens_from_record(record)
    except DecodeError as exc:
        message = str(exc)
        assert message
    else:
        assert len(got) == 4 * count


@pytest.mark.parametrize("encoding", PACKED)
@settings(max_examples=150, deadline=None)
@given(ids=token_lists, flips=st.lists(st.integers(0, 10**6), min_size=1, max_size=3))
def test_corrupt_packed_data_raises_decode_error(
    encoding: str, ids: list[int], flips: list[int]
) -> None:
    enc = encode_tokens(_raw(ids), encoding)
    record = _record(enc)
    data = bytearray(enc.packed)
    if not data:
        return
    for f in flips:
        data[f % len(data)] ^= 1 << (f % 8)
    for packed in (bytes(data), bytes(data[: flips[0] % len(data)])):
        record["packed"] = packed
        _decodes_or_says_why(record, len(ids))


@settings(max_examples=300, deadline=None)
@given(
    encoding=st.sampled_from(["BIT_PLANES", "VARINT", "DELTA_VARINT", "UNKNOWN", "NONE"]),
    compression=st.sampled_from(["NONE", "ZSTD", "UNKNOWN"]),
    count=st.one_of(st.integers(-2, 200), st.just(2**40)),
    data=st.binary(max_size=120),
)
def test_arbitrary_packed_fields_raise_only_decode_error(
    encoding: str, compression: str, count: int, data: bytes
) -> None:
    record = _record(EncodedTokens(PackedTokens(0, 0, b"", b"")))
    record.update(
        packed_encoding=encoding, packed_compression=compression, packed_count=count, packed=data
    )
    _decodes_or_says_why(record, count)


def test_zstd_bomb_is_refused() -> None:
    """A tiny frame claiming a huge expansion is refused without allocating the claim."""
    cramjam = pytest.importorskip("cramjam")
    bomb = bytes(cramjam.zstd.compress(b"\x00" * (4 << 20), level=1))
    record = _record(EncodedTokens(PackedTokens(0, 0, b"", b"")))
    record.update(
        packed_encoding="VARINT", packed_compression="ZSTD", packed_count=4 << 20, packed=bomb
    )
    assert len(bomb) * 256 + (1 << 20) < 4 << 20
    with pytest.raises(DecodeError, match="zstd"):
        tokens_from_record(record)
    # The writer never produces what readers refuse: such a run is left uncompressed.
    run = _raw([1000] * (2 << 20))
    enc = encode_tokens(run, "auto")
    assert (enc.encoding, enc.compression) == ("DELTA_VARINT", "NONE")
    assert tokens_from_record(_record(enc)) == run
    with pytest.raises(EncodeError, match="256x"):
        encode_tokens(run, "delta_varint+zstd")


def test_both_layouts_at_once_are_rejected() -> None:
    enc = encode_tokens(_raw([1, 2, 3]), "varint")
    record = _record(enc)
    record.update(count=3, low16=b"\x01\x00\x02\x00\x03\x00")
    with pytest.raises(DecodeError, match="bit-plane fields are set too"):
        tokens_from_record(record)
    planes = _record(encode_tokens(_raw([1, 2, 3]), "planes"))
    planes.update(packed=b"\x01")
    with pytest.raises(DecodeError, match="packed fields are set"):
        stored_kind(planes)


def test_auto_picks_per_batch() -> None:
    """Uniform ids stay bit planes; Zipf-like ids become zstd varints; runs of consecutive ids
    delta varints."""
    rng = np.random.default_rng(0)
    uniform = rng.integers(0, 128_000, 8192, dtype=np.uint32)
    ranks = rng.zipf(1.2, 40_000)
    zipf = (ranks[ranks <= 128_000] - 1).astype(np.uint32)[:8192]
    steps = (np.arange(8192, dtype=np.uint32) + 100_000).astype(np.uint32)
    assert not encode_tokens(uniform.tobytes()).is_packed
    z = encode_tokens(zipf.tobytes())
    assert (z.encoding, z.compression) == ("VARINT", "ZSTD")
    assert z.wire_bytes < 1.3 * 8192
    s = encode_tokens(steps.tobytes())
    assert s.encoding == "DELTA_VARINT"
    assert s.wire_bytes < 0.1 * 8192


def test_unknown_encoding_name() -> None:
    with pytest.raises(EncodeError, match="unknown token encoding"):
        encode_tokens(_raw([1]), "lz4")
    with pytest.raises(EncodeError, match="unknown token encoding"):
        encode_tokens(b"", "gzip")


def test_documented_varint_vectors() -> None:
    """Examples a non-Python consumer can check against (docs/wire-format.md)."""
    ids = [1, 300, 2**32 - 1, 299]
    assert encode_tokens(_raw(ids), "varint").packed == bytes.fromhex("01ac02ffffffff0fab02")
    # deltas 1, 299, -301, 300 -> zig-zag 2, 598, 601, 600
    assert encode_tokens(_raw(ids), "delta_varint").packed == bytes.fromhex("02d604d904d804")
