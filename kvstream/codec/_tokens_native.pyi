"""Type stub of the optional C extension ``kvstream.codec._tokens_native``
(``_tokens_native.c``).

The token encodings of schema v4, and the model batch and column encoders in C;
:mod:`kvstream.codec.tokens` (numpy) and :mod:`kvstream.codec.encoder` (``_encode_py``) hold
the references, property-tested equal.
"""

from typing import Any

Buffer = bytes | bytearray | memoryview

def varint_encode(raw: Buffer, delta: bool) -> bytes:
    """Little-endian uint32 ids as LEB128 varints (``delta``: of the zig-zag differences)."""

def varint_decode(data: Buffer, count: int, delta: bool) -> bytes:
    """Exactly ``count`` canonical varints -> uint32 LE ids; ValueError otherwise."""

def varint_sizes(raw: Buffer) -> tuple[int, int, int]:
    """``(max_id, varint_bytes, delta_varint_bytes)`` of uint32 LE ids."""

def planes_encode(raw: Buffer) -> tuple[int, bytes, bytes]:
    """``(high_bits, low16, high_planes)``: the bit planes of uint32 LE ids."""

def body_setup(
    types: tuple[type, ...],
    attention: tuple[Any, Any],
    field_names: tuple[str, ...],
    block_defaults: tuple[Any, ...],
    frames: tuple[Any, ...],
    tails: tuple[bytes | None, ...],
    block_attrs: Any,
    encode_tokens: Any,
) -> None:
    """What ``encode_body`` needs: the model classes, constant byte runs and two helpers
    (``kvstream.codec.encoder._native_encode`` passes them)."""

def encode_body(
    prefix: bytes, batch: Any, events: tuple[Any, ...], version: int, token_encoding: str
) -> bytes | None:
    """A model batch's Avro body after ``prefix`` (``encoder._encode_py``), or None where a
    value is not as the models guarantee (the caller then runs the Python path)."""

def columns_setup(
    attention_values: tuple[str, str], default_hash_algo: str, v1_kinds: int, attr_fields: Any
) -> None:
    """What ``encode_columns`` needs: the AttentionKind values, schema v1's hash algorithm and
    kinds (a bit mask of kind codes), and the stored-attribute helper
    (``kvstream.codec.column_encoder._native_encode`` passes them)."""

def encode_columns(
    prefix: bytes, cols: Any, version: int, token_encoding: str, lossy: bool
) -> bytes | None:
    """Publisher columns' Avro body after ``prefix`` (``column_encoder._encode_columns_py``),
    or None where a value is not as the columns' contract says or the Python path would raise
    (the caller then runs the Python path)."""

def deferred_rows(
    records: list[Any],
    start: int,
    columns: tuple[list[Any], ...],
    raws: list[bytes],
    block_run: type,
    default_algo: str,
    default_group: int,
) -> int:
    """``deferred_columns``' loop over ``records[start:]`` for the records it reads straight
    (plain stored runs, non-empty removals), appended to the seven column lists and ``raws``;
    the index of the first record left to Python (nothing of it appended)."""
