"""Multimodal content digests and the multimodal keys that hashers mix into blocks.

**Content digest** (TensorRT-LLM seed 003, ``apply_mm_hashes``): BLAKE3 over the serialized
item bytes, 32 bytes. With a ``uuid`` (a caller-chosen stable id for the item) the hashed bytes
are ``b"<uuid>" + uuid_utf8 + b"</uuid><content>" + data + b"</content>"``. The event model's
``mm_key.hash`` is this digest (TensorRT-LLM publishes it as 64 hex chars).

**Multimodal keys** (``mm_keys`` of ``BlockHasher.extend``/``chain``): a sequence, one entry
per item overlapping the block, each either a ``(hash, start_offset)`` pair or an object with
``.hash`` and ``.start_offset`` attributes (the event model's ``MmKey``). ``start_offset`` is
the offset, within the item, of the item's first token that falls in the block.
``hash`` is the 32-byte digest (or its 64-char hex); vLLM hashers also take any string
identifier (vLLM's ``mm_feature.identifier``). How each algorithm mixes the keys in is
documented in its module.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeAlias

from blake3 import blake3

from kvstream.errors import HashingError

__all__ = ["MmKeyLike", "NormMmKey", "content_digest", "digest32", "normalize_mm_keys"]

#: One multimodal key as callers pass it: ``(hash, start_offset)`` or an ``MmKey``-like object.
MmKeyLike: TypeAlias = "tuple[bytes | str, int] | Any"
#: A validated key: ``(hash as given (bytes, str, or an int where allowed), start_offset)``.
NormMmKey: TypeAlias = tuple[bytes | str | int, int]

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1
_I64_MIN = -(2**63)
_I64_MAX = 2**63 - 1


def content_digest(data: bytes | bytearray | memoryview, uuid: str | None = None) -> bytes:
    """The 32-byte BLAKE3 content digest of a multimodal item (TensorRT-LLM seed 003 rule).

    ``uuid`` None hashes ``data`` alone; otherwise the uuid framing of the module docstring is
    hashed, so the same bytes under two uuids give two digests. Raises HashingError for a
    non-bytes ``data`` or non-str ``uuid``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HashingError(f"content_digest needs bytes, got {type(data).__name__}")
    if uuid is None:
        return bytes(blake3(data).digest())
    if not isinstance(uuid, str):
        raise HashingError(f"content_digest uuid must be a str, got {type(uuid).__name__}")
    h = blake3(b"<uuid>")
    h.update(uuid.encode("utf-8"))
    h.update(b"</uuid><content>")
    h.update(data)
    h.update(b"</content>")
    return bytes(h.digest())


def digest32(value: object, where: str = "mm_key") -> bytes:
    """A multimodal key's hash as 32 raw bytes (accepts the bytes or their 64-char hex)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    elif isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise HashingError(f"{where}: hash {value!r} is not the hex of a 32-byte digest")
    else:
        raise HashingError(f"{where}: hash must be bytes or hex str, got {type(value).__name__}")
    if len(raw) != 32:
        raise HashingError(f"{where}: a content digest is 32 bytes, got {len(raw)}")
    return raw


def normalize_mm_keys(
    mm_keys: Iterable[Any] | None,
    where: str = "mm_keys",
    *,
    signed_offsets: bool = False,
    int_hashes: bool = False,
) -> tuple[NormMmKey, ...]:
    """Validate multimodal keys into ``((hash, start_offset), ...)``, preserving order.

    ``hash`` is kept as given (bytes-like become ``bytes``; str stays str; with ``int_hashes`` an
    int in ``0..2**64-1`` is accepted too) and checked by the algorithm. ``start_offset`` must be
    an int in ``0..2**32-1``, or, with ``signed_offsets`` (vLLM, whose offset is the item's start
    relative to the block and is negative for an item that began in an earlier block), in
    ``-2**63..2**63-1``. Raises HashingError.
    """
    if not mm_keys:
        return ()
    if isinstance(mm_keys, (bytes, bytearray, str)):
        raise HashingError(f"{where} must be a sequence of (hash, start_offset) keys")
    lo, hi = (_I64_MIN, _I64_MAX) if signed_offsets else (0, _U32_MAX)
    out: list[NormMmKey] = []
    for i, key in enumerate(mm_keys):
        if isinstance(key, (tuple, list)):
            if len(key) < 2:
                raise HashingError(f"{where}[{i}] must be (hash, start_offset), got {key!r}")
            h, off = key[0], key[1]
        elif hasattr(key, "hash") and hasattr(key, "start_offset"):
            h, off = key.hash, key.start_offset
        else:
            raise HashingError(
                f"{where}[{i}] must be (hash, start_offset) or have .hash/.start_offset, "
                f"got {type(key).__name__}"
            )
        if isinstance(h, (bytearray, memoryview)):
            h = bytes(h)
        if int_hashes and type(h) is int:
            if not 0 <= h <= _U64_MAX:
                raise HashingError(f"{where}[{i}]: an int hash must be in 0..2**64-1, got {h}")
        elif not isinstance(h, (bytes, str)):
            raise HashingError(f"{where}[{i}]: hash must be bytes or str, got {type(h).__name__}")
        if isinstance(off, bool) or not isinstance(off, int) or not lo <= off <= hi:
            raise HashingError(
                f"{where}[{i}]: start_offset must be an int in {lo}..{hi}, got {off!r}"
            )
        out.append((h, off))
    return tuple(out)
