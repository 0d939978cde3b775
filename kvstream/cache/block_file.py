"""The on-disk format of one KV block file: a fixed 96-byte header, then the payload.

The payload is the raw bytes of one block's K/V tensors, of any length. The header is
little-endian:

=======  ====  ===========================================================================
offset   size  field
=======  ====  ===========================================================================
0        4     magic ``b"KVSB"``
4        2     format version (u16) = 1
6        2     header size (u16) = 96
8        8     payload size in bytes (u64)
16       16    namespace (the store's key space, e.g. a model/layout digest)
32       1     block hash length (u8): 8 or 32
33       32    block hash, zero padded to 32 bytes
65       7     reserved, zero
72       16    payload checksum: ``xxhash.xxh3_128_digest(payload)``
88       8     header checksum: ``xxhash.xxh3_64_digest(header[0:88])``
=======  ====  ===========================================================================

A file is valid only if its size is exactly ``96 + payload size``: a truncated file or one
with trailing bytes is rejected before the payload is read. The header names its block and
namespace, so a file copied or renamed to another block's name is detected too.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

import xxhash

from kvstream.cache.errors import BlockBufferError, BlockFileError, BlockKeyError

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np
    from typing_extensions import Buffer

    # numpy's stubs declare ndarray.__buffer__ only for Python >= 3.12.
    BufferLike: TypeAlias = Buffer | np.ndarray[Any, Any]

__all__ = [
    "FORMAT_VERSION",
    "HASH_LENGTHS",
    "HEADER_SIZE",
    "MAGIC",
    "NAMESPACE_SIZE",
    "BlockHeader",
    "byte_view",
    "check_key",
    "encode_header",
    "parse_header",
    "payload_hasher",
    "verify_checksum",
    "verify_payload",
]

MAGIC: Final = b"KVSB"
FORMAT_VERSION: Final = 1
HEADER_SIZE: Final = 96
NAMESPACE_SIZE: Final = 16
HASH_LENGTHS: Final = (8, 32)

_MAX_HASH: Final = 32
# Everything the header checksum covers: magic .. payload checksum (88 bytes).
_BODY: Final = struct.Struct("<4sHHQ16sB32s7x16s")
_CHECKSUM_SIZE: Final = 8
assert _BODY.size + _CHECKSUM_SIZE == HEADER_SIZE


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """What a validated header says about its payload."""

    payload_size: int
    payload_checksum: bytes  # xxh3_128 digest, 16 bytes


def byte_view(buf: BufferLike) -> memoryview:
    """A flat unsigned-byte view of ``buf`` (bytes, bytearray, memoryview, numpy array...),
    without copying. Raises BlockBufferError (a TypeError) for a buffer that is not
    C-contiguous."""
    view = memoryview(cast("Buffer", buf))
    if view.ndim == 1 and view.format == "B":
        return view
    if not view.c_contiguous:
        raise BlockBufferError("block payload buffers must be C-contiguous")
    return view.cast("B")


def check_key(namespace: bytes, block_hash: bytes) -> None:
    """BlockKeyError unless ``namespace`` is 16 bytes and ``block_hash`` 8 or 32 (``bytes``)."""
    if not isinstance(namespace, bytes) or not isinstance(block_hash, bytes):
        raise BlockKeyError(
            "a block key is (namespace: bytes, block_hash: bytes), got "
            f"({type(namespace).__name__}, {type(block_hash).__name__})"
        )
    if len(namespace) != NAMESPACE_SIZE:
        raise BlockKeyError(f"namespace must be {NAMESPACE_SIZE} bytes, got {len(namespace)}")
    if len(block_hash) not in HASH_LENGTHS:
        raise BlockKeyError(f"block hash must be 8 or 32 bytes, got {len(block_hash)}")


def encode_header(
    *,
    namespace: bytes,
    block_hash: bytes,
    payload: BufferLike,
    checksum: bytes | None = None,
) -> bytes:
    """The 96-byte header of a block file holding ``payload``.

    ``payload`` is any C-contiguous buffer; its checksum is computed in place (no copy)
    unless ``checksum`` (a :func:`payload_hasher` digest of it) is given.
    Raises BlockKeyError (a ValueError) if ``namespace`` is not 16 bytes or ``block_hash``
    not 8 or 32.
    """
    check_key(namespace, block_hash)
    view = byte_view(payload)
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        view.nbytes,
        bytes(namespace),
        len(block_hash),
        bytes(block_hash).ljust(_MAX_HASH, b"\0"),
        xxhash.xxh3_128_digest(view) if checksum is None else checksum,
    )
    return body + xxhash.xxh3_64_digest(body)


def parse_header(raw: bytes, *, namespace: bytes, block_hash: bytes, file_size: int) -> BlockHeader:
    """Validate the header ``raw`` (the first bytes of a file of ``file_size`` bytes) of the
    block file expected to hold ``(namespace, block_hash)``.

    Raises :class:`~kvstream.cache.errors.BlockFileError` saying why when the header is
    short, has a bad magic, an unknown version or header size, a header checksum mismatch,
    names another namespace or block, or when ``file_size`` is not ``96 + payload size``
    (a truncated file or trailing bytes). The payload itself is checked by
    :func:`verify_payload`.
    """
    if len(raw) < HEADER_SIZE:
        raise BlockFileError(f"short header: {len(raw)} of {HEADER_SIZE} bytes")
    raw = bytes(raw[:HEADER_SIZE])
    magic, version, header_size, payload_size, ns, hash_len, padded_hash, checksum = (
        _BODY.unpack_from(raw)
    )
    if magic != MAGIC:
        raise BlockFileError(f"bad magic {magic!r} (not a kvstream block file)")
    if version != FORMAT_VERSION:
        raise BlockFileError(f"unknown block file format version {version}")
    if header_size != HEADER_SIZE:
        raise BlockFileError(f"unknown header size {header_size}")
    if xxhash.xxh3_64_digest(raw[: _BODY.size]) != raw[_BODY.size :]:
        raise BlockFileError("header checksum mismatch")
    if ns != namespace:
        raise BlockFileError(f"namespace differs: file has {ns.hex()}, asked for {namespace.hex()}")
    if hash_len not in HASH_LENGTHS:
        raise BlockFileError(f"bad block hash length {hash_len}")
    found = padded_hash[:hash_len]
    if found != block_hash:
        raise BlockFileError(
            f"block hash differs: file has {found.hex()}, asked for {block_hash.hex()}"
        )
    if file_size != HEADER_SIZE + payload_size:
        kind = "truncated" if file_size < HEADER_SIZE + payload_size else "trailing bytes"
        raise BlockFileError(
            f"file size {file_size} != {HEADER_SIZE} + payload size {payload_size} ({kind})"
        )
    return BlockHeader(payload_size=payload_size, payload_checksum=checksum)


def verify_payload(payload: BufferLike, header: BlockHeader) -> None:
    """Check ``payload`` against ``header``'s size and checksum, hashing it in place.

    Raises :class:`~kvstream.cache.errors.BlockFileError` on a mismatch.
    """
    view = byte_view(payload)
    if view.nbytes != header.payload_size:
        raise BlockFileError(f"payload is {view.nbytes} bytes, header says {header.payload_size}")
    verify_checksum(xxhash.xxh3_128_digest(view), header)


def payload_hasher() -> xxhash.xxh3_128:
    """A streaming hasher for a payload read in pieces: ``update()`` it with every piece in
    order; its ``digest()`` is then the payload checksum (XXH3 streaming and one-shot agree)."""
    return xxhash.xxh3_128()


def verify_checksum(digest: bytes, header: BlockHeader) -> None:
    """Check a payload checksum computed by the caller (see :func:`payload_hasher`).

    Raises :class:`~kvstream.cache.errors.BlockFileError` on a mismatch.
    """
    if digest != header.payload_checksum:
        raise BlockFileError("payload checksum mismatch")
