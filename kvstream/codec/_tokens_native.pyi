"""Type stub of the optional C extension ``kvstream.codec._tokens_native``
(``_tokens_native.c``).

The token encodings of schema v4 and the encoder's block gathering in C;
:mod:`kvstream.codec.tokens` (numpy) and :mod:`kvstream.codec.encoder` (``_gather_py``) hold
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

def gather_blocks(
    block_tuples: list[tuple[Any, ...]],
) -> tuple[bytes, list[bytes], list[int], bool, list[bool]] | None:
    """Per batch: all token ids, per event its hashes joined, per block its token count, whether
    the counts are all equal, per event whether its blocks set only block_hash/token_ids; None
    when a block is not as expected."""
