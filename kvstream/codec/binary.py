"""Avro binary primitives: zig-zag varint longs, length-prefixed bytes and strings.

The fast batch encoder (:mod:`.encoder`) and the container framing (:mod:`.container`) use
these; record decoding goes through fastavro.
"""

from __future__ import annotations

from typing import Final

from kvstream.errors import DecodeError, EncodeError

__all__ = [
    "LONG_MAX",
    "LONG_MIN",
    "encode_bytes",
    "encode_long",
    "encode_string",
    "read_long",
]

LONG_MIN: Final = -(2**63)
LONG_MAX: Final = 2**63 - 1
_SMALL: Final = tuple(bytes((i,)) for i in range(128))
_MAX_VARINT_BYTES: Final = 10


def encode_long(n: int) -> bytes:
    """Avro ``long``/``int``: zig-zag, then base-128 varint, least significant group first.

    Raises EncodeError outside the signed 64-bit range.
    """
    z = (n << 1) ^ (n >> 63)
    if 0 <= z < 0x80:
        return _SMALL[z]
    if 0 <= z < 0x4000:  # unrolled: event ids, sizes and lengths are mostly 2-3 bytes
        return bytes((z & 0x7F | 0x80, z >> 7))
    if 0 <= z < 0x200000:
        return bytes((z & 0x7F | 0x80, (z >> 7) & 0x7F | 0x80, z >> 14))
    if not LONG_MIN <= n <= LONG_MAX:
        raise EncodeError(f"{n} does not fit an Avro long")
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def encode_bytes(data: bytes) -> bytes:
    """Avro ``bytes``: the length as a long, then the bytes."""
    return encode_long(len(data)) + data


def encode_string(text: str) -> bytes:
    """Avro ``string``: UTF-8 bytes, length-prefixed. Raises EncodeError for lone surrogates."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise EncodeError(f"string {text[:40]!r} is not valid UTF-8 text: {exc}") from None
    return encode_long(len(data)) + data


def read_long(buf: bytes | memoryview, pos: int, what: str = "long") -> tuple[int, int]:
    """Read one Avro long at ``buf[pos]``; returns ``(value, next_pos)``.

    Raises DecodeError naming ``what`` when the data ends inside the varint or the varint is
    longer than 10 bytes / outside the 64-bit range.
    """
    z = 0
    shift = 0
    end = len(buf)
    for i in range(_MAX_VARINT_BYTES):
        if pos >= end:
            raise DecodeError(f"data ends inside the varint of {what} (at byte {pos})")
        b = buf[pos]
        pos += 1
        z |= (b & 0x7F) << shift
        if not b & 0x80:
            if i == _MAX_VARINT_BYTES - 1 and b > 1:
                raise DecodeError(f"varint of {what} overflows 64 bits")
            return (z >> 1) ^ -(z & 1), pos
        shift += 7
    raise DecodeError(f"varint of {what} is longer than {_MAX_VARINT_BYTES} bytes")
