"""Message framings around a schemaless Avro body.

* Avro **single-object encoding**: ``C3 01`` + the writer schema's 8-byte little-endian
  CRC-64-AVRO fingerprint (of its Parsing Canonical Form) + body. Needs no registry.
* **Confluent wire format**: ``00`` + the 4-byte big-endian schema registry id + body, what
  Java/Go/JS consumers with a schema registry expect.
"""

from __future__ import annotations

from typing import Final

from kvstream.errors import DecodeError, EncodeError

__all__ = [
    "CONFLUENT_HEADER_LEN",
    "CONFLUENT_MAGIC",
    "SINGLE_OBJECT_HEADER_LEN",
    "SINGLE_OBJECT_MAGIC",
    "confluent_header",
    "single_object_header",
    "split_confluent",
    "split_single_object",
]

SINGLE_OBJECT_MAGIC: Final = b"\xc3\x01"
SINGLE_OBJECT_HEADER_LEN: Final = 10
CONFLUENT_MAGIC: Final = b"\x00"
CONFLUENT_HEADER_LEN: Final = 5
_SCHEMA_ID_MAX: Final = 2**31 - 1


def single_object_header(fingerprint: bytes) -> bytes:
    """``C3 01`` + the 8-byte fingerprint."""
    if len(fingerprint) != 8:
        raise EncodeError(f"a CRC-64-AVRO fingerprint has 8 bytes, got {len(fingerprint)}")
    return SINGLE_OBJECT_MAGIC + fingerprint


def split_single_object(data: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
    """``(fingerprint, body)`` of a single-object encoded message.

    Raises DecodeError for data shorter than the 10-byte header or without the ``C3 01`` magic.
    """
    data = bytes(data)
    if len(data) < SINGLE_OBJECT_HEADER_LEN:
        raise DecodeError(
            f"single-object message too short: {len(data)} bytes, the header alone is "
            f"{SINGLE_OBJECT_HEADER_LEN}"
        )
    if data[:2] != SINGLE_OBJECT_MAGIC:
        raise DecodeError(
            f"not an Avro single-object message: starts with {data[:2].hex()}, expected c301"
        )
    return data[2:SINGLE_OBJECT_HEADER_LEN], data[SINGLE_OBJECT_HEADER_LEN:]


def confluent_header(schema_id: int) -> bytes:
    """``00`` + ``schema_id`` as 4 big-endian bytes; raises EncodeError outside 0..2**31-1."""
    if isinstance(schema_id, bool) or not isinstance(schema_id, int):
        raise EncodeError(f"schema id must be an int, got {type(schema_id).__name__}")
    if not 0 <= schema_id <= _SCHEMA_ID_MAX:
        raise EncodeError(f"schema id {schema_id} is outside 0..{_SCHEMA_ID_MAX}")
    return CONFLUENT_MAGIC + schema_id.to_bytes(4, "big")


def split_confluent(data: bytes | bytearray | memoryview) -> tuple[int, bytes]:
    """``(schema_id, body)`` of a Confluent wire-format message.

    Raises DecodeError for data shorter than the 5-byte header or a magic byte other than 0.
    """
    data = bytes(data)
    if len(data) < CONFLUENT_HEADER_LEN:
        raise DecodeError(
            f"Confluent message too short: {len(data)} bytes, the header alone is "
            f"{CONFLUENT_HEADER_LEN}"
        )
    if data[:1] != CONFLUENT_MAGIC:
        raise DecodeError(
            f"not a Confluent wire-format message: magic byte {data[0]:#04x}, expected 0x00"
        )
    return int.from_bytes(data[1:5], "big"), data[CONFLUENT_HEADER_LEN:]
