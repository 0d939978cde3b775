"""The TokenPack byte format (low 16-bit plane + high bit planes)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstream.codec.tokens import PackedTokens, pack_tokens, unpack_tokens
from kvstream.errors import DecodeError


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
